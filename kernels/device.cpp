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
  switch (kind) {
  case device_kind::cpu:
    return std::make_unique<cpu_device>(index);
  case device_kind::cuda:
    return cuda().make_device(index);
  }
  // A value no name gives: a peer of another build sent it.
  throw error{errc::invalid_argument,
              "device kind " + std::to_string(static_cast<int>(kind)) + " is not known"};
}

} // namespace troupe
