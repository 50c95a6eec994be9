#include "kernels/cpu/ops.hpp"

#include <cblas.h>

#include <cmath>

namespace troupe::cpu {

void set_gemm_threads(int threads) {
  openblas_set_num_threads(threads < 1 ? 1 : threads);
}

void gemm_nt(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k,
             bool accumulate, int64_t ldy) {
  if (m == 0 || n == 0)
    return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, x, static_cast<blasint>(k), w,
              static_cast<blasint>(k), accumulate ? 1.0f : 0.0f, y,
              static_cast<blasint>(ldy > 0 ? ldy : n));
}

void rms_norm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * dim;
    float* out = y + r * dim;
    double sum = 0.0;
    for (int64_t i = 0; i < dim; ++i)
      sum += static_cast<double>(in[i]) * in[i];
    auto inv = static_cast<float>(1.0 / std::sqrt(sum / dim + eps));
    for (int64_t i = 0; i < dim; ++i)
      out[i] = in[i] * inv * weight[i];
  }
}

void add_bias(float* y, const float* bias, int64_t m, int64_t n) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < n; ++i)
      y[r * n + i] += bias[i];
}

void rotary(float* x, int64_t heads, int64_t head_dim, int64_t rotary_dim, const float* cos,
            const float* sin) {
  auto half = rotary_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      float a = v[i];
      float b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i] + a * sin[i];
    }
  }
}

void rotary_neighbours(float* x, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                       const float* cos, const float* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < rotary_dim / 2; ++i) {
      float a = v[2 * i];
      float b = v[2 * i + 1];
      v[2 * i] = a * cos[i] - b * sin[i];
      v[2 * i + 1] = b * cos[i] + a * sin[i];
    }
  }
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) {
  const float root_2_over_pi = 0.7978845608028654f;
  for (int64_t i = 0; i < n; ++i) {
    float x = gate[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(root_2_over_pi * (x + 0.044715f * x * x * x))) * up[i];
  }
}

} // namespace troupe::cpu
