// The supervisor actor of an executor: scatter-gather, supervision, the distributed
// execution loop and the sleep state machine.

#include "actors/executor_actor.hpp"

#include "actors/log.hpp"
#include "actors/node_auth.hpp"
#include "actors/remoting.hpp"
#include "actors/sleep_state.hpp"
#include "messages/messages.hpp"
#include "troupe/errors.hpp"

#include <caf/all.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <unordered_map>

namespace troupe {

namespace {

using clock_type = std::chrono::steady_clock;
using gather_result = caf::expected<std::vector<caf::message>>;

/// One collective call in flight: the request, who still owes a reply, what came back.
struct gather {
  uint64_t id = 0;
  std::string label;
  std::vector<int32_t> ranks;
  caf::message request;
  /// When set, the request for `ranks[i]` (instead of `request` for all).
  std::vector<caf::message> per_rank;
  bool forever = false;
  clock_type::time_point deadline;
  timeout_type timeout{0};
  size_t max_concurrent = 0;
  size_t next = 0;
  size_t in_flight = 0;
  size_t remaining = 0;
  std::vector<caf::message> results;
  /// Which of `ranks` replied (a reply may be an empty message).
  std::vector<bool> answered;
  std::function<void(gather_result)> done;
  bool finished = false;
};

using gather_ptr = std::shared_ptr<gather>;

struct supervisor_state {
  executor_config cfg;
  std::vector<caf::actor> workers;
  std::vector<worker_place> places;
  /// Set when a worker went down or the executor shut down; every call fails with it.
  caf::error failure;
  uint64_t next_id = 1;
  std::unordered_map<uint64_t, gather_ptr> pending;
  /// The deadline timer in flight that fires first, if any (see `arm_deadline`).
  bool timer_armed = false;
  clock_type::time_point timer_at;
  troupe::sleep_state sleep;
  /// A sleep or wake_up is being carried out on the workers.
  bool transition = false;
  /// The parallel worker tasks of the execution loop (vLLM's parallel_worker_tasks).
  gather_ptr loop;
  /// Id of the running loop; each loop has its own, so that late news of an old loop
  /// never touches a newer one.
  int64_t loop_id = 0;
  /// A loop task that failed; reported by the next execute_model or stop.
  caf::error loop_error;
  /// The loop `loop_error` came from.
  int64_t loop_error_id = 0;
  /// Callers of stop_remote_worker_execution_loop waiting for the tasks to end.
  std::vector<caf::response_promise> stop_waiters;
  std::shared_ptr<spdlog::logger> log = get_logger("troupe.executor");

