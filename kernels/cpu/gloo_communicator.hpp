#pragma once

#include "kernels/communicator.hpp"

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace troupe {

/// The CPU collective of a tensor-parallel group: Gloo over TCP. Bootstrapped in two
/// rounds that the executor runs with collective_rpc: `prepare` opens one pair per peer and
/// returns their addresses; `connect` takes every rank's addresses and connects the pairs
/// (every rank at once). Failures (a peer gone, a timeout) throw `troupe::error`.
class gloo_communicator final : public communicator {
public:
  /// A group of `size` ranks, this one `rank`, listening on `host`.
  gloo_communicator(int rank, int size, const std::string& host, std::chrono::milliseconds timeout);
  ~gloo_communicator() override;

  /// The address of this rank's pair for each peer (empty for itself).
  std::vector<std::string> prepare();

  /// `table[j][i]`: rank j's address for its pair with rank i.
  void connect(const std::vector<std::vector<std::string>>& table);

  /// Sums `count` floats over the group, in place.
  void all_reduce(float* data, size_t count) override;

  /// Copies `bytes` at `data` on rank `root` to `data` on every other rank.
  void broadcast(void* data, size_t bytes, int root);

  /// Fails every pair with `why`, which wakes a reduction waiting on them.
  void abort(const std::string& why) noexcept override;

  int rank() const {
    return rank_;
  }
  int size() const {
    return size_;
  }

private:
  void reduce(float* data, size_t count);

  struct impl;
  int rank_;
  int size_;
  std::unique_ptr<impl> impl_;
};

} // namespace troupe
