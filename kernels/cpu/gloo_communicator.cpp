#include "kernels/cpu/gloo_communicator.hpp"

#include "troupe/errors.hpp"

#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/math.h>
#include <gloo/transport/tcp/device.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>

#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>

namespace troupe {

namespace {

/// Gloo's Context keeps its transport protected; this one fills it from addresses
/// exchanged by the executor instead of a rendezvous store.
class bootstrapped_context : public gloo::Context {
public:
  bootstrapped_context(int rank, int size, std::shared_ptr<gloo::transport::Device> dev)
    : gloo::Context(rank, size) {
    device_ = std::move(dev);
    transportContext_ = device_->createContext(rank, size);
  }

  /// Sets the deadline of new pairs (connecting) and of collectives.
  void set_timeouts(std::chrono::milliseconds timeout) {
    setTimeout(timeout);
    transportContext_->setTimeout(timeout);
  }

  gloo::transport::Context& transport() {
    return *transportContext_;
  }
};

/// The socket address at the start of a Gloo TCP pair address (its layout: a
/// `sockaddr_storage`, then a sequence number).
std::optional<sockaddr_storage> socket_address(const std::string& pair_address) {
  if (pair_address.size() < sizeof(sockaddr_storage))
    return std::nullopt;
  sockaddr_storage ss{};
  std::memcpy(&ss, pair_address.data(), sizeof ss);
  if (ss.ss_family != AF_INET && ss.ss_family != AF_INET6)
    return std::nullopt;
  return ss;
}

bool same_endpoint(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family)
    return false;
  if (a.ss_family == AF_INET) {
    auto& x = reinterpret_cast<const sockaddr_in&>(a);
    auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  auto& x = reinterpret_cast<const sockaddr_in6&>(a);
  auto& y = reinterpret_cast<const sockaddr_in6&>(b);
  return x.sin6_port == y.sin6_port &&
         std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof x.sin6_addr) == 0;
}

/// Shuts down this process's sockets that end at one of `local` here or of `remote` there.
void shut_sockets(const std::vector<sockaddr_storage>& local,
                  const std::vector<sockaddr_storage>& remote) {
  std::error_code ec;
  for (auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    int fd = -1;
    try {
      fd = std::stoi(entry.path().filename().string());
    } catch (...) {
      continue;
    }
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode))
      continue;
    sockaddr_storage here{}, there{};
    socklen_t here_len = sizeof here, there_len = sizeof there;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&here), &here_len) != 0 ||
        getpeername(fd, reinterpret_cast<sockaddr*>(&there), &there_len) != 0)
      continue; // not a connected socket (the listener, say)
    bool ours = false;
    for (auto& l : local)
      ours = ours || same_endpoint(here, l);
    for (auto& r : remote)
      ours = ours || same_endpoint(there, r);
    if (ours)
      ::shutdown(fd, SHUT_RDWR);
  }
}

template <class F>
auto guarded(const char* what, F&& f) {
  try {
    return f();
  } catch (const gloo::IoException& e) {
    // A connection of the group closed or went silent: a peer is gone (a dead worker,
    // which the executor learns of from its monitor too).
    throw error{errc::worker_died, std::string{"gloo "} + what + ": " + e.what()};
  } catch (const std::exception& e) {
    throw error{errc::worker_error, std::string{"gloo "} + what + ": " + e.what()};
  }
}

} // namespace

struct gloo_communicator::impl {
  std::shared_ptr<bootstrapped_context> context;
  std::chrono::milliseconds timeout;
  /// Guards what follows, so that an abort never meets pairs being made.
  std::mutex mtx;
  /// Where this rank's pairs listen, and where its peers' pairs with it do: a pair's
  /// socket ends at one or the other (accepted here, or connected there). Empty until the
  /// group is connected.
  std::vector<sockaddr_storage> mine;
  std::vector<sockaddr_storage> peers;
  std::atomic<bool> aborted{false};
  std::string why;

  /// The error of a reduction after `abort`.
  error abort_error() {
    std::lock_guard<std::mutex> lk{mtx};
    return error{errc::worker_died, "gloo all_reduce aborted: " + why};
  }
};

