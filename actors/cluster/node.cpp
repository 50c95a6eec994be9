#include "troupe/node.hpp"

#include "actors/cluster/gateway.hpp"
#include "actors/linger.hpp"
#include "kernels/log.hpp"
#include "actors/cluster/node_auth.hpp"
#include "actors/cluster/link_server.hpp"
#include "actors/cluster/remoting.hpp"
#include "actors/teardown.hpp"
#include "actors/worker_actor.hpp"
#include "messages/protocols.hpp"
#include "troupe/errors.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <caf/io/basp_broker.hpp>
#include <caf/io/network/default_multiplexer.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include <csignal>
#include <sys/socket.h>
#include <unistd.h>

namespace troupe {

namespace {

/// SIGINT/SIGTERM are turned into a byte on this pipe (see node::stop_on_signals).
int signal_pipe[2] = {-1, -1};

extern "C" void on_stop_signal(int) {
  char byte = 1;
  [[maybe_unused]] auto n = write(signal_pipe[1], &byte, 1);
}

using gate_clock = std::chrono::steady_clock;

/// How long a stop waits for the workers and then for the actor system.
constexpr std::chrono::milliseconds stop_grace{5000};

/// Handshakes under way at once; more are refused rather than remembered.
constexpr size_t max_pending_handshakes = 1024;

/// The current lease: the executor's holder actor and the workers it has. It lives apart
/// from the gate's state, so that what releases it when the gate goes, however it goes
/// (a kill cannot be trapped), never touches the state CAF has destroyed by then; the node
/// reads the workers from it when it stops.
struct node_lease {
  caf::actor holder;
  std::atomic<int32_t> leased{0};
  /// The gate: leased workers take exit messages only from their own node and their
  /// executor's, so the release names the gate as their source even once it is gone.
  caf::actor_addr gate;

  /// Adds a worker that owns device slot `slot`.
  void add(caf::actor worker, int32_t slot) {
    std::lock_guard<std::mutex> guard{mtx_};
    workers_.push_back(std::move(worker));
    slots_.push_back(slot);
    leased = static_cast<int32_t>(workers_.size());
  }

  /// Forgets a worker that went down, which frees its slot; false when it is not leased.
  bool remove(const caf::actor_addr& worker) {
    std::lock_guard<std::mutex> guard{mtx_};
    for (size_t i = 0; i < workers_.size(); ++i)
      if (workers_[i].address() == worker) {
        workers_.erase(workers_.begin() + static_cast<std::ptrdiff_t>(i));
        slots_.erase(slots_.begin() + static_cast<std::ptrdiff_t>(i));
        leased = static_cast<int32_t>(workers_.size());
        return true;
      }
    return false;
  }

  /// The device slots of `devices` that no leased worker owns, in order.
  std::vector<int32_t> free_slots(int32_t devices) {
    std::lock_guard<std::mutex> guard{mtx_};
    std::vector<int32_t> free;
    for (int32_t slot = 0; slot < devices; ++slot)
      if (std::find(slots_.begin(), slots_.end(), slot) == slots_.end())
        free.push_back(slot);
    return free;
  }

  std::vector<caf::actor> workers() {
    std::lock_guard<std::mutex> guard{mtx_};
    return workers_;
  }

  /// Gives the lease to `holder` (whose node id CAF serializes as `node`) with a fresh
  /// token, which its call links present.
  void hold(caf::actor h, std::string node) {
    std::lock_guard<std::mutex> guard{mtx_};
    holder = std::move(h);
    holder_node_ = std::move(node);
    token_ = random_challenge();
  }

  /// Whether `node` (serialized) is the holder's (`frame_policy::holds`).
  bool held_by(const std::string& node) {
    std::lock_guard<std::mutex> guard{mtx_};
    return !holder_node_.empty() && node == holder_node_;
  }

  std::string token() {
    std::lock_guard<std::mutex> guard{mtx_};
    return token_;
  }

  /// Where call links from this host connect (`frame_gateway::local_address`); empty until
  /// the gateway listens, or when it has no local socket.
  void set_local_address(std::string address) {
    std::lock_guard<std::mutex> guard{mtx_};
    local_address_ = std::move(address);
  }

  std::string local_address() {
    std::lock_guard<std::mutex> guard{mtx_};
    return local_address_;
  }

