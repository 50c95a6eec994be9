// The integer kernels of kernels/cpu/quant_int8.hpp with AVX-512 VNNI (built with AVX-512
// F, BW, VL, DQ and VNNI enabled; called only where the CPU has them). A 512-bit vector
// holds 64 weights of two activation blocks; `vpdpbusd` sums its products four at a time
// into 16 integer lanes (lanes 0-7 the first block, 8-15 the second), which are scaled
// as floats by the lanes' block (and sub-block) scales. Weights go in unsigned (nibbles,
// 6-bit values; Q8_0's magnitudes, its signs moved onto the activations), activations
// signed; what an offset adds (Q4_0's 8, Q4_K's minimum, Q6_K's 32) comes from the
// activations' block sums. Several activation rows share each weight vector.

#include "kernels/cpu/quant_int8.hpp"

#include <immintrin.h>

#include <cstring>

namespace troupe::cpu::vnni {

namespace {

/// Every float16 value as a float: a scale is a load.
const float* halves() {
  static const float* table = [] {
    static float t[65536];
    for (uint32_t h = 0; h < 65536; ++h)
      t[h] = half_to_float(static_cast<uint16_t>(h));
    return t;
  }();
  return table;
}

inline float half_at(const unsigned char* p, const float* table) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return table[h];
}

/// Lanes 0-7 `a`, 8-15 `b`.
inline __m512 two(float a, float b) {
  return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

inline __m512i load512(const void* p) {
  return _mm512_loadu_si512(p);
}

inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

inline __m512i dot(__m512i w, __m512i x) {
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
}

/// The 6-bit scales (bytes 0-7) and minimums (bytes 8-15) of a Q4_K super-block's eight
/// sub-blocks, from its 12 bytes of them (kernels/dtype.hpp's `k_scale_min`, four at a
/// time in 32-bit words: in registers, where eight stores and a vector load would wait on
/// store forwarding).
inline __m128i k_scales_mins(const unsigned char* p) {
  uint32_t w[3];
  std::memcpy(w, p, sizeof w);
  uint32_t scales_low = w[0] & 0x3f3f3f3fu;
  uint32_t mins_low = w[1] & 0x3f3f3f3fu;
  uint32_t scales_high = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
  uint32_t mins_high = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
  return _mm_set_epi32(static_cast<int>(mins_high), static_cast<int>(mins_low),
                       static_cast<int>(scales_high), static_cast<int>(scales_low));
}

/// Where the activations of rows [row, row + R) are.
struct rows_at {
  const int8_rows& x;
  int64_t row;
  int64_t blocks; // of 32 in a row

  const int8_t* q(int r, int64_t block) const {
    return x.q.data() + (row + r) * x.k + 32 * block;
  }
  const float* scale(int r, int64_t block) const {
    return x.scale.data() + (row + r) * blocks + block;
  }
  const float* sum32(int r, int64_t block) const {
    return x.sum32.data() + (row + r) * blocks + block;
  }
  const float* sum16(int r, int64_t half) const {
    return x.sum16.data() + (row + r) * 2 * blocks + half;
  }
};

// One weight row against R activation rows each: out[r].

template <int R>
void q8_0(const unsigned char* w, const rows_at& a, float* out) {
  const float* table = halves();
  __m512 acc[R];
  for (int r = 0; r < R; ++r)
    acc[r] = _mm512_setzero_ps();
  float tail[R] = {};
  int64_t b = 0;
  for (; b + 2 <= a.blocks; b += 2) {
    const unsigned char* b0 = w + 34 * b;
    const unsigned char* b1 = b0 + 34;
    if constexpr (R == 1)
      _mm_prefetch(reinterpret_cast<const char*>(b0) + 1024, _MM_HINT_T0);
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(load256(b0 + 2)), load256(b1 + 2), 1);
    __mmask64 negative = _mm512_movepi8_mask(v);
    __m512i magnitude = _mm512_abs_epi8(v);
    float d0 = half_at(b0, table), d1 = half_at(b1, table);
    for (int r = 0; r < R; ++r) {
      __m512i x = load512(a.q(r, b));
      x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
      const float* s = a.scale(r, b);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(magnitude, x)), two(d0 * s[0], d1 * s[1]),
                               acc[r]);
    }
  }
  for (; b < a.blocks; ++b) { // an odd last block
    const unsigned char* block = w + 34 * b;
    float d = half_at(block, table);
    for (int r = 0; r < R; ++r) {
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i)
        sum += static_cast<int8_t>(block[2 + i]) * a.q(r, b)[i];
      tail[r] += d * *a.scale(r, b) * static_cast<float>(sum);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(acc[r]) + tail[r];
}

