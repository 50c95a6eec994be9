#include "troupe/device.hpp"

#include "kernels/cpu/cpu_device.hpp"
#ifdef TROUPE_WITH_CUDA
#include "kernels/cuda/cuda_device.hpp"
#endif
#include "troupe/errors.hpp"

namespace troupe {

device::~device() = default;

std::unique_ptr<device> make_device(const std::string& kind, int32_t index) {
  if (kind == "cpu")
    return std::make_unique<cpu_device>(index);
#ifdef TROUPE_WITH_CUDA
  if (kind == "cuda")
    return std::make_unique<cuda_device>(index);
  const char* kinds = "\"cpu\" or \"cuda\"";
#else
  const char* kinds = "\"cpu\"; CUDA is not built in";
#endif
  throw error{errc::invalid_argument,
              "device kind '" + kind + "' is not supported by this build (" + kinds + ")"};
}

} // namespace troupe
