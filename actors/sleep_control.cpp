#include "actors/sleep_control.hpp"

#include "troupe/errors.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

namespace troupe {

sleep_control::sleep_control(gather_table& gathers, std::vector<int32_t> ranks,
                             timeout_type timeout, std::shared_ptr<spdlog::logger> log)
  : gathers_(gathers), ranks_(std::move(ranks)), timeout_(timeout), log_(std::move(log)) {}

void sleep_control::sleep(sleep_request asked, caf::typed_response_promise<caf::ok_atom> rp) {
  auto level = asked.level;
  change(
    "sleep", state_.check_sleep(), typed_call(asked),
    [this, level](const caf::error& err) {
      // Even when some rank failed, others may be asleep: only wake_up may lead back to
      // awake (waking an awake worker does nothing). A worker that died during the sleep
      // is replaced asleep, as the others are.
      state_.commit_sleep(level);
      if (err)
        log_->error("sleep failed; call wake_up before the next step: {}", render(err));
    },
    [](double took) { return fmt::format("It took {:.6f} seconds to fall asleep.", took); },
    std::move(rp));
}

void sleep_control::wake_up(const std::vector<std::string>& tags,
                            caf::typed_response_promise<caf::ok_atom> rp) {
  auto verdict = state_.check_wake(tags);
  auto woken = verdict.tags;
  change(
    "wake_up", verdict, typed_call(wake_request{woken}),
    [this, woken](const caf::error& err) {
      // After a failure the tags still count as asleep; waking them again is harmless. A
      // worker that died during the wake-up is replaced awake, and the others finish
      // theirs: all are awake.
      if (!err || to_errc(err) == errc::worker_replaced)
        state_.commit_wake(woken);
    },
    [woken](double took) {
      return fmt::format("It took {:.6f} seconds to wake up tags {}.", took, describe(woken));
    },
    std::move(rp));
}

void sleep_control::change(const std::string& method, sleep_state::decision verdict, ask_fn ask,
                           std::function<void(const caf::error&)> commit,
                           std::function<std::string(double)> done,
                           caf::typed_response_promise<caf::ok_atom> rp) {
  if (transition_) {
    rp.deliver(caf::make_error(errc::invalid_argument,
                               std::string{"another sleep or wake_up is in progress"}));
    return;
  }
  if (!verdict.proceed) {
    log_->warn("{}", verdict.warning);
    rp.deliver(caf::ok_atom::value);
    return;
  }
  transition_ = true;
  auto start = std::chrono::steady_clock::now();
  gathers_.start(method, ranks_, std::move(ask), timeout_, 0, [=](gather_result res) mutable {
    transition_ = false;
    auto err = res ? caf::error{} : res.error();
    commit(err);
    if (err) {
      rp.deliver(err);
      return;
    }
    std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
    log_->info("{}", done(seconds.count()));
    rp.deliver(caf::ok_atom::value);
  });
}

caf::error sleep_control::step_refusal() const {
  if (transition_)
    return caf::make_error(errc::sleeping,
                           std::string{"execute_model while a sleep or wake_up is in progress"});
  if (state_.is_sleeping())
    return caf::make_error(errc::sleeping, "execute_model while tags " +
                                             describe(state_.sleeping_tags()) +
                                             " sleep; call wake_up first");
  return {};
}

std::vector<std::string> sleep_control::sleeping_tag_names() const {
  std::vector<std::string> names;
  for (auto tag : state_.sleeping_tags())
    names.emplace_back(to_string(tag));
  return names;
}

std::vector<std::pair<std::string, ask_fn>> sleep_control::catch_up() const {
  std::vector<std::pair<std::string, ask_fn>> calls;
  if (!state_.is_sleeping())
    return calls;
  calls.emplace_back("sleep", typed_call(sleep_request{to_sleep_level(state_.level())}));
  auto sleeping = state_.sleeping_tags();
  wake_request woken;
  for (auto tag : all_memory_tags)
    if (std::find(sleeping.begin(), sleeping.end(), tag) == sleeping.end())
      woken.tags.push_back(tag);
  if (!woken.tags.empty())
    calls.emplace_back("wake_up", typed_call(woken));
  return calls;
}

} // namespace troupe
