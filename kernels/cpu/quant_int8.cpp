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
void dot_packed(dtype w_type, const unsigned char* w, const int8_rows& x, float* y,
                int64_t ldy, int64_t begin, int64_t end, bool accumulate);
}
#endif

void int8_rows::quantize(const float* x, int64_t rows, int64_t cols, int64_t block_size) {
  m = rows;
  k = cols;
  block = block_size;
  const int64_t blocks = rows * cols / block;
  q.resize(static_cast<size_t>(rows * cols));
  scale.resize(static_cast<size_t>(blocks));
  sums.resize(static_cast<size_t>(rows * cols / 16));
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + block * b;
    float most = 0.0f;
    for (int64_t i = 0; i < block; ++i)
      most = std::max(most, std::fabs(xb[i]));
    float inverse = most > 0.0f ? 127.0f / most : 0.0f;
    scale[b] = most / 127.0f;
    int8_t* qb = q.data() + block * b;
    for (int64_t i = 0; i < block; ++i)
      qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inverse));
  }
  for (size_t h = 0; h < sums.size(); ++h) {
    int sum = 0;
    for (size_t i = 16 * h; i < 16 * h + 16; ++i)
      sum += q[i];
    sums[h] = static_cast<int16_t>(sum);
  }
}

int64_t int8_block(dtype w_type) {
  return is_k_quant(w_type) ? 256 : 32;
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

/// Row `row` of the rounded activations against one row of weights, block by block: the
/// products are summed as integers, then scaled (per block of 32: by the weight block's
/// and the activation block's scales; per k-quant sub-block: by its integer scale, then
/// per super-block by the float ones).
float reference_dot(dtype t, const unsigned char* w, const int8_rows& x, int64_t row) {
  const int8_t* xq = x.q.data() + row * x.k;
  const float* scale = x.scale.data() + row * (x.k / x.block);
  const int16_t* sums = x.sums.data() + row * (x.k / 16);
  float total = 0.0f;
  if (t == dtype::q8_0 || t == dtype::q4_0) {
    const int64_t bytes = t == dtype::q8_0 ? 34 : 18;
    for (int64_t b = 0; b < x.k / 32; ++b) {
      const unsigned char* block = w + b * bytes;
      int32_t dot = 0;
      for (int i = 0; i < 32; ++i) {
        int wi = t == dtype::q8_0 ? static_cast<int8_t>(block[2 + i])
                                  : (i < 16 ? block[2 + i] & 0x0f : block[2 + i - 16] >> 4);
        dot += wi * xq[32 * b + i];
      }
      if (t == dtype::q4_0) // the centre: -8 for every element
        dot -= 8 * (sums[2 * b] + sums[2 * b + 1]);
      total += load_half(block) * scale[b] * static_cast<float>(dot);
    }
    return total;
  }
  for (int64_t s = 0; s < x.k / 256; ++s) {
    const int8_t* xs = xq + 256 * s;
    const int16_t* sum16 = sums + 16 * s;
    int32_t dot = 0;
    if (t == dtype::q4_k) {
      const unsigned char* block = w + s * 144;
      int32_t minimums = 0;
      for (int j = 0; j < 8; ++j) {
        int sc = 0, mn = 0;
        k_scale_min(block + 4, j, &sc, &mn);
        const unsigned char* qs = block + 16 + 32 * (j / 2);
        int32_t part = 0;
        for (int l = 0; l < 32; ++l)
          part += (j % 2 == 0 ? qs[l] & 0x0f : qs[l] >> 4) * xs[32 * j + l];
        dot += sc * part;
        minimums += mn * (sum16[2 * j] + sum16[2 * j + 1]);
      }
      total += scale[s] * (load_half(block) * static_cast<float>(dot) -
                           load_half(block + 2) * static_cast<float>(minimums));
    } else { // Q6_K
      const unsigned char* block = w + s * 210;
      auto scales = reinterpret_cast<const int8_t*>(block + 192);
      for (int sub = 0; sub < 16; ++sub) {
        int h = sub / 8, k = (sub % 8) / 2, first = 16 * (sub % 2);
        int32_t part = 0;
        for (int l = first; l < first + 16; ++l) {
          unsigned char low = block[64 * h + l + 32 * (k % 2)];
          int q = (k < 2 ? low & 0x0f : low >> 4) | (((block[128 + 32 * h + l] >> (2 * k)) & 3) << 4);
          part += q * xs[128 * h + 32 * k + l];
        }
        dot += scales[sub] * (part - 32 * sum16[sub]);
      }
      total += scale[s] * load_half(block + 208) * static_cast<float>(dot);
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

namespace {

void check_packable(dtype t, int64_t rows, int64_t cols) {
  if (t != dtype::q4_k)
    throw error{errc::unsupported, std::string{"no packed layout for "} + dtype_name(t)};
  if (rows % packed_rows != 0 || cols % 256 != 0)
    throw error{errc::invalid_argument, "a packed Q4_K matrix has rows in groups of 16 and "
                                        "columns in super-blocks of 256, not " +
                                          std::to_string(rows) + " x " + std::to_string(cols)};
}

constexpr size_t q4_k_bytes = 144;
constexpr size_t group_block = packed_rows * q4_k_bytes;

/// Moves the bytes of each group of 16 rows between the stored and the packed layouts (see
/// quant_int8.hpp), in the units they move in: d and dmin 2 bytes, the rest 4.
void regroup(const void* src, void* dst, int64_t rows, int64_t cols, bool to_packed) {
  const size_t blocks = static_cast<size_t>(cols) / 256;
  const size_t stride = blocks * q4_k_bytes;
  const size_t group = packed_rows * stride;
  for (int64_t g = 0; g < rows / packed_rows; ++g) {
    auto from = static_cast<const unsigned char*>(src) + static_cast<size_t>(g) * group;
    auto to = static_cast<unsigned char*>(dst) + static_cast<size_t>(g) * group;
    for (size_t i = 0; i < packed_rows; ++i)
      for (size_t s = 0; s < blocks; ++s) {
        size_t stored = i * stride + s * q4_k_bytes;
        size_t packed = s * group_block;
        auto move = [&](size_t at_stored, size_t at_packed, size_t n) {
          if (to_packed)
            std::memcpy(to + packed + at_packed, from + stored + at_stored, n);
          else
            std::memcpy(to + stored + at_stored, from + packed + at_packed, n);
        };
        move(0, 2 * i, 2);
        move(2, 32 + 2 * i, 2);
        for (size_t word = 0; word < 3; ++word)
          move(4 + 4 * word, 64 + 64 * word + 4 * i, 4);
        for (size_t q = 0; q < 32; ++q)
          move(16 + 4 * q, 256 + 64 * q + 4 * i, 4);
      }
  }
}

} // namespace

bool has_packed_layout(dtype w_type) {
  return w_type == dtype::q4_k && cpu_has_vnni();
}

void pack_rows(dtype w_type, const void* src, void* dst, int64_t rows, int64_t cols) {
  check_packable(w_type, rows, cols);
  regroup(src, dst, rows, cols, true);
}

void unpack_rows(dtype w_type, const void* src, void* dst, int64_t rows, int64_t cols) {
  check_packable(w_type, rows, cols);
  regroup(src, dst, rows, cols, false);
}

void dot_packed_int8(dtype w_type, const void* w, const int8_rows& x, float* y, int64_t ldy,
                     int64_t begin, int64_t end, bool accumulate) {
  if (!has_packed_layout(w_type))
    throw error{errc::unsupported, std::string{"no packed kernel for "} + dtype_name(w_type)};
  if (begin % packed_rows != 0 || end % packed_rows != 0)
    throw error{errc::invalid_argument, "packed rows go in groups of 16, not [" +
                                          std::to_string(begin) + ", " + std::to_string(end) + ")"};
#if TROUPE_X86_KERNELS
  vnni::dot_packed(w_type, static_cast<const unsigned char*>(w), x, y, ldy, begin, end,
                   accumulate);
#else
  (void)w;
  (void)x;
  (void)y;
  (void)ldy;
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
