#include "actors/adapter_log.hpp"

#include <algorithm>
#include <set>

namespace troupe {

adapter_kind adapter_kind_of(const std::string& method) {
  return method.find("prompt_adapter") != std::string::npos ? adapter_kind::prompt_adapter
                                                            : adapter_kind::lora;
}

adapter_log::adapter_log(gather_table& gathers, std::vector<int32_t> ranks, timeout_type timeout,
                         std::shared_ptr<spdlog::logger> log)
  : gathers_(gathers), ranks_(std::move(ranks)), timeout_(timeout), log_(std::move(log)) {}

void adapter_log::note(const std::string& method, const caf::message& args, int64_t id) {
  auto kind = adapter_kind_of(method);
  if (method.rfind("remove_", 0) == 0)
    return forget(kind, id);
  // Adding or pinning again what the log already holds changes nothing.
  for (auto& e : entries_)
    if (e.method == method && e.id == id) {
      e.args = args;
      return;
    }
  entries_.push_back({method, args, kind, id});
}

void adapter_log::forget(adapter_kind kind, int64_t id) {
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [&](const entry& e) { return e.kind == kind && e.id == id; }),
                 entries_.end());
}

void adapter_log::catch_up(int32_t rank, std::vector<step_fn>& steps) {
  for (auto& e : entries_)
    steps.push_back(gather_step(gathers_, e.method, {rank}, calling(e.method, e.args), timeout_));
  for (auto kind : {adapter_kind::lora, adapter_kind::prompt_adapter})
    steps.push_back([this, kind](std::function<void(caf::error)> next) { reconcile(kind, next); });
}

void adapter_log::reconcile(adapter_kind kind, std::function<void(caf::error)> next) {
  auto list = std::string{"list_"} + to_string(kind) + "s";
  gathers_.start(
    "replacement: " + list, ranks_, calling(list), timeout_, 0,
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
      auto remove = std::string{"remove_"} + to_string(kind);
      auto steps = std::make_shared<std::vector<step_fn>>();
      std::set<int64_t> partial;
      for (size_t rank = 0; rank < held.size(); ++rank)
        for (auto id : held[rank])
          if (common.count(id) == 0) {
            partial.insert(id);
            steps->push_back(gather_step(gathers_, remove, {static_cast<int32_t>(rank)},
                                         calling(remove, caf::make_message(id)), timeout_));
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
