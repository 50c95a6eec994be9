#pragma once

/// @file
/// The kernels of a Llama-family decoder step on a GPU, each the counterpart of one in
/// `kernels/cpu/ops.hpp` (same layouts: row-major float32, weights [out, in]). Every
/// launch goes on `stream` and returns at once; a launch failure throws `troupe::error`.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace troupe::cuda {

/// y[i] = x[i] / rms(x) · weight, per row of `rows` × `dim`.
void rms_norm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps,
              cudaStream_t stream);

/// Adds `bias[n]` to every row of y[m×n].
void add_bias(float* y, const float* bias, int64_t m, int64_t n, cudaStream_t stream);

/// Rotates `heads` heads of `head_dim` of each of `rows` rows in place ("rotate half"
/// layout), with per-row cos/sin tables of head_dim/2 entries (`cos[row * head_dim/2 + i]`).
void rotary(float* x, int64_t rows, int64_t heads, int64_t head_dim, const float* cos,
            const float* sin, cudaStream_t stream);

/// out[i] = silu(gate[i]) · up[i].
void silu_mul(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream);

/// out[r] = table[ids[r]] for `rows` rows of `dim`.
void embedding(const int32_t* ids, const float* table, float* out, int64_t rows, int64_t dim,
               cudaStream_t stream);

/// The index of the largest value of each of `rows` rows of `cols` (the first on ties).
void argmax(const float* x, int32_t* out, int64_t rows, int64_t cols, cudaStream_t stream);

/// y[m×n] = x[m×k] · w[n×k]ᵀ (+ y when `accumulate`), through cuBLAS on `handle`'s stream.
void gemm_nt(cublasHandle_t handle, const float* x, const float* w, float* y, int64_t m,
             int64_t n, int64_t k, bool accumulate = false);

} // namespace troupe::cuda
