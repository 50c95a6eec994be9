#pragma once

/// @file
/// The device interface a worker computes on: tagged allocation that can sleep and wake,
/// and copies. `kernels/cpu` implements it for host memory, `kernels/cuda` for a GPU.

#include "troupe/types.hpp"

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace troupe {

/// One compute device, owned by one worker and used from the worker's thread only.
///
/// Every allocation carries a memory tag. `sleep(offload_weights)` copies the `weights`
/// allocations to a host backup and releases the memory of every tag; `sleep(discard)`
/// releases it with no backup.
/// `wake_up(tags)` backs the memory of the given tags again at the same addresses, restores
/// the weights backup (if any) and zeroes everything else. Pointers stay valid across a
/// sleep cycle; touching memory of a sleeping tag is a bug.
class device {
public:
  virtual ~device();

  /// Name such as `"cpu:0"` or `"cuda:1"`.
  virtual std::string name() const = 0;

  /// Allocates `bytes` (zeroed) under `tag`. Throws `troupe::error` (`memory_error`) when
  /// the memory cannot be had, or (`sleeping`) when the tag sleeps.
  virtual void* allocate(std::size_t bytes, memory_tag tag) = 0;

  /// Maps `bytes` of the open file `fd` from `offset` (a multiple of the page size) as a new
  /// allocation under `tag`, or returns nullptr where the device cannot use a file's pages
  /// as its memory (a GPU). `shared`: what is written reaches the file (to fill it).
  /// Otherwise copy-on-write: writes stay in this process, and the pages nobody writes are
  /// the page cache's, so mapping a file that is cached costs no fresh memory. Sleep and
  /// wake treat it as any allocation; it is freed with `deallocate`.
  virtual void* map_file(int fd, std::size_t offset, std::size_t bytes, memory_tag tag,
                         bool shared);

  /// Frees memory from `allocate` or `map_file`; `nullptr` is ignored.
  virtual void deallocate(void* ptr) noexcept = 0;

  /// Releases the memory of every awake tag; `offload_weights` first backs up `weights`.
  /// Tags that already sleep are left as they are.
  virtual void sleep(sleep_level level) = 0;

  /// Wakes the given tags (all sleeping tags when empty). Awake tags are left as they are.
  virtual void wake_up(const std::vector<memory_tag>& tags) = 0;

  /// Tags that sleep now.
  virtual std::vector<memory_tag> sleeping_tags() const = 0;

  /// Bytes per tag: allocated, resident, backed up.
  virtual std::vector<memory_usage> usage() const = 0;

  /// Copies `bytes` between two device addresses.
  virtual void copy(void* dst, const void* src, std::size_t bytes) = 0;

  /// Bytes the device could still allocate (free memory of the device).
  virtual std::size_t free_memory() const = 0;

  /// Bytes of memory the device has in all.
  virtual std::size_t total_memory() const = 0;
};

/// Creates the device a worker of the given rank owns: host memory, or GPU `index`.
/// Throws `troupe::error` when this build or machine has no such device, or `kind` is none
/// of the enum's values.
std::unique_ptr<device> make_device(device_kind kind, int32_t index);

/// Memory from a device, freed when the buffer goes away.
class device_buffer {
public:
  device_buffer() = default;

  /// Allocates `bytes` under `tag` on `dev`.
  device_buffer(device& dev, std::size_t bytes, memory_tag tag)
    : dev_(&dev), ptr_(dev.allocate(bytes, tag)), size_(bytes) {}

  /// `device::map_file` as a buffer; an empty one where the device cannot map files.
  static device_buffer map_file(device& dev, int fd, std::size_t offset, std::size_t bytes,
                                memory_tag tag, bool shared) {
    device_buffer b;
    b.ptr_ = dev.map_file(fd, offset, bytes, tag, shared);
    if (b.ptr_ != nullptr) {
      b.dev_ = &dev;
      b.size_ = bytes;
    }
    return b;
  }

  device_buffer(device_buffer&& other) noexcept
    : dev_(other.dev_), ptr_(other.ptr_), size_(other.size_) {
    other.ptr_ = nullptr;
    other.size_ = 0;
  }

  device_buffer& operator=(device_buffer&& other) noexcept {
    if (this != &other) {
      reset();
      dev_ = other.dev_;
      ptr_ = other.ptr_;
      size_ = other.size_;
      other.ptr_ = nullptr;
      other.size_ = 0;
    }
    return *this;
  }

  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  ~device_buffer() {
    reset();
  }

  /// Frees the memory now.
  void reset() noexcept {
    if (ptr_ != nullptr)
      dev_->deallocate(ptr_);
    ptr_ = nullptr;
    size_ = 0;
  }

  void* data() const noexcept {
    return ptr_;
  }

  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(ptr_);
  }

  std::size_t size() const noexcept {
    return size_;
  }

private:
  device* dev_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t size_ = 0;
};

} // namespace troupe
