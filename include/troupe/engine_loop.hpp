#pragma once

/// @file
/// `troupe::engine_loop`: the engine online (vLLM's `AsyncLLM` loop). A thread of its own
/// steps a `troupe::llm` while requests join and leave between steps, and hands each
/// update to its request's sink. `troupe serve` answers HTTP over one; a program that
/// serves requests some other way can use it as well.

#include "troupe/errors.hpp"
#include "troupe/llm.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace troupe {

/// Why the loop refused a request or ended it unfinished.
enum class request_failure_kind : uint8_t {
  /// The engine refused the request, or a step computing it failed; `code` says why.
  engine_error,
  /// More requests than the capacity are running or waiting.
  overloaded,
  /// The executor failed for good (a worker died and none replaced it); later requests
  /// are refused the same way.
  engine_failed,
  /// Its LoRA adapter was unloaded while it ran.
  adapter_unloaded,
  /// It names a LoRA adapter unloaded before the request reached the engine.
  adapter_missing,
  /// The loop stopped before the request finished.
  stopped,
  /// Anything else (a bug's last stop).
  internal,
};

/// A request refused by the loop or ended unfinished: what happened, and in words.
struct request_failure : std::runtime_error {
  request_failure(request_failure_kind kind, const std::string& message, errc code = errc::none)
    : std::runtime_error(message), kind(kind), code(code) {}
  request_failure_kind kind;
  /// The engine's error code for `engine_error` (`errc::none` otherwise).
  errc code;
};

/// Where a request's updates go (a client's connection, say), and what the loop keeps of
/// it for the request's times. Its functions run on the loop's thread and should only
/// hand the update on.
struct request_sink {
  virtual ~request_sink() = default;
  virtual void update(const generation_update& u) = 0;
  virtual void fail(const request_failure& f) = 0;

  /// The engine's request id, once added (-1 before).
  int64_t id = -1;
  /// Samples not finished (of the request's `n`).
  int32_t samples_left = 1;
  /// The LoRA adapter it is computed with (0: the base model).
  int64_t lora_id = 0;
  /// Set by `engine_loop::abort`: a request not yet added is then never added.
  std::atomic<bool> cancelled{false};
  std::chrono::steady_clock::time_point arrived = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_token;
  /// Seconds to the first token of any sample (-1 before it).
  double first_token = -1;
  /// Seconds between the first sample's tokens.
  std::vector<double> gaps;
};

/// What the loop reports besides the updates (a server's metrics, say). Called on the
/// loop's thread.
struct engine_loop_observer {
  virtual ~engine_loop_observer() = default;
  /// A request's samples all finished: the last one's finish reason, and its times in
  /// seconds (to the first token, between the first sample's tokens, in all).
  virtual void finished(const std::string& reason, double first_token,
                        const std::vector<double>& gaps, double total) = 0;
  /// The engine's counts after each round of the loop.
  virtual void stepped(const engine_stats& stats) = 0;
};

/// The engine's thread: runs commands (adds, aborts, admin calls) between steps, steps
/// while requests are unfinished, and hands each update to its request's sink. A step
/// that fails ends the requests it computed and the loop goes on (a sleeping executor,
/// say); a dead worker ends every request and fails every later one.
class engine_loop {
public:
  /// Starts the thread over `model` (which must outlive the loop). At most `capacity`
  /// requests run or wait at once.
  engine_loop(llm& model, engine_loop_observer& observer, int64_t capacity);
  /// Stops (see `stop`) and waits for the thread to end.
  ~engine_loop();

  engine_loop(const engine_loop&) = delete;
  engine_loop& operator=(const engine_loop&) = delete;

  /// Has the thread end after its current round, from any thread (the loop's too):
  /// requests not finished, queued ones included, fail with `request_failure_kind::stopped`
  /// and are aborted in the engine; commands of `post` not yet run are dropped; later
  /// submissions are refused as stopped.
  void stop();

  /// Runs `f` on the engine's thread, between steps. An exception out of `f` is logged,
  /// so `f` answers its own errors. Dropped if the loop stops first.
  void post(std::function<void(llm&)> f);

  /// Queues a generation. Throws `request_failure` (`overloaded`) beyond the capacity,
  /// (`engine_failed`) once the executor failed and (`stopped`) once the loop stopped. A request
  /// the engine refuses (a bad token id, say) fails at its own sink and touches no other.
  void submit(generation_request g, std::shared_ptr<request_sink> sink);

  /// Aborts the request of `sink` (its client went away).
  void abort(std::shared_ptr<request_sink> sink);

  /// Aborts every request (the end of a drain).
  void abort_all();

  /// Engine thread only (inside a `post`), before LoRA adapter `lora_id` goes: ends the
  /// requests computed with it (`adapter_unloaded`, with `message`), and only those;
  /// requests that name it and are still on their way to the engine fail with
  /// `adapter_missing` (adding them would load it again).
  void unload_lora(int64_t lora_id, const std::string& message);

  /// Requests added or queued and not finished.
  int64_t active() const {
    return active_;
  }

  /// Whether the executor failed for good.
  bool failed() const {
    return failed_;
  }

  /// Why it failed (empty before).
  std::string failure() const;

private:
  using sink_map = std::map<int64_t, std::shared_ptr<request_sink>>;
  struct command {
    std::function<void(llm&)> run;
    /// Runs in the round the loop stops in too (a generation, which then fails at its
    /// sink).
    bool at_stop = false;
  };

  /// False once the loop's last round took its commands (the command never runs).
  bool enqueue(std::function<void(llm&)> f, bool at_stop);

  void run();
  void dispatch(const generation_update& u);
  /// Ends the request of `at` with `why` in the engine and at its sink.
  void drop(sink_map::iterator at, const request_failure& why);
  /// A step failed and the engine can go on: the requests in the engine get the error
  /// and are aborted there.
  void fail_requests(const request_failure& why);
  /// The executor failed for good: every request gets the error, and later ones too.
  void fail_all(const error& e);
  request_failure engine_failed() const;
  static request_failure stopped();

  llm& model_;
  engine_loop_observer& observer_;
  const int64_t capacity_;
  mutable std::mutex mtx_;
  std::condition_variable cv_;
  std::deque<command> commands_;
  /// Set under `mtx_`; read by commands on the loop's thread too.
  std::atomic<bool> stop_{false};
  /// The last round took its commands (under `mtx_`).
  bool ended_ = false;
  std::atomic<bool> failed_{false};
  std::string failure_;
  std::atomic<int64_t> active_{0};
  /// Engine thread only.
  sink_map sinks_;
  std::set<int64_t> unloaded_loras_;
  std::thread thread_;
};

} // namespace troupe