  static inline const char* name = "troupe.executor";
};

using supervisor_self = caf::stateful_actor<supervisor_state>;

std::string ms_text(timeout_type t) {
  auto ms = std::chrono::duration<double, std::milli>(t).count();
  return std::to_string(ms) + " ms";
}

/// The deadline of a call; the facade has already refused zero and negative ones.
timeout_type from_us(int64_t us) {
  return us == wait_forever.count() ? wait_forever : timeout_type{std::max<int64_t>(us, 1)};
}

/// Fails `rp` with the executor's failure, if it has one.
bool refuse_if_failed(supervisor_self* self, caf::response_promise& rp) {
  if (!self->state.failure)
    return false;
  rp.deliver(self->state.failure);
  return true;
}

void finish(supervisor_self* self, const gather_ptr& g, gather_result result) {
  if (g->finished)
    return;
  g->finished = true;
  self->state.pending.erase(g->id);
  g->done(std::move(result));
}

/// Maps the error of one request to the error of the whole call, naming the rank.
caf::error rank_error(const gather& g, int32_t rank, const caf::error& err) {
  if (err == caf::sec::request_timeout)
    return caf::make_error(errc::timeout, g.label + ": rank " + std::to_string(rank) +
                                            " did not answer within " + ms_text(g.timeout));
  if (err == caf::sec::request_receiver_down)
    return caf::make_error(errc::worker_died, g.label + ": rank " + std::to_string(rank) +
                                                " is down");
  if (err.category() == caf::atom("troupe"))
    return err; // The worker already named its rank.
  return caf::make_error(errc::worker_error,
                         g.label + ": rank " + std::to_string(rank) + ": " + render(err));
}

/// The first rank of `g` that has not replied: the one a missed deadline is blamed on.
int32_t first_silent_rank(const gather& g) {
  for (size_t i = 0; i < g.ranks.size(); ++i)
    if (!g.answered[i])
      return g.ranks[i];
  return g.ranks.front();
}

/// Makes sure a deadline check reaches the supervisor by `at`. The deadlines of calls are
/// the supervisor's own, checked by one timer for all of them: a CAF 0.17 request timeout
/// stays in the actor clock, holding a reference to its sender, until it fires, even when
/// the reply came long before, so one per request grows memory with the call rate.
void arm_deadline(supervisor_self* self, clock_type::time_point at) {
  auto& st = self->state;
  if (st.timer_armed && st.timer_at <= at)
    return;
  st.timer_armed = true;
  st.timer_at = at;
  auto in = std::max(at - clock_type::now(), clock_type::duration::zero());
  self->delayed_send(self, in, deadline_atom::value,
                     static_cast<int64_t>(at.time_since_epoch().count()));
}

/// The timer set for `at` fired: fails the calls whose deadline passed, naming the first
/// rank that did not answer, and arms the timer for the next deadline.
void check_deadlines(supervisor_self* self, int64_t at) {
  auto& st = self->state;
  if (st.timer_armed && st.timer_at.time_since_epoch().count() == at)
    st.timer_armed = false;
  auto now = clock_type::now();
  std::vector<gather_ptr> expired;
  for (auto& entry : st.pending) {
    auto& g = entry.second;
    if (!g->forever && g->deadline <= now)
      expired.push_back(g);
  }
  for (auto& g : expired)
    finish(self, g, rank_error(*g, first_silent_rank(*g), caf::sec::request_timeout));
  for (auto& entry : st.pending)
    if (!entry.second->forever)
      arm_deadline(self, entry.second->deadline);
}

void send_next(supervisor_self* self, const gather_ptr& g) {
  while (!g->finished && g->next < g->ranks.size()
         && (g->max_concurrent == 0 || g->in_flight < g->max_concurrent)) {
    auto index = g->next++;
    ++g->in_flight;
    auto& request = g->per_rank.empty() ? g->request : g->per_rank[index];
    // No CAF timeout on the request: the gather's deadline covers it (see arm_deadline).
    self->request(self->state.workers[g->ranks[index]], caf::infinite, request)
      .then(
        [=](caf::ok_atom, caf::message& result) {
          if (g->finished)
            return;
          --g->in_flight;
          g->answered[index] = true;
          g->results[index] = std::move(result);
          if (--g->remaining == 0)
            finish(self, g, std::move(g->results));
          else
            send_next(self, g);
        },
        [=](caf::error& err) { finish(self, g, rank_error(*g, g->ranks[index], err)); });
  }
}

/// Scatters `request` to `ranks` and calls `done` once with every reply (in the order of
/// `ranks`) or with the first error.
gather_ptr start_gather(supervisor_self* self, std::string label, std::vector<int32_t> ranks,
                        caf::message request, timeout_type timeout, size_t max_concurrent,
                        std::function<void(gather_result)> done,
                        std::vector<caf::message> per_rank = {}) {
  auto& st = self->state;
  auto g = std::make_shared<gather>();
  g->id = st.next_id++;
  g->label = std::move(label);
  g->ranks = std::move(ranks);
  g->request = std::move(request);
  g->per_rank = std::move(per_rank);
  g->timeout = timeout;
  g->forever = timeout == wait_forever;
  if (!g->forever)
    g->deadline = clock_type::now() + timeout;
  g->max_concurrent = max_concurrent;
  g->remaining = g->ranks.size();
  g->results.resize(g->ranks.size());
  g->answered.resize(g->ranks.size());
  g->done = std::move(done);
  if (st.failure) {
    g->finished = true;
    g->done(st.failure);
    return g;
  }
  if (g->ranks.empty()) {
    g->finished = true;
    g->done(std::vector<caf::message>{});
    return g;
  }
  st.pending.emplace(g->id, g);
  if (!g->forever)
    arm_deadline(self, g->deadline);
  send_next(self, g);
  return g;
}

std::vector<int32_t> all_ranks(supervisor_self* self) {
  std::vector<int32_t> ranks(self->state.workers.size());
  for (size_t i = 0; i < ranks.size(); ++i)
    ranks[i] = static_cast<int32_t>(i);
  return ranks;
}

/// collective_rpc: every reply, in rank order, goes to `rp`.
void collective(supervisor_self* self, caf::response_promise rp, std::string label,
                caf::message request, const rpc_options& opts) {
  start_gather(self, std::move(label), all_ranks(self), std::move(request),
               from_us(opts.timeout_us),
               static_cast<size_t>(std::max(opts.max_concurrent_workers, 0)),
               [=](gather_result res) mutable {
                 if (res)
                   rp.deliver(std::move(*res));
                 else
                   rp.deliver(res.error());
               });
}

/// Calls `method` on every worker with the default deadline; `reduce` turns the replies into
/// the answer delivered to `rp`.
void call_all(supervisor_self* self, caf::response_promise rp, const std::string& method,
              caf::message args, std::function<caf::message(std::vector<caf::message>&)> reduce,
              caf::settings kwargs = {}) {
  auto request = caf::make_message(call_atom::value, method, std::move(args), std::move(kwargs));
  start_gather(self, method, all_ranks(self), std::move(request), self->state.cfg.rpc_timeout, 0,
               [=](gather_result res) mutable {
                 if (!res) {
                   rp.deliver(res.error());
                   return;
                 }
                 try {
                   rp.deliver(reduce(*res));
                 } catch (const error& e) {
                   rp.deliver(caf::make_error(e.code(), std::string{e.what()}));
                 }
               });
}

/// The result of `rank` as a `T`, or a `bad_arguments` error naming the rank and method.
template <class T>
const T& result_as(const caf::message& msg, size_t rank, const std::string& method) {
  if (msg.size() != 1 || !msg.match_element<T>(0))
    throw error{errc::bad_arguments, method + ": rank " + std::to_string(rank) +
                                       " returned (" + to_string(msg) +
                                       "), not the expected type"};
  return msg.get_as<T>(0);
}

caf::message no_result(std::vector<caf::message>&) {
  return caf::message{};
}

caf::error invalid_id(const char* what, int64_t id) {
  return caf::make_error(errc::invalid_argument, std::string{what} + " must be greater than 0, got " +
                                                   std::to_string(id));
}

bool is_local(supervisor_self* self, const caf::actor& worker) {
  return worker.node() == self->node();
}

std::vector<int32_t> peer_ranks(supervisor_self* self) {
  std::vector<int32_t> peers;
  for (size_t rank = 1; rank < self->state.workers.size(); ++rank)
    peers.push_back(static_cast<int32_t>(rank));
  return peers;
}

/// The tasks of loop `loop_id` ended (normally or not): wake the callers of stop. After a
/// failure the peers still in that loop are told to leave it, so the next loop starts clean.
void loop_ended(supervisor_self* self, int64_t loop_id, gather_result res) {
  auto& st = self->state;
  if (!st.loop || st.loop_id != loop_id)
    return; // news of an older loop
  st.loop.reset();
  caf::error err = res ? caf::error{} : res.error();
  if (err) {
    for (auto rank : peer_ranks(self))
      self->send(st.workers[rank], step_atom::value, stop_loop_atom::value, loop_id);
    if (st.stop_waiters.empty()) {
      st.loop_error = err;
      st.loop_error_id = loop_id;
    }
  }
  for (auto& rp : st.stop_waiters) {
    if (err)
      rp.deliver(err);
    else
      rp.deliver(caf::unit);
  }
  st.stop_waiters.clear();
}

/// A step the driver failed leaves loop `loop_id` suspect: its peers are told to leave it,
/// and a failure they report for it is the one the caller already got, not news for the
/// next call.
void abandon_loop(supervisor_self* self, int64_t loop_id) {
  auto& st = self->state;
  if (st.loop_error && st.loop_error_id == loop_id)
    st.loop_error = caf::error{};
  if (!st.loop || st.loop_id != loop_id)
    return;
  st.loop.reset();
  for (auto rank : peer_ranks(self))
    self->send(st.workers[rank], step_atom::value, stop_loop_atom::value, loop_id);
  for (auto& rp : st.stop_waiters)
    rp.deliver(caf::unit);
  st.stop_waiters.clear();
}

void start_loop(supervisor_self* self) {
  auto& st = self->state;
  if (st.loop || st.workers.size() < 2)
    return;
  auto loop_id = ++st.loop_id;
  auto request = caf::make_message(call_atom::value, std::string{"start_worker_execution_loop"},
                                   caf::make_message(loop_id), caf::settings{});
  // The tasks end only when the loop is stopped; a dead worker still fails them at once.
  auto g = start_gather(self, "start_worker_execution_loop", peer_ranks(self),
                        std::move(request), wait_forever, 0,
                        [=](gather_result res) { loop_ended(self, loop_id, std::move(res)); });
  if (!g->finished)
    st.loop = g;
}

/// Where rank `rank` runs, for messages: its host and process, and its node if leased.
std::string where_rank(supervisor_self* self, const worker_info& info) {
  auto text = "rank " + std::to_string(info.rank) + " on " + info.hostname + " (pid " +
              std::to_string(info.pid);
  auto& place = self->state.places[static_cast<size_t>(info.rank)];
  if (!place.host.empty())
    text += ", " + place.kind + " " + place.host + ":" + std::to_string(place.port);
  return text + ")";
}

/// An `inconsistent_workers` error when two ranks loaded different models (one host has
/// another version of the files at the same path): they would compute garbage together.
caf::error different_models(supervisor_self* self, const std::vector<worker_info>& infos) {
  for (auto& info : infos) {
    auto& first = infos.front();
    if (first.model_fingerprint.empty() || info.model_fingerprint.empty() ||
        info.model_fingerprint == first.model_fingerprint)
      continue;
    return caf::make_error(errc::inconsistent_workers,
                           where_rank(self, first) + " and " + where_rank(self, info) +
                             " loaded different models from '" + first.model + "' and '" +
                             info.model + "': their configs or files differ (names, shapes, "
                             "types or bytes of the tensors); every host needs the same files");
  }
  return {};
}

void on_worker_down(supervisor_self* self, const caf::down_msg& msg) {
  auto& st = self->state;
  int32_t rank = -1;
  for (size_t i = 0; i < st.workers.size(); ++i)
    if (st.workers[i].address() == msg.source)
      rank = static_cast<int32_t>(i);
  if (rank < 0 || st.failure)
    return;
  auto what = "rank " + std::to_string(rank);
  auto why = render(msg.reason);
  auto& place = st.places[static_cast<size_t>(rank)];
  if (!place.host.empty()) {
    what += " on " + place.kind + " " + place.host + ":" + std::to_string(place.port);
    // CAF says only that the connection is gone; asking the peer's port again tells how.
    if (msg.reason == caf::exit_reason::remote_link_unreachable)
      why = why_connection_lost(place.host, place.port, !st.cfg.tls_certificate.empty());
  }
  st.failure = caf::make_error(errc::worker_died, what + " went down: " + why);
  st.log->error("{}", render(st.failure));
  auto pending = std::move(st.pending);
  st.pending.clear();
  for (auto& [id, g] : pending) {
    g->finished = true;
    g->done(st.failure);
  }
}

caf::behavior supervisor(supervisor_self* self, executor_config cfg,
                         std::vector<caf::actor> workers, std::vector<worker_place> places) {
  auto& st = self->state;
  st.cfg = std::move(cfg);
  st.workers = std::move(workers);
  st.places = std::move(places);
  for (auto& w : st.workers)
    self->monitor(w);
  self->set_down_handler([=](caf::down_msg& msg) { on_worker_down(self, msg); });
  // Shutdown: fail what is pending, stop every local worker, then stop; later calls find
  // the supervisor gone.
  self->set_exit_handler([=](caf::exit_msg& msg) {
    auto& st = self->state;
    if (!st.failure)
      st.failure = caf::make_error(errc::shut_down, std::string{"executor is shut down"});
    auto pending = std::move(st.pending);
    st.pending.clear();
    for (auto& [id, g] : pending) {
      g->finished = true;
      g->done(st.failure);
    }
    for (auto& w : st.workers) {
      self->demonitor(w);
      if (is_local(self, w))
        self->send_exit(w, caf::exit_reason::user_shutdown);
    }
    self->quit(msg.reason);
  });
  return {
    // Starts every worker: device, model, rank and peers. Replies std::vector<worker_info>.
    [=](init_atom) {
      auto rp = self->make_response_promise();
      auto& st = self->state;
      auto world = static_cast<int32_t>(st.workers.size());
      std::vector<caf::message> requests;
      int32_t local_index = 0;
      for (int32_t rank = 0; rank < world; ++rank) {
        worker_context ctx;
        ctx.rank = rank;
        ctx.world_size = world;
        ctx.device_kind = st.cfg.device_kind;
        ctx.device_index = is_local(self, st.workers[rank]) ? local_index++ : 0;
        ctx.block_size = st.cfg.block_size;
        ctx.max_model_len = st.cfg.max_model_len;
        ctx.profile_dir = st.cfg.profile_dir;
        ctx.collective_host = st.cfg.collective_host;
        std::vector<caf::actor> peers;
        if (rank == 0)
          peers.assign(st.workers.begin() + 1, st.workers.end());
        requests.push_back(caf::make_message(init_atom::value, ctx, std::move(peers)));
      }
      auto g = start_gather(self, "init", all_ranks(self), caf::message{},
                            st.cfg.startup_timeout, 0, [=](gather_result res) mutable {
                              if (!res) {
                                rp.deliver(res.error());
                                return;
                              }
                              std::vector<worker_info> infos;
                              for (size_t rank = 0; rank < res->size(); ++rank) {
                                auto& info = (*res)[rank];
                                if (!info.match_elements<worker_info>()) {
                                  rp.deliver(caf::make_error(
                                    errc::bad_arguments, "rank " + std::to_string(rank) +
                                                           " answered init with (" +
                                                           to_string(info) +
                                                           "), not a worker_info"));
                                  return;
                                }
                                infos.push_back(info.get_as<worker_info>(0));
                              }
                              if (auto err = different_models(self, infos)) {
                                rp.deliver(std::move(err));
                                return;
                              }
                              rp.deliver(std::move(infos));
                            },
                            std::move(requests));
      (void)g;
      return rp;
    },
    // collective_rpc with a method name: std::vector<caf::message> in rank order.
    [=](rpc_atom, std::string method, caf::message args, caf::settings kwargs,
        rpc_options opts) {
      auto rp = self->make_response_promise();
      auto label = "collective_rpc '" + method + "'";
      auto request = caf::make_message(call_atom::value, std::move(method), std::move(args),
                                       std::move(kwargs));
      collective(self, rp, std::move(label), std::move(request), opts);
      return rp;
    },
    // collective_rpc with a callable: refused when any worker lives in another process.
    [=](rpc_atom, local_call call, rpc_options opts) {
      auto rp = self->make_response_promise();
      auto& st = self->state;
      std::string remote;
      for (size_t rank = 0; rank < st.workers.size(); ++rank)
        if (!is_local(self, st.workers[rank]))
          remote += (remote.empty() ? "" : ", ") + std::to_string(rank);
      if (!remote.empty()) {
        rp.deliver(caf::make_error(errc::remote_callable,
                                   "callable '" + call.label + "' cannot run on rank(s) " + remote +
                                     ": they live in another process and callables are never "
                                     "serialised; register a named method instead"));
        return rp;
      }
      auto label = "collective_rpc callable '" + call.label + "'";
      collective(self, rp, std::move(label), caf::make_message(call_atom::value, std::move(call)),
                 opts);
      return rp;
    },
    // determine_num_available_blocks: the minimum over workers of both numbers.
    [=](blocks_atom) {
      auto rp = self->make_response_promise();
      const std::string method = "determine_num_available_blocks";
      call_all(self, rp, method, {}, [method](std::vector<caf::message>& results) {
        cache_blocks least;
        for (size_t rank = 0; rank < results.size(); ++rank) {
          auto& b = result_as<cache_blocks>(results[rank], rank, method);
          if (rank == 0 || b.num_device_blocks < least.num_device_blocks)
            least.num_device_blocks = b.num_device_blocks;
          if (rank == 0 || b.num_swap_blocks < least.num_swap_blocks)
            least.num_swap_blocks = b.num_swap_blocks;
        }
        return caf::make_message(least);
      });
      return rp;
    },
    // save_sharded_state, all or nothing: every rank writes its files aside; they are moved
    // into place only once every rank has succeeded, and removed otherwise.
    [=](save_state_atom, sharded_state_request req) {
      auto rp = self->make_response_promise();
      auto& st = self->state;
      // Names this save's staging folders; random, so that executors sharing a folder
      // never mix their parts.
      auto token = random_challenge().substr(0, 16);
      auto finish = [=](bool commit, std::function<void(gather_result)> then) {
        start_gather(self, "save_sharded_state", all_ranks(self),
                     caf::make_message(call_atom::value, std::string{"finish_sharded_state"},
                                       caf::make_message(req.path, token, commit),
                                       caf::settings{}),
                     self->state.cfg.rpc_timeout, 0, std::move(then));
      };
      caf::settings staged;
      staged["staging"] = token;
      start_gather(self, "save_sharded_state", all_ranks(self),
                   caf::make_message(call_atom::value, std::string{"save_sharded_state"},
                                     caf::make_message(req), std::move(staged)),
                   st.cfg.rpc_timeout, 0, [=](gather_result res) mutable {
                     if (!res) {
                       finish(false, [=, failure = res.error()](gather_result) mutable {
                         rp.deliver(failure);
                       });
                       return;
                     }
                     finish(true, [=](gather_result done) mutable {
                       if (done)
                         rp.deliver(caf::message{});
                       else
                         rp.deliver(done.error());
                     });
                   });
      return rp;
    },
    [=](init_cache_atom, cache_blocks blocks) {
      auto rp = self->make_response_promise();
      auto& st = self->state;
      if (blocks.num_device_blocks <= 0 || blocks.num_swap_blocks < 0) {
        rp.deliver(caf::make_error(
          errc::invalid_argument,
          "initialize_cache needs num_device_blocks > 0 and num_swap_blocks >= 0, got " +
            std::to_string(blocks.num_device_blocks) + " and " +
            std::to_string(blocks.num_swap_blocks)));
        return rp;
      }
      st.log->info("# device blocks: {}, # CPU blocks: {}", blocks.num_device_blocks,
                   blocks.num_swap_blocks);
      auto concurrency = static_cast<double>(blocks.num_device_blocks) * st.cfg.block_size
                         / st.cfg.max_model_len;
      st.log->info("Maximum concurrency for {} tokens per request: {:.2f}x",
                   st.cfg.max_model_len, concurrency);
      call_all(self, rp, "initialize_cache", caf::make_message(blocks), no_result);
      return rp;
    },
    // add/remove/pin of adapters: true when every worker said true. The id is checked
    // first (vLLM asserts it; here it is an error).
    [=](all_true_atom, std::string method, caf::message args) {
      auto rp = self->make_response_promise();
      int64_t id = 0;
      if (args.match_elements<int64_t>())
        id = args.get_as<int64_t>(0);
      else if (args.match_elements<lora_request>())
        id = args.get_as<lora_request>(0).lora_int_id;
      else if (args.match_elements<prompt_adapter_request>())
        id = args.get_as<prompt_adapter_request>(0).prompt_adapter_id;
      if (id <= 0) {
        auto what = method.find("prompt_adapter") != std::string::npos ? "prompt_adapter_id"
                                                                        : "lora_id";
        rp.deliver(invalid_id(what, id));
        return rp;
      }
      call_all(self, rp, method, std::move(args), [method](std::vector<caf::message>& results) {
        bool all = true;
        for (size_t rank = 0; rank < results.size(); ++rank)
          all = result_as<bool>(results[rank], rank, method) && all;
        return caf::make_message(all);
      });
      return rp;
    },
    // list_loras / list_prompt_adapters: every worker must hold the same set.
    [=](same_set_atom, std::string method) {
      auto rp = self->make_response_promise();
      call_all(self, rp, method, {}, [method](std::vector<caf::message>& results) {
        auto first = result_as<std::vector<int64_t>>(results[0], 0, method);
        std::sort(first.begin(), first.end());
        std::string differing;
        for (size_t rank = 1; rank < results.size(); ++rank) {
          auto set = result_as<std::vector<int64_t>>(results[rank], rank, method);
          std::sort(set.begin(), set.end());
          if (set != first)
            differing += (differing.empty() ? "" : ", ") + std::to_string(rank);
        }
        if (!differing.empty())
          throw error{errc::inconsistent_workers,
                      method + ": rank(s) " + differing + " disagree with rank 0 (" +
                        to_string(caf::make_message(first)) + "); all workers should hold the same set"};
        return caf::make_message(std::move(first));
      });
      return rp;
    },
    [=](execute_atom, execute_model_request req) {
      auto rp = self->make_response_promise();
      auto& st = self->state;
      if (refuse_if_failed(self, rp))
        return rp;
      if (st.transition) {
        rp.deliver(caf::make_error(errc::sleeping,
                                   std::string{"execute_model while a sleep or wake_up is in "
                                               "progress"}));
        return rp;
      }
      if (st.sleep.is_sleeping()) {
        rp.deliver(caf::make_error(errc::sleeping,
                                   "execute_model while tags " + describe(st.sleep.sleeping_tags()) +
                                     " sleep; call wake_up first"));
        return rp;
      }
      if (st.loop_error) {
        auto err = std::move(st.loop_error);
        st.loop_error = caf::error{};
        rp.deliver(err);
        return rp;
      }
      start_loop(self);
      auto loop_id = st.loop_id;
      start_gather(self, "execute_model", {0},
                   caf::make_message(execute_atom::value, std::move(req)), st.cfg.rpc_timeout, 0,
                   [=](gather_result res) mutable {
                     if (res) {
                       rp.deliver(std::move((*res)[0]));
                     } else {
                       abandon_loop(self, loop_id);
                       rp.deliver(res.error());
                     }
                   });
      return rp;
    },
    [=](stop_loop_atom) {
      auto rp = self->make_response_promise();
      auto& st = self->state;
      if (refuse_if_failed(self, rp))
        return rp;
      if (!st.loop) {
        auto err = std::move(st.loop_error);
        st.loop_error = caf::error{};
        if (err)
          rp.deliver(err);
        else
          rp.deliver(caf::unit);
        return rp;
      }
      st.stop_waiters.push_back(rp);
      auto loop = st.loop;
      start_gather(self, "stop_remote_worker_execution_loop", {0},
                   caf::make_message(execute_atom::value, stop_loop_atom::value, st.loop_id),
                   st.cfg.rpc_timeout, 0, [=](gather_result res) {
                     // The driver could not pass the stop on: end the loop's tasks here,
                     // which also tells the peers to leave the loop.
                     if (!res)
                       finish(self, loop, res.error());
                   });
      return rp;
    },
    [=](sleep_atom, sleep_request asked) {
      auto level = asked.level;
      auto rp = self->make_response_promise();
      auto& st = self->state;
      if (refuse_if_failed(self, rp))
        return rp;
      if (st.transition) {
        rp.deliver(caf::make_error(errc::invalid_argument,
                                   std::string{"another sleep or wake_up is in progress"}));
        return rp;
      }
      auto verdict = st.sleep.check_sleep();
      if (!verdict.proceed) {
        st.log->warn("{}", verdict.warning);
        rp.deliver(caf::unit);
        return rp;
      }
      st.transition = true;
      auto start = clock_type::now();
      auto request = caf::make_message(call_atom::value, std::string{"sleep"},
                                       caf::make_message(asked), caf::settings{});
      start_gather(self, "sleep", all_ranks(self), std::move(request), st.cfg.rpc_timeout, 0,
                   [=](gather_result res) mutable {
                     auto& st = self->state;
                     st.transition = false;
                     // Even when some rank failed, others may be asleep: only wake_up may
                     // lead back to awake (waking an awake worker does nothing).
                     st.sleep.commit_sleep(level);
                     if (!res) {
                       st.log->error("sleep failed; call wake_up before the next step: {}",
                                     render(res.error()));
                       rp.deliver(res.error());
                       return;
                     }
                     std::chrono::duration<double> took = clock_type::now() - start;
                     st.log->info("It took {:.6f} seconds to fall asleep.", took.count());
                     rp.deliver(caf::unit);
                   });
      return rp;
    },
    [=](wake_atom, std::vector<std::string> tags) {
      auto rp = self->make_response_promise();
      auto& st = self->state;
      if (refuse_if_failed(self, rp))
        return rp;
      if (st.transition) {
        rp.deliver(caf::make_error(errc::invalid_argument,
                                   std::string{"another sleep or wake_up is in progress"}));
        return rp;
      }
      auto verdict = st.sleep.check_wake(tags);
      if (!verdict.proceed) {
        st.log->warn("{}", verdict.warning);
        rp.deliver(caf::unit);
        return rp;
      }
      st.transition = true;
      auto start = clock_type::now();
      auto woken = verdict.tags;
      auto request = caf::make_message(call_atom::value, std::string{"wake_up"},
                                       caf::make_message(wake_request{woken}), caf::settings{});
      start_gather(self, "wake_up", all_ranks(self), std::move(request), st.cfg.rpc_timeout, 0,
                   [=](gather_result res) mutable {
                     auto& st = self->state;
                     st.transition = false;
                     if (!res) {
                       // The tags still count as asleep; waking them again is harmless.
                       rp.deliver(res.error());
                       return;
                     }
                     st.sleep.commit_wake(woken);
                     std::chrono::duration<double> took = clock_type::now() - start;
                     st.log->info("It took {:.6f} seconds to wake up tags {}.", took.count(),
                                  describe(woken));
                     rp.deliver(caf::unit);
                   });
      return rp;
    },
    // The sleeping tags by name; empty when awake (vLLM's is_sleeping is "any tag sleeps").
    [=](sleep_state_atom) {
      std::vector<std::string> names;
      for (auto tag : self->state.sleep.sleeping_tags())
        names.emplace_back(to_string(tag));
      return names;
    },
    // check_health: every report in rank order, or an error naming the unhealthy ranks.
    [=](deadline_atom, int64_t at) { check_deadlines(self, at); },
    [=](health_atom) {
      auto rp = self->make_response_promise();
      const std::string method = "check_health";
      call_all(self, rp, method, {}, [method](std::vector<caf::message>& results) {
        std::vector<worker_health> reports;
        std::string unhealthy;
        for (size_t rank = 0; rank < results.size(); ++rank) {
          reports.push_back(result_as<worker_health>(results[rank], rank, method));
          if (!reports.back().healthy)
            unhealthy += (unhealthy.empty() ? "rank " : "; rank ") + std::to_string(rank) +
                         ": " + reports.back().detail;
        }
        if (!unhealthy.empty())
          throw error{errc::worker_error, "unhealthy workers: " + unhealthy};
        return caf::make_message(std::move(reports));
      });
      return rp;
    },
  };
}

} // namespace

caf::actor spawn_supervisor(caf::actor_system& sys, const executor_config& cfg,
                            std::vector<caf::actor> workers, std::vector<worker_place> places) {
  places.resize(workers.size());
  return sys.spawn(supervisor, cfg, std::move(workers), std::move(places));
}

} // namespace troupe
