#include "kernels/backend.hpp"

#include "kernels/cpu/cpu_backend.hpp"
#ifdef TROUPE_WITH_CUDA
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_device.hpp"
#endif

namespace troupe {

captured_calls::~captured_calls() = default;

backend::~backend() = default;

std::unique_ptr<backend> make_backend(device& dev, int cpu_threads) {
#ifdef TROUPE_WITH_CUDA
  if (auto gpu = dynamic_cast<cuda_device*>(&dev))
    return make_cuda_backend(*gpu);
#endif
  return make_cpu_backend(cpu_threads);
}

} // namespace troupe
