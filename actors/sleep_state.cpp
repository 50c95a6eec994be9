#include "actors/sleep_state.hpp"

#include <algorithm>

namespace troupe {

namespace {

template <class... Fs>
struct overload : Fs... {
  using Fs::operator()...;
};
template <class... Fs>
overload(Fs...) -> overload<Fs...>;

} // namespace

std::string describe(const std::vector<memory_tag>& tags) {
  std::string result = "{";
  for (size_t i = 0; i < tags.size(); ++i) {
    if (i > 0)
      result += ", ";
    result += to_string(tags[i]);
  }
  return result + "}";
}

sleep_state::decision sleep_state::check_sleep() const {
  decision d;
  if (is_sleeping()) {
    d.warning =
      "Executor is already sleeping (tags " + describe(sleeping_tags()) + "); sleep ignored.";
    return d;
  }
  d.proceed = true;
  d.tags.assign(std::begin(all_memory_tags), std::end(all_memory_tags));
  return d;
}

void sleep_state::commit_sleep(sleep_level level) {
  state_ = asleep{level};
}

sleep_state::decision sleep_state::check_wake(const std::vector<std::string>& tag_names) const {
  decision d;
  if (!is_sleeping()) {
    d.warning = "Executor is not sleeping; wake_up ignored.";
    return d;
  }
  auto sleeping = sleeping_tags();
  if (tag_names.empty()) {
    d.proceed = true;
    d.tags = sleeping;
    return d;
  }
  std::vector<memory_tag> tags;
  for (auto& name : tag_names) {
    auto tag = parse_memory_tag(name);
    if (!tag) {
      d.warning = "Tag " + name +
                  " is not a memory tag (known: weights, kv_cache); "
                  "wake_up ignored.";
      return d;
    }
    if (std::find(sleeping.begin(), sleeping.end(), *tag) == sleeping.end()) {
      d.warning =
        "Tag " + name + " is not in sleeping tags " + describe(sleeping) + "; wake_up ignored.";
      return d;
    }
    if (std::find(tags.begin(), tags.end(), *tag) == tags.end())
      tags.push_back(*tag);
  }
  d.proceed = true;
  d.tags = tags;
  return d;
}

void sleep_state::commit_wake(const std::vector<memory_tag>& tags) {
  auto remaining = sleeping_tags();
  std::set<memory_tag> left(remaining.begin(), remaining.end());
  for (auto tag : tags)
    left.erase(tag);
  if (left.empty())
    state_ = awake{};
  else
    state_ = partly_awake{static_cast<sleep_level>(level()), left};
}

bool sleep_state::is_sleeping() const {
  return !std::holds_alternative<awake>(state_);
}

std::vector<memory_tag> sleep_state::sleeping_tags() const {
  return std::visit(overload{
                      [](const awake&) { return std::vector<memory_tag>{}; },
                      [](const asleep&) {
                        return std::vector<memory_tag>(std::begin(all_memory_tags),
                                                       std::end(all_memory_tags));
                      },
                      [](const partly_awake& s) {
                        return std::vector<memory_tag>(s.sleeping.begin(), s.sleeping.end());
                      },
                    },
                    state_);
}

int32_t sleep_state::level() const {
  return std::visit(overload{
                      [](const awake&) { return int32_t{0}; },
                      [](const asleep& s) { return static_cast<int32_t>(s.level); },
                      [](const partly_awake& s) { return static_cast<int32_t>(s.level); },
                    },
                    state_);
}

} // namespace troupe
