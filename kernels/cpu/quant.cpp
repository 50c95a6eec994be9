#include "kernels/cpu/quant.hpp"

#include "kernels/cpu/ops.hpp"
#include "kernels/sampler.hpp"

#include "troupe/errors.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if TROUPE_X86_KERNELS
#include <cpuid.h>
#endif

namespace troupe::cpu {

#if TROUPE_X86_KERNELS
#define TROUPE_DECLARE_ISA(ns)                                                                     \
  namespace ns {                                                                                   \
  void dot_rows_quantized(int kind, const unsigned char* w, int64_t blocks, const float* x,        \
                          const float* xsums, const float* halves, int64_t m, float* y,            \
                          int64_t ldy, int64_t begin, int64_t end, bool accumulate);               \
  void dot_rows_half(bool bf16, const uint16_t* w, const float* x, int64_t m, int64_t k, float* y, \
                     int64_t ldy, int64_t begin, int64_t end, bool accumulate);                    \
  void attend(const float* query, int64_t head_dim, int64_t heads, int64_t len, float scale,       \
              const float* keys, const float* values, const int64_t* offsets, float* scores,       \
              float* out, float softcap);                                                          \
  bool attend_tokens(const float* query, int64_t stride, int64_t head_dim, int64_t heads,          \
                     int64_t tokens, const int64_t* first, const int64_t* end, int64_t len,        \
                     float scale, const float* keys, const float* values, const int64_t* offsets,  \
                     float* out, float softcap);                                                   \
  void silu_mul(const float* gate, const float* up, float* out, int64_t n);                        \
  float log_partition(const float* x, int64_t n);                                                  \
  }
TROUPE_DECLARE_ISA(avx2)
TROUPE_DECLARE_ISA(avx512)
#undef TROUPE_DECLARE_ISA
#endif

namespace {

/// 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1, 5 Q4_K, 6 Q5_K, 7 Q6_K: the kernels' names for
/// the block formats.
int kind_of(dtype t) {
  switch (t) {
  case dtype::q8_0:
    return 0;
  case dtype::q4_0:
    return 1;
  case dtype::q4_1:
    return 2;
  case dtype::q5_0:
    return 3;
  case dtype::q5_1:
    return 4;
  case dtype::q4_k:
    return 5;
  case dtype::q5_k:
    return 6;
  case dtype::q6_k:
    return 7;
  default:
    throw error{errc::unsupported, std::string{"no block-format kernel for "} + dtype_name(t)};
  }
}

/// The portable kernel: each block unpacked, then summed as the SIMD kernels sum it
/// (d · Σ q·x, plus the shift times Σ x; a k-quant's super-block dequantized, then Σ w·x).
float portable_dot(dtype t, const unsigned char* w, int64_t blocks, const float* x,
                   const float* xsums) {
  const auto bytes = static_cast<int64_t>(block_bytes(t));
  float total = 0.0f;
  if (is_k_quant(t)) {
    float wv[256];
    for (int64_t b = 0; b < blocks / 8; ++b) {
      to_float(t, w + b * bytes, wv, 256);
      float dot = 0.0f;
      for (int i = 0; i < 256; ++i)
        dot += wv[i] * x[b * 256 + i];
      total += dot;
    }
    return total;
  }
  float corr = 0.0f;
  float q[32];
  for (int64_t b = 0; b < blocks; ++b) {
    float shift = 0.0f;
    float d = unpack_block(t, w + b * bytes, q, &shift);
    float dot = 0.0f;
    for (int i = 0; i < 32; ++i)
      dot += q[i] * x[b * 32 + i];
    total += dot * d;
    corr += shift * xsums[b];
  }
  return total + corr;
}

/// Every float16 value as a float, for the kernels' scales.
const float* half_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h)
      t[h] = half_to_float(static_cast<uint16_t>(h));
    return t;
  }();
  return table.data();
}

float widen(bool bf16, uint16_t h) {
  return bf16 ? bf16_to_float(h) : half_to_float(h);
}

isa detect() {
#if TROUPE_X86_KERNELS
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    return isa::portable;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_F16C))
    return isa::portable;
  // libgcc checks that the OS saves the AVX-512 state before it says avx512f.
  return __builtin_cpu_supports("avx512f") ? isa::avx512 : isa::avx2;
#else
  return isa::portable;
#endif
}

} // namespace

isa best_isa() {
  static const isa chosen = [] {
    auto best = detect();
    if (const char* asked = std::getenv("TROUPE_CPU_ISA")) {
      for (auto i : {isa::portable, isa::avx2, isa::avx512})
        if (std::string{asked} == isa_name(i) && i <= best)
          return i;
    }
    return best;
  }();
  return chosen;
}

const char* isa_name(isa i) {
  switch (i) {
  case isa::portable:
    return "portable";
  case isa::avx2:
    return "avx2";
  case isa::avx512:
    return "avx512";
  }
  return "?";
}

void block_sums(const float* x, int64_t rows, int64_t k, float* sums) {
  for (int64_t b = 0; b < rows * (k / 32); ++b) {
    float total = 0.0f;
    for (int i = 0; i < 32; ++i)
      total += x[b * 32 + i];
    sums[b] = total;
  }
}

