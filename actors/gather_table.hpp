#pragma once

/// @file
/// The supervisor's scatter-gather: the collective calls in flight to the workers, their
/// deadlines, and how each ends. A gather sends one request to each of its ranks and ends
/// once, with every reply in rank order or with the first error (named after the rank).
/// Two transports: an ordinary gather asks each worker from the supervisor's own thread and
/// takes the replies there; a direct one (`start_direct`) hands its replies to the
/// `reply_sink`, which ends the call on the last worker's thread, while the table still
/// watches its deadline and takes its errors.

#include "actors/reply_sink.hpp"
#include "messages/protocols.hpp"
#include "troupe/config.hpp"
#include "troupe/errors.hpp"

#include <caf/typed_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace troupe {

/// How a gather asks one worker: sends it the request, then hands on its reply or error.
using reply_fn = std::function<void(caf::ok_atom, caf::message&)>;
using error_fn = std::function<void(caf::error&)>;
using ask_fn =
  std::function<void(supervisor_actor::pointer, const worker_actor&, reply_fn, error_fn)>;

namespace detail {

/// Hands a worker's reply `(ok_atom, rs...)` on as the message of `rs...` (a reply that is
/// a message already, a named method's, as it is).
template <class Reply>
struct hand_on;

template <class... Rs>
struct hand_on<caf::detail::type_list<caf::ok_atom, Rs...>> {
  static auto to(reply_fn ok) {
    return [ok = std::move(ok)](caf::ok_atom, Rs&... rs) {
      auto m = caf::make_message(std::move(rs)...);
      ok(caf::ok_atom::value, m);
    };
  }
};

template <>
struct hand_on<caf::detail::type_list<caf::ok_atom, caf::message>> {
  static reply_fn to(reply_fn ok) {
    return ok;
  }
};

} // namespace detail

/// The request `xs...` as a gather sends it to each worker, checked against the worker's
/// interface; its reply is handed on as a message of what follows the `ok_atom`. No CAF
/// timeout: the gather's deadline covers it.
template <class... Ts>
ask_fn asking(Ts... xs) {
  using reply =
    caf::response_type_unbox_t<caf::signatures_of_t<worker_actor>, caf::detail::type_list<Ts...>>;
  return [=](supervisor_actor::pointer self, const worker_actor& w, reply_fn ok, error_fn fail) {
    self->request(w, caf::infinite, xs...)
      .then(detail::hand_on<reply>::to(std::move(ok)), std::move(fail));
  };
}

/// A call of the library's own (`messages/worker_calls.hpp`) as a gather's request.
template <class Call>
ask_fn typed_call(Call call) {
  return asking(call_atom::value, std::move(call));
}

/// A named method of the workers, as a gather's request (users' methods; the library's
/// own go as `typed_call`s).
ask_fn calling(std::string method, caf::message args = {}, caf::settings kwargs = {});

/// The request `xs...` as a message for a direct gather, checked against the worker's
/// interface as `asking` is.
template <class... Ts>
caf::message worker_request(Ts&&... xs) {
  using token =
    caf::detail::type_list<typename caf::detail::implicit_conversions<std::decay_t<Ts>>::type...>;
  static_assert(caf::response_type_unbox<caf::signatures_of_t<worker_actor>, token>::valid,
                "a worker does not accept this request");
  return caf::make_message(std::forward<Ts>(xs)...);
}

/// "12 ms", or "0.250 ms" below a whole millisecond.
std::string ms_text(timeout_type t);

/// One collective call in flight: the request, who still owes a reply, what came back.
struct gather {
  using clock_type = std::chrono::steady_clock;

  uint64_t id = 0;
  std::string label;
  std::vector<int32_t> ranks;
  ask_fn ask;
  /// When set, the request for `ranks[i]` (instead of `ask` for all).
  std::vector<ask_fn> per_rank;
  /// A direct gather's: the request sent to every rank, and what its sink shares.
  caf::message request;
  std::shared_ptr<direct_reply> direct;
  /// The table took the direct gather from its sink (see `gather_table::claim`).
  bool claimed = false;
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
  /// Under a restart policy, an error saying that a worker is gone, held until `settle_at`
  /// for the death to be reported: the call then fails with `worker_replaced`.
  caf::error held;
  clock_type::time_point settle_at;
};

using gather_ptr = std::shared_ptr<gather>;

