#pragma once

/// @file
/// The executor's half of a lease (the node's half is the gate in `actors/cluster/node.cpp`).

#include "messages/protocols.hpp"
#include "troupe/config.hpp"

#include <caf/actor.hpp>
#include <caf/blocking_actor.hpp>
#include <caf/spawn_options.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace troupe {

class link_client;

/// What a node gave: the workers, and the call link to them (none with `node_links` off,
/// or when the node refused it; calls then go over BASP).
struct node_grant {
  std::vector<worker_actor> workers;
  std::shared_ptr<link_client> link;
};

/// Connects to node `n` (the secret proved before any BASP byte, or TLS), proves the
/// secret to its gate and leases `count` workers of `cfg.cluster.node_worker_kind` for `holder`
/// (the actor whose end releases them), then opens the call link to them (proving the
/// secret or, under TLS, the executor's certificate), all before
/// `deadline`. `self` makes the requests and blocks for the replies: the facade's scoped
/// actor, or a helper of the supervisor. Throws `troupe::error`: `worker_died` when the
/// node cannot be reached, does not answer in time or publishes a gate of another
/// interface (another version of troupe), `invalid_argument` when it refuses.
node_grant lease_workers(caf::blocking_actor* self, const executor_config& cfg,
                         const node_address& n, int32_t count, const caf::actor& holder,
                         std::chrono::steady_clock::time_point deadline);

/// "node HOST:PORT", as errors and logs name a node.
std::string node_name(const node_address& n);

/// A helper actor's body: answers one `lease_atom` with a worker leased from the first of
/// `candidates` that gives one, and its index, or an error naming what each said. Each is
/// asked for at most `cfg.cluster.node_timeout` (a lease only spawns an actor: a node that is up
/// answers at once, a stopped one never); everything ends by `deadline`, and no candidate
/// is asked once `cancelled` is set. The call link to the worker leased, if any, is left
/// in `link` before the reply.
void lease_one(caf::blocking_actor* self, executor_config cfg, std::vector<node_address> candidates,
               caf::actor holder, std::chrono::steady_clock::time_point deadline,
               std::shared_ptr<std::atomic<bool>> cancelled,
               std::shared_ptr<std::shared_ptr<link_client>> link);

/// The replacements of workers that nodes gave, leased one at a time: from the dead
/// worker's node if it is back (a worker may die while its node lives), else from the
/// first spare node that gives one, else from another of the executor's nodes with a free
/// device; nodes on which a worker died are tried last, as a node that is gone or stopped
/// costs a timeout each try.
class replacement_leases {
public:
  /// Workers leased for `holder` (whose end releases them), under `cfg`'s nodes, secret or
  /// TLS, and deadlines.
  replacement_leases(executor_config cfg, caf::actor holder)
    : cfg_(std::move(cfg)), holder_(std::move(holder)) {}

  /// No helper asks a further node.
  ~replacement_leases() {
    *cancelled_ = true;
  }

  replacement_leases(const replacement_leases&) = delete;
  replacement_leases& operator=(const replacement_leases&) = delete;

  /// Leases the replacement of a worker that died on node `dead`. A helper does it on a
  /// thread of its own, as connecting blocks; `self` goes on meanwhile and gets the worker,
  /// its node and its call link (`made`), or why none came (`failed`).
  template <class Self, class Made, class Failed>
  void lease(Self* self, const node_address& dead, Made made, Failed failed) {
    auto candidates = order(dead);
    auto link = std::make_shared<std::shared_ptr<link_client>>();
    auto helper = self->template spawn<caf::detached>(
      lease_one, cfg_, candidates, holder_, std::chrono::steady_clock::now() + cfg_.startup_timeout,
      cancelled_, link);
    self->request(helper, caf::infinite, lease_atom::value)
      .then(
        [candidates, link, made](worker_actor& leased, int32_t which) mutable {
          made(leased, candidates[static_cast<size_t>(which)], *link);
        },
        [failed](caf::error& err) mutable { failed(err); });
  }

private:
  /// The nodes to ask for the replacement of a worker that died on `dead`, in order; notes
  /// `dead` as a node that lost a worker.
  std::vector<node_address> order(const node_address& dead);

  executor_config cfg_;
  caf::actor holder_;
  std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
  /// Nodes (host, port) on which a worker died.
  std::set<std::pair<std::string, uint16_t>> lost_;
};

} // namespace troupe
