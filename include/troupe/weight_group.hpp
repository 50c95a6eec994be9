#pragma once

/// @file
/// `troupe::weight_update_group`: the group over which a trainer sends new weights to
/// troupe's workers (SGLang's weight-update group): the trainer is rank 0, the engine's
/// ranks follow it (`rank_offset` + their rank).

#include "troupe/config.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace troupe {

/// One member of a weight-update group of `world_size` ranks over Gloo (TCP). The members
/// meet at `master_address:master_port`, where rank 0 listens: every other rank connects
/// there (retrying until the deadline), says who it is and where its Gloo pairs listen,
/// and learns the others'; then the pairs connect. All members must be constructed at
/// about the same time (each blocks until every one has come, or `timeout` passes and it
/// throws `timeout`). Members trust each other as the tensor-parallel ranks do: run it on a
/// private network.
class weight_update_group {
public:
  weight_update_group(const std::string& master_address, int32_t master_port, int32_t rank,
                      int32_t world_size, timeout_type timeout = std::chrono::seconds(60));
  ~weight_update_group();
  weight_update_group(const weight_update_group&) = delete;
  weight_update_group& operator=(const weight_update_group&) = delete;

  /// Copies `bytes` at `data` on rank `root` to `data` on every other member. Throws
  /// `worker_died` when a member is gone, `timeout` after the group's deadline.
  void broadcast(void* data, size_t bytes, int32_t root);

  int32_t rank() const;
  int32_t world_size() const;

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace troupe
