#include "troupe/device.hpp"

#include "kernels/cpu/cpu_device.hpp"
#include "troupe/errors.hpp"

namespace troupe {

device::~device() = default;

std::unique_ptr<device> make_device(const std::string& kind, int32_t index) {
  if (kind == "cpu")
    return std::make_unique<cpu_device>(index);
  throw error{errc::invalid_argument,
              "device kind '" + kind + "' is not supported by this build (expected \"cpu\")"};
}

} // namespace troupe
