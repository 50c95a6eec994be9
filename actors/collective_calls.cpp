#include "actors/collective_calls.hpp"

#include "actors/adapter_log.hpp"
#include "actors/recovery.hpp"
#include "actors/reductions.hpp"
#include "troupe/errors.hpp"

#include <caf/all.hpp>

#include <algorithm>

namespace troupe {

timeout_type from_us(int64_t us) {
  return us == wait_forever.count() ? wait_forever : timeout_type{std::max<int64_t>(us, 1)};
}

collective_calls::collective_calls(supervisor_actor::pointer self, gather_table& gathers,
                                   std::vector<int32_t> ranks, const executor_config& cfg,
                                   adapter_log& adapters, const recovery& recov,
                                   std::function<bool(size_t)> in_process,
                                   std::shared_ptr<spdlog::logger> log)
  : self_(self), gathers_(gathers), ranks_(std::move(ranks)), cfg_(cfg), adapters_(adapters),
    recov_(recov), in_process_(std::move(in_process)), log_(std::move(log)) {}

template <class T>
collective_calls::promise<T> collective_calls::refuse(caf::error err) {
  auto rp = self_->make_response_promise<T>();
  rp.deliver(std::move(err));
  return rp;
}

template <class T, class Call>
collective_calls::promise<T>
collective_calls::call_all(const Call& call, std::function<T(std::vector<caf::message>&)> reduce) {
  auto rp = self_->make_response_promise<T>();
  gathers_.start(method_name(call), ranks_, typed_call(call), cfg_.rpc_timeout, 0,
                 [=](gather_result res) mutable {
                   if (!res) {
                     rp.deliver(res.error());
                     return;
                   }
                   try {
                     rp.deliver(reduce(*res));
                   } catch (const error& e) {
                     rp.deliver(caf::make_error(e.code(), std::string{e.what()}));
                   }
                 });
  return rp;
}

void collective_calls::named(const std::string& method, caf::message args, caf::settings kwargs,
                             const rpc_options& opts, timeout_type timeout,
                             reply_to<std::vector<caf::message>> reply) {
  auto label = "collective_rpc '" + method + "'";
  if (opts.max_concurrent_workers > 0)
    gathers_.start(std::move(label), ranks_, calling(method, args, kwargs), timeout,
                   static_cast<size_t>(opts.max_concurrent_workers), std::move(reply));
  else
    gathers_.start_direct(
      std::move(label), ranks_,
      worker_request(call_atom::value, method, std::move(args), std::move(kwargs)), timeout,
      std::move(reply));
}

collective_calls::promise<std::vector<caf::message>>
collective_calls::callable(local_call call, const rpc_options& opts) {
  std::string remote;
  for (auto rank : ranks_)
    if (!in_process_(static_cast<size_t>(rank)))
      remote += (remote.empty() ? "" : ", ") + std::to_string(rank);
  if (!remote.empty())
    return refuse<std::vector<caf::message>>(caf::make_error(
      errc::remote_callable, "callable '" + call.label + "' cannot run on rank(s) " + remote +
                               ": they live in another process and callables are never "
                               "serialised; register a named method instead"));
  auto rp = self_->make_response_promise<std::vector<caf::message>>();
  // Named before `call` moves into the request (the arguments' order is unspecified).
  auto label = "collective_rpc callable '" + call.label + "'";
  gathers_.start(
    std::move(label), ranks_, asking(call_atom::value, std::move(call)), from_us(opts.timeout_us),
    static_cast<size_t>(std::max(opts.max_concurrent_workers, 0)), [=](gather_result res) mutable {
      if (res)
        rp.deliver(std::move(*res));
      else
        rp.deliver(res.error());
    });
  return rp;
}

collective_calls::promise<cache_blocks> collective_calls::available_blocks() {
  return call_all<cache_blocks>(blocks_query{}, least_blocks);
}

collective_calls::promise<caf::ok_atom> collective_calls::initialize_cache(cache_blocks blocks) {
  if (blocks.num_device_blocks <= 0 || blocks.num_swap_blocks < 0)
    return refuse<caf::ok_atom>(caf::make_error(
      errc::invalid_argument,
      "initialize_cache needs num_device_blocks > 0 and num_swap_blocks >= 0, got " +
        std::to_string(blocks.num_device_blocks) + " and " +
        std::to_string(blocks.num_swap_blocks)));
  log_->info("# device blocks: {}, # CPU blocks: {}", blocks.num_device_blocks,
             blocks.num_swap_blocks);
  auto concurrency =
    static_cast<double>(blocks.num_device_blocks) * cfg_.block_size / cfg_.max_model_len;
  log_->info("Maximum concurrency for {} tokens per request: {:.2f}x", cfg_.max_model_len,
             concurrency);
  cache_ = blocks;
  return call_all<caf::ok_atom>(cache_init{blocks},
                                [](std::vector<caf::message>&) { return caf::ok_atom::value; });
}

template <class Call>
collective_calls::promise<bool> collective_calls::adapter_call(Call call) {
  if (call.id <= 0)
    return refuse<bool>(caf::make_error(
      errc::invalid_argument,
      std::string{call.kind == adapter_kind::prompt_adapter ? "prompt_adapter_id" : "lora_id"} +
        " must be greater than 0, got " + std::to_string(call.id)));
  auto* log = &adapters_;
  return call_all<bool>(call, [log, call](std::vector<caf::message>& replies) {
    bool all = troupe::all_true(method_name(call), replies);
    if (all)
      log->note(call);
    return all;
  });
}

collective_calls::promise<bool> collective_calls::all_true(adapter_request call) {
  return adapter_call(std::move(call));
}

collective_calls::promise<bool> collective_calls::all_true(adapter_change call) {
  return adapter_call(call);
}

collective_calls::promise<std::vector<int64_t>> collective_calls::same_set(adapter_list call) {
  return call_all<std::vector<int64_t>>(call, [call](std::vector<caf::message>& replies) {
    return troupe::same_set(method_name(call), replies);
  });
}

collective_calls::promise<int32_t> collective_calls::virtual_tokens(adapter_tokens call) {
  return call_all<int32_t>(call, [call](std::vector<caf::message>& replies) {
    return same_count(method_name(call), replies);
  });
}

collective_calls::promise<std::vector<worker_health>> collective_calls::check_health() {
  auto* recov = &recov_;
  return call_all<std::vector<worker_health>>(
    health_query{}, [recov](std::vector<caf::message>& replies) {
      return all_healthy(replies, [recov](size_t rank) { return recov->restarts(rank); });
    });
}

} // namespace troupe
