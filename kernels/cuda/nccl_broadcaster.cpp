#include "kernels/cuda/nccl_broadcaster.hpp"

#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda_device.hpp"
#include "troupe/errors.hpp"

#include <algorithm>

namespace troupe {

namespace {

/// Makes a GPU current for a scope, then the caller's again, unless the caller's has no
/// context: a thread that never chose a GPU reads as GPU 0, and making that current would
/// create a context there (hundreds of MB on a GPU the process may not use).
class current_gpu {
public:
  explicit current_gpu(int32_t gpu) {
    TROUPE_CUDA_CHECK(cudaGetDevice(&before_));
    restore_ = before_ != gpu && cuda_device::has_context(before_);
    TROUPE_CUDA_CHECK(cudaSetDevice(gpu));
  }
  ~current_gpu() {
    if (restore_)
      cudaSetDevice(before_);
  }
  current_gpu(const current_gpu&) = delete;
  current_gpu& operator=(const current_gpu&) = delete;

private:
  int before_ = 0;
  bool restore_ = false;
};

} // namespace

nccl_broadcaster::nccl_broadcaster(int32_t gpu, std::chrono::milliseconds timeout)
  : gpu_(gpu), timeout_(timeout) {
  cuda_device::check(gpu);
  current_gpu on{gpu_};
  TROUPE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  // Before the meeting, not in the middle of an update, where a failure would leave the
  // other members waiting in a broadcast; and cudaFree would wait for the whole GPU.
  if (cudaMalloc(&staging_, piece) != cudaSuccess) {
    cudaGetLastError();
    cudaStreamDestroy(stream_);
    throw error{errc::memory_error, "weight-update group: no room for its " +
                                      std::to_string(piece >> 20) +
                                      " MiB staging buffer on cuda:" + std::to_string(gpu)};
  }
}

nccl_broadcaster::~nccl_broadcaster() {
  try {
    current_gpu on{gpu_};
    comm_.reset();
    cudaFree(staging_);
    cudaStreamDestroy(stream_);
  } catch (...) {
    // The GPU's context is gone, and what it held with it.
  }
}

void nccl_broadcaster::join(int rank, int world, const std::string& id) {
  current_gpu on{gpu_};
  try {
    comm_ = std::make_unique<nccl_communicator>(rank, world, id, timeout_);
  } catch (const error& e) {
    // NCCL's words for two members on one GPU ("invalid usage") do not say so.
    std::string what = e.what();
    if (what.find("invalid usage") == std::string::npos)
      throw;
    throw error{e.code(), what + " (member " + std::to_string(rank) +
                            " on cuda:" + std::to_string(gpu_) +
                            "; NCCL takes one member per GPU: is another member on it?)"};
  }
}

void nccl_broadcaster::broadcast(void* data, std::size_t bytes, int root, bool on_gpu) {
  if (!comm_)
    throw error{errc::invalid_argument, "NCCL broadcast before the group was joined"};
  current_gpu on{gpu_};
  bool sends = comm_->rank() == root;
  for (std::size_t done = 0; done < bytes; done += piece) {
    auto n = std::min(piece, bytes - done);
    auto* at = static_cast<char*>(data) + done;
    if (on_gpu) {
      comm_->broadcast(at, n, root, stream_);
      continue;
    }
    if (sends)
      TROUPE_CUDA_CHECK(cudaMemcpyAsync(staging_, at, n, cudaMemcpyHostToDevice, stream_));
    comm_->broadcast(staging_, n, root, stream_);
    if (!sends) {
      TROUPE_CUDA_CHECK(cudaMemcpyAsync(at, staging_, n, cudaMemcpyDeviceToHost, stream_));
      TROUPE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
  }
}

} // namespace troupe
