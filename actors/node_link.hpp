#pragma once

/// @file
/// The call link: a second connection from an executor to a node, beside BASP, that carries
/// the requests of direct gathers (`collective_rpc` of a named method, `execute_model`) to
/// the node's leased workers and their replies back. On BASP such a call crosses the
/// middleman's thread and the gateway's on each side; on the link the supervisor writes the
/// request to the socket, the node's link thread puts it in the worker's mailbox, and the
/// worker writes its reply to the socket itself.
///
/// A link proves the node's secret as a BASP connection does (`actors/node_auth.hpp`, with
/// the kind "link"), then presents the lease's token, which the node gave only to the
/// executor holding its lease (over the BASP connection that proved the secret). Under
/// mutual TLS the link proves a certificate of the node's CA instead (`actors/link_tls.hpp`)
/// and its frames go encrypted, then presents the token the same way.
///
/// Frames, both ways: a 24-byte header (payload length u32, kind u8, 3 zero bytes, key u64,
/// target u64; integers little-endian) and the payload. A request's target is the worker's
/// actor id and its payload the request as CAF serialises a message; a reply's payload is
/// the worker's reply as a message. A ping is answered by a pong with the same key once
/// everything before it has been read.
///
/// Over a Unix socket (a node on the same host) the executor may ask, with a `share` frame
/// right after the hello, for shared memory: the node answers with a `share` frame whose
/// payload is the capacity of each ring (u64) and which carries a sealed memfd
/// (`actors/shared_rings.hpp`), or with an empty one to decline. From then on the frames
/// go through the rings, the same bytes in the same order, and the socket only wakes a
/// reader that sleeps (one byte, a doorbell) and tells either end that the other closed.

#include "actors/linger.hpp"
#include "actors/link_tls.hpp"
#include "actors/shared_rings.hpp"
#include "troupe/config.hpp"

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <caf/mailbox_element.hpp>
#include <caf/message.hpp>

#include <spdlog/logger.h>

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

#include <sys/types.h>

struct iovec;

namespace troupe {

/// One end of a link's socket: whole frames in, whole frames out. Any thread writes; one at
/// a time reads. Once both ends share rings (`ask_rings`, `offer_rings`) the frames go
/// through them.
class link_socket {
public:
  enum kind : uint8_t { hello = 1, request = 2, reply = 3, ping = 4, pong = 5, share = 6 };

  struct frame {
    kind type = hello;
    uint64_t key = 0;
    uint64_t target = 0;
    std::vector<char> payload;
  };

  /// Takes `fd`, a connected stream socket; `linger`: how long `wait` polls before it
  /// sleeps; frames whose payload is larger than `max_payload` are refused. A read of the
  /// rest of a frame, and a write, that make no progress for `stall` fail (a peer stopped
  /// mid-frame, or one that reads nothing, never holds a thread for good). `tls`: the
  /// session whose handshake the socket went through; the frames go encrypted (until
  /// they go through shared rings, which stay on this host).
  link_socket(int fd, timeout_type linger, uint64_t max_payload, timeout_type stall,
              std::unique_ptr<tls_session> tls = nullptr);

  /// Changes the bound on payloads (the hello's is small).
  void bound(uint64_t max_payload) {
    max_payload_ = max_payload;
  }
  ~link_socket();

  link_socket(const link_socket&) = delete;
  link_socket& operator=(const link_socket&) = delete;

  /// Writes one frame, whole; false once the socket is closed or broken.
  bool write(kind type, uint64_t key, uint64_t target, const std::vector<char>& payload);

  /// Waits until bytes come to the socket, or `also` (another descriptor, or -1) is
  /// readable: polls for `linger` while `keep()` holds (a thread that sleeps takes tens of
  /// microseconds to wake here), then sleeps in `poll` for at most `limit` (negative: no
  /// limit). True when bytes wait or the peer closed; false otherwise (the limit, `also`,
  /// or `shut`). `reader`: the caller is the reader, whose polls read ahead what came;
  /// else any thread may wait.
  template <class Keep>
  bool wait(std::chrono::milliseconds limit, Keep keep, int also = -1, bool reader = false) {
    auto came = [&] { return reader ? readable() : arrived(); };
    // What was read ahead comes first: no wait on the socket for it.
    if (reader && readable())
      return !is_shut();
    if (linger_ > timeout_type::zero() && keep() &&
        linger_for(linger_, [&] { return came() || !keep(); }) && came())
      return !is_shut();
    return block(static_cast<int>(limit.count()), also) || (reader && readable());
  }

