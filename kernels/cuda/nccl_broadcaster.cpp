#include "kernels/cuda/nccl_broadcaster.hpp"

#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda_device.hpp"
#include "troupe/errors.hpp"

#include <algorithm>

namespace troupe {

namespace {

/// Makes a GPU current for a scope, then the caller's again.
class current_gpu {
public:
  explicit current_gpu(int32_t gpu) {
    TROUPE_CUDA_CHECK(cudaGetDevice(&before_));
    TROUPE_CUDA_CHECK(cudaSetDevice(gpu));
  }
  ~current_gpu() {
    cudaSetDevice(before_);
  }
  current_gpu(const current_gpu&) = delete;
  current_gpu& operator=(const current_gpu&) = delete;

private:
  int before_ = 0;
};

} // namespace

nccl_broadcaster::nccl_broadcaster(int32_t gpu, std::chrono::milliseconds timeout)
  : gpu_(gpu), timeout_(timeout) {
  cuda_device::check(gpu);
  current_gpu on{gpu_};
  TROUPE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
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
  comm_ = std::make_unique<nccl_communicator>(rank, world, id, timeout_);
}

void nccl_broadcaster::broadcast(void* data, std::size_t bytes, int root, bool on_gpu) {
  if (!comm_)
    throw error{errc::invalid_argument, "NCCL broadcast before the group was joined"};
  current_gpu on{gpu_};
  auto need = std::min(bytes, piece);
  if (!on_gpu && staging_bytes_ < need) {
    TROUPE_CUDA_CHECK(cudaFree(staging_));
    staging_ = nullptr;
    staging_bytes_ = 0;
    TROUPE_CUDA_CHECK(cudaMalloc(&staging_, need));
    staging_bytes_ = need;
  }
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
