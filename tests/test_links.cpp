// A call link's transport on its own: link sockets over a socket pair or loopback TCP, the
// rings in shared memory that links on one host move to, and what a peer that breaks them
// can do.

#include "actors/cluster/link_socket.hpp"
#include "actors/cluster/link_tls.hpp"
#include "actors/cluster/shared_rings.hpp"
#include "tests/test_pki.hpp"
#include "tests/test_worker.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

using namespace troupe;
using namespace std::chrono_literals;
using troupe::testing::code_of;
using troupe::testing::test_pki;

namespace {

using clock_type = std::chrono::steady_clock;

/// Two ends of one connection: a Unix socket pair, or loopback TCP.
std::pair<int, int> connected_pair(bool unix_socket) {
  if (unix_socket) {
    int fds[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
    return {fds[0], fds[1]};
  }
  int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  REQUIRE(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(listen(listener, 1) == 0);
  REQUIRE(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  int client = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  int server = accept(listener, nullptr, nullptr);
  REQUIRE(server >= 0);
  close(listener);
  return {server, client};
}

std::vector<char> pattern(size_t size, unsigned seed) {
  std::vector<char> bytes(size);
  for (size_t i = 0; i < size; ++i)
    bytes[i] = static_cast<char>((i * 131 + seed * 7) & 0xff);
  return bytes;
}

/// The node's side of a call link's TLS handshake on `fd` (blocking), as its gateway goes
/// through it: the preamble, then the handshake. None when it fails.
std::unique_ptr<tls_session> accept_tls(int fd, const std::shared_ptr<ssl_ctx_st>& context) {
  std::string preamble(tls_link_preamble_size, '\0');
  if (recv(fd, preamble.data(), preamble.size(), MSG_WAITALL) !=
        static_cast<ssize_t>(preamble.size()) ||
      preamble != tls_link_preamble)
    return nullptr;
  auto session = std::make_unique<tls_session>(context, tls_role::server);
  std::vector<char> out;
  char in[16 << 10];
  for (;;) {
    out.clear();
    auto step = session->handshake(out);
    if (!out.empty() &&
        send(fd, out.data(), out.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(out.size()))
      return nullptr;
    if (step == tls_session::progress::done)
      return session;
    if (step == tls_session::progress::failed)
      return nullptr;
    auto n = recv(fd, in, sizeof in, 0);
    if (n <= 0)
      return nullptr;
    session->give(in, static_cast<size_t>(n));
  }
}

/// A node's end and an executor's end of one link, the executor having asked for shared
/// rings of `capacity` bytes (`ask`); `linger`: how long their waits poll before they
/// sleep. With `pki`, the ends went through the TLS handshake first, as a link to a node
/// under TLS does.
struct link_pair {
  std::unique_ptr<link_socket> node;
  std::unique_ptr<link_socket> executor;
  /// The ends' descriptors, for bytes that no link socket would write or read.
  int node_fd = -1;
  int executor_fd = -1;
  /// What `ask_rings` returned, and its `why`.
  bool shared = false;
  std::string why;

  link_pair(bool unix_socket, uint64_t capacity, timeout_type linger = 0us,
            const test_pki* pki = nullptr, bool ask = true) {
    auto fds = connected_pair(unix_socket);
    node_fd = fds.first;
    executor_fd = fds.second;
    std::unique_ptr<tls_session> node_tls;
    std::unique_ptr<tls_session> executor_tls;
    if (pki) {
      auto accepted = std::async(std::launch::async, [&] {
        return accept_tls(node_fd, make_tls_context(tls_role::server, pki->pem("node"),
                                                    pki->key("node"), pki->pem("ca")));
      });
      executor_tls = tls_connect(executor_fd,
                                 make_tls_context(tls_role::client, pki->pem("executor"),
                                                  pki->key("executor"), pki->pem("ca")),
                                 "the node", clock_type::now() + 5s);
      node_tls = accepted.get();
      REQUIRE(node_tls);
    }
    node = std::make_unique<link_socket>(node_fd, linger, 64 << 20, 5s, std::move(node_tls));
    executor =
      std::make_unique<link_socket>(executor_fd, linger, 64 << 20, 5s, std::move(executor_tls));
    if (!ask)
      return;
    // The node answers the request as its link's reader does.
    auto answer = std::async(std::launch::async, [&] {
      link_socket::frame f;
      std::string ignored, declined;
      REQUIRE(node->read(f, ignored));
      REQUIRE(f.type == link_socket::share);
      return node->offer_rings(capacity, declined);
    });
    shared = executor->ask_rings(clock_type::now() + 5s, why);
    REQUIRE(answer.get());
  }
};

/// Frames of many sizes each way over `link`, in order, both ends reading and writing at
/// once: those around the ring's 4 KiB and the read-ahead's 16 KiB, many times round the
/// ring, and (`large`) some larger than a TLS record and the 1 MiB part of a sealed write.
void frames_both_ways(link_pair& link, bool large) {
  std::vector<size_t> sizes{0, 1, 100, 4072, 4073, 5000, 16384, 100000, 3, 70000};
  if (large)
    sizes.insert(sizes.end(), {(size_t{1} << 20) - 24, size_t{1} << 20, (size_t{3} << 20) + 5});
  for (int round = 0; round < 3; ++round)
    for (size_t i = 0; i < 10; ++i)
      sizes.push_back((i * 977 + round * 313) % 9000);
  auto send_all = [&sizes](link_socket& writer) {
    for (size_t i = 0; i < sizes.size(); ++i)
      if (!writer.write(link_socket::request, i, i * 3, pattern(sizes[i], i)))
        return false;
    return true;
  };
  auto read_all = [&sizes](link_socket& reader) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      link_socket::frame f;
      std::string why;
      if (!reader.wait(
            5s, [] { return true; }, -1, true) ||
          !reader.read(f, why) || f.type != link_socket::request || f.key != i ||
          f.target != i * 3 || f.payload != pattern(sizes[i], i))
        return "frame " + std::to_string(i) + ": " + (why.empty() ? "not the one sent" : why);
    }
    return std::string{};
  };
  auto to_node = std::async(std::launch::async, [&] { return send_all(*link.executor); });
  auto from_node = std::async(std::launch::async, [&] { return send_all(*link.node); });
  auto node_read = std::async(std::launch::async, [&] { return read_all(*link.node); });
  CHECK(read_all(*link.executor) == "");
  CHECK(node_read.get() == "");
  CHECK(to_node.get());
  CHECK(from_node.get());
}

/// Why the next read on `end` fails, once something came: empty when it succeeds.
std::string why_read_fails(link_socket& end) {
  REQUIRE(end.wait(
    5s, [] { return false; }, -1, true));
  link_socket::frame f;
  std::string why;
  return end.read(f, why) ? std::string{} : why;
}

/// The bytes of the mapping `rings` made, as a third party (another mapping of it) sees
/// them: a peer that writes where it likes.
char* scribbler(const shared_rings& rings) {
  auto size = 4096 + 2 * rings.capacity();
  void* at = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, rings.fd(), 0);
  REQUIRE(at != MAP_FAILED);
  return static_cast<char*>(at);
}

} // namespace

TEST_CASE("frames go through shared rings in order, across the wrap, and larger than a ring "
          "in parts") {
  link_pair link{true, 4096};
  REQUIRE(link.shared);
  CHECK(link.why.empty());
  CHECK(link.node->has_rings());
  CHECK(link.executor->has_rings());
  frames_both_ways(link, false);
}

TEST_CASE("under TLS frames go encrypted, in order, over TCP and a Unix socket, and over a "
          "Unix socket move to shared rings") {
  test_pki pki;
  SUBCASE("TCP") {
    link_pair link{false, 4096, 0us, &pki};
    CHECK_FALSE(link.shared);
    CHECK(link.why.empty());
    frames_both_ways(link, true);
  }
  SUBCASE("a Unix socket") {
    link_pair link{true, 4096, 0us, &pki, false};
    frames_both_ways(link, true);
  }
  SUBCASE("shared rings, asked for and given through TLS") {
    link_pair link{true, 4096, 0us, &pki};
    REQUIRE_MESSAGE(link.shared, link.why);
    CHECK(link.node->has_rings());
    CHECK(link.executor->has_rings());
    frames_both_ways(link, true);
  }
  SUBCASE("what goes on the socket is TLS records, not the frame") {
    link_pair link{false, 4096, 0us, &pki, false};
    auto payload = pattern(1000, 9);
    REQUIRE(link.executor->write(link_socket::request, 1, 2, payload));
    std::vector<char> wire(4096);
    auto n = recv(link.node_fd, wire.data(), wire.size(), 0);
    REQUIRE(n > 1000);
    wire.resize(static_cast<size_t>(n));
    CHECK(static_cast<unsigned char>(wire[0]) == 0x17); // application data
    CHECK(std::search(wire.begin(), wire.end(), payload.begin(), payload.begin() + 64) ==
          wire.end());
  }
  SUBCASE("a record changed on the way breaks the link, naming TLS") {
    link_pair link{false, 4096, 0us, &pki, false};
    REQUIRE(link.executor->write(link_socket::request, 1, 2, pattern(1000, 9)));
    std::vector<char> wire(4096);
    auto n = recv(link.node_fd, wire.data(), wire.size(), 0);
    REQUIRE(n > 100);
    wire[static_cast<size_t>(n) / 2] ^= 1;
    // Sent again from the executor's side, as a peer in the middle would.
    REQUIRE(send(link.executor_fd, wire.data(), static_cast<size_t>(n), MSG_NOSIGNAL) == n);
    auto why = why_read_fails(*link.node);
    CHECK_MESSAGE(why.rfind("TLS: ", 0) == 0, why);
  }
}

TEST_CASE("a call link's TLS handshake refuses a certificate of another CA, both ways") {
  test_pki pki;
  for (bool stranger_is_node : {false, true}) {
    CAPTURE(stranger_is_node);
    auto fds = connected_pair(false);
    auto node_cert = stranger_is_node ? "stranger" : "node";
    auto executor_cert = stranger_is_node ? "executor" : "stranger";
    auto accepted = std::async(std::launch::async, [&] {
      auto session = accept_tls(fds.first, make_tls_context(tls_role::server, pki.pem(node_cert),
                                                            pki.key(node_cert), pki.pem("ca")));
      close(fds.first);
      return session != nullptr;
    });
    // Under TLS 1.3 the client is done before the node judges its certificate: the node's
    // refusal closes the connection.
    std::unique_ptr<tls_session> session;
    auto code = code_of([&] {
      session = tls_connect(fds.second,
                            make_tls_context(tls_role::client, pki.pem(executor_cert),
                                             pki.key(executor_cert), pki.pem("ca")),
                            "the node", clock_type::now() + 5s);
    });
    CHECK_FALSE(accepted.get());
    if (stranger_is_node) {
      CHECK(code == errc::invalid_argument);
    } else {
      link_socket end{fds.second, 0us, 1 << 20, 5s, std::move(session)};
      CHECK(why_read_fails(end) != "");
      fds.second = -1; // closed by `end`
    }
    if (fds.second >= 0)
      close(fds.second);
  }
  CHECK(code_of([&] {
          make_tls_context(tls_role::client, pki.pem("executor"), pki.key("node"), pki.pem("ca"));
        }) == errc::invalid_argument);
  CHECK(code_of([&] {
          make_tls_context(tls_role::client, pki.dir + "/none.pem", pki.key("executor"),
                           pki.pem("ca"));
        }) == errc::invalid_argument);
}

TEST_CASE("under TLS one end reads while three threads write, and no frame is lost or torn") {
  test_pki pki;
  link_pair link{false, 4096, 50us, &pki, false};
  constexpr int per_writer = 400;
  // The node echoes every frame; the executor's three writers share its end with its reader.
  auto echo = std::async(std::launch::async, [&] {
    for (int i = 0; i < 3 * per_writer; ++i) {
      link_socket::frame f;
      std::string why;
      if (!link.node->wait(
            5s, [] { return true; }, -1, true) ||
          !link.node->read(f, why) || !link.node->write(link_socket::reply, f.key, 0, f.payload))
        return i;
    }
    return 3 * per_writer;
  });
  std::vector<std::future<bool>> writers;
  for (uint64_t w = 0; w < 3; ++w)
    writers.push_back(std::async(std::launch::async, [&, w] {
      for (uint64_t i = 0; i < per_writer; ++i) {
        auto key = w * per_writer + i;
        if (!link.executor->write(link_socket::request, key, 0,
                                  pattern((key * 37) % 20000, static_cast<unsigned>(key))))
          return false;
      }
      return true;
    }));
  std::vector<bool> seen(3 * per_writer);
  int good = 0;
  for (int i = 0; i < 3 * per_writer; ++i) {
    link_socket::frame f;
    std::string why;
    if (!link.executor->wait(
          5s, [] { return true; }, -1, true) ||
        !link.executor->read(f, why))
      break;
    if (f.key < seen.size() && !seen[f.key] &&
        f.payload == pattern((f.key * 37) % 20000, static_cast<unsigned>(f.key))) {
      seen[f.key] = true;
      ++good;
    }
  }
  CHECK(good == 3 * per_writer);
  CHECK(echo.get() == 3 * per_writer);
  for (auto& w : writers)
    CHECK(w.get());
}

TEST_CASE("a reader asleep on shared rings wakes for a frame, and for the peer's close only "
          "after what it wrote") {
  // No lingering: every wait sleeps on the doorbell at once.
  link_pair link{true, 1 << 16};
  REQUIRE(link.shared);
  for (int i = 0; i < 20; ++i) {
    auto later = std::async(std::launch::async, [&] {
      std::this_thread::sleep_for(2ms);
      return link.executor->write(link_socket::ping, i, 0, {});
    });
    // Woken by the frame's doorbell, not by the limit (after which it would find the frame
    // too).
    auto start = clock_type::now();
    REQUIRE(link.node->wait(
      3s, [] { return false; }, -1, true));
    CHECK(clock_type::now() - start < 3s);
    link_socket::frame f;
    std::string why;
    REQUIRE(link.node->read(f, why));
    CHECK(f.type == link_socket::ping);
    CHECK(f.key == static_cast<uint64_t>(i));
    CHECK(later.get());
  }
  // Nothing comes: a wait with a limit returns at it.
  auto start = clock_type::now();
  CHECK_FALSE(link.node->wait(
    50ms, [] { return false; }, -1, true));
  CHECK(clock_type::now() - start >= 40ms);
  // Two frames, then the executor's end goes away: both are read, then the close.
  REQUIRE(link.executor->write(link_socket::request, 1, 2, pattern(300, 1)));
  REQUIRE(link.executor->write(link_socket::request, 2, 2, pattern(30000, 2)));
  link.executor.reset();
  for (uint64_t key : {1, 2}) {
    link_socket::frame f;
    std::string why;
    REQUIRE(link.node->wait(
      5s, [] { return false; }, -1, true));
    REQUIRE_MESSAGE(link.node->read(f, why), why);
    CHECK(f.key == key);
  }
  CHECK(why_read_fails(*link.node) == "the peer closed the connection");
}

TEST_CASE("through shared rings a ping-pong of thousands of rounds between threads that sleep "
          "at once loses no wake-up") {
  // No lingering: every wait that finds nothing says it sleeps and sleeps, so each round
  // races a writer's doorbell against a reader going to sleep.
  link_pair link{true, 4096};
  REQUIRE(link.shared);
  auto pong = std::async(std::launch::async, [&] {
    for (int i = 0; i < 3000; ++i) {
      link_socket::frame f;
      std::string why;
      if (!link.node->wait(
            5s, [] { return false; }, -1, true) ||
          !link.node->read(f, why) || f.key != static_cast<uint64_t>(i) ||
          !link.node->write(link_socket::pong, f.key, 0, f.payload))
        return i;
    }
    return 3000;
  });
  int round = 0;
  for (; round < 3000; ++round) {
    link_socket::frame f;
    std::string why;
    if (!link.executor->write(link_socket::ping, round, 0, pattern(round % 50, round)) ||
        !link.executor->wait(
          5s, [] { return false; }, -1, true) ||
        !link.executor->read(f, why) || f.key != static_cast<uint64_t>(round) ||
        f.payload != pattern(round % 50, round))
      break;
  }
  CHECK(round == 3000);
  CHECK(pong.get() == 3000);
}

TEST_CASE("shut wakes a thread asleep on shared rings, and a peer that floods the socket "
          "with doorbells breaks the link") {
  {
    link_pair link{true, 4096};
    REQUIRE(link.shared);
    auto waited = std::async(std::launch::async, [&] {
      return link.node->wait(
        std::chrono::milliseconds(-1), [] { return false; }, -1, true);
    });
    std::this_thread::sleep_for(20ms);
    link.node->shut();
    REQUIRE(waited.wait_for(5s) == std::future_status::ready);
    waited.get(); // woken, by the end that the next read reports
    link_socket::frame f;
    std::string why;
    CHECK_FALSE(link.node->read(f, why));
    CHECK(why == "closed");
    CHECK_FALSE(link.node->write(link_socket::ping, 1, 0, {}));
  }
  link_pair link{true, 4096};
  REQUIRE(link.shared);
  // A doorbell for each time the node sleeps is all a peer may ring.
  std::string bells(1000, 'x');
  REQUIRE(send(link.executor_fd, bells.data(), bells.size(), MSG_NOSIGNAL) == 1000);
  CHECK(why_read_fails(*link.node) == "the peer broke the shared-memory protocol");
}

TEST_CASE("over TCP a request for shared memory is declined and the frames stay on the "
          "socket") {
  link_pair link{false, 4096};
  CHECK_FALSE(link.shared);
  CHECK(link.why.empty());
  CHECK_FALSE(link.node->has_rings());
  CHECK_FALSE(link.executor->has_rings());
  REQUIRE(link.executor->write(link_socket::request, 7, 8, pattern(10000, 3)));
  link_socket::frame f;
  std::string why;
  REQUIRE(link.node->read(f, why));
  CHECK(f.key == 7);
  CHECK(f.payload == pattern(10000, 3));
}

TEST_CASE("shared rings refuse a capacity out of range, and memory that could shrink or is "
          "not the size named") {
  CHECK(code_of([] { shared_rings::create(1000); }) == errc::invalid_argument);
  CHECK(code_of([] { shared_rings::create(uint64_t{1} << 30); }) == errc::invalid_argument);
  auto rings = shared_rings::create(4096);
  // The size the node gave is part of the answer: another one is refused.
  CHECK(code_of([&] { shared_rings::adopt(dup(rings->fd()), 8192); }) == errc::invalid_argument);
  CHECK(shared_rings::adopt(dup(rings->fd()), 4096) != nullptr);
  // A memfd without seals: the peer could shrink it and fault this process.
  int unsealed = memfd_create("unsealed", MFD_CLOEXEC);
  REQUIRE(unsealed >= 0);
  REQUIRE(ftruncate(unsealed, 4096 + 2 * 4096) == 0);
  CHECK(code_of([&] { shared_rings::adopt(unsealed, 4096); }) == errc::invalid_argument);
  // A pipe is no file to map.
  int pipe_fds[2];
  REQUIRE(pipe(pipe_fds) == 0);
  CHECK(code_of([&] { shared_rings::adopt(pipe_fds[0], 4096); }) == errc::invalid_argument);
  close(pipe_fds[1]);
}

TEST_CASE("positions a peer breaks in shared rings end the link, and nothing is read or "
          "written outside the rings") {
  auto node = shared_rings::create(4096);
  auto executor = shared_rings::adopt(dup(node->fd()), 4096);
  auto* bytes = scribbler(*node);
  auto position = [&](size_t offset) {
    return reinterpret_cast<std::atomic<uint64_t>*>(bytes + offset);
  };
  // The node writes the first ring (positions at 0 and 64) and reads the second (at 2048).
  auto* executor_tail = position(64);
  auto* node_head = position(2048);
  std::vector<char> out(100, 'a');
  std::vector<char> in(8192);
  REQUIRE(node->push(out.data(), out.size()) == 100);
  REQUIRE(executor->pull(in.data(), in.size()) == 100);
  CHECK(executor_tail->load() == 100);

  SUBCASE("a head beyond what the ring holds") {
    REQUIRE(executor->push(out.data(), 10) == 10);
    node_head->store(10 + 4097);
    CHECK(node->incoming() > 0); // the reader looks, and finds
    CHECK(node->pull(in.data(), in.size()) == 0);
    CHECK(node->broken());
  }
  SUBCASE("a head moved back after it announced bytes") {
    REQUIRE(executor->push(out.data(), 100) == 100);
    CHECK(node->incoming() == 100);
    node_head->store(50);
    CHECK(node->pull(in.data(), in.size()) == 0);
    CHECK(node->broken());
  }
  SUBCASE("a head behind what was read") {
    REQUIRE(executor->push(out.data(), 10) == 10);
    REQUIRE(node->pull(in.data(), in.size()) == 10);
    node_head->store(5);
    CHECK(node->pull(in.data(), in.size()) == 0);
    CHECK(node->broken());
  }
  SUBCASE("a tail beyond what was written") {
    executor_tail->store(101);
    CHECK(node->push(out.data(), out.size()) == 0);
    CHECK(node->broken());
  }
  SUBCASE("a tail that frees more than the ring holds") {
    // As though the reader took bytes from before the start: 100 written, 4096 + 100 room.
    executor_tail->store(uint64_t{0} - 4096);
    CHECK(node->push(out.data(), out.size()) == 0);
    CHECK(node->broken());
  }
  munmap(bytes, 4096 + 2 * 4096);
}
