#pragma once

/// @file
/// The supervisor's calls that are one gather to every worker, answered with one
/// reduction of the replies: collective_rpc, determine_num_available_blocks,
/// initialize_cache, the adapter calls and check_health.

#include "actors/gather_table.hpp"
#include "actors/supervisor.hpp"
#include "messages/protocols.hpp"
#include "troupe/config.hpp"

#include <caf/typed_response_promise.hpp>

#include <spdlog/logger.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace troupe {

class adapter_log;
class recovery;

/// The deadline of a call in microseconds (`wait_forever.count()`: none); the facade has
/// already refused zero and negative ones.
timeout_type from_us(int64_t us);

class collective_calls {
public:
  template <class T>
  using promise = caf::typed_response_promise<T>;

  /// `in_process(rank)`: whether the worker of `rank` lives in this process (a callable
  /// runs only there).
  collective_calls(supervisor_actor::pointer self, gather_table& gathers,
                   std::vector<int32_t> ranks, const executor_config& cfg, adapter_log& adapters,
                   const recovery& recov, std::function<bool(size_t)> in_process,
                   std::shared_ptr<spdlog::logger> log);

  /// collective_rpc of a named method, answered through `reply`: a direct gather, unless
  /// `opts` limits the workers asked at once.
  void named(const std::string& method, caf::message args, caf::settings kwargs,
             const rpc_options& opts, timeout_type timeout,
             reply_to<std::vector<caf::message>> reply);

  /// collective_rpc with a callable: refused when any worker lives in another process.
  promise<std::vector<caf::message>> callable(local_call call, const rpc_options& opts);

  /// determine_num_available_blocks: the least over the workers of both numbers.
  promise<cache_blocks> available_blocks();

  /// initialize_cache on every worker; the blocks are kept for a replacement.
  promise<caf::ok_atom> initialize_cache(cache_blocks blocks);

  /// The blocks of the last initialize_cache, if any.
  const std::optional<cache_blocks>& cache() const {
    return cache_;
  }

  /// add, remove or pin of an adapter: true when every worker said true (then noted for a
  /// replacement). The id is checked first (vLLM asserts it; here it is an error).
  promise<bool> all_true(adapter_request call);
  promise<bool> all_true(adapter_change call);

  /// list_loras / list_prompt_adapters: every worker must hold the same set.
  promise<std::vector<int64_t>> same_set(adapter_list call);

  /// prompt_adapter_virtual_tokens: every worker must say the same.
  promise<int32_t> virtual_tokens(adapter_tokens call);

  /// check_health: every report in rank order, or an error naming the unhealthy ranks.
  promise<std::vector<worker_health>> check_health();

private:
  /// Makes `call` on every worker with the default deadline; `reduce` turns the replies
  /// into the answer (throwing `troupe::error` to refuse them).
  template <class T, class Call>
  promise<T> call_all(const Call& call, std::function<T(std::vector<caf::message>&)> reduce);

  template <class Call>
  promise<bool> adapter_call(Call call);

  /// The current request, answered at once with `err`.
  template <class T>
  promise<T> refuse(caf::error err);

  supervisor_actor::pointer self_;
  gather_table& gathers_;
  std::vector<int32_t> ranks_;
  const executor_config& cfg_;
  adapter_log& adapters_;
  const recovery& recov_;
  std::function<bool(size_t)> in_process_;
  std::shared_ptr<spdlog::logger> log_;
  std::optional<cache_blocks> cache_;
};

} // namespace troupe
