// The integer kernels of kernels/cpu/quant_int8.hpp with AVX-512 VNNI (built with AVX-512
// F, BW, VL, DQ and VNNI enabled; called only where the CPU has them). A 512-bit vector
// holds 64 weights. Blocks of 32 (Q8_0, Q4_0): `vpdpbusd` sums the products four at a
// time into 16 integer lanes (lanes 0-7 the first block, 8-15 the second), scaled as
// floats by both blocks' scales. k-quants: `vpmaddubsw` sums them in pairs (16 bits), and
// `vpdpwssd` multiplies the pairs by their sub-block's integer scale into 32-bit sums that
// run over the super-block, scaled once. Weights go in unsigned (nibbles, 6-bit values;
// Q8_0's magnitudes, its signs moved onto the activations), activations signed; what an
// offset adds (Q4_0's 8, Q4_K's minimum, Q6_K's 32) comes from the activations' sums.
// Several activation rows share each unpacked weight vector.
//
// The kernels of the packed layout (one vector: 4 bytes of each of 16 rows) put each
// weight row in its own lane instead: `vpdpbusd` against 4 activation bytes broadcast,
// integer sums per sub-block times its scale (`vpmulld`), no horizontal sums. BF16 weights
// the same way with `vdpbf16ps` (AVX-512 BF16, also enabled here) on pairs.

#include "kernels/cpu/quant_int8.hpp"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

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

/// The sum of 8 floats.
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// Where the activations of rows [row, row + R) are.
struct rows_at {
  const int8_rows& x;
  int64_t row;
  int64_t blocks; // of x.block in a row

  /// Element 32·`at` of row r.
  const int8_t* q(int r, int64_t at) const {
    return x.q.data() + (row + r) * x.k + 32 * at;
  }
  const float* scale(int r, int64_t block) const {
    return x.scale.data() + (row + r) * blocks + block;
  }
  /// Sums of 16 from element 16·`at` of row r.
  const int16_t* sums(int r, int64_t at) const {
    return x.sums.data() + (row + r) * (x.k / 16) + at;
  }
};

// One weight row against R activation rows each: out[r].

/// Lane l of the sums of a pair of blocks (2j, 2j + 1 of a group of 8) belongs to block
/// 2j + l / 8.
alignas(64) const int32_t pair_lanes[4][16] = {
  {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
  {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
  {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
  {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
};

/// Blocks b and b + 1 of Q8_0 (`Q8`) or Q4_0 as 64 unsigned bytes: Q4_0's nibbles, Q8_0's
/// quants + 128 (so that every activation, −128 included, keeps its sign).
template <bool Q8>
inline __m512i block_pair(const unsigned char* b0, const unsigned char* b1) {
  if constexpr (Q8) {
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(load256(b0 + 2)), load256(b1 + 2), 1);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 2))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + 2)), 1);
    // [low 0, low 1, high 0, high 1] in 16-byte lanes, then block 0's before block 1's.
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, mask)),
                                   _mm256_and_si256(_mm256_srli_epi16(v, 4), mask), 1);
    return _mm512_shuffle_i64x2(q, q, _MM_SHUFFLE(3, 1, 2, 0));
  }
}

