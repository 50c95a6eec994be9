#include "actors/cluster/link_server.hpp"

#include "actors/companion.hpp"
#include "kernels/log.hpp"
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

/// Each way, for links through shared memory: far above a step's request (a batch's
/// tokens) yet small to keep mapped; a larger frame passes in parts.
constexpr uint64_t ring_capacity = uint64_t{1} << 20;

} // namespace

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
