#pragma once

/// @file
/// `troupe::weight_update_group`: the group over which a trainer sends new weights to
/// troupe's workers (SGLang's weight-update group): the trainer is rank 0, the engine's
/// ranks follow it (`rank_offset` + their rank). Over Gloo (CPU) or NCCL (GPUs).

#include "troupe/config.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace troupe {

/// One member of a weight-update group of `world_size` ranks. The members meet at
/// `master_address:master_port`, where rank 0 listens: every other rank connects there
/// (retrying until the deadline), says who it is, and learns what it needs to join (where
/// the others' Gloo pairs listen, or the NCCL group's id); then the group forms. All members
/// must be constructed at about the same time (each blocks until every one has come, or
/// `timeout` passes and it throws `timeout`). Members trust each other as the
/// tensor-parallel ranks do: run it on a private network.
///
/// `backend` is every member's choice alike: `"gloo"` (TCP, host memory) or `"nccl"` (GPU
/// `gpu` of this member; host memory passes through a 32 MiB staging buffer on that GPU,
/// kept while the group lives, and GPU memory goes as it is). NCCL needs one GPU per
/// member: it refuses two members on one GPU.
class weight_update_group {
public:
  /// Throws `invalid_argument` for a backend other than `"gloo"` or `"nccl"`; for `"nccl"`,
  /// before the meeting, `unsupported` where this build has no CUDA and `invalid_argument`
  /// where this machine has no GPU `gpu`.
  weight_update_group(const std::string& master_address, int32_t master_port, int32_t rank,
                      int32_t world_size, timeout_type timeout = std::chrono::seconds(60),
                      const std::string& backend = "gloo", int32_t gpu = 0);
  ~weight_update_group();
  weight_update_group(const weight_update_group&) = delete;
  weight_update_group& operator=(const weight_update_group&) = delete;

  /// Copies `bytes` of host memory at `data` on rank `root` to `data` on every other
  /// member. Every member gives the same `bytes`. Throws `worker_died` when a member is
  /// gone, `timeout` (Gloo) or `worker_died` (NCCL) after the group's deadline.
  void broadcast(void* data, size_t bytes, int32_t root);

  /// `broadcast` of memory on this member's GPU, with no copy through the host (`nccl`
  /// only; `invalid_argument` otherwise). Its peers may give host or GPU memory.
  void broadcast_gpu(void* data, size_t bytes, int32_t root);

  int32_t rank() const;
  int32_t world_size() const;
  /// `"gloo"` or `"nccl"`.
  std::string backend() const;

private:
  void send(void* data, size_t bytes, int32_t root, bool on_gpu);

  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace troupe
