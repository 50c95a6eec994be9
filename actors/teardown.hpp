#pragma once

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>

#include <chrono>
#include <memory>

namespace troupe {

/// Destroys `sys` and then `cfg` (which it reads to the end) on a thread of their own and
/// waits up to `wait` for it. Destroying a system waits for every actor; when that takes
/// longer, the thread is left to finish on its own rather than hang the caller, and false
/// is returned. Both pointers are empty afterwards either way.
bool destroy_within(std::unique_ptr<caf::actor_system>& sys,
                    std::unique_ptr<caf::actor_system_config>& cfg, std::chrono::milliseconds wait);

} // namespace troupe
