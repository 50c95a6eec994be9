#pragma once

/// @file
/// The fast path of the CPU device: products of weights kept as stored (Q8_0, Q4_0, Q4_K,
/// Q6_K) with activations rounded to 8-bit integers, summed as integers (AVX-512 VNNI) and
/// scaled once per block. Rounding the activations moves the logits slightly, so it is a
/// choice (`model_worker_options::cpu_precision`); the float kernels of quant.hpp stay the
/// exact path. The activations are rounded as llama.cpp rounds them for the same weights:
/// per block of 32 for Q8_0 and Q4_0 (each block's product is scaled by both blocks'
/// scales), per super-block of 256 for the k-quants (their sub-block scales then apply to
/// integer sums: `vpmaddubsw` and `vpdpwssd`, two instructions for 64 products).

#include "kernels/cpu/quant.hpp"

#include <cstdint>
#include <vector>

namespace troupe::cpu {

/// Activations x[m × k] as 8-bit integers: q = round(x / scale) per block of `block` (32
/// or 256) elements, scale = max |x| / 127 (0 for a block of zeros); `sums[h]` = Σ q over
/// the 16 elements of h: what a format's offset (Q4_0's 8, Q4_K's minimum, Q6_K's 32)
/// multiplies.
struct int8_rows {
  int64_t m = 0;
  int64_t k = 0;
  int64_t block = 32;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int16_t> sums;

  /// Rounds x in blocks of `block_size` (a divisor of cols); the buffers keep their memory
  /// from call to call.
  void quantize(const float* x, int64_t rows, int64_t cols, int64_t block_size);
};

/// The block `int8_rows` must be rounded in for `w_type`: 256 for the k-quants, else 32.
int64_t int8_block(dtype w_type);

/// Whether `w_type` has an integer kernel, and the CPU the instructions it needs (AVX-512
/// with VNNI and BW; `TROUPE_CPU_ISA` below avx512 says no). Elsewhere the fast path is
/// the exact one.
bool has_int8_kernel(dtype w_type);

/// y[r·ldy + i] (+)= row i of `w` · row r of `x`, for the weight rows i in [begin, end):
/// as `dot_rows_quantized`, on the rounded activations. Throws `unsupported` where
/// `has_int8_kernel` says no.
void dot_rows_int8(dtype w_type, const void* w, const int8_rows& x, float* y, int64_t ldy,
                   int64_t begin, int64_t end, bool accumulate);

/// The same, one block at a time in plain C++: the definition the vector kernels are
/// tested against (equal up to the order of float sums). Any CPU.
void dot_rows_int8_reference(dtype w_type, const void* w, const int8_rows& x, float* y,
                             int64_t ldy, int64_t begin, int64_t end, bool accumulate);

/// The packed layout: weights of `w_type` rearranged in groups of `packed_rows` rows so
/// that one vector load holds 4 bytes of each of the 16 rows and every product of a
/// `vpdpbusd` adds into that row's own lane: no horizontal sums, each row's scales unpacked
/// 16 at a time, and a tile of activation rows shares every weight vector (the prefill
/// GEMM). A group takes the bytes its 16 rows take as stored, so a band of whole groups
/// starts where it did. Q4_K, super-block s of a group (2304 bytes): the 16 rows' d
/// (float16) at 0, their dmin at 32, the three 32-bit words of their 6-bit scales and
/// minimums at 64 + 64·word + 4·row, and at 256 + 64·(8c + g) + 4·row the row's quant
/// bytes 32c + 4g ... 32c + 4g + 3 (their low nibbles elements 64c + 4g ..., the high
/// ones 64c + 32 + 4g ...).
constexpr int64_t packed_rows = 16;

/// Whether `w_type` has a packed layout and this CPU the kernel that reads it (Q4_K, the
/// same CPUs as `has_int8_kernel`).
bool has_packed_layout(dtype w_type);

/// Writes `rows` (a multiple of `packed_rows`) rows of `cols` elements of `w_type`, as
/// stored at `src`, to `dst` in the packed layout (`src` and `dst` do not overlap).
void pack_rows(dtype w_type, const void* src, void* dst, int64_t rows, int64_t cols);

/// The inverse of `pack_rows`: packed rows at `src` to `dst` as stored.
void unpack_rows(dtype w_type, const void* src, void* dst, int64_t rows, int64_t cols);

/// `dot_rows_int8` for weights in the packed layout; `begin` and `end` are multiples of
/// `packed_rows`. Throws `unsupported` where `has_packed_layout`
/// says no.
void dot_packed_int8(dtype w_type, const void* w, const int8_rows& x, float* y, int64_t ldy,
                     int64_t begin, int64_t end, bool accumulate);

} // namespace troupe::cpu
