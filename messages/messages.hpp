#pragma once

/// @file
/// The wire vocabulary of troupe: atoms, the internal protocol structs and the one CAF
/// type-id block that registers every type that crosses an actor-system boundary.
/// The block is append-only: new entries go at its end.

#include "messages/worker_calls.hpp"
#include "troupe/config.hpp"
#include "troupe/types.hpp"
#include "troupe/worker.hpp"

#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>
#include <caf/type_id.hpp>

#include <functional>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

namespace troupe {

/// A callable for `collective_rpc` that runs in the worker's process. Never serialised:
/// the executor refuses to send it to a worker in another process.
struct local_call {
  /// Name shown in errors and profiles.
  std::string label;
  worker_method fn;
  caf::message args;
  caf::settings kwargs;
  /// Set by a blocking caller that gave up (deadline, another rank's error): workers that
  /// have not run the callable yet skip it, because it may refer to the caller's stack.
  /// Workers hold it shared while running the callable; the caller takes it exclusively
  /// to cancel, which waits for runs in progress.
  struct guard_type {
    std::shared_mutex mtx;
    bool cancelled = false;
  };
  std::shared_ptr<guard_type> guard;
};

/// What an `async_call` gets to make its request with; defined by the supervisor
/// (`actors/supervisor.hpp`).
struct supervisor_access;

/// A call of the facade. The host thread hands it to the supervisor (and runs the
/// supervisor itself when it is idle, see `hand_to_supervisor`), which makes the call: as
/// a request to itself, or through `supervisor_access`, whose replies go from the workers
/// straight to the caller's future. Calls made one after another keep their order, and an
/// async call costs no hop more than a blocking one. Never leaves the process.
struct async_call {
  std::function<void(supervisor_access&)> request;
  /// Fails the call without making it (it waited past `timeout` for a replacement).
  std::function<void(const caf::error&)> fail;
  /// How long the call may wait before it is made; `wait_forever` for no limit.
  timeout_type timeout = wait_forever;
  /// Set on a call the supervisor sent itself to make it behind what its mailbox already
  /// holds: it runs as it comes (see `send_direct` in actors/executor.cpp).
  bool admitted = false;
};

/// The workers of a group in rank order, as typed handles (`messages/protocols.hpp`).
struct worker_handles;

/// Deadline and fan-out of one collective call (executor-internal).
struct rpc_options {
  /// Microseconds; `wait_forever.count()` for no deadline.
  int64_t timeout_us = 0;
  /// Workers asked at once; 0 asks all.
  int32_t max_concurrent_workers = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rpc_options& x) {
  return f(caf::meta::type_name("rpc_options"), x.timeout_us, x.max_concurrent_workers);
}

} // namespace troupe

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::local_call)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::async_call)

CAF_BEGIN_TYPE_ID_BLOCK(troupe, caf::first_custom_type_id)

CAF_ADD_TYPE_ID(troupe, (troupe::memory_tag))
CAF_ADD_TYPE_ID(troupe, (troupe::sampling_params))
CAF_ADD_TYPE_ID(troupe, (troupe::sequence_data))
CAF_ADD_TYPE_ID(troupe, (troupe::sequence_group_metadata))
CAF_ADD_TYPE_ID(troupe, (troupe::block_move))
CAF_ADD_TYPE_ID(troupe, (troupe::execute_model_request))
CAF_ADD_TYPE_ID(troupe, (troupe::token_logprob))
CAF_ADD_TYPE_ID(troupe, (troupe::sequence_output))
CAF_ADD_TYPE_ID(troupe, (troupe::sequence_group_output))
CAF_ADD_TYPE_ID(troupe, (troupe::sampler_output))
CAF_ADD_TYPE_ID(troupe, (troupe::lora_request))
CAF_ADD_TYPE_ID(troupe, (troupe::prompt_adapter_request))
CAF_ADD_TYPE_ID(troupe, (troupe::cache_blocks))
CAF_ADD_TYPE_ID(troupe, (troupe::sleep_request))
CAF_ADD_TYPE_ID(troupe, (troupe::wake_request))
CAF_ADD_TYPE_ID(troupe, (troupe::sharded_state_request))
CAF_ADD_TYPE_ID(troupe, (troupe::memory_usage))
CAF_ADD_TYPE_ID(troupe, (troupe::worker_info))
CAF_ADD_TYPE_ID(troupe, (troupe::worker_health))
CAF_ADD_TYPE_ID(troupe, (troupe::worker_context))
CAF_ADD_TYPE_ID(troupe, (std::vector<troupe::sampler_output>))
CAF_ADD_TYPE_ID(troupe, (std::vector<troupe::memory_tag>))
CAF_ADD_TYPE_ID(troupe, (std::vector<troupe::worker_health>))
CAF_ADD_TYPE_ID(troupe, (std::vector<int64_t>))
CAF_ADD_TYPE_ID(troupe, (std::vector<int32_t>))
CAF_ADD_TYPE_ID(troupe, (troupe::rpc_options))
CAF_ADD_TYPE_ID(troupe, (std::vector<std::vector<std::string>>))

