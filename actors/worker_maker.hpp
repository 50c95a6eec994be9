#pragma once

/// @file
/// Where the worker that takes a dead one's place comes from: for a worker a node gave,
/// one leased again from the nodes (`replacement_leases`); for a worker of this process,
/// or one published on its own (which nothing here can start again), one of this process
/// that the executor's factory makes.

#include "actors/cluster/lease.hpp"
#include "actors/supervisor.hpp"
#include "messages/protocols.hpp"
#include "troupe/config.hpp"

#include <caf/actor.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace troupe {

class worker_maker {
public:
  /// Makes the replacements of the workers at `places` (by rank; a replacement's place is
  /// written there), leased for `lease_holder` under `cfg`, or made by `factory` (none: a
  /// worker of this process cannot be replaced). Every replacement is added to
  /// `replacements`.
  worker_maker(const executor_config& cfg, worker_factory factory, caf::actor lease_holder,
               std::shared_ptr<replacement_list> replacements, std::vector<worker_place>& places);

  /// Why the dead worker of `rank` (one of this process: `local`) cannot be replaced;
  /// empty when it can.
  std::string refusal(int32_t rank, bool local) const;

  /// Makes the replacement of `rank` and hands it to `made`, or why none came to `failed`.
  /// A lease answers later, from `self`'s thread: `wanted()` then says whether the
  /// replacement is still wanted (a lease no longer wanted ends with its holder).
  void make(supervisor_actor::pointer self, int32_t rank, std::function<bool()> wanted,
            std::function<void(worker_actor)> made, std::function<void(caf::error)> failed);

  /// Asks no node further (the executor shuts down).
  void stop();

private:
  worker_factory factory_;
  std::unique_ptr<replacement_leases> leases_;
  std::shared_ptr<replacement_list> replacements_;
  std::vector<worker_place>& places_;
};

} // namespace troupe
