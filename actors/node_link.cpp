#include "actors/node_link.hpp"

#include "actors/companion.hpp"
#include "kernels/log.hpp"
#include "actors/remoting.hpp"
#include "messages/messages.hpp"
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

/// Each way, for links through shared memory: far above a step's request (a batch's
/// tokens) yet small to keep mapped; a larger frame passes in parts.
constexpr uint64_t ring_capacity = uint64_t{1} << 20;

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
  // A small frame goes as one record; a large one in parts, so that its ciphertext is never
  // all in memory at once.
  constexpr size_t part = size_t{1} << 20;
  sealed_.clear();
  bool ok = true;
  if (payload.size() <= part) {
    plain_.assign(header, header + header_size);
    plain_.insert(plain_.end(), payload.begin(), payload.end());
    ok = tls_->seal(plain_.data(), plain_.size(), sealed_);
  } else {
    ok = tls_->seal(header, header_size, sealed_);
    for (size_t at = 0; ok && at < payload.size(); at += part) {
      ok = tls_->seal(payload.data() + at, std::min(part, payload.size() - at), sealed_);
      iovec all{sealed_.data(), sealed_.size()};
      ok = ok && send_all(&all, 1);
      sealed_.clear();
    }
  }
  iovec all{sealed_.data(), sealed_.size()};
  if (!ok || !send_all(&all, 1)) {
    shut(); // part of a frame may have gone: nothing may follow it
    return false;
  }
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

// -- node_link --------------------------------------------------------------------------

node_link::node_link(std::unique_ptr<link_socket> socket, std::string name)
  : name_(std::move(name)), socket_(std::move(socket)) {}

std::shared_ptr<node_link> node_link::open(const std::string& host, uint16_t port,
                                           const std::string& local_address, bool shared_memory,
                                           const link_credentials& credentials,
                                           const std::string& token, timeout_type linger,
                                           timeout_type stall,
                                           std::chrono::steady_clock::time_point deadline) {
  auto name = "node " + host + ":" + std::to_string(port);
  std::unique_ptr<tls_session> tls;
  // Connects with `connect` and proves the credentials on the connection.
  auto dial = [&](auto connect, const std::string& where,
                  std::chrono::steady_clock::time_point until) {
    if (!credentials.tls)
      return connect(until);
    int fd = -1;
    try {
      fd = connect(until);
      tls = tls_connect(fd, credentials.tls, where, until);
    } catch (...) {
      if (fd >= 0)
        ::close(fd);
      throw;
    }
    return fd;
  };
  int fd = -1;
  if (!local_address.empty()) {
    // Half the time left at most, so that TCP still has the rest when the local socket
    // does not answer in time.
    auto now = std::chrono::steady_clock::now();
    try {
      fd = dial(
        [&](auto until) {
          return credentials.tls ? connect_local(local_address, until)
                                 : dial_local_link(local_address, credentials.secret, until);
        },
        "the node at " + local_address, now + (deadline - now) / 2);
    } catch (const error& e) {
      // Nothing there (another host, or another network namespace), or a refusal or
      // silence there: TCP, as from anywhere else, says what it has to say.
      get_logger("troupe.executor")
        ->debug("{}: no call link at {} ({}); over TCP", name, local_address, e.what());
    }
  }
  if (fd < 0)
    fd = dial(
      [&](auto until) {
        return credentials.tls ? connect_node(host, port, until)
                               : dial_node(host, port, credentials.secret, until, true);
      },
      name, deadline);
  // Replies are bounded by the node's own bound on what it reads, which it proved to know
  // the secret to set; this one only keeps a length from being absurd.
  auto socket = std::make_unique<link_socket>(fd, linger, uint64_t{1} << 32, stall, std::move(tls));
  link_socket::frame ack;
  std::string why;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
    deadline - std::chrono::steady_clock::now());
  if (!socket->write(link_socket::hello, 0, 0, std::vector<char>(token.begin(), token.end())) ||
      !socket->wait(
        std::max(left, std::chrono::milliseconds(1)), [] { return false; }, -1, true))
    throw error{errc::worker_died, name + ": no answer to the call link's hello in time"};
  if (!socket->read(ack, why) || ack.type != link_socket::hello)
    throw error{errc::invalid_argument,
                name + " refused the call link (" + (why.empty() ? "not a hello" : why) + ")"};
  if (shared_memory && socket->is_local() && !socket->ask_rings(deadline, why) && !why.empty())
    throw error{errc::worker_died, name + ": the call link's shared memory: " + why};
  return std::shared_ptr<node_link>{new node_link(std::move(socket), std::move(name))};
}

