#pragma once

#include <spdlog/logger.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace troupe {

/// The public face of a node: accepts TCP connections on `host:port` and relays each to
/// the node's middleman on a loopback port, reading the BASP frame headers of what peers
/// send. A frame whose payload is larger than `max_frame_bytes` closes the connection
/// before any of it reaches CAF (which would allocate the whole payload up front), and is
/// logged with the peer's address. Traffic to the peers is relayed as it is.
class frame_gateway {
public:
  /// Binds and starts accepting. Throws `worker_error` when the address cannot be bound.
  frame_gateway(const std::string& host, uint16_t port, uint16_t target_port,
                uint64_t max_frame_bytes, std::shared_ptr<spdlog::logger> log);
  ~frame_gateway();

  frame_gateway(const frame_gateway&) = delete;
  frame_gateway& operator=(const frame_gateway&) = delete;

  uint16_t port() const {
    return port_;
  }

  /// Stops accepting and closes every relayed connection.
  void stop();

private:
  void accept_loop();
  void relay(int client, std::string peer);

  uint16_t port_ = 0;
  uint16_t target_port_;
  uint64_t max_frame_bytes_;
  std::shared_ptr<spdlog::logger> log_;
  int listener_ = -1;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::mutex mtx_;
  /// Open sockets (closed by stop) and the relay threads, joined once done.
  struct relay_thread {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::set<int> sockets_;
  std::vector<relay_thread> relays_;
};

} // namespace troupe
