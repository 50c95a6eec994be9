#pragma once

/// @file
/// The replacement of dead workers under a restart policy (`executor_config::restart`):
/// whether a death may be replaced (one at a time, at most `max_restarts` in the policy's
/// window), the replacement's course (a fresh worker put in the dead one's place, then the
/// steps that bring it to the others' state, one after another), and what waits for it:
/// calls of the facade made meanwhile, work the dead rank left (`leave`), hooks (`after`).
/// The supervisor (`recovery_host`) knows how to make a worker and what the others' state
/// is; this object knows where a replacement stands.

#include "actors/gather_table.hpp"
#include "messages/messages.hpp"
#include "troupe/config.hpp"

#include <spdlog/logger.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace troupe {

/// One step of bringing a replacement to the others' state: calls `next` once, with its
/// error or none.
using step_fn = std::function<void(std::function<void(caf::error)>)>;

/// Runs `steps` one after another; `done` gets the first error, or none.
void run_steps(std::shared_ptr<std::vector<step_fn>> steps, std::function<void(caf::error)> done);

/// A callable that runs `then` at its `n`-th call (`n` > 0): the end of `n` calls made
/// side by side.
std::function<void()> after_calls(size_t n, std::function<void()> then);

/// A gather of `ask` on `ranks` (labelled "replacement: `label`") as a step, bounded by
/// `timeout`.
step_fn gather_step(gather_table& gathers, std::string label, std::vector<int32_t> ranks,
                    ask_fn ask, timeout_type timeout);

/// What a replacement needs of the supervisor.
class recovery_host {
public:
  virtual ~recovery_host() = default;

  /// Rank `rank` died and will be replaced: the calls in flight fail with `lost`, and what
  /// depended on the dead worker ends (the execution loop, the KV cache).
  virtual void lose_work(int32_t rank, const caf::error& lost) = 0;

  /// Has `recovery::start(rank)` called once the requests already in the mailbox ran (they
  /// fail: their rank is gone).
  virtual void start_later(int32_t rank) = 0;

  /// Makes a worker for `rank`, of this process or leased from a node, and calls `made` with
  /// it or `failed` with why not; neither once the executor failed meanwhile.
  virtual void make_worker(int32_t rank, std::function<void(worker_actor)> made,
                           std::function<void(caf::error)> failed) = 0;

  /// Puts `fresh` in the place of the dead `rank`.
  virtual void install(int32_t rank, worker_actor fresh) = 0;

  /// The steps that bring the worker in `rank`'s place to the others' state.
  virtual std::vector<step_fn> catch_up(int32_t rank) = 0;

  /// The executor fails with `why`, unless it failed already; returns its failure.
  virtual caf::error fail(caf::error why) = 0;

  /// Where `rank` runs, for the log ("in this process", "on node H:P").
  virtual std::string whereabouts(int32_t rank) const = 0;

  /// Makes a call of the facade that waited for the replacement (`until`: its deadline).
  virtual void resume(async_call call, std::chrono::steady_clock::time_point until) = 0;
};

/// Where the replacement of a dead worker stands, and what waits for it.
class recovery {
public:
  using clock_type = std::chrono::steady_clock;

  /// `step_timeout` bounds each step of a replacement and each leftover call.
  recovery(recovery_host& host, gather_table& gathers, restart_policy policy,
           timeout_type step_timeout, std::shared_ptr<spdlog::logger> log)
    : host_(host), gathers_(gathers), policy_(policy), step_timeout_(step_timeout),
      log_(std::move(log)) {}

  /// The executor has `ranks` workers (replacements are counted per rank).
  void started(size_t ranks) {
    rank_restarts_.assign(ranks, 0);
  }

  /// Whether a replacement is under way.
  bool under_way() const {
    return under_way_;
  }

  /// The rank being replaced (while `under_way`).
  int32_t rank() const {
    return rank_;
  }

  /// The dead worker is still in its rank's place: its replacement is not up yet, and
  /// what is sent to it is never answered.
  bool dead_in_place() const {
    return dead_in_place_;
  }

  /// Why the worker being replaced died.
  const std::string& cause() const {
    return cause_;
  }

  /// What a call whose work the death lost fails with: `worker_replaced`, naming the cause.
  caf::error lost_work() const;

  /// The replacement under way, in words ("recovering rank N for S s (cause)"); empty
  /// when none is.
  std::string status() const;

  /// Replacements of `rank` so far.
  int32_t restarts(size_t rank) const {
    return rank < rank_restarts_.size() ? rank_restarts_[rank] : 0;
  }

  /// Why one more death cannot be replaced now (one at a time, and the policy's count in
  /// its window); empty when it can.
  std::string refusal();

  /// The worker of `rank` died of `cause` and will be replaced: the calls in flight lose
  /// their work, and calls made from now on wait (`defer`).
  void begin(int32_t rank, std::string cause);

  /// Makes the replacement of `rank` and brings it to the others' state
  /// (`recovery_host::start_later`).
  void start(int32_t rank);

  /// Keeps `call` until the replacement under way ends (`until`: its deadline, when it
  /// waited before); false when none is, or the call was admitted.
  bool defer(async_call& call, std::optional<clock_type::time_point> until);

  /// Fails the calls that waited for the replacement as long as they may, and arms the
  /// deadline of the others.
  void expire_waiting(clock_type::time_point now);

  /// Runs `hook` once the replacement under way ends (with its error, if it failed).
  void after(std::function<void(caf::error)> hook) {
    hooks_.push_back(std::move(hook));
  }

  /// Runs the hooks that wait (`failed`: why there is no replacement).
  void run_hooks(const caf::error& failed);

  /// A call that `rank` could not make, for its next replacement to make first (a save's
  /// staged part it did not remove: same rank, same folder).
  void leave(int32_t rank, std::string label, ask_fn ask) {
    leftovers_[rank].push_back({std::move(label), std::move(ask)});
  }

  /// Makes the calls that `rank` left on the worker now in its place, then `then`. A failed
  /// one is logged and not made again: what it would have removed stays.
  void make_leftover_calls(int32_t rank, std::function<void()> then);

private:
  void bring_up(int32_t rank, worker_actor fresh);
  void end(int32_t rank, caf::error err);

  struct waiting_call {
    async_call call;
    /// `time_point::max()` when the call may wait for ever.
    clock_type::time_point until;
  };
  struct leftover {
    std::string label;
    ask_fn ask;
  };

  recovery_host& host_;
  gather_table& gathers_;
  restart_policy policy_;
  timeout_type step_timeout_;
  std::shared_ptr<spdlog::logger> log_;
  bool under_way_ = false;
  int32_t rank_ = -1;
  bool dead_in_place_ = false;
  std::string cause_;
  clock_type::time_point began_;
  /// When the replacements within the policy's window began.
  std::deque<clock_type::time_point> recent_;
  std::vector<int32_t> rank_restarts_;
  std::vector<waiting_call> waiting_;
  std::vector<std::function<void(caf::error)>> hooks_;
  std::map<int32_t, std::vector<leftover>> leftovers_;
};

} // namespace troupe
