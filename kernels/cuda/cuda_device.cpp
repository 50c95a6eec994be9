#include "kernels/cuda/cuda_device.hpp"

#include "kernels/cuda/check.hpp"
#include "troupe/errors.hpp"

#include <cudaTypedefs.h>

#include <mutex>

namespace troupe {

namespace {

/// The driver calls of the pool, from the runtime's entry points.
struct driver_api {
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
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
  });
  return api;
}

CUdeviceptr address(void* ptr) {
  return reinterpret_cast<CUdeviceptr>(ptr);
}

void check_tag(memory_tag tag) {
  if (static_cast<size_t>(tag) > 1)
    throw error{errc::invalid_argument,
                "unknown memory tag " + std::to_string(static_cast<int>(tag))};
}

} // namespace

int cuda_device::count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

cuda_device::cuda_device(int32_t index) : index_(index) {
  auto devices = count();
  if (index < 0 || index >= devices)
    throw error{errc::invalid_argument, "cuda:" + std::to_string(index) + " does not exist (" +
                                          std::to_string(devices) + " GPU(s) visible)"};
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
  for (auto& [ptr, a] : allocations_)
    free_allocation(ptr, a);
  if (stream_ != nullptr)
    cudaStreamDestroy(stream_);
}

std::string cuda_device::name() const {
  return "cuda:" + std::to_string(index_);
}

void cuda_device::free_allocation(void* ptr, allocation& a) noexcept {
  if (a.handle != 0) {
    driver().unmap(address(ptr), a.mapped);
    driver().release(a.handle);
  }
  driver().address_free(address(ptr), a.mapped);
  if (a.backup != nullptr)
    cudaFreeHost(a.backup);
}

void cuda_device::map(void* ptr, allocation& a) {
  auto& api = driver();
  TROUPE_CUDA_CHECK(api.create(&a.handle, a.mapped, &prop_, 0));
  try {
    TROUPE_CUDA_CHECK(api.map(address(ptr), a.mapped, 0, a.handle, 0));
  } catch (...) {
    api.release(a.handle);
    a.handle = 0;
    throw;
  }
  CUmemAccessDesc access{};
  access.location = prop_.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  TROUPE_CUDA_CHECK(api.set_access(address(ptr), a.mapped, &access, 1));
}

void cuda_device::unmap(void* ptr, allocation& a) {
  auto& api = driver();
  TROUPE_CUDA_CHECK(api.unmap(address(ptr), a.mapped));
  TROUPE_CUDA_CHECK(api.release(a.handle));
  a.handle = 0;
}

void* cuda_device::allocate(std::size_t bytes, memory_tag tag) {
  check_tag(tag);
  if (asleep_[static_cast<size_t>(tag)])
    throw error{errc::sleeping, std::string{"cuda device: cannot allocate under tag '"} +
                                  to_string(tag) + "' while it sleeps"};
  allocation a;
  a.requested = bytes;
  a.tag = tag;
  a.mapped = ((bytes == 0 ? 1 : bytes) + granularity_ - 1) / granularity_ * granularity_;
  CUdeviceptr base = 0;
  TROUPE_CUDA_CHECK(driver().address_reserve(&base, a.mapped, granularity_, 0, 0));
  auto ptr = reinterpret_cast<void*>(base);
  try {
    map(ptr, a);
    TROUPE_CUDA_CHECK(cudaMemsetAsync(ptr, 0, a.mapped, stream_));
    TROUPE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } catch (...) {
    if (a.handle != 0) {
      driver().unmap(base, a.mapped);
      driver().release(a.handle);
    }
    driver().address_free(base, a.mapped);
    throw;
  }
  allocations_.emplace(ptr, a);
  return ptr;
}

void cuda_device::deallocate(void* ptr) noexcept {
  auto i = allocations_.find(ptr);
  if (i == allocations_.end())
    return;
  cudaStreamSynchronize(stream_); // kernels may still use it
  free_allocation(ptr, i->second);
  allocations_.erase(i);
}

void cuda_device::sleep(int32_t level) {
  if (level != 1 && level != 2)
    throw error{errc::invalid_argument,
                "sleep level must be 1 or 2, got " + std::to_string(level)};
  TROUPE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  // Backups first (they can fail for want of pinned memory), then the releases, so that a
  // failure leaves the device as it was.
  for (auto& [ptr, a] : allocations_) {
    if (asleep_[static_cast<size_t>(a.tag)])
      continue;
    if (level == 1 && a.tag == memory_tag::weights) {
      if (a.backup == nullptr)
        TROUPE_CUDA_CHECK(cudaMallocHost(&a.backup, a.requested == 0 ? 1 : a.requested));
      TROUPE_CUDA_CHECK(
        cudaMemcpyAsync(a.backup, ptr, a.requested, cudaMemcpyDeviceToHost, stream_));
      a.backup_valid = true;
    } else {
      a.backup_valid = false;
    }
  }
  TROUPE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (auto& [ptr, a] : allocations_)
    if (!asleep_[static_cast<size_t>(a.tag)] && a.handle != 0)
      unmap(ptr, a);
  asleep_.fill(true);
}

void cuda_device::wake_up(const std::vector<memory_tag>& tags) {
  for (auto tag : tags)
    check_tag(tag);
  auto wanted = tags.empty() ? sleeping_tags() : tags;
  for (auto tag : wanted) {
    if (!asleep_[static_cast<size_t>(tag)])
      continue;
    for (auto& [ptr, a] : allocations_) {
      if (a.tag != tag || a.handle != 0)
        continue;
      map(ptr, a);
      if (a.backup_valid) {
        TROUPE_CUDA_CHECK(
          cudaMemcpyAsync(ptr, a.backup, a.requested, cudaMemcpyHostToDevice, stream_));
        a.backup_valid = false; // the pinned buffer stays for the next sleep
      } else {
        TROUPE_CUDA_CHECK(cudaMemsetAsync(ptr, 0, a.mapped, stream_));
      }
    }
    TROUPE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    asleep_[static_cast<size_t>(tag)] = false;
  }
}

std::vector<memory_tag> cuda_device::sleeping_tags() const {
  std::vector<memory_tag> out;
  for (auto tag : {memory_tag::weights, memory_tag::kv_cache})
    if (asleep_[static_cast<size_t>(tag)])
      out.push_back(tag);
  return out;
}

std::vector<memory_usage> cuda_device::usage() const {
  std::vector<memory_usage> out;
  for (auto tag : {memory_tag::weights, memory_tag::kv_cache}) {
    memory_usage u;
    u.tag = tag;
    for (auto& [ptr, a] : allocations_) {
      if (a.tag != tag)
        continue;
      u.allocated_bytes += static_cast<int64_t>(a.requested);
      if (a.handle != 0)
        u.resident_bytes += static_cast<int64_t>(a.requested);
      if (a.backup_valid)
        u.backup_bytes += static_cast<int64_t>(a.requested);
    }
    out.push_back(u);
  }
  return out;
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
