#include "actors/cluster/link_client.hpp"

#include "actors/cluster/remoting.hpp"
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

// -- link_client --------------------------------------------------------------------------

link_client::link_client(std::unique_ptr<link_socket> socket, std::string name)
  : name_(std::move(name)), socket_(std::move(socket)) {}

std::shared_ptr<link_client> link_client::open(const std::string& host, uint16_t port,
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
  // A node that closed the connection refused it, whether its close came before the hello
  // went (the write fails) or after (the read finds no hello back).
  if (!socket->write(link_socket::hello, 0, 0, std::vector<char>(token.begin(), token.end())))
    throw error{errc::invalid_argument,
                name + " refused the call link (it closed the connection before the hello)"};
  if (!socket->wait(
        std::max(left, std::chrono::milliseconds(1)), [] { return false; }, -1, true))
    throw error{errc::worker_died, name + ": no answer to the call link's hello in time"};
  if (!socket->read(ack, why) || ack.type != link_socket::hello)
    throw error{errc::invalid_argument,
                name + " refused the call link (" + (why.empty() ? "not a hello" : why) + ")"};
  if (shared_memory && socket->is_local() && !socket->ask_rings(deadline, why) && !why.empty())
    throw error{errc::worker_died, name + ": the call link's shared memory: " + why};
  return std::shared_ptr<link_client>{new link_client(std::move(socket), std::move(name))};
}

link_client::~link_client() {
  close();
}

void link_client::start(caf::actor_system& sys, std::shared_ptr<std::atomic<int>> helpers) {
  if (thread_.joinable())
    return;
  sys_ = &sys;
  helpers_ = std::move(helpers);
  thread_ = std::thread{[this] { run(); }};
}

bool link_client::forward(uint64_t worker, const caf::mailbox_element& element,
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

bool link_client::owes(uint64_t worker) {
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

void link_client::forget(uint64_t worker) {
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

void link_client::flush(std::function<void()> then) {
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

bool link_client::pump() {
  std::unique_lock<std::mutex> reading{read_mtx_, std::try_to_lock};
  if (!reading || broken_ || !socket_->readable())
    return false;
  bool any = false;
  while (!broken_ && socket_->readable())
    any = take() || any;
  return any;
}

void link_client::helpers_left() {
  std::lock_guard<std::mutex> lk{mtx_};
  call_reader();
}

bool link_client::reader_needed() const {
  return (!routes_.empty() || !flushes_.empty()) && (!helpers_ || helpers_->load() == 0);
}

void link_client::call_reader() {
  if (reader_asleep_ && reader_needed())
    wake_.notify_one();
}

bool link_client::take() {
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

void link_client::broke(const std::string& why) {
  std::lock_guard<std::mutex> reading{read_mtx_};
  if (!broken_)
    fail(why);
}

void link_client::fail(const std::string& why) {
  why_ = why;
  broken_ = true;
  socket_->shut();
  std::lock_guard<std::mutex> lk{mtx_};
  wake_.notify_one(); // the reader reports it
}

void link_client::run() {
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

void link_client::lost(const std::string& why) {
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

void link_client::close() {
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

void link_set::add(const std::shared_ptr<link_client>& link, caf::actor_system& sys) {
  link->start(sys, helpers_);
  std::lock_guard<std::mutex> lk{mtx_};
  for (auto& weak : links_)
    if (weak.lock() == link)
      return;
  links_.erase(std::remove_if(links_.begin(), links_.end(),
                              [](const std::weak_ptr<link_client>& l) { return l.expired(); }),
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

caf::strong_actor_ptr make_link_stub(caf::actor_system& sys, std::shared_ptr<link_client> link,
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

} // namespace troupe
