#pragma once

#include "messages/protocols.hpp"
#include "troupe/config.hpp"

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace troupe {

class link_set;
class link_client;

/// Where a worker runs, for the report of its death: `host` is empty for a worker of this
/// process, else the `kind` of peer ("node", "worker host") at `host`:`port`.
struct worker_place {
  std::string kind;
  std::string host;
  uint16_t port = 0;
  /// The call link to the worker's node, if any (`actors/cluster/link_socket.hpp`).
  std::shared_ptr<link_client> link;
};

struct supervisor_state;

/// Where the answer of a call made through `supervisor_access` goes: called once, from
/// whichever thread finishes the call (the worker that replied last, or the supervisor's
/// with an error).
template <class T>
using reply_to = std::function<void(caf::expected<T>)>;

/// What an `async_call` runs with, in the supervisor's place (on whichever thread runs it):
/// to make the call's request to the supervisor itself, or one of the calls below.
struct supervisor_access {
  supervisor_actor::pointer self;
  supervisor_state* state;
  /// What is left of the call's deadline: `wait_forever` for a call made as it arrives
  /// (its request carries its deadline), what remains for one that waited for a
  /// replacement.
  timeout_type left = wait_forever;

  /// `left` as the timeout of a request to the supervisor.
  caf::duration request_timeout() const {
    return left == wait_forever ? caf::duration{caf::infinite} : caf::duration{left};
  }

  /// The shorter of `timeout` and `left`.
  timeout_type within(timeout_type timeout) const {
    return std::min(timeout, left);
  }

  /// collective_rpc of the named `method`, with `opts.timeout_us` or what is `left`.
  void collective_rpc(const std::string& method, caf::message args, caf::settings kwargs,
                      const rpc_options& opts, reply_to<std::vector<caf::message>> reply);

  /// execute_model through the driver, within `timeout` or what is `left`.
  void execute_model(execute_model_request req, timeout_type timeout,
                     reply_to<std::vector<sampler_output>> reply);
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
/// for `lease_holder` (`restart_policy`), and lists it in `replacements`. It reads the
/// call links of `places` and adds them to `links`.
supervisor_actor spawn_supervisor(caf::actor_system& sys, const executor_config& cfg,
                                  std::vector<worker_actor> workers,
                                  std::vector<worker_place> places, worker_factory factory,
                                  caf::actor lease_holder,
                                  std::shared_ptr<replacement_list> replacements,
                                  std::shared_ptr<link_set> links);

} // namespace troupe
