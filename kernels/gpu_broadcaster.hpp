#pragma once

/// @file
/// What a weight-update group needs of a GPU member (the CUDA module makes it; see
/// kernels/cuda_module.hpp).

#include <cstddef>
#include <string>

namespace troupe {

/// A member of a weight-update group on one GPU: NCCL broadcasts from one member to the
/// others (`weight_update_group` with the `nccl` backend).
class gpu_broadcaster {
public:
  virtual ~gpu_broadcaster();

  /// Joins the NCCL group `id` (from `make_collective_id`) of `world` members as `rank`;
  /// every member joins at once. Throws `worker_died` when the others do not join in time.
  virtual void join(int rank, int world, const std::string& id) = 0;

  /// Copies `bytes` at `data` on member `root` to `data` on every other member. `data` is
  /// memory of this member's GPU when `on_gpu`, else host memory, staged through the GPU.
  /// Every member gives the same `bytes` (each may choose `on_gpu` for itself). Throws
  /// `worker_died` when a member is gone or the timeout passes.
  virtual void broadcast(void* data, std::size_t bytes, int root, bool on_gpu) = 0;
};

} // namespace troupe
