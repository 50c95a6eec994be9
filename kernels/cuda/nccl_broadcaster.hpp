#pragma once

#include "kernels/cuda/nccl_communicator.hpp"
#include "kernels/gpu_broadcaster.hpp"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace troupe {

/// A weight-update group's member on one GPU: NCCL broadcasts on a stream of its own, cut
/// into pieces of at most `piece` bytes (every member cuts alike, so their calls pair up
/// whether each gives GPU or host memory); host memory passes through one staging buffer
/// of a piece, allocated with the member. Each call makes the GPU current for itself and
/// gives the caller's thread back the GPU it had (a trainer's PyTorch device).
class nccl_broadcaster final : public gpu_broadcaster {
public:
  static constexpr std::size_t piece = std::size_t{32} << 20;

  /// Throws `invalid_argument` when GPU `gpu` does not exist, `memory_error` when it has no
  /// room for the staging buffer.
  nccl_broadcaster(int32_t gpu, std::chrono::milliseconds timeout);
  ~nccl_broadcaster() override;

  nccl_broadcaster(const nccl_broadcaster&) = delete;
  nccl_broadcaster& operator=(const nccl_broadcaster&) = delete;

  void join(int rank, int world, const std::string& id) override;
  void broadcast(void* data, std::size_t bytes, int root, bool on_gpu) override;

private:
  int32_t gpu_;
  std::chrono::milliseconds timeout_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<nccl_communicator> comm_;
  void* staging_ = nullptr;
};

} // namespace troupe