CAF_ADD_ATOM(troupe, troupe, init_atom, "t_init")
CAF_ADD_ATOM(troupe, troupe, call_atom, "t_call")
CAF_ADD_ATOM(troupe, troupe, execute_atom, "t_execute")
CAF_ADD_ATOM(troupe, troupe, step_atom, "t_step")
CAF_ADD_ATOM(troupe, troupe, stop_loop_atom, "t_stoploop")
CAF_ADD_ATOM(troupe, troupe, rpc_atom, "t_rpc")
CAF_ADD_ATOM(troupe, troupe, blocks_atom, "t_blocks")
CAF_ADD_ATOM(troupe, troupe, init_cache_atom, "t_initcach")
CAF_ADD_ATOM(troupe, troupe, all_true_atom, "t_alltrue")
CAF_ADD_ATOM(troupe, troupe, same_set_atom, "t_sameset")
CAF_ADD_ATOM(troupe, troupe, sleep_atom, "t_sleep")
CAF_ADD_ATOM(troupe, troupe, wake_atom, "t_wake")
CAF_ADD_ATOM(troupe, troupe, sleep_state_atom, "t_sstate")
CAF_ADD_ATOM(troupe, troupe, health_atom, "t_health")
CAF_ADD_ATOM(troupe, troupe, hello_atom, "t_hello")
CAF_ADD_ATOM(troupe, troupe, auth_atom, "t_auth")
CAF_ADD_ATOM(troupe, troupe, lease_atom, "t_lease")
CAF_ADD_ATOM(troupe, troupe, save_state_atom, "t_savestat")
CAF_ADD_ATOM(troupe, troupe, deadline_atom, "t_deadline")
CAF_ADD_ATOM(troupe, troupe, loop_atom, "t_loop")
CAF_ADD_ATOM(troupe, troupe, peers_atom, "t_peers")
CAF_ADD_ATOM(troupe, troupe, replace_atom, "t_replace")
CAF_ADD_ATOM(troupe, troupe, group_atom, "t_group")
CAF_ADD_ATOM(troupe, troupe, reply_error_atom, "t_rerror")
CAF_ADD_ATOM(troupe, troupe, linger_atom, "t_linger")
CAF_ADD_ATOM(troupe, troupe, recovery_atom, "t_recovery")
CAF_ADD_TYPE_ID(troupe, (troupe::blocks_query))
CAF_ADD_TYPE_ID(troupe, (troupe::cache_init))
CAF_ADD_TYPE_ID(troupe, (troupe::health_query))
CAF_ADD_TYPE_ID(troupe, (troupe::collective_prepare))
CAF_ADD_TYPE_ID(troupe, (troupe::collective_connect))
CAF_ADD_TYPE_ID(troupe, (troupe::staged_save))
CAF_ADD_TYPE_ID(troupe, (troupe::staged_finish))
CAF_ADD_TYPE_ID(troupe, (troupe::adapter_request))
CAF_ADD_TYPE_ID(troupe, (troupe::adapter_change))
CAF_ADD_TYPE_ID(troupe, (troupe::adapter_list))
CAF_ADD_TYPE_ID(troupe, (troupe::adapter_tokens))
CAF_ADD_ATOM(troupe, troupe, agree_atom, "t_agree")
CAF_ADD_TYPE_ID(troupe, (troupe::worker_handles))

CAF_END_TYPE_ID_BLOCK(troupe)

namespace troupe {

/// Registers the type-id block and the error category with a config. Every actor system
/// that talks to troupe actors calls this.
void register_messages(caf::actor_system_config& cfg);

} // namespace troupe
