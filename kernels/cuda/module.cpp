/// The entry point of libtroupe_cuda.so (see kernels/cuda_module.hpp).

#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_device.hpp"
#include "kernels/cuda/nccl_broadcaster.hpp"
#include "kernels/cuda/nccl_communicator.hpp"
#include "kernels/cuda_module.hpp"

namespace troupe {

namespace {

/// An NCCL rank that sums on its device's stream.
class nccl_rank final : public communicator {
public:
  nccl_rank(cuda_device& dev, int rank, int world, const std::string& id,
            std::chrono::milliseconds timeout)
    : comm_(rank, world, id, timeout), stream_(dev.stream()) {}

  void all_reduce(float* data, std::size_t count) override {
    comm_.all_reduce(data, count, stream_);
  }

  void abort(const std::string& why) noexcept override {
    comm_.request_abort(why);
  }

private:
  nccl_communicator comm_;
  cudaStream_t stream_;
};

const cuda_module entry_points{
  [](int32_t index) -> std::unique_ptr<device> { return std::make_unique<cuda_device>(index); },
  [](device& dev) { return make_cuda_backend(dynamic_cast<cuda_device&>(dev)); },
  [] { return nccl_communicator::make_id(); },
  [](device& dev, int rank, int world, const std::string& id,
     std::chrono::milliseconds timeout) -> std::unique_ptr<communicator> {
    return std::make_unique<nccl_rank>(dynamic_cast<cuda_device&>(dev), rank, world, id, timeout);
  },
  [](int32_t gpu, std::chrono::milliseconds timeout) -> std::unique_ptr<gpu_broadcaster> {
    return std::make_unique<nccl_broadcaster>(gpu, timeout);
  },
  [](std::size_t bytes) -> void* {
    void* p = nullptr;
    return cudaMallocHost(&p, bytes) == cudaSuccess ? p : nullptr;
  },
  [](void* p) { cudaFreeHost(p); },
};

} // namespace

} // namespace troupe

extern "C" const troupe::cuda_module* troupe_cuda_module() {
  return &troupe::entry_points;
}
