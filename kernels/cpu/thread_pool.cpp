#include "kernels/cpu/thread_pool.hpp"

#include "kernels/cpu/spin_wait.hpp"

#include <chrono>

namespace troupe::cpu {

namespace {

/// How long an idle helper spins before it sleeps: longer than the gaps between the
/// kernel calls of a step, far shorter than the gaps between steps that wait for a caller.
constexpr auto spin_for = std::chrono::microseconds(200);

} // namespace

thread_pool::thread_pool(int threads) {
  for (int i = 1; i < threads; ++i)
    helpers_.emplace_back([this] { help(); });
}

thread_pool::~thread_pool() {
  {
    std::lock_guard<std::mutex> lk{mtx_};
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : helpers_)
    t.join();
}

void thread_pool::work() {
  for (;;) {
    auto i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= parts_)
      return;
    (*part_)(i);
  }
}

void thread_pool::run(int64_t parts, const std::function<void(int64_t)>& part) {
  if (parts <= 0)
    return;
  if (helpers_.empty() || parts == 1) {
    for (int64_t i = 0; i < parts; ++i)
      part(i);
    return;
  }
  parts_ = parts;
  part_ = &part;
  next_.store(0, std::memory_order_relaxed);
  busy_.store(static_cast<int>(helpers_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk{mtx_};
    if (sleeping_ > 0)
      wake_.notify_all();
  }
  work();
  // Every helper checks in, having seen this generation, before the next call changes
  // what they read.
  while (busy_.load(std::memory_order_acquire) > 0)
    spin_pause();
}

void thread_pool::help() {
  uint64_t seen = 0;
  for (;;) {
    spin_then_wait([&] { return generation_.load(std::memory_order_acquire) != seen || stop_; },
                   spin_for, mtx_, wake_, sleeping_);
    if (stop_)
      return;
    seen = generation_.load(std::memory_order_acquire);
    work();
    busy_.fetch_sub(1, std::memory_order_release);
  }
}

} // namespace troupe::cpu
