#pragma once

/// @file
/// The distributed execution loop (vLLM's parallel worker tasks): while steps run, the
/// driver's peers sit in a loop that takes each step from the driver instead of from the
/// supervisor. The supervisor starts the loop with the first step; `stop` (vLLM's
/// `stop_remote_worker_execution_loop`) has the driver end it. A task that fails is
/// reported once, by the next step or stop; each loop has its own id, so late news of an
/// old loop never touches a newer one.

#include "actors/gather_table.hpp"
#include "messages/protocols.hpp"
#include "troupe/config.hpp"

#include <caf/typed_response_promise.hpp>

#include <cstdint>
#include <functional>
#include <vector>

namespace troupe {

class execution_loop {
public:
  /// Tells rank `rank` to leave loop `id` (its message goes where the rank's calls go).
  using leave_fn = std::function<void(int32_t rank, int64_t id)>;

  /// The loop of the driver's `peers` (ranks 1..), whose tasks are gathers of `gathers`;
  /// the driver's stop is bounded by `timeout`.
  execution_loop(gather_table& gathers, std::vector<int32_t> peers, timeout_type timeout,
                 leave_fn leave);

  /// Starts the loop unless it runs or there are no peers; returns its id.
  int64_t start();

  /// The failure of a loop task that no step or stop reported yet (reported once).
  caf::error take_error();

  /// Has the driver end the loop; `rp` is answered when its tasks have ended (with the
  /// failure of a task, if one failed).
  void stop(caf::typed_response_promise<caf::ok_atom> rp);

  /// A step the driver failed leaves loop `id` suspect: its peers are told to leave it, and
  /// a failure they report for it is the one the caller already got, not news for the
  /// next call.
  void abandon(int64_t id);

  /// A worker died: the loop ended with it. The survivors leave it, and the callers of
  /// `stop` get `why`.
  void lost(const caf::error& why);

private:
  /// The tasks of loop `id` ended (normally or not): wakes the callers of stop. After a
  /// failure the peers still in that loop are told to leave it, so the next loop starts
  /// clean.
  void ended(int64_t id, gather_result res);
  void leave(int64_t id);
  void wake_stop_waiters(const caf::error& err);

  gather_table& gathers_;
  std::vector<int32_t> peers_;
  timeout_type timeout_;
  leave_fn leave_;
  /// The running loop's tasks, or null.
  gather_ptr tasks_;
  int64_t id_ = 0;
  /// A loop task that failed, and the loop it came from.
  caf::error error_;
  int64_t error_id_ = 0;
  /// Callers of `stop` waiting for the tasks to end.
  std::vector<caf::typed_response_promise<caf::ok_atom>> stop_waiters_;
};

} // namespace troupe