/// Q8_0 (`Q8`) or Q4_0: groups of 8 blocks (their float16 scales gathered at once, the
/// products' lane scales permuted from one vector), then pairs, then a last block.
template <bool Q8, int R>
void blocks_of_32(const unsigned char* w, const rows_at& a, float* out) {
  constexpr int bytes = Q8 ? 34 : 18;
  // What the unsigned quants carry above the signed ones: Σ offset · q over each block.
  constexpr float offset = Q8 ? 128.0f : 8.0f;
  const float* table = halves();
  const __m256i offsets =
    _mm256_setr_epi32(0, bytes, 2 * bytes, 3 * bytes, 4 * bytes, 5 * bytes, 6 * bytes, 7 * bytes);
  const __m256i ones = _mm256_set1_epi16(1);
  __m512 acc[R];
  __m256 shift[R]; // Σ d · activation scale · sum of the block, times `offset` at the end
  float tail[R] = {};
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    shift[r] = _mm256_setzero_ps();
  }
  int64_t b = 0;
  for (; b + 8 <= a.blocks; b += 8) {
    const unsigned char* group = w + bytes * b;
    if constexpr (R == 1)
      _mm_prefetch(reinterpret_cast<const char*>(group) + 1024, _MM_HINT_T0);
    __m256 d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(
      _mm256_i32gather_epi32(reinterpret_cast<const int*>(group), offsets, 1)));
    __m512i q[4];
    for (int j = 0; j < 4; ++j)
      q[j] = block_pair<Q8>(group + 2 * j * bytes, group + (2 * j + 1) * bytes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256 scales = _mm256_mul_ps(d, _mm256_loadu_ps(a.scale(r, b)));
      __m512 wide = _mm512_castps256_ps512(scales);
      for (int j = 0; j < 4; ++j)
        acc[r] =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(q[j], load512(a.q(r, b + 2 * j)))),
                          _mm512_permutexvar_ps(_mm512_load_si512(pair_lanes[j]), wide), acc[r]);
      shift[r] = _mm256_fmadd_ps(
        scales, _mm256_cvtepi32_ps(_mm256_madd_epi16(load256(a.sums(r, 2 * b)), ones)), shift[r]);
    }
  }
  for (; b + 2 <= a.blocks; b += 2) {
    const unsigned char* b0 = w + bytes * b;
    __m512i q = block_pair<Q8>(b0, b0 + bytes);
    float d0 = half_at(b0, table), d1 = half_at(b0 + bytes, table);
    for (int r = 0; r < R; ++r) {
      const float* s = a.scale(r, b);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(q, load512(a.q(r, b)))),
                               two(d0 * s[0], d1 * s[1]), acc[r]);
      const int16_t* sums = a.sums(r, 2 * b);
      tail[r] -= offset * (d0 * s[0] * static_cast<float>(sums[0] + sums[1]) +
                           d1 * s[1] * static_cast<float>(sums[2] + sums[3]));
    }
  }
  for (; b < a.blocks; ++b) { // an odd last block
    const unsigned char* block = w + bytes * b;
    float d = half_at(block, table);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.q(r, b);
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i)
        sum += (Q8 ? static_cast<int8_t>(block[2 + i])
                   : (i < 16 ? block[2 + i] & 0x0f : block[2 + i - 16] >> 4) - 8) *
               x[i];
      tail[r] += d * *a.scale(r, b) * static_cast<float>(sum);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(acc[r]) - offset * sum8(shift[r]) + tail[r];
}

