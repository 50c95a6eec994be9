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

} // namespace troupe::cpu
