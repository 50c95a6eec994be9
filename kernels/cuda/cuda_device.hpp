#pragma once

#include "kernels/tagged_pool.hpp"

#include <cstddef>
#include <cstdint>

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
class cuda_device final : public tagged_pool {
public:
  /// Binds the calling thread to GPU `index`. Throws `troupe::error` when there is no such
  /// device or its driver lacks virtual memory management.
  explicit cuda_device(int32_t index);
  ~cuda_device() override;

  std::string name() const override;
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

  /// Throws `invalid_argument` when GPU `index` does not exist.
  static void check(int32_t index);

  /// Whether GPU `index`'s primary context is active in this process (making it current
  /// would not create one).
  static bool has_context(int32_t index);

private:
  void* map_new(region& r) override;
  void free_region(void* ptr, region& r) noexcept override;
  /// Copies to a pinned host buffer, allocated on the first sleep and kept for later ones.
  void back_up(void* ptr, region& r) override;
  void undo_backup(void* ptr, region& r) override;
  void release(void* ptr, region& r) override;
  void restore(void* ptr, region& r) override;
  void settle() override;

  /// Creates physical memory for `r` and maps it at `ptr`.
  void map(void* ptr, region& r);

  int32_t index_;
  cudaStream_t stream_ = nullptr;
  std::size_t granularity_ = 0;
  CUmemAllocationProp prop_{};
};

} // namespace troupe
