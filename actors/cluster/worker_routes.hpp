#pragma once

/// @file
/// Where each rank's messages go: to its worker, or, when its node gave a call link, to
/// the link's stub, whose reader hands the replies on (messages that carry actor handles
/// still go over BASP, which alone resolves them). A linked worker's death waits until the
/// link has handed on what the worker wrote before it.

#include "actors/worker_actor.hpp"

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <caf/system_messages.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

namespace troupe {

class link_client;
class link_set;

class worker_routes {
public:
  /// How long a death waits for its worker's call link at most (see `hold_death`): a node
  /// that is stopped or hung never answers the ping.
  static constexpr auto link_flush_time = std::chrono::milliseconds(100);

  /// Routes for `ranks` ranks; the links' readers are those of `links`.
  worker_routes(caf::actor_system& sys, std::shared_ptr<link_set> links, size_t ranks);

  /// Ends the stubs; the links stay open (their owner closes them).
  ~worker_routes();

  worker_routes(const worker_routes&) = delete;
  worker_routes& operator=(const worker_routes&) = delete;

  /// Routes `rank` to `worker`, over `link` when it is not null (its reader starts once).
  void route(size_t rank, const worker_actor& worker, std::shared_ptr<link_client> link);

  /// Where `rank`'s messages go: the stub of its call link, if it has one, else the worker.
  worker_actor target(size_t rank) const;

  /// Whether the death in `msg`, of `rank`'s worker (-1: of none), waits for its call link
  /// first. A
  /// worker that replied and then died wrote its reply to the link before BASP carried
  /// its death: `me` gets `msg` again once the link has handed on what came before it (a
  /// ping answered, or the link closed), or after `link_flush_time` at the latest; of the
  /// two, the first is to be handled and the second is dropped (true again).
  bool hold_death(const caf::down_msg& msg, int32_t rank, const caf::actor& me);

  /// `rank`'s worker is dead: what it still owes over its link fails.
  void forget(size_t rank, const caf::actor_addr& worker);

private:
  struct route_entry {
    worker_actor worker;
    std::shared_ptr<link_client> link;
    caf::strong_actor_ptr stub;
  };

  caf::actor_system& sys_;
  std::shared_ptr<link_set> links_;
  std::vector<route_entry> routes_;
  /// Deaths held for their call link: true once handled.
  std::map<caf::actor_addr, bool> held_;
};

} // namespace troupe
