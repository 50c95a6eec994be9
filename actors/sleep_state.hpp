#pragma once

#include "troupe/types.hpp"

#include <set>
#include <string>
#include <variant>
#include <vector>

namespace troupe {

/// The executor's sleep/wake state machine, with vLLM's rules:
///
///     awake --sleep(level)--> asleep(level, {weights, kv_cache})
///     asleep --wake_up(some tags)--> partly_awake(level, remaining tags)
///     asleep | partly_awake --wake_up(all remaining)--> awake
///
/// Sleeping while any tag sleeps, waking while awake, and waking a tag that is unknown or
/// not asleep are refused with a warning and change nothing. The machine only decides; the
/// executor carries a transition out on the workers and then commits it.
class sleep_state {
public:
  struct awake {};
  struct asleep {
    sleep_level level = sleep_level::offload_weights;
  };
  struct partly_awake {
    sleep_level level = sleep_level::offload_weights;
    std::set<memory_tag> sleeping;
  };
  using state = std::variant<awake, asleep, partly_awake>;

  /// The answer to a requested transition: go ahead with `tags`, or log `warning` and stop.
  struct decision {
    bool proceed = false;
    std::string warning;
    /// Tags the transition acts on.
    std::vector<memory_tag> tags;
  };

  /// May the executor fall asleep?
  decision check_sleep() const;

  /// Records that every worker fell asleep at `level`.
  void commit_sleep(sleep_level level);

  /// May the executor wake `tag_names` (all sleeping tags when empty)?
  decision check_wake(const std::vector<std::string>& tag_names) const;

  /// Records that `tags` woke up on every worker.
  void commit_wake(const std::vector<memory_tag>& tags);

  bool is_sleeping() const;

  /// Sleeping tags, in tag order.
  std::vector<memory_tag> sleeping_tags() const;

  /// The level of the current sleep; 0 when awake.
  int32_t level() const;

  const state& current() const {
    return state_;
  }

private:
  state state_ = awake{};
};

/// `"{weights, kv_cache}"`, as vLLM prints a set of tags.
std::string describe(const std::vector<memory_tag>& tags);

} // namespace troupe