node_link::~node_link() {
  close();
}

void node_link::start(caf::actor_system& sys, std::shared_ptr<std::atomic<int>> helpers) {
  if (thread_.joinable())
    return;
  sys_ = &sys;
  helpers_ = std::move(helpers);
  thread_ = std::thread{[this] { run(); }};
}

bool node_link::forward(uint64_t worker, const caf::mailbox_element& element,
                        const caf::message& content) {
  if (!element.stages.empty())
    return false; // a forwarding chain: BASP carries it
  std::string why;
  auto payload = serialize_message(*sys_, content, why);
  if (!why.empty())
    return false;
  uint64_t key = 0;
  {
    std::lock_guard<std::mutex> lk{mtx_};
    if (closed_ || broken_ || socket_->is_shut())
      return false;
    // A message that expects no response travels under key 0.
    if (element.mid.is_request()) {
      key = next_key_++;
      routes_.emplace(key, route{element.sender, element.mid, worker});
    }
    call_reader();
  }
  // A failed write breaks the link: its reader then fails what is owed.
  if (!socket_->write(link_socket::request, key, worker, payload))
    broke("a write to the node failed or stalled");
  return true;
}

bool node_link::owes(uint64_t worker) {
  std::lock_guard<std::mutex> lk{mtx_};
  for (auto& entry : routes_)
    if (entry.second.worker == worker)
      return true;
  return false;
}

namespace {

/// Answers a request whose worker is gone, as BASP does; `why`, when given, says how (the
/// link closed under it).
void answer_down(const caf::strong_actor_ptr& sender, caf::message_id mid,
                 const std::string& why = {}) {
  if (!sender)
    return;
  auto err = why.empty() ? caf::make_error(caf::sec::request_receiver_down)
                         : caf::make_error(caf::sec::request_receiver_down, why);
  sender->enqueue(caf::make_mailbox_element(nullptr, mid.response_id(), {}, std::move(err)),
                  nullptr);
}

} // namespace

void node_link::forget(uint64_t worker) {
  std::vector<route> dropped;
  {
    std::lock_guard<std::mutex> lk{mtx_};
    for (auto i = routes_.begin(); i != routes_.end();)
      if (i->second.worker == worker && !i->second.delivering) {
        dropped.push_back(std::move(i->second));
        i = routes_.erase(i);
      } else {
        ++i;
      }
  }
  for (auto& r : dropped)
    answer_down(r.sender, r.mid);
}

void node_link::flush(std::function<void()> then) {
  uint64_t ping = 0;
  {
    std::lock_guard<std::mutex> lk{mtx_};
    if (!closed_) {
      ping = next_ping_++;
      flushes_.emplace(ping, std::move(then));
      call_reader();
    }
  }
  if (ping == 0)
    then();
  else if (!socket_->write(link_socket::ping, ping, 0, {}))
    broke("a write to the node failed or stalled"); // its reader runs `then` as it closes
}

bool node_link::pump() {
  std::unique_lock<std::mutex> reading{read_mtx_, std::try_to_lock};
  if (!reading || broken_ || !socket_->readable())
    return false;
  bool any = false;
  while (!broken_ && socket_->readable())
    any = take() || any;
  return any;
}

void node_link::helpers_left() {
  std::lock_guard<std::mutex> lk{mtx_};
  call_reader();
}

bool node_link::reader_needed() const {
  return (!routes_.empty() || !flushes_.empty()) && (!helpers_ || helpers_->load() == 0);
}

void node_link::call_reader() {
  if (reader_asleep_ && reader_needed())
    wake_.notify_one();
}

