#pragma once

#include "kernels/tagged_pool.hpp"

#include <cstddef>
#include <cstdint>
#include <string>

namespace troupe {

/// The CPU device: host memory in a tagged pool whose sleep really returns pages to the OS.
///
/// Each allocation reserves its own page-aligned address range with `mmap`. Sleeping
/// releases the pages with `madvise(MADV_DONTNEED)` and makes the range inaccessible
/// (`PROT_NONE`), so the addresses stay reserved and a stray access faults instead of
/// silently allocating. A level-1 sleep first moves the pages of each `weights` allocation
/// to a host backup range (`mremap`: the backup of host memory in host memory needs no
/// copy), and the wake-up moves them back to the same addresses, so an awake device does
/// not hold the weights twice. Needs Linux 5.7 or later (`MREMAP_DONTUNMAP`; 5.13 for a
/// file's pages, `map_file`). A file mapping that sleeps is released as any range; what
/// wakes in its place is zeroed memory, or the backup's pages.
class cpu_device final : public tagged_pool {
public:
  explicit cpu_device(int32_t index);
  ~cpu_device() override;

  std::string name() const override;
  void copy(void* dst, const void* src, std::size_t bytes) override;
  std::size_t free_memory() const override;
  std::size_t total_memory() const override;

private:
  void* map_new(region& r) override;
  void* map_file_region(region& r, int fd, std::size_t offset, bool shared) override;
  void free_region(void* ptr, region& r) noexcept override;
  /// Moves the pages to a backup range (`r.backup`).
  void back_up(void* ptr, region& r) override;
  void undo_backup(void* ptr, region& r) override;
  void release(void* ptr, region& r) override;
  void restore(void* ptr, region& r) override;

  int32_t index_;
};

} // namespace troupe