template <int R>
void q4_0(const unsigned char* w, const rows_at& a, float* out) {
  const float* table = halves();
  const __m256i mask = _mm256_set1_epi8(0x0f);
  __m512 acc[R];
  float shift[R] = {};
  for (int r = 0; r < R; ++r)
    acc[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= a.blocks; b += 2) {
    const unsigned char* b0 = w + 18 * b;
    const unsigned char* b1 = b0 + 18;
    if constexpr (R == 1)
      _mm_prefetch(reinterpret_cast<const char*>(b0) + 1024, _MM_HINT_T0);
    __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 2))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + 2)), 1);
    // [low 0, low 1, high 0, high 1] in 16-byte lanes, then block 0's before block 1's.
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, mask)),
                                   _mm256_and_si256(_mm256_srli_epi16(v, 4), mask), 1);
    q = _mm512_shuffle_i64x2(q, q, _MM_SHUFFLE(3, 1, 2, 0));
    float d0 = half_at(b0, table), d1 = half_at(b1, table);
    for (int r = 0; r < R; ++r) {
      const float* s = a.scale(r, b);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(q, load512(a.q(r, b)))),
                               two(d0 * s[0], d1 * s[1]), acc[r]);
      const float* sums = a.sum32(r, b);
      shift[r] += d0 * sums[0] + d1 * sums[1];
    }
  }
  for (; b < a.blocks; ++b) {
    const unsigned char* block = w + 18 * b;
    float d = half_at(block, table);
    for (int r = 0; r < R; ++r) {
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i)
        sum += (i < 16 ? block[2 + i] & 0x0f : block[2 + i - 16] >> 4) * a.q(r, b)[i];
      acc[r] = _mm512_add_ps(acc[r], _mm512_set_ps(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                   d * *a.scale(r, b) * static_cast<float>(sum)));
      shift[r] += d * *a.sum32(r, b);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(acc[r]) - 8.0f * shift[r];
}

/// Lane l of a Q4_K product (chunk c: elements 64c ...) belongs to sub-block 2c + l / 8.
alignas(64) const int32_t q4k_lanes[4][16] = {
  {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
  {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
  {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
  {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
};

template <int R>
void q4_k(const unsigned char* w, const rows_at& a, float* out) {
  const float* table = halves();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512i lanes[4];
  for (int c = 0; c < 4; ++c)
    lanes[c] = _mm512_load_si512(q4k_lanes[c]);
  __m512 acc[R];
  __m256 mins[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    mins[r] = _mm256_setzero_ps();
  }
  for (int64_t s = 0; s < a.blocks / 8; ++s) {
    const unsigned char* block = w + 144 * s;
    if constexpr (R == 1)
      _mm_prefetch(reinterpret_cast<const char*>(block) + 1024, _MM_HINT_T0);
    __m128i packed = k_scales_mins(block + 4);
    __m256 scales = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed)),
                                  _mm256_set1_ps(half_at(block, table)));
    __m256 minimums = _mm256_mul_ps(
      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))),
      _mm256_set1_ps(half_at(block + 2, table)));
    // Chunk c: the low nibbles of its 32 bytes (sub-block 2c), then the high ones (2c + 1);
    // two chunks from one load.
    __m512i q[4];
    for (int c = 0; c < 4; c += 2) {
      __m512i v = load512(block + 16 + 32 * c);
      __m512i low = _mm512_and_si512(v, low4);
      __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      q[c] = _mm512_shuffle_i64x2(low, high, 0x44);
      q[c + 1] = _mm512_shuffle_i64x2(low, high, 0xee);
    }
    for (int r = 0; r < R; ++r) {
      // d · scale of each sub-block · its activation block's scale.
      __m512 t = _mm512_castps256_ps512(_mm256_mul_ps(scales, _mm256_loadu_ps(a.scale(r, 8 * s))));
      for (int c = 0; c < 4; ++c)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(q[c], load512(a.q(r, 8 * s + 2 * c)))),
                                 _mm512_permutexvar_ps(lanes[c], t), acc[r]);
      mins[r] = _mm256_fmadd_ps(minimums, _mm256_loadu_ps(a.sum32(r, 8 * s)), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(mins[r]), _mm256_extractf128_ps(mins[r], 1));
    m4 = _mm_add_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_add_ss(m4, _mm_movehdup_ps(m4));
    out[r] = _mm512_reduce_add_ps(acc[r]) - _mm_cvtss_f32(m4);
  }
}

