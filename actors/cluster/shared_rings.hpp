#pragma once

/// @file
/// Two byte rings in memory shared by two processes on one host, one each way: what a call
/// link carries once both ends map them (`link_socket::ask_rings`, `offer_rings`). A write is a
/// copy and an atomic store, and a reader that polls sees it at once, where a Unix socket costs a
/// `sendmsg` and a `recv` each way.
///
/// The node makes the memory (a sealed memfd that the peer cannot shrink under it) and
/// passes it over the link's Unix socket; the executor maps it. Neither end trusts what the
/// other writes there: each keeps its own positions privately, checks the peer's against
/// them, and copies bytes out before it reads them, so a peer that scribbles on the memory
/// can break the link but not read or write outside it.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace troupe {

class shared_rings {
public:
  /// Makes a memfd holding two rings of `capacity` bytes (a power of two, 4 KiB to
  /// 64 MiB), sealed against resizing; this end is the node's. Throws `troupe::error`
  /// (`worker_error`) when the kernel refuses.
  static std::unique_ptr<shared_rings> create(uint64_t capacity);

  /// Maps `fd` (which it takes), a memfd made by `create` in the peer process with
  /// `capacity`; this end is the executor's. Throws `troupe::error` (`invalid_argument`)
  /// naming what is wrong: a size that does not match, or a file that could shrink.
  static std::unique_ptr<shared_rings> adopt(int fd, uint64_t capacity);

  shared_rings(const shared_rings&) = delete;
  shared_rings& operator=(const shared_rings&) = delete;
  ~shared_rings();

  /// The memfd, to pass to the peer (the creator's end, until `passed`); -1 at the
  /// executor's end.
  int fd() const {
    return fd_;
  }

  /// The peer has the memfd: this end closes its descriptor (the mapping stays).
  void passed();

  uint64_t capacity() const {
    return capacity_;
  }

  /// Copies as much of `data` as fits into the outgoing ring and publishes it; returns how
  /// many bytes went (0: full). Sets `broken` when the peer's position is impossible.
  /// One writer at a time.
  size_t push(const char* data, size_t size);

  /// Copies up to `size` bytes that came into `data`; returns how many (0: none yet). One
  /// reader at a time.
  size_t pull(char* data, size_t size);

  /// Bytes that came and wait to be pulled; any thread. An impossible position counts as
  /// bytes (the reader's `pull` then finds the link broken).
  size_t incoming() const;

  /// Whether the peer moved a position where it cannot be; the link is then over.
  bool broken() const {
    return broken_.load(std::memory_order_acquire);
  }

  /// The reader is about to sleep (true) until the peer rings its doorbell, or is awake
  /// again (false). Before it sleeps it must look at `incoming` once more: the peer rings
  /// only for bytes it published after it saw the reader asleep.
  void sleeping(bool on);

  /// After a `push`: whether the peer's reader sleeps and must be woken (and marks it woken,
  /// so that one doorbell serves until it sleeps again).
  bool peer_needs_doorbell();

private:
  struct control;
  shared_rings(int fd, uint64_t capacity, void* base, bool creator);

  int fd_;
  uint64_t capacity_;
  void* base_;
  size_t mapped_;
  control* out_;
  control* in_;
  char* out_data_;
  char* in_data_;
  /// This end's positions; the copies in shared memory are for the peer to read.
  uint64_t written_ = 0;
  std::atomic<uint64_t> read_{0};
  /// The highest incoming head seen: a head never goes back, and bytes once announced
  /// (`incoming`) are there to pull.
  mutable std::atomic<uint64_t> seen_head_{0};
  /// Reads the incoming head; false when it went back.
  bool fresh_head(uint64_t& head) const;
  std::atomic<bool> broken_{false};
};

} // namespace troupe
