#pragma once

/// @file
/// The CPU collective of a tensor-parallel group whose ranks all live in one process: an
/// all-reduce through shared memory, with no socket in the way.

#include "kernels/communicator.hpp"

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

namespace troupe {

/// One process-wide id of this process, for telling whether ranks share one.
const std::string& process_token();

/// A rank of a group whose ranks are threads of one process. The ranks of a group meet
/// under `key` (the same string for all, unique to the group). `all_reduce` sums in rank
/// order on every rank, so every rank gets the same bits whatever the timing. A rank that
/// does not arrive within `timeout` makes the others throw `troupe::error` (`worker_died`)
/// instead of waiting for ever.
class local_communicator final : public communicator {
public:
  local_communicator(int rank, int size, const std::string& key, std::chrono::milliseconds timeout);
  ~local_communicator() override;

  local_communicator(const local_communicator&) = delete;
  local_communicator& operator=(const local_communicator&) = delete;

  /// Sums `count` floats over the group, in place.
  void all_reduce(float* data, size_t count) override;

  /// Leaves the group, as a destroyed rank does: every rank's wait fails.
  void abort(const std::string& why) noexcept override;

  /// What the ranks of a group share (defined with the communicator).
  struct group;

private:
  int rank_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<group> group_;
};

} // namespace troupe
