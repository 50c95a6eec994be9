#pragma once

// Actors whose mailbox is a function: the reply sink, the stubs of linked workers and a
// node's link replies (`actors/reply_sink`, `actors/cluster/link_*`).

#include <caf/actor_companion.hpp>
#include <caf/actor_system.hpp>
#include <caf/mailbox_element.hpp>
#include <caf/message_id.hpp>
#include <caf/scoped_execution_unit.hpp>

#include <cstdint>
#include <functional>

namespace troupe {

/// A hidden actor that runs `receive` on the sender's thread for each message sent to it.
inline caf::strong_actor_ptr
spawn_companion(caf::actor_system& sys, std::function<void(caf::mailbox_element_ptr)> receive) {
  auto ptr = caf::actor_cast<caf::strong_actor_ptr>(sys.spawn<caf::actor_companion, caf::hidden>());
  static_cast<caf::actor_companion*>(caf::actor_cast<caf::abstract_actor*>(ptr))
    ->on_enqueue(std::move(receive));
  return ptr;
}

/// Stops a companion: messages from now on are dropped (it waits for a `receive` under
/// way). Terminated here, while its system lives: a companion that a remote peer saw stays
/// in the system's registry, and one destroyed with the registry crashes.
inline void end_companion(const caf::strong_actor_ptr& ptr) {
  auto* c = static_cast<caf::actor_companion*>(caf::actor_cast<caf::abstract_actor*>(ptr));
  c->on_enqueue(nullptr);
  caf::scoped_execution_unit host{&c->home_system()};
  c->cleanup(caf::exit_reason::user_shutdown, &host);
}

/// The id of a request that carries `key` (a counter below 2^48), so that its response
/// names the key: `response.mid.request_id().integer_value()`.
inline caf::message_id keyed_request_id(uint64_t key) {
  return caf::message_id{caf::make_message_id(caf::message_priority::normal).integer_value() | key};
}

} // namespace troupe
