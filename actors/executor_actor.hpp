#pragma once

#include "messages/protocols.hpp"
#include "troupe/config.hpp"

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace troupe {

/// Where a worker runs, for the report of its death: `host` is empty for a worker of this
/// process, else the `kind` of peer ("node", "worker host") at `host`:`port`.
struct worker_place {
  std::string kind;
  std::string host;
  uint16_t port = 0;
};

/// What an `async_call` runs with: the supervisor, on its own thread, to make the call's
/// request to itself.
struct supervisor_access {
  supervisor_actor::pointer self;
  /// What is left of the call's deadline: infinite for a call made as it arrives (its
  /// request carries its deadline), what remains for one that waited for a replacement.
  caf::duration left = caf::infinite;
};

/// The workers a supervisor spawned or leased to replace dead ones, for the facade's
/// shutdown (which handles them as it does the first ones). The supervisor adds to it; the
/// facade reads it as it stops.
struct replacement_list {
  std::mutex mtx;
  /// Spawned in this process.
  std::vector<worker_actor> workers;
  /// Leased from nodes (held by the lease holder).
  std::vector<worker_actor> leased;
};

/// Spawns the supervisor (interface `supervisor_actor`, messages/protocols.hpp): it
/// monitors `workers` (rank order, local or remote; `places` says where each runs),
/// scatters and gathers every collective call, runs the distributed execution loop and
/// keeps the sleep/wake state machine. Under `cfg.restart` it replaces a dead worker of
/// this process with one that `factory` makes, and one leased from a node with one leased
/// for `lease_holder` (`restart_policy`), and lists it in `replacements`.
supervisor_actor spawn_supervisor(caf::actor_system& sys, const executor_config& cfg,
                                  std::vector<worker_actor> workers,
                                  std::vector<worker_place> places, worker_factory factory,
                                  caf::actor lease_holder,
                                  std::shared_ptr<replacement_list> replacements);

} // namespace troupe
