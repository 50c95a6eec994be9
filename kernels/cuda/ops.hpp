#pragma once

/// @file
/// The kernels of a Llama-family decoder step on a GPU, the counterparts of those in
/// `kernels/cpu/ops.hpp` (same layouts: row-major, float32 activations, weights [out, in]).
/// Every launch goes on `stream` and returns at once; a launch failure throws
/// `troupe::error`.

#include "kernels/backend.hpp"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace troupe::cuda {

/// y[i] = x[i] / rms(x) · weight, per row of `rows` × `dim`.
void rms_norm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps,
              cudaStream_t stream);

/// Adds `bias[n]` to every row of y[m×n].
void add_bias(float* y, const float* bias, int64_t m, int64_t n, cudaStream_t stream);

/// x += h, then y = x / rms(x) · weight, per row of `rows` × `dim` (`y` may be `h`: each
/// element is read and written by the same thread).
void add_rms_norm(float* x, const float* h, const float* weight, float* y, int64_t rows,
                  int64_t dim, float eps, cudaStream_t stream);

/// Rotates in place the first `rotary_dim` entries of `q_heads` heads of each of `rows` rows
/// of `q` and `k_heads` of `k` (heads of `head_dim`, "rotate half" layout within them) in
/// one launch, with per-row cos/sin tables of rotary_dim/2 entries
/// (`cos[row * rotary_dim/2 + i]`).
void rotary(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t rows, int64_t head_dim,
            int64_t rotary_dim, const float* cos, const float* sin, cudaStream_t stream);

/// out[i] = silu(gate[i]) · up[i].
void silu_mul(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream);

/// out[i] = gelu(gate[i]) · up[i], GELU in its tanh form.
void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream);

/// y[i] *= factor.
void scale(float* y, float factor, int64_t n, cudaStream_t stream);

/// y[i] = cap · tanh(y[i] / cap).
void soft_cap(float* y, float cap, int64_t n, cudaStream_t stream);

/// y[i] += x[i].
void add(float* y, const float* x, int64_t n, cudaStream_t stream);

/// y[rows[r]] += weights[r] · x[r] for `n` rows of `dim`, no row twice.
void scatter_add_rows(const float* x, const int32_t* rows, const float* weights, float* y,
                      int64_t n, int64_t dim, cudaStream_t stream);

/// out[r] = table[ids[r]] as float32 for `rows` rows of `dim`; `table` holds `type`.
void gather_rows(const int32_t* ids, const void* table, dtype type, float* out, int64_t rows,
                 int64_t dim, cudaStream_t stream);

/// `backend::edit_logits`: the edited rows of `x` copied to `processed` under their masks
/// (a block per row), then a thread per edit.
void edit_logits(const float* x, float* processed, int64_t rows, int64_t cols,
                 const row_sampling* params, const logit_edit* edits, int64_t num_edits,
                 const uint32_t* masks, int64_t mask_words, cudaStream_t stream);

/// For each of `rows` rows of `cols` logits, the token `params[row]` picks and its
/// log-softmax: the largest (the first on ties) at temperature 0; else the draw of
/// `choose_token` (model/sampler.hpp), with the top-k, min-p and top-p cuts found as
/// thresholds on the value instead of a sort (ties at a cut are all kept) and `u` found in
/// the running sum in token order. An edited row is drawn from `processed`; the log-softmax
/// and the rank (`rank_of`) are `x`'s. One block per row.
void sample(const float* x, const float* processed, const row_sampling* params, int32_t* ids,
            float* logprobs, int32_t* ranks, int64_t rows, int64_t cols, cudaStream_t stream);

/// y[i] = x[i] rounded to `type` (f16 or bf16, to nearest even).
void to_half(const float* x, void* y, dtype type, int64_t n, cudaStream_t stream);

/// Writes the keys and values of `tokens` tokens (rows of `row` = kv_heads × head_dim
/// floats) into one layer's paged cache: token t goes to slot `slots[t]` (block × block_size
/// + offset) of `k_cache` / `v_cache` ([blocks × block_size, row]).
void write_kv(const float* k, const float* v, float* k_cache, float* v_cache, const int32_t* slots,
              int64_t tokens, int64_t row, cudaStream_t stream);

/// Causal grouped-query attention of `tokens` query rows ([tokens, heads, head_dim], head_dim
/// at most 256) over one layer's paged cache, for prefill and decode alike. One block per
/// (token, head), over the positions a chunk at a time with a running softmax (max, sum,
/// weighted values), so no scratch memory is needed for any length.
void paged_attention(const float* q, float* out, const float* k_cache, const float* v_cache,
                     const paged_layout& layout, int64_t tokens, float scale, cudaStream_t stream);

/// One weight matrix of `gemv_half`: y[m×n] (+)= x[m×k] · w[n×k]ᵀ, y's rows `ldy` apart.
struct gemv_output {
  const void* w = nullptr;
  float* y = nullptr;
  int64_t n = 0;
  int64_t ldy = 0;
  bool accumulate = false;
};

/// The most activation rows and weight matrices one `gemv_half` takes.
constexpr int64_t gemv_max_rows = 8;
constexpr int gemv_max_outputs = 4;

/// The decode-sized product of a few rows of x with up to `gemv_max_outputs` half-precision
/// weight matrices in one launch (q/k/v, or gate/up): each warp reads one weight row in
/// 16-byte loads. x is rounded to `type` first, as the cuBLAS path rounds it. Returns false,
/// launching nothing, when m is above `gemv_max_rows`, there are too many outputs, k is not
/// a multiple of 8 or a pointer is not 16-byte aligned.
bool gemv_half(const float* x, dtype type, int64_t m, int64_t k, const gemv_output* outputs,
               int count, cudaStream_t stream);

/// y[m×n] = x[m×k] · w[n×k]ᵀ (+ y when `accumulate`), y's rows `ldy` apart (0: n), through
/// cuBLAS on `handle`'s stream.
void gemm_nt(cublasHandle_t handle, const float* x, const float* w, float* y, int64_t m, int64_t n,
             int64_t k, bool accumulate = false, int64_t ldy = 0);

/// The same with x and w in `type` (f16 or bf16) and y in float32, accumulating in float32
/// (cublasGemmEx).
void gemm_nt_half(cublasHandle_t handle, const void* x, const void* w, dtype type, float* y,
                  int64_t m, int64_t n, int64_t k, bool accumulate = false, int64_t ldy = 0);

} // namespace troupe::cuda
