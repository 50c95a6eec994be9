// The supervisor actor of an executor: supervision and the replacement of dead workers
// over the calls in flight of its `gather_table`, with the objects that each keep one part
// of the workers' common state (`recovery`, `execution_loop`, `sleep_control`,
// `adapter_log`) or one kind of call (`collective_calls`, `worker_group`). Its interface is
// `supervisor_actor` (messages/protocols.hpp); each handler calls one member function of its state.

#include "actors/supervisor.hpp"

#include "actors/adapter_log.hpp"
#include "actors/cluster/link_client.hpp"
#include "actors/cluster/node_auth.hpp"
#include "actors/cluster/remoting.hpp"
#include "actors/cluster/worker_routes.hpp"
#include "actors/collective_calls.hpp"
#include "actors/execution_loop.hpp"
#include "actors/gather_table.hpp"
#include "actors/lost_cache.hpp"
#include "actors/recovery.hpp"
#include "actors/reply_sink.hpp"
#include "actors/sharded_save.hpp"
#include "actors/sleep_control.hpp"
#include "actors/worker_actor.hpp"
#include "actors/worker_group.hpp"
#include "actors/worker_maker.hpp"
#include "kernels/log.hpp"
#include "troupe/errors.hpp"

#include <caf/all.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>

namespace troupe {

namespace {

using clock_type = std::chrono::steady_clock;
using supervisor_self = supervisor_actor::stateful_pointer<supervisor_state>;

template <class... Ts>
using promise = caf::typed_response_promise<Ts...>;

/// "node HOST:PORT" or "worker host HOST:PORT": where a remote worker runs.
std::string place_name(const worker_place& place) {
  return place.kind + " " + place.host + ":" + std::to_string(place.port);
}

} // namespace

struct supervisor_state : gather_host, recovery_host, group_host {
  supervisor_self self = nullptr;
  executor_config cfg;
  std::vector<worker_actor> workers;
  std::vector<worker_place> places;
  /// Set when a worker went down or the executor shut down; every call fails with it.
  caf::error failure;
  /// The calls in flight to the workers (made once `self` and `sink` are).
  std::unique_ptr<gather_table> gathers;
  /// Sleep and wake-up on every worker (made with `gathers`).
  std::unique_ptr<sleep_control> sleep;
  /// The execution loop of the driver's peers (made with `gathers`).
  std::unique_ptr<execution_loop> loop;

  /// Where a replacement comes from (`executor_config::restart`).
  std::unique_ptr<worker_maker> maker;
  /// The workers as one tensor-parallel group (made with `gathers`).
  std::unique_ptr<worker_group> group;
  /// The adapter calls a replacement repeats (made with `gathers`).
  std::unique_ptr<adapter_log> adapters;
  /// What a replacement took from the steps.
  lost_cache cache_loss;
  /// Where a replacement stands, and what waits for it (made with `gathers`).
  std::unique_ptr<recovery> recov;
  /// The calls answered by one gather to every worker (made with `adapters`).
  std::unique_ptr<collective_calls> calls;
  /// Where the workers' replies of direct gathers go.
  std::unique_ptr<reply_sink> sink;
  /// Where each rank's messages go (its worker, or its call link's stub).
  std::unique_ptr<worker_routes> routes;
  std::shared_ptr<spdlog::logger> log = get_logger("troupe.executor");

  static inline const char* name = "troupe.executor";

  ~supervisor_state() {
    // The links' readers hand responses to the sink, which is destroyed first.
    routes.reset();
    for (auto& place : places)
      if (place.link)
        place.link->close();
  }

  // -- what the gathers ask of the supervisor -----------------------------------------

  caf::error refusal(const gather& g) override {
    if (failure)
      return failure;
    if (recov->dead_in_place() &&
        std::find(g.ranks.begin(), g.ranks.end(), recov->rank()) != g.ranks.end()) {
      // What is sent to a dead worker is never answered.
      if (g.label == "execute_model")
        cache_loss.told(); // this step tells the engine
      return recov->lost_work();
    }
    return {};
  }

  bool replaces_workers() const override {
    return cfg.restart.max_restarts > 0;
  }

  caf::error work_lost() const override {
    return recov->under_way() ? recov->lost_work() : caf::error{};
  }

