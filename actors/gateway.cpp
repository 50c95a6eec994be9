#include "actors/gateway.hpp"

#include "troupe/errors.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <vector>

namespace troupe {

namespace {

/// Size of a BASP header: operation, 2 padding bytes, flags, payload length (u32), operation
/// data (u64), source and destination actor ids (u64 each), integers in network order.
constexpr size_t basp_header_size = 32;
constexpr size_t payload_length_offset = 4;

bool read_full(int fd, char* data, size_t size) {
  while (size > 0) {
    auto n = ::read(fd, data, size);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool write_full(int fd, const char* data, size_t size) {
  while (size > 0) {
    auto n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

void no_delay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

} // namespace

frame_gateway::frame_gateway(const std::string& host, uint16_t port, uint16_t target_port,
                             uint64_t max_frame_bytes, std::shared_ptr<spdlog::logger> log)
  : target_port_(target_port), max_frame_bytes_(max_frame_bytes), log_(std::move(log)) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  auto service = std::to_string(port);
  if (getaddrinfo(host.c_str(), service.c_str(), &hints, &found) != 0 || !found)
    throw error{errc::worker_error, "node: cannot resolve '" + host + "'"};
  std::string why;
  for (auto* a = found; a && listener_ < 0; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0)
      continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 64) == 0) {
      listener_ = fd;
      sockaddr_storage bound{};
      socklen_t len = sizeof(bound);
      getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
      port_ = ntohs(bound.ss_family == AF_INET6
                      ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                      : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    } else {
      why = std::strerror(errno);
      close(fd);
    }
  }
  freeaddrinfo(found);
  if (listener_ < 0)
    throw error{errc::worker_error,
                "node: cannot listen on " + host + ":" + std::to_string(port) + ": " + why};
  if (pipe(wake_) != 0) {
    close(listener_);
    throw error{errc::worker_error, "node: cannot create the gateway's wake-up pipe"};
  }
  acceptor_ = std::thread{[this] { accept_loop(); }};
}

frame_gateway::~frame_gateway() {
  stop();
}

void frame_gateway::stop() {
  if (stopping_.exchange(true))
    return;
  char byte = 0;
  [[maybe_unused]] auto n = write(wake_[1], &byte, 1);
  if (acceptor_.joinable())
    acceptor_.join();
  std::vector<relay_thread> relays;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    for (auto fd : sockets_)
      shutdown(fd, SHUT_RDWR);
    relays = std::move(relays_);
  }
  for (auto& r : relays)
    r.thread.join();
  close(listener_);
  close(wake_[0]);
  close(wake_[1]);
}

void frame_gateway::accept_loop() {
  for (;;) {
    pollfd fds[2] = {{listener_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(fds, 2, -1) < 0 && errno != EINTR)
      return;
    if (fds[1].revents != 0 || stopping_)
      return;
    if ((fds[0].revents & POLLIN) == 0)
      continue;
    sockaddr_storage from{};
    socklen_t len = sizeof(from);
    int client = accept(listener_, reinterpret_cast<sockaddr*>(&from), &len);
    if (client < 0)
      continue;
    char name[INET6_ADDRSTRLEN] = "?";
    uint16_t port = 0;
    if (from.ss_family == AF_INET) {
      auto* in = reinterpret_cast<sockaddr_in*>(&from);
      inet_ntop(AF_INET, &in->sin_addr, name, sizeof(name));
      port = ntohs(in->sin_port);
    } else if (from.ss_family == AF_INET6) {
      auto* in = reinterpret_cast<sockaddr_in6*>(&from);
      inet_ntop(AF_INET6, &in->sin6_addr, name, sizeof(name));
      port = ntohs(in->sin6_port);
    }
    auto peer = std::string{name} + ":" + std::to_string(port);
    log_->info("connection from {}", peer);
    std::lock_guard<std::mutex> guard{mtx_};
    for (auto i = relays_.begin(); i != relays_.end();) {
      if (*i->done) {
        i->thread.join();
        i = relays_.erase(i);
      } else {
        ++i;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    relays_.push_back({std::thread{[this, client, peer, done] {
                         relay(client, peer);
                         *done = true;
                       }},
                       done});
  }
}

void frame_gateway::relay(int client, std::string peer) {
  int server = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in target{};
  target.sin_family = AF_INET;
  target.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  target.sin_port = htons(target_port_);
  if (server < 0 || connect(server, reinterpret_cast<sockaddr*>(&target), sizeof(target)) != 0) {
    log_->error("connection from {}: cannot reach the middleman", peer);
    if (server >= 0)
      close(server);
    close(client);
    return;
  }
  no_delay(client);
  no_delay(server);
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (stopping_) {
      close(server);
      close(client);
      return;
    }
    sockets_.insert(client);
    sockets_.insert(server);
  }
  auto end_both = [&] {
    shutdown(client, SHUT_RDWR);
    shutdown(server, SHUT_RDWR);
  };
  // To the peer: bytes as they come.
  std::thread downstream{[&] {
    std::vector<char> buf(64 << 10);
    for (;;) {
      auto n = ::read(server, buf.data(), buf.size());
      if (n < 0 && errno == EINTR)
        continue;
      if (n <= 0 || !write_full(client, buf.data(), static_cast<size_t>(n)))
        break;
    }
    end_both();
  }};
  // From the peer: frame by frame, each payload streamed through a fixed buffer.
  std::vector<char> buf(64 << 10);
  char header[basp_header_size];
  while (read_full(client, header, sizeof(header))) {
    uint32_t net_length = 0;
    std::memcpy(&net_length, header + payload_length_offset, sizeof(net_length));
    uint64_t length = ntohl(net_length);
    if (length > max_frame_bytes_) {
      log_->warn("refused {}: a message of {} bytes, above the bound of {}", peer, length,
                 max_frame_bytes_);
      break;
    }
    if (!write_full(server, header, sizeof(header)))
      break;
    bool ok = true;
    while (length > 0 && ok) {
      auto chunk = static_cast<size_t>(std::min<uint64_t>(length, buf.size()));
      ok = read_full(client, buf.data(), chunk) && write_full(server, buf.data(), chunk);
      length -= chunk;
    }
    if (!ok)
      break;
  }
  end_both();
  downstream.join();
  {
    std::lock_guard<std::mutex> guard{mtx_};
    sockets_.erase(client);
    sockets_.erase(server);
  }
  close(client);
  close(server);
  log_->info("connection from {} closed", peer);
}

} // namespace troupe
