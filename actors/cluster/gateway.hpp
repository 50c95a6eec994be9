#pragma once

#include "actors/cluster/link_tls.hpp"
#include "troupe/config.hpp"

#include <spdlog/logger.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace troupe {

/// TLS ended at a node's gateway: the node's certificate chain and key, and the CA that the
/// peers' certificates must chain to (both sides are verified, as caf-openssl does).
struct gateway_tls {
  std::string certificate;
  std::string key;
  std::string ca;
};

/// Whom a BASP peer may address through the gateway, judged by each frame's header and the
/// node ids at the start of its payload (CAF 0.17's BASP: a client handshake carries the
/// client's node id; a routed, monitor or down message its source and destination nodes).
/// The lease holder's process may send anything (it relays between its nodes); any other
/// peer reaches the gate alone, and speaks only for itself. A frame that names this node as
/// its source is forged (no peer speaks for the node: that is how a peer would pass itself
/// off as the gate) and closes the connection; any other frame a peer may not send is
/// dropped and logged.
struct frame_policy {
  /// This node's id, as CAF serializes it.
  std::string this_node;
  /// The gate's actor id.
  uint64_t gate = 0;
  /// Whether `node` (a node id as CAF serializes it) is the lease holder's; false while
  /// nobody holds the lease. Called on the gateway's thread, for every frame of a peer.
  std::function<bool(const std::string& node)> holds;
};

/// How a node's gateway listens and whom it lets through.
struct gateway_options {
  std::string host;
  uint16_t port = 0;
  /// End TLS here (both certificates verified); none: plain TCP.
  std::optional<gateway_tls> tls;
  /// Without TLS: the shared secret every connection proves before any byte reaches CAF
  /// (`actors/cluster/node_auth.hpp`, the connection handshake). Under TLS the certificates are
  /// the connection's proof.
  std::string secret;
  /// What BASP peers may send; none: anything that proved itself is relayed.
  std::shared_ptr<const frame_policy> policy;
  /// The largest BASP payload a peer may announce.
  uint64_t max_frame_bytes = uint64_t{64} << 20;
  /// A connection that has not proved itself (TLS handshake, secret) within this is closed.
  timeout_type handshake_timeout = std::chrono::seconds(3);
  /// Connections still proving themselves at once; a new one beyond this closes the oldest.
  size_t max_pending = 256;
  /// After each event the thread polls for the next one this long before it sleeps
  /// (`node_config::network_linger`).
  timeout_type linger{0};
};

/// The listening sockets of a node: its TCP port and, for call links from this host, a
/// local socket (`local_address`). It accepts TCP connections, ends TLS or checks the
/// connection handshake, hands a call link that proved the secret or went through its TLS
/// handshake (`actors/cluster/link_tls.hpp`) to `link`, and relays each other
/// connection that proved itself to the node's middleman over a private socket pair (`connect`
/// hands the middleman one end and returns the other): nothing reaches CAF, not even a BASP
/// handshake, from a peer that has not proved the secret or a certificate of the node's CA. It
/// reads the BASP frame headers of what peers send, after decryption: a frame whose payload is
/// larger than `max_frame_bytes` closes the connection before any of it reaches CAF (which would
/// allocate the whole payload up front), and is logged with the peer's address; `policy` says
/// which frames pass. Traffic to the peers is relayed as it is.
///
/// All connections share one thread (Boost.Asio), and one still proving itself holds only its
/// socket and a few hundred bytes. When the process runs out of file descriptors, accepting pauses
/// for a moment instead of spinning.
class frame_gateway {
public:
  /// The gateway's end of a new private connection to the middleman, or -1.
  using connect_fn = std::function<int()>;
  /// Takes a call link (`actors/cluster/link_socket.hpp`) that proved the secret or a certificate:
  /// its socket, its TLS session (none without TLS) and the peer's address. Called on the
  /// gateway's thread.
  using link_fn = std::function<void(int fd, std::unique_ptr<tls_session> tls, std::string peer)>;

  /// Binds and starts accepting. Throws `worker_error` when the address cannot be bound or
  /// the TLS files cannot be loaded. Without `link`, links are refused.
  frame_gateway(gateway_options options, connect_fn connect, link_fn link,
                std::shared_ptr<spdlog::logger> log);
  ~frame_gateway();

  frame_gateway(const frame_gateway&) = delete;
  frame_gateway& operator=(const frame_gateway&) = delete;

  uint16_t port() const;

  /// Where processes on this host open call links, skipping TCP: "@name", a name in the
  /// abstract Unix namespace; empty without links, or when it could not be made. That
  /// socket takes call links only, which prove the secret or go through the TLS handshake
  /// as they do over TCP.
  const std::string& local_address() const;

  /// Stops accepting and closes every relayed connection; idempotent.
  void stop();

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace troupe
