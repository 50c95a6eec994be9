#include "actors/worker_actor.hpp"

#include "actors/worker_calls.hpp"

#include "actors/linger.hpp"
#include "kernels/log.hpp"
#include "messages/protocols.hpp"
#include "troupe/errors.hpp"

#include <caf/all.hpp>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <set>
#include <unordered_map>

namespace troupe {

namespace {

/// What the death of a group member reaches, from whichever thread reports it: the
/// worker object while it lives.
struct collective_watch {
  std::mutex mtx;
  worker* obj = nullptr;

  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lk{mtx};
    if (obj != nullptr)
      obj->abort_collective(why);
  }

  void set(worker* w) {
    std::lock_guard<std::mutex> lk{mtx};
    obj = w;
  }
};

struct worker_actor_state {
  worker_actor_state() = default;
  worker_actor_state(const worker_actor_state&) = delete;
  worker_actor_state& operator=(const worker_actor_state&) = delete;
  ~worker_actor_state() {
    watch->set(nullptr); // before `obj` goes
  }

  worker_factory factory;
  std::unique_ptr<worker> obj;
  std::shared_ptr<collective_watch> watch = std::make_shared<collective_watch>();
  /// Group members whose death aborts this worker's collective.
  std::set<caf::actor_addr> watched;
  std::vector<worker_actor> peers;
  int32_t rank = -1;
  /// The parallel worker task of vLLM: answered when the execution loop stops.
  caf::typed_response_promise<caf::ok_atom, int64_t> loop_task;
  /// Id of the running loop; 0 when none runs.
  int64_t loop_id = 0;
  /// The highest loop id this worker has heard of (started or stopped).
  int64_t newest_loop = 0;
  /// Stops that overtook their loop's start (they travel different paths); such a loop
  /// ends as soon as it starts.
  std::set<int64_t> early_stops;
  int64_t loop_steps = 0;
  /// The driver's samples of its last step, by sequence: what a `pending_token` stands for.
  std::unordered_map<int64_t, int32_t> last_samples;
  /// Nodes whose messages a node-hosted worker serves: the executor's that leased it, and
  /// those of its peers once init names them. Empty: any sender (in-process workers).
  std::set<caf::node_id> allowed;
  /// The device and collective address its node chose (leased workers only).
  std::optional<node_placement> placement;
  /// How long it waits for the next message after a call (`worker_context::linger_us`).
  std::chrono::microseconds linger{0};
  /// A `linger_atom` waits in the mailbox.
  bool linger_queued = false;
  /// A leased worker's part in reading its node's call links as it lingers.
  std::shared_ptr<linger_reader> reader;
  std::shared_ptr<spdlog::logger> log = get_logger("troupe.worker");

