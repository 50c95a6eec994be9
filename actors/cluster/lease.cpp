#include "actors/cluster/lease.hpp"

#include "kernels/log.hpp"
#include "actors/cluster/node_auth.hpp"
#include "actors/cluster/link_client.hpp"
#include "actors/cluster/remoting.hpp"
#include "messages/messages.hpp"
#include "troupe/errors.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <caf/io/basp_broker.hpp>
#include <caf/io/network/default_multiplexer.hpp>
#include <caf/openssl/all.hpp>

#include <algorithm>
#include <set>

namespace troupe {

std::string node_name(const node_address& n) {
  return "node " + n.host + ":" + std::to_string(n.port);
}

node_grant lease_workers(caf::blocking_actor* self, const executor_config& cfg,
                         const node_address& n, int32_t count, const caf::actor& holder,
                         std::chrono::steady_clock::time_point deadline) {
  auto where = node_name(n);
  auto& sys = self->system();
  auto late = "no answer within " +
              std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                               deadline - std::chrono::steady_clock::now())
                               .count()) +
              " ms";
  // Each step gets what is left of the deadline; none starts once it has passed.
  auto left = [&] {
    auto rest = std::chrono::duration_cast<std::chrono::microseconds>(
      deadline - std::chrono::steady_clock::now());
    if (rest <= std::chrono::microseconds::zero())
      throw error{errc::worker_died, "cannot reach " + where + ": " + late};
    return caf::duration{rest};
  };
  caf::error err;
  auto why = [&] { return err == caf::sec::request_timeout ? late : render(err); };
  auto fail = [&](caf::error& e) { err = std::move(e); };
  node_gate_actor gate;
  std::set<std::string> interface;
  auto take_gate = [&](caf::node_id&, caf::strong_actor_ptr& ptr, std::set<std::string>& ifs) {
    gate = caf::actor_cast<node_gate_actor>(std::move(ptr));
    interface = std::move(ifs);
  };
  if (cfg.cluster.tls_certificate.empty()) {
    // The connection proves the secret before any BASP byte; then the middleman takes
    // it over as if it had connected itself.
    left();
    auto fd = dial_node(n.host, n.port, cfg.cluster.node_secret, deadline);
    auto& mm = sys.middleman();
    auto basp = mm.named_broker<caf::io::basp_broker>(caf::atom("BASP"));
    self->request(basp, left(), caf::connect_atom::value, mm.backend().new_scribe(fd), n.port)
      .receive(take_gate, fail);
  } else {
    // Through the TLS manager's actor, so that the deadline bounds the connection.
    self
      ->request(sys.openssl_manager().actor_handle(), left(), caf::connect_atom::value, n.host,
                n.port)
      .receive(take_gate, fail);
  }
  if (err || !gate)
    throw error{errc::worker_died,
                "cannot reach " + where + ": " + (err ? why() : "it published nothing")};
  if (interface != sys.message_types<node_gate_actor>())
    throw error{errc::worker_died, where + " is no troupe node of this version (its gate speaks " +
                                     "another protocol)"};
  auto checked = [&] {
    if (!err)
      return;
    auto code =
      err.category() == caf::atom("troupe") ? static_cast<errc>(err.code()) : errc::worker_died;
    throw error{code == errc::timeout ? errc::worker_died : code, where + ": " + why()};
  };
  if (!cfg.cluster.node_secret.empty()) {
    std::string challenge;
    self->request(gate, left(), hello_atom::value)
      .receive([&](std::string& c) { challenge = std::move(c); }, fail);
    checked();
    auto proof = secret_proof(cfg.cluster.node_secret, challenge, to_string(sys.node()));
    self->request(gate, left(), auth_atom::value, proof).receive([](caf::ok_atom) {}, fail);
    checked();
  }
  node_grant grant;
  std::string token;
  std::string local_address;
  self
    ->request(gate, left(), lease_atom::value, cfg.cluster.node_worker_kind,
              cfg.cluster.node_worker_options, count, holder)
    .receive(
      [&](worker_handles& ws, std::string& t, std::string& local) {
        grant.workers = std::move(ws.ranks);
        token = std::move(t);
        local_address = std::move(local);
      },
      fail);
  checked();
  if (cfg.cluster.node_links) {
    try {
      link_credentials credentials{cfg.cluster.node_secret, nullptr};
      if (!cfg.cluster.tls_certificate.empty())
        credentials.tls = make_tls_context(tls_role::client, cfg.cluster.tls_certificate,
                                           cfg.cluster.tls_key, cfg.cluster.tls_ca);
      grant.link =
        link_client::open(n.host, n.port, cfg.cluster.node_local_links ? local_address : "",
                          cfg.cluster.node_shared_memory, credentials, token,
                          cfg.cluster.network_linger, cfg.cluster.node_timeout, deadline);
    } catch (const error& e) {
      // The workers are leased and BASP reaches them: the calls go that way.
      get_logger("troupe.executor")
        ->warn("{}: no call link ({}); calls to its workers go over BASP", where, e.what());
    }
  }
  return grant;
}

void lease_one(caf::blocking_actor* self, executor_config cfg, std::vector<node_address> candidates,
               caf::actor holder, std::chrono::steady_clock::time_point deadline,
               std::shared_ptr<std::atomic<bool>> cancelled,
               std::shared_ptr<std::shared_ptr<link_client>> link) {
  self->receive([&](lease_atom) -> caf::result<worker_actor, int32_t> {
    std::string refusals;
    for (size_t i = 0; i < candidates.size() && !*cancelled; ++i) {
      auto until = std::min(deadline, std::chrono::steady_clock::now() + cfg.cluster.node_timeout);
      try {
        auto grant = lease_workers(self, cfg, candidates[i], 1, holder, until);
        auto& leased = grant.workers;
        if (leased.size() == 1) {
          *link = std::move(grant.link);
          return {leased[0], static_cast<int32_t>(i)};
        }
        refusals += (refusals.empty() ? "" : "; ") + node_name(candidates[i]) + ": gave " +
                    std::to_string(leased.size()) + " workers for 1";
      } catch (const error& e) {
        refusals += (refusals.empty() ? "" : "; ") + std::string{e.what()};
      }
    }
    return caf::make_error(errc::worker_died, "no node gave a replacement (" + refusals + ")");
  });
}

std::vector<node_address> replacement_leases::order(const node_address& dead) {
  std::vector<node_address> candidates{dead};
  for (auto* list : {&cfg_.cluster.spare_nodes, &cfg_.cluster.nodes})
    for (auto& n : *list) {
      bool known = false;
      for (auto& c : candidates)
        known = known || (c.host == n.host && c.port == n.port);
      if (!known)
        candidates.push_back({n.host, n.port, 1});
    }
  std::stable_partition(candidates.begin() + 1, candidates.end(), [&](const node_address& n) {
    return lost_.count({n.host, n.port}) == 0;
  });
  lost_.insert({dead.host, dead.port});
  return candidates;
}

} // namespace troupe