/// The 16-bit lanes of a k-quant product of 64 weights (`vpmaddubsw`: lane i holds
/// elements 2i and 2i + 1) by the sub-block each belongs to: Q4_K's chunk c (elements
/// 64c ...) holds sub-blocks 2c and 2c + 1 (32 elements each); Q6_K's vector v, sub-blocks
/// 4v ... 4v + 3 (16 each).
alignas(64) const int16_t q4k_lanes[4][32] = {
  {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
  {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
  {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5},
  {6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7},
};
alignas(64) const int16_t q6k_lanes[4][32] = {
  {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
  {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
  {8,  8,  8,  8,  8,  8,  8,  8,  9,  9,  9,  9,  9,  9,  9,  9,
   10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
  {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13,
   14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15},
};
/// Each of 8 16-bit values twice: Q4_K's minimums against the sums of 16.
alignas(32) const int16_t pairs_of_8[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};

/// Σ over a super-block of the products of 4 weight vectors and the activations at `x`,
/// each pair of products times its sub-block's scale (`scales[v]`), as 16 integer lanes.
inline __m512i scaled_sums(const __m512i* q, const __m512i* scales, const int8_t* x) {
  __m512i total = _mm512_setzero_si512();
  for (int v = 0; v < 4; ++v)
    total = _mm512_dpwssd_epi32(total, _mm512_maddubs_epi16(q[v], load512(x + 64 * v)), scales[v]);
  return total;
}

template <int R>
void q4_k(const unsigned char* w, const rows_at& a, float* out) {
  const float* table = halves();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m256i pairs = _mm256_load_si256(reinterpret_cast<const __m256i*>(pairs_of_8));
  __m512 acc[R];
  __m256 mins[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    mins[r] = _mm256_setzero_ps();
  }
  for (int64_t s = 0; s < a.blocks; ++s) {
    const unsigned char* block = w + 144 * s;
    if constexpr (R == 1)
      _mm_prefetch(reinterpret_cast<const char*>(block) + 1024, _MM_HINT_T0);
    __m128i packed = k_scales_mins(block + 4);
    __m512i scales16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(packed));
    __m512i scales[4];
    for (int c = 0; c < 4; ++c)
      scales[c] = _mm512_permutexvar_epi16(_mm512_load_si512(q4k_lanes[c]), scales16);
    // Minimum j against the sums of its two 16s.
    __m256i minimums = _mm256_permutexvar_epi16(
      pairs, _mm256_castsi128_si256(_mm_cvtepu8_epi16(_mm_srli_si128(packed, 8))));
    float d = half_at(block, table), dmin = half_at(block + 2, table);
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
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float xs = *a.scale(r, s);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(scaled_sums(q, scales, a.q(r, 8 * s))),
                               _mm512_set1_ps(d * xs), acc[r]);
      __m256i m = _mm256_madd_epi16(minimums, load256(a.sums(r, 16 * s)));
      mins[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dmin * xs), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(acc[r]) - sum8(mins[r]);
}

template <int R>
void q6_k(const unsigned char* w, const rows_at& a, float* out) {
  const float* table = halves();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i bits45 = _mm512_set1_epi8(0x30);
  // Bits 0-1 (first 32 bytes) and 2-3 (last 32) up to 4-5; bits 4-5 and 6-7 down to them.
  const __m512i up_shifts = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4);
  const __m512i down_shifts = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
  __m512 acc[R];
  __m256 offsets[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    offsets[r] = _mm256_setzero_ps();
  }
  for (int64_t s = 0; s < a.blocks; ++s) {
    const unsigned char* block = w + 210 * s;
    if constexpr (R == 1)
      _mm_prefetch(reinterpret_cast<const char*>(block) + 1024, _MM_HINT_T0);
    __m256i sub_scales =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
    __m512i scales[4];
    for (int v = 0; v < 4; ++v)
      scales[v] = _mm512_permutexvar_epi16(_mm512_load_si512(q6k_lanes[v]),
                                           _mm512_castsi256_si512(sub_scales));
    float d = half_at(block + 208, table);
    // Vector 2h + p: groups 2p and 2p + 1 of half h (elements 128h + 64p ...): the low
    // (p = 0) or high (p = 1) nibbles of the half's 64 low bytes, and bits 4p, 4p + 2 of
    // its 32 high bytes moved to bits 4-5 (a shift within 64-bit lanes moves no bit there
    // from another byte).
    __m512i q[4];
    for (int h = 0; h < 2; ++h) {
      __m512i ql = load512(block + 64 * h);
      __m512i qh = _mm512_broadcast_i64x4(load256(block + 128 + 32 * h));
      __m512i high0 = _mm512_and_si512(_mm512_sllv_epi64(qh, up_shifts), bits45);
      __m512i high1 = _mm512_and_si512(_mm512_srlv_epi64(qh, down_shifts), bits45);
      q[2 * h] = _mm512_ternarylogic_epi32(ql, low4, high0, 0xea); // (ql & 15) | high
      q[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), low4, high1, 0xea);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float ds = d * *a.scale(r, s);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(scaled_sums(q, scales, a.q(r, 8 * s))),
                               _mm512_set1_ps(ds), acc[r]);
      // The 32 every value is stored above: Σ scale · sum of 16.
      __m256i o = _mm256_madd_epi16(sub_scales, load256(a.sums(r, 16 * s)));
      offsets[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_set1_ps(32.0f * ds), offsets[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(acc[r]) - sum8(offsets[r]);
}

/// Byte `j` of each 32-bit lane.
inline __m512i byte_of(__m512i v, int j) {
  return _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), _mm512_set1_epi32(0xff));
}

inline __m512i broadcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

/// Q4_K in the packed layout (quant_int8.hpp): the 16 rows of a group against R
/// activation rows, out[r] lane i for row i. Per chunk of 64 elements, the products of
/// each sub-block sum as integers in the row's lane (`vpdpbusd` with the activations'
/// 4 bytes broadcast), times the sub-block's scale (`vpmulld`); the minimums go against
/// the activations' sums of 16 (`vpdpwssd`, each minimum twice in a lane).
template <int R>
void q4_k_packed(const unsigned char* group, const rows_at& a, __m512* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i six = _mm512_set1_epi32(0x3f3f3f3f);
  const __m512i four = _mm512_set1_epi32(0x0f0f0f0f);
  const __m512i two_bits = _mm512_set1_epi32(0x03030303);
  __m512 acc[R];
  for (int r = 0; r < R; ++r)
    acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < a.blocks; ++s) {
    const unsigned char* b = group + 2304 * s;
    // k_scales_mins, 16 rows at a time: bytes 0-3 of sc[0] are sub-blocks 0-3, of sc[1] 4-7.
    __m512i w0 = load512(b + 64), w1 = load512(b + 128), w2 = load512(b + 192);
    __m512i sc[2] = {
      _mm512_and_si512(w0, six),
      _mm512_or_si512(_mm512_and_si512(w2, four),
                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), two_bits), 4))};
    __m512i mn[2] = {
      _mm512_and_si512(w1, six),
      _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), four),
                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), two_bits), 4))};
    __m512i sums[R];
    for (int r = 0; r < R; ++r)
      sums[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m512i low[R], high[R];
      for (int r = 0; r < R; ++r)
        low[r] = high[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        __m512i v = load512(b + 256 + 64 * (8 * c + g));
        __m512i lo = _mm512_and_si512(v, low4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.q(r, 8 * s + 2 * c);
          low[r] = _mm512_dpbusd_epi32(low[r], lo, broadcast32(x + 4 * g));
          high[r] = _mm512_dpbusd_epi32(high[r], hi, broadcast32(x + 32 + 4 * g));
        }
      }
      __m512i s0 = byte_of(sc[c / 2], 2 * (c % 2)), s1 = byte_of(sc[c / 2], 2 * (c % 2) + 1);
      for (int r = 0; r < R; ++r)
        sums[r] = _mm512_add_epi32(sums[r], _mm512_add_epi32(_mm512_mullo_epi32(low[r], s0),
                                                             _mm512_mullo_epi32(high[r], s1)));
    }
    __m512i minimums[R];
    for (int r = 0; r < R; ++r)
      minimums[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i m = byte_of(mn[j / 4], j % 4);
      m = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
      for (int r = 0; r < R; ++r)
        minimums[r] = _mm512_dpwssd_epi32(minimums[r], m, broadcast32(a.sums(r, 16 * s + 2 * j)));
    }
    __m512 d = _mm512_cvtph_ps(load256(b)), dmin = _mm512_cvtph_ps(load256(b + 32));
    for (int r = 0; r < R; ++r) {
      __m512 xs = _mm512_set1_ps(*a.scale(r, s));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, xs), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(minimums[r]), _mm512_mul_ps(dmin, xs), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = acc[r];
}

