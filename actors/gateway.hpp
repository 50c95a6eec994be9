#pragma once

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

/// The only listening socket of a node. It accepts TCP connections on `host:port`, ends TLS
/// when asked to, and relays each connection to the node's middleman over a private socket
/// pair (`connect` hands the middleman one end and returns the other), so nothing reaches
/// CAF except through it. It reads the BASP frame headers of what peers send, after
/// decryption: a frame whose payload is larger than `max_frame_bytes` closes the connection
/// before any of it reaches CAF (which would allocate the whole payload up front), and is
/// logged with the peer's address. Traffic to the peers is relayed as it is.
///
/// All connections share one thread (Boost.Asio). A TLS handshake not finished within
/// `handshake_timeout` closes the connection; when the process runs out of file
/// descriptors, accepting pauses for a moment instead of spinning.
class frame_gateway {
public:
  /// The gateway's end of a new private connection to the middleman, or -1.
  using connect_fn = std::function<int()>;

  /// Binds and starts accepting. Throws `worker_error` when the address cannot be bound or
  /// the TLS files cannot be loaded.
  frame_gateway(const std::string& host, uint16_t port, std::optional<gateway_tls> tls,
                uint64_t max_frame_bytes, timeout_type handshake_timeout, connect_fn connect,
                std::shared_ptr<spdlog::logger> log);
  ~frame_gateway();

  frame_gateway(const frame_gateway&) = delete;
  frame_gateway& operator=(const frame_gateway&) = delete;

  uint16_t port() const;

  /// Stops accepting and closes every relayed connection; idempotent.
  void stop();

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace troupe
