#pragma once

#include "troupe/config.hpp"

#include <chrono>

#include <sched.h>

namespace troupe {

/// Waits up to `time` for `arrived()`, yielding the core to any thread that is ready to
/// run (`executor_config::linger`); returns whether it arrived.
template <class Arrived>
bool linger_for(timeout_type time, Arrived arrived) {
  auto until = std::chrono::steady_clock::now() + time;
  bool got = arrived();
  while (!got && std::chrono::steady_clock::now() < until) {
    sched_yield();
    got = arrived();
  }
  return got;
}

} // namespace troupe