/// Byte `j` of each 32-bit lane, sign-extended.
inline __m512i signed_byte_of(__m512i v, int j) {
  return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * j), 24);
}

/// Q8_0 (its quants stored + 128), Q4_0 or Q4_1 in the packed layout: each block's
/// products sum as integers in the rows' lanes, less the offset (128 or 8 times the sum of
/// the activations), then scaled as floats; Q4_1 adds m times the sum.
template <dtype T, int R>
void blocks_of_32_packed(const unsigned char* group, const rows_at& a, __m512* out) {
  constexpr bool q8 = T == dtype::q8_0, with_min = T == dtype::q4_1;
  constexpr int64_t bytes = 16 * (q8 ? 34 : with_min ? 20 : 18);
  constexpr int quants = with_min ? 64 : 32;
  constexpr int offset = q8 ? 128 : with_min ? 0 : 8;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r)
    acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const unsigned char* p = group + bytes * b;
    __m512i sums[R];
    for (int r = 0; r < R; ++r)
      sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int v = 0; v < (q8 ? 8 : 4); ++v) {
      __m512i w = load512(p + quants + 64 * v);
      if constexpr (q8) {
        for (int r = 0; r < R; ++r)
          sums[r] = _mm512_dpbusd_epi32(sums[r], w, broadcast32(a.q(r, b) + 4 * v));
      } else {
        __m512i lo = _mm512_and_si512(w, low4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
        for (int r = 0; r < R; ++r) {
          sums[r] = _mm512_dpbusd_epi32(sums[r], lo, broadcast32(a.q(r, b) + 4 * v));
          sums[r] = _mm512_dpbusd_epi32(sums[r], hi, broadcast32(a.q(r, b) + 16 + 4 * v));
        }
      }
    }
    __m512 d = _mm512_cvtph_ps(load256(p));
    for (int r = 0; r < R; ++r) {
      const int16_t* s16 = a.sums(r, 2 * b);
      const int sum = s16[0] + s16[1];
      const float xs = *a.scale(r, b);
      __m512i shifted =
        offset ? _mm512_sub_epi32(sums[r], _mm512_set1_epi32(offset * sum)) : sums[r];
      acc[r] =
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(shifted), _mm512_mul_ps(d, _mm512_set1_ps(xs)), acc[r]);
      if constexpr (with_min)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(load256(p + 32)),
                                 _mm512_set1_ps(xs * static_cast<float>(sum)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = acc[r];
}

/// Q6_K in the packed layout, the sub-blocks of 16 of half H, first or second 16 elements
/// (`Second`) of each quarter: a quarter at a time, its 6-bit values rebuilt 16 rows at a
/// time from `ql` (low or high nibbles) and `qh` (its two bits moved to bits 4-5), the
/// products summed as integers in the rows' lanes, times the sub-block's signed scale, into
/// `sums`. One quarter's sums a row keep the registers free for tiles of 4 rows, over which
/// the unpacking is shared.
template <int R, int H, int Second>
inline void q6_k_half(const unsigned char* b, const rows_at& a, int64_t s, const __m512i* scales,
                      __m512i* sums) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i bits45 = _mm512_set1_epi8(0x30);
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    __m512i part[R];
    for (int r = 0; r < R; ++r)
      part[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int g = 4 * Second; g < 4 * Second + 4; ++g) {
      // Quarter k: the low (k < 2) or high nibbles of ql bytes 64H + 32(k % 2) + l, and bits
      // 2k, 2k + 1 of qh byte 32H + l moved to bits 4-5 (a | (b & c): 0xf8).
      const unsigned char* triple = b + 288 + 192 * (8 * H + g);
      __m512i ql = load512(triple + 64 * (k % 2));
      __m512i qh = load512(triple + 128);
      __m512i nibbles = _mm512_and_si512(k < 2 ? ql : _mm512_srli_epi16(ql, 4), low4);
      __m512i high = k == 0   ? _mm512_slli_epi16(qh, 4)
                     : k == 1 ? _mm512_slli_epi16(qh, 2)
                     : k == 2 ? qh
                              : _mm512_srli_epi16(qh, 2);
      __m512i w = _mm512_ternarylogic_epi32(nibbles, high, bits45, 0xf8);
      for (int r = 0; r < R; ++r)
        part[r] =
          _mm512_dpbusd_epi32(part[r], w, broadcast32(a.q(r, 8 * s) + 128 * H + 4 * g + 32 * k));
    }
    const int j = 8 * H + 2 * k + Second;
    __m512i scale = signed_byte_of(scales[j / 4], j % 4);
    for (int r = 0; r < R; ++r)
      sums[r] = _mm512_add_epi32(sums[r], _mm512_mullo_epi32(part[r], scale));
  }
}