  /// `wait` by the reader, without a limit, lingering every time.
  bool wait() {
    return wait(
      std::chrono::milliseconds(-1), [] { return true; }, -1, true);
  }

  /// Whether a frame can be read without waiting for its first byte (or the peer closed):
  /// bytes read ahead, or bytes that a read without waiting brings. The reader's own.
  bool readable();

  /// Reads the next frame, waiting for all of it; false when the peer closed, the socket
  /// broke, `shut` was called, or the frame is not one (unknown kind, payload above the
  /// bound): `why` says which.
  bool read(frame& out, std::string& why);

  /// Ends both directions: a thread waiting or reading returns false.
  void shut();

  /// Whether the socket is a Unix one: its peer is on this host and can share memory.
  bool is_local() const;

  /// Whether the frames go through shared rings.
  bool has_rings() const {
    return rings_.load(std::memory_order_acquire) != nullptr;
  }

  /// The executor's end, right after the hello: asks the node for shared rings and, when
  /// it gives them before `deadline`, sends and reads through them from now on. False
  /// with `why` empty when the node declined (the frames stay on the socket); false with
  /// `why` set when the answer did not come or is not one.
  bool ask_rings(std::chrono::steady_clock::time_point deadline, std::string& why);

  /// The node's end, for a `share` frame: makes rings of `capacity` bytes each way and
  /// passes them, or declines (not a Unix socket, or the kernel refused: `why` says it).
  /// The reader's own; false when the answer could not be written.
  bool offer_rings(uint64_t capacity, std::string& why);

  bool is_shut() const {
    return shut_.load(std::memory_order_acquire);
  }

  /// Whether bytes wait on the socket itself; any thread.
  bool arrived() const;

  /// Whether a whole frame waits (read ahead, or on the socket), so that `read` takes it
  /// without waiting. The reader's own.
  bool whole_frame();

private:
  enum class came { nothing, bytes, end };
  /// Reads what came after what is read ahead, without waiting: bytes, nothing yet, or the
  /// end of the stream (or an error, which the next read reports).
  came take_in();
  bool block(int timeout_ms, int also);
  bool block_on_rings(int timeout_ms, int also);
  bool fill(char* data, size_t size, std::string& why);
  /// Sends all of `parts`; false (and the socket shut) when it cannot. Holds `write_mtx_`.
  bool send_all(iovec* parts, size_t count);
  /// `write` under TLS. Holds `write_mtx_`.
  bool write_sealed(const char* header, const std::vector<char>& payload);
  /// `take_some` under TLS: plaintext the session holds, else what the socket brings.
  ssize_t take_sealed(char* data, size_t size, bool wait);
  /// Reads into `data` what came, at most `size` bytes: from the rings, or the socket.
  /// -1 (with errno) when nothing came yet or on error, 0 at the end of the stream.
  ssize_t take_some(char* data, size_t size, bool wait);
  /// `take_some` from the rings: what came, else (with `wait`) waits for it up to the
  /// stall bound.
  ssize_t take_from_rings(char* data, size_t size, bool wait);
  /// `write` through the rings, without the frame's doorbell; holds `write_mtx_`.
  bool push(const char* data, size_t size);
  /// Wakes the peer's reader if it sleeps; holds `write_mtx_`.
  void ring_doorbell();
  /// The frames go through `rings` from now on; holds `write_mtx_`, and the reader's side.
  void use_rings(std::unique_ptr<shared_rings> rings);
  /// Whether the peer closed its end (the rings' only sign of it); any thread.
  bool peer_closed() const;
  /// `peer_closed`, but looking at the socket at most once per `close_check_interval`:
  /// for readers that poll the rings, for which a `poll` each time would cost more than
  /// the rest of their loop.
  bool closed_lately() const;
  /// Reads the doorbells that came, noting an end of the stream.
  void drain_doorbells();

