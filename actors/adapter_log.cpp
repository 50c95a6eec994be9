#include "actors/adapter_log.hpp"

#include <algorithm>
#include <set>

namespace troupe {

adapter_log::adapter_log(gather_table& gathers, std::vector<int32_t> ranks, timeout_type timeout,
                         std::shared_ptr<spdlog::logger> log)
  : gathers_(gathers), ranks_(std::move(ranks)), timeout_(timeout), log_(std::move(log)) {}

void adapter_log::note(const adapter_request& call) {
  keep(method_name(call), typed_call(call), call.kind, call.id);
}

void adapter_log::note(const adapter_change& call) {
  if (call.action == adapter_action::remove)
    return forget(call.kind, call.id);
  keep(method_name(call), typed_call(call), call.kind, call.id);
}

void adapter_log::keep(std::string method, ask_fn ask, adapter_kind kind, int64_t id) {
  // Adding or pinning again what the log already holds changes nothing.
  for (auto& e : entries_)
    if (e.method == method && e.id == id) {
      e.ask = std::move(ask);
      return;
    }
  entries_.push_back({std::move(method), std::move(ask), kind, id});
}

void adapter_log::forget(adapter_kind kind, int64_t id) {
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [&](const entry& e) { return e.kind == kind && e.id == id; }),
                 entries_.end());
}

void adapter_log::catch_up(int32_t rank, std::vector<step_fn>& steps) {
  for (auto& e : entries_)
    steps.push_back(gather_step(gathers_, e.method, {rank}, e.ask, timeout_));
  for (auto kind : {adapter_kind::lora, adapter_kind::prompt_adapter})
    steps.push_back([this, kind](std::function<void(caf::error)> next) { reconcile(kind, next); });
}

void adapter_log::reconcile(adapter_kind kind, std::function<void(caf::error)> next) {
  auto list = method_name(adapter_list{kind});
  gathers_.start(
    "replacement: " + list, ranks_, typed_call(adapter_list{kind}), timeout_, 0,
    [this, kind, list, next](gather_result res) {
      if (!res)
        return next(res.error());
      std::vector<std::set<int64_t>> held;
      try {
        for (size_t rank = 0; rank < res->size(); ++rank) {
          auto ids = result_as<std::vector<int64_t>>((*res)[rank], rank, list);
          held.emplace_back(ids.begin(), ids.end());
        }
      } catch (const error& e) {
        return next(caf::make_error(e.code(), std::string{e.what()}));
      }
      auto common = held[0];
      for (auto& ids : held)
        for (auto i = common.begin(); i != common.end();)
          i = ids.count(*i) > 0 ? std::next(i) : common.erase(i);
      auto remove = method_name(adapter_change{kind, adapter_action::remove});
      auto steps = std::make_shared<std::vector<step_fn>>();
      std::set<int64_t> partial;
      for (size_t rank = 0; rank < held.size(); ++rank)
        for (auto id : held[rank])
          if (common.count(id) == 0) {
            partial.insert(id);
            steps->push_back(
              gather_step(gathers_, remove, {static_cast<int32_t>(rank)},
                          typed_call(adapter_change{kind, adapter_action::remove, id}), timeout_));
          }
      for (auto id : partial) {
        forget(kind, id);
        log_->warn("{} {} was held by some ranks only after the replacement (a call was in "
                   "flight); removed from all",
                   to_string(kind), id);
      }
      run_steps(steps, next);
    });
}

} // namespace troupe
