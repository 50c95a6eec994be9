#include "actors/remoting.hpp"

#include "troupe/errors.hpp"

#include <caf/openssl/manager.hpp>
#include <caf/timespan.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace troupe {

void configure_heartbeats(caf::actor_system_config& cfg, timeout_type timeout) {
  auto span = std::chrono::duration_cast<caf::timespan>(timeout);
  cfg.set("middleman.heartbeat-interval", span / 4);
  cfg.set("middleman.connection-timeout", span);
}

bool wants_tls(const std::string& certificate, const std::string& key, const std::string& ca) {
  auto given = !certificate.empty() + !key.empty() + !ca.empty();
  if (given == 0)
    return false;
  if (given != 3)
    throw error{errc::invalid_argument, "TLS needs a certificate, a key and a CA file"};
  for (auto& file : {certificate, key, ca})
    if (!std::filesystem::is_regular_file(file))
      throw error{errc::invalid_argument, "TLS: no file '" + file + "'"};
  return true;
}

std::string why_connection_lost(const std::string& host, uint16_t port, bool tls) {
  constexpr int wait_ms = 250;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found)
    return "connection lost, and '" + host + "' no longer resolves";
  int fd = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(found);
    return "connection lost";
  }
  int connected = connect(fd, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  int err = connected == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    if (poll(&p, 1, wait_ms) <= 0) {
      close(fd);
      return "connection lost; its port does not answer within " + std::to_string(wait_ms) +
             " ms: the host or the network is down";
    }
    socklen_t len = sizeof err;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  }
  if (err != 0) {
    close(fd);
    if (err == ECONNREFUSED)
      return "connection lost; nothing listens on its port any more: its process has exited";
    if (err == ECONNRESET)
      return "connection lost; its port resets connections: its process is exiting";
    return std::string{"connection lost; connecting again fails: "} + std::strerror(err);
  }
  if (tls) {
    close(fd);
    return "connection lost; its port still accepts connections: a heartbeat timeout, or the "
           "peer closed it (its log says why)";
  }
  // A live BASP peer sends its handshake as soon as a connection is accepted.
  pollfd p{fd, POLLIN, 0};
  int ready = poll(&p, 1, wait_ms);
  char byte = 0;
  auto got = ready > 0 ? recv(fd, &byte, 1, 0) : -1;
  close(fd);
  if (ready == 0)
    return "no heartbeat within the timeout; its port still accepts connections but the process "
           "says nothing: it is stopped or hung";
  if (got > 0)
    return "connection closed by the peer, which is still up (its log says why)";
  // Accepted by the kernel, then closed before a word: the process's sockets are closing.
  return "connection lost; its port closes connections at once: its process is exiting";
}

void configure_tls(caf::actor_system_config& cfg, const std::string& certificate,
                   const std::string& key, const std::string& ca) {
  cfg.openssl_certificate = certificate;
  cfg.openssl_key = key;
  cfg.openssl_cafile = ca;
  cfg.load<caf::openssl::manager>();
}

} // namespace troupe
