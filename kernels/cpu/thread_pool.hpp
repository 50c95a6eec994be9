#pragma once

/// @file
/// The threads a CPU worker computes on.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace troupe::cpu {

/// A fixed set of threads that run the parts of one kernel call at a time, the calling
/// thread included. Between the calls of a step the helpers spin for a short while (a step
/// makes hundreds of calls, microseconds apart, and a sleeping thread takes tens of
/// microseconds to wake); idle longer than that, they sleep and cost no CPU.
class thread_pool {
public:
  /// `threads` in all, the caller included (at least 1).
  explicit thread_pool(int threads);
  ~thread_pool();

  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  int size() const {
    return static_cast<int>(helpers_.size()) + 1;
  }

  /// Calls `part(i)` for every i in [0, parts), spread over the threads; returns once all
  /// are done. Not reentrant: one call at a time, from one thread.
  void run(int64_t parts, const std::function<void(int64_t)>& part);

private:
  void help();
  void work();

  std::vector<std::thread> helpers_;
  /// Bumped for each call; a helper that sees a new value joins in.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> busy_{0};
  int64_t parts_ = 0;
  const std::function<void(int64_t)>* part_ = nullptr;
  std::atomic<bool> stop_{false};
  std::mutex mtx_;
  std::condition_variable wake_;
  /// Helpers asleep on `wake_`.
  int sleeping_ = 0;
};

} // namespace troupe::cpu
