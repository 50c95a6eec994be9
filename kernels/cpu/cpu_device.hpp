#pragma once

#include "troupe/device.hpp"

#include <array>
#include <cstddef>
#include <unordered_map>

namespace troupe {

/// The CPU device: host memory in a tagged pool whose sleep really returns pages to the OS.
///
/// Each allocation reserves its own page-aligned address range with `mmap`. Sleeping
/// releases the pages with `madvise(MADV_DONTNEED)` and makes the range inaccessible
/// (`PROT_NONE`), so the addresses stay reserved and a stray access faults instead of
/// silently allocating. A level-1 sleep first moves the pages of each `weights` allocation
/// to a host backup range (`mremap`: the backup of host memory in host memory needs no
/// copy), and the wake-up moves them back to the same addresses, so an awake device does
/// not hold the weights twice. Needs Linux 5.7 or later (`MREMAP_DONTUNMAP`).
class cpu_device final : public device {
public:
  explicit cpu_device(int32_t index);
  ~cpu_device() override;

  std::string name() const override;
  void* allocate(std::size_t bytes, memory_tag tag) override;
  void deallocate(void* ptr) noexcept override;
  void sleep(int32_t level) override;
  void wake_up(const std::vector<memory_tag>& tags) override;
  std::vector<memory_tag> sleeping_tags() const override;
  std::vector<memory_usage> usage() const override;
  void copy(void* dst, const void* src, std::size_t bytes) override;
  std::size_t free_memory() const override;
  std::size_t total_memory() const override;

private:
  struct allocation {
    std::size_t requested = 0;
    /// Length of the mapping (a multiple of the page size).
    std::size_t mapped = 0;
    memory_tag tag = memory_tag::weights;
    /// Host backup range: the weights' own pages, moved there by a level-1 sleep and back by
    /// the wake-up (which unmaps it); nullptr while awake or without a backup.
    void* backup = nullptr;
  };

  struct tag_state {
    bool asleep = false;
    int32_t level = 0;
  };

  static std::size_t index_of(memory_tag tag) {
    return static_cast<std::size_t>(tag);
  }

  int32_t index_;
  std::unordered_map<void*, allocation> allocations_;
  std::array<tag_state, 2> tags_{};
};

} // namespace troupe
