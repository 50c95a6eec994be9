#pragma once

#include "troupe/device.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <unordered_map>

#include <cuda.h>
#include <cuda_runtime_api.h>

namespace troupe {

/// A GPU whose tagged pool sleeps for real, on CUDA virtual memory management.
///
/// Each allocation reserves its own device address range and maps physical memory made with
/// `cuMemCreate` into it. Sleeping unmaps and releases the physical memory (it goes back to
/// the device: `cudaMemGetInfo` sees it) while the address range stays reserved; waking
/// creates new physical memory and maps it at the same addresses, so pointers held by the
/// model stay valid. A level-1 sleep first copies each `weights` allocation into a pinned
/// host backup, allocated on the first sleep and reused by every later one. The driver API
/// is reached through the runtime's entry points, so the library loads on machines without
/// a GPU driver. Owned and used by one worker thread, with one stream.
class cuda_device final : public device {
public:
  /// Binds the calling thread to GPU `index`. Throws `troupe::error` when there is no such
  /// device or its driver lacks virtual memory management.
  explicit cuda_device(int32_t index);
  ~cuda_device() override;

  std::string name() const override;
  void* allocate(std::size_t bytes, memory_tag tag) override;
  void deallocate(void* ptr) noexcept override;
  void sleep(int32_t level) override;
  void wake_up(const std::vector<memory_tag>& tags) override;
  std::vector<memory_tag> sleeping_tags() const override;
  std::vector<memory_usage> usage() const override;
  /// Copies between any two addresses (device or host), on the stream, and waits.
  void copy(void* dst, const void* src, std::size_t bytes) override;
  std::size_t free_memory() const override;
  std::size_t total_memory() const override;

  /// The worker's stream: every kernel of this device runs on it.
  cudaStream_t stream() const {
    return stream_;
  }

  /// How many GPUs the process sees (0 without a driver or device).
  static int count();

private:
  struct allocation {
    std::size_t requested = 0;
    /// Mapped length (a multiple of the allocation granularity).
    std::size_t mapped = 0;
    memory_tag tag = memory_tag::weights;
    /// Physical memory; 0 while the tag sleeps.
    CUmemGenericAllocationHandle handle = 0;
    /// Pinned host backup, allocated on the first level-1 sleep; nullptr before.
    void* backup = nullptr;
    bool backup_valid = false;
  };

  /// Creates physical memory for `a` and maps it at `ptr`.
  void map(void* ptr, allocation& a);
  /// Unmaps and releases the physical memory of `a`.
  void unmap(void* ptr, allocation& a);
  /// Gives back everything of `a`: physical memory, address range, backup.
  static void free_allocation(void* ptr, allocation& a) noexcept;

  int32_t index_;
  cudaStream_t stream_ = nullptr;
  std::size_t granularity_ = 0;
  CUmemAllocationProp prop_{};
  std::unordered_map<void*, allocation> allocations_;
  std::array<bool, 2> asleep_{};
};

} // namespace troupe
