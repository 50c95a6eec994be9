// The CPU device's tagged pool: sleep really returns pages to the OS, wake restores them at
// the same addresses.

#include "kernels/cpu/cpu_device.hpp"
#include "tests/rss.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

using namespace troupe;
using troupe::testing::rss_bytes;

namespace {

constexpr size_t mib = size_t{1} << 20;

void fill(void* p, size_t n, unsigned seed) {
  auto bytes = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < n; ++i)
    bytes[i] = static_cast<unsigned char>((i * 31 + seed) & 0xff);
}

bool same_as_fill(const void* p, size_t n, unsigned seed) {
  auto bytes = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i)
    if (bytes[i] != static_cast<unsigned char>((i * 31 + seed) & 0xff))
      return false;
  return true;
}

bool all_zero(const void* p, size_t n) {
  auto bytes = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i)
    if (bytes[i] != 0)
      return false;
  return true;
}

int64_t usage_of(const device& dev, memory_tag tag, int64_t memory_usage::*field) {
  for (auto& u : dev.usage())
    if (u.tag == tag)
      return u.*field;
  return -1;
}

/// A file of `n` bytes (`fill` with `seed`) that is gone when the object is.
struct temp_file {
  std::string path;
  int fd = -1;

  temp_file(size_t n, unsigned seed) {
    char name[] = "/tmp/troupe-device-XXXXXX";
    fd = mkstemp(name);
    REQUIRE(fd >= 0);
    path = name;
    std::vector<unsigned char> bytes(n);
    fill(bytes.data(), n, seed);
    REQUIRE(pwrite(fd, bytes.data(), n, 0) == static_cast<ssize_t>(n));
  }
  ~temp_file() {
    ::close(fd);
    std::remove(path.c_str());
  }

  bool holds_fill(size_t n, unsigned seed) const {
    std::vector<unsigned char> bytes(n);
    return pread(fd, bytes.data(), n, 0) == static_cast<ssize_t>(n) &&
           same_as_fill(bytes.data(), n, seed);
  }
};

} // namespace

TEST_CASE("allocations are zeroed and accounted per tag") {
  cpu_device dev{0};
  CHECK(dev.name() == "cpu:0");
  auto w = dev.allocate(1000, memory_tag::weights);
  auto kv = dev.allocate(3000, memory_tag::kv_cache);
  CHECK(all_zero(w, 1000));
  CHECK(usage_of(dev, memory_tag::weights, &memory_usage::allocated_bytes) == 1000);
  CHECK(usage_of(dev, memory_tag::kv_cache, &memory_usage::resident_bytes) == 3000);
  dev.deallocate(kv);
  CHECK(usage_of(dev, memory_tag::kv_cache, &memory_usage::allocated_bytes) == 0);
  dev.deallocate(w);
  dev.deallocate(nullptr);
  CHECK(dev.free_memory() > 0);
}

TEST_CASE("level-1 sleep releases the pages and wake restores weights bit for bit") {
  cpu_device dev{0};
  const size_t n = 64 * mib;
  auto w = dev.allocate(n, memory_tag::weights);
  auto kv = dev.allocate(n, memory_tag::kv_cache);
  fill(w, n, 7);
  std::memset(kv, 0xab, n);
  auto before = rss_bytes();
  dev.sleep(sleep_level::offload_weights);
  auto asleep = rss_bytes();
  CHECK(dev.sleeping_tags().size() == 2);
  CHECK(usage_of(dev, memory_tag::weights, &memory_usage::resident_bytes) == 0);
  CHECK(testing::resident_bytes(w, n) == 0); // the kernel agrees
  CHECK(testing::resident_bytes(kv, n) == 0);
  auto backup = usage_of(dev, memory_tag::weights, &memory_usage::backup_bytes);
  CHECK(backup == static_cast<int64_t>(n));
  // Device pages of both tags are gone; the weights now live once, in the backup.
  auto released = static_cast<int64_t>(2 * n);
  MESSAGE("RSS " << before / mib << " MiB awake, " << asleep / mib << " MiB asleep");
  CHECK(before - asleep >= static_cast<int64_t>(0.9 * static_cast<double>(released - backup)));
  dev.wake_up({});
  CHECK(dev.sleeping_tags().empty());
  CHECK(same_as_fill(w, n, 7));
  CHECK(all_zero(kv, n));
  // The backup's pages are returned once restored: awake, the weights are held once.
  auto awake = rss_bytes();
  CHECK(awake - before < static_cast<int64_t>(n / 10));
  CHECK(usage_of(dev, memory_tag::weights, &memory_usage::backup_bytes) == 0);
  // A second cycle gives the same bytes.
  dev.sleep(sleep_level::offload_weights);
  dev.wake_up({});
  CHECK(same_as_fill(w, n, 7));
}