  /// Fails every pending call with `why`, which every later call also gets.
  void fail_all(caf::error why) {
    failure = std::move(why);
    gathers->fail_all(failure);
    recov->run_hooks(failure);
  }

  /// The deadline timer fired: the gathers' deadlines, and those of calls waiting for a
  /// replacement.
  void check_deadlines(int64_t at) {
    gathers->check_deadlines(at);
    recov->expire_waiting(clock_type::now());
  }

  std::vector<int32_t> all_ranks() const {
    std::vector<int32_t> ranks(workers.size());
    for (size_t i = 0; i < ranks.size(); ++i)
      ranks[i] = static_cast<int32_t>(i);
    return ranks;
  }

  std::vector<int32_t> peer_ranks() const {
    auto ranks = all_ranks();
    if (!ranks.empty())
      ranks.erase(ranks.begin());
    return ranks;
  }

  bool is_local(const worker_actor& w) const {
    return w.node() == self->node();
  }

  /// A promise for the current request: failed at once when the executor is, else handed
  /// to `answer`, which delivers it.
  template <class F>
  promise<caf::ok_atom> unless_failed(F answer) {
    auto rp = self->template make_response_promise<caf::ok_atom>();
    if (failure)
      rp.deliver(failure);
    else
      answer(rp);
    return rp;
  }

  // -- what the group asks of the supervisor -------------------------------------------

  worker_handles members() const override {
    return {workers};
  }

  /// A driver of this process sends its steps to the stubs of linked peers, so that they
  /// share the link's stream with what the supervisor sends them.
  worker_handles driver_peers() const override {
    worker_handles peers;
    bool local = !workers.empty() && is_local(workers[0]);
    for (size_t i = 1; i < workers.size(); ++i)
      peers.ranks.push_back(local ? target(i) : workers[i]);
    return peers;
  }

  bool in_process(size_t rank) const override {
    return is_local(workers[rank]);
  }

  /// Where rank `rank` runs, for messages: its host and process, and its node if leased.
  std::string where(const worker_info& info) const override {
    auto text = "rank " + std::to_string(info.rank) + " on " + info.hostname + " (pid " +
                std::to_string(info.pid);
    auto& place = places[static_cast<size_t>(info.rank)];
    if (!place.host.empty())
      text += ", " + place_name(place);
    return text + ")";
  }

  // -- the handlers -----------------------------------------------------------------

  /// Starts every worker (device, model, rank and peers), then forms their tensor-parallel
  /// group.
  promise<std::vector<worker_info>> init_workers() {
    auto rp = self->template make_response_promise<std::vector<worker_info>>();
    recov->started(workers.size());
    group->start([rp](caf::expected<std::vector<worker_info>> infos) mutable {
      if (infos)
        rp.deliver(std::move(*infos));
      else
        rp.deliver(infos.error());
    });
    return rp;
  }

  /// save_sharded_state, all or nothing (see `save_sharded`).
  promise<caf::ok_atom> save_sharded_state(sharded_state_request req) {
    auto rp = self->template make_response_promise<caf::ok_atom>();
    save_sharded(*gathers, *recov, all_ranks(), cfg.rpc_timeout, log, std::move(req),
                 random_challenge().substr(0, 16), [rp](caf::error err) mutable {
                   if (err)
                     rp.deliver(std::move(err));
                   else
                     rp.deliver(caf::ok_atom::value);
                 });
    return rp;
  }

  // -- the execution loop -------------------------------------------------------------

  /// execute_model through the driver, answered through `reply`: from the driver's thread
  /// with its output, or from the supervisor's with an error. Starts the execution loop.
  void execute_model(execute_model_request req, reply_to<std::vector<sampler_output>> reply,
                     timeout_type timeout) {
    if (failure)
      return reply(failure);
    if (auto err = sleep->step_refusal())
      return reply(err);
    if (auto err = loop->take_error())
      return reply(err);
    if (auto err = cache_loss.refusal(req, recov->cause()))
      return reply(err);
    auto id = loop->start();
    auto* st = this;
    gathers->start_direct("execute_model", {0}, worker_request(execute_atom::value, std::move(req)),
                          timeout, [reply, id, st](gather_result res) {
                            if (!res) { // on the supervisor's thread
                              st->loop->abandon(id);
                              return reply(res.error());
                            }
                            try {
                              auto& out = (*res)[0];
                              (void)result_as<std::vector<sampler_output>>(out, 0, "execute_model");
                              reply(std::move(out.get_mutable_as<std::vector<sampler_output>>(0)));
                            } catch (const error& e) {
                              reply(caf::make_error(e.code(), std::string{e.what()}));
                            }
                          });
  }

