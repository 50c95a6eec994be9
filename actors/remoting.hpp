#pragma once

#include "troupe/config.hpp"

#include <caf/actor_system_config.hpp>

namespace troupe {

/// Turns on BASP heartbeats (every quarter of `timeout`) and drops connections silent for
/// `timeout`, so that a peer that is cut off or stopped is noticed.
void configure_heartbeats(caf::actor_system_config& cfg, timeout_type timeout);

} // namespace troupe
