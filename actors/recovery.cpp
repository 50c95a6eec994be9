#include "actors/recovery.hpp"

#include "troupe/errors.hpp"

#include <caf/all.hpp>

#include <fmt/format.h>

#include <algorithm>

namespace troupe {

namespace {

void run_from(std::shared_ptr<std::vector<step_fn>> steps, size_t i,
              std::function<void(caf::error)> done) {
  if (i == steps->size()) {
    done(caf::none);
    return;
  }
  (*steps)[i]([steps, i, done](caf::error err) {
    if (err)
      done(std::move(err));
    else
      run_from(steps, i + 1, done);
  });
}

} // namespace

void run_steps(std::shared_ptr<std::vector<step_fn>> steps, std::function<void(caf::error)> done) {
  run_from(std::move(steps), 0, std::move(done));
}

std::function<void()> after_calls(size_t n, std::function<void()> then) {
  auto left = std::make_shared<size_t>(n);
  return [left, then] {
    if (--*left == 0)
      then();
  };
}

step_fn gather_step(gather_table& gathers, std::string label, std::vector<int32_t> ranks,
                    ask_fn ask, timeout_type timeout) {
  return [&gathers, label, ranks, ask, timeout](std::function<void(caf::error)> next) {
    gathers.start("replacement: " + label, ranks, ask, timeout, 0,
                  [next](gather_result res) { next(res ? caf::none : res.error()); });
  };
}

caf::error recovery::lost_work() const {
  return caf::make_error(errc::worker_replaced,
                         cause_ + "; the call's work is lost, a replacement is starting");
}

std::string recovery::status() const {
  if (!under_way_)
    return {};
  std::chrono::duration<double> took = clock_type::now() - began_;
  return fmt::format("recovering rank {} for {:.1f} s ({})", rank_, took.count(), cause_);
}

std::string recovery::refusal() {
  if (under_way_)
    return "it died while another worker was being replaced";
  auto now = clock_type::now();
  while (!recent_.empty() && now - recent_.front() >= policy_.window)
    recent_.pop_front();
  if (static_cast<int32_t>(recent_.size()) >= policy_.max_restarts)
    return std::to_string(recent_.size()) + " replacement(s) within the last " +
           ms_text(policy_.window) + " already (max_restarts " +
           std::to_string(policy_.max_restarts) + ")";
  return {};
}

void recovery::begin(int32_t rank, std::string cause) {
  under_way_ = true;
  rank_ = rank;
  dead_in_place_ = true;
  cause_ = std::move(cause);
  began_ = clock_type::now();
  recent_.push_back(began_);
  log_->warn("{}; replacing it", cause_);
  host_.lose_work(rank, lost_work());
  host_.start_later(rank);
}

void recovery::start(int32_t rank) {
  if (!under_way_)
    return;
  host_.make_worker(
    rank, [this, rank](worker_actor fresh) { bring_up(rank, std::move(fresh)); },
    [this, rank](caf::error err) { end(rank, std::move(err)); });
}

void recovery::bring_up(int32_t rank, worker_actor fresh) {
  host_.install(rank, std::move(fresh));
  dead_in_place_ = false;
  auto steps = std::make_shared<std::vector<step_fn>>(host_.catch_up(rank));
  run_steps(steps, [this, rank](caf::error err) { end(rank, std::move(err)); });
}

void recovery::end(int32_t rank, caf::error err) {
  under_way_ = false;
  dead_in_place_ = false;
  caf::error failed;
  if (err) {
    failed = host_.fail(
      caf::make_error(errc::worker_died, cause_ + "; its replacement failed: " + render(err)));
    log_->error("{}", render(failed));
  } else {
    auto& count = rank_restarts_[static_cast<size_t>(rank)];
    ++count;
    auto ms = std::chrono::duration<double, std::milli>(clock_type::now() - began_).count();
    log_->warn("rank {} replaced in {:.1f} ms, {} (replacement {} of this rank) after: {}", rank,
               ms, host_.whereabouts(rank), count, cause_);
  }
  run_hooks(failed);
  auto calls = std::move(waiting_);
  waiting_.clear();
  for (auto& w : calls)
    host_.resume(std::move(w.call), w.until);
}

bool recovery::defer(async_call& call, std::optional<clock_type::time_point> until) {
  if (!under_way_ || call.admitted)
    return false;
  auto at = until.value_or(clock_type::time_point::max());
  if (!until && call.timeout != wait_forever) {
    at = clock_type::now() + call.timeout;
    gathers_.arm_deadline(at);
  }
  waiting_.push_back({std::move(call), at});
  return true;
}

void recovery::expire_waiting(clock_type::time_point now) {
  auto late = std::stable_partition(waiting_.begin(), waiting_.end(),
                                    [&](const waiting_call& w) { return w.until > now; });
  std::vector<waiting_call> gone(std::make_move_iterator(late),
                                 std::make_move_iterator(waiting_.end()));
  waiting_.erase(late, waiting_.end());
  for (auto& w : gone)
    w.call.fail(caf::make_error(
      errc::timeout, "waited " + ms_text(w.call.timeout) + " for the replacement of rank " +
                       std::to_string(rank_) + ", which is still in progress"));
  for (auto& w : waiting_)
    if (w.until != clock_type::time_point::max())
      gathers_.arm_deadline(w.until);
}

void recovery::run_hooks(const caf::error& failed) {
  auto hooks = std::move(hooks_);
  hooks_.clear();
  for (auto& hook : hooks)
    hook(failed);
}

void recovery::make_leftover_calls(int32_t rank, std::function<void()> then) {
  auto found = leftovers_.find(rank);
  if (found == leftovers_.end())
    return then();
  auto calls = std::move(found->second);
  leftovers_.erase(found);
  auto one_done = after_calls(calls.size(), std::move(then));
  auto log = log_;
  for (auto& call : calls)
    gathers_.start("replacement: " + call.label, {rank}, call.ask, step_timeout_, 0,
                   [log, rank, label = call.label, one_done](gather_result res) {
                     if (!res)
                       log->warn("rank {}: the {} its predecessor left failed: {}", rank, label,
                                 render(res.error()));
                     one_done();
                   });
}

} // namespace troupe
