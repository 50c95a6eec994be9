#pragma once

/// @file
/// Configuration of an executor: how many workers, where they live, default deadlines.

#include "troupe/types.hpp"

#include <caf/actor_system_config.hpp>
#include <caf/message.hpp>
#include <caf/settings.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace troupe {

/// Deadline of a call. `wait_forever` must be asked for explicitly.
using timeout_type = std::chrono::microseconds;

/// Asks a call to wait without a deadline (it still fails at once when a worker dies).
inline constexpr timeout_type wait_forever = timeout_type::max();

/// The longest `executor_config::linger`, `cluster_config::network_linger` and
/// `node_config::network_linger` accepted.
inline constexpr timeout_type max_linger = std::chrono::seconds(1);

/// A call of a worker's named method (`collective_rpc`'s method, positional and keyword
/// arguments), as `executor_config::replacement_calls` gives them.
struct replay_call {
  std::string method;
  caf::message args;
  caf::settings kwargs;
};

/// A worker actor published by another actor system (`troupe::publish_worker`), reached
/// through CAF's middleman.
struct remote_worker {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
};

/// A worker node (`troupe node`) and how many of its workers to lease.
struct node_address {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  int32_t workers = 1;
};

/// What the supervisor does when a worker dies, after Erlang/OTP's restart intensity.
/// With `max_restarts` 0 (the default) a death fails the executor, as in vLLM: every
/// pending and later call fails with `worker_died`. Otherwise a dead worker is replaced and
/// the replacement brought to the others' state (model, tensor-parallel group, KV-cache
/// blocks, adapters, sleep); the calls in flight fail with `worker_replaced` and calls made
/// meanwhile wait for it. A worker of this process is spawned anew; one leased from a node
/// is leased again: from its own node if it is back, else from `cluster_config::spare_nodes`
/// in order, else from another of `nodes` with a free device (each asked for at most
/// `node_timeout`, all within `startup_timeout`). A death
/// beyond `max_restarts` within `window`, and a replacement that fails or is not to be had
/// still fail the executor. A worker published on its own (`remote_workers`) is replaced
/// by one of this process, made by the executor's factory (none: the executor fails). A
/// replacement made while the others sleep falls asleep as they are.
struct restart_policy {
  /// Replacements allowed within `window`.
  int32_t max_restarts = 0;
  timeout_type window = std::chrono::seconds(60);
};

/// Where an executor's workers beyond this process are, and how it reaches them: worker
/// nodes (`troupe node`) leased with a shared secret or mutual TLS, and worker actors
/// published on their own. Empty: every worker lives in this process.
struct cluster_config {
  /// Worker nodes to lease workers from: their workers take the ranks after the local
  /// ones, node by node in this order. Local workers are the ones the nodes do not give.
  std::vector<node_address> nodes;
  /// Nodes held in reserve under a restart policy: none is leased at startup; a worker lost
  /// on a node is replaced by one leased from the first of these that gives one (their
  /// `workers` is not used: a replacement is one worker).
  std::vector<node_address> spare_nodes;
  /// The shared secret the nodes expect (may be empty when they use TLS only).
  std::string node_secret;
  /// Mutual TLS with the nodes (caf-openssl for BASP, OpenSSL for the call links): this
  /// executor's certificate and key and the CA the nodes' certificates are signed by (PEM
  /// files; all three or none).
  std::string tls_certificate;
  std::string tls_key;
  std::string tls_ca;
  /// The worker kind asked of the nodes, and its options (for `"model"`: a
  /// `model_worker_options` turned into settings by `to_settings`).
  std::string node_worker_kind = "model";
  caf::settings node_worker_options;
  /// A connection to a node or remote worker silent this long counts as lost (BASP
  /// heartbeats go every quarter of it): the workers behind it are reported dead.
  timeout_type node_timeout = std::chrono::seconds(3);
  /// Worker actors published on their own (`publish_worker`, no authentication; for
  /// trusted set-ups and tests): they take the last ranks.
  std::vector<remote_worker> remote_workers;
  /// `executor_config::linger` for the thread that talks to nodes and remote workers
  /// (CAF's middleman), after each message it sends or receives. It is longer because a
  /// reply that crosses a network takes longer to come: on a small VM's loopback, a call
  /// to a node took 45-100 µs with 100 here (and the node's own
  /// `node_config::network_linger` as long), 120-190 µs with 30 and 300 µs with 0. A
  /// blocking caller of an executor with such workers waits for its reply this long too.
  /// 0 turns it off; at most 1 s.
  timeout_type network_linger = std::chrono::microseconds(100);
  /// Whether the requests of `collective_rpc` (of a named method) and `execute_model` go to
  /// the workers of a node over a connection of their own (a call link), which skips the
  /// middleman's and the node's gateway threads, rather than over BASP with everything else.
  /// A link proves the shared secret or, under TLS, this executor's certificate.
  bool node_links = true;
  /// Whether the call link to a node on this host goes over the node's local socket (a Unix
  /// socket: on a small VM a round trip takes about 1 µs less than over loopback TCP
  /// between threads that block, 2 µs less between threads that poll) rather than TCP. A
  /// node on another host has none that this process can reach: its link is TCP.
  bool node_local_links = true;
  /// Whether a call link over the local socket moves its frames to memory shared with the
  /// node (two rings; the socket then only wakes a side that sleeps): on a small VM a
  /// round trip between threads that poll takes 0.3-0.4 µs through shared memory against
  /// 3.4 µs through a Unix socket.
  bool node_shared_memory = true;

