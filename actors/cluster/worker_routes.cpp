#include "actors/cluster/worker_routes.hpp"

#include "actors/cluster/link_client.hpp"
#include "actors/companion.hpp"
#include "messages/messages.hpp"

#include <caf/all.hpp>

namespace troupe {

namespace {

/// Messages that go to a node's worker over BASP even when it has a call link: those that
/// carry actor handles, which only BASP resolves. They start workers, peers and groups,
/// when no call is in flight (calls wait for a replacement).
bool carries_handles(const caf::message& msg) {
  return msg.match_element<init_atom>(0) || msg.match_element<peers_atom>(0) ||
         msg.match_element<group_atom>(0);
}

} // namespace

worker_routes::worker_routes(caf::actor_system& sys, std::shared_ptr<link_set> links, size_t ranks)
  : sys_(sys), links_(std::move(links)), routes_(ranks) {}

worker_routes::~worker_routes() {
  for (auto& r : routes_)
    if (r.stub)
      end_companion(r.stub);
}

void worker_routes::route(size_t rank, const worker_actor& worker,
                          std::shared_ptr<link_client> link) {
  auto& r = routes_[rank];
  if (r.stub)
    end_companion(r.stub);
  r = {worker, std::move(link), nullptr};
  if (!r.link)
    return;
  links_->add(r.link, sys_);
  r.stub = make_link_stub(sys_, r.link, caf::actor_cast<caf::actor>(worker), carries_handles);
}

worker_actor worker_routes::target(size_t rank) const {
  auto& r = routes_[rank];
  return r.stub ? caf::actor_cast<worker_actor>(r.stub) : r.worker;
}

bool worker_routes::hold_death(const caf::down_msg& msg, int32_t rank, const caf::actor& me) {
  auto seen = held_.find(msg.source);
  if (seen != held_.end()) {
    if (seen->second) {
      held_.erase(seen);
      return true;
    }
    seen->second = true;
    return false;
  }
  if (rank < 0)
    return false;
  auto& link = routes_[static_cast<size_t>(rank)].link;
  if (!link || !link->owes(msg.source.id()))
    return false;
  held_.emplace(msg.source, false);
  link->flush([me, msg] { caf::anon_send(me, msg); });
  caf::delayed_anon_send(me, link_flush_time, msg);
  return true;
}

void worker_routes::forget(size_t rank, const caf::actor_addr& worker) {
  if (auto& link = routes_[rank].link)
    link->forget(worker.id());
}

} // namespace troupe