bool node_link::take() {
  try {
    link_socket::frame f;
    std::string why;
    if (!socket_->read(f, why)) {
      fail(why);
      return false;
    }
    if (f.type == link_socket::pong) {
      std::function<void()> then;
      {
        std::lock_guard<std::mutex> lk{mtx_};
        auto i = flushes_.find(f.key);
        if (i != flushes_.end()) {
          then = std::move(i->second);
          flushes_.erase(i);
        }
      }
      if (then)
        then();
      return true;
    }
    if (f.type != link_socket::reply) {
      fail("the node sent a frame that is not a reply");
      return false;
    }
    caf::message reply;
    caf::binary_deserializer source{*sys_, f.payload};
    if (auto err = source(reply))
      reply = caf::make_message(caf::make_error(
        errc::worker_error, "a reply that does not deserialise here: " + sys_->render(err)));
    // Owed until handed on: a death handled meanwhile waits for it (`owes`), and `forget`
    // leaves it to this response.
    route to;
    {
      std::lock_guard<std::mutex> lk{mtx_};
      auto i = routes_.find(f.key);
      if (i == routes_.end())
        return true; // forgotten: its worker died, and its request failed
      i->second.delivering = true;
      to = i->second;
    }
    if (to.sender)
      to.sender->enqueue(
        caf::make_mailbox_element(nullptr, to.mid.response_id(), {}, std::move(reply)), nullptr);
    std::lock_guard<std::mutex> lk{mtx_};
    routes_.erase(f.key);
    return true;
  } catch (const std::exception& e) {
    fail(std::string{"reading a reply failed: "} + e.what());
    return false;
  }
}

void node_link::broke(const std::string& why) {
  std::lock_guard<std::mutex> reading{read_mtx_};
  if (!broken_)
    fail(why);
}

void node_link::fail(const std::string& why) {
  why_ = why;
  broken_ = true;
  socket_->shut();
  std::lock_guard<std::mutex> lk{mtx_};
  wake_.notify_one(); // the reader reports it
}

void node_link::run() {
  // Between replies the link's thread sleeps on `wake_`: it reads only while something is
  // owed and no caller reads for it, so that a blocking call costs no hand-off.
  auto alone = [this] { return !helpers_ || helpers_->load() == 0; };
  // Whether the last wait ran out: a reply that never comes (its worker died, until the
  // death is handled) then costs no more lingering.
  bool waited = false;
  while (!broken_) {
    {
      std::unique_lock<std::mutex> lk{mtx_};
      reader_asleep_ = true;
      wake_.wait(lk, [&] { return broken_ || reader_needed(); });
      reader_asleep_ = false;
    }
    if (broken_)
      break;
    // A short timeout: a caller that starts to read meanwhile takes the replies, and this
    // thread goes back to sleep rather than wait here for data that may not come.
    auto fresh = !waited;
    waited = true;
    if (!socket_->wait(std::chrono::milliseconds(10), [&] { return fresh && alone(); })) {
      if (socket_->is_shut()) {
        std::lock_guard<std::mutex> reading{read_mtx_};
        if (!broken_)
          fail("closed");
      }
      continue;
    }
    // A caller may have read the frames meanwhile (see `pump`); none stays read ahead
    // while this thread waits on the socket.
    std::lock_guard<std::mutex> reading{read_mtx_};
    while (!broken_ && socket_->readable())
      take();
    waited = false;
  }
  lost(why_);
}

void node_link::lost(const std::string& why) {
  std::unordered_map<uint64_t, route> owed;
  std::map<uint64_t, std::function<void()>> flushes;
  {
    std::lock_guard<std::mutex> lk{mtx_};
    closed_ = true;
    owed.swap(routes_);
    flushes.swap(flushes_);
  }
  socket_->shut();
  if (!owed.empty() || why != "closed")
    get_logger("troupe.executor")
      ->warn("the call link to {} closed ({}); {} request(s) on it fail, later calls go over "
             "BASP",
             name_, why, owed.size());
  for (auto& entry : owed)
    answer_down(entry.second.sender, entry.second.mid,
                "its call link to " + name_ + " closed: " + why);
  for (auto& entry : flushes)
    entry.second();
}

