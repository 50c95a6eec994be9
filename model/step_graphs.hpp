#pragma once

/// @file
/// Decode steps recorded once per shape and replayed at the cost of one launch (CUDA graphs
/// on a GPU), with named limits on what is kept.

#include "kernels/backend.hpp"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <tuple>

namespace troupe {

class step_graphs {
public:
  /// Wider decode steps run call by call (a graph per width would be kept for each).
  static constexpr int64_t max_tokens = 512;
  /// Recordings kept; one more drops them all (shapes recur, so they come back).
  static constexpr std::size_t max_recorded = 64;
  /// Shapes remembered as seen once or as not recordable, before they are forgotten.
  static constexpr std::size_t max_remembered = 256;

  /// What a recorded step depends on: its sizes, the cache (where and how its layers lie)
  /// and the backend's scratch.
  struct shape {
    int64_t tokens, samples, seqs, max_blocks;
    const float* cache;
    int64_t cache_blocks, block_size;
    uint64_t scratch_epoch;
    bool operator<(const shape& o) const {
      return std::tie(tokens, samples, seqs, max_blocks, cache, cache_blocks, block_size,
                      scratch_epoch) < std::tie(o.tokens, o.samples, o.seqs, o.max_blocks, o.cache,
                                                o.cache_blocks, o.block_size, o.scratch_epoch);
    }
  };

  /// Runs `compute`, a step of shape `s`, on `be`: replays its recording if there is one;
  /// records it on its second sighting (the first runs as it is, so that scratch memory
  /// has grown before it is recorded); else makes the calls.
  void run(backend& be, const shape& s, const std::function<void()>& compute);

  /// Drops every recording (the memory they name moved).
  void clear();

  /// Whether steps are recorded at all (vLLM's `enforce_eager` turns it off).
  bool enabled() const {
    return enabled_;
  }
  void enable(bool on) {
    enabled_ = on;
    clear();
  }

private:
  bool enabled_ = true;
  std::map<shape, std::unique_ptr<captured_calls>> recorded_;
  std::set<shape> seen_;
  std::set<shape> unrecordable_;
};

} // namespace troupe
