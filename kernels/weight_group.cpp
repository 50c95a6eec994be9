#include "troupe/weight_group.hpp"

#include "kernels/cpu/gloo_communicator.hpp"
#include "kernels/cuda_module.hpp"
#include "troupe/errors.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace troupe {

namespace {

using clock = std::chrono::steady_clock;

constexpr char magic[16] = "troupe-weights2";
/// A Gloo pair address is a few hundred bytes; anything longer is not one.
constexpr uint32_t max_address = 4096;
constexpr int32_t max_world = 4096;

/// A socket closed with the object.
struct socket_fd {
  int fd = -1;
  explicit socket_fd(int f = -1) : fd(f) {}
  socket_fd(socket_fd&& o) noexcept : fd(o.fd) {
    o.fd = -1;
  }
  socket_fd& operator=(socket_fd&& o) noexcept {
    std::swap(fd, o.fd);
    return *this;
  }
  ~socket_fd() {
    if (fd >= 0)
      ::close(fd);
  }
};

[[noreturn]] void fail(errc code, const std::string& what) {
  throw error{code, "weight-update group: " + what};
}

int remaining_ms(clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left.count(), 1 << 30)));
}

/// Waits until `fd` is ready for `events`; false at the deadline.
bool wait_for(int fd, short events, clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n > 0)
      return true;
    if (n == 0)
      return false;
    if (errno != EINTR)
      fail(errc::worker_error, std::string{"poll: "} + std::strerror(errno));
  }
}

void read_exact(int fd, void* data, size_t n, clock::time_point deadline) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_for(fd, POLLIN, deadline))
      fail(errc::timeout, "a member did not finish its part of the meeting in time");
    auto got = ::recv(fd, p, n, 0);
    if (got == 0)
      fail(errc::worker_died, "a member closed its connection during the meeting");
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN)
        continue;
      fail(errc::worker_died, std::string{"recv: "} + std::strerror(errno));
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
}

void write_all(int fd, const void* data, size_t n, clock::time_point deadline) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!wait_for(fd, POLLOUT, deadline))
      fail(errc::timeout, "a member did not read its part of the meeting in time");
    auto put = ::send(fd, p, n, MSG_NOSIGNAL);
    if (put < 0) {
      if (errno == EINTR || errno == EAGAIN)
        continue;
      fail(errc::worker_died, std::string{"send: "} + std::strerror(errno));
    }
    p += put;
    n -= static_cast<size_t>(put);
  }
}

void write_u32(std::string& out, uint32_t v) {
  v = htonl(v);
  out.append(reinterpret_cast<const char*>(&v), 4);
}

uint32_t read_u32(int fd, clock::time_point deadline) {
  uint32_t v = 0;
  read_exact(fd, &v, 4, deadline);
  return ntohl(v);
}

/// A member's entry of the meeting's table: its count, then each string.
void write_strings(std::string& out, const std::vector<std::string>& items) {
  write_u32(out, static_cast<uint32_t>(items.size()));
  for (auto& s : items) {
    write_u32(out, static_cast<uint32_t>(s.size()));
    out += s;
  }
}

/// In place of the table: the meeting is off, and why (a string follows).
constexpr uint32_t refused = 0xffffffff;

/// The `count` strings of an entry.
std::vector<std::string> read_entry(int fd, uint32_t count, clock::time_point deadline) {
  if (count > static_cast<uint32_t>(max_world))
    fail(errc::invalid_argument, "a member sent an entry of " + std::to_string(count) +
                                   " strings (over the largest world)");
  std::vector<std::string> items(count);
  for (auto& s : items) {
    auto size = read_u32(fd, deadline);
    if (size > max_address)
      fail(errc::invalid_argument, "a member sent an address of " + std::to_string(size) +
                                     " bytes (not a Gloo pair address or an NCCL id)");
    s.resize(size);
    read_exact(fd, s.data(), size, deadline);
  }
  return items;
}

/// A member's entry of the table; throws what rank 0 said when it called the meeting off.
std::vector<std::string> read_strings(int fd, clock::time_point deadline) {
  auto count = read_u32(fd, deadline);
  if (count == refused) {
    auto why = read_entry(fd, std::min<uint32_t>(read_u32(fd, deadline), 1), deadline);
    fail(errc::invalid_argument,
         "member 0 called the meeting off: " + (why.empty() ? std::string{"(no reason)"} : why[0]));
  }
  return read_entry(fd, count, deadline);
}

