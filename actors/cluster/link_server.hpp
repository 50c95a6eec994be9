#pragma once

/// @file
/// The node's end of a call link (`actors/cluster/link_socket.hpp`): a link's server, and
/// the leased workers that read the links while they linger.

#include "actors/cluster/link_socket.hpp"
#include "actors/worker_actor.hpp"
#include "troupe/config.hpp"

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

#include <spdlog/logger.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace troupe {

class link_server;

/// A node's call links and the leased workers that read them. A worker that lingers after
/// a call (`executor_config::linger`) reads the links itself (`pump`): a request for it
/// then reaches its mailbox without a hand-off from a link's thread, and that thread,
/// which would take a core from the worker, sleeps. It sleeps only while every leased worker
/// reads (is lingering, or handling what came while it lingered, with a linger queued
/// behind): a request for a worker that sleeps needs the link's thread.
class link_readers {
public:
  /// A leased worker's part, from its spawn to its end: it counts as not reading until
  /// `reading(true)`, and leaves the count when destroyed.
  class member final : public linger_reader {
  public:
    explicit member(std::shared_ptr<link_readers> readers);
    ~member() override;
    member(const member&) = delete;
    member& operator=(const member&) = delete;

    /// The worker starts (true) or stops (false) reading the links as it lingers.
    void reading(bool on) override;

    /// `link_readers::pump`.
    bool pump() override {
      return readers_->pump();
    }

  private:
    std::shared_ptr<link_readers> readers_;
    bool reading_ = false;
  };

  /// Reads what came on every open link, if no other worker is reading them, and hands
  /// each request to its worker from this thread; true when any came.
  bool pump();

  /// Whether every leased worker reads the links (the links' threads may sleep).
  bool quiet() const {
    return quiet_.load(std::memory_order_acquire);
  }

  /// Requests that workers read this way since the node started.
  uint64_t requests_read() const {
    return read_.load(std::memory_order_relaxed);
  }

  /// Counts a request a worker read.
  void read_one() {
    read_.fetch_add(1, std::memory_order_relaxed);
  }

  /// Lists `link` (opened) / forgets it (it waits for a `pump` under way).
  void add(link_server* link);
  void remove(link_server* link);

private:
  /// Changes the counts; wakes the links' threads when it stops being quiet.
  void count(int members, int reading);

  /// Held by the worker that pumps.
  std::mutex links_mtx_;
  std::vector<link_server*> links_;
  std::mutex count_mtx_;
  int members_ = 0;
  int reading_ = 0;
  std::atomic<bool> quiet_{false};
  std::atomic<uint64_t> read_{0};
};

/// The node's end of one link: a thread that reads its requests, checks each against the
/// lease, and puts it in the worker's mailbox with a sender that writes the reply back.
/// Leased workers that linger read the requests too (`link_readers`).
class link_server {
public:
  /// What the lease says of a request for actor `id` under `token`.
  struct lookup {
    /// `token` is the current lease's.
    bool holds = false;
    /// The leased worker with that id; none when it died or was released.
    caf::actor worker;
  };
  using find_fn = std::function<lookup(const std::string& token, uint64_t id)>;

  /// Serves `fd` (a connection that proved the node's secret, or went through `tls`'s
  /// handshake) from `peer`, whose hello must come within `timeout`; counts the requests
  /// it hands to workers in `requests`; once open, the workers of `readers` read it too.
  link_server(caf::actor_system& sys, int fd, std::unique_ptr<tls_session> tls, std::string peer,
              find_fn find, timeout_type linger, uint64_t max_payload, timeout_type timeout,
              std::shared_ptr<std::atomic<uint64_t>> requests,
              std::shared_ptr<link_readers> readers, std::shared_ptr<spdlog::logger> log);
  ~link_server();

  link_server(const link_server&) = delete;
  link_server& operator=(const link_server&) = delete;

  /// Closes the connection and waits for the thread.
  void stop();

  /// Closes the connection; the thread ends on its own.
  void shut();

  /// Reads what came, if no other thread is reading, and hands it on; true when any came.
  bool pump();

  /// Wakes the thread if it sleeps (its readers stopped being quiet).
  void wake();

  /// Whether the connection has closed.
  bool done() const {
    return done_.load(std::memory_order_acquire);
  }

  /// Whether the link presented the lease's token.
  bool opened() const {
    return opened_.load(std::memory_order_acquire);
  }

private:
  void run();
  /// Waits until a frame may have come; false once the link is shut.
  bool next();
  /// Reads one frame and acts on it (`by_worker`: in a worker's `pump`); false, with
  /// `why_` set and the link shut, when the link must close. Holds `read_mtx_`.
  bool take(bool by_worker);
  /// Shuts the link for `why`. Holds `read_mtx_`.
  void end(std::string why);

  caf::actor_system& sys_;
  std::string peer_;
  find_fn find_;
  std::shared_ptr<spdlog::logger> log_;
  timeout_type linger_;
  timeout_type timeout_;
  uint64_t max_payload_;
  std::shared_ptr<link_socket> socket_;
  caf::strong_actor_ptr replies_;
  /// Requests with the workers; while `awaits_replies_`, the reply ending them signals
  /// `wake_fd_`, which also wakes the thread for `wake`, `shut` and a link that a worker
  /// found broken.
  std::atomic<int> in_flight_{0};
  std::atomic<bool> awaits_replies_{false};
  int wake_fd_ = -1;
  std::shared_ptr<std::atomic<uint64_t>> requests_;
  std::shared_ptr<link_readers> readers_;
  /// Held by whoever reads: the thread or a worker (`pump`).
  std::mutex read_mtx_;
  /// The lease's token, once the hello presented it.
  std::string token_;
  /// A frame other than `share` came (under `read_mtx_`).
  bool requests_seen_ = false;
  /// Why the link closed.
  std::string why_;
  std::atomic<bool> opened_{false};
  std::atomic<bool> done_{false};
  std::thread thread_;
};

} // namespace troupe
