#pragma once

/// @file
/// A device's tagged memory pool, written once: allocations by tag, sleep (every backup
/// first, then the releases, so that a sleep that fails leaves memory as it was), wake-up
/// of the tags asked for, and usage. A device supplies the primitives: map, free, back up,
/// release, restore.

#include "troupe/device.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <unordered_map>

namespace troupe {

class tagged_pool : public device {
public:
  void* allocate(std::size_t bytes, memory_tag tag) final;
  void* map_file(int fd, std::size_t offset, std::size_t bytes, memory_tag tag, bool shared) final;
  void deallocate(void* ptr) noexcept final;
  void sleep(sleep_level level) final;
  void wake_up(const std::vector<memory_tag>& tags) final;
  std::vector<memory_tag> sleeping_tags() const final;
  std::vector<memory_usage> usage() const final;

protected:
  /// One allocation: an address range the device keeps for it, with memory behind it while
  /// its tag is awake.
  struct region {
    std::size_t requested = 0;
    /// The length of the range (whole pages, or the device's granularity).
    std::size_t mapped = 0;
    memory_tag tag = memory_tag::weights;
    /// The device's handle of the memory behind the range (a GPU's physical memory).
    std::uint64_t handle = 0;
    /// The device's host backup, in the device's own form, and whether it holds the
    /// region's contents now.
    void* backup = nullptr;
    bool backed_up = false;
    /// A file's pages back the range (where awake) or the backup (while backed up).
    bool file = false;
  };

  /// Reserves a range for `r.requested` bytes with zeroed memory behind it, sets
  /// `r.mapped` (and `r.handle`), and returns its start. Throws `memory_error`.
  virtual void* map_new(region& r) = 0;
  /// Maps `r.requested` bytes of `fd` from `offset` as `device::map_file` says, sets
  /// `r.mapped` and `r.file`, and returns its start; nullptr where the device cannot.
  virtual void* map_file_region(region& r, int fd, std::size_t offset, bool shared) {
    (void)r;
    (void)fd;
    (void)offset;
    (void)shared;
    return nullptr;
  }
  /// Gives back everything of a region: memory, range, backup.
  virtual void free_region(void* ptr, region& r) noexcept = 0;
  /// Saves the contents in host memory (`r.backed_up`). Throws when memory is short.
  virtual void back_up(void* ptr, region& r) = 0;
  /// Puts a backup of a sleep that failed back: the region is as before `back_up`.
  virtual void undo_backup(void* ptr, region& r) = 0;
  /// Gives the memory behind the range back; the range stays reserved.
  virtual void release(void* ptr, region& r) = 0;
  /// Memory behind the range again, with the backup's contents (consuming it) or zeros.
  virtual void restore(void* ptr, region& r) = 0;
  /// Waits for the device's queued work (kernels, copies); nothing by default.
  virtual void settle() {}

  /// Frees every region; a device's destructor calls it (the pool's cannot reach the
  /// device's primitives any more).
  void free_all() noexcept;

private:
  /// Throws for an unknown tag or one that sleeps.
  void check_awake(memory_tag tag) const;

  bool asleep(memory_tag tag) const {
    return asleep_[static_cast<std::size_t>(tag)];
  }

  std::unordered_map<void*, region> regions_;
  std::array<bool, std::size(all_memory_tags)> asleep_{};
};

} // namespace troupe