addrinfo* resolve(const std::string& host, int32_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* found = nullptr;
  auto port_text = std::to_string(port);
  if (int rc = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &found); rc != 0)
    fail(errc::invalid_argument, "master address '" + host + "': " + ::gai_strerror(rc));
  return found;
}

/// The numeric host of a socket's own end.
std::string local_host(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0)
    fail(errc::worker_error, std::string{"getsockname: "} + std::strerror(errno));
  char text[INET6_ADDRSTRLEN] = {};
  const void* addr = ss.ss_family == AF_INET
                       ? static_cast<const void*>(&reinterpret_cast<sockaddr_in&>(ss).sin_addr)
                       : static_cast<const void*>(&reinterpret_cast<sockaddr_in6&>(ss).sin6_addr);
  ::inet_ntop(ss.ss_family, addr, text, sizeof text);
  return text;
}

/// The backends, as the meeting names them (members of different backends cannot pair).
enum class transport : uint32_t { gloo = 1, nccl = 2 };

transport transport_of(const std::string& backend) {
  if (backend == "gloo")
    return transport::gloo;
  if (backend == "nccl")
    return transport::nccl;
  fail(errc::invalid_argument, "backend '" + backend + "' (gloo or nccl)");
}

const char* name_of(transport t) {
  return t == transport::nccl ? "nccl" : "gloo";
}

} // namespace

struct weight_update_group::impl {
  int32_t rank = 0;
  int32_t world = 0;
  transport backend = transport::gloo;
  std::chrono::milliseconds timeout{};
  std::unique_ptr<gloo_communicator> gloo;
  std::unique_ptr<gpu_broadcaster> gpu;

  /// This member's entry of the meeting's table; `host`: where its Gloo pairs listen.
  std::vector<std::string> entry(const std::string& host) {
    if (backend == transport::nccl)
      return rank == 0 ? std::vector<std::string>{cuda().make_collective_id()}
                       : std::vector<std::string>{};
    gloo = std::make_unique<gloo_communicator>(rank, world, host, timeout);
    return gloo->prepare();
  }

  void connect(const std::vector<std::vector<std::string>>& table) {
    if (backend == transport::gloo)
      return gloo->connect(table);
    if (table[0].size() != 1)
      fail(errc::invalid_argument, "member 0 sent no NCCL id");
    gpu->join(rank, world, table[0][0]);
  }
};