void node_link::close() {
  // Shut first: a reader stalled mid-frame returns and lets go of the lock.
  socket_->shut();
  {
    std::lock_guard<std::mutex> reading{read_mtx_};
    if (!broken_)
      fail("closed");
  }
  if (thread_.joinable())
    thread_.join();
  std::lock_guard<std::mutex> lk{mtx_};
  closed_ = true;
}

// -- link_set ---------------------------------------------------------------------------

void link_set::add(const std::shared_ptr<node_link>& link, caf::actor_system& sys) {
  link->start(sys, helpers_);
  std::lock_guard<std::mutex> lk{mtx_};
  for (auto& weak : links_)
    if (weak.lock() == link)
      return;
  links_.erase(std::remove_if(links_.begin(), links_.end(),
                              [](const std::weak_ptr<node_link>& l) { return l.expired(); }),
               links_.end());
  links_.push_back(link);
}

link_set::helping::~helping() {
  if (set_)
    set_->leave();
}

link_set::helping link_set::help() {
  helpers_->fetch_add(1);
  return helping{this};
}

void link_set::leave() {
  if (helpers_->fetch_sub(1) != 1)
    return;
  // The last caller reading stopped: the links' threads read what is still owed.
  std::lock_guard<std::mutex> lk{mtx_};
  for (auto& weak : links_)
    if (auto link = weak.lock())
      link->helpers_left();
}

bool link_set::pump() {
  bool any = false;
  std::unique_lock<std::mutex> lk{mtx_, std::try_to_lock};
  if (!lk)
    return false; // another caller reads
  for (auto& weak : links_)
    if (auto link = weak.lock())
      any = link->pump() || any;
  return any;
}

// -- link stubs -------------------------------------------------------------------------

caf::strong_actor_ptr make_link_stub(caf::actor_system& sys, std::shared_ptr<node_link> link,
                                     caf::actor worker,
                                     std::function<bool(const caf::message&)> by_proxy) {
  auto id = worker.id();
  // Runs on the sender's thread, as an enqueue to the worker's proxy would.
  return spawn_companion(sys, [link = std::move(link), worker = std::move(worker), id,
                               by_proxy = std::move(by_proxy)](caf::mailbox_element_ptr x) {
    auto content = x->copy_content_to_message();
    if (by_proxy(content) || !link->forward(id, *x, content))
      caf::actor_cast<caf::abstract_actor*>(worker)->enqueue(std::move(x), nullptr);
  });
}

// -- link_readers -----------------------------------------------------------------------

link_readers::member::member(std::shared_ptr<link_readers> readers) : readers_(std::move(readers)) {
  readers_->count(1, 0);
}

link_readers::member::~member() {
  readers_->count(-1, reading_ ? -1 : 0);
}

void link_readers::member::reading(bool on) {
  if (reading_ == on)
    return;
  reading_ = on;
  readers_->count(0, on ? 1 : -1);
}

void link_readers::count(int members, int reading) {
  bool woke;
  {
    std::lock_guard<std::mutex> lk{count_mtx_};
    members_ += members;
    reading_ += reading;
    bool quiet = members_ > 0 && reading_ == members_;
    woke = quiet_.exchange(quiet) != quiet;
  }
  // Either way the links' threads change how they wait: on the socket, or on their eventfd
  // alone while the workers read.
  if (!woke)
    return;
  std::lock_guard<std::mutex> lk{links_mtx_};
  for (auto* link : links_)
    link->wake();
}

bool link_readers::pump() {
  std::unique_lock<std::mutex> lk{links_mtx_, std::try_to_lock};
  if (!lk)
    return false; // another worker reads
  bool any = false;
  for (auto* link : links_)
    any = link->pump() || any;
  return any;
}

void link_readers::add(link_server* link) {
  std::lock_guard<std::mutex> lk{links_mtx_};
  links_.push_back(link);
}

void link_readers::remove(link_server* link) {
  std::lock_guard<std::mutex> lk{links_mtx_};
  links_.erase(std::remove(links_.begin(), links_.end(), link), links_.end());
}

// -- link_server ------------------------------------------------------------------------