  /// Whether `token` is the lease's, and if so the leased worker with actor id `id`.
  link_server::lookup find(const std::string& token, uint64_t id) {
    std::lock_guard<std::mutex> guard{mtx_};
    link_server::lookup found;
    found.holds = !token_.empty() && same_proof(token, token_);
    if (found.holds)
      for (auto& w : workers_)
        if (w.id() == id)
          found.worker = w;
    return found;
  }

  /// Stops the workers (their memory is freed) and forgets the holder.
  void release(caf::actor_system& sys, spdlog::logger& log, const std::string& why) {
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (workers_.empty() && !holder)
        return;
      log.info("releasing {} worker(s): {}", workers_.size(), why);
      for (auto& w : workers_) {
        caf::anon_send(w, caf::exit_msg{gate, caf::exit_reason::user_shutdown});
        sys.registry().erase(w.id());
      }
      workers_.clear();
      slots_.clear();
      holder = nullptr;
      holder_node_.clear();
      token_.clear();
      leased = 0;
    }
    if (ended)
      ended();
  }

  /// Called once a lease is released: its call links close.
  std::function<void()> ended;

  /// Called (on a CAF thread, so it must not block) when the gate has gone, with why.
  std::function<void(const caf::error&)> gate_gone;

  /// The call links and the leased workers that read them.
  std::shared_ptr<link_readers> readers = std::make_shared<link_readers>();

private:
  std::mutex mtx_;
  std::vector<caf::actor> workers_;
  /// The device slot (index into node_config::device_indices) of each worker.
  std::vector<int32_t> slots_;
  /// What the holder's call links present; empty while nobody holds the lease.
  std::string token_;
  std::string holder_node_;
  std::string local_address_;
};

/// `id` as CAF's BASP writes it into frames (`frame_policy`).
std::string serialized(caf::actor_system& sys, const caf::node_id& id) {
  std::vector<char> buf;
  caf::binary_serializer sink{sys, buf};
  auto copy = id;
  if (auto err = sink(copy))
    throw error{errc::worker_error, "node: cannot serialize a node id: " + render(err)};
  return {buf.begin(), buf.end()};
}

/// The node's only published actor: authenticates executors and leases workers to one.
struct gate_state {
  node_config cfg;
  /// Challenges handed out, by the node that asked, and when. A challenge is answered
  /// within the connection timeout or forgotten, so peers that never answer leave nothing.
  std::map<caf::node_id, std::pair<std::string, gate_clock::time_point>> challenges;
  /// Peers that proved the secret, and when; forgotten when their lease ends, or after the
  /// connection timeout when they never lease.
  std::map<caf::node_id, gate_clock::time_point> authenticated;
  std::shared_ptr<node_lease> lease;
  std::shared_ptr<spdlog::logger> log = get_logger("troupe.node");

