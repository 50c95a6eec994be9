#include "actors/executor_system.hpp"

#include "actors/cluster/lease.hpp"
#include "actors/cluster/link_client.hpp"
#include "actors/cluster/remoting.hpp"
#include "actors/teardown.hpp"
#include "actors/worker_actor.hpp"
#include "kernels/log.hpp"
#include "messages/messages.hpp"
#include "troupe/errors.hpp"
#include "troupe/executor.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <chrono>
#include <mutex>

namespace troupe {

executor_system::executor_system()
  : replacements_(std::make_shared<replacement_list>()), links_(std::make_shared<link_set>()),
    log_(get_logger("troupe.executor")) {}

executor_system::~executor_system() = default;

void executor_system::stop() {
  if (!sys_)
    return;
  size_t left = 0;
  {
    logger_release release;
    caf::scoped_actor self{*sys_};
    for (auto& w : local_workers_) {
      self->monitor(w);
      ++left;
    }
    if (supervisor_) {
      self->monitor(supervisor_);
      ++left;
    }
    // Waiting for the nodes to release their workers lets the middleman finish with
    // those connections before the system is destroyed; destroyed earlier, it now and
    // then kept a reference to the supervisor and waited for it forever.
    std::vector<worker_actor> leased = leased_workers_;
    {
      std::lock_guard<std::mutex> lk{replacements_->mtx};
      leased.insert(leased.end(), replacements_->leased.begin(), replacements_->leased.end());
    }
    for (auto& w : leased) {
      self->monitor(w);
      ++left;
    }
    // The supervisor stops the workers; this covers a supervisor that is already gone.
    for (auto& w : local_workers_)
      self->send_exit(w, caf::exit_reason::user_shutdown);
    // Tells the nodes to release their workers. Its end is awaited too: the nodes watch
    // it, and hear of its end through the middleman, which must still run then.
    if (lease_holder_) {
      self->monitor(lease_holder_);
      ++left;
      self->send_exit(lease_holder_, caf::exit_reason::user_shutdown);
    }
    auto deadline = std::chrono::steady_clock::now() + executor::shutdown_grace;
    bool timed_out = false;
    while (left > 0 && !timed_out) {
      auto remaining = deadline - std::chrono::steady_clock::now();
      if (remaining <= decltype(remaining)::zero())
        break;
      self->receive([&](caf::down_msg&) { --left; },
                    caf::after(std::chrono::duration_cast<std::chrono::microseconds>(remaining)) >>
                      [&] { timed_out = true; });
    }
  }
  {
    // The supervisor is gone (or abandoned): it replaces no more workers, and stopped
    // those it made.
    std::lock_guard<std::mutex> lk{replacements_->mtx};
    for (auto& w : replacements_->workers)
      local_workers_.push_back(w);
    replacements_->workers.clear();
    replacements_->leased.clear();
  }
  // Actors that remote nodes have seen stay in the registry for as long as those nodes
  // keep a proxy; drop them so that destroying the system does not wait for the peers.
  for (auto& w : local_workers_)
    sys_->registry().erase(w.id());
  if (supervisor_)
    sys_->registry().erase(supervisor_.id());
  if (lease_holder_)
    sys_->registry().erase(lease_holder_.id());
  supervisor_ = nullptr;
  lease_holder_ = nullptr;
  local_workers_.clear();
  leased_workers_.clear();
  if (left > 0)
    log_->error("shutdown: {} actor(s) still busy after {} s; abandoning them", left,
                executor::shutdown_grace.count());
  // Destroying the system waits for every actor; rather than hang the host, a system
  // that takes too long is left behind.
  auto wait = left > 0 ? std::chrono::seconds(0) : executor::shutdown_grace;
  if (!destroy_within(sys_, sys_cfg_, wait) && left == 0)
    log_->error("shutdown: the actor system did not stop within {} s; leaving it behind",
                executor::shutdown_grace.count());
}

void executor_system::start_system(const executor_config& cfg) {
  sys_cfg_ = std::make_unique<caf::actor_system_config>();
  register_messages(*sys_cfg_);
  configure_scheduler(*sys_cfg_, cfg.scheduler_threads, cfg.scheduler_poll_attempts);
  caller_linger_ = cfg.linger;
  if (!cfg.cluster.empty()) {
    caller_linger_ = std::max(cfg.linger, cfg.cluster.network_linger);
    load_middleman(*sys_cfg_, cfg.cluster.node_timeout, cfg.cluster.network_linger);
    if (wants_tls(cfg.cluster.tls_certificate, cfg.cluster.tls_key, cfg.cluster.tls_ca))
      configure_tls(*sys_cfg_, cfg.cluster.tls_certificate, cfg.cluster.tls_key,
                    cfg.cluster.tls_ca);
  }
  if (cfg.configure_system)
    cfg.configure_system(*sys_cfg_);
  sys_ = std::make_unique<caf::actor_system>(*sys_cfg_);
  // The constructing thread, too, keeps a reference to the system's logger (see
  // logger_release).
  caf::logger::set_current_actor_system(nullptr);
}

void executor_system::lease_from_nodes(const executor_config& cfg,
                                       std::vector<worker_actor>& workers,
                                       std::vector<worker_place>& places) {
  if (cfg.cluster.nodes.empty())
    return;
  // The nodes watch this actor: when it goes (shutdown, death, lost connection) they
  // release the workers.
  lease_holder_ = sys_->spawn([]() -> caf::behavior { return {[](caf::ok_atom) {}}; });
  // startup_timeout bounds the connections and handshakes with every node together.
  auto deadline = std::chrono::steady_clock::now() + cfg.startup_timeout;
  logger_release release;
  caf::scoped_actor self{*sys_};
  for (auto& n : cfg.cluster.nodes) {
    auto grant = lease_workers(self.ptr(), cfg, n, n.workers, lease_holder_, deadline);
    for (auto& w : grant.workers) {
      workers.push_back(w);
      leased_workers_.push_back(workers.back());
      places.push_back({"node", n.host, n.port, grant.link});
    }
  }
}

void executor_system::connect_remote_workers(const executor_config& cfg,
                                             std::vector<worker_actor>& workers,
                                             std::vector<worker_place>& places) {
  for (auto& rw : cfg.cluster.remote_workers) {
    // Checks the published actor's interface on connect.
    auto handle = sys_->middleman().remote_actor<worker_actor>(rw.host, rw.port);
    caf::logger::set_current_actor_system(nullptr); // see logger_release
    if (!handle)
      throw error{errc::worker_died, "cannot reach remote worker " + rw.host + ":" +
                                       std::to_string(rw.port) + ": " + render(handle.error())};
    workers.push_back(*handle);
    places.push_back({"worker host", rw.host, rw.port, nullptr});
  }
}

void executor_system::start(const executor_config& cfg, worker_factory factory) {
  start_system(cfg);
  std::vector<worker_actor> workers;
  std::vector<worker_place> places;
  for (int32_t i = 0; i < cfg.tensor_parallel_size - cfg.cluster.remote_count(); ++i) {
    workers.push_back(spawn_worker(*sys_, factory));
    local_workers_.push_back(workers.back());
    places.emplace_back();
  }
  try {
    lease_from_nodes(cfg, workers, places);
    connect_remote_workers(cfg, workers, places);
  } catch (...) {
    // A handle held here would keep its detached worker's thread, and so stop, waiting.
    workers.clear();
    stop();
    throw;
  }
  supervisor_ = spawn_supervisor(*sys_, cfg, std::move(workers), std::move(places),
                                 std::move(factory), lease_holder_, replacements_, links_);
}

} // namespace troupe
