#pragma once

/// @file
/// The engine's thread under the server: requests join and leave between steps, and each
/// update goes to its request's sink.

#include "server/metrics.hpp"
#include "server/openai.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

namespace troupe {

/// The http_error of a troupe::error from the engine or the executor: the client's own
/// mistakes are 400, a sleeping model 503, the rest 500.
http_error from_engine(const error& e);

/// Where a request's updates go (its connection), and what the engine's thread keeps of
/// it for the metrics.
struct request_sink {
  virtual ~request_sink() = default;
  virtual void update(const generation_update& u) = 0;
  virtual void fail(const http_error& e) = 0;

  int64_t id = -1; // the engine's, once added
  /// Samples not finished (of the request's `n`).
  int32_t samples_left = 1;
  /// The LoRA adapter it is computed with (0: the base model).
  int64_t lora_id = 0;
  std::atomic<bool> cancelled{false};
  std::chrono::steady_clock::time_point arrived = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_token;
  double first_token = -1;
  std::vector<double> gaps;
};

/// The engine's thread: runs commands (adds, aborts, admin calls) between steps, steps
/// while requests are unfinished, and hands each update to its request's sink.
class engine_loop {
public:
  engine_loop(llm& model, server_metrics& metrics, int64_t capacity);
  ~engine_loop();

  engine_loop(const engine_loop&) = delete;
  engine_loop& operator=(const engine_loop&) = delete;

  /// Runs `f` on the engine's thread, between steps.
  void post(std::function<void(llm&)> f);

  /// Queues a generation; throws http_error 429 beyond the capacity, 503 once the engine
  /// failed. A request the engine refuses (a bad token id, say) gets its own error and
  /// touches no other.
  void submit(generation_request g, std::shared_ptr<request_sink> sink);

  /// Aborts the request of `sink` (a client gone).
  void abort(std::shared_ptr<request_sink> sink);

  /// Aborts every request (the end of a drain).
  void abort_all();

  /// Engine thread only (inside a `post`), before LoRA adapter `lora_id` goes: ends the
  /// requests computed with it with `why`, and only those; requests that name it and are
  /// still on their way to the engine are refused (adding them would load it again).
  void unload_lora(int64_t lora_id, const http_error& why);

  /// Requests added or queued and not finished.
  int64_t active() const {
    return active_;
  }

  bool failed() const {
    return failed_;
  }

  std::string failure() const;

private:
  void run();
  void dispatch(const generation_update& u);
  /// Ends the request of `at` with `why` in the engine and at its sink.
  void drop(std::map<int64_t, std::shared_ptr<request_sink>>::iterator at, const http_error& why);
  /// A step failed and the engine can go on (the workers sleep, say): the requests in the
  /// engine get the error and are aborted there.
  void fail_requests(const http_error& why);
  /// The executor failed for good: every request gets the error, and later ones a 503.
  void fail_all(const error& e);

  llm& model_;
  server_metrics& metrics_;
  const int64_t capacity_;
  mutable std::mutex mtx_;
  std::condition_variable cv_;
  std::deque<std::function<void(llm&)>> commands_;
  bool stop_ = false;
  std::atomic<bool> failed_{false};
  std::string failure_;
  std::atomic<int64_t> active_{0};
  /// Engine thread only.
  std::map<int64_t, std::shared_ptr<request_sink>> sinks_;
  std::set<int64_t> unloaded_loras_;
  std::thread thread_;
};

} // namespace troupe