  static inline const char* name = "troupe.node";
};

using gate_self = node_gate_actor::stateful_pointer<gate_state>;

std::string peer_of(gate_self self) {
  auto& sender = self->current_sender();
  return sender ? to_string(sender->node()) : std::string{"an anonymous sender"};
}

/// Forgets the handshakes older than the connection timeout (those of the lease holder
/// stay).
void forget_stale(gate_self self) {
  auto& st = self->state;
  auto oldest = gate_clock::now() - st.cfg.connection_timeout;
  for (auto i = st.challenges.begin(); i != st.challenges.end();)
    i = i->second.second < oldest ? st.challenges.erase(i) : std::next(i);
  for (auto i = st.authenticated.begin(); i != st.authenticated.end();)
    i = i->second < oldest && (!st.lease->holder || i->first != st.lease->holder.node())
          ? st.authenticated.erase(i)
          : std::next(i);
}

void release(gate_self self, const std::string& why) {
  auto& st = self->state;
  if (st.lease->holder) {
    st.authenticated.erase(st.lease->holder.node());
    self->demonitor(st.lease->holder);
  }
  st.lease->release(self->home_system(), *st.log, why);
}

caf::error refused(gate_self self, const std::string& why) {
  self->state.log->warn("refused {}: {}", peer_of(self), why);
  return caf::make_error(errc::invalid_argument, "node: " + why);
}

node_gate_actor::behavior_type gate(gate_self self, node_config cfg,
                                    std::shared_ptr<node_lease> lease) {
  self->state.cfg = std::move(cfg);
  lease->gate = self->address();
  self->state.lease = lease;
  self->set_down_handler([=](caf::down_msg& msg) {
    auto& st = self->state;
    if (st.lease->holder && msg.source == st.lease->holder.address())
      release(self, "its executor is gone (" + render(msg.reason) + ")");
    else if (st.lease->remove(msg.source))
      st.log->warn("a leased worker went down ({}); its device is free for its executor",
                   render(msg.reason));
  });
  // Only the node stops the gate (with a kill, which no handler sees); an exit message from
  // anyone else is logged and changes nothing.
  self->set_exit_handler([=](caf::exit_msg& msg) {
    self->state.log->warn("ignored an exit message ({}) from {}", render(msg.reason),
                          msg.source ? to_string(msg.source.node()) : std::string{"anonymous"});
  });
  auto& sys = self->home_system();
  auto log = self->state.log;
  self->attach_functor([lease, &sys, log](const caf::error& reason) {
    lease->release(sys, *log, "the gate is gone (" + render(reason) + ")");
    if (lease->gate_gone)
      lease->gate_gone(reason);
  });
  return {
    [=](hello_atom) -> caf::result<std::string> {
      auto& sender = self->current_sender();
      if (!sender)
        return refused(self, "a hello without a sender");
      auto& st = self->state;
      if (st.lease->holder && st.lease->holder.node() != sender->node())
        return refused(self, "a hello while another executor holds the workers");
      forget_stale(self);
      if (st.challenges.size() >= max_pending_handshakes)
        return refused(self, "too many executors are authenticating at once");
      auto challenge = random_challenge();
      st.challenges[sender->node()] = {challenge, gate_clock::now()};
      return challenge;
    },
    [=](auth_atom, const std::string& proof) -> caf::result<caf::ok_atom> {
      auto& st = self->state;
      auto& sender = self->current_sender();
      if (!sender)
        return refused(self, "an anonymous proof");
      auto peer = sender->node();
      if (st.lease->holder && st.lease->holder.node() != peer)
        return refused(self, "a proof while another executor holds the workers");
      forget_stale(self);
      auto at = st.challenges.find(peer);
      if (at == st.challenges.end())
        return refused(self, "a proof without a challenge (or after the connection timeout)");
      auto expected = secret_proof(st.cfg.secret, at->second.first, to_string(peer));
      st.challenges.erase(at); // one try per challenge
      if (!same_proof(proof, expected))
        return refused(self, "wrong secret");
      st.authenticated[peer] = gate_clock::now();
      st.log->info("{} authenticated", to_string(peer));
      return caf::ok_atom::value;
    },
    [=](lease_atom, const std::string& kind, const caf::settings& options, int32_t count,
        caf::actor holder) -> caf::result<worker_handles, std::string, std::string> {
      auto& st = self->state;
      auto& sender = self->current_sender();
      // Without a secret the node runs TLS only: its peers proved their certificates.
      forget_stale(self);
      if (!sender || (!st.cfg.secret.empty() && st.authenticated.count(sender->node()) == 0))
        return refused(self, "a lease before authentication");
      // The executor that holds the lease may lease more (a replacement for a worker
      // that died) while devices are free.
      if (st.lease->holder && st.lease->holder != holder)
        return refused(self, "a lease while another executor holds the workers");
      auto factory = st.cfg.kinds.find(kind);
      if (factory == st.cfg.kinds.end()) {
        std::string known;
        for (auto& [name, f] : st.cfg.kinds)
          known += (known.empty() ? "" : ", ") + name;
        return refused(self, "no worker kind '" + kind + "' (this node has: " + known + ")");
      }
      auto free = st.lease->free_slots(st.cfg.devices);
      if (count < 1 || count > static_cast<int32_t>(free.size()))
        return refused(self, std::to_string(count) + " workers asked, the node has " +
                               std::to_string(free.size()) + " free of " +
                               std::to_string(st.cfg.devices) + " devices");
      if (!holder)
        return refused(self, "a lease without a holder");
      // The holder's end releases the workers, and its call links get the lease's token:
      // it must be the asking executor's own actor.
      if (holder.node() != sender->node())
        return refused(self, "a lease for a holder in another process");
      auto make = factory->second;
      worker_handles leased;
      for (int32_t i = 0; i < count; ++i) {
        auto slot = free[static_cast<size_t>(i)];
        leased.ranks.push_back(spawn_leased_worker(
          self->home_system(), [make, options](int32_t rank) { return make(rank, options); },
          sender->node(),
          {st.cfg.device_type, st.cfg.device_indices[static_cast<size_t>(slot)],
           st.cfg.collective_host},
          std::make_shared<link_readers::member>(st.lease->readers)));
        self->monitor(leased.ranks.back());
        st.lease->add(caf::actor_cast<caf::actor>(leased.ranks.back()), slot);
      }
      if (!st.lease->holder) {
        st.lease->hold(holder, serialized(self->home_system(), holder.node()));
        self->monitor(holder);
      }
      st.log->info("leased {} '{}' worker(s) to {}", count, kind, to_string(sender->node()));
      return {std::move(leased), st.lease->token(), st.lease->local_address()};
    },
  };
}

} // namespace