  static inline const char* name = "troupe.worker";
};

using worker_self = worker_actor::stateful_pointer<worker_actor_state>;

/// Has the worker wait for the next message once this call is answered (see
/// `executor_config::linger`): a message to itself, handled after the reply left.
void linger_after(worker_self self) {
  auto& st = self->state;
  if (st.linger.count() > 0 && !st.linger_queued) {
    st.linger_queued = true;
    self->send(self, linger_atom::value);
  }
}

/// Waits until a message arrives or the linger time is up. A message that arrives meanwhile
/// finds the thread awake (its sender wakes nobody); the thread yields its core to any
/// other thread that is ready to run. A leased worker reads its node's call links
/// meanwhile, and lingers again after what it read, so that it goes on reading them until
/// a linger runs out (or a message comes otherwise).
void linger(worker_self self) {
  auto& st = self->state;
  st.linger_queued = false;
  if (!st.reader) {
    linger_for(st.linger, [&] { return !self->mailbox().empty(); });
    return;
  }
  st.reader->reading(true);
  bool read = false;
  if (linger_for(st.linger,
                 [&] {
                   read = st.reader->pump() || read;
                   return !self->mailbox().empty();
                 }) &&
      read)
    linger_after(self);
  else
    st.reader->reading(false);
}

caf::error not_initialised() {
  return caf::make_error(errc::unsupported, std::string{"worker actor is not initialised"});
}

/// Whether the exception being handled is a `worker_fault`: the worker cannot go on.
bool fault_in_flight() {
  try {
    throw;
  } catch (const worker_fault&) {
    return true;
  } catch (...) {
    return false;
  }
}

/// The error of the exception being handled, logged; a worker that threw `worker_fault`
/// stops with it after this message, without answering it: the executor learns of the
/// death from its monitor, which fails (or, under a restart policy, repeats) the call.
caf::error failed(worker_self self, const std::string& method) {
  auto& st = self->state;
  auto err = worker_failure(st.rank, method);
  st.log->warn("{}", render(err));
  if (fault_in_flight())
    self->quit(err);
  return err;
}

/// Runs `f` on the worker object and wraps its result (none for an empty `Ts`) or
/// exception into the reply.
template <class... Ts, class F>
caf::result<caf::ok_atom, Ts...> guarded_with(worker_self self, const std::string& method, F&& f) {
  auto& st = self->state;
  if (!st.obj)
    return not_initialised();
  try {
    if constexpr (sizeof...(Ts) == 0) {
      f(*st.obj);
      return caf::ok_atom::value;
    } else {
      return {caf::ok_atom::value, f(*st.obj)};
    }
  } catch (...) {
    bool fault = fault_in_flight();
    auto err = failed(self, method);
    if (fault)
      return caf::delegated<caf::ok_atom, Ts...>{}; // no answer: its death fails the call
    return err;
  }
}

template <class F>
caf::result<caf::ok_atom, caf::message> guarded(worker_self self, const std::string& method,
                                                F&& f) {
  return guarded_with<caf::message>(self, method, std::forward<F>(f));
}

/// Whether the current message comes from a node this worker does not serve; logs it.
bool refused(worker_self self) {
  auto& st = self->state;
  if (st.allowed.empty())
    return false;
  auto& sender = self->current_sender();
  if (sender && st.allowed.count(sender->node()) > 0)
    return false;
  st.log->warn("rank {}: refused a message from {}, which is not its executor's", st.rank,
               sender ? to_string(sender->node()) : std::string{"an anonymous sender"});
  return true;
}

caf::error refusal() {
  return caf::make_error(errc::invalid_argument,
                         std::string{"this worker serves only the executor that leased it"});
}

/// The handler of a library call (`messages/worker_calls.hpp`): runs what the named
/// built-in of its method runs, timed as a call of that method, and answers its reply.
template <class Call>
auto on_call(worker_self self) {
  using reply = typename call_traits<Call>::reply;
  auto run = [self](const Call& call) {
    auto method = method_name(call);
    if constexpr (std::is_void_v<reply>) {
      return guarded_with<>(self, method, [&](worker& w) {
        w.call_local(method, [&](worker& ref) {
          run_call(ref, call);
          return caf::message{};
        });
      });
    } else {
      return guarded_with<reply>(self, method, [&](worker& w) {
        reply out;
        w.call_local(method, [&](worker& ref) {
          out = run_call(ref, call);
          return caf::message{};
        });
        return out;
      });
    }
  };
  return [self, run](call_atom, const Call& call) -> decltype(run(call)) {
    if (refused(self))
      return refusal();
    linger_after(self);
    return run(call);
  };
}

/// Puts the driver's last samples in for the pending tokens of `req`; an error names a
/// sequence whose token cannot be known.
caf::error fill_pending_tokens(execute_model_request& req,
                               const std::unordered_map<int64_t, int32_t>& last) {
  // Only a last token may be pending; one elsewhere is refused by the model as a token
  // outside the vocabulary.
  for (auto& g : req.seq_group_metadata_list)
    for (auto& seq : g.seqs) {
      if (seq.token_ids.empty() || seq.token_ids.back() != pending_token)
        continue;
      auto sample = last.find(seq.seq_id);
      if (sample == last.end())
        return caf::make_error(errc::invalid_argument,
                               "sequence " + std::to_string(seq.seq_id) + " of '" + g.request_id +
                                 "' has a pending last token, but the driver's "
                                 "previous step sampled none for it");
      seq.token_ids.back() = sample->second;
    }
  return caf::none;
}

void remember_samples(std::unordered_map<int64_t, int32_t>& last,
                      const std::vector<sampler_output>& outputs) {
  last.clear();
  for (auto& out : outputs)
    for (auto& group : out.outputs)
      for (auto& sample : group.samples)
        last[sample.parent_seq_id] = sample.output_token;
}

void end_loop(worker_self self, caf::error err) {
  auto& st = self->state;
  if (st.loop_id == 0)
    return;
  st.loop_id = 0;
  if (err)
    st.loop_task.deliver(std::move(err));
  else
    st.loop_task.deliver(caf::ok_atom::value, st.loop_steps);
  // A delivered promise still holds the requester; let it go.
  st.loop_task = {};
}

/// The driver's peers, which get its steps; a leased worker takes exit messages from
/// their nodes too.
void take_peers(worker_self self, worker_handles peers) {
  auto& st = self->state;
  if (!st.allowed.empty())
    for (auto& peer : peers.ranks)
      st.allowed.insert(peer.node());
  st.peers = std::move(peers.ranks);
}

worker_actor::behavior_type worker_behavior(worker_self self, worker_factory factory,
                                            std::optional<caf::node_id> owner,
                                            std::optional<node_placement> placement,
                                            std::shared_ptr<linger_reader> reader) {
  self->state.factory = std::move(factory);
  self->state.placement = std::move(placement);
  self->state.reader = std::move(reader);
  if (owner) {
    // Its own node (the node daemon releasing it) and its executor's.
    self->state.allowed.insert(self->node());
    self->state.allowed.insert(*owner);
    self->set_exit_handler([=](caf::exit_msg& msg) {
      if (self->state.allowed.count(msg.source.node()) > 0) {
        self->quit(msg.reason);
        return;
      }
      self->state.log->warn("rank {}: ignored an exit message from {}", self->state.rank,
                            to_string(msg.source.node()));
    });
  }
  return {
    [=](init_atom, worker_context ctx,
        worker_handles& peers) -> caf::result<caf::ok_atom, worker_info> {
      auto& st = self->state;
      if (refused(self))
        return refusal();
      if (st.obj)
        return caf::make_error(errc::invalid_argument,
                               "rank " + std::to_string(st.rank) + ": worker already initialised");
      st.rank = ctx.rank;
      st.linger = std::clamp(timeout_type{ctx.linger_us}, timeout_type::zero(), max_linger);
      take_peers(self, std::move(peers));
      if (st.placement) {
        ctx.device_type = st.placement->device_type;
        ctx.device_index = st.placement->device_index;
        if (!st.placement->collective_host.empty())
          ctx.collective_host = st.placement->collective_host;
      }
      try {
        st.obj = st.factory(ctx.rank);
        if (!st.obj)
          throw error{errc::invalid_argument, "worker factory returned no worker"};
        st.obj->init_device(ctx);
        st.obj->load_model();
      } catch (...) {
        st.obj.reset();
        return worker_failure(ctx.rank, "init");
      }
      st.watch->set(st.obj.get());
      auto info = st.obj->info();
      st.log->debug("rank {} ready on {} (pid {})", info.rank, info.device, info.pid);
      return {caf::ok_atom::value, std::move(info)};
    },
    [=](call_atom, const std::string& method, const caf::message& args,
        const caf::settings& kwargs) -> caf::result<caf::ok_atom, caf::message> {
      if (refused(self))
        return refusal();
      linger_after(self);
      return guarded(self, method, [&](worker& w) { return w.call(method, args, kwargs); });
    },
    [=](loop_atom, int64_t id) -> caf::result<caf::ok_atom, int64_t> {
      auto& st = self->state;
      if (refused(self))
        return refusal();
      if (!st.obj)
        return not_initialised();
      if (id <= 0)
        return caf::make_error(errc::bad_arguments,
                               std::string{"an execution loop needs an id > 0, got "} +
                                 std::to_string(id));
      st.newest_loop = std::max(st.newest_loop, id);
      if (st.early_stops.erase(id) > 0)
        return {caf::ok_atom::value, int64_t{0}};
      if (st.loop_id != 0)
        end_loop(self, caf::make_error(errc::worker_error,
                                       "rank " + std::to_string(st.rank) + ": execution loop " +
                                         std::to_string(st.loop_id) + " superseded by loop " +
                                         std::to_string(id)));
      st.loop_id = id;
      st.loop_steps = 0;
      st.loop_task = self->make_response_promise<caf::ok_atom, int64_t>();
      return st.loop_task;
    },
    [=](call_atom, const local_call& call) -> caf::result<caf::ok_atom, caf::message> {
      if (refused(self))
        return refusal();
      return guarded(self, call.label, [&](worker& w) {
        std::shared_lock<std::shared_mutex> running;
        if (call.guard) {
          running = std::shared_lock<std::shared_mutex>{call.guard->mtx};
          if (call.guard->cancelled)
            throw error{errc::timeout, "callable '" + call.label + "' abandoned by its caller"};
        }
        return w.call_local(call.label,
                            [&](worker& ref) { return call.fn(ref, call.args, call.kwargs); });
      });
    },
    [=](execute_atom, execute_model_request& req) -> caf::result<caf::ok_atom, caf::message> {
      if (refused(self))
        return refusal();
      linger_after(self);
      auto& st = self->state;
      // The peers get the step with its tokens filled in.
      if (auto err = fill_pending_tokens(req, st.last_samples)) {
        st.last_samples.clear();
        return err;
      }
      for (auto& peer : st.peers)
        self->send(peer, step_atom::value, req);
      st.last_samples.clear();
      return guarded(self, "execute_model", [&](worker& w) {
        return w.call_local("execute_model", [&](worker& ref) {
          auto out = ref.run_step(req);
          remember_samples(st.last_samples, out);
          return caf::make_message(std::move(out));
        });
      });
    },
    [=](execute_atom, stop_loop_atom, int64_t loop_id) -> caf::result<caf::ok_atom> {
      if (refused(self))
        return refusal();
      for (auto& peer : self->state.peers)
        self->send(peer, step_atom::value, stop_loop_atom::value, loop_id);
      return caf::ok_atom::value;
    },
    [=](step_atom, const execute_model_request& req) {
      auto& st = self->state;
      if (refused(self) || !st.obj)
        return;
      try {
        st.obj->call_local("execute_model", [&](worker& w) {
          w.run_step(req);
          return caf::message{};
        });
        ++st.loop_steps;
      } catch (...) {
        bool fault = fault_in_flight();
        auto err = failed(self, "execute_model (execution loop)");
        if (!fault) // a worker that stops leaves its loop by dying
          end_loop(self, std::move(err));
      }
    },
    [=](linger_atom) { linger(self); },
    [=](peers_atom, worker_handles& peers) -> caf::result<caf::ok_atom> {
      if (refused(self))
        return refusal();
      take_peers(self, std::move(peers));
      return caf::ok_atom::value;
    },
    [=](group_atom, const worker_handles& members) -> caf::result<caf::ok_atom> {
      auto& st = self->state;
      if (refused(self))
        return refusal();
      for (size_t rank = 0; rank < members.ranks.size(); ++rank) {
        auto& member = members.ranks[rank];
        if (!member || member.address() == self->address() ||
            !st.watched.insert(member.address()).second)
          continue;
        // Runs on the thread that learns of the death (the member's own, or the network's
        // for a member on another node), while this worker may wait in a reduction.
        std::weak_ptr<collective_watch> watch = st.watch;
        member->attach_functor([watch, rank](const caf::error& reason) {
          if (auto w = watch.lock())
            w->abort("rank " + std::to_string(rank) + " went down (" + render(reason) + ")");
        });
      }
      return caf::ok_atom::value;
    },
    [=](step_atom, stop_loop_atom, int64_t loop_id) {
      auto& st = self->state;
      if (refused(self))
        return;
      if (st.loop_id == loop_id)
        end_loop(self, caf::none);
      else if (loop_id > st.newest_loop)
        st.early_stops.insert(loop_id);
      // Otherwise the loop already ended (by an error): nothing to do.
      st.newest_loop = std::max(st.newest_loop, loop_id);
    },
    // The library's calls, after the handlers of every step and named call: a message is
    // matched against the handlers in order, and these are rare.
    on_call<blocks_query>(self), on_call<cache_init>(self), on_call<health_query>(self),
    on_call<collective_prepare>(self), on_call<collective_connect>(self),
    on_call<sleep_request>(self), on_call<wake_request>(self), on_call<staged_save>(self),
    on_call<staged_finish>(self), on_call<adapter_request>(self), on_call<adapter_change>(self),
    on_call<adapter_list>(self), on_call<adapter_tokens>(self)};
}

} // namespace

worker_actor spawn_worker(caf::actor_system& sys, worker_factory factory) {
  return sys.spawn<caf::detached>(worker_behavior, std::move(factory),
                                  std::optional<caf::node_id>{}, std::optional<node_placement>{},
                                  std::shared_ptr<linger_reader>{});
}

worker_actor spawn_leased_worker(caf::actor_system& sys, worker_factory factory, caf::node_id owner,
                                 node_placement placement, std::shared_ptr<linger_reader> reader) {
  return sys.spawn<caf::detached>(
    worker_behavior, std::move(factory), std::optional<caf::node_id>{std::move(owner)},
    std::optional<node_placement>{std::move(placement)}, std::move(reader));
}

caf::error worker_failure(int32_t rank, const std::string& method) {
  auto where = "rank " + std::to_string(rank) + ", " + method + ": ";
  try {
    throw;
  } catch (const error& e) {
    // Keep the worker's own code (unknown_method, invalid_argument, ...).
    return caf::make_error(e.code(), where + e.what());
  } catch (const std::exception& e) {
    return caf::make_error(errc::worker_error, where + e.what());
  } catch (...) {
    return caf::make_error(errc::worker_error, where + "unknown exception");
  }
}

} // namespace troupe
