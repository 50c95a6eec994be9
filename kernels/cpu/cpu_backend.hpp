#pragma once

#include "kernels/backend.hpp"

namespace troupe {

/// The CPU kernels as a backend, its products spread over `threads` threads (the caller's
/// included): float32 weights through OpenBLAS (`kernels/cpu/ops.hpp`), 16-bit and GGUF
/// block-format weights as stored (`kernels/cpu/quant.hpp`).
std::unique_ptr<backend> make_cpu_backend(int threads = 1);

} // namespace troupe
