#include "kernels/cuda/nccl_communicator.hpp"

#include "kernels/cuda/check.hpp"
#include "troupe/errors.hpp"

#include <cstring>
#include <thread>

namespace troupe {

std::string nccl_communicator::make_id() {
  ncclUniqueId id;
  TROUPE_CUDA_CHECK(ncclGetUniqueId(&id));
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (auto c : id.internal) {
    auto b = static_cast<unsigned char>(c);
    out.push_back(digits[b >> 4]);
    out.push_back(digits[b & 15]);
  }
  return out;
}

nccl_communicator::nccl_communicator(int rank, int world, const std::string& id,
                                     std::chrono::milliseconds timeout)
  : rank_(rank), world_(world), timeout_(timeout) {
  ncclUniqueId unique;
  if (id.size() != 2 * sizeof(unique.internal))
    throw error{errc::invalid_argument, "NCCL unique id of " + std::to_string(id.size()) +
                                          " hex digits, expected " +
                                          std::to_string(2 * sizeof(unique.internal))};
  for (size_t i = 0; i < sizeof(unique.internal); ++i)
    unique.internal[i] = static_cast<char>(std::stoi(id.substr(2 * i, 2), nullptr, 16));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  auto started = ncclCommInitRankConfig(&comm_, world, unique, rank, &config);
  if (started != ncclSuccess && started != ncclInProgress)
    TROUPE_CUDA_CHECK(started);
  wait("joining the communicator", [] { return true; });
}

nccl_communicator::~nccl_communicator() {
  if (comm_ == nullptr)
    return;
  // Finalizing a non-blocking communicator is itself asynchronous: it is polled to its end
  // (bounded like every call) before the communicator may be destroyed; one that does not
  // finish, because a peer is gone, is aborted instead.
  auto finalized = ncclCommFinalize(comm_);
  if (finalized != ncclSuccess && finalized != ncclInProgress) {
    abort();
    return;
  }
  try {
    wait("finalizing", [] { return true; });
  } catch (...) {
    return; // wait aborted it
  }
  ncclCommDestroy(comm_);
}

template <class Done>
void nccl_communicator::wait(const char* what, Done done) {
  auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    TROUPE_CUDA_CHECK(ncclCommGetAsyncError(comm_, &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      abort();
      TROUPE_CUDA_CHECK(state);
    }
    if (state == ncclSuccess && done())
      return;
    if (abort_requested_.load()) {
      abort();
      std::lock_guard<std::mutex> lk{why_mtx_};
      throw error{errc::worker_died,
                  "NCCL rank " + std::to_string(rank_) + ": " + what + " aborted: " + why_};
    }
    if (std::chrono::steady_clock::now() > deadline) {
      abort();
      throw error{errc::worker_died, "NCCL rank " + std::to_string(rank_) + " of " +
                                       std::to_string(world_) + ": " + what + " took over " +
                                       std::to_string(timeout_.count()) +
                                       " ms; a peer is gone (communicator aborted)"};
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void nccl_communicator::all_reduce(float* data, std::size_t count, cudaStream_t stream) {
  if (comm_ == nullptr)
    throw error{errc::worker_died, "NCCL communicator was aborted"};
  finish("an all-reduce", ncclAllReduce(data, data, count, ncclFloat32, ncclSum, comm_, stream),
         stream);
}

void nccl_communicator::broadcast(void* data, std::size_t bytes, int root, cudaStream_t stream) {
  if (comm_ == nullptr)
    throw error{errc::worker_died, "NCCL communicator was aborted"};
  finish("a broadcast", ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, stream), stream);
}

void nccl_communicator::finish(const char* what, ncclResult_t queued, cudaStream_t stream) {
  if (queued != ncclSuccess && queued != ncclInProgress)
    TROUPE_CUDA_CHECK(queued);
  wait(what, [stream] {
    auto e = cudaStreamQuery(stream);
    if (e == cudaErrorNotReady)
      return false;
    TROUPE_CUDA_CHECK(e);
    return true;
  });
}

void nccl_communicator::request_abort(const std::string& why) noexcept {
  try {
    std::lock_guard<std::mutex> lk{why_mtx_};
    why_ = why;
  } catch (...) {
    // The flag alone still aborts; only the reason is lost.
  }
  abort_requested_.store(true);
}

void nccl_communicator::abort() noexcept {
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
}

} // namespace troupe