  /// stop_remote_worker_execution_loop: answered when the loop's tasks have ended.
  promise<caf::ok_atom> stop_loop() {
    return unless_failed([this](promise<caf::ok_atom> rp) { loop->stop(rp); });
  }

  // -- sleep and wake -----------------------------------------------------------------

  promise<caf::ok_atom> fall_asleep(sleep_request asked) {
    return unless_failed([this, asked](promise<caf::ok_atom> rp) { sleep->sleep(asked, rp); });
  }

  promise<caf::ok_atom> wake_up(std::vector<std::string> tags) {
    return unless_failed([this, &tags](promise<caf::ok_atom> rp) { sleep->wake_up(tags, rp); });
  }

  /// The replacement under way, in words; empty when none is.
  std::string recovery_status() const {
    return recov->status();
  }

  // -- supervision --------------------------------------------------------------------

  worker_actor target(size_t rank) const override {
    return routes->target(rank);
  }

  /// The rank of the worker at `addr`, or -1.
  int32_t rank_of(const caf::actor_addr& addr) const {
    for (size_t i = 0; i < workers.size(); ++i)
      if (workers[i].address() == addr)
        return static_cast<int32_t>(i);
    return -1;
  }

  void on_worker_down(const caf::down_msg& msg) {
    auto rank = rank_of(msg.source);
    if (routes->hold_death(msg, rank, caf::actor_cast<caf::actor>(self)) || rank < 0)
      return;
    // Nothing more comes from it over its link.
    routes->forget(static_cast<size_t>(rank), msg.source);
    if (failure)
      return;
    auto what = "rank " + std::to_string(rank);
    auto why = render(msg.reason);
    auto& place = places[static_cast<size_t>(rank)];
    if (!place.host.empty()) {
      what += " on " + place_name(place);
      // CAF says only that the connection is gone; asking the peer's port again tells how.
      if (msg.reason == caf::exit_reason::remote_link_unreachable)
        why = why_connection_lost(place.host, place.port, !cfg.cluster.tls_certificate.empty());
    }
    auto cause = what + " went down: " + why;
    if (cfg.restart.max_restarts > 0) {
      auto refusal = cannot_replace(rank);
      if (refusal.empty()) {
        recov->begin(rank, cause);
        return;
      }
      cause += "; not replaced: " + refusal;
    }
    fail_all(caf::make_error(errc::worker_died, cause));
    log->error("{}", render(failure));
  }

  // -- replacing a worker (what `recovery` asks of the supervisor) ----------------------

  /// Why a dead `rank` cannot be replaced under the restart policy; empty when it can.
  std::string cannot_replace(int32_t rank) {
    if (!group->started())
      return "it died before the executor had started";
    auto why = maker->refusal(rank, is_local(workers[static_cast<size_t>(rank)]));
    return why.empty() ? recov->refusal() : why;
  }

  void lose_work(int32_t, const caf::error& lost) override {
    // A step in flight tells the engine that the KV cache is gone (it fails below);
    // without one, the next step does.
    cache_loss.replaced(gathers->claim_any("execute_model"));
    gathers->fail_all(lost);
    loop->lost(lost);
  }

  void start_later(int32_t rank) override {
    self->send(self, replace_atom::value, rank);
  }

  void make_worker(int32_t rank, std::function<void(worker_actor)> made,
                   std::function<void(caf::error)> failed) override {
    auto* st = this;
    maker->make(
      self, rank, [st] { return st->recov->under_way() && !st->failure; }, std::move(made),
      std::move(failed));
  }

  void install(int32_t rank, worker_actor fresh) override {
    self->monitor(fresh);
    workers[static_cast<size_t>(rank)] = fresh;
    routes->route(static_cast<size_t>(rank), fresh, places[static_cast<size_t>(rank)].link);
  }

