#pragma once

/// @file
/// The executor's half of a lease (the node's half is the gate in `actors/node.cpp`).

#include "troupe/config.hpp"

#include <caf/actor.hpp>
#include <caf/blocking_actor.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace troupe {

/// Connects to node `n` (the secret proved before any BASP byte, or TLS), proves the
/// secret to its gate and leases `count` workers of `cfg.node_worker_kind` for `holder`
/// (the actor whose end releases them), all before `deadline`. `self` makes the requests
/// and blocks for the replies: the facade's scoped actor, or a helper of the supervisor.
/// Throws `troupe::error`: `worker_died` when the node cannot be reached or does not
/// answer in time, `invalid_argument` when it refuses.
std::vector<caf::actor> lease_workers(caf::blocking_actor* self, const executor_config& cfg,
                                      const node_address& n, int32_t count,
                                      const caf::actor& holder,
                                      std::chrono::steady_clock::time_point deadline);

/// "node HOST:PORT", as errors and logs name a node.
std::string node_name(const node_address& n);

} // namespace troupe
