#include "actors/cluster/remoting.hpp"

#include "actors/linger.hpp"
#include "actors/cluster/node_auth.hpp"
#include "troupe/errors.hpp"

#include <caf/io/middleman.hpp>
#include <caf/io/network/default_multiplexer.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/timespan.hpp>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <memory>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

namespace troupe {

void configure_scheduler(caf::actor_system_config& cfg, size_t threads, size_t poll_attempts) {
  if (threads > 0)
    cfg.set("scheduler.max-threads", threads);
  if (poll_attempts > 0)
    cfg.set("work-stealing.aggressive-poll-attempts", poll_attempts);
  cfg.set("work-stealing.moderate-poll-attempts", size_t{0});
  // An idle scheduler thread waits on its condition variable, which every message from
  // outside the scheduler signals; the timeout only lets it look for work to steal. CAF's
  // 10 ms cost an idle executor over 1 % of a core in wake-ups.
  cfg.set("work-stealing.relaxed-sleep-duration", caf::timespan{std::chrono::seconds(1)});
}

namespace {

/// CAF's multiplexer, except that after each event its thread polls for the next one for
/// `linger`, yielding its core, before it sleeps in `epoll_wait`. A remote call crosses the
/// middleman's thread twice on each side; each time it sleeps, waking it costs 20-100 µs on
/// a small VM, against a few for a poll.
class lingering_multiplexer final : public caf::io::network::default_multiplexer {
public:
  lingering_multiplexer(caf::actor_system* sys, timeout_type linger)
    : default_multiplexer(sys), linger_(linger) {}

  // The loop of CAF's `run`: it ends with the last socket handler, the pipe that the
  // middleman's supervisor closes when the system stops.
  void run() override {
    while (num_socket_handlers() > 0) {
      if (linger_ > timeout_type::zero() && linger_for(linger_, [&] { return poll_once(false); }))
        continue;
      poll_once(true);
    }
  }

private:
  timeout_type linger_;
};

class lingering_middleman final : public caf::io::middleman {
public:
  lingering_middleman(caf::actor_system& sys, timeout_type linger)
    : middleman(sys), backend_(&sys, linger) {}

  caf::io::network::multiplexer& backend() override {
    return backend_;
  }

private:
  lingering_multiplexer backend_;
};

} // namespace

void load_middleman(caf::actor_system_config& cfg, timeout_type timeout, timeout_type linger) {
  cfg.module_factories.push_back([linger](caf::actor_system& sys) -> caf::actor_system::module* {
    return new lingering_middleman(sys, linger);
  });
  auto span = std::chrono::duration_cast<caf::timespan>(timeout);
  cfg.set("middleman.heartbeat-interval", span / 4);
  cfg.set("middleman.connection-timeout", span);
  // CAF hands each message read from a connection to a worker thread to deserialize and
  // deliver: a thread wake-up more on every remote call, each way. troupe's messages are
  // small, so the middleman's thread delivers them itself.
  cfg.set("middleman.workers", size_t{0});
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

namespace {

/// Milliseconds left before `deadline`, at least 0.
int ms_left(std::chrono::steady_clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
    deadline - std::chrono::steady_clock::now());
  return static_cast<int>(std::max<int64_t>(left.count(), 0));
}

/// Goes through the node's connection handshake on `fd`, a connected non-blocking socket,
/// before `deadline`; throws as `dial_node` when it fails.
void prove_connection(int fd, const std::string& where, const std::string& secret,
                      std::chrono::steady_clock::time_point deadline, bool link) {
  auto late = [&] {
    return error{errc::worker_died,
                 "cannot reach " + where + ": the handshake did not end in time"};
  };
  // Reads exactly `size` bytes, or up to a newline when `line`.
  auto read_some = [&](size_t size, bool line) {
    std::string got;
    while (got.size() < size) {
      char c;
      auto n = recv(fd, &c, 1, 0);
      if (n == 1) {
        got.push_back(c);
        if (line && c == '\n')
          break;
      } else if (n == 0) {
        break;
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!poll_until(fd, POLLIN, deadline))
          throw late();
      } else if (errno != EINTR) {
        break;
      }
    }
    return got;
  };
  auto write_all = [&](const std::string& data) {
    send_before(fd, data.data(), data.size(), where, "the handshake", deadline);
  };
  auto node_challenge = challenge_of_greeting(read_some(greeting_size, false));
  if (node_challenge.empty())
    throw error{errc::invalid_argument,
                where + " does not speak troupe's connection handshake (not a troupe node, or "
                        "one that wants TLS: give the TLS certificate, key and CA)"};
  auto challenge = random_challenge();
  write_all(link ? challenge + "+" + link_proof(secret, node_challenge, challenge) + "\n"
                 : challenge + " " + peer_proof(secret, node_challenge, challenge) + "\n");
  auto verdict = read_some(max_verdict_size, true);
  if (verdict.rfind("no ", 0) == 0)
    throw error{errc::invalid_argument,
                where + " refused the connection: " + verdict.substr(3, verdict.size() - 4)};
  if (verdict.size() != 3 + 64 + 1 || verdict.rfind("ok ", 0) != 0 ||
      !same_proof(verdict.substr(3, 64), node_proof(secret, node_challenge, challenge)))
    throw error{errc::invalid_argument,
                where + " did not prove the secret: it is not the node meant, or its secret "
                        "differs"};
}

/// Connects `fd` to `addr`, waiting until `deadline`; throws `worker_died` naming `where`
/// when it cannot.
void connect_before(int fd, const sockaddr* addr, socklen_t size, const std::string& where,
                    std::chrono::steady_clock::time_point deadline) {
  int connected = connect(fd, addr, size);
  int err = connected == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    if (!poll_until(fd, POLLOUT, deadline))
      throw error{errc::worker_died,
                  "cannot reach " + where + ": the connection did not open in time"};
    socklen_t len = sizeof err;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  }
  if (err != 0)
    throw error{errc::worker_died, "cannot reach " + where + ": " + std::strerror(err)};
}

