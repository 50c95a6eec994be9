#pragma once

// Replies that go straight to the caller: the gather of a call whose workers answer to a
// sink, which runs on each replying worker's thread, instead of to the supervisor, which
// would first have to be woken to gather them.

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <caf/expected.hpp>
#include <caf/message.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace troupe {

using gather_result = caf::expected<std::vector<caf::message>>;

/// What the sink and the supervisor share of one call: the replies so far, and who
/// finished it. Exactly one of them calls `done`: the sink with every reply, from the
/// thread of the worker that replied last, or the supervisor with an error.
struct direct_reply {
  direct_reply(uint64_t gather_id, size_t ranks, std::function<void(gather_result)> done);

  /// Claims the call; true only for the first caller.
  bool take() {
    return !taken_.exchange(true, std::memory_order_acq_rel);
  }

  bool taken() const {
    return taken_.load(std::memory_order_acquire);
  }

  bool answered(size_t index) const {
    return answered_[index].load(std::memory_order_acquire);
  }

  /// The gather in the supervisor's table.
  const uint64_t gather_id;
  std::function<void(gather_result)> done;

private:
  friend class reply_sink;
  std::vector<caf::message> results_;
  std::unique_ptr<std::atomic<bool>[]> answered_;
  std::atomic<size_t> remaining_;
  std::atomic<bool> taken_{false};
  /// The request ids that the sink expects for this call (see `reply_sink::forget`).
  std::vector<uint64_t> keys_;
};

/// The sender of a direct call's requests: an actor whose mailbox is a function run by
/// whoever replies. A success is stored; the last one finishes the call. An error (or a
/// request bounced by a dead worker) goes on to the supervisor as
/// `(reply_error_atom, gather id, index, error)`, whose gather logic reports it.
class reply_sink {
public:
  /// `supervisor` is held weakly: the supervisor owns the sink.
  reply_sink(caf::actor_system& sys, const caf::actor& supervisor);
  ~reply_sink();

  reply_sink(const reply_sink&) = delete;
  reply_sink& operator=(const reply_sink&) = delete;

  /// Sends `request` to `worker` for rank index `index` of `call`, as a request whose
  /// reply comes here. `host` is the sender's execution unit.
  void ask(const std::shared_ptr<direct_reply>& call, size_t index, const caf::actor& worker,
           caf::message request, caf::execution_unit* host);

  /// Drops what `call` still expects: it is finished, and late replies are ignored.
  void forget(direct_reply& call);

private:
  void receive(caf::mailbox_element& reply);

  struct expected_reply {
    std::shared_ptr<direct_reply> call;
    size_t index = 0;
  };

  caf::actor_addr supervisor_;
  caf::strong_actor_ptr self_;
  std::mutex mtx_;
  uint64_t next_key_ = 1;
  std::unordered_map<uint64_t, expected_reply> expected_;
};

} // namespace troupe