  int fd_;
  timeout_type stall_;
  std::unique_ptr<tls_session> tls_;
  /// A frame's plaintext and ciphertext under TLS; under `write_mtx_`.
  std::vector<char> plain_;
  std::vector<char> sealed_;
  std::unique_ptr<shared_rings> owned_rings_;
  /// Set once, under both the read and the write side, when the rings take over.
  std::atomic<shared_rings*> rings_{nullptr};
  /// With rings: the socket reached its end (the peer closed).
  mutable std::atomic<bool> ended_{false};
  static constexpr std::chrono::steady_clock::duration close_check_interval =
    std::chrono::microseconds(50);
  /// When `closed_lately` next looks at the socket (steady clock ticks).
  mutable std::atomic<int64_t> next_close_check_{0};
  /// With rings, for the one thread that sleeps on the doorbell: how often it said so, and
  /// the doorbells that came; more doorbells than that breaks the link (`flooded_`).
  uint64_t sleeps_ = 0;
  uint64_t bells_ = 0;
  std::atomic<bool> flooded_{false};
  timeout_type linger_;
  uint64_t max_payload_;
  std::mutex write_mtx_;
  std::atomic<bool> shut_{false};
  /// What one `recv` brought beyond the frame being read: a frame and the next's header
  /// usually come in one call.
  std::vector<char> ahead_;
  size_t ahead_begin_ = 0;
  size_t ahead_end_ = 0;
};

/// A message as CAF serialises it; empty with `why` set when it cannot be.
std::vector<char> serialize_message(caf::actor_system& sys, const caf::message& msg,
                                    std::string& why);

/// How a call link proves itself to a node: the secret's handshake, or mutual TLS.
struct link_credentials {
  /// The node's shared secret (`actors/node_auth.hpp`), when `tls` is none.
  std::string secret;
  /// This side's context (`make_tls_context` as the client), for a node under TLS.
  std::shared_ptr<ssl_ctx_st> tls;
};

/// The executor's end of the link to one node: it carries what this process sends to the
/// node's workers (through their stubs, `make_link_stub`), in order, and routes each reply
/// to its request's sender.
class node_link {
public:
  /// Dials the node at `host`:`port` (first at `local_address`, its local socket, when
  /// that is given and reachable: the node is on this host), proves `credentials`, presents
  /// `token` and has the node accept it, all before `deadline`; over the local socket,
  /// with `shared_memory`, it then asks for rings in shared memory. Its reader polls for
  /// `linger` before it sleeps, and a frame or write stalled for `stall` breaks the link.
  /// Throws `troupe::error` (as `dial_node`; `invalid_argument` when the node refuses the
  /// token or a certificate).
  static std::shared_ptr<node_link>
  open(const std::string& host, uint16_t port, const std::string& local_address, bool shared_memory,
       const link_credentials& credentials, const std::string& token, timeout_type linger,
       timeout_type stall, std::chrono::steady_clock::time_point deadline);
  ~node_link();

  node_link(const node_link&) = delete;
  node_link& operator=(const node_link&) = delete;

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
  node_link(std::unique_ptr<link_socket> socket, std::string name);
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
/// blocking facade (whose callers read them while they wait: `node_link::pump`).
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

  /// Starts `link`'s thread (see `node_link::start`) and lists it.
  void add(const std::shared_ptr<node_link>& link, caf::actor_system& sys);

  /// Taken by a blocking caller from before its request goes until it stops waiting.
  helping help();

  /// `pump` on every link alive; true when any handed on a reply.
  bool pump();

private:
  void leave();

  std::mutex mtx_;
  std::vector<std::weak_ptr<node_link>> links_;
  std::shared_ptr<std::atomic<int>> helpers_ = std::make_shared<std::atomic<int>>(0);
};

/// An actor of this process that stands for `worker`, a worker on the node of `link`:
/// what is sent to it goes over the link, in the order sent; once the link is closed, and
/// for messages that `by_proxy` picks (those carrying actor handles, which only BASP
/// resolves), to `worker` itself. `end_companion` stops it.
caf::strong_actor_ptr make_link_stub(caf::actor_system& sys, std::shared_ptr<node_link> link,
                                     caf::actor worker,
                                     std::function<bool(const caf::message&)> by_proxy);

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
  class member {
  public:
    explicit member(std::shared_ptr<link_readers> readers);
    ~member();
    member(const member&) = delete;
    member& operator=(const member&) = delete;

    /// The worker starts (true) or stops (false) reading the links as it lingers.
    void reading(bool on);

    /// `link_readers::pump`.
    bool pump() {
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
