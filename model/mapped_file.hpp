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

  /// The file as it was opened: its absolute path, size, device, inode and modification
  /// time. A file rewritten or replaced since has another.
  const std::string& identity() const {
    return identity_;
  }

  /// The open file (read-only), for a second mapping of its pages: the same file as the
  /// mapping's, whatever happens to its path meanwhile.
  int fd() const {
    return fd_;
  }
  /// Whether `p` points into the mapping.
  bool contains(const void* p) const;

  /// Gives back the pages wholly inside [p, p + bytes) (which must lie in the mapping): they
  /// leave the process's resident memory and are read from the file again if touched. A
  /// loader calls it once a tensor is copied, so that a model does not stay resident twice.
  void release(const void* p, std::size_t bytes) const;

private:
  void* map_ = nullptr;
  std::size_t size_ = 0;
  int fd_ = -1;
  std::string identity_;
};

/// The bytes of the regular file at `path` (a JSON config, a tokenizer). Throws
/// `troupe::error` (`invalid_argument`) naming the file, prefixed with `kind`, when it is
/// missing, not a regular file (a FIFO would block the reader for as long as its writer
/// likes) or larger than `max_bytes`.
std::string read_small_file(const std::string& path, const char* kind, std::size_t max_bytes);

} // namespace troupe
