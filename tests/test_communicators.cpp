// The CPU collectives. In one process: sums in rank order, the same bits on every rank, and
// a rank that does not come is reported instead of waited on. Both kinds, Gloo over TCP
// too: an abort (a member is known to be dead) ends a wait at once. The weight-update
// group's meeting and its Gloo broadcasts (its NCCL ones are in test_cuda).

#include "kernels/cpu/gloo_communicator.hpp"
#include "kernels/cpu/local_communicator.hpp"
#include "tests/ports.hpp"
#include "tests/random.hpp"
#include "troupe/errors.hpp"
#include "troupe/weight_group.hpp"

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

using namespace troupe;
using namespace std::chrono_literals;
using troupe::testing::free_port;

TEST_CASE("ranks in one process all-reduce to the rank-order sum, the same bits on each") {
  const int size = 3;
  std::vector<std::vector<std::vector<float>>> results(size);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < size; ++rank)
    ranks.emplace_back([&, rank] {
      local_communicator comm{rank, size, "sum-test", 10s};
      for (int call = 0; call < 50; ++call) {
        auto data = testing::random_floats(static_cast<size_t>(1 + call * 7), call * 10 + rank);
        comm.all_reduce(data.data(), data.size());
        results[static_cast<size_t>(rank)].push_back(data);
      }
    });
  for (auto& t : ranks)
    t.join();
  for (int call = 0; call < 50; ++call) {
    auto n = static_cast<size_t>(1 + call * 7);
    std::vector<float> want(n, 0.0f);
    for (int rank = 0; rank < size; ++rank) {
      auto part = testing::random_floats(n, call * 10 + rank);
      for (size_t i = 0; i < n; ++i)
        want[i] = rank == 0 ? part[i] : want[i] + part[i];
    }
    for (int rank = 0; rank < size; ++rank)
      REQUIRE(results[static_cast<size_t>(rank)][static_cast<size_t>(call)] == want);
  }
}

TEST_CASE("a rank that never joins or never reduces is reported as dead, not waited on") {
  // One of two ranks never joins: the other gives up at its deadline.
  CHECK_THROWS_WITH_AS(local_communicator(0, 2, "never-joins", 200ms),
                       doctest::Contains("did not arrive within 200 ms"), error);

  // Both join; one leaves: the other's next all-reduce fails (at once: see below).
  std::atomic<bool> failed{false};
  std::thread stays([&] {
    local_communicator comm{0, 2, "one-leaves", 300ms};
    std::vector<float> data(4, 1.0f);
    comm.all_reduce(data.data(), data.size());
    try {
      comm.all_reduce(data.data(), data.size());
    } catch (const error& e) {
      failed = e.code() == errc::worker_died;
    }
  });
  {
    local_communicator comm{1, 2, "one-leaves", 300ms};
    std::vector<float> data(4, 2.0f);
    comm.all_reduce(data.data(), data.size());
    CHECK(data == std::vector<float>(4, 3.0f));
  }
  stays.join();
  CHECK(failed);
}

TEST_CASE("a rank whose communicator goes (its worker died) fails the others' wait at once") {
  std::atomic<int> joined{0};
  std::string what;
  std::thread survivor([&] {
    local_communicator comm{0, 2, "leave-test", 60s};
    ++joined;
    std::vector<float> data(4, 1.0f);
    try {
      comm.all_reduce(data.data(), data.size()); // the other rank never comes: it leaves
    } catch (const error& e) {
      what = e.what();
    }
  });
  {
    local_communicator leaving{1, 2, "leave-test", 60s};
    while (joined == 0)
      std::this_thread::yield();
  }                // destroyed without reducing, as when its worker dies
  survivor.join(); // long before the 60 s timeout
  CHECK(what == "all-reduce: a rank of this process left the group (its worker died)");
}

