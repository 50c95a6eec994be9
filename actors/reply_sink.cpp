#include "actors/reply_sink.hpp"

#include "actors/companion.hpp"
#include "messages/messages.hpp"

#include <caf/all.hpp>

namespace troupe {

direct_reply::direct_reply(uint64_t gather_id, size_t ranks,
                           std::function<void(gather_result)> done)
  : gather_id(gather_id), done(std::move(done)), results_(ranks),
    answered_(new std::atomic<bool>[ranks]), remaining_(ranks) {
  for (size_t i = 0; i < ranks; ++i)
    answered_[i].store(false, std::memory_order_relaxed);
}

reply_sink::reply_sink(caf::actor_system& sys, const caf::actor& supervisor)
  : supervisor_(supervisor.address()),
    self_(spawn_companion(sys, [this](caf::mailbox_element_ptr reply) { receive(*reply); })) {}

reply_sink::~reply_sink() {
  // Replies that arrive from now on are dropped, not handed to a sink that is gone.
  end_companion(self_);
}

void reply_sink::ask(const std::shared_ptr<direct_reply>& call, size_t index,
                     const caf::actor& worker, caf::message request, caf::execution_unit* host) {
  uint64_t key = 0;
  {
    std::lock_guard<std::mutex> lk{mtx_};
    key = next_key_++;
    expected_.emplace(key, expected_reply{call, index});
    call->keys_.push_back(key);
  }
  caf::actor_cast<caf::abstract_actor*>(worker)->enqueue(
    caf::make_mailbox_element(self_, keyed_request_id(key), {}, std::move(request)), host);
}

void reply_sink::forget(direct_reply& call) {
  std::lock_guard<std::mutex> lk{mtx_};
  for (auto key : call.keys_)
    expected_.erase(key);
  call.keys_.clear();
}

void reply_sink::receive(caf::mailbox_element& reply) {
  expected_reply from;
  {
    std::lock_guard<std::mutex> lk{mtx_};
    auto i = expected_.find(reply.mid.request_id().integer_value());
    if (i == expected_.end())
      return; // the call is finished: a late reply
    from = std::move(i->second);
    expected_.erase(i);
  }
  auto& call = *from.call;
  auto msg = reply.move_content_to_message();
  if (msg.match_elements<caf::ok_atom, caf::message>()) {
    call.results_[from.index] = std::move(msg.get_mutable_as<caf::message>(1));
    call.answered_[from.index].store(true, std::memory_order_release);
    // Each reply dropped its own key above: the last leaves none to forget.
    if (call.remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1 && call.take())
      call.done(std::move(call.results_));
    return;
  }
  auto err = msg.match_elements<caf::error>() ? msg.get_as<caf::error>(0)
                                              : caf::make_error(caf::sec::unexpected_response, msg);
  if (auto supervisor = caf::actor_cast<caf::actor>(supervisor_))
    caf::anon_send(supervisor, reply_error_atom::value, call.gather_id,
                   static_cast<uint64_t>(from.index), std::move(err));
}

} // namespace troupe
