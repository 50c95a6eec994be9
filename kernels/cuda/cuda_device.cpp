#include "kernels/cuda/cuda_device.hpp"

#include "kernels/cuda/check.hpp"
#include "troupe/errors.hpp"

#include <cudaTypedefs.h>

#include <mutex>

namespace troupe {

namespace {

/// The driver calls of the pool (and a context's state), from the runtime's entry points.
struct driver_api {
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDevicePrimaryCtxGetState_v7000 context_state = nullptr;
};

template <class F>
void entry(const char* symbol, F& fn) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult found{};
  TROUPE_CUDA_CHECK(
    cudaGetDriverEntryPointByVersion(symbol, &ptr, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || ptr == nullptr)
    throw error{errc::unsupported, std::string{"cuda device: the driver has no "} + symbol};
  fn = reinterpret_cast<F>(ptr);
}

const driver_api& driver() {
  static driver_api api;
  static std::once_flag once;
  std::call_once(once, [] {
    entry("cuMemAddressReserve", api.address_reserve);
    entry("cuMemAddressFree", api.address_free);
    entry("cuMemCreate", api.create);
    entry("cuMemRelease", api.release);
    entry("cuMemMap", api.map);
    entry("cuMemUnmap", api.unmap);
    entry("cuMemSetAccess", api.set_access);
    entry("cuMemGetAllocationGranularity", api.granularity);
    entry("cuDeviceGet", api.device_get);
    entry("cuDevicePrimaryCtxGetState", api.context_state);
  });
  return api;
}

CUdeviceptr address(void* ptr) {
  return reinterpret_cast<CUdeviceptr>(ptr);
}

} // namespace

int cuda_device::count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

void cuda_device::check(int32_t index) {
  auto devices = count();
  if (index < 0 || index >= devices)
    throw error{errc::invalid_argument, "cuda:" + std::to_string(index) + " does not exist (" +
                                          std::to_string(devices) + " GPU(s) visible)"};
}

bool cuda_device::has_context(int32_t index) {
  CUdevice dev = 0;
  unsigned flags = 0;
  int active = 0;
  return driver().device_get(&dev, index) == CUDA_SUCCESS &&
         driver().context_state(dev, &flags, &active) == CUDA_SUCCESS && active != 0;
}

cuda_device::cuda_device(int32_t index) : index_(index) {
  check(index);
  TROUPE_CUDA_CHECK(cudaSetDevice(index));
  TROUPE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop_.location.id = index;
  TROUPE_CUDA_CHECK(
    driver().granularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
}

cuda_device::~cuda_device() {
  if (stream_ != nullptr)
    cudaStreamSynchronize(stream_);
  free_all();
  if (stream_ != nullptr)
    cudaStreamDestroy(stream_);
}

std::string cuda_device::name() const {
  return "cuda:" + std::to_string(index_);
}

void cuda_device::free_region(void* ptr, region& r) noexcept {
  cudaStreamSynchronize(stream_); // kernels may still use it
  if (r.handle != 0) {
    driver().unmap(address(ptr), r.mapped);
    driver().release(r.handle);
  }
  driver().address_free(address(ptr), r.mapped);
  if (r.backup != nullptr)
    cudaFreeHost(r.backup);
}

void cuda_device::map(void* ptr, region& r) {
  auto& api = driver();
  CUmemGenericAllocationHandle handle = 0;
  TROUPE_CUDA_CHECK(api.create(&handle, r.mapped, &prop_, 0));
  try {
    TROUPE_CUDA_CHECK(api.map(address(ptr), r.mapped, 0, handle, 0));
  } catch (...) {
    api.release(handle);
    throw;
  }
  r.handle = handle;
  CUmemAccessDesc access{};
  access.location = prop_.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  TROUPE_CUDA_CHECK(api.set_access(address(ptr), r.mapped, &access, 1));
}

void* cuda_device::map_new(region& r) {
  r.mapped =
    ((r.requested == 0 ? 1 : r.requested) + granularity_ - 1) / granularity_ * granularity_;
  CUdeviceptr base = 0;
  TROUPE_CUDA_CHECK(driver().address_reserve(&base, r.mapped, granularity_, 0, 0));
  auto ptr = reinterpret_cast<void*>(base);
  try {
    map(ptr, r);
    TROUPE_CUDA_CHECK(cudaMemsetAsync(ptr, 0, r.mapped, stream_));
    TROUPE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } catch (...) {
    if (r.handle != 0) {
      driver().unmap(base, r.mapped);
      driver().release(r.handle);
      r.handle = 0;
    }
    driver().address_free(base, r.mapped);
    throw;
  }
  return ptr;
}

void cuda_device::back_up(void* ptr, region& r) {
  if (r.backup == nullptr)
    TROUPE_CUDA_CHECK(cudaMallocHost(&r.backup, r.requested == 0 ? 1 : r.requested));
  TROUPE_CUDA_CHECK(cudaMemcpyAsync(r.backup, ptr, r.requested, cudaMemcpyDeviceToHost, stream_));
  r.backed_up = true;
}

void cuda_device::undo_backup(void*, region& r) {
  r.backed_up = false; // the memory was never released; the pinned buffer stays
}

void cuda_device::release(void* ptr, region& r) {
  if (r.handle == 0)
    return;
  auto& api = driver();
  TROUPE_CUDA_CHECK(api.unmap(address(ptr), r.mapped));
  TROUPE_CUDA_CHECK(api.release(r.handle));
  r.handle = 0;
}

void cuda_device::restore(void* ptr, region& r) {
  if (r.handle != 0)
    return;
  map(ptr, r);
  if (r.backed_up) {
    TROUPE_CUDA_CHECK(cudaMemcpyAsync(ptr, r.backup, r.requested, cudaMemcpyHostToDevice, stream_));
    r.backed_up = false; // the pinned buffer stays for the next sleep
  } else {
    TROUPE_CUDA_CHECK(cudaMemsetAsync(ptr, 0, r.mapped, stream_));
  }
}

void cuda_device::settle() {
  TROUPE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void cuda_device::copy(void* dst, const void* src, std::size_t bytes) {
  TROUPE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
  TROUPE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::size_t cuda_device::free_memory() const {
  std::size_t free_bytes = 0;
  std::size_t total = 0;
  TROUPE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return free_bytes;
}

std::size_t cuda_device::total_memory() const {
  std::size_t free_bytes = 0;
  std::size_t total = 0;
  TROUPE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return total;
}

} // namespace troupe