link_server::link_server(caf::actor_system& sys, int fd, std::unique_ptr<tls_session> tls,
                         std::string peer, find_fn find, timeout_type linger, uint64_t max_payload,
                         timeout_type timeout, std::shared_ptr<std::atomic<uint64_t>> requests,
                         std::shared_ptr<link_readers> readers, std::shared_ptr<spdlog::logger> log)
  : sys_(sys), peer_(std::move(peer)), find_(std::move(find)), log_(std::move(log)),
    linger_(linger), timeout_(timeout), max_payload_(max_payload),
    socket_(std::make_shared<link_socket>(fd, linger, max_payload, timeout, std::move(tls))),
    requests_(std::move(requests)), readers_(std::move(readers)) {
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0)
    throw error{errc::worker_error,
                std::string{"cannot serve a call link: eventfd: "} + std::strerror(errno)};
  // A worker's reply is written by the worker's own thread, in the order it replies.
  replies_ = spawn_companion(sys, [this, socket = socket_](caf::mailbox_element_ptr reply) {
    if (!reply->mid.is_response())
      return;
    auto key = reply->mid.request_id().integer_value();
    std::string why;
    auto bytes = serialize_message(sys_, reply->move_content_to_message(), why);
    if (!why.empty())
      bytes = serialize_message(
        sys_, caf::make_message(caf::make_error(errc::worker_error, "the reply " + why)), why);
    // A failed write shut the link: the thread, which may sleep while workers read, ends it.
    bool sent = socket->write(link_socket::reply, key, 0, bytes);
    if ((in_flight_.fetch_sub(1) == 1 && awaits_replies_.load()) || !sent)
      wake();
  });
  thread_ = std::thread{[this] { run(); }};
}

link_server::~link_server() {
  stop();
  if (wake_fd_ >= 0)
    ::close(wake_fd_);
}

void link_server::stop() {
  shut();
  if (thread_.joinable())
    thread_.join();
  if (replies_) {
    end_companion(replies_);
    replies_ = nullptr;
  }
}

void link_server::shut() {
  socket_->shut();
  wake();
}

void link_server::wake() {
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
}

bool link_server::pump() {
  std::unique_lock<std::mutex> reading{read_mtx_, std::try_to_lock};
  if (!reading || !opened() || socket_->is_shut())
    return false;
  // Only frames that came whole: a worker never waits on the socket for the rest of one
  // (the thread reads a frame too large to come whole once the workers stop reading).
  bool any = false;
  while (socket_->whole_frame() && take(true))
    any = true;
  if (socket_->is_shut())
    wake(); // a frame or a write ended the link: the thread reports it
  return any;
}

void link_server::end(std::string why) {
  if (why_.empty())
    why_ = std::move(why);
  shut(); // the thread reports it
}

bool link_server::next() {
  auto idle = [this] { return in_flight_.load() == 0; };
  auto drain = [this] {
    uint64_t count;
    [[maybe_unused]] auto n = ::read(wake_fd_, &count, sizeof count);
  };
  for (;;) {
    if (socket_->is_shut())
      return false;
    if (readers_->quiet()) {
      // The workers read: this thread sleeps until one stops, or the link is shut.
      pollfd p{wake_fd_, POLLIN, 0};
      if (readers_->quiet() && !socket_->is_shut())
        while (::poll(&p, 1, -1) < 0 && errno == EINTR) {
        }
      drain();
      continue;
    }
    if (socket_->arrived())
      return true;
    // While a worker has a request, the next comes after its reply at the earliest. A reply
    // that computes little comes within microseconds: this thread waits for it awake, for
    // `linger_`, since waking it would cost tens of microseconds here; past that it sleeps
    // (the worker computes) until the reply is written, then lingers for the next request.
    if (!idle() &&
        linger_for(linger_, [&] { return idle() || socket_->arrived() || readers_->quiet(); }))
      continue;
    awaits_replies_ = true;
    auto came = socket_->wait(
      std::chrono::milliseconds(-1), [&] { return idle() && !readers_->quiet(); }, wake_fd_);
    awaits_replies_ = false;
    // Once the workers read, what came is theirs.
    if (came && !readers_->quiet())
      return true;
    if (!came)
      drain();
  }
}