  /// Brings the worker in `rank`'s place to the others' state: model, the driver's peers,
  /// what its predecessor left, the weight updates, the tensor-parallel group (re-formed
  /// by all ranks), KV-cache blocks, adapters, sleep.
  std::vector<step_fn> catch_up(int32_t rank) override {
    std::vector<step_fn> steps;
    auto* st = this;
    auto step = [st](std::string label, std::vector<int32_t> ranks, ask_fn ask) {
      return gather_step(*st->gathers, std::move(label), std::move(ranks), std::move(ask),
                         st->cfg.startup_timeout);
    };
    steps.push_back(step("init", {rank}, group->init_request(rank)));
    if (rank != 0)
      steps.push_back(step("the driver's peers", {0}, asking(peers_atom::value, driver_peers())));
    steps.push_back([st, rank](std::function<void(caf::error)> next) {
      st->recov->make_leftover_calls(rank, [next] { next(caf::none); });
    });
    if (cfg.replacement_calls)
      for (auto& c : cfg.replacement_calls())
        steps.push_back(step(c.method, {rank}, calling(c.method, c.args, c.kwargs)));
    steps.push_back([st](std::function<void(caf::error)> next) { st->group->form(next); });
    if (auto& cache = calls->cache())
      steps.push_back(step("initialize_cache", {rank}, typed_call(cache_init{*cache})));
    adapters->catch_up(rank, steps);
    for (auto& [method, ask] : sleep->catch_up())
      steps.push_back(step(method, {rank}, ask));
    return steps;
  }

  caf::error fail(caf::error why) override {
    if (!failure)
      fail_all(std::move(why));
    return failure;
  }

  std::string whereabouts(int32_t rank) const override {
    auto& place = places[static_cast<size_t>(rank)];
    return place.host.empty() ? "in this process" : "on " + place_name(place);
  }

  void resume(async_call call, clock_type::time_point until) override {
    run_call(std::move(call), until);
  }

  /// A call of the facade: made now, or once the replacement in progress is done. `until`:
  /// its deadline, once it has waited (it then gets only what is left of it).
  void run_call(async_call call, std::optional<clock_type::time_point> until = std::nullopt) {
    if (recov->defer(call, until))
      return;
    supervisor_access access{self, this};
    if (until && *until != clock_type::time_point::max())
      access.left = std::max(std::chrono::duration_cast<timeout_type>(*until - clock_type::now()),
                             timeout_type{1});
    call.request(access);
  }