struct node::impl {
  std::unique_ptr<caf::actor_system_config> sys_cfg = std::make_unique<caf::actor_system_config>();
  std::unique_ptr<caf::actor_system> sys;
  node_gate_actor gate;
  uint16_t port = 0;
  std::shared_ptr<node_lease> lease = std::make_shared<node_lease>();
  std::mutex mtx;
  /// Held for the whole of a stop.
  std::mutex stop_mtx;
  std::condition_variable stopped_cv;
  std::thread watcher;
  std::unique_ptr<frame_gateway> gateway;
  /// The call links of the lease holder (and links that have closed, dropped as new come).
  mutable std::mutex links_mtx;
  std::vector<std::unique_ptr<link_server>> links;
  std::shared_ptr<std::atomic<uint64_t>> linked_requests =
    std::make_shared<std::atomic<uint64_t>>(0);
  bool stopped = false;
  /// Set once `stop` has begun: the gate's end is then the node's doing.
  std::atomic<bool> stopping{false};
  /// Why the node stopped on its own (`node::failure`), and the thread that stops it when
  /// its gate goes: a node without a gate can serve nobody.
  std::string failure;
  bool gate_gone = false;
  std::condition_variable gate_cv;
  std::thread gate_watch;
  std::shared_ptr<spdlog::logger> log = get_logger("troupe.node");
};

