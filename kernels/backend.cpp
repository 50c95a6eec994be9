#include "kernels/backend.hpp"

#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cuda_module.hpp"
#include "troupe/errors.hpp"

namespace troupe {

captured_calls::~captured_calls() = default;

backend::~backend() = default;

void backend::throw_no_packing() {
  throw error{errc::unsupported, "this backend has no packed weight layout"};
}

std::unique_ptr<backend> make_backend(device& dev, int cpu_threads, bool int8_activations) {
  if (is_cuda(dev))
    return cuda().make_backend(dev);
  return make_cpu_backend(cpu_threads, int8_activations);
}

} // namespace troupe