/// Q6_K in the packed layout; the 32 every value is stored above goes against the
/// activations' sums of 16.
template <int R>
void q6_k_packed(const unsigned char* group, const rows_at& a, __m512* out) {
  const __m512i low16 = _mm512_set1_epi32(0xffff);
  __m512 acc[R];
  for (int r = 0; r < R; ++r)
    acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < a.blocks; ++s) {
    const unsigned char* b = group + 3360 * s;
    __m512i scales[4];
    for (int q = 0; q < 4; ++q)
      scales[q] = load512(b + 32 + 64 * q);
    __m512i sums[R], offsets[R];
    for (int r = 0; r < R; ++r)
      sums[r] = offsets[r] = _mm512_setzero_si512();
    q6_k_half<R, 0, 0>(b, a, s, scales, sums);
    q6_k_half<R, 0, 1>(b, a, s, scales, sums);
    q6_k_half<R, 1, 0>(b, a, s, scales, sums);
    q6_k_half<R, 1, 1>(b, a, s, scales, sums);
    // Σ scale · sum of 16, a pair of sub-blocks per dpwssd.
#pragma GCC unroll 8
    for (int j = 0; j < 16; j += 2) {
      __m512i pair =
        _mm512_or_si512(_mm512_and_si512(signed_byte_of(scales[j / 4], j % 4), low16),
                        _mm512_slli_epi32(signed_byte_of(scales[j / 4], j % 4 + 1), 16));
      for (int r = 0; r < R; ++r)
        offsets[r] = _mm512_dpwssd_epi32(offsets[r], pair, broadcast32(a.sums(r, 16 * s + j)));
    }
    __m512 d = _mm512_cvtph_ps(load256(b));
    for (int r = 0; r < R; ++r) {
      __m512i total = _mm512_sub_epi32(sums[r], _mm512_slli_epi32(offsets[r], 5));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total),
                               _mm512_mul_ps(d, _mm512_set1_ps(*a.scale(r, s))), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = acc[r];
}

template <int R>
void one_group(dtype t, const unsigned char* group, const rows_at& a, __m512* out) {
  switch (t) {
  case dtype::q8_0:
    return blocks_of_32_packed<dtype::q8_0, R>(group, a, out);
  case dtype::q4_0:
    return blocks_of_32_packed<dtype::q4_0, R>(group, a, out);
  case dtype::q4_1:
    return blocks_of_32_packed<dtype::q4_1, R>(group, a, out);
  case dtype::q4_k:
    return q4_k_packed<R>(group, a, out);
  default:
    return q6_k_packed<R>(group, a, out);
  }
}

template <int R>
void one_row(dtype t, const unsigned char* w, const rows_at& a, float* out) {
  switch (t) {
  case dtype::q8_0:
    return blocks_of_32<true, R>(w, a, out);
  case dtype::q4_0:
    return blocks_of_32<false, R>(w, a, out);
  case dtype::q4_k:
    return q4_k<R>(w, a, out);
  default:
    return q6_k<R>(w, a, out);
  }
}

} // namespace

