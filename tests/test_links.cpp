// A call link's transport on its own: link sockets over a socket pair or loopback TCP, the
// rings in shared memory that links on one host move to, and what a peer that breaks them
// can do.

#include "actors/node_link.hpp"
#include "actors/shared_rings.hpp"
#include "tests/test_worker.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>

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

/// A node's end and an executor's end of one link, the executor having asked for shared
/// rings of `capacity` bytes; `linger`: how long their waits poll before they sleep.
struct link_pair {
  std::unique_ptr<link_socket> node;
  std::unique_ptr<link_socket> executor;
  /// The executor's descriptor, for bytes that no link socket would write.
  int executor_fd = -1;
  /// What `ask_rings` returned, and its `why`.
  bool shared = false;
  std::string why;

  link_pair(bool unix_socket, uint64_t capacity, timeout_type linger = 0us) {
    auto fds = connected_pair(unix_socket);
    executor_fd = fds.second;
    node = std::make_unique<link_socket>(fds.first, linger, 64 << 20, 5s);
    executor = std::make_unique<link_socket>(fds.second, linger, 64 << 20, 5s);
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

std::vector<char> pattern(size_t size, unsigned seed) {
  std::vector<char> bytes(size);
  for (size_t i = 0; i < size; ++i)
    bytes[i] = static_cast<char>((i * 131 + seed * 7) & 0xff);
  return bytes;
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
  // Sizes around the ring's 4 KiB and the read-ahead's 16 KiB, many times round the ring.
  std::vector<size_t> sizes{0, 1, 100, 4072, 4073, 5000, 16384, 100000, 3, 70000};
  for (int round = 0; round < 3; ++round)
    for (size_t i = 0; i < 10; ++i)
      sizes.push_back((i * 977 + round * 313) % 9000);
  for (bool to_node : {true, false}) {
    CAPTURE(to_node);
    auto& writer = to_node ? *link.executor : *link.node;
    auto& reader = to_node ? *link.node : *link.executor;
    auto wrote = std::async(std::launch::async, [&] {
      for (size_t i = 0; i < sizes.size(); ++i)
        if (!writer.write(link_socket::request, i, i * 3, pattern(sizes[i], i)))
          return false;
      return true;
    });
    for (size_t i = 0; i < sizes.size(); ++i) {
      CAPTURE(i);
      link_socket::frame f;
      std::string why;
      REQUIRE(reader.wait(
        5s, [] { return true; }, -1, true));
      REQUIRE_MESSAGE(reader.read(f, why), why);
      CHECK(f.type == link_socket::request);
      CHECK(f.key == i);
      CHECK(f.target == i * 3);
      CHECK(f.payload == pattern(sizes[i], i));
    }
    CHECK(wrote.get());
  }
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