gloo_communicator::gloo_communicator(int rank, int size, const std::string& host,
                                     std::chrono::milliseconds timeout)
  : rank_(rank), size_(size), impl_(std::make_unique<impl>()) {
  impl_->timeout = timeout;
  // Gloo writes with writev, which raises SIGPIPE once a peer is gone (and would end the
  // process). Blocked in this thread, and so in the device's loop thread that inherits the
  // mask, such a write fails with EPIPE instead and the reduction reports the dead peer.
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  guarded("device", [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    impl_->context = std::make_shared<bootstrapped_context>(rank, size, dev);
    impl_->context->set_timeouts(timeout);
    return 0;
  });
}

gloo_communicator::~gloo_communicator() = default;

std::vector<std::string> gloo_communicator::prepare() {
  return guarded("prepare", [&] {
    std::vector<std::string> addresses(static_cast<size_t>(size_));
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_)
        continue;
      auto& pair = impl_->context->transport().createPair(peer);
      auto bytes = pair->address().bytes();
      addresses[static_cast<size_t>(peer)].assign(bytes.begin(), bytes.end());
    }
    return addresses;
  });
}

void gloo_communicator::connect(const std::vector<std::vector<std::string>>& table) {
  if (table.size() != static_cast<size_t>(size_))
    throw error{errc::invalid_argument, "gloo connect: " + std::to_string(table.size()) +
                                          " address lists for a group of " + std::to_string(size_)};
  guarded("connect", [&] {
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_)
        continue;
      auto& mine = table[static_cast<size_t>(peer)][static_cast<size_t>(rank_)];
      impl_->context->transport().getPair(peer)->connect(
        std::vector<char>(mine.begin(), mine.end()));
    }
    return 0;
  });
  std::lock_guard<std::mutex> lk{impl_->mtx};
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_)
      continue;
    if (auto here = socket_address(table[static_cast<size_t>(rank_)][static_cast<size_t>(peer)]))
      impl_->mine.push_back(*here);
    if (auto there = socket_address(table[static_cast<size_t>(peer)][static_cast<size_t>(rank_)]))
      impl_->peers.push_back(*there);
  }
}

void gloo_communicator::all_reduce(float* data, size_t count) {
  if (size_ == 1 || count == 0)
    return;
  if (impl_->aborted.load())
    throw impl_->abort_error();
  try {
    reduce(data, count);
  } catch (const error&) {
    if (impl_->aborted.load())
      throw impl_->abort_error();
    throw;
  }
}

void gloo_communicator::broadcast(void* data, size_t bytes, int root) {
  if (size_ == 1 || bytes == 0)
    return;
  if (impl_->aborted.load())
    throw impl_->abort_error();
  guarded("broadcast", [&] {
    gloo::BroadcastOptions opts(impl_->context);
    opts.setOutput(static_cast<char*>(data), bytes);
    opts.setRoot(root);
    opts.setTimeout(impl_->timeout);
    gloo::broadcast(opts);
    return 0;
  });
}

void gloo_communicator::abort(const std::string& why) noexcept {
  std::lock_guard<std::mutex> lk{impl_->mtx};
  if (impl_->aborted.exchange(true))
    return;
  impl_->why = why;
  if (impl_->mine.empty() && impl_->peers.empty())
    return; // not connected: the next reduction fails on the flag
  // Gloo has no abort a reduction can see, but its pairs fail the operations waiting on
  // them when their connection closes, as when a peer is killed: so close them.
  try {
    shut_sockets(impl_->mine, impl_->peers);
  } catch (...) {
    // Then the reduction ends at the group's timeout instead.
  }
}

void gloo_communicator::reduce(float* data, size_t count) {
  guarded("all_reduce", [&] {
    gloo::AllreduceOptions opts(impl_->context);
    opts.setOutput(data, count);
    opts.setReduceFunction(
      static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    opts.setTimeout(impl_->timeout);
    gloo::allreduce(opts);
    return 0;
  });
}

} // namespace troupe
