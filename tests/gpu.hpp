#pragma once

// Helpers of the gpu suites.

#include "kernels/cuda/cuda_device.hpp"
#include "tests/skip.hpp"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace troupe::testing {

/// Whether a GPU is visible; without one the test case is skipped (ctest sees a skip, never
/// a pass) and should return.
inline bool have_gpu() {
  if (cuda_device::count() > 0)
    return true;
  skip("no GPU visible");
  return false;
}

/// The source tree: $TROUPE_SOURCE_DIR where set (a bundle run on another machine,
/// scripts/gpu-check.sh), else where the suite was built from.
inline std::string source_dir() {
  if (auto dir = std::getenv("TROUPE_SOURCE_DIR"))
    return dir;
  return TROUPE_SOURCE_DIR;
}

/// Free bytes of GPU 0, as cudaMemGetInfo sees them.
inline size_t gpu_free_bytes() {
  size_t free_bytes = 0;
  size_t total = 0;
  cudaSetDevice(0);
  cudaMemGetInfo(&free_bytes, &total);
  return free_bytes;
}

} // namespace troupe::testing
