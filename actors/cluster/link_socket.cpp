#include "actors/cluster/link_socket.hpp"

#include "troupe/errors.hpp"

#include <caf/all.hpp>
#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>

namespace troupe {

namespace {

constexpr size_t header_size = 24;

/// Integers in a frame's header, little-endian.
template <class T>
void put_le(char* at, T x) {
  for (size_t i = 0; i < sizeof(T); ++i)
    at[i] = static_cast<char>((x >> (8 * i)) & 0xff);
}

template <class T>
T get_le(const char* at) {
  T x = 0;
  for (size_t i = 0; i < sizeof(T); ++i)
    x |= static_cast<T>(static_cast<unsigned char>(at[i])) << (8 * i);
  return x;
}

} // namespace

// -- link_socket ----------------------------------------------------------------------

link_socket::link_socket(int fd, timeout_type linger, uint64_t max_payload, timeout_type stall,
                         std::unique_ptr<tls_session> tls)
  : fd_(fd), stall_(stall), tls_(std::move(tls)), linger_(linger), max_payload_(max_payload),
    ahead_(16 << 10) {
  // Blocking reads and writes, each bounded by `stall`; waits for a frame poll instead.
  int flags = fcntl(fd_, F_GETFL, 0);
  if (flags >= 0)
    fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(stall).count();
  timeval limit{static_cast<time_t>(us / 1000000), static_cast<suseconds_t>(us % 1000000)};
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
}

link_socket::~link_socket() {
  ::close(fd_);
}

namespace {

void put_header(char* header, link_socket::kind type, uint64_t key, uint64_t target,
                size_t length) {
  std::memset(header, 0, header_size);
  put_le(header, static_cast<uint32_t>(length));
  header[4] = static_cast<char>(type);
  put_le(header + 8, key);
  put_le(header + 16, target);
}

/// Waits with growing pauses, from a few microseconds to a millisecond: for the rest of a
/// frame, or for room in a ring, which come late only when the peer is slow.
class backoff {
public:
  explicit backoff(timeout_type linger)
    : linger_until_(std::chrono::steady_clock::now() + linger) {}

  void pause() {
    if (std::chrono::steady_clock::now() < linger_until_) {
      sched_yield();
      return;
    }
    std::this_thread::sleep_for(pause_);
    pause_ = std::min(pause_ * 2, std::chrono::microseconds(1000));
  }

private:
  std::chrono::steady_clock::time_point linger_until_;
  std::chrono::microseconds pause_{10};
};

} // namespace

bool link_socket::write(kind type, uint64_t key, uint64_t target,
                        const std::vector<char>& payload) {
  char header[header_size];
  put_header(header, type, key, target, payload.size());
  std::lock_guard<std::mutex> lk{write_mtx_};
  if (has_rings()) {
    bool pushed =
      push(header, header_size) && (payload.empty() || push(payload.data(), payload.size()));
    // One doorbell for the frame, if its reader sleeps.
    ring_doorbell();
    return pushed;
  }
  if (tls_)
    return write_sealed(header, payload);
  iovec parts[2] = {{header, header_size}, {const_cast<char*>(payload.data()), payload.size()}};
  return send_all(parts, payload.empty() ? 1 : 2);
}

bool link_socket::write_sealed(const char* header, const std::vector<char>& payload) {
  // The header goes with the payload's first part; a large payload goes in parts, so that
  // its ciphertext is never all in memory at once.
  constexpr size_t part = size_t{1} << 20;
  size_t at = 0;
  do {
    auto n = std::min(part, payload.size() - at);
    plain_.clear();
    if (at == 0)
      plain_.assign(header, header + header_size);
    plain_.insert(plain_.end(), payload.begin() + static_cast<std::ptrdiff_t>(at),
                  payload.begin() + static_cast<std::ptrdiff_t>(at + n));
    sealed_.clear();
    if (!tls_->seal(plain_.data(), plain_.size(), sealed_)) {
      shut(); // part of a frame may have gone: nothing may follow it
      return false;
    }
    iovec all{sealed_.data(), sealed_.size()};
    if (!send_all(&all, 1))
      return false; // and the socket is shut
    at += n;
  } while (at < payload.size());
  return true;
}

bool link_socket::send_all(iovec* parts, size_t count) {
  msghdr msg{};
  msg.msg_iov = parts;
  msg.msg_iovlen = count;
  size_t left = 0;
  for (size_t i = 0; i < count; ++i)
    left += parts[i].iov_len;
  while (left > 0) {
    if (shut_.load(std::memory_order_acquire))
      return false;
    auto n = sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      // Part of a frame may have gone: nothing may follow it.
      shut();
      return false;
    }
    left -= static_cast<size_t>(n);
    // Skips what went out of the parts.
    auto sent = static_cast<size_t>(n);
    while (sent > 0 && msg.msg_iovlen > 0) {
      auto& first = msg.msg_iov[0];
      if (sent >= first.iov_len) {
        sent -= first.iov_len;
        ++msg.msg_iov;
        --msg.msg_iovlen;
      } else {
        first.iov_base = static_cast<char*>(first.iov_base) + sent;
        first.iov_len -= sent;
        sent = 0;
      }
    }
  }
  return true;
}

