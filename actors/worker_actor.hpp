#pragma once

#include "troupe/worker.hpp"

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

#include <caf/node_id.hpp>

#include <optional>
#include <string>

namespace troupe {

/// Spawns a detached worker actor (its own OS thread). The worker object is created with
/// `factory` on that thread when the executor initialises the actor with its rank.
///
/// Protocol (every reply to the executor is `(ok_atom, caf::message result)` or an error):
/// - `(init_atom, worker_context, std::vector<caf::actor> peers)`: create the worker
///   object, bind the device, load the model; replies `worker_info`. `peers` are the other
///   ranks, used by the driver to hand on steps of the execution loop.
/// - `(call_atom, method, args, kwargs)`: runs a registered method.
///   `"start_worker_execution_loop"` answers only when the loop stops.
/// - `(call_atom, local_call)`: runs an in-process callable.
/// - `(execute_atom, execute_model_request)`: driver step; hands the step to the peers,
///   then computes and replies `std::vector<sampler_output>`.
/// - `(execute_atom, stop_loop_atom)`: driver tells every peer to leave the loop.
/// - `(step_atom, execute_model_request)` / `(step_atom, stop_loop_atom)`: from the driver.
caf::actor spawn_worker(caf::actor_system& sys, worker_factory factory);

/// What a node decides for a worker it leases, whatever the executor's context says.
struct node_placement {
  /// The device the worker owns on the node ("cpu" or "cuda", and its index).
  std::string device_kind = "cpu";
  int32_t device_index = 0;
  /// Where its collective listens (the node's address).
  std::string collective_host;
};

/// A worker a node leased to the executor on node `owner`: it serves only messages from
/// that node, its own node and, after init, its peers' nodes; others are refused and
/// logged (exit messages included). Its device and collective address are the node's
/// `placement`.
caf::actor spawn_leased_worker(caf::actor_system& sys, worker_factory factory,
                               caf::node_id owner, node_placement placement);

/// Turns an exception thrown inside a worker into an error reply that names the rank and
/// the method.
caf::error worker_failure(int32_t rank, const std::string& method);

} // namespace troupe