  /// Whether every worker lives in this process (no nodes, spares or remote workers).
  bool empty() const;

  /// The workers that live in other processes: those of `nodes` and `remote_workers`.
  int32_t remote_count() const;

  /// Throws `troupe::error` (`invalid_argument`) naming what is wrong: a node without
  /// workers, nodes without a secret or TLS, half a TLS set-up, a timeout or linger out of
  /// range.
  void validate() const;
};

/// Everything an executor needs to start (the counterpart of the parts of vLLM's
/// `VllmConfig` that the executor layer reads).
struct executor_config {
  /// Number of workers; rank 0 is the driver (vLLM's `tensor_parallel_size`).
  int32_t tensor_parallel_size = 1;
  /// The device each local worker owns: the CPU, or a GPU (the i-th local worker takes GPU
  /// i). Workers leased from nodes own the devices their node gives them.
  device_kind device_type = device_kind::cpu;
  /// The workers of other processes and hosts.
  cluster_config cluster;
  /// Deadline of calls that do not name one. Finite by default: no call waits forever
  /// unless `wait_forever` is given.
  timeout_type rpc_timeout = std::chrono::seconds(60);
  /// Deadline for starting the workers (device init and model load), and for replacing one.
  timeout_type startup_timeout = std::chrono::seconds(300);
  /// Whether and how often a dead worker is replaced.
  restart_policy restart;
  /// Asked at each replacement (in this process or leased from a node), once its model is
  /// loaded and before it joins the others: the workers' named methods that bring back state
  /// the supervisor does not know of (the engine gives the weight updates the replaced
  /// worker had). A call that fails fails the replacement. Called on the supervisor's thread.
  std::function<std::vector<replay_call>()> replacement_calls;
  /// Tokens per KV-cache block (vLLM's `cache_config.block_size`).
  int32_t block_size = 16;
  /// Longest sequence the model serves (vLLM's `model_config.max_model_len`).
  int32_t max_model_len = 2048;
  /// Where `stop_profile` writes one trace per worker (Chrome trace format); empty keeps the
  /// traces in memory only and `stop_profile` just logs a summary.
  std::string profile_dir;
  /// Address the workers' tensor-parallel collective (Gloo on the CPU) listens on.
  std::string collective_host = "127.0.0.1";
  /// Threads of CAF's scheduler for the supervisor and other event-based actors; 0 keeps
  /// CAF's default (one per core).
  size_t scheduler_threads = 0;
  /// How many times an idle scheduler thread polls for work before it waits for the next
  /// message; 0 keeps CAF's default (100). The workers have threads of their own; the
  /// scheduler runs the supervisor when no caller does (replies to calls that are not
  /// direct, deaths, deadlines), whose latency large values (say 100000) cut, at the price
  /// of a scheduler thread spinning for a while after each message.
  size_t scheduler_poll_attempts = 0;
  /// How long a thread of the executor stays awake for a message that is about to come,
  /// yielding its core to any other thread, before it sleeps: a worker after it answered a
  /// call, a blocking caller waiting for its reply. Calls that follow each other closely
  /// (steps, back-to-back collective_rpc) then find their threads awake: waking a sleeping
  /// thread costs tens of microseconds on a virtual machine. An idle executor uses no CPU:
  /// threads linger only around a call. 0 turns it off; at most 1 s.
  timeout_type linger = std::chrono::microseconds(30);
  /// Lets the host add settings or message types to the executor's actor system.
  std::function<void(caf::actor_system_config&)> configure_system;

  /// Throws `troupe::error` (`invalid_argument`) naming the first field that is out of
  /// range: sizes and timeouts that are not positive, more remote workers than ranks, and
  /// what `cluster_config::validate` refuses.
  void validate() const;
};

} // namespace troupe
