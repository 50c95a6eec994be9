#pragma once

/// @file
/// The call link: a second connection from an executor to a node, beside BASP, that carries
/// the requests of direct gathers (`collective_rpc` of a named method, `execute_model`) to
/// the node's leased workers and their replies back. On BASP such a call crosses the
/// middleman's thread and the gateway's on each side; on the link the supervisor writes the
/// request to the socket, the node's link thread puts it in the worker's mailbox, and the
/// worker writes its reply to the socket itself. The executor's end is a `link_client`
/// (`actors/cluster/link_client.hpp`), the node's a `link_server`
/// (`actors/cluster/link_server.hpp`); both move frames through a `link_socket`, here.
///
/// A link proves the node's secret as a BASP connection does
/// (`actors/cluster/node_auth.hpp`, with the kind "link"), then presents the lease's token,
/// which the node gave only to the executor holding its lease (over the BASP connection
/// that proved the secret). Under mutual TLS the link proves a certificate of the node's CA
/// instead (`actors/cluster/link_tls.hpp`) and its frames go encrypted, then presents the
/// token the same way.
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
/// (`actors/cluster/shared_rings.hpp`), or with an empty one to decline. From then on the
/// frames go through the rings, the same bytes in the same order, and the socket only wakes
/// a reader that sleeps (one byte, a doorbell) and tells either end that the other closed.

#include "actors/cluster/link_tls.hpp"
#include "actors/cluster/shared_rings.hpp"
#include "actors/linger.hpp"
#include "troupe/config.hpp"

#include <caf/actor_system.hpp>
#include <caf/message.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
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

} // namespace troupe
