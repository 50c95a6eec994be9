#pragma once

/// @file
/// Checking macros for the CUDA runtime, the driver, cuBLAS and NCCL: a failed call throws
/// `troupe::error` naming the call, file, line and device, which the worker actor turns into
/// an error reply. Out-of-memory results become `errc::memory_error`, the rest
/// `errc::worker_error`.

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cublas_v2.h>
#include <nccl.h>

namespace troupe::cuda {

[[noreturn]] void fail(const char* domain, int code, const char* what, bool out_of_memory,
                       const char* call, const char* file, int line);

inline void check(cudaError_t e, const char* call, const char* file, int line) {
  if (e != cudaSuccess)
    fail("CUDA", static_cast<int>(e), cudaGetErrorString(e), e == cudaErrorMemoryAllocation, call,
         file, line);
}

inline void check(CUresult e, const char* call, const char* file, int line) {
  if (e != CUDA_SUCCESS)
    fail("CUDA driver", static_cast<int>(e), "", e == CUDA_ERROR_OUT_OF_MEMORY, call, file, line);
}

inline void check(cublasStatus_t e, const char* call, const char* file, int line) {
  if (e != CUBLAS_STATUS_SUCCESS)
    fail("cuBLAS", static_cast<int>(e), cublasGetStatusString(e), e == CUBLAS_STATUS_ALLOC_FAILED,
         call, file, line);
}

inline void check(ncclResult_t e, const char* call, const char* file, int line) {
  if (e != ncclSuccess)
    fail("NCCL", static_cast<int>(e), ncclGetErrorString(e), false, call, file, line);
}

} // namespace troupe::cuda

/// Checks a CUDA runtime, driver, cuBLAS or NCCL call (the overload picks the domain).
#define TROUPE_CUDA_CHECK(call) ::troupe::cuda::check((call), #call, __FILE__, __LINE__)