node::node(node_config config) : impl_(std::make_unique<impl>()) {
  auto& d = *impl_;
  auto tls = wants_tls(config.tls_certificate, config.tls_key, config.tls_ca);
  if (config.secret.empty() && !tls)
    throw error{errc::invalid_argument,
                "a node needs a shared secret (--secret-file) or TLS certificates (--tls-*)"};
  if (!config.secret.empty())
    check_secret(config.secret, "the node's secret");
  if (config.kinds.empty())
    throw error{errc::invalid_argument, "a node needs at least one worker kind"};
  if (config.device_indices.empty())
    for (int32_t i = 0; i < config.devices; ++i)
      config.device_indices.push_back(i);
  config.devices = static_cast<int32_t>(config.device_indices.size());
  if (config.devices < 1)
    throw error{errc::invalid_argument, "a node needs at least one device"};
  if (config.collective_host.empty())
    config.collective_host = config.host;
  if (config.connection_timeout <= timeout_type::zero())
    throw error{errc::invalid_argument, "connection_timeout must be positive"};
  check_linger(config.network_linger, "network_linger");
  register_messages(*d.sys_cfg);
  configure_scheduler(*d.sys_cfg, 0, 0);
  load_middleman(*d.sys_cfg, config.connection_timeout, config.network_linger);
  if (config.configure_system)
    config.configure_system(*d.sys_cfg);
  {
    // CAF's threads must not take SIGINT or SIGTERM (an interrupted multiplexer stops the
    // system under the node); they inherit the mask in place while they start.
    sigset_t stop_signals;
    sigset_t previous;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, &previous);
    d.sys = std::make_unique<caf::actor_system>(*d.sys_cfg);
    pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  }
  gateway_options listen;
  listen.host = config.host;
  listen.port = config.port;
  listen.max_frame_bytes = config.max_message_bytes;
  listen.handshake_timeout = config.connection_timeout;
  listen.linger = config.network_linger;
  if (tls)
    listen.tls = gateway_tls{config.tls_certificate, config.tls_key, config.tls_ca};
  else
    listen.secret = config.secret; // under TLS the gate checks it, behind the certificates
  auto host = config.host;
  d.gate = d.sys->spawn(gate, std::move(config), d.lease);
  auto policy = std::make_shared<frame_policy>();
  policy->this_node = serialized(*d.sys, d.sys->node());
  policy->gate = d.gate.id();
  policy->holds = [lease = d.lease](const std::string& node) { return lease->held_by(node); };
  listen.policy = std::move(policy);
  // The middleman listens nowhere: the gateway is the node's only socket, and hands it
  // each connection it accepted (TLS ended, frames bounded) over a private socket pair, as
  // if the middleman had accepted it for the gate.
  auto& mm = d.sys->middleman();
  auto basp = mm.named_broker<caf::io::basp_broker>(caf::atom("BASP"));
  auto gate_ptr = caf::actor_cast<caf::strong_actor_ptr>(d.gate);
  // Its interface goes with it: an executor checks it against its own.
  auto interface = d.sys->message_types<node_gate_actor>();
  auto connect = [&mm, basp, gate_ptr, interface]() -> int {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0)
      return -1;
    auto theirs = pair[0];
    mm.backend().dispatch([&mm, basp, gate_ptr, interface, theirs] {
      // BASP files published actors by port; with no listening port of its own, any fixed
      // number names the gate.
      constexpr uint16_t gate_key = 1;
      caf::anon_send(basp, caf::publish_atom::value, mm.backend().new_scribe(theirs), gate_key,
                     gate_ptr, interface);
    });
    return pair[1];
  };
  auto* node_impl = &d;
  d.lease->gate_gone = [node_impl](const caf::error& reason) {
    auto& n = *node_impl;
    if (n.stopping)
      return;
    std::lock_guard<std::mutex> guard{n.mtx};
    n.failure = "its gate is gone (" + render(reason) +
                "): the node stops, as it can lease "
                "to nobody; start it again";
    n.gate_gone = true;
    n.gate_cv.notify_all();
  };
  d.lease->ended = [node_impl] {
    std::lock_guard<std::mutex> lk{node_impl->links_mtx};
    for (auto& l : node_impl->links)
      l->shut();
  };
  auto max_payload = listen.max_frame_bytes;
  auto link_linger = listen.linger;
  auto link_timeout = listen.handshake_timeout;
  auto link = [node_impl, max_payload, link_linger,
               link_timeout](int fd, std::unique_ptr<tls_session> tls, std::string peer) {
    auto& n = *node_impl;
    auto lease = n.lease;
    auto find = [lease](const std::string& token, uint64_t id) { return lease->find(token, id); };
    std::lock_guard<std::mutex> lk{n.links_mtx};
    n.links.erase(std::remove_if(n.links.begin(), n.links.end(),
                                 [](const std::unique_ptr<link_server>& l) { return l->done(); }),
                  n.links.end());
    try {
      n.links.push_back(std::make_unique<link_server>(*n.sys, fd, std::move(tls), std::move(peer),
                                                      find, link_linger, max_payload, link_timeout,
                                                      n.linked_requests, lease->readers, n.log));
    } catch (const std::exception& e) {
      n.log->warn("{}", e.what()); // its executor's calls go over BASP
    }
  };
  try {
    d.gateway = std::make_unique<frame_gateway>(std::move(listen), connect, link, d.log);
  } catch (...) {
    caf::logger::set_current_actor_system(nullptr);
    stop();
    throw;
  }
  // Spawning left this thread a reference to the system's logger; the system's destructor,
  // on whatever thread stops the node, would wait for it.
  caf::logger::set_current_actor_system(nullptr);
  d.port = d.gateway->port();
  const auto& local = d.gateway->local_address();
  d.lease->set_local_address(local);
  d.log->info("node listening on {}:{}{}{}", host, d.port, tls ? " (mutual TLS)" : "",
              local.empty() ? "" : ", call links from this host at " + local);
  d.gate_watch = std::thread{[this, node_impl] {
    auto& n = *node_impl;
    {
      std::unique_lock<std::mutex> guard{n.mtx};
      n.gate_cv.wait(guard, [&] { return n.gate_gone || n.stopped; });
      if (!n.gate_gone)
        return;
      n.log->error("{}", n.failure);
    }
    stop();
  }};
}

