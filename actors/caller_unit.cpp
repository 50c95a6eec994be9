#include "actors/caller_unit.hpp"

#include <caf/all.hpp>

namespace troupe {

namespace {

/// The execution unit of a host thread that hands a message to the supervisor: the first
/// actor it is asked to schedule is the supervisor its own message woke, which it keeps to
/// run itself; any other (woken by what the supervisor sends meanwhile) goes to CAF's
/// scheduler.
class caller_unit : public caf::execution_unit {
public:
  explicit caller_unit(caf::actor_system& sys) : caf::execution_unit(&sys) {}

  void exec_later(caf::resumable* job) override {
    if (job_ == nullptr && !running_) {
      job_ = job;
      return;
    }
    system().scheduler().enqueue(job);
  }

  /// Runs the kept actor until its mailbox is empty or it handled `limit` messages; then
  /// the scheduler has it.
  void run(size_t limit) {
    if (job_ == nullptr)
      return;
    running_ = true;
    switch (job_->resume(this, limit)) {
    case caf::resumable::resume_later:
      system().scheduler().enqueue(job_); // keeps the reference the enqueue added
      break;
    case caf::resumable::done:
    case caf::resumable::awaiting_message:
    case caf::resumable::shutdown_execution_unit:
      intrusive_ptr_release(job_);
      break;
    }
    job_ = nullptr;
  }

private:
  caf::resumable* job_ = nullptr;
  bool running_ = false;
};

/// How many messages a caller handles for the supervisor before the scheduler takes over:
/// its call and what came in meanwhile, never a long backlog.
constexpr size_t caller_throughput = 16;

} // namespace

void hand_to_supervisor(caf::actor_system& sys, const supervisor_actor& supervisor,
                        async_call call) {
  caller_unit unit{sys};
  auto dest = caf::actor_cast<caf::strong_actor_ptr>(supervisor);
  dest->enqueue(caf::make_mailbox_element(nullptr, caf::make_message_id(), {}, std::move(call)),
                &unit);
  // An actor spawned while this thread runs the supervisor (a replacement worker) leaves a
  // reference to the system's logger in this thread, and ~actor_system waits for it.
  bool had_logger = caf::logger::current_logger() != nullptr;
  unit.run(caller_throughput);
  if (!had_logger)
    caf::logger::set_current_actor_system(nullptr);
}

} // namespace troupe
