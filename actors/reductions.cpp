#include "actors/reductions.hpp"

#include "actors/gather_table.hpp"
#include "troupe/errors.hpp"

#include <algorithm>

namespace troupe {

cache_blocks least_blocks(const std::vector<caf::message>& replies) {
  const std::string method = "determine_num_available_blocks";
  cache_blocks least;
  for (size_t rank = 0; rank < replies.size(); ++rank) {
    auto& b = result_as<cache_blocks>(replies[rank], rank, method);
    if (rank == 0 || b.num_device_blocks < least.num_device_blocks)
      least.num_device_blocks = b.num_device_blocks;
    if (rank == 0 || b.num_swap_blocks < least.num_swap_blocks)
      least.num_swap_blocks = b.num_swap_blocks;
  }
  return least;
}

bool all_true(const std::string& method, const std::vector<caf::message>& replies) {
  bool all = true;
  for (size_t rank = 0; rank < replies.size(); ++rank)
    all = result_as<bool>(replies[rank], rank, method) && all;
  return all;
}

namespace {

/// The reply every worker gave (each made `normal` first); the ranks that differ from
/// rank 0 are named.
template <class T, class Normal>
T agreed(const std::string& method, const std::vector<caf::message>& replies, Normal normal,
         const char* should) {
  auto reply = [&](size_t rank) { return normal(result_as<T>(replies[rank], rank, method)); };
  auto first = reply(0);
  std::string differing;
  for (size_t rank = 1; rank < replies.size(); ++rank)
    if (reply(rank) != first)
      differing += (differing.empty() ? "" : ", ") + std::to_string(rank);
  if (!differing.empty())
    throw error{errc::inconsistent_workers,
                method + ": rank(s) " + differing + " disagree with rank 0 (" +
                  to_string(caf::make_message(first)) + "); all workers should " + should};
  return first;
}

} // namespace

std::vector<int64_t> same_set(const std::string& method, const std::vector<caf::message>& replies) {
  auto sorted = [](std::vector<int64_t> set) {
    std::sort(set.begin(), set.end());
    return set;
  };
  return agreed<std::vector<int64_t>>(method, replies, sorted, "hold the same set");
}

int32_t same_count(const std::string& method, const std::vector<caf::message>& replies) {
  return agreed<int32_t>(
    method, replies, [](int32_t n) { return n; }, "say the same");
}

std::vector<worker_health> all_healthy(const std::vector<caf::message>& replies,
                                       const std::function<int32_t(size_t)>& restarts) {
  std::vector<worker_health> reports;
  std::string unhealthy;
  for (size_t rank = 0; rank < replies.size(); ++rank) {
    reports.push_back(result_as<worker_health>(replies[rank], rank, "check_health"));
    reports.back().restarts = restarts(rank);
    if (!reports.back().healthy)
      unhealthy += (unhealthy.empty() ? "rank " : "; rank ") + std::to_string(rank) + ": " +
                   reports.back().detail;
  }
  if (!unhealthy.empty())
    throw error{errc::worker_error, "unhealthy workers: " + unhealthy};
  return reports;
}

} // namespace troupe