/// `fd` after `connect_and_prove(fd)`, or closed when that throws.
template <class Steps>
int ready_or_closed(int fd, Steps connect_and_prove) {
  try {
    connect_and_prove(fd);
  } catch (...) {
    close(fd);
    throw;
  }
  return fd;
}

} // namespace

bool poll_until(int fd, short events, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int ready = poll(&p, 1, ms_left(deadline));
    if (ready > 0)
      return true;
    if (ready == 0 || errno != EINTR)
      return false;
  }
}

void send_before(int fd, const char* data, size_t size, const std::string& where,
                 const std::string& during, std::chrono::steady_clock::time_point deadline) {
  size_t sent = 0;
  while (sent < size) {
    auto n = send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n > 0)
      sent += static_cast<size_t>(n);
    else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!poll_until(fd, POLLOUT, deadline))
        throw error{errc::worker_died,
                    "cannot reach " + where + ": " + during + " did not end in time"};
    } else if (n < 0 && errno != EINTR)
      throw error{errc::worker_died, where + ": connection lost during " + during};
  }
}

int connect_node(const std::string& host, uint16_t port,
                 std::chrono::steady_clock::time_point deadline) {
  auto where = "node " + host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found)
    throw error{errc::worker_died, "cannot reach " + where + ": the host does not resolve"};
  int fd = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(found);
    throw error{errc::worker_died, "cannot reach " + where + ": " + std::strerror(errno)};
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> freed{found, freeaddrinfo};
  return ready_or_closed(fd, [&](int s) {
    connect_before(s, found->ai_addr, found->ai_addrlen, where, deadline);
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  });
}

int connect_local(const std::string& address, std::chrono::steady_clock::time_point deadline) {
  auto where = "the node at " + address;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  // "@name": the abstract namespace, whose names start with a zero byte and are not
  // terminated.
  if (address.size() < 2 || address[0] != '@' || address.size() > sizeof addr.sun_path)
    throw error{errc::invalid_argument, "not a local link address: '" + address + "'"};
  std::memcpy(addr.sun_path + 1, address.data() + 1, address.size() - 1);
  auto size = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size());
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    throw error{errc::worker_died, "cannot reach " + where + ": " + std::strerror(errno)};
  return ready_or_closed(fd, [&](int s) {
    connect_before(s, reinterpret_cast<sockaddr*>(&addr), size, where, deadline);
  });
}

int dial_node(const std::string& host, uint16_t port, const std::string& secret,
              std::chrono::steady_clock::time_point deadline, bool link) {
  auto where = "node " + host + ":" + std::to_string(port);
  return ready_or_closed(connect_node(host, port, deadline),
                         [&](int s) { prove_connection(s, where, secret, deadline, link); });
}

int dial_local_link(const std::string& address, const std::string& secret,
                    std::chrono::steady_clock::time_point deadline) {
  return ready_or_closed(connect_local(address, deadline), [&](int s) {
    prove_connection(s, "the node at " + address, secret, deadline, true);
  });
}

void configure_tls(caf::actor_system_config& cfg, const std::string& certificate,
                   const std::string& key, const std::string& ca) {
  cfg.openssl_certificate = certificate;
  cfg.openssl_key = key;
  cfg.openssl_cafile = ca;
  cfg.load<caf::openssl::manager>();
}

} // namespace troupe