void dot_rows_quantized(isa i, dtype w_type, const void* w, const float* x, const float* xsums,
                        int64_t m, int64_t k, float* y, int64_t ldy, int64_t begin, int64_t end,
                        bool accumulate) {
  const int kind = kind_of(w_type);
  const int64_t blocks = k / 32;
  auto bytes = static_cast<const unsigned char*>(w);
#if TROUPE_X86_KERNELS
  if (i == isa::avx512)
    return avx512::dot_rows_quantized(kind, bytes, blocks, x, xsums, half_table(), m, y, ldy, begin,
                                      end, accumulate);
  if (i == isa::avx2)
    return avx2::dot_rows_quantized(kind, bytes, blocks, x, xsums, half_table(), m, y, ldy, begin,
                                    end, accumulate);
#else
  (void)kind;
#endif
  const auto stride = static_cast<int64_t>(storage_bytes(w_type, static_cast<size_t>(k)));
  for (int64_t row = begin; row < end; ++row)
    for (int64_t r = 0; r < m; ++r) {
      float v = portable_dot(w_type, bytes + row * stride, blocks, x + r * k, xsums + r * blocks);
      float& dst = y[r * ldy + row];
      dst = accumulate ? dst + v : v;
    }
}

void dot_rows_half(isa i, dtype w_type, const void* w, const float* x, int64_t m, int64_t k,
                   float* y, int64_t ldy, int64_t begin, int64_t end, bool accumulate) {
  if (w_type != dtype::f16 && w_type != dtype::bf16)
    throw error{errc::unsupported, std::string{"no 16-bit kernel for "} + dtype_name(w_type)};
  const bool bf16 = w_type == dtype::bf16;
  auto half = static_cast<const uint16_t*>(w);
#if TROUPE_X86_KERNELS
  if (i == isa::avx512)
    return avx512::dot_rows_half(bf16, half, x, m, k, y, ldy, begin, end, accumulate);
  if (i == isa::avx2)
    return avx2::dot_rows_half(bf16, half, x, m, k, y, ldy, begin, end, accumulate);
#endif
  for (int64_t row = begin; row < end; ++row)
    for (int64_t r = 0; r < m; ++r) {
      float v = 0.0f;
      for (int64_t j = 0; j < k; ++j)
        v += widen(bf16, half[row * k + j]) * x[r * k + j];
      float& dst = y[r * ldy + row];
      dst = accumulate ? dst + v : v;
    }
}

void attend(isa i, const float* query, int64_t head_dim, int64_t heads, int64_t len, float scale,
            const float* keys, const float* values, const int64_t* offsets, float* scores,
            float* out, float softcap) {
#if TROUPE_X86_KERNELS
  if (i == isa::avx512)
    return avx512::attend(query, head_dim, heads, len, scale, keys, values, offsets, scores, out,
                          softcap);
  if (i == isa::avx2)
    return avx2::attend(query, head_dim, heads, len, scale, keys, values, offsets, scores, out,
                        softcap);
#else
  (void)i;
#endif
  for (int64_t g = 0; g < heads; ++g)
    cpu::attend(
      query + g * head_dim, head_dim, len, scale, [&](int64_t p) { return keys + offsets[p]; },
      [&](int64_t p) { return values + offsets[p]; }, scores + g * len, out + g * head_dim,
      softcap);
}

void attend_tokens(isa i, const float* query, int64_t stride, int64_t head_dim, int64_t heads,
                   int64_t tokens, const int64_t* first, const int64_t* end, int64_t len,
                   float scale, const float* keys, const float* values, const int64_t* offsets,
                   float* out, float softcap) {
#if TROUPE_X86_KERNELS
  // A single token (a decode step's) too, up to 2,048 positions: sixteen positions' keys
  // loaded at once for the transposition keep more reads in flight than a position at a
  // time, and its scores need no sum across a vector. Past that, `attend`'s prefetches keep
  // up better with a context streamed from memory (the two give the same bits).
  constexpr int64_t tiled_decode_positions = 2048;
  if ((tokens > 1 || len <= tiled_decode_positions) &&
      ((i == isa::avx512 &&
        avx512::attend_tokens(query, stride, head_dim, heads, tokens, first, end, len, scale, keys,
                              values, offsets, out, softcap)) ||
       (i == isa::avx2 && avx2::attend_tokens(query, stride, head_dim, heads, tokens, first, end,
                                              len, scale, keys, values, offsets, out, softcap))))
    return;
#endif
  // A token at a time, its heads together.
  thread_local std::vector<float> scores;
  for (int64_t t = 0; t < tokens; ++t) {
    scores.resize(static_cast<size_t>(heads * (end[t] - first[t])));
    attend(i, query + t * stride, head_dim, heads, end[t] - first[t], scale, keys, values,
           offsets + first[t], scores.data(), out + t * stride, softcap);
  }
}

float log_partition(isa i, const float* logits, int64_t n) {
#if TROUPE_X86_KERNELS
  if (i == isa::avx512)
    return avx512::log_partition(logits, n);
  if (i == isa::avx2)
    return avx2::log_partition(logits, n);
#else
  (void)i;
#endif
  return troupe::log_partition(logits, n);
}

void silu_mul(isa i, const float* gate, const float* up, float* out, int64_t n) {
#if TROUPE_X86_KERNELS
  if (i == isa::avx512)
    return avx512::silu_mul(gate, up, out, n);
  if (i == isa::avx2)
    return avx2::silu_mul(gate, up, out, n);
#else
  (void)i;
#endif
  cpu::silu_mul(gate, up, out, n);
}

} // namespace troupe::cpu
