#include "troupe/device.hpp"

#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cuda_module.hpp"
#include "troupe/errors.hpp"

namespace troupe {

device::~device() = default;

void* device::map_file(int, std::size_t, std::size_t, memory_tag, bool) {
  return nullptr;
}

std::unique_ptr<device> make_device(device_kind kind, int32_t index) {
  if (kind == device_kind::cuda)
    return cuda().make_device(index);
  return std::make_unique<cpu_device>(index);
}

} // namespace troupe
