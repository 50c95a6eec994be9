#include "actors/execution_loop.hpp"

#include <utility>

namespace troupe {

execution_loop::execution_loop(gather_table& gathers, std::vector<int32_t> peers,
                               timeout_type timeout, leave_fn leave)
  : gathers_(gathers), peers_(std::move(peers)), timeout_(timeout), leave_(std::move(leave)) {}

int64_t execution_loop::start() {
  if (tasks_ || peers_.empty())
    return id_;
  auto id = ++id_;
  // The tasks end only when the loop is stopped; a dead worker still fails them at once.
  auto g = gathers_.start("execution loop", peers_, asking(loop_atom::value, id), wait_forever, 0,
                          [this, id](gather_result res) { ended(id, std::move(res)); });
  if (!g->finished)
    tasks_ = g;
  return id;
}

caf::error execution_loop::take_error() {
  return std::exchange(error_, caf::error{});
}

void execution_loop::stop(caf::typed_response_promise<caf::ok_atom> rp) {
  if (!tasks_) {
    auto err = take_error();
    if (err)
      rp.deliver(err);
    else
      rp.deliver(caf::ok_atom::value);
    return;
  }
  stop_waiters_.push_back(rp);
  auto tasks = tasks_;
  gathers_.start("stop_remote_worker_execution_loop", {0},
                 asking(execute_atom::value, stop_loop_atom::value, id_), timeout_, 0,
                 [this, tasks](gather_result res) {
                   // The driver could not pass the stop on: end the loop's tasks here,
                   // which also tells the peers to leave the loop.
                   if (!res)
                     gathers_.finish(tasks, res.error());
                 });
}

void execution_loop::abandon(int64_t id) {
  if (error_ && error_id_ == id)
    error_ = caf::error{};
  if (!tasks_ || id_ != id)
    return;
  tasks_.reset();
  leave(id);
  wake_stop_waiters(caf::error{});
}

void execution_loop::lost(const caf::error& why) {
  if (tasks_)
    leave(id_);
  tasks_.reset();
  error_ = caf::error{};
  wake_stop_waiters(why);
}

void execution_loop::ended(int64_t id, gather_result res) {
  if (!tasks_ || id_ != id)
    return; // news of an older loop
  tasks_.reset();
  caf::error err = res ? caf::error{} : res.error();
  if (err) {
    leave(id);
    if (stop_waiters_.empty()) {
      error_ = err;
      error_id_ = id;
    }
  }
  wake_stop_waiters(err);
}

void execution_loop::leave(int64_t id) {
  for (auto rank : peers_)
    leave_(rank, id);
}

void execution_loop::wake_stop_waiters(const caf::error& err) {
  for (auto& rp : stop_waiters_) {
    if (err)
      rp.deliver(err);
    else
      rp.deliver(caf::ok_atom::value);
  }
  stop_waiters_.clear();
}

} // namespace troupe