  /// Shutdown: fail what is pending, stop every local worker, then stop; later calls find
  /// the supervisor gone.
  void on_exit(const caf::exit_msg& msg) {
    maker->stop();
    fail_all(failure ? failure
                     : caf::make_error(errc::shut_down, std::string{"executor is shut down"}));
    for (auto& w : workers) {
      self->demonitor(w.address());
      if (is_local(w))
        self->send_exit(w, caf::exit_reason::user_shutdown);
    }
    self->quit(msg.reason);
  }
};

void supervisor_access::collective_rpc(const std::string& method, caf::message args,
                                       caf::settings kwargs, const rpc_options& opts,
                                       reply_to<std::vector<caf::message>> reply) {
  state->calls->named(method, std::move(args), std::move(kwargs), opts,
                      within(from_us(opts.timeout_us)), std::move(reply));
}

void supervisor_access::execute_model(execute_model_request req, timeout_type timeout,
                                      reply_to<std::vector<sampler_output>> reply) {
  state->execute_model(std::move(req), std::move(reply), within(timeout));
}

namespace {

supervisor_actor::behavior_type
supervisor(supervisor_self self, executor_config cfg, std::vector<worker_actor> workers,
           std::vector<worker_place> places, worker_factory factory, caf::actor lease_holder,
           std::shared_ptr<replacement_list> replacements, std::shared_ptr<link_set> links) {
  auto& st = self->state;
  st.self = self;
  st.cfg = std::move(cfg);
  st.workers = std::move(workers);
  st.places = std::move(places);
  st.maker = std::make_unique<worker_maker>(st.cfg, std::move(factory), std::move(lease_holder),
                                            std::move(replacements), st.places);
  st.sink = std::make_unique<reply_sink>(self->system(), caf::actor_cast<caf::actor>(self));
  st.gathers = std::make_unique<gather_table>(self, st, *st.sink);
  st.recov =
    std::make_unique<recovery>(st, *st.gathers, st.cfg.restart, st.cfg.startup_timeout, st.log);
  st.group = std::make_unique<worker_group>(*st.gathers, st, st.cfg, st.all_ranks());
  st.adapters =
    std::make_unique<adapter_log>(*st.gathers, st.all_ranks(), st.cfg.startup_timeout, st.log);
  st.calls = std::make_unique<collective_calls>(
    self, *st.gathers, st.all_ranks(), st.cfg, *st.adapters, *st.recov,
    [&st](size_t rank) { return st.in_process(rank); }, st.log);
  st.sleep =
    std::make_unique<sleep_control>(*st.gathers, st.all_ranks(), st.cfg.rpc_timeout, st.log);
  st.loop = std::make_unique<execution_loop>(
    *st.gathers, st.peer_ranks(), st.cfg.rpc_timeout, [self](int32_t rank, int64_t id) {
      self->send(self->state.target(static_cast<size_t>(rank)), step_atom::value,
                 stop_loop_atom::value, id);
    });
  st.routes = std::make_unique<worker_routes>(self->system(), std::move(links), st.workers.size());
  for (size_t rank = 0; rank < st.workers.size(); ++rank)
    st.routes->route(rank, st.workers[rank], st.places[rank].link);
  for (auto& w : st.workers)
    self->monitor(w);
  self->set_down_handler([self](caf::down_msg& msg) { self->state.on_worker_down(msg); });
  self->set_exit_handler([self](caf::exit_msg& msg) { self->state.on_exit(msg); });
  return {
    [self](init_atom) { return self->state.init_workers(); },
    [self](rpc_atom, local_call call, rpc_options opts) {
      return self->state.calls->callable(std::move(call), opts);
    },
    [self](blocks_atom) { return self->state.calls->available_blocks(); },
    [self](init_cache_atom, cache_blocks blocks) {
      return self->state.calls->initialize_cache(blocks);
    },
    [self](save_state_atom, sharded_state_request req) {
      return self->state.save_sharded_state(std::move(req));
    },
    [self](all_true_atom, adapter_request call) {
      return self->state.calls->all_true(std::move(call));
    },
    [self](all_true_atom, adapter_change call) { return self->state.calls->all_true(call); },
    [self](same_set_atom, adapter_list call) { return self->state.calls->same_set(call); },
    [self](agree_atom, adapter_tokens call) { return self->state.calls->virtual_tokens(call); },
    [self](stop_loop_atom) { return self->state.stop_loop(); },
    [self](sleep_atom, sleep_request req) { return self->state.fall_asleep(req); },
    [self](wake_atom, std::vector<std::string> tags) {
      return self->state.wake_up(std::move(tags));
    },
    [self](sleep_state_atom) { return self->state.sleep->sleeping_tag_names(); },
    [self](recovery_atom) { return self->state.recovery_status(); },
    [self](health_atom) { return self->state.calls->check_health(); },
    [self](deadline_atom, int64_t at) { self->state.check_deadlines(at); },
    [self](async_call& call) { self->state.run_call(std::move(call)); },
    [self](replace_atom, int32_t rank) {
      if (!self->state.failure)
        self->state.recov->start(rank);
    },
    [self](reply_error_atom, uint64_t id, uint64_t index, caf::error& err) {
      self->state.gathers->direct_failed(id, index, err);
    },
  };
}

} // namespace

supervisor_actor spawn_supervisor(caf::actor_system& sys, const executor_config& cfg,
                                  std::vector<worker_actor> workers,
                                  std::vector<worker_place> places, worker_factory factory,
                                  caf::actor lease_holder,
                                  std::shared_ptr<replacement_list> replacements,
                                  std::shared_ptr<link_set> links) {
  places.resize(workers.size());
  // Scheduled, not detached: a caller may run it (`hand_to_supervisor`).
  return sys.spawn(supervisor, cfg, std::move(workers), std::move(places), std::move(factory),
                   std::move(lease_holder), std::move(replacements), std::move(links));
}

} // namespace troupe