TEST_CASE("abort ends a wait in the in-process group at once, naming why") {
  std::atomic<int> joined{0};
  std::string what;
  local_communicator* waiting = nullptr;
  std::thread survivor([&] {
    local_communicator comm{0, 2, "abort-test", 60s};
    waiting = &comm;
    ++joined;
    std::vector<float> data(4, 1.0f);
    try {
      comm.all_reduce(data.data(), data.size()); // rank 1 is alive but never reduces
    } catch (const error& e) {
      CHECK(e.code() == errc::worker_died);
      what = e.what();
    }
    ++joined;
  });
  local_communicator silent{1, 2, "abort-test", 60s};
  while (joined == 0)
    std::this_thread::yield();
  std::this_thread::sleep_for(100ms); // let rank 0 wait
  waiting->abort("rank 1 went down (test)");
  survivor.join(); // long before the 60 s timeout
  CHECK(what == "all-reduce: rank 1 went down (test)");
}

TEST_CASE("abort ends a Gloo reduction that waits for a silent peer, naming why") {
  gloo_communicator a{0, 2, "127.0.0.1", 60s}, b{1, 2, "127.0.0.1", 60s};
  std::vector<std::vector<std::string>> table{a.prepare(), b.prepare()};
  std::thread connecting([&] { b.connect(table); });
  a.connect(table);
  connecting.join();
  std::vector<float> x(8, 1.0f), y(8, 2.0f);
  std::thread reducing([&] { b.all_reduce(y.data(), y.size()); });
  a.all_reduce(x.data(), x.size());
  reducing.join();
  CHECK(x == std::vector<float>(8, 3.0f));
  CHECK(y == std::vector<float>(8, 3.0f));

  std::string what;
  std::atomic<bool> done{false};
  std::thread survivor([&] {
    try {
      a.all_reduce(x.data(), x.size()); // b never reduces again
    } catch (const error& e) {
      CHECK(e.code() == errc::worker_died);
      what = e.what();
    }
    done = true;
  });
  std::this_thread::sleep_for(200ms);
  CHECK_FALSE(done.load()); // waiting for b
  a.abort("rank 1 went down (test)");
  survivor.join(); // long before the 60 s timeout
  CHECK(what == "gloo all_reduce aborted: rank 1 went down (test)");
  // The group is done for every rank: b's next reduction fails too.
  CHECK_THROWS_AS(b.all_reduce(y.data(), y.size()), error);
  CHECK_THROWS_AS(a.all_reduce(x.data(), x.size()), error);
}

TEST_CASE("a weight-update group over Gloo gives every member the root's bytes") {
  const int32_t world = 3;
  const size_t sizes[] = {1, 4097, size_t{3} << 20};
  auto port = free_port();
  std::vector<std::vector<std::vector<uint8_t>>> got(world);
  std::vector<std::string> backends(world);
  std::vector<std::thread> members;
  for (int32_t r = 0; r < world; ++r)
    members.emplace_back([&, r] {
      weight_update_group group{"127.0.0.1", port, r, world, 30s};
      backends[static_cast<size_t>(r)] = group.backend();
      for (auto bytes : sizes) {
        std::vector<uint8_t> data(bytes, 0);
        if (r == 1) // the root need not be member 0
          for (size_t i = 0; i < bytes; ++i)
            data[i] = static_cast<uint8_t>(i * 7 + bytes);
        group.broadcast(data.data(), bytes, 1);
        got[static_cast<size_t>(r)].push_back(std::move(data));
      }
      uint8_t byte = 0;
      CHECK_THROWS_WITH_AS(group.broadcast_gpu(&byte, 1, 0),
                           "weight-update group: GPU memory is broadcast by the nccl backend; "
                           "this group's is gloo",
                           error);
    });
  for (auto& m : members)
    m.join();
  for (size_t r = 0; r < world; ++r) {
    CHECK(backends[r] == "gloo");
    REQUIRE(got[r].size() == std::size(sizes));
    for (size_t k = 0; k < std::size(sizes); ++k)
      CHECK(got[r][k] == got[1][k]);
  }
  CHECK(got[0][2][12345] == static_cast<uint8_t>(12345 * 7 + (size_t{3} << 20)));
}

