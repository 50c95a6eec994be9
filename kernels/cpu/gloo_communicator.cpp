#include "kernels/cpu/gloo_communicator.hpp"

#include "troupe/errors.hpp"

#include <gloo/allreduce.h>
#include <gloo/context.h>
#include <gloo/math.h>
#include <gloo/transport/tcp/device.h>

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

template <class F>
auto guarded(const char* what, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    throw error{errc::worker_error, std::string{"gloo "} + what + ": " + e.what()};
  }
}

} // namespace

struct gloo_communicator::impl {
  std::shared_ptr<bootstrapped_context> context;
  std::chrono::milliseconds timeout;
};

gloo_communicator::gloo_communicator(int rank, int size, const std::string& host,
                                     std::chrono::milliseconds timeout)
  : rank_(rank), size_(size), impl_(std::make_unique<impl>()) {
  impl_->timeout = timeout;
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
                                          " address lists for a group of " +
                                          std::to_string(size_)};
  guarded("connect", [&] {
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_)
        continue;
      auto& mine = table[static_cast<size_t>(peer)][static_cast<size_t>(rank_)];
      impl_->context->transport().getPair(peer)->connect(std::vector<char>(mine.begin(), mine.end()));
    }
    return 0;
  });
}

void gloo_communicator::all_reduce(float* data, size_t count) {
  if (size_ == 1 || count == 0)
    return;
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