/// The reply of `rank` as a `T`; throws a `bad_arguments` error naming the rank and
/// method when it is something else.
template <class T>
const T& result_as(const caf::message& msg, size_t rank, const std::string& method) {
  if (msg.size() != 1 || !msg.match_element<T>(0))
    throw error{errc::bad_arguments, method + ": rank " + std::to_string(rank) + " returned (" +
                                       to_string(msg) + "), not the expected type"};
  return msg.get_as<T>(0);
}

/// What the gathers need to know of the supervisor.
class gather_host {
public:
  virtual ~gather_host() = default;

  /// Why `g` fails before it is sent (the executor failed, or one of its ranks is a dead
  /// worker awaiting its replacement, which would never answer); none: it goes.
  virtual caf::error refusal(const gather& g) = 0;

  /// The actor that takes `rank`'s requests: its worker, or the stub of its call link.
  virtual worker_actor target(size_t rank) const = 0;

  /// Whether a dead worker is replaced (a restart policy): a call that found its worker
  /// gone then waits for the death's report, which decides how it fails.
  virtual bool replaces_workers() const = 0;

  /// While a dead worker is being replaced: what a call whose work it lost fails with.
  /// None otherwise.
  virtual caf::error work_lost() const = 0;
};

/// The calls in flight, by id, and one timer for all their deadlines.
class gather_table {
public:
  using clock_type = std::chrono::steady_clock;

  gather_table(supervisor_actor::pointer self, gather_host& host, reply_sink& sink)
    : self_(self), host_(host), sink_(sink) {}

  /// Scatters `ask` (or `per_rank[i]` to `ranks[i]`) to `ranks`, at most `max_concurrent`
  /// at a time (0: all), and calls `done` once with every reply (in the order of `ranks`)
  /// or with the first error; `timeout` bounds the whole call (`wait_forever`: none).
  gather_ptr start(std::string label, std::vector<int32_t> ranks, ask_fn ask, timeout_type timeout,
                   size_t max_concurrent, std::function<void(gather_result)> done,
                   std::vector<ask_fn> per_rank = {});

  /// Scatters `request` to `ranks`, whose replies go to the sink: `done` is called once,
  /// from the last worker's thread with every reply, or from the supervisor's with the
  /// first error. Its success must therefore touch no state of the supervisor.
  gather_ptr start_direct(std::string label, std::vector<int32_t> ranks, caf::message request,
                          timeout_type timeout, std::function<void(gather_result)> done);

  /// Ends `g` with `result`, unless it has ended.
  void finish(const gather_ptr& g, gather_result result);

  /// Rank `ranks[index]` of `g` answered `err`.
  void rank_failed(const gather_ptr& g, size_t index, const caf::error& err);

  /// The sink passed on the error of rank `index` of direct gather `id`.
  void direct_failed(uint64_t id, uint64_t index, const caf::error& err);

  /// Ends every call in flight with `why`.
  void fail_all(const caf::error& why);

  /// Whether a call labelled `label` is in flight and now the table's to end (a direct
  /// gather that its last worker has not ended already).
  bool claim_any(const std::string& label);

  /// Makes sure a deadline check (`deadline_atom`) reaches the supervisor by `at`. One
  /// timer for every deadline: a CAF 0.17 request timeout stays in the actor clock,
  /// holding a reference to its sender, until it fires, even when the reply came long
  /// before, so one per request grows memory with the call rate.
  void arm_deadline(clock_type::time_point at);

  /// The timer set for `at` fired: ends the held calls whose settle time passed and fails
  /// those whose deadline passed, naming the first rank that did not answer; arms the
  /// timer for the next deadline.
  void check_deadlines(int64_t at);

private:
  gather_ptr launch(std::string label, std::vector<int32_t> ranks, ask_fn ask, timeout_type timeout,
                    size_t max_concurrent, std::function<void(gather_result)> done,
                    std::vector<ask_fn> per_rank, caf::message request);
  void send_next(const gather_ptr& g);
  /// Keeps `g` pending with `why` for `settle_time`: a request found its worker gone, and
  /// the death that will follow decides how the call fails.
  void hold(const gather_ptr& g, caf::error why);
  /// Hands `g` its result: to `done`, or, for a direct gather, to the sink's `done` unless
  /// the sink already finished it (the sink then forgets the replies still owed).
  void conclude(gather& g, gather_result result);
  /// Drops the direct gathers that their last worker finished.
  void sweep();

  supervisor_actor::pointer self_;
  gather_host& host_;
  reply_sink& sink_;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, gather_ptr> pending_;
  /// The deadline timer in flight that fires first, if any.
  bool timer_armed_ = false;
  clock_type::time_point timer_at_;
};

} // namespace troupe
