#pragma once

/// @file
/// The numeric kernels of the CPU device: GEMM through OpenBLAS, and plain loops for the
/// rest of a Llama-family decoder step. All tensors are row-major float32.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace troupe::cpu {

/// Threads OpenBLAS may use for one GEMM (process-wide).
void set_gemm_threads(int threads);

/// y[m×n] = x[m×k] · w[n×k]ᵀ (+ y when `accumulate`), y's rows `ldy` apart (0: n). `w` is a
/// weight in the Hugging Face layout [out_features, in_features].
void gemm_nt(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k,
             bool accumulate = false, int64_t ldy = 0);

/// y[i] = x[i] / rms(x) · weight, per row of `rows` × `dim`.
void rms_norm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps);

/// Adds `bias[n]` to every row of y[m×n].
void add_bias(float* y, const float* bias, int64_t m, int64_t n);

/// Rotates the first `rotary_dim` entries of `heads` heads of `head_dim` in place (the
/// "rotate half" layout of Hugging Face: element i pairs with i + rotary_dim/2), with
/// cos/sin tables of rotary_dim/2 entries; the rest of each head passes through.
void rotary(float* x, int64_t heads, int64_t head_dim, int64_t rotary_dim, const float* cos,
            const float* sin);

/// `rotary` with neighbouring entries paired (2i with 2i + 1: llama.cpp's order).
void rotary_neighbours(float* x, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                       const float* cos, const float* sin);

/// out[i] = silu(gate[i]) · up[i].
void silu_mul(const float* gate, const float* up, float* out, int64_t n);

/// out[i] = gelu(gate[i]) · up[i], GELU in its tanh form.
void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n);

/// An attention score soft-capped: cap · tanh(score / cap) (Gemma 2); `score` when cap is 0.
inline float soft_capped(float score, float cap) {
  return cap > 0 ? cap * std::tanh(score / cap) : score;
}

/// Attention of one query row against `len` cached positions of one sequence.
/// `key_at(pos)` / `value_at(pos)` give the cached key and value vectors of the query's
/// KV head at a position. Writes head_dim outputs; `scores` needs room for `len` floats.
/// Scores are soft-capped at `softcap` where it is positive.
template <class KeyAt, class ValueAt>
void attend(const float* query, int64_t head_dim, int64_t len, float scale, KeyAt key_at,
            ValueAt value_at, float* scores, float* out, float softcap = 0) {
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < len; ++p) {
    const float* k = key_at(p);
    float dot = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d)
      dot += query[d] * k[d];
    scores[p] = soft_capped(dot * scale, softcap);
    max_score = std::max(max_score, scores[p]);
  }
  float sum = 0.0f;
  for (int64_t p = 0; p < len; ++p) {
    scores[p] = std::exp(scores[p] - max_score);
    sum += scores[p];
  }
  std::fill(out, out + head_dim, 0.0f);
  for (int64_t p = 0; p < len; ++p) {
    const float* v = value_at(p);
    float weight = scores[p] / sum;
    for (int64_t d = 0; d < head_dim; ++d)
      out[d] += weight * v[d];
  }
}

} // namespace troupe::cpu
