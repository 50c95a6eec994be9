#pragma once

/// @file
/// The fast path of the CPU device: products of weights kept as stored (Q8_0, Q4_0, Q4_K,
/// Q6_K) with activations rounded to 8-bit integers per block of 32, summed as integers
/// (AVX-512 VNNI's `vpdpbusd`: 64 products an instruction) and scaled once per block.
/// Rounding the activations moves the logits slightly, so it is a choice
/// (`model_worker_options::cpu_precision`); the float kernels of quant.hpp stay the exact
/// path. Each activation block keeps its own scale (llama.cpp's k-quant path shares one
/// among 256), so the rounding is never coarser than llama.cpp's.

#include "kernels/cpu/quant.hpp"

#include <cstdint>
#include <vector>

namespace troupe::cpu {

/// Activations x[m × k] (k a multiple of 32) as 8-bit integers: q = round(x / scale) per
/// block of 32, scale = max |x| / 127 (0 for a block of zeros). `sum32[b]` is
/// scale · Σ q over block b, `sum16[h]` the same over half-block h: what a format's offset
/// (Q4_0's 8, Q4_K's minimum, Q6_K's 32) multiplies.
struct int8_rows {
  int64_t m = 0;
  int64_t k = 0;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> sum32;
  std::vector<float> sum16;

  /// Rounds x (sizes the buffers, which keep their memory from call to call).
  void quantize(const float* x, int64_t rows, int64_t cols);
};

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
