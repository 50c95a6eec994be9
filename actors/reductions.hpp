#pragma once

/// @file
/// How the supervisor makes one answer of the workers' replies to a collective call (one
/// reply per rank, in rank order). Each throws `troupe::error` to refuse the replies: a
/// reply of the wrong type (`bad_arguments`, naming the rank), workers that disagree
/// (`inconsistent_workers`), unhealthy ones (`worker_error`).

#include "messages/messages.hpp"

#include <caf/message.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace troupe {

/// determine_num_available_blocks: the least over the workers of both numbers.
cache_blocks least_blocks(const std::vector<caf::message>& replies);

/// add/remove/pin of an adapter: whether every worker said true.
bool all_true(const std::string& method, const std::vector<caf::message>& replies);

/// list_loras / list_prompt_adapters: the ids every worker holds, sorted; workers that
/// hold another set are named.
std::vector<int64_t> same_set(const std::string& method, const std::vector<caf::message>& replies);

/// prompt_adapter_virtual_tokens: the count every worker gives; workers that give another
/// are named.
int32_t same_count(const std::string& method, const std::vector<caf::message>& replies);

/// check_health: every report in rank order, with `restarts(rank)`; the unhealthy ranks
/// are named with their details.
std::vector<worker_health> all_healthy(const std::vector<caf::message>& replies,
                                       const std::function<int32_t(size_t)>& restarts);

} // namespace troupe