bool link_socket::push(const char* data, size_t size) {
  auto* rings = rings_.load(std::memory_order_acquire);
  // As over the socket, a write that the peer's end closed fails.
  if (is_shut() || ended_.load(std::memory_order_acquire))
    return false;
  auto until = std::chrono::steady_clock::now() + stall_;
  backoff wait{linger_};
  for (;;) {
    auto n = rings->push(data, size);
    data += n;
    size -= n;
    // The bound is on a stall: a reader that takes a large frame part by part is none.
    if (n > 0)
      until = std::chrono::steady_clock::now() + stall_;
    if (size == 0)
      return true;
    // A frame larger than the free room comes in parts: a reader asleep is woken to take
    // what is there (this frame's first parts, or the frames before it) and make room.
    ring_doorbell();
    // Part of a frame may have gone: nothing may follow it.
    if (rings->broken() || is_shut() || peer_closed() ||
        std::chrono::steady_clock::now() >= until) {
      shut();
      return false;
    }
    wait.pause();
  }
}

void link_socket::ring_doorbell() {
  if (rings_.load(std::memory_order_acquire)->peer_needs_doorbell()) {
    char bell = 0;
    [[maybe_unused]] auto sent = send(fd_, &bell, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
  }
}

void link_socket::use_rings(std::unique_ptr<shared_rings> rings) {
  owned_rings_ = std::move(rings);
  rings_.store(owned_rings_.get(), std::memory_order_release);
}

bool link_socket::closed_lately() const {
  if (ended_.load(std::memory_order_acquire))
    return true;
  auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  auto next = next_close_check_.load(std::memory_order_relaxed);
  if (now < next)
    return false;
  next_close_check_.store(now + close_check_interval.count(), std::memory_order_relaxed);
  return peer_closed();
}

bool link_socket::peer_closed() const {
  if (ended_.load(std::memory_order_acquire))
    return true;
  pollfd p{fd_, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0 || (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0)
    return false;
  ended_.store(true, std::memory_order_release);
  return true;
}

void link_socket::drain_doorbells() {
  char bells[64];
  for (;;) {
    auto n = recv(fd_, bells, sizeof bells, MSG_DONTWAIT);
    if (n > 0) {
      // The peer rings once for each time this end said it sleeps, at most: more is a
      // peer that would keep the link's thread awake for nothing.
      bells_ += static_cast<uint64_t>(n);
      if (bells_ > sleeps_) {
        flooded_.store(true, std::memory_order_release);
        return;
      }
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
      ended_.store(true, std::memory_order_release);
    if (n == 0 || errno != EINTR)
      return;
  }
}

ssize_t link_socket::take_from_rings(char* data, size_t size, bool wait) {
  auto* rings = rings_.load(std::memory_order_acquire);
  auto until = std::chrono::steady_clock::now() + stall_;
  backoff pause{linger_};
  for (;;) {
    // Seen before the pull: bytes the peer wrote before it closed are read first.
    bool closed = ended_.load(std::memory_order_acquire);
    if (auto n = rings->pull(data, size))
      return static_cast<ssize_t>(n);
    if (rings->broken() || flooded_.load(std::memory_order_acquire)) {
      errno = EPROTO;
      return -1;
    }
    if (is_shut() || closed)
      return 0;
    if (!wait) {
      // Readers that poll look at the socket now and then: a peer that closed is seen
      // within that, not only once the link's thread sleeps on the socket.
      if (closed_lately())
        continue; // pulls once more
      errno = EAGAIN;
      return -1;
    }
    // Only the waits for a frame (`block`) sleep on the doorbell, so that one thread at most
    // does and none reads a doorbell that another needs.
    if (peer_closed())
      continue; // pulls once more
    if (std::chrono::steady_clock::now() >= until) {
      errno = EAGAIN;
      return -1;
    }
    pause.pause();
  }
}

ssize_t link_socket::take_some(char* data, size_t size, bool wait) {
  if (has_rings())
    return take_from_rings(data, size, wait);
  if (tls_)
    return take_sealed(data, size, wait);
  return recv(fd_, data, size, wait ? 0 : MSG_DONTWAIT);
}

ssize_t link_socket::take_sealed(char* data, size_t size, bool wait) {
  char in[16 << 10];
  for (;;) {
    // Readers that poll come here often with nothing held: the socket alone answers them.
    if (tls_->ready()) {
      auto n = tls_->open(data, size);
      if (n >= 0 || errno != EAGAIN)
        return n;
    }
    auto got = recv(fd_, in, sizeof in, wait ? 0 : MSG_DONTWAIT);
    if (got <= 0)
      return got;
    tls_->give(in, static_cast<size_t>(got));
  }
}

bool link_socket::fill(char* data, size_t size, std::string& why) {
  size_t got = 0;
  while (got < size) {
    if (ahead_begin_ < ahead_end_) {
      auto n = std::min(size - got, ahead_end_ - ahead_begin_);
      std::memcpy(data + got, ahead_.data() + ahead_begin_, n);
      ahead_begin_ += n;
      got += n;
      continue;
    }
    // A large rest goes straight to its place; a small one comes with what follows it.
    bool direct = size - got >= ahead_.size();
    auto n = direct ? take_some(data + got, size - got, true)
                    : take_some(ahead_.data(), ahead_.size(), true);
    if (n > 0) {
      if (direct) {
        got += static_cast<size_t>(n);
      } else {
        ahead_begin_ = 0;
        ahead_end_ = static_cast<size_t>(n);
      }
    } else if (n == 0) {
      why = is_shut() ? "closed" : "the peer closed the connection";
      return false;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      why = "the rest of a frame did not come in time";
      return false;
    } else if (errno == EPROTO) {
      why =
        has_rings() || !tls_ ? "the peer broke the shared-memory protocol" : "TLS: " + tls_->why();
      return false;
    } else if (errno != EINTR) {
      why = std::string{"the connection broke: "} + std::strerror(errno);
      return false;
    }
  }
  return true;
}

link_socket::came link_socket::take_in() {
  auto have = ahead_end_ - ahead_begin_;
  if (ahead_begin_ > 0) {
    std::memmove(ahead_.data(), ahead_.data() + ahead_begin_, have);
    ahead_begin_ = 0;
    ahead_end_ = have;
  }
  if (ahead_end_ == ahead_.size())
    return came::nothing;
  auto n = take_some(ahead_.data() + ahead_end_, ahead_.size() - ahead_end_, false);
  if (n > 0) {
    ahead_end_ += static_cast<size_t>(n);
    return came::bytes;
  }
  return n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) ? came::end
                                                                               : came::nothing;
}

bool link_socket::readable() {
  // The end of the stream, or an error, is readable too: the next read reports it.
  return ahead_begin_ < ahead_end_ || take_in() != came::nothing;
}

bool link_socket::whole_frame() {
  auto have = [this] { return ahead_end_ - ahead_begin_; };
  auto length = [this] { return get_le<uint32_t>(ahead_.data() + ahead_begin_); };
  if ((have() < header_size || have() < header_size + length()) && take_in() == came::end)
    return true; // `read` reports it
  if (have() < header_size)
    return false;
  // A length above the bound is read at once, to be refused.
  if (length() > max_payload_ || have() >= header_size + length())
    return true;
  // A frame larger than the read-ahead: whole once the rest waits.
  if (auto* rings = rings_.load(std::memory_order_acquire))
    return have() + rings->incoming() >= header_size + length();
  int queued = 0;
  if (ioctl(fd_, FIONREAD, &queued) != 0 || queued < 0)
    return false;
  // Under TLS the ciphertext is a little larger than the frame: at worst `read` then waits
  // for a record on its way.
  auto waiting = static_cast<size_t>(queued) + (tls_ ? tls_->held() : 0);
  return have() + waiting >= header_size + length();
}

bool link_socket::arrived() const {
  if (auto* rings = rings_.load(std::memory_order_acquire))
    return rings->incoming() > 0 || closed_lately();
  if (tls_ && tls_->ready())
    return true;
  pollfd p{fd_, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

bool link_socket::block(int timeout_ms, int also) {
  if (has_rings())
    return block_on_rings(timeout_ms, also);
  if (tls_ && tls_->ready())
    return !is_shut();
  pollfd p[2] = {{fd_, POLLIN, 0}, {also, POLLIN, 0}};
  while (::poll(p, 2, timeout_ms) < 0 && errno == EINTR) {
  }
  return p[0].revents != 0 && !is_shut();
}

bool link_socket::block_on_rings(int timeout_ms, int also) {
  auto* rings = rings_.load(std::memory_order_acquire);
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    drain_doorbells();
    if (is_shut())
      return false;
    if (flooded_.load(std::memory_order_acquire))
      return true; // the read reports it
    rings->sleeping(true);
    ++sleeps_;
    if (rings->incoming() > 0 || ended_.load(std::memory_order_acquire)) {
      rings->sleeping(false);
      return true;
    }
    int left = timeout_ms;
    if (timeout_ms >= 0)
      left =
        static_cast<int>(std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                until - std::chrono::steady_clock::now())
                                                .count()));
    pollfd p[2] = {{fd_, POLLIN | POLLRDHUP, 0}, {also, POLLIN, 0}};
    int n;
    while ((n = ::poll(p, 2, left)) < 0 && errno == EINTR) {
    }
    rings->sleeping(false);
    if (is_shut())
      return false;
    if ((p[0].revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
      ended_.store(true, std::memory_order_release);
      return true;
    }
    if (rings->incoming() > 0)
      return true;
    // A doorbell for bytes that a reader took meanwhile: sleep again for the time left.
    if (n <= 0 || p[1].revents != 0 || (p[0].revents & POLLIN) == 0)
      return false;
  }
}

bool link_socket::read(frame& out, std::string& why) {
  char header[header_size];
  if (!fill(header, header_size, why))
    return false;
  auto length = get_le<uint32_t>(header);
  auto type = static_cast<uint8_t>(header[4]);
  if (type < hello || type > share || header[5] != 0 || header[6] != 0 || header[7] != 0) {
    why = "not a link frame";
    return false;
  }
  if (length > max_payload_) {
    why = "a frame of " + std::to_string(length) + " bytes, above the bound of " +
          std::to_string(max_payload_);
    return false;
  }
  out.type = static_cast<kind>(type);
  out.key = get_le<uint64_t>(header + 8);
  out.target = get_le<uint64_t>(header + 16);
  out.payload.resize(length);
  return length == 0 || fill(out.payload.data(), length, why);
}

void link_socket::shut() {
  shut_.store(true, std::memory_order_release);
  ::shutdown(fd_, SHUT_RDWR);
}

bool link_socket::is_local() const {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  return getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0 &&
         addr.ss_family == AF_UNIX;
}

bool link_socket::offer_rings(uint64_t capacity, std::string& why) {
  std::unique_ptr<shared_rings> made;
  if (!is_local()) {
    why = "not a Unix socket";
  } else {
    try {
      made = shared_rings::create(capacity);
    } catch (const error& e) {
      why = e.what();
    }
  }
  char frame[header_size + sizeof(uint64_t)];
  put_header(frame, share, 0, 0, made ? sizeof(uint64_t) : 0);
  put_le(frame + header_size, capacity);
  size_t size = made ? sizeof frame : header_size;
  std::lock_guard<std::mutex> lk{write_mtx_};
  // Under TLS the answer is one record, and the descriptor comes with its bytes.
  std::vector<char> bytes;
  if (tls_ ? !tls_->seal(frame, size, bytes) : (bytes.assign(frame, frame + size), false)) {
    shut();
    return false;
  }
  iovec part{bytes.data(), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &part;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (made) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    auto* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    int fd = made->fd();
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  // The frame is tiny: a socket that takes only part of it is one to give up on.
  ssize_t n;
  while ((n = sendmsg(fd_, &msg, MSG_NOSIGNAL)) < 0 && errno == EINTR) {
  }
  if (n != static_cast<ssize_t>(part.iov_len)) {
    shut();
    return false;
  }
  if (made) {
    made->passed();
    use_rings(std::move(made));
  }
  return true;
}

bool link_socket::ask_rings(std::chrono::steady_clock::time_point deadline, std::string& why) {
  if (!write(share, 0, 0, {})) {
    why = "the request for shared memory could not be written";
    return false;
  }
  if (ahead_begin_ != ahead_end_ || (tls_ && tls_->held() > 0)) {
    why = "bytes after the hello";
    return false;
  }
  // Read with the descriptor that comes with it: exactly the answer, nothing beyond (after
  // it the socket only carries doorbells).
  int passed = -1;
  auto keep = [&passed](int fd) {
    if (passed < 0)
      passed = fd;
    else
      ::close(fd);
  };
  auto read_exactly = [&](char* into, size_t want) {
    size_t got = 0;
    while (got < want) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    deadline - std::chrono::steady_clock::now())
                    .count();
      pollfd p{fd_, POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) == 0) {
        why = "no answer to the request for shared memory in time";
        return false;
      }
      iovec part{into + got, want - got};
      msghdr msg{};
      msg.msg_iov = &part;
      msg.msg_iovlen = 1;
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      auto n = recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
        continue;
      if (n <= 0) {
        why = n == 0 ? "the node closed the connection" : std::strerror(errno);
        return false;
      }
      for (auto* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
          for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            keep(fd);
          }
      got += static_cast<size_t>(n);
    }
    return true;
  };
  char frame[header_size + sizeof(uint64_t)];
  size_t length = 0;
  auto answer_is_one = [&] {
    length = get_le<uint32_t>(frame);
    if (static_cast<uint8_t>(frame[4]) == share && (length == 0 || length == sizeof(uint64_t)))
      return true;
    why = "an answer to the request for shared memory that is not one";
    return false;
  };
  if (tls_) {
    // One record: its 5-byte header says how long it is.
    std::vector<char> record(5);
    if (read_exactly(record.data(), record.size())) {
      record.resize(5 + ((static_cast<size_t>(static_cast<unsigned char>(record[3])) << 8) |
                         static_cast<unsigned char>(record[4])));
      if (read_exactly(record.data() + 5, record.size() - 5)) {
        tls_->give(record.data(), record.size());
        auto n = tls_->open(frame, sizeof frame);
        if (n < 0 && errno == EPROTO)
          why = "TLS: " + tls_->why();
        else if ((n < static_cast<ssize_t>(header_size) || !answer_is_one() ||
                  static_cast<size_t>(n) != header_size + length) &&
                 why.empty())
          why = "an answer to the request for shared memory that is not one";
      }
    }
  } else if (read_exactly(frame, header_size) && answer_is_one()) {
    read_exactly(frame + header_size, length);
  }
  if (!why.empty() || length == 0) {
    // Declined (the node says why in its log), or no answer: the socket carries the frames.
    if (passed >= 0)
      ::close(passed);
    return false;
  }
  if (passed < 0) {
    why = "shared memory offered without its descriptor";
    return false;
  }
  try {
    auto rings = shared_rings::adopt(passed, get_le<uint64_t>(frame + header_size));
    std::lock_guard<std::mutex> lk{write_mtx_};
    use_rings(std::move(rings));
  } catch (const error& e) {
    why = e.what();
    return false;
  }
  return true;
}

std::vector<char> serialize_message(caf::actor_system& sys, const caf::message& msg,
                                    std::string& why) {
  std::vector<char> buf;
  caf::binary_serializer sink{sys, buf};
  auto copy = msg;
  if (auto err = sink(copy)) {
    why = "cannot serialise (" + to_string(msg) + "): " + sys.render(err);
    buf.clear();
  }
  return buf;
}

} // namespace troupe
