#pragma once

/// @file
/// How host threads call an executor's supervisor: blocking within a deadline (awake for
/// a while for the reply, reading the call links meanwhile) or as futures; and the
/// shutdown that fails the calls in flight and those that come after it.

#include "actors/executor_system.hpp"
#include "actors/linger.hpp"
#include "actors/caller_unit.hpp"
#include "actors/cluster/link_client.hpp"
#include "actors/supervisor.hpp"
#include "messages/protocols.hpp"
#include "troupe/errors.hpp"

#include <caf/all.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <utility>

namespace troupe {

/// The facade waits a little longer than the supervisor, which enforces the real deadline
/// and reports it with context.
constexpr auto facade_grace = std::chrono::seconds(5);

/// What a call of an executor that is shut down fails with.
inline error shut_down_error() {
  return error{errc::shut_down, "executor is shut down"};
}

/// The exception for a call's error: a supervisor gone after shutdown means `shut_down`.
inline error translated(const caf::error& err, bool shut) {
  if (shut && err == caf::sec::request_receiver_down)
    return shut_down_error();
  return error::from(err);
}

/// The promise behind the future of an async call. One that is dropped unanswered (its
/// call never reached the supervisor: the executor shut down) fails with `shut_down`
/// instead of leaving the future broken.
template <class T>
class async_slot {
public:
  std::future<T> future() {
    return p_.get_future();
  }
  template <class... Us>
  void set(Us&&... xs) {
    if (!std::exchange(done_, true))
      p_.set_value(std::forward<Us>(xs)...);
  }
  void fail(const error& e) {
    if (!std::exchange(done_, true))
      p_.set_exception(std::make_exception_ptr(e));
  }
  ~async_slot() {
    fail(shut_down_error());
  }

private:
  std::promise<T> p_;
  bool done_ = false;
};

/// Handler type that receives a reply of type T (nothing for void).
template <class T>
struct reply {
  template <class P>
  static auto async_handler(P slot) {
    return [slot](T& x) { slot->set(std::move(x)); };
  }
};

/// A call whose answer, of type H, only says that it succeeded: its future is `void`.
template <class H>
struct discarded {};

template <class H>
struct reply<discarded<H>> {
  template <class P>
  static auto async_handler(P slot) {
    return [slot](H&) { slot->set(); };
  }
};

/// Calls with nothing to return are answered `ok_atom`.
template <>
struct reply<void> {
  template <class P>
  static auto async_handler(P slot) {
    return [slot](caf::ok_atom) { slot->set(); };
  }
};

/// One executor's calls of its supervisor, from any host thread.
class supervisor_client {
public:
  /// Calls of `actors`' supervisor; `reads_links`: whether the workers of some calls are
  /// on nodes, whose call links a blocking caller reads while it waits; `default_timeout`:
  /// the deadline of `ask_async`.
  supervisor_client(executor_system& actors, bool reads_links, timeout_type default_timeout)
    : actors_(actors), reads_links_(reads_links), default_timeout_(default_timeout) {}

  /// The exception for a call's error (`shut_down` for a supervisor gone after shutdown).
  error translate(const caf::error& err) const {
    return translated(err, *shut_);
  }

  /// Throws `shut_down` once the executor is.
  void check_open() const {
    if (*shut_)
      throw shut_down_error();
  }

  /// Holds the system open for a call of the caller's own (shutdown waits for it to end);
  /// throws `shut_down` once the executor is.
  std::shared_lock<std::shared_mutex> hold_open() {
    std::shared_lock<std::shared_mutex> guard{lifecycle_};
    check_open();
    return guard;
  }

  /// Shutdown: the supervisor stops first (calls in flight fail), later calls find the
  /// executor shut, then every actor stops (`executor_system::stop`). Once only.
  void close() {
    if (shut_->exchange(true))
      return;
    {
      std::shared_lock<std::shared_mutex> guard{lifecycle_};
      if (auto& supervisor = actors_.supervisor())
        caf::anon_send_exit(supervisor, caf::exit_reason::user_shutdown);
    }
    std::unique_lock<std::shared_mutex> guard{lifecycle_};
    actors_.stop();
  }

  /// Sends a request to the supervisor and blocks for the reply (see `send`). The facade
  /// waits a grace longer than the deadline, which the supervisor enforces and reports.
  template <class T, class... Ts>
  T ask(timeout_type t, Ts&&... xs) {
    auto open = hold_open();
    auto reading = read_links();
    return wait_for(t, send<T>(t, std::forward<Ts>(xs)...), std::move(reading));
  }

  /// `ask` for a call made through `supervisor_access` (see `send_direct`).
  template <class T, class Make>
  T ask_direct(timeout_type t, Make make) {
    auto open = hold_open();
    auto reading = read_links();
    return wait_for(t, send_direct<T>(t, std::move(make)), std::move(reading));
  }

  /// `send_direct` for the async API: a closed executor's future fails with `shut_down`.
  template <class T, class Make>
  std::future<T> ask_async_direct(timeout_type t, Make make) {
    return if_open<T>([&] { return send_direct<T>(t, std::move(make)); });
  }

  /// What `send` gives, or for a closed executor a future that fails with `shut_down`.
  template <class T, class Send>
  std::future<T> if_open(Send send) {
    std::shared_lock<std::shared_mutex> guard{lifecycle_};
    if (*shut_) {
      async_slot<T> closed;
      return closed.future(); // fails with shut_down as `closed` goes
    }
    return send();
  }

