#pragma once

#include "kernels/backend.hpp"

namespace troupe {

/// The CPU kernels as a backend, its products spread over `threads` threads (the caller's
/// included): float32 weights through OpenBLAS (`kernels/cpu/ops.hpp`), 16-bit and GGUF
/// block-format weights as stored (`kernels/cpu/quant.hpp`); with `int8_activations` (the
/// fast path), the formats that have packed kernels are repacked at load (`backend::pack`)
/// and multiply activations rounded to 8-bit integers, or to bfloat16 for BF16 (F16's stay
/// float32: a layout change only) (`kernels/cpu/quant_int8.hpp`).
std::unique_ptr<backend> make_cpu_backend(int threads = 1, bool int8_activations = false);

} // namespace troupe