node::~node() {
  stop();
  if (impl_->gate_watch.joinable())
    impl_->gate_watch.join();
  if (impl_->watcher.joinable()) {
    char wake = 0; // a watcher still waiting for a signal leaves
    [[maybe_unused]] auto n = write(signal_pipe[1], &wake, 1);
    impl_->watcher.join();
  }
}

uint16_t node::port() const {
  return impl_->port;
}

std::string node::local_address() const {
  return impl_->lease->local_address();
}

int32_t node::leased_workers() const {
  return impl_->lease->leased.load();
}

int32_t node::call_links() const {
  auto& d = *impl_;
  std::lock_guard<std::mutex> lk{d.links_mtx};
  return static_cast<int32_t>(
    std::count_if(d.links.begin(), d.links.end(),
                  [](const std::unique_ptr<link_server>& l) { return l->opened() && !l->done(); }));
}

uint64_t node::linked_requests() const {
  return impl_->linked_requests->load();
}

uint64_t node::requests_read_by_workers() const {
  return impl_->lease->readers->requests_read();
}

void node::wait() {
  std::unique_lock<std::mutex> guard{impl_->mtx};
  impl_->stopped_cv.wait(guard, [&] { return impl_->stopped; });
}

std::string node::failure() const {
  std::lock_guard<std::mutex> guard{impl_->mtx};
  return impl_->failure;
}

void node::stop() {
  auto& d = *impl_;
  std::lock_guard<std::mutex> stopping{d.stop_mtx};
  {
    std::lock_guard<std::mutex> guard{d.mtx};
    if (d.stopped)
      return;
  }
  d.stopping = true;
  if (d.gateway)
    d.gateway->stop();
  {
    // No new link comes once the gateway has stopped.
    std::lock_guard<std::mutex> lk{d.links_mtx};
    d.links.clear();
  }
  if (d.gate) {
    auto workers = d.lease->workers();
    {
      caf::scoped_actor self{*d.sys};
      for (auto& w : workers)
        self->monitor(w);
      // The gate stops the workers as it goes; it ignores exit messages it can trap.
      self->send_exit(d.gate, caf::exit_reason::kill);
      auto deadline = std::chrono::steady_clock::now() + stop_grace;
      for (size_t down = 0; down < workers.size();) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0)
          break;
        self->receive([&](caf::down_msg&) { ++down; }, caf::after(left) >> [&] {});
      }
    }
    // A worker's last messages to its executor may put it back in the registry (where
    // remote peers' proxies keep actors); once it is down, nothing needs it there.
    for (auto& w : workers)
      d.sys->registry().erase(w.id());
    d.sys->registry().erase(d.gate.id());
    d.gate = nullptr;
  }
  // Sending from this thread left it a reference to the system's logger, which the
  // system's destructor would wait for.
  caf::logger::set_current_actor_system(nullptr);
  if (!destroy_within(d.sys, d.sys_cfg, stop_grace))
    d.log->error("stop: the actor system did not stop within {} ms; leaving it behind",
                 stop_grace.count());
  {
    std::lock_guard<std::mutex> guard{d.mtx};
    d.stopped = true;
  }
  d.stopped_cv.notify_all();
  d.gate_cv.notify_all();
}

void node::stop_on_signals() {
  auto& d = *impl_;
  if (d.watcher.joinable())
    return;
  // Any thread may take the signal (libraries start threads before main); the handler only
  // writes to a pipe, and a thread of ours stops the node.
  if (signal_pipe[0] < 0 && pipe(signal_pipe) != 0)
    throw error{errc::worker_error, "node: cannot create the signal pipe"};
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  d.watcher = std::thread{[this] {
    char byte = 0;
    while (read(signal_pipe[0], &byte, 1) < 0 && errno == EINTR) {
    }
    if (byte == 1) {
      impl_->log->info("signal received: stopping");
      stop();
    }
  }};
}

} // namespace troupe