void dot_rows(dtype w_type, const unsigned char* w, const int8_rows& x, float* y, int64_t ldy,
              int64_t begin, int64_t end, bool accumulate) {
  const int64_t blocks = x.k / x.block;
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

void dot_packed(dtype w_type, const unsigned char* w, const int8_rows& x, float* y, int64_t ldy,
                int64_t begin, int64_t end, bool accumulate) {
  const int64_t blocks = x.k / x.block;
  const auto group_bytes =
    16 * static_cast<int64_t>(storage_bytes(w_type, static_cast<size_t>(x.k)));
  __m512 out[4];
  auto put = [&](int64_t first, int64_t row, int count) {
    for (int r = 0; r < count; ++r) {
      float* dst = y + (row + r) * ldy + first;
      _mm512_storeu_ps(dst, accumulate ? _mm512_add_ps(_mm512_loadu_ps(dst), out[r]) : out[r]);
    }
  };
  // Activation rows in tiles of 4 (their sums, the weights of a step and the scales fill
  // the registers), then 2, then 1.
  for (int64_t first = begin; first < end; first += 16) {
    const unsigned char* group = w + first / 16 * group_bytes;
    int64_t r = 0;
    for (; r + 4 <= x.m; r += 4) {
      one_group<4>(w_type, group, rows_at{x, r, blocks}, out);
      put(first, r, 4);
    }
    for (; r + 2 <= x.m; r += 2) {
      one_group<2>(w_type, group, rows_at{x, r, blocks}, out);
      put(first, r, 2);
    }
    for (; r < x.m; ++r) {
      one_group<1>(w_type, group, rows_at{x, r, blocks}, out);
      put(first, r, 1);
    }
  }
}

void quantize(const float* x, int64_t blocks, int64_t block, int8_t* q, float* scale,
              int16_t* sums) {
  const __m512i top = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + block * b;
    __m512 most = _mm512_setzero_ps();
    __m512 least = _mm512_setzero_ps();
    for (int64_t i = 0; i < block; i += 16) {
      __m512 v = _mm512_loadu_ps(xb + i);
      most = _mm512_max_ps(most, v);
      least = _mm512_min_ps(least, v);
    }
    const float hi = _mm512_reduce_max_ps(most);
    const float lo = _mm512_reduce_min_ps(least);
    // As the plain loop: the value of largest magnitude (the negative one of a tie)
    // becomes −128, the rest x · (−128 / it) rounded to nearest even (the default mode),
    // at most 127.
    const float m = std::fabs(lo) >= hi ? lo : hi;
    const __m512 inverse = _mm512_set1_ps(m != 0.0f ? -128.0f / m : 0.0f);
    scale[b] = m / -128.0f;
    for (int64_t i = 0; i < block; i += 16) {
      __m512i v =
        _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), inverse)), top);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + block * b + i), _mm512_cvtepi32_epi8(v));
      sums[(block * b + i) / 16] = static_cast<int16_t>(_mm512_reduce_add_epi32(v));
    }
  }
}

void to_bf16(const float* x, int64_t count, uint16_t* out) {
  int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(pair));
  }
  for (; i < count; ++i) {
    __m128bh one = _mm_cvtneps_pbh(_mm_set_ss(x[i]));
    uint16_t v;
    std::memcpy(&v, &one, sizeof v);
    out[i] = v;
  }
}

namespace {

inline __m512bh as_bf16(__m512i v) {
  return reinterpret_cast<__m512bh>(v);
}

/// Lanes 2i and 2i + 1 of (lo, hi) summed into lane i: a row's even and odd columns.
inline __m512 sum_pairs(__m512 lo, __m512 hi) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(lo, even, hi), _mm512_permutex2var_ps(lo, odd, hi));
}

/// A group of 16 packed BF16 rows against R activation rows: a pair of elements of the 16
/// rows per vector, each pair of the activations broadcast; C accumulators a row where the
/// tile is too small to hide `vdpbf16ps`'s latency.
template <int R>
void bf16_group(const unsigned char* group, const uint16_t* x, int64_t k, __m512* out) {
  constexpr int C = R >= 4 ? 1 : 4 / R;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  int64_t p = 0;
  for (; p + C <= pairs; p += C)
    for (int c = 0; c < C; ++c) {
      __m512i w = load512(group + 64 * (p + c));
      for (int r = 0; r < R; ++r)
        acc[r][c] =
          _mm512_dpbf16_ps(acc[r][c], as_bf16(w), as_bf16(broadcast32(x + r * k + 2 * (p + c))));
    }
  for (; p < pairs; ++p) {
    __m512i w = load512(group + 64 * p);
    for (int r = 0; r < R; ++r)
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], as_bf16(w), as_bf16(broadcast32(x + r * k + 2 * p)));
  }
  for (int r = 0; r < R; ++r) {
    out[r] = acc[r][0];
    for (int c = 1; c < C; ++c)
      out[r] = _mm512_add_ps(out[r], acc[r][c]);
  }
}

