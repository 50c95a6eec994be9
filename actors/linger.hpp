#pragma once

#include "troupe/config.hpp"
#include "troupe/errors.hpp"

#include <chrono>
#include <string>

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

/// Throws `invalid_argument` naming `field` unless `linger` is between 0 and `max_linger`.
inline void check_linger(timeout_type linger, const char* field) {
  if (linger < timeout_type::zero() || linger > max_linger)
    throw error{errc::invalid_argument, std::string{field} + " must be between 0 and 1 s, got " +
                                          std::to_string(linger.count()) + " us"};
}

} // namespace troupe
