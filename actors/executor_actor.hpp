#pragma once

#include "troupe/config.hpp"

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

#include <vector>

namespace troupe {

/// Spawns the supervisor: it monitors `workers` (rank order, local or remote), scatters
/// and gathers every collective call, runs the distributed execution loop and keeps the
/// sleep/wake state machine. Its message interface is private to the facade
/// (`actors/executor.cpp`); the handlers are documented there.
caf::actor spawn_supervisor(caf::actor_system& sys, const executor_config& cfg,
                            std::vector<caf::actor> workers);

} // namespace troupe