TEST_CASE("a weight-update group refuses a backend it has not, a GPU that is not there, and "
          "a member of another backend, naming them") {
  CHECK_THROWS_WITH_AS(weight_update_group("127.0.0.1", free_port(), 0, 2, 5s, "mpi"),
                       doctest::Contains("backend 'mpi' (gloo or nccl)"), error);
  // NCCL on a GPU this machine lacks (or a build without CUDA): refused before the meeting,
  // which would otherwise wait for the others.
  auto start = std::chrono::steady_clock::now();
  try {
    weight_update_group("127.0.0.1", free_port(), 1, 2, 30s, "nccl", 4096);
    FAIL("joined NCCL on cuda:4096");
  } catch (const error& e) {
    MESSAGE(std::string{e.what()});
    bool named = e.code() == errc::unsupported ||
                 std::string{e.what()}.find("cuda:4096 does not exist") != std::string::npos;
    CHECK(named);
  }
  CHECK(std::chrono::steady_clock::now() - start < 10s);

  // A member that speaks NCCL comes to a Gloo group (its hello, as the meeting reads it).
  auto port = free_port();
  std::thread member([port] {
    int fd = -1;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int tries = 0; tries < 200; ++tries) {
      fd = ::socket(AF_INET, SOCK_STREAM, 0);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0)
        break;
      ::close(fd);
      fd = -1;
      std::this_thread::sleep_for(25ms);
    }
    REQUIRE(fd >= 0);
    std::string hello{"troupe-weights2", 16};
    for (uint32_t v : {1u, 2u, 2u, 0u}) { // rank 1 of 2, backend nccl, an empty entry
      auto n = htonl(v);
      hello.append(reinterpret_cast<const char*>(&n), 4);
    }
    CHECK(::send(fd, hello.data(), hello.size(), 0) == static_cast<ssize_t>(hello.size()));
    // Told why: the refusal mark, then the reason as an entry of one string.
    std::string answer(1024, '\0');
    size_t got = 0;
    for (;;) { // to the end: rank 0 closes after it
      auto n = ::recv(fd, answer.data() + got, answer.size() - got, 0);
      if (n <= 0)
        break;
      got += static_cast<size_t>(n);
    }
    REQUIRE(got > 12);
    CHECK(answer.substr(0, 8) == std::string("\xff\xff\xff\xff\0\0\0\1", 8));
    CHECK(answer.find("a member came with the nccl backend; this group's is gloo") == 12);
    ::close(fd);
  });
  CHECK_THROWS_WITH_AS(weight_update_group("127.0.0.1", port, 0, 2, 30s, "gloo"),
                       "weight-update group: a member came with the nccl backend; this "
                       "group's is gloo",
                       error);
  member.join();
}

TEST_CASE("a member hears why member 0 called the meeting off") {
  // Member 0 as the meeting speaks it: it reads the hello, then answers with the refusal.
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), len) == 0);
  REQUIRE(::listen(listener, 1) == 0);
  REQUIRE(::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  std::thread zero([listener] {
    int fd = ::accept(listener, nullptr, nullptr);
    auto take = [fd](size_t n) {
      std::string bytes(n, '\0');
      for (size_t got = 0; got < n;) {
        auto r = ::recv(fd, bytes.data() + got, n - got, 0);
        if (r <= 0)
          break;
        got += static_cast<size_t>(r);
      }
      return bytes;
    };
    auto u32 = [&] {
      uint32_t v = 0;
      std::memcpy(&v, take(4).data(), 4);
      return ntohl(v);
    };
    take(16 + 12); // magic, rank, world, backend
    for (auto count = u32(); count > 0; --count)
      take(u32());
    std::string off;
    for (uint32_t v : {0xffffffffu, 1u, 12u}) {
      auto n = htonl(v);
      off.append(reinterpret_cast<const char*>(&n), 4);
    }
    off += "test: no way";
    ::send(fd, off.data(), off.size(), MSG_NOSIGNAL);
    ::close(fd);
  });
  CHECK_THROWS_WITH_AS(weight_update_group("127.0.0.1", ntohs(a.sin_port), 1, 2, 30s),
                       "weight-update group: member 0 called the meeting off: test: no way", error);
  zero.join();
  ::close(listener);
}
