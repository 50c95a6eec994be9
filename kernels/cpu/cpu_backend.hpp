#pragma once

#include "kernels/backend.hpp"

namespace troupe {

/// The CPU kernels (`kernels/cpu/ops.hpp`) as a backend: float32 weights only.
std::unique_ptr<backend> make_cpu_backend();

} // namespace troupe