void link_server::run() {
  link_socket::frame f;
  std::string why;
  // The hello: the lease's token (64 hex digits), within the connection timeout.
  auto refuse = [&](const std::string& reason) {
    log_->warn("refused a link from {}: {}", peer_, reason);
    socket_->shut();
    done_ = true;
  };
  socket_->bound(64);
  auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(timeout_);
  if (!socket_->wait(
        limit, [] { return false; }, -1, true) ||
      !socket_->read(f, why) || f.type != link_socket::hello)
    return refuse(why.empty() ? "no hello in time" : why);
  token_.assign(f.payload.begin(), f.payload.end());
  if (!find_(token_, 0).holds)
    return refuse("not the token of the lease");
  socket_->bound(max_payload_);
  socket_->write(link_socket::hello, 0, 0, {});
  opened_ = true;
  readers_->add(this);
  log_->info("link from {} opened", peer_);
  while (next()) {
    // A worker may have read the frames meanwhile (`pump`); none stays read ahead while
    // this thread waits on the socket.
    std::lock_guard<std::mutex> reading{read_mtx_};
    while (!socket_->is_shut() && socket_->readable() && take(false)) {
    }
  }
  readers_->remove(this);
  {
    std::lock_guard<std::mutex> reading{read_mtx_};
    log_->info("link from {} closed: {}", peer_, why_.empty() ? "closed" : why_);
  }
  done_ = true;
}

bool link_server::take(bool by_worker) {
  link_socket::frame f;
  std::string why;
  if (!socket_->read(f, why)) {
    end(why);
    return false;
  }
  if (f.type == link_socket::ping) {
    requests_seen_ = true;
    socket_->write(link_socket::pong, f.key, 0, {});
    return true;
  }
  if (f.type == link_socket::share) {
    // Only first, before anything is owed over the socket: the frames then move to the
    // rings at one point in both directions.
    if (requests_seen_ || socket_->has_rings()) {
      end("shared memory asked for after the first request");
      return false;
    }
    std::string declined;
    if (!socket_->offer_rings(ring_capacity, declined)) {
      end("the answer to a request for shared memory could not be written");
      return false;
    }
    if (declined.empty())
      log_->debug("link from {} goes through shared memory", peer_);
    else
      log_->info("link from {} stays on its socket: {}", peer_, declined);
    // The thread may sleep on the socket alone: it waits again, on the rings' doorbell.
    wake();
    return true;
  }
  requests_seen_ = true;
  if (f.type != link_socket::request) {
    end("a frame that is not a request");
    return false;
  }
  // Keys are counters; one with high bits would set flags of CAF's message id.
  if ((f.key >> 48) != 0) {
    end("a request key out of range");
    return false;
  }
  auto found = find_(token_, f.target);
  if (!found.holds) {
    end("the lease has ended");
    return false;
  }
  // Answers a request (key 0 expects none) with an error.
  auto refuse = [&](caf::error err) {
    std::string ignored;
    if (f.key != 0)
      socket_->write(link_socket::reply, f.key, 0,
                     serialize_message(sys_, caf::make_message(std::move(err)), ignored));
    return true;
  };
  if (!found.worker) {
    // Dead or released since: answered as BASP answers a request to an actor that is
    // gone; the link goes on for the others.
    return refuse(caf::make_error(caf::sec::request_receiver_down));
  }
  caf::message request;
  caf::binary_deserializer source{sys_, f.payload};
  if (auto err = source(request))
    return refuse(caf::make_error(
      errc::bad_arguments, "the request does not deserialise on the node: " + sys_.render(err)));
  requests_->fetch_add(1, std::memory_order_relaxed);
  if (by_worker)
    readers_->read_one();
  // Key 0: a message that expects no response.
  if (f.key != 0)
    in_flight_.fetch_add(1);
  auto mid = f.key != 0 ? keyed_request_id(f.key) : caf::make_message_id();
  caf::actor_cast<caf::abstract_actor*>(found.worker)
    ->enqueue(caf::make_mailbox_element(replies_, mid, {}, std::move(request)), nullptr);
  return true;
}

} // namespace troupe
