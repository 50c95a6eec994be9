#pragma once

#include "kernels/backend.hpp"

namespace troupe {

class cuda_device;

/// The CUDA kernels and cuBLAS on `dev`'s stream as a backend: weights in float32, float16
/// or bfloat16 (half-precision GEMMs convert the activations to the weights' type and
/// accumulate in float32). Scratch memory (converted activations, attention scores) comes
/// from the device under `memory_tag::kv_cache`, so it sleeps with the cache.
std::unique_ptr<backend> make_cuda_backend(cuda_device& dev);

} // namespace troupe