TEST_CASE("level-2 sleep releases everything with no backup and weights come back zeroed") {
  cpu_device dev{0};
  const size_t n = 64 * mib;
  auto w = dev.allocate(n, memory_tag::weights);
  auto kv = dev.allocate(n, memory_tag::kv_cache);
  fill(w, n, 3);
  std::memset(kv, 0x11, n);
  auto before = rss_bytes();
  dev.sleep(sleep_level::discard);
  auto asleep = rss_bytes();
  MESSAGE("RSS " << before / mib << " MiB awake, " << asleep / mib << " MiB asleep");
  CHECK(testing::resident_bytes(w, n) == 0);
  CHECK(testing::resident_bytes(kv, n) == 0);
  CHECK(before - asleep >= static_cast<int64_t>(0.9 * static_cast<double>(2 * n)));
  CHECK(usage_of(dev, memory_tag::weights, &memory_usage::backup_bytes) == 0);
  dev.wake_up({memory_tag::weights});
  CHECK(dev.sleeping_tags() == std::vector<memory_tag>{memory_tag::kv_cache});
  CHECK(all_zero(w, n));
  dev.wake_up({memory_tag::kv_cache});
  CHECK(all_zero(kv, n));
}

TEST_CASE("a file mapped copy-on-write reads as the file, never writes it, sleeps and wakes "
          "as any allocation") {
  cpu_device dev{0};
  const size_t n = 32 * mib;
  temp_file file{n, 5};
  auto before = rss_bytes();
  auto w = dev.map_file(file.fd, 0, n, memory_tag::weights, false);
  REQUIRE(w != nullptr);
  // Mapped whole at once, from the page cache.
  CHECK(rss_bytes() - before >= static_cast<int64_t>(0.9 * static_cast<double>(n)));
  CHECK(same_as_fill(w, n, 5));
  CHECK(usage_of(dev, memory_tag::weights, &memory_usage::allocated_bytes) ==
        static_cast<int64_t>(n));
  static_cast<unsigned char*>(w)[1000] ^= 0xff; // this process's copy only
  CHECK(file.holds_fill(n, 5));
  // Level 1: the contents come back as they were, the write included.
  dev.sleep(sleep_level::offload_weights);
  CHECK(usage_of(dev, memory_tag::weights, &memory_usage::backup_bytes) == static_cast<int64_t>(n));
  dev.wake_up({});
  static_cast<unsigned char*>(w)[1000] ^= 0xff;
  CHECK(same_as_fill(w, n, 5));
  // Level 2: the pages leave the process, and zeros wake in their place, not the file.
  auto awake = rss_bytes();
  dev.sleep(sleep_level::discard);
  CHECK(awake - rss_bytes() >= static_cast<int64_t>(0.9 * static_cast<double>(n)));
  dev.wake_up({});
  CHECK(all_zero(w, n));
  fill(w, n, 9); // anonymous memory now
  CHECK(file.holds_fill(n, 5));
  dev.deallocate(w);
}

TEST_CASE("a file mapped shared is written through, from an offset") {
  cpu_device dev{0};
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t n = 4 * mib;
  temp_file file{n + page, 1};
  auto w = dev.map_file(file.fd, page, n, memory_tag::weights, true);
  REQUIRE(w != nullptr);
  fill(w, n, 8);
  dev.deallocate(w);
  std::vector<unsigned char> back(n);
  REQUIRE(pread(file.fd, back.data(), n, static_cast<off_t>(page)) == static_cast<ssize_t>(n));
  CHECK(same_as_fill(back.data(), n, 8));
}

TEST_CASE("the pool refuses what it cannot do with the reason") {
  cpu_device dev{1};
  auto w = dev.allocate(4096, memory_tag::weights);
  CHECK_THROWS_WITH_AS(to_sleep_level(3), doctest::Contains("sleep level must be 1 or 2"), error);
  dev.sleep(sleep_level::offload_weights);
  try {
    dev.allocate(10, memory_tag::kv_cache);
    FAIL("allocating under a sleeping tag must fail");
  } catch (const error& e) {
    CHECK(e.code() == errc::sleeping);
  }
  // Sleeping again leaves the sleeping tags as they are; waking an awake tag does nothing.
  dev.sleep(sleep_level::discard);
  dev.wake_up({memory_tag::weights});
  dev.wake_up({memory_tag::weights});
  CHECK(dev.sleeping_tags() == std::vector<memory_tag>{memory_tag::kv_cache});
  dev.wake_up({});
  dev.deallocate(w);
}

TEST_CASE("make_device knows the cpu and names what it does not know") {
  CHECK(make_device(device_kind::cpu, 2)->name() == "cpu:2");
  CHECK(make_device(parse_device_kind("cpu"), 0)->name() == "cpu:0");
  CHECK_THROWS_WITH_AS(parse_device_kind("tpu"), doctest::Contains("'tpu'"), error);
}
