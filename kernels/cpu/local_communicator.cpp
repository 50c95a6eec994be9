#include "kernels/cpu/local_communicator.hpp"

#include "kernels/cpu/spin_wait.hpp"
#include "troupe/errors.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <vector>

#include <unistd.h>

namespace troupe {

namespace {

using clock_type = std::chrono::steady_clock;

/// How long a rank spins at a barrier before it sleeps: the other ranks of a step arrive
/// within microseconds when they have cores of their own.
constexpr auto spin_for = std::chrono::microseconds(100);

} // namespace

const std::string& process_token() {
  static const std::string token = [] {
    std::random_device rd;
    return std::to_string(getpid()) + "-" + std::to_string(rd()) + std::to_string(rd());
  }();
  return token;
}

struct local_communicator::group {
  explicit group(int n) : size(n), slots(static_cast<size_t>(n)) {}

  const int size;
  /// Each rank's copy of its input; a rank writes only its own, reads all after a barrier.
  std::vector<std::vector<float>> slots;

  std::atomic<int> arrived{0};
  std::atomic<uint64_t> generation{0};
  std::mutex mtx;
  std::condition_variable wake;
  int sleeping = 0;
  /// A rank's communicator was destroyed (its worker died or re-formed its group): the
  /// others stop waiting for it.
  std::atomic<bool> abandoned{false};
  /// Why, under `mtx`: the first reason given.
  std::string why;

  void abandon(const std::string& reason) {
    std::lock_guard<std::mutex> lk{mtx};
    if (!abandoned.exchange(true, std::memory_order_acq_rel))
      why = reason;
    wake.notify_all();
  }

  std::string abandoned_why() {
    std::lock_guard<std::mutex> lk{mtx};
    return why;
  }

  /// Waits until every rank has arrived; throws `worker_died` when a rank left the group
  /// or `timeout` passed first.
  void barrier(std::chrono::milliseconds timeout, const char* what) {
    if (!arrive(timeout))
      throw error{errc::worker_died, std::string{what} + ": " +
                                       (abandoned.load(std::memory_order_acquire)
                                          ? abandoned_why()
                                          : "a rank of this process did not arrive within " +
                                              std::to_string(timeout.count()) + " ms")};
  }

  bool arrive(std::chrono::milliseconds timeout) {
    if (abandoned.load(std::memory_order_acquire))
      return false;
    auto seen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == size) {
      arrived.store(0, std::memory_order_relaxed);
      generation.fetch_add(1, std::memory_order_acq_rel);
      std::lock_guard<std::mutex> lk{mtx};
      if (sleeping > 0)
        wake.notify_all();
      return true;
    }
    auto passed = [&] { return generation.load(std::memory_order_acquire) != seen; };
    auto left = [&] { return abandoned.load(std::memory_order_acquire); };
    cpu::spin_then_wait([&] { return passed() || left(); }, spin_for, mtx, wake, sleeping,
                        clock_type::now() + timeout);
    return passed();
  }
};

namespace {

std::mutex registry_mtx;
/// Groups being formed or in use, by key.
std::map<std::string, std::weak_ptr<local_communicator::group>> registry;

} // namespace

local_communicator::local_communicator(int rank, int size, const std::string& key,
                                       std::chrono::milliseconds timeout)
  : rank_(rank), timeout_(timeout) {
  {
    std::lock_guard<std::mutex> lk{registry_mtx};
    auto& entry = registry[key];
    group_ = entry.lock();
    if (!group_) {
      group_ = std::make_shared<group>(size);
      entry = group_;
    }
    if (group_->size != size)
      throw error{errc::invalid_argument, "local collective '" + key +
                                            "': ranks disagree on "
                                            "the group size"};
  }
  // Every rank must be there before the first reduction (a missing one is a dead worker).
  group_->barrier(timeout_, "local collective: joining");
  std::lock_guard<std::mutex> lk{registry_mtx};
  auto i = registry.find(key);
  if (i != registry.end() && i->second.lock() == group_)
    registry.erase(i); // complete: a later group may reuse the key
}

local_communicator::~local_communicator() {
  group_->abandon("a rank of this process left the group (its worker died)");
}

void local_communicator::abort(const std::string& why) noexcept {
  try {
    group_->abandon(why);
  } catch (...) {
    // Only the reason's copy can throw; the flag is what wakes the ranks.
    group_->abandoned.store(true, std::memory_order_release);
  }
}

void local_communicator::all_reduce(float* data, size_t count) {
  auto& g = *group_;
  auto& mine = g.slots[static_cast<size_t>(rank_)];
  mine.assign(data, data + count);
  g.barrier(timeout_, "all-reduce");
  // Every rank adds the same slots in the same order: identical results on every rank.
  std::copy(g.slots[0].begin(), g.slots[0].end(), data);
  for (size_t j = 1; j < g.slots.size(); ++j) {
    const float* slot = g.slots[j].data();
    for (size_t i = 0; i < count; ++i)
      data[i] += slot[i];
  }
  // No rank may overwrite its slot for the next call while another still reads it.
  g.barrier(timeout_, "all-reduce");
}

} // namespace troupe
