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

/// Writes the keys and values of `tokens` tokens (rows of `row` = kv_heads × head_dim
/// floats) into one layer's paged cache: token t goes to slot `slots[t]` (block × block_size
/// + offset) of `k_cache` / `v_cache` ([blocks × block_size, row]).
void write_kv(const float* k, const float* v, float* k_cache, float* v_cache,
              const int32_t* slots, int64_t tokens, int64_t row, cudaStream_t stream);

/// What `paged_attention` reads: where each query token's sequence keeps its cache.
struct paged_layout {
  /// Block table of every query token, `max_blocks` entries each.
  const int32_t* block_tables = nullptr;
  int64_t max_blocks = 0;
  /// Position of every query token: it attends to positions 0..position.
  const int32_t* positions = nullptr;
  int64_t block_size = 0;
  /// Local query heads and the kv heads they use: query head h reads kv head
  /// (head_begin + h) / group_size - kv_offset of a row of `kv_heads` heads.
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t head_begin = 0;
  int64_t group_size = 1;
  int64_t kv_offset = 0;
};

/// Causal grouped-query attention of `tokens` query rows ([tokens, heads, head_dim]) over
/// one layer's paged cache, for prefill and decode alike; `scores` is scratch of
/// tokens × heads × `max_len` floats (`max_len` > every position). A plain two-pass kernel
/// (scores, then softmax-weighted values): correct for any length, not tuned.
void paged_attention(const float* q, float* out, const float* k_cache, const float* v_cache,
                     const paged_layout& layout, int64_t tokens, float scale, float* scores,
                     int64_t max_len, cudaStream_t stream);

/// y[m×n] = x[m×k] · w[n×k]ᵀ (+ y when `accumulate`), through cuBLAS on `handle`'s stream.
void gemm_nt(cublasHandle_t handle, const float* x, const float* w, float* y, int64_t m,
             int64_t n, int64_t k, bool accumulate = false);

/// LoRA on rows [0, m): y[m×out] += b[out×rank] · (a[rank×in] · x[m×in]) with the scaling
/// folded into b (as `lora_weights` holds it); `mid` is scratch of m × rank floats.
void apply_lora(cublasHandle_t handle, const float* x, const float* a, const float* b, float* y,
                int64_t m, int64_t in, int64_t rank, int64_t out, float* mid);

} // namespace troupe::cuda
