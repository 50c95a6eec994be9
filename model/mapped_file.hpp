#pragma once

#include <cstddef>
#include <string>

namespace troupe {

/// A whole file mapped read-only. Throws `troupe::error` (`invalid_argument`) naming the
/// file, prefixed with `kind` ("safetensors file", "GGUF file"), when it cannot be opened
/// or is shorter than `min_size`.
class mapped_file {
public:
  mapped_file(const std::string& path, const char* kind, std::size_t min_size);
  ~mapped_file();

  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;

  const std::byte* data() const {
    return static_cast<const std::byte*>(map_);
  }
  std::size_t size() const {
    return size_;
  }

private:
  void* map_ = nullptr;
  std::size_t size_ = 0;
};

} // namespace troupe
