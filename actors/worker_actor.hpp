#pragma once

#include "messages/protocols.hpp"
#include "troupe/worker.hpp"

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

#include <caf/node_id.hpp>

#include <memory>
#include <optional>
#include <string>

namespace troupe {

/// What a leased worker reads besides its mailbox while it lingers (its node's call links:
/// `link_readers::member`, `actors/cluster/link_server.hpp`), from its spawn to its end.
class linger_reader {
public:
  virtual ~linger_reader() = default;
  /// The worker starts (true) or stops (false) reading as it lingers.
  virtual void reading(bool on) = 0;
  /// Reads what came and hands it on; true when any came.
  virtual bool pump() = 0;
};

/// Spawns a detached worker actor (its own OS thread), with the interface `worker_actor`
/// (`messages/protocols.hpp`). The worker object is created with `factory` on that thread
/// when the executor initialises the actor with its rank.
worker_actor spawn_worker(caf::actor_system& sys, worker_factory factory);

/// What a node decides for a worker it leases, whatever the executor's context says.
struct node_placement {
  /// The device the worker owns on the node, and its index.
  device_kind device_type = device_kind::cpu;
  int32_t device_index = 0;
  /// Where its collective listens (the node's address).
  std::string collective_host;
};

/// A worker a node leased to the executor on node `owner`: it serves only messages from
/// that node, its own node and, after init, its peers' nodes; others are refused and
/// logged (exit messages included). Its device and collective address are the node's
/// `placement`. While it lingers it reads the node's call links (`reader`, its own).
worker_actor spawn_leased_worker(caf::actor_system& sys, worker_factory factory, caf::node_id owner,
                                 node_placement placement, std::shared_ptr<linger_reader> reader);

/// Turns an exception thrown inside a worker into an error reply that names the rank and
/// the method.
caf::error worker_failure(int32_t rank, const std::string& method);

} // namespace troupe
