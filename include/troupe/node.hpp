#pragma once

/// @file
/// A worker node: a process that hosts worker actors for an executor in another process
/// or on another machine, reached through CAF's middleman (`troupe node` on the command
/// line).

#include "troupe/config.hpp"
#include "troupe/worker.hpp"

#include <caf/actor_system_config.hpp>
#include <caf/settings.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace troupe {

/// Builds the worker of one kind for `rank` from the options the executor sent
/// (`cluster_config::node_worker_options`).
using node_worker_factory =
  std::function<std::unique_ptr<worker>(int32_t rank, const caf::settings& options)>;

/// How a node listens and what it may host.
struct node_config {
  /// Address and port to listen on; loopback unless told otherwise, 0 picks a free port.
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  /// Where the workers' tensor-parallel collective (Gloo) listens; empty takes `host`
  /// (give one when `host` is 0.0.0.0).
  std::string collective_host;
  /// The largest message a peer may send (a BASP frame's payload); a larger one closes
  /// the connection before the node reads it, with or without TLS (the bound is checked
  /// after decryption). The node listens on `host:port` only: its middleman has no port of
  /// its own, so nothing bypasses the bound.
  uint64_t max_message_bytes = uint64_t{64} << 20;
  /// The devices the node hosts workers on, one worker each: the CPU (N of them: `cpu:N`)
  /// or GPUs (`cuda:0,1` gives indices 0 and 1). Empty indices with `devices` = N mean
  /// 0..N-1.
  device_kind device_type = device_kind::cpu;
  std::vector<int32_t> device_indices;
  int32_t devices = 1;
  /// The shared secret an executor proves before anything else is served. Required
  /// unless TLS is set up; with both, executors need both.
  std::string secret;
  /// Mutual TLS: this node's certificate and key, and the CA that executors' certificates
  /// must be signed by (PEM files; all three or none). Peers without such a certificate
  /// cannot connect; executors connect with caf-openssl, and their call links prove the
  /// same certificates. A peer that has not finished its TLS handshake within
  /// `connection_timeout` is closed.
  std::string tls_certificate;
  std::string tls_key;
  std::string tls_ca;
  /// The worker kinds an executor may ask for, by name; nothing else can be spawned.
  std::map<std::string, node_worker_factory> kinds;
  /// A connection silent for this long counts as lost (BASP heartbeats every quarter of
  /// it): an executor that disappears releases the node's workers.
  timeout_type connection_timeout = std::chrono::seconds(3);
  /// How long the node's network threads (its gateway's and its middleman's) poll for the
  /// next message after one before they sleep, as `cluster_config::network_linger` does
  /// for the executor's (the workers linger as the executor's `executor_config::linger`
  /// says). 0 turns it off; at most 1 s.
  timeout_type network_linger = std::chrono::microseconds(100);
  /// Lets the host add settings to the node's actor system.
  std::function<void(caf::actor_system_config&)> configure_system;
};

/// A running node. One executor at a time leases its workers: the executor proves the
/// shared secret (an HMAC-SHA256 of a fresh challenge, so the secret never travels), then
/// asks for workers of a registered kind. Leased workers serve only that executor and its
/// other workers; every other peer is refused and logged. A leased worker that dies frees
/// its device, and the executor holding the lease may lease again while devices are free
/// (to replace the worker). When the executor goes away
/// (it shuts down, dies, or its connection times out) the workers are stopped, their
/// memory released, and the node waits for the next executor.
class node {
public:
  /// Starts listening. Throws `troupe::error`: `invalid_argument` without a secret or TLS,
  /// with part of the TLS files, no worker kind or no device; `worker_error` when the
  /// address cannot be bound or the TLS files cannot be loaded.
  explicit node(node_config config);
  /// Stops the node (see `stop`).
  ~node();

  node(const node&) = delete;
  node& operator=(const node&) = delete;

  /// The port the node listens on.
  uint16_t port() const;

  /// Where executors on this host open their call links (`cluster_config::node_local_links`):
  /// "@name", a name in the abstract Unix namespace, given to an executor with its lease.
  /// Under TLS, links on it go through the TLS handshake as over TCP. Empty when the socket
  /// could not be made (links then come over TCP).
  std::string local_address() const;

  /// Workers leased to an executor right now.
  int32_t leased_workers() const;

  /// Call links open right now (`cluster_config::node_links`): connections of the lease
  /// holder that carry its calls to the workers.
  int32_t call_links() const;

  /// Requests that call links have handed to workers since the node started.
  uint64_t linked_requests() const;

  /// Of those, the requests that leased workers read from the links themselves while they
  /// lingered after a call (`executor_config::linger`), with no hand-off from a link's
  /// thread.
  uint64_t requests_read_by_workers() const;

  /// Blocks until the node is stopped (by `stop` from another thread, a signal, or itself:
  /// see `failure`).
  void wait();

  /// Why the node stopped on its own, empty when it was stopped or still runs: its gate
  /// went (killed by a peer that proved the secret), and with it every way to lease the
  /// workers, so the node stops rather than run on useless and silent.
  std::string failure() const;

  /// Stops the leased workers and closes the node; idempotent, and a second caller waits
  /// until the first is done.
  void stop();

  /// For daemons: from now on SIGINT and SIGTERM (their handlers replaced) stop the node.
  void stop_on_signals();

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace troupe
