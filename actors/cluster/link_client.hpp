#pragma once

/// @file
/// The executor's end of a call link (`actors/cluster/link_socket.hpp`): the link to one
/// node, the links of one executor, and the stubs that stand for the node's workers.

#include "actors/cluster/link_socket.hpp"
#include "troupe/config.hpp"

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <caf/mailbox_element.hpp>
#include <caf/message.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace troupe {

/// How a call link proves itself to a node: the secret's handshake, or mutual TLS.
struct link_credentials {
  /// The node's shared secret (`actors/cluster/node_auth.hpp`), when `tls` is none.
  std::string secret;
  /// This side's context (`make_tls_context` as the client), for a node under TLS.
  std::shared_ptr<ssl_ctx_st> tls;
};

/// The executor's end of the link to one node: it carries what this process sends to the
/// node's workers (through their stubs, `make_link_stub`), in order, and routes each reply
/// to its request's sender.
class link_client {
public:
  /// Dials the node at `host`:`port` (first at `local_address`, its local socket, when
  /// that is given and reachable: the node is on this host), proves `credentials`, presents
  /// `token` and has the node accept it, all before `deadline`; over the local socket,
  /// with `shared_memory`, it then asks for rings in shared memory. Its reader polls for
  /// `linger` before it sleeps, and a frame or write stalled for `stall` breaks the link.
  /// Throws `troupe::error` (as `dial_node`; `invalid_argument` when the node refuses the
  /// token or a certificate).
  static std::shared_ptr<link_client>
  open(const std::string& host, uint16_t port, const std::string& local_address, bool shared_memory,
       const link_credentials& credentials, const std::string& token, timeout_type linger,
       timeout_type stall, std::chrono::steady_clock::time_point deadline);
  ~link_client();

  link_client(const link_client&) = delete;
  link_client& operator=(const link_client&) = delete;

  /// Starts the thread that reads replies. While `helpers` is above 0, callers read them
  /// (`pump`) and the thread does not. Once only: later calls do nothing.
  void start(caf::actor_system& sys, std::shared_ptr<std::atomic<int>> helpers);

  /// Sends `content`, that of `element`, to the worker with actor id `worker`. The response to
  /// a request goes to its sender, from whichever thread reads it: an error
  /// (`request_receiver_down`) when the link closes first. False, with nothing sent, when
  /// the link is closed or the content cannot be sent this way (the caller then sends it
  /// over BASP).
  bool forward(uint64_t worker, const caf::mailbox_element& element, const caf::message& content);

  /// Reads the replies that have come, if no other thread is reading, and hands them on
  /// from this thread; true when it handed on any. A caller that waits for its reply
  /// calls this as it lingers: the reply then reaches it without a hand-off from the
  /// link's thread.
  bool pump();

  /// The last caller that read stopped: the link's thread reads what is still owed.
  void helpers_left();

  /// Whether a request to `worker` awaits its reply.
  bool owes(uint64_t worker);

  /// Fails what `worker` still owes (it is dead), as `close` does.
  void forget(uint64_t worker);

  /// Runs `then` (on the link's thread) once every reply that the node wrote before it
  /// reads this has been handed on; at once when the link is closed.
  void flush(std::function<void()> then);

  /// Closes the link and waits for its thread; the requests still owed fail, and later
  /// `forward`s return false.
  void close();

  /// "node HOST:PORT".
  const std::string& name() const {
    return name_;
  }

private:
  link_client(std::unique_ptr<link_socket> socket, std::string name);
  void run();
  /// Reads one frame and hands it on; false when the link broke. Holds `read_mtx_`.
  bool take();
  /// Marks the link broken; its thread fails what is owed. Holds `read_mtx_`.
  void fail(const std::string& why);
  /// `fail`, taking `read_mtx_`.
  void broke(const std::string& why);
  /// Whether the link's thread has something to read that no caller reads. Holds `mtx_`.
  bool reader_needed() const;
  /// Wakes the link's thread if it sleeps and is needed. Holds `mtx_`.
  void call_reader();
  void lost(const std::string& why);

  std::string name_;
  std::unique_ptr<link_socket> socket_;
  caf::actor_system* sys_ = nullptr;
  std::thread thread_;
  /// Held by whoever reads: the link's thread or a caller (`pump`).
  std::mutex read_mtx_;
  /// Callers that read the links while they wait (`link_set::help`).
  std::shared_ptr<std::atomic<int>> helpers_;
  std::atomic<bool> broken_{false};
  std::string why_;
  std::mutex mtx_;
  std::condition_variable wake_;
  bool reader_asleep_ = false;
  bool closed_ = false;
  /// Where the response to each request still owed goes.
  struct route {
    caf::strong_actor_ptr sender;
    caf::message_id mid;
    uint64_t worker = 0;
    /// Its response is being handed on.
    bool delivering = false;
  };
  std::unordered_map<uint64_t, route> routes_;
  uint64_t next_key_ = 1;
  std::map<uint64_t, std::function<void()>> flushes_;
  uint64_t next_ping_ = 1;
};

/// The call links of one executor, shared by the supervisor (which adds them) and the
/// blocking facade (whose callers read them while they wait: `link_client::pump`).
class link_set {
public:
  /// While one lives, its caller reads the links (`pump`) and their threads do not.
  class helping {
  public:
    explicit helping(link_set* set) : set_(set) {}
    helping(helping&& other) noexcept : set_(std::exchange(other.set_, nullptr)) {}
    helping(const helping&) = delete;
    helping& operator=(const helping&) = delete;
    helping& operator=(helping&&) = delete;
    ~helping();

  private:
    link_set* set_;
  };

  /// Starts `link`'s thread (see `link_client::start`) and lists it.
  void add(const std::shared_ptr<link_client>& link, caf::actor_system& sys);

  /// Taken by a blocking caller from before its request goes until it stops waiting.
  helping help();

  /// `pump` on every link alive; true when any handed on a reply.
  bool pump();

private:
  void leave();

  std::mutex mtx_;
  std::vector<std::weak_ptr<link_client>> links_;
  std::shared_ptr<std::atomic<int>> helpers_ = std::make_shared<std::atomic<int>>(0);
};

/// An actor of this process that stands for `worker`, a worker on the node of `link`:
/// what is sent to it goes over the link, in the order sent; once the link is closed, and
/// for messages that `by_proxy` picks (those carrying actor handles, which only BASP
/// resolves), to `worker` itself. `end_companion` stops it.
caf::strong_actor_ptr make_link_stub(caf::actor_system& sys, std::shared_ptr<link_client> link,
                                     caf::actor worker,
                                     std::function<bool(const caf::message&)> by_proxy);

} // namespace troupe