/// Lane l of a Q6_K product (vector v = 2h + p) belongs to sub-block 8h + 4p + l / 4.
alignas(64) const int32_t q6k_lanes[4][16] = {
  {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
  {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
  {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11},
  {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15},
};
/// Sub-block s's activation block: s / 2.
alignas(64) const int32_t q6k_blocks[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};

template <int R>
void q6_k(const unsigned char* w, const rows_at& a, float* out) {
  const float* table = halves();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i low2 = _mm512_set1_epi8(0x03);
  __m512i lanes[4];
  for (int v = 0; v < 4; ++v)
    lanes[v] = _mm512_load_si512(q6k_lanes[v]);
  const __m512i blocks = _mm512_load_si512(q6k_blocks);
  __m512 acc[R], offsets[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    offsets[r] = _mm512_setzero_ps();
  }
  for (int64_t s = 0; s < a.blocks / 8; ++s) {
    const unsigned char* block = w + 210 * s;
    if constexpr (R == 1)
      _mm_prefetch(reinterpret_cast<const char*>(block) + 1024, _MM_HINT_T0);
    __m512 scales = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)))),
      _mm512_set1_ps(half_at(block + 208, table)));
    // Vector 2h + p: groups 2p and 2p + 1 of half h (elements 128h + 64p ...): the low
    // (p = 0) or high (p = 1) nibbles of the half's 64 low bytes, and bits 4p, 4p + 2 of
    // its 32 high bytes above them.
    __m512i q[4];
    for (int h = 0; h < 2; ++h) {
      __m512i ql = load512(block + 64 * h);
      __m256i qh = load256(block + 128 + 32 * h);
      for (int p = 0; p < 2; ++p) {
        __m512i high = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_srli_epi16(qh, 4 * p)), _mm256_srli_epi16(qh, 4 * p + 2), 1);
        __m512i low = p == 0 ? ql : _mm512_srli_epi16(ql, 4);
        q[2 * h + p] = _mm512_or_si512(_mm512_and_si512(low, low4),
                                       _mm512_slli_epi16(_mm512_and_si512(high, low2), 4));
      }
    }
    for (int r = 0; r < R; ++r) {
      // d · scale of each sub-block · its activation block's scale.
      __m512 t = _mm512_mul_ps(
        scales, _mm512_permutexvar_ps(blocks, _mm512_castps256_ps512(_mm256_loadu_ps(a.scale(r, 8 * s)))));
      for (int v = 0; v < 4; ++v)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(q[v], load512(a.q(r, 8 * s + 2 * v)))),
                                 _mm512_permutexvar_ps(lanes[v], t), acc[r]);
      offsets[r] = _mm512_fmadd_ps(scales, _mm512_loadu_ps(a.sum16(r, 16 * s)), offsets[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(acc[r]) - 32.0f * _mm512_reduce_add_ps(offsets[r]);
}

template <int R>
void one_row(dtype t, const unsigned char* w, const rows_at& a, float* out) {
  switch (t) {
    case dtype::q8_0:
      return q8_0<R>(w, a, out);
    case dtype::q4_0:
      return q4_0<R>(w, a, out);
    case dtype::q4_k:
      return q4_k<R>(w, a, out);
    default:
      return q6_k<R>(w, a, out);
  }
}

} // namespace

void dot_rows(dtype w_type, const unsigned char* w, const int8_rows& x, float* y, int64_t ldy,
              int64_t begin, int64_t end, bool accumulate) {
  const int64_t blocks = x.k / 32;
  const auto stride = static_cast<int64_t>(storage_bytes(w_type, static_cast<size_t>(x.k)));
  // Activation rows in tiles of 8 (the accumulators of a tile and a super-block's
  // weights fill the registers), then 4, then one at a time.
  float out[8];
  auto put = [&](int64_t i, int64_t row, int count) {
    for (int r = 0; r < count; ++r) {
      float& dst = y[(row + r) * ldy + i];
      dst = accumulate ? dst + out[r] : out[r];
    }
  };
  for (int64_t i = begin; i < end; ++i) {
    const unsigned char* row = w + i * stride;
    int64_t r = 0;
    for (; r + 8 <= x.m; r += 8) {
      one_row<8>(w_type, row, rows_at{x, r, blocks}, out);
      put(i, r, 8);
    }
    for (; r + 4 <= x.m; r += 4) {
      one_row<4>(w_type, row, rows_at{x, r, blocks}, out);
      put(i, r, 4);
    }
    for (; r < x.m; ++r) {
      one_row<1>(w_type, row, rows_at{x, r, blocks}, out);
      put(i, r, 1);
    }
  }
}

} // namespace troupe::cpu::vnni
