#pragma once

/// @file
/// Waiting for another thread of one step: spin first, then sleep.

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace troupe::cpu {

/// Tells the core this thread is spinning (lets its sibling hyperthread run).
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

/// Waits until `done()` holds. Spins for `spin` first, because the threads of a step arrive
/// within microseconds of each other and a sleeping thread takes tens of microseconds to
/// wake; then sleeps on `wake` under `mtx`, counted in `sleeping` so that whoever makes
/// `done()` true knows to notify. Returns false when `until` passes first.
template <class Done>
bool spin_then_wait(
  Done done, std::chrono::microseconds spin, std::mutex& mtx, std::condition_variable& wake,
  int& sleeping,
  std::chrono::steady_clock::time_point until = std::chrono::steady_clock::time_point::max()) {
  auto start = std::chrono::steady_clock::now();
  int polls = 0;
  while (!done()) {
    spin_pause();
    if (++polls % 64 != 0 || std::chrono::steady_clock::now() - start < spin)
      continue;
    std::unique_lock<std::mutex> lk{mtx};
    ++sleeping;
    bool passed = until == std::chrono::steady_clock::time_point::max()
                    ? (wake.wait(lk, done), true)
                    : wake.wait_until(lk, until, done);
    --sleeping;
    return passed;
  }
  return true;
}

} // namespace troupe::cpu
