#pragma once

/// @file
/// The executor's half of a lease (the node's half is the gate in `actors/cluster/node.cpp`).

#include "troupe/config.hpp"

#include <caf/actor.hpp>
#include <caf/blocking_actor.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace troupe {

class link_client;

/// What a node gave: the workers, and the call link to them (none with `node_links` off,
/// or when the node refused it; calls then go over BASP).
struct node_grant {
  std::vector<caf::actor> workers;
  std::shared_ptr<link_client> link;
};

/// Connects to node `n` (the secret proved before any BASP byte, or TLS), proves the
/// secret to its gate and leases `count` workers of `cfg.node_worker_kind` for `holder`
/// (the actor whose end releases them), then opens the call link to them (proving the
/// secret or, under TLS, the executor's certificate), all before
/// `deadline`. `self` makes the requests and blocks for the replies: the facade's scoped
/// actor, or a helper of the supervisor. Throws `troupe::error`: `worker_died` when the
/// node cannot be reached or does not answer in time, `invalid_argument` when it refuses.
node_grant lease_workers(caf::blocking_actor* self, const executor_config& cfg,
                         const node_address& n, int32_t count, const caf::actor& holder,
                         std::chrono::steady_clock::time_point deadline);

/// "node HOST:PORT", as errors and logs name a node.
std::string node_name(const node_address& n);

} // namespace troupe
