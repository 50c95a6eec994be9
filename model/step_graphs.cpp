#include "model/step_graphs.hpp"

namespace troupe {

void step_graphs::clear() {
  recorded_.clear();
  seen_.clear();
  unrecordable_.clear();
}

void step_graphs::run(backend& be, const shape& s, const std::function<void()>& compute) {
  auto found = recorded_.find(s);
  if (found == recorded_.end() && seen_.count(s) > 0 && unrecordable_.count(s) == 0) {
    if (recorded_.size() >= max_recorded)
      clear();
    if (auto calls = be.capture(compute))
      found = recorded_.emplace(s, std::move(calls)).first;
    else
      unrecordable_.insert(s);
  }
  if (found != recorded_.end()) {
    found->second->replay();
    return;
  }
  if (seen_.size() >= max_remembered || unrecordable_.size() >= max_remembered)
    clear();
  seen_.insert(s);
  compute();
}

} // namespace troupe
