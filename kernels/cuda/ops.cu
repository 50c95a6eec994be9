#include "kernels/cuda/check.hpp"
#include "kernels/cuda/ops.hpp"

namespace troupe::cuda {

namespace {

constexpr int threads = 256;

int blocks_for(int64_t n) {
  return static_cast<int>((n + threads - 1) / threads);
}

void launched(const char* kernel) {
  auto e = cudaGetLastError();
  if (e != cudaSuccess)
    fail("CUDA", static_cast<int>(e), cudaGetErrorString(e), false, kernel, __FILE__, __LINE__);
}

// One block per row: a block-wide sum of squares, then the scaled row.
__global__ void rms_norm_kernel(const float* x, const float* weight, float* y, int64_t dim,
                                float eps) {
  __shared__ float partial[threads];
  auto row = blockIdx.x;
  const float* in = x + row * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
    sum += in[i] * in[i];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride)
      partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  float scale = rsqrtf(partial[0] / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
    y[row * dim + i] = in[i] * scale * weight[i];
}

__global__ void add_bias_kernel(float* y, const float* bias, int64_t m, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < m * n)
    y[i] += bias[i % n];
}

__global__ void rotary_kernel(float* x, int64_t rows, int64_t heads, int64_t head_dim,
                              const float* cos, const float* sin) {
  int64_t half = head_dim / 2;
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * heads * half)
    return;
  int64_t row = i / (heads * half);
  int64_t head = (i / half) % heads;
  int64_t j = i % half;
  float* h = x + (row * heads + head) * head_dim;
  float c = cos[row * half + j];
  float s = sin[row * half + j];
  float a = h[j];
  float b = h[j + half];
  h[j] = a * c - b * s;
  h[j + half] = b * c + a * s;
}

__global__ void silu_mul_kernel(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) {
    float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void embedding_kernel(const int32_t* ids, const float* table, float* out,
                                 int64_t rows, int64_t dim) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < rows * dim)
    out[i] = table[static_cast<int64_t>(ids[i / dim]) * dim + i % dim];
}

// One block per row: each thread keeps its best, then a block-wide reduction that prefers
// the lower index on ties (as the CPU sampler does).
__global__ void argmax_kernel(const float* x, int32_t* out, int64_t cols) {
  __shared__ float best[threads];
  __shared__ int64_t at[threads];
  auto row = blockIdx.x;
  const float* in = x + row * cols;
  float b = -INFINITY;
  int64_t a = cols;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
    if (in[i] > b || (in[i] == b && i < a)) {
      b = in[i];
      a = i;
    }
  best[threadIdx.x] = b;
  at[threadIdx.x] = a;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      auto ob = best[threadIdx.x + stride];
      auto oa = at[threadIdx.x + stride];
      if (ob > best[threadIdx.x] || (ob == best[threadIdx.x] && oa < at[threadIdx.x])) {
        best[threadIdx.x] = ob;
        at[threadIdx.x] = oa;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0)
    out[row] = static_cast<int32_t>(at[0] < cols ? at[0] : 0);
}

} // namespace

void rms_norm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps,
              cudaStream_t stream) {
  if (rows == 0)
    return;
  rms_norm_kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, weight, y, dim, eps);
  launched("rms_norm_kernel");
}

void add_bias(float* y, const float* bias, int64_t m, int64_t n, cudaStream_t stream) {
  if (m * n == 0)
    return;
  add_bias_kernel<<<blocks_for(m * n), threads, 0, stream>>>(y, bias, m, n);
  launched("add_bias_kernel");
}

void rotary(float* x, int64_t rows, int64_t heads, int64_t head_dim, const float* cos,
            const float* sin, cudaStream_t stream) {
  auto n = rows * heads * (head_dim / 2);
  if (n == 0)
    return;
  rotary_kernel<<<blocks_for(n), threads, 0, stream>>>(x, rows, heads, head_dim, cos, sin);
  launched("rotary_kernel");
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  silu_mul_kernel<<<blocks_for(n), threads, 0, stream>>>(gate, up, out, n);
  launched("silu_mul_kernel");
}

void embedding(const int32_t* ids, const float* table, float* out, int64_t rows, int64_t dim,
               cudaStream_t stream) {
  if (rows * dim == 0)
    return;
  embedding_kernel<<<blocks_for(rows * dim), threads, 0, stream>>>(ids, table, out, rows, dim);
  launched("embedding_kernel");
}

void argmax(const float* x, int32_t* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0)
    return;
  argmax_kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, out, cols);
  launched("argmax_kernel");
}

void gemm_nt(cublasHandle_t handle, const float* x, const float* w, float* y, int64_t m,
             int64_t n, int64_t k, bool accumulate) {
  // Row-major y = x · wᵀ is column-major yᵀ = w · xᵀ: w is a column-major k×n matrix used
  // transposed, x a column-major k×m one.
  float alpha = 1.0f;
  float beta = accumulate ? 1.0f : 0.0f;
  TROUPE_CUDA_CHECK(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                static_cast<int>(m), static_cast<int>(k), &alpha, w,
                                static_cast<int>(k), x, static_cast<int>(k), &beta, y,
                                static_cast<int>(n)));
}

} // namespace troupe::cuda
