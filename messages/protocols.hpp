#pragma once

/// @file
/// The actors' interfaces as typed handles: a message the receiver does not handle is a
/// compile error at the sender.

#include "messages/messages.hpp"

#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>

#include <string>
#include <vector>

namespace troupe {

/// The signature of a library call (`messages/worker_calls.hpp`): `(call_atom, Call)`
/// answered `(ok_atom, reply)`, or `(ok_atom)` for a call with no reply.
template <class Call, class Reply = typename call_traits<Call>::reply>
struct call_signature {
  using type = typename caf::replies_to<call_atom, Call>::template with<caf::ok_atom, Reply>;
};

template <class Call>
struct call_signature<Call, void> {
  using type = typename caf::replies_to<call_atom, Call>::template with<caf::ok_atom>;
};

template <class Call>
using call_signature_t = typename call_signature<Call>::type;

/// A worker actor (`actors/worker_actor`): hosts one worker object on its own thread.
/// Every request is answered `(ok_atom)`, `(ok_atom, result)` or with an error naming the
/// rank.
using worker_actor = caf::typed_actor<
  /// Creates the worker object, binds the device, loads the model; replies `worker_info`.
  /// The driver (rank 0) gets the other ranks as peers, for the execution loop.
  caf::replies_to<init_atom, worker_context, worker_handles>::with<caf::ok_atom, worker_info>,
  /// A registered method with its arguments.
  caf::replies_to<call_atom, std::string, caf::message, caf::settings>::with<caf::ok_atom,
                                                                             caf::message>,
  /// The library's own calls, each with its reply.
  call_signature_t<blocks_query>, call_signature_t<cache_init>, call_signature_t<health_query>,
  call_signature_t<collective_prepare>, call_signature_t<collective_connect>,
  call_signature_t<sleep_request>, call_signature_t<wake_request>, call_signature_t<staged_save>,
  call_signature_t<staged_finish>, call_signature_t<adapter_request>,
  call_signature_t<adapter_change>, call_signature_t<adapter_list>,
  call_signature_t<adapter_tokens>,
  /// An in-process callable (never serialised).
  caf::replies_to<call_atom, local_call>::with<caf::ok_atom, caf::message>,
  /// Joins execution loop `id` (a peer): answered when the loop stops, with its steps.
  caf::replies_to<loop_atom, int64_t>::with<caf::ok_atom, int64_t>,
  /// A driver step: handed on to the peers, then computed; replies the sampler outputs.
  caf::replies_to<execute_atom, execute_model_request>::with<caf::ok_atom, caf::message>,
  /// The driver tells every peer to leave loop `id`.
  caf::replies_to<execute_atom, stop_loop_atom, int64_t>::with<caf::ok_atom>,
  /// From the driver to a peer in the loop: a step, or the end of loop `id`.
  caf::reacts_to<step_atom, execute_model_request>,
  caf::reacts_to<step_atom, stop_loop_atom, int64_t>,
  /// The driver's new peers, after one was replaced.
  caf::replies_to<peers_atom, worker_handles>::with<caf::ok_atom>,
  /// Every member of the tensor-parallel group, in rank order: a member that goes down
  /// aborts this worker's collective (`worker::abort_collective`), so that a reduction
  /// waiting for it fails at once instead of at the collective's timeout.
  caf::replies_to<group_atom, worker_handles>::with<caf::ok_atom>,
  /// A worker's own, after a call: waits a little for the next message before its thread
  /// sleeps.
  caf::reacts_to<linger_atom>>;

/// The workers of a group in rank order (a driver's peers: ranks 1 on). A driver's peer
/// may be the stub of its call link (`actors/cluster/link_client.hpp`), which takes a
/// worker's messages on its behalf.
struct worker_handles {
  std::vector<worker_actor> ranks;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, worker_handles& x) {
  return f(caf::meta::type_name("worker_handles"), x.ranks);
}

/// A node's gate (`actors/cluster/node.cpp`), the one actor a node publishes: an executor
/// proves the node's secret (a challenge, then its proof) and leases workers.
using node_gate_actor = caf::typed_actor<
  /// A challenge for the secret's proof.
  caf::replies_to<hello_atom>::with<std::string>,
  /// The proof (`secret_proof`, actors/cluster/node_auth.hpp).
  caf::replies_to<auth_atom, std::string>::with<caf::ok_atom>,
  /// `count` workers of the node's `kind` made with `options`, for `holder` (whose end
  /// releases them): the workers, the lease's token for call links, and the node's local
  /// link address (empty: none).
  caf::replies_to<lease_atom, std::string, caf::settings, int32_t,
                  caf::actor>::with<worker_handles, std::string, std::string>>;

/// The supervisor of an executor (`actors/supervisor`), as the facade
/// (`actors/executor.cpp`) talks to it.
using supervisor_actor = caf::typed_actor<
  /// Starts every worker; their infos in rank order.
  caf::replies_to<init_atom>::with<std::vector<worker_info>>,
  /// collective_rpc with an in-process callable: every reply in rank order. (Named
  /// methods and execute_model are made through `supervisor_access`: their replies go
  /// straight to the caller.)
  caf::replies_to<rpc_atom, local_call, rpc_options>::with<std::vector<caf::message>>,
  /// determine_num_available_blocks: the least of every worker's.
  caf::replies_to<blocks_atom>::with<cache_blocks>,
  caf::replies_to<init_cache_atom, cache_blocks>::with<caf::ok_atom>,
  /// save_sharded_state, all ranks or none.
  caf::replies_to<save_state_atom, sharded_state_request>::with<caf::ok_atom>,
  /// add/remove/pin of an adapter: whether every worker said yes.
  caf::replies_to<all_true_atom, adapter_request>::with<bool>,
  caf::replies_to<all_true_atom, adapter_change>::with<bool>,
  /// list_loras / list_prompt_adapters: the set every worker holds.
  caf::replies_to<same_set_atom, adapter_list>::with<std::vector<int64_t>>,
  /// prompt_adapter_virtual_tokens: what every worker says.
  caf::replies_to<agree_atom, adapter_tokens>::with<int32_t>,
  /// stop_remote_worker_execution_loop.
  caf::replies_to<stop_loop_atom>::with<caf::ok_atom>,
  caf::replies_to<sleep_atom, sleep_request>::with<caf::ok_atom>,
  /// wake_up of tags by name (all sleeping ones when empty).
  caf::replies_to<wake_atom, std::vector<std::string>>::with<caf::ok_atom>,
  /// The sleeping tags by name; empty when awake.
  caf::replies_to<sleep_state_atom>::with<std::vector<std::string>>,
  /// The replacement under way ("recovering rank N (cause)"), or empty; answered at once.
  caf::replies_to<recovery_atom>::with<std::string>,
  caf::replies_to<health_atom>::with<std::vector<worker_health>>,
  /// The supervisor's own deadline timer (see `supervisor.cpp`).
  caf::reacts_to<deadline_atom, int64_t>,
  /// A call of the facade's async API (see `async_call`).
  caf::reacts_to<async_call>,
  /// The supervisor's own: replace the dead worker of `rank` (after the requests that were
  /// already in its mailbox).
  caf::reacts_to<replace_atom, int32_t>,
  /// A worker's error in a call whose replies go to a sink (actors/reply_sink.hpp): the
  /// gather's id, the index of the rank in it, the error.
  caf::reacts_to<reply_error_atom, uint64_t, uint64_t, caf::error>>;

} // namespace troupe