  /// `send` for the async API, for a call whose deadline is `t`: a closed executor's
  /// future fails with `shut_down`.
  template <class T, class Reply = T, class... Ts>
  std::future<T> ask_async_within(timeout_type t, Ts... xs) {
    return if_open<T>([&] { return send<T, Reply>(t, std::move(xs)...); });
  }

  /// `ask_async_within` the default deadline.
  template <class T, class Reply = T, class... Ts>
  std::future<T> ask_async(Ts... xs) {
    return ask_async_within<T, Reply>(default_timeout_, std::move(xs)...);
  }

private:
  /// With call links, a caller reads them itself while it lingers for its reply, which
  /// then reaches it without a hand-off from the link's thread; it says so before its
  /// request goes, so that the link's thread is not woken for the reply.
  std::optional<link_set::helping> read_links() {
    if (!reads_links_ || actors_.caller_linger() <= timeout_type::zero())
      return std::nullopt;
    return actors_.links()->help();
  }

  /// The answer of a call whose deadline is `t`.
  template <class T>
  T wait_for(timeout_type t, std::future<T> fut, std::optional<link_set::helping> reading) {
    // Past a year a deadline is as good as none (and the clock arithmetic would overflow).
    bool bounded = t != wait_forever && t < std::chrono::hours(24 * 365);
    // A reply that comes within the caller's linger finds this thread awake.
    auto linger = actors_.caller_linger();
    auto ready = [&] { return fut.wait_for(timeout_type::zero()) == std::future_status::ready; };
    if (!reading)
      linger_for(linger, ready);
    else
      linger_for(linger, [&] {
        actors_.links()->pump();
        return ready();
      });
    reading.reset();
    if (bounded && fut.wait_for(t + facade_grace) == std::future_status::timeout)
      throw translate(caf::sec::request_timeout);
    return fut.get();
  }

  using fail_fn = std::function<void(const caf::error&)>;

  /// Hands a call to the supervisor, which makes its request to itself and fills the
  /// future with the reply. Calls made one after another (from one thread, or ordered by
  /// the host) reach the supervisor in that order, which lets a caller queue the next step
  /// behind the one in flight. A call that the supervisor drops unanswered (it shut_ down)
  /// fails with `shut_down`; one that waits for a replacement longer than `timeout` fails
  /// with `timeout`. The caller holds `lifecycle_` and has checked `shut_`.
  template <class T, class Reply = T, class... Ts>
  std::future<T> send(timeout_type timeout, Ts... xs) {
    return hand_over<T>(timeout, [&](std::shared_ptr<async_slot<T>> slot, fail_fn fail) {
      return [=](supervisor_access& access) mutable {
        auto me = caf::actor_cast<supervisor_actor>(access.self);
        access.self->request(me, access.request_timeout(), std::move(xs)...)
          .then(reply<Reply>::async_handler(slot), [fail](caf::error& e) { fail(e); });
      };
    });
  }

  /// `send` for a call that `make(access, reply)` makes through `supervisor_access`: its
  /// answer reaches the future straight from the thread that finishes the call, usually
  /// the last worker to reply, without a hop through the supervisor.
  template <class T, class Make>
  std::future<T> send_direct(timeout_type timeout, Make make) {
    return hand_over<T>(timeout, [&](std::shared_ptr<async_slot<T>> slot, fail_fn fail) {
      auto closed = shut_;
      reply_to<T> reply = [slot, closed](caf::expected<T> res) {
        if (!res)
          slot->fail(translated(res.error(), *closed));
        else if constexpr (std::is_void_v<T>)
          slot->set();
        else
          slot->set(std::move(*res));
      };
      return [make = std::move(make), reply, fail](supervisor_access& access) mutable {
        // Made behind what the supervisor's mailbox holds, as the requests to itself of
        // the calls before it are: calls from one thread reach the workers in order. With
        // nothing there, nothing can be overtaken: it is made at once.
        if (access.self->mailbox().empty()) {
          make(access, reply);
          return;
        }
        async_call made;
        made.admitted = true;
        made.request = [make = std::move(make), reply,
                        left = access.left](supervisor_access& now) mutable {
          now.left = left;
          make(now, reply);
        };
        made.fail = fail;
        access.self->send(caf::actor_cast<supervisor_actor>(access.self), std::move(made));
      };
    });
  }

  /// Hands the supervisor a call whose request `make_request(slot, fail)` makes; the
  /// future is the slot's. `fail` fails the slot with a translated error.
  template <class T, class MakeRequest>
  std::future<T> hand_over(timeout_type timeout, MakeRequest make_request) {
    auto slot = std::make_shared<async_slot<T>>();
    auto fut = slot->future();
    auto closed = shut_;
    fail_fn fail = [slot, closed](const caf::error& e) { slot->fail(translated(e, *closed)); };
    async_call call;
    call.request = make_request(slot, fail);
    call.fail = fail;
    call.timeout = timeout;
    hand_to_supervisor(actors_.system(), actors_.supervisor(), std::move(call));
    return fut;
  }

  executor_system& actors_;
  bool reads_links_;
  timeout_type default_timeout_;
  /// Shared with the helpers of async calls, which may outlive the facade.
  std::shared_ptr<std::atomic<bool>> shut_ = std::make_shared<std::atomic<bool>>(false);
  /// Calls hold it shared while they use the system; shutdown takes it exclusively
  /// (after telling the supervisor to stop, which makes calls in flight return) before it
  /// tears the system down.
  std::shared_mutex lifecycle_;
};

} // namespace troupe
