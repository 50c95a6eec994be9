#pragma once

/// @file
/// Sleep and wake-up on every worker: the state machine (`sleep_state`) decides, this
/// object carries a transition out as one gather and commits its outcome, one transition
/// at a time. Steps are refused while a transition runs or a tag sleeps; a replacement is
/// brought to the same sleep as the others.

#include "actors/gather_table.hpp"
#include "actors/sleep_state.hpp"
#include "messages/messages.hpp"

#include <caf/typed_response_promise.hpp>
#include <spdlog/logger.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace troupe {

class sleep_control {
public:
  /// Transitions are gathers of `gathers` on `ranks`, each bounded by `timeout`.
  sleep_control(gather_table& gathers, std::vector<int32_t> ranks, timeout_type timeout,
                std::shared_ptr<spdlog::logger> log);

  /// vLLM's `sleep(level)`: `rp` is answered once every rank slept (at once, with a
  /// warning logged, when a tag already sleeps).
  void sleep(sleep_request asked, caf::typed_response_promise<caf::ok_atom> rp);

  /// vLLM's `wake_up(tags)` (every sleeping tag when empty).
  void wake_up(const std::vector<std::string>& tags, caf::typed_response_promise<caf::ok_atom> rp);

  /// Why a step may not run now (a transition in progress, or tags asleep); none when it
  /// may.
  caf::error step_refusal() const;

  /// The sleeping tags by name; empty when awake (vLLM's is_sleeping is "any tag sleeps").
  std::vector<std::string> sleeping_tag_names() const;

  /// The calls (method, request) that bring a fresh worker to the others' sleep: asleep
  /// at their level, with the tags they woke awake. None while awake.
  std::vector<std::pair<std::string, ask_fn>> catch_up() const;

private:
  /// The one transition routine: refused while another runs; `verdict` is the state
  /// machine's (a refusal is a warning, and success); `commit` records the outcome;
  /// `done` words the log line from the seconds it took.
  void change(const std::string& method, sleep_state::decision verdict, ask_fn ask,
              std::function<void(const caf::error&)> commit,
              std::function<std::string(double)> done,
              caf::typed_response_promise<caf::ok_atom> rp);

  gather_table& gathers_;
  std::vector<int32_t> ranks_;
  timeout_type timeout_;
  std::shared_ptr<spdlog::logger> log_;
  sleep_state state_;
  /// A sleep or wake_up is being carried out on the workers.
  bool transition_ = false;
};

} // namespace troupe
