#include "kernels/cpu/quant_int8.hpp"

#include "troupe/errors.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace troupe::cpu {

#if TROUPE_X86_KERNELS
namespace vnni {
void dot_rows(dtype w_type, const unsigned char* w, const int8_rows& x, float* y, int64_t ldy,
              int64_t begin, int64_t end, bool accumulate);
}
#endif

void int8_rows::quantize(const float* x, int64_t rows, int64_t cols) {
  m = rows;
  k = cols;
  const int64_t blocks = rows * cols / 32;
  q.resize(static_cast<size_t>(rows * cols));
  scale.resize(static_cast<size_t>(blocks));
  sum32.resize(static_cast<size_t>(blocks));
  sum16.resize(static_cast<size_t>(2 * blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + 32 * b;
    float most = 0.0f;
    for (int i = 0; i < 32; ++i)
      most = std::max(most, std::fabs(xb[i]));
    float d = most / 127.0f;
    float inverse = most > 0.0f ? 127.0f / most : 0.0f;
    int8_t* qb = q.data() + 32 * b;
    int halves[2] = {0, 0};
    for (int i = 0; i < 32; ++i) {
      qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inverse));
      halves[i / 16] += qb[i];
    }
    scale[b] = d;
    sum16[2 * b] = d * static_cast<float>(halves[0]);
    sum16[2 * b + 1] = d * static_cast<float>(halves[1]);
    sum32[b] = d * static_cast<float>(halves[0] + halves[1]);
  }
}

namespace {

bool cpu_has_vnni() {
#if TROUPE_X86_KERNELS
  static const bool has = [] {
    __builtin_cpu_init();
    return best_isa() == isa::avx512 && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return has;
#else
  return false;
#endif
}

bool int8_format(dtype t) {
  return t == dtype::q8_0 || t == dtype::q4_0 || t == dtype::q4_k || t == dtype::q6_k;
}

[[noreturn]] void no_kernel(dtype t) {
  throw error{errc::unsupported, std::string{"no 8-bit integer kernel for "} + dtype_name(t)};
}

/// Block b of row r of the weights (32 elements; a k-quant super-block holds 8) against
/// the same block of the rounded activations of row `row`: the sums are integers, each
/// scaled once.
float reference_dot(dtype t, const unsigned char* w, const int8_rows& x, int64_t row) {
  const int64_t blocks = x.k / 32;
  const int8_t* xq = x.q.data() + row * x.k;
  const float* scale = x.scale.data() + row * blocks;
  const float* sum32 = x.sum32.data() + row * blocks;
  const float* sum16 = x.sum16.data() + row * 2 * blocks;
  float total = 0.0f;
  if (t == dtype::q8_0 || t == dtype::q4_0) {
    const int64_t bytes = t == dtype::q8_0 ? 34 : 18;
    for (int64_t b = 0; b < blocks; ++b) {
      const unsigned char* block = w + b * bytes;
      float d = load_half(block);
      int32_t dot = 0;
      for (int i = 0; i < 32; ++i) {
        int wi = t == dtype::q8_0 ? static_cast<int8_t>(block[2 + i])
                                  : (i < 16 ? block[2 + i] & 0x0f : block[2 + i - 16] >> 4);
        dot += wi * xq[32 * b + i];
      }
      total += d * scale[b] * static_cast<float>(dot);
      if (t == dtype::q4_0)
        total -= 8.0f * d * sum32[b];
    }
    return total;
  }
  for (int64_t s = 0; s < blocks / 8; ++s) {
    if (t == dtype::q4_k) {
      const unsigned char* block = w + s * 144;
      float d = load_half(block);
      float dmin = load_half(block + 2);
      for (int j = 0; j < 8; ++j) {
        int sc = 0, mn = 0;
        k_scale_min(block + 4, j, &sc, &mn);
        const unsigned char* qs = block + 16 + 32 * (j / 2);
        int64_t b = 8 * s + j;
        int32_t dot = 0;
        for (int l = 0; l < 32; ++l)
          dot += (j % 2 == 0 ? qs[l] & 0x0f : qs[l] >> 4) * xq[32 * b + l];
        total += d * static_cast<float>(sc) * scale[b] * static_cast<float>(dot) -
                 dmin * static_cast<float>(mn) * sum32[b];
      }
    } else { // Q6_K
      const unsigned char* block = w + s * 210;
      float d = load_half(block + 208);
      auto scales = reinterpret_cast<const int8_t*>(block + 192);
      for (int sub = 0; sub < 16; ++sub) {
        int h = sub / 8, k = (sub % 8) / 2, first = 16 * (sub % 2);
        int64_t b = 8 * s + sub / 2;
        int32_t dot = 0;
        for (int l = first; l < first + 16; ++l) {
          unsigned char low = block[64 * h + l + 32 * (k % 2)];
          int q = (k < 2 ? low & 0x0f : low >> 4) | (((block[128 + 32 * h + l] >> (2 * k)) & 3) << 4);
          dot += q * xq[32 * b + l];
        }
        total += d * static_cast<float>(scales[sub]) *
                 (scale[b] * static_cast<float>(dot) - 32.0f * sum16[16 * s + sub]);
      }
    }
  }
  return total;
}

} // namespace

bool has_int8_kernel(dtype w_type) {
  return int8_format(w_type) && cpu_has_vnni();
}

void dot_rows_int8(dtype w_type, const void* w, const int8_rows& x, float* y, int64_t ldy,
                   int64_t begin, int64_t end, bool accumulate) {
  if (!has_int8_kernel(w_type))
    no_kernel(w_type);
#if TROUPE_X86_KERNELS
  vnni::dot_rows(w_type, static_cast<const unsigned char*>(w), x, y, ldy, begin, end,
                 accumulate);
#else
  (void)w;
  (void)x;
  (void)y;
  (void)ldy;
  (void)begin;
  (void)end;
  (void)accumulate;
#endif
}

void dot_rows_int8_reference(dtype w_type, const void* w, const int8_rows& x, float* y,
                             int64_t ldy, int64_t begin, int64_t end, bool accumulate) {
  if (!int8_format(w_type))
    no_kernel(w_type);
  const auto stride = static_cast<int64_t>(storage_bytes(w_type, static_cast<size_t>(x.k)));
  auto bytes = static_cast<const unsigned char*>(w);
  for (int64_t i = begin; i < end; ++i)
    for (int64_t r = 0; r < x.m; ++r) {
      float v = reference_dot(w_type, bytes + i * stride, x, r);
      float& dst = y[r * ldy + i];
      dst = accumulate ? dst + v : v;
    }
}

} // namespace troupe::cpu
