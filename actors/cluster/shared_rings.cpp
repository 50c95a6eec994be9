#include "actors/cluster/shared_rings.hpp"

#include "troupe/errors.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace troupe {

/// One ring's positions, each on its own cache line: the writer publishes `head`, the
/// reader `tail`; `reader_sleeps` is the reader's flag for the writer's doorbell.
struct shared_rings::control {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) std::atomic<uint32_t> reader_sleeps;
};

namespace {

static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                std::atomic<uint32_t>::is_always_lock_free,
              "positions shared between processes need lock-free atomics");

/// The first page holds both rings' control blocks; the rings follow it.
constexpr size_t control_page = 4096;
constexpr size_t second_control = 2048;
constexpr uint64_t min_capacity = 4096;
constexpr uint64_t max_capacity = uint64_t{64} << 20;

bool valid_capacity(uint64_t capacity) {
  return capacity >= min_capacity && capacity <= max_capacity && (capacity & (capacity - 1)) == 0;
}

size_t mapped_size(uint64_t capacity) {
  return control_page + 2 * static_cast<size_t>(capacity);
}

std::string system_error(const char* what) {
  return std::string{what} + ": " + std::strerror(errno);
}

} // namespace

shared_rings::shared_rings(int fd, uint64_t capacity, void* base, bool creator)
  : fd_(fd), capacity_(capacity), base_(base), mapped_(mapped_size(capacity)) {
  auto* page = static_cast<char*>(base);
  auto* first = reinterpret_cast<control*>(page);
  auto* second = reinterpret_cast<control*>(page + second_control);
  auto* first_data = page + control_page;
  auto* second_data = first_data + capacity;
  if (creator) {
    new (first) control{};
    new (second) control{};
  }
  // The creator writes the first ring and reads the second; the peer the other way.
  out_ = creator ? first : second;
  in_ = creator ? second : first;
  out_data_ = creator ? first_data : second_data;
  in_data_ = creator ? second_data : first_data;
}

shared_rings::~shared_rings() {
  if (base_)
    munmap(base_, mapped_);
  if (fd_ >= 0)
    ::close(fd_);
}

std::unique_ptr<shared_rings> shared_rings::create(uint64_t capacity) {
  if (!valid_capacity(capacity))
    throw error{errc::invalid_argument, "a shared ring of " + std::to_string(capacity) +
                                          " bytes: not a power of two from 4 KiB to 64 MiB"};
  int fd = memfd_create("troupe-link", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    throw error{errc::worker_error, system_error("memfd_create")};
  auto fail = [fd](const char* what) {
    auto why = system_error(what);
    ::close(fd);
    throw error{errc::worker_error, why};
  };
  auto size = mapped_size(capacity);
  // Sealed before the peer sees it: it cannot shrink the file under this process's mapping
  // (which would fault here) nor lift the seals.
  if (ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    fail("sizing and sealing the shared rings");
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED)
    fail("mapping the shared rings");
  return std::unique_ptr<shared_rings>{new shared_rings{fd, capacity, base, true}};
}

std::unique_ptr<shared_rings> shared_rings::adopt(int fd, uint64_t capacity) {
  auto refuse = [fd](const std::string& why) -> std::unique_ptr<shared_rings> {
    ::close(fd);
    throw error{errc::invalid_argument, "the node's shared rings: " + why};
  };
  if (!valid_capacity(capacity))
    return refuse("a capacity of " + std::to_string(capacity) + " bytes");
  struct stat st {};
  if (fstat(fd, &st) != 0)
    return refuse(system_error("fstat"));
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) != mapped_size(capacity))
    return refuse("a file of " + std::to_string(st.st_size) + " bytes where " +
                  std::to_string(mapped_size(capacity)) + " belong");
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0)
    return refuse("a file that can shrink (not sealed)");
  void* base = mmap(nullptr, mapped_size(capacity), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED)
    return refuse(system_error("mmap"));
  ::close(fd);
  return std::unique_ptr<shared_rings>{new shared_rings{-1, capacity, base, false}};
}

void shared_rings::passed() {
  if (fd_ >= 0)
    ::close(fd_);
  fd_ = -1;
}

size_t shared_rings::push(const char* data, size_t size) {
  auto tail = out_->tail.load(std::memory_order_acquire);
  auto used = written_ - tail;
  if (used > capacity_) {
    broken_.store(true, std::memory_order_release);
    return 0;
  }
  auto n = std::min<uint64_t>(size, capacity_ - used);
  auto at = written_ & (capacity_ - 1);
  auto first = std::min<uint64_t>(n, capacity_ - at);
  std::memcpy(out_data_ + at, data, first);
  std::memcpy(out_data_, data + first, n - first);
  written_ += n;
  out_->head.store(written_, std::memory_order_release);
  return n;
}

bool shared_rings::fresh_head(uint64_t& head) const {
  head = in_->head.load(std::memory_order_acquire);
  auto seen = seen_head_.load(std::memory_order_relaxed);
  while (head > seen && !seen_head_.compare_exchange_weak(seen, head, std::memory_order_relaxed)) {
  }
  return head >= seen;
}

size_t shared_rings::pull(char* data, size_t size) {
  uint64_t head;
  bool fresh = fresh_head(head);
  auto read = read_.load(std::memory_order_relaxed);
  auto have = head - read;
  if (!fresh || have > capacity_) {
    broken_.store(true, std::memory_order_release);
    return 0;
  }
  auto n = std::min<uint64_t>(size, have);
  if (n == 0)
    return 0; // no store: a reader that polls leaves the writer's cache lines alone
  auto at = read & (capacity_ - 1);
  auto first = std::min<uint64_t>(n, capacity_ - at);
  std::memcpy(data, in_data_ + at, first);
  std::memcpy(data + first, in_data_, n - first);
  read_.store(read + n, std::memory_order_release);
  in_->tail.store(read + n, std::memory_order_release);
  return n;
}

size_t shared_rings::incoming() const {
  uint64_t head;
  bool fresh = fresh_head(head);
  auto have = head - read_.load(std::memory_order_acquire);
  return !fresh || have > capacity_ ? 1 : have;
}

void shared_rings::sleeping(bool on) {
  in_->reader_sleeps.store(on ? 1 : 0, std::memory_order_relaxed);
  // Pairs with the fence in `peer_needs_doorbell`: either this reader sees the bytes
  // published before it, or the writer sees this reader asleep.
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

bool shared_rings::peer_needs_doorbell() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return out_->reader_sleeps.load(std::memory_order_relaxed) != 0 &&
         out_->reader_sleeps.exchange(0, std::memory_order_relaxed) != 0;
}

} // namespace troupe