/// A group of 16 packed F16 rows against R float32 activation rows: a vector's pairs of
/// the 16 rows widen into two vectors (rows 0-7 and 8-15, a row's pair in two lanes), each
/// times the pair of activations broadcast; C accumulators a row where the tile is too
/// small to hide the latency of the multiply-adds. Each row's lanes sum at the end.
template <int R>
void f16_group(const unsigned char* group, const float* x, int64_t k, __m512* out) {
  constexpr int C = R >= 4 ? 1 : 4 / R;
  __m512 lo[R][C], hi[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      lo[r][c] = _mm512_setzero_ps();
      hi[r][c] = _mm512_setzero_ps();
    }
  auto step = [&](int64_t p, int c) {
    __m512i w = load512(group + 64 * p);
    __m512 wl = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
    __m512 wh = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
    for (int r = 0; r < R; ++r) {
      double pair;
      std::memcpy(&pair, x + r * k + 2 * p, sizeof pair);
      __m512 xp = _mm512_castpd_ps(_mm512_set1_pd(pair));
      lo[r][c] = _mm512_fmadd_ps(wl, xp, lo[r][c]);
      hi[r][c] = _mm512_fmadd_ps(wh, xp, hi[r][c]);
    }
  };
  const int64_t pairs = k / 2;
  int64_t p = 0;
  for (; p + C <= pairs; p += C)
    for (int c = 0; c < C; ++c)
      step(p + c, c);
  for (; p < pairs; ++p)
    step(p, 0);
  for (int r = 0; r < R; ++r) {
    __m512 l = lo[r][0];
    __m512 h = hi[r][0];
    for (int c = 1; c < C; ++c) {
      l = _mm512_add_ps(l, lo[r][c]);
      h = _mm512_add_ps(h, hi[r][c]);
    }
    out[r] = sum_pairs(l, h);
  }
}

/// y[(row + r)·ldy + first ...] (+)= the 16 sums of sums[r], r < count.
inline void store_rows(float* y, int64_t ldy, int64_t first, int64_t row, const __m512* sums,
                       int count, bool accumulate) {
  for (int r = 0; r < count; ++r) {
    float* dst = y + (row + r) * ldy + first;
    _mm512_storeu_ps(dst, accumulate ? _mm512_add_ps(_mm512_loadu_ps(dst), sums[r]) : sums[r]);
  }
}

/// Asks for line p of both groups of the pair at `next` (none where it is null): the next
/// pair's weights come from memory while this pair's first tile computes, instead of
/// stalling the next one's.
inline void prefetch_pair_line(const unsigned char* next, int64_t group_bytes, int64_t p) {
  if (next != nullptr) {
    _mm_prefetch(reinterpret_cast<const char*>(next + 64 * p), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(next + group_bytes + 64 * p), _MM_HINT_T1);
  }
}

/// Two groups of packed BF16 rows (32 outputs, `group_bytes` apart) against 8 activation
/// rows: each weight vector serves 8 rows and each broadcast pair of activations both
/// groups, so the loads stay well under the multiply-adds. out[2r + g]: row r, group g.
void bf16_two_groups(const unsigned char* group, int64_t group_bytes, const uint16_t* x, int64_t k,
                     __m512* out, const unsigned char* next) {
  constexpr int R = 8;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r)
    acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512i w0 = load512(group + 64 * p);
    __m512i w1 = load512(group + group_bytes + 64 * p);
    prefetch_pair_line(next, group_bytes, p);
    for (int r = 0; r < R; ++r) {
      __m512bh pair = as_bf16(broadcast32(x + r * k + 2 * p));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], as_bf16(w0), pair);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], as_bf16(w1), pair);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[2 * r] = acc[r][0];
    out[2 * r + 1] = acc[r][1];
  }
}

/// Two groups of packed F16 rows widened to float32 once, in the order `f16_two_groups`
/// reads them: for each pair of columns, four vectors (group 0's rows 0-7 and 8-15, then
/// group 1's). Widening inside the tile loop would cost a conversion per 8 multiply-adds.
void widen_two_groups(const unsigned char* group, int64_t group_bytes, int64_t k, float* wide) {
  for (int64_t p = 0; p < k / 2; ++p)
    for (int g = 0; g < 2; ++g) {
      __m512i w = load512(group + g * group_bytes + 64 * p);
      _mm512_storeu_ps(wide + 64 * p + 32 * g, _mm512_cvtph_ps(_mm512_castsi512_si256(w)));
      _mm512_storeu_ps(wide + 64 * p + 32 * g + 16,
                       _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1)));
    }
}