weight_update_group::weight_update_group(const std::string& master_address, int32_t master_port,
                                         int32_t rank, int32_t world_size, timeout_type timeout,
                                         const std::string& backend, int32_t gpu)
  : impl_(std::make_unique<impl>()) {
  if (world_size < 2 || world_size > max_world)
    fail(errc::invalid_argument, "world_size must be in [2, " + std::to_string(max_world) +
                                   "], not " + std::to_string(world_size));
  if (rank < 0 || rank >= world_size)
    fail(errc::invalid_argument,
         "rank " + std::to_string(rank) + " is outside a world of " + std::to_string(world_size));
  if (master_port < 1 || master_port > 65535)
    fail(errc::invalid_argument, "master_port " + std::to_string(master_port) + " is no port");
  auto& self = *impl_;
  self.rank = rank;
  self.world = world_size;
  self.backend = transport_of(backend);
  self.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
  // A GPU that cannot take part is refused before the meeting, which would wait for it.
  if (self.backend == transport::nccl)
    self.gpu = cuda().make_broadcaster(gpu, self.timeout);
  auto deadline = clock::now() + timeout;
  auto W = static_cast<size_t>(world_size);
  std::vector<std::vector<std::string>> table(W);
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addrs{
    resolve(master_address, master_port, rank == 0), &::freeaddrinfo};
  if (rank == 0) {
    socket_fd listener{::socket(addrs->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0)};
    int one = 1;
    ::setsockopt(listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (listener.fd < 0 || ::bind(listener.fd, addrs->ai_addr, addrs->ai_addrlen) != 0 ||
        ::listen(listener.fd, world_size) != 0)
      fail(errc::invalid_argument, "cannot listen on " + master_address + ":" +
                                     std::to_string(master_port) + ": " + std::strerror(errno));
    std::vector<socket_fd> members(W);
    for (size_t joined = 1; joined < W;) {
      if (!wait_for(listener.fd, POLLIN, deadline))
        fail(errc::timeout, std::to_string(W - joined) + " of " + std::to_string(W - 1) +
                              " members did not come to " + master_address + ":" +
                              std::to_string(master_port) + " in time");
      socket_fd conn{::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC)};
      if (conn.fd < 0)
        continue;
      std::optional<transport> other; // a member of another backend
      // A stranger's bytes end its own connection, not the meeting; nor does its silence
      // hold the meeting past a few seconds.
      try {
        auto hello_deadline = std::min(deadline, clock::now() + std::chrono::seconds(10));
        char said[sizeof magic];
        read_exact(conn.fd, said, sizeof said, hello_deadline);
        if (std::memcmp(said, magic, sizeof magic) != 0)
          continue;
        auto r = read_u32(conn.fd, hello_deadline);
        auto w = read_u32(conn.fd, hello_deadline);
        auto came_with = static_cast<transport>(read_u32(conn.fd, hello_deadline));
        if (w != W || r == 0 || r >= W || members[r].fd >= 0 ||
            (came_with != transport::gloo && came_with != transport::nccl))
          continue;
        if (came_with != self.backend) {
          other = came_with;
          read_strings(conn.fd, hello_deadline); // read, so that closing does not reset it
          members[r] = std::move(conn);          // told why below, with the others
        } else {
          table[r] = read_strings(conn.fd, hello_deadline);
          members[r] = std::move(conn);
          ++joined;
        }
      } catch (const error& e) {
        if (e.code() == errc::timeout && clock::now() >= deadline)
          throw;
      }
      if (other) {
        // Everyone who came hears why, rather than waiting out the timeout.
        auto why = std::string{"a member came with the "} + name_of(*other) +
                   " backend; this group's is " + name_of(self.backend);
        std::string off;
        write_u32(off, refused);
        write_strings(off, {why});
        for (auto& m : members)
          if (m.fd >= 0) {
            try {
              write_all(m.fd, off.data(), off.size(), clock::now() + std::chrono::seconds(1));
            } catch (const error&) {
            }
          }
        fail(errc::invalid_argument, why);
      }
    }
    // Made once everyone has come: NCCL's id starts a listener that a failed meeting would
    // leave behind.
    table[0] = self.entry(master_address);
    std::string answer;
    for (auto& row : table)
      write_strings(answer, row);
    for (size_t r = 1; r < W; ++r)
      write_all(members[r].fd, answer.data(), answer.size(), deadline);
  } else {
    socket_fd conn;
    for (;;) {
      conn = socket_fd{::socket(addrs->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0)};
      if (::connect(conn.fd, addrs->ai_addr, addrs->ai_addrlen) == 0)
        break;
      if (clock::now() >= deadline)
        fail(errc::timeout, "rank 0 did not listen on " + master_address + ":" +
                              std::to_string(master_port) + " in time");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    std::string hello{magic, sizeof magic};
    write_u32(hello, static_cast<uint32_t>(rank));
    write_u32(hello, static_cast<uint32_t>(world_size));
    write_u32(hello, static_cast<uint32_t>(self.backend));
    write_strings(hello, self.entry(local_host(conn.fd)));
    write_all(conn.fd, hello.data(), hello.size(), deadline);
    for (auto& row : table)
      row = read_strings(conn.fd, deadline);
  }
  self.connect(table);
}

weight_update_group::~weight_update_group() = default;

void weight_update_group::broadcast(void* data, size_t bytes, int32_t root) {
  send(data, bytes, root, false);
}

void weight_update_group::broadcast_gpu(void* data, size_t bytes, int32_t root) {
  if (impl_->backend != transport::nccl)
    fail(errc::invalid_argument, "GPU memory is broadcast by the nccl backend; this group's is " +
                                   std::string{name_of(impl_->backend)});
  send(data, bytes, root, true);
}

void weight_update_group::send(void* data, size_t bytes, int32_t root, bool on_gpu) {
  if (root < 0 || root >= impl_->world)
    fail(errc::invalid_argument,
         "root " + std::to_string(root) + " is outside a world of " + std::to_string(impl_->world));
  if (impl_->gpu)
    impl_->gpu->broadcast(data, bytes, root, on_gpu);
  else
    impl_->gloo->broadcast(data, bytes, root);
}

int32_t weight_update_group::rank() const {
  return impl_->rank;
}

int32_t weight_update_group::world_size() const {
  return impl_->world;
}

std::string weight_update_group::backend() const {
  return name_of(impl_->backend);
}

} // namespace troupe
