#include "troupe/device.hpp"

#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cuda_module.hpp"
#include "troupe/errors.hpp"

namespace troupe {

device::~device() = default;

void* device::map_file(int, std::size_t, std::size_t, memory_tag, bool) {
  return nullptr;
}

std::unique_ptr<device> make_device(const std::string& kind, int32_t index) {
  if (kind == "cpu")
    return std::make_unique<cpu_device>(index);
  if (kind == "cuda")
    return cuda().make_device(index);
  throw error{errc::invalid_argument,
              "device kind '" + kind + "' is not known (\"cpu\" or \"cuda\")"};
}

} // namespace troupe