/// Two groups of F16 rows, widened by `widen_two_groups`, against 6 float32 activation
/// rows: 24 accumulators, each pair of activations broadcast once for the four vectors.
/// out[2r + g]: row r, group g.
void f16_two_groups(const float* wide, const float* x, int64_t k, __m512* out,
                    const unsigned char* next, int64_t group_bytes) {
  constexpr int R = 6;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512 w[4];
    for (int v = 0; v < 4; ++v)
      w[v] = _mm512_loadu_ps(wide + 64 * p + 16 * v);
    prefetch_pair_line(next, group_bytes, p);
    for (int r = 0; r < R; ++r) {
      double pair;
      std::memcpy(&pair, x + r * k + 2 * p, sizeof pair);
      __m512 xp = _mm512_castpd_ps(_mm512_set1_pd(pair));
      for (int v = 0; v < 4; ++v)
        acc[r][v] = _mm512_fmadd_ps(w[v], xp, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[2 * r] = sum_pairs(acc[r][0], acc[r][1]);
    out[2 * r + 1] = sum_pairs(acc[r][2], acc[r][3]);
  }
}

/// A packed 16-bit product (F16 widened against float32 activations, or BF16 against
/// bfloat16 ones) over the groups of [begin, end). Where there are rows enough, pairs of
/// groups go through the two-group tiles (for F16 widened once per pair into this thread's
/// buffer); the rows left over, and a decode step's few, through one group at a time in
/// tiles of 8, 4, 2 and 1 rows.
template <bool F16, class X>
void packed_pairs(const unsigned char* w, const X* x, int64_t m, int64_t k, float* y, int64_t ldy,
                  int64_t begin, int64_t end, bool accumulate) {
  const int64_t group_bytes = 16 * 2 * k;
  constexpr int64_t two_group_rows = F16 ? 6 : 8;
  // F16's widening pays for itself over two tiles or more (at 8 rows, one group at a time
  // is 1.6x faster).
  constexpr int64_t two_group_min = F16 ? 2 * two_group_rows : two_group_rows;
  __m512 out[2 * two_group_rows];
  auto one_group = [&](int64_t first, int64_t r) {
    auto group = w + first / 16 * group_bytes;
    auto tile = [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      for (; r + R <= m; r += R) {
        if constexpr (F16)
          f16_group<R>(group, x + r * k, k, out);
        else
          bf16_group<R>(group, x + r * k, k, out);
        store_rows(y, ldy, first, r, out, R, accumulate);
      }
    };
    tile(std::integral_constant<int, 8>{});
    tile(std::integral_constant<int, 4>{});
    tile(std::integral_constant<int, 2>{});
    tile(std::integral_constant<int, 1>{});
  };
  int64_t first = begin;
  if (m >= two_group_min) {
    thread_local std::vector<float> wide;
    if (F16)
      wide.resize(static_cast<size_t>(32 * k));
    for (; first + 32 <= end; first += 32) {
      auto group = w + first / 16 * group_bytes;
      if constexpr (F16)
        widen_two_groups(group, group_bytes, k, wide.data());
      auto next = first + 64 <= end ? group + 2 * group_bytes : nullptr;
      int64_t r = 0;
      for (; r + two_group_rows <= m; r += two_group_rows) {
        auto ask = r == 0 ? next : nullptr;
        if constexpr (F16)
          f16_two_groups(wide.data(), x + r * k, k, out, ask, group_bytes);
        else
          bf16_two_groups(group, group_bytes, x + r * k, k, out, ask);
        for (int i = 0; i < two_group_rows; ++i)
          for (int g = 0; g < 2; ++g)
            store_rows(y, ldy, first + 16 * g, r + i, out + 2 * i + g, 1, accumulate);
      }
      one_group(first, r);
      one_group(first + 16, r);
    }
  }
  for (; first < end; first += 16)
    one_group(first, 0);
}

} // namespace

void dot_packed_f16(const unsigned char* w, const float* x, int64_t m, int64_t k, float* y,
                    int64_t ldy, int64_t begin, int64_t end, bool accumulate) {
  packed_pairs<true>(w, x, m, k, y, ldy, begin, end, accumulate);
}

void dot_packed_bf16(const unsigned char* w, const uint16_t* x, int64_t m, int64_t k, float* y,
                     int64_t ldy, int64_t begin, int64_t end, bool accumulate) {
  packed_pairs<false>(w, x, m, k, y, ldy, begin, end, accumulate);
}

} // namespace troupe::cpu::vnni
