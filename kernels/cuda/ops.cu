#include "kernels/cuda/check.hpp"
#include "kernels/cuda/ops.hpp"
#include "troupe/errors.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

// One block per row: a block-wide sum of squares, then the scaled row. With `residual`, the
// row is x + h, written back to x first (each thread reads and writes its own elements, so y
// may be h).
template <bool residual>
__global__ void rms_norm_kernel(float* x, const float* h, const float* weight, float* y,
                                int64_t dim, float eps) {
  __shared__ float partial[threads];
  auto row = blockIdx.x;
  float* in = x + row * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = in[i];
    if (residual) {
      v += h[row * dim + i];
      in[i] = v;
    }
    sum += v * v;
  }
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

// One thread per (row, head, pair); heads [0, q_heads) are q's, the rest k's.
__global__ void rotary_kernel(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t rows,
                              int64_t head_dim, const float* cos, const float* sin) {
  int64_t half = head_dim / 2;
  int64_t heads = q_heads + k_heads;
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * heads * half)
    return;
  int64_t row = i / (heads * half);
  int64_t head = (i / half) % heads;
  int64_t j = i % half;
  float* h = head < q_heads ? q + (row * q_heads + head) * head_dim
                            : k + (row * k_heads + head - q_heads) * head_dim;
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

__global__ void gelu_tanh_mul_kernel(const float* gate, const float* up, float* out,
                                     int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) {
    float x = gate[i];
    out[i] = 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x))) * up[i];
  }
}

__global__ void scale_kernel(float* y, float factor, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n)
    y[i] *= factor;
}

__global__ void soft_cap_kernel(float* y, float cap, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n)
    y[i] = cap * tanhf(y[i] / cap);
}

__device__ float as_float(float x) {
  return x;
}
__device__ float as_float(__half x) {
  return __half2float(x);
}
__device__ float as_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <class T>
__global__ void gather_rows_kernel(const int32_t* ids, const T* table, float* out, int64_t rows,
                                   int64_t dim) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < rows * dim)
    out[i] = as_float(table[static_cast<int64_t>(ids[i / dim]) * dim + i % dim]);
}

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n)
    y[i] += x[i];
}

__global__ void to_bf16_kernel(const float* x, __nv_bfloat16* y, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n)
    y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void to_f16_kernel(const float* x, __half* y, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n)
    y[i] = __float2half_rn(x[i]);
}

struct add_op {
  __device__ float operator()(float a, float b) const {
    return a + b;
  }
};
struct min_op {
  __device__ float operator()(float a, float b) const {
    return fminf(a, b);
  }
};

// A key that orders like the float it is made of (-inf lowest, +inf highest).
__device__ uint32_t order_key(float v) {
  uint32_t bits = __float_as_uint(v);
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// The block's reduction of one value per thread (blockDim.x == threads); every thread gets
// the result. `shared` is free again when it returns.
template <class Op>
__device__ float block_reduce(float value, float* shared, Op op) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride)
      shared[threadIdx.x] = op(shared[threadIdx.x], shared[threadIdx.x + stride]);
    __syncthreads();
  }
  float out = shared[0];
  __syncthreads();
  return out;
}

// One block per row. The largest logit (the lower index on ties, as the CPU sampler) and
// the log-softmax's normaliser; at a temperature, the top-k and top-p cuts as thresholds on
// the logits found by bisection (then snapped to the logit at the cut), and the draw found
// in the running sum of the kept weights in token order: each thread sums a contiguous
// chunk, and the thread whose chunk holds u × total walks it.
__global__ void sample_kernel(const float* x, const row_sampling* params, int32_t* ids,
                              float* logprobs, int64_t cols) {
  __shared__ float scratch[threads];
  __shared__ int64_t at[threads];
  __shared__ float prefix[threads];
  __shared__ int64_t pick;
  auto row = blockIdx.x;
  const float* in = x + row * cols;
  row_sampling p = params[row];
  float b = -INFINITY;
  int64_t a = cols;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
    if (in[i] > b || (in[i] == b && i < a)) {
      b = in[i];
      a = i;
    }
  scratch[threadIdx.x] = b;
  at[threadIdx.x] = a;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      auto ob = scratch[threadIdx.x + stride];
      auto oa = at[threadIdx.x + stride];
      if (ob > scratch[threadIdx.x] || (ob == scratch[threadIdx.x] && oa < at[threadIdx.x])) {
        scratch[threadIdx.x] = ob;
        at[threadIdx.x] = oa;
      }
    }
    __syncthreads();
  }
  float max_value = scratch[0];
  int64_t best = at[0] < cols ? at[0] : 0;
  __syncthreads();
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
    sum += expf(in[i] - max_value);
  sum = block_reduce(sum, scratch, add_op{});
  if (threadIdx.x == 0)
    pick = best;
  if (p.temperature >= row_sampling::greedy_below) {
    float inv_t = 1.0f / p.temperature;
    auto weight = [&](float v) { return expf((v - max_value) * inv_t); };
    // Tokens whose key is at least `cut` are kept; keys order like the logits, ±inf
    // included, so a bisection over them ends on a logit exactly, in 32 halvings.
    float lowest = INFINITY;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
      lowest = fminf(lowest, in[i]);
    uint32_t cut = order_key(block_reduce(lowest, scratch, min_op{}));
    // The largest key k in [cut, key(max)] with holds(k); holds(cut) is true and holds
    // is monotone.
    auto largest = [&](auto holds) {
      uint32_t lo = cut;
      uint32_t hi = order_key(max_value);
      while (lo < hi) {
        uint32_t mid = lo + (hi - lo + 1) / 2;
        if (holds(mid))
          lo = mid;
        else
          hi = mid - 1;
      }
      return lo;
    };
    if (p.top_k > 0 && p.top_k < cols)
      cut = largest([&](uint32_t k) {
        float count = 0.0f;
        for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
          count += order_key(in[i]) >= k ? 1.0f : 0.0f;
        return block_reduce(count, scratch, add_op{}) >= static_cast<float>(p.top_k);
      });
    auto mass_from = [&](uint32_t k) {
      float m = 0.0f;
      for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
        if (order_key(in[i]) >= k)
          m += weight(in[i]);
      return block_reduce(m, scratch, add_op{});
    };
    if (p.top_p < 1.0f) {
      float need = p.top_p * mass_from(cut);
      cut = largest([&](uint32_t k) { return mass_from(k) >= need; });
    }
    int64_t chunk = (cols + blockDim.x - 1) / blockDim.x;
    int64_t begin = threadIdx.x * chunk;
    int64_t end = begin + chunk < cols ? begin + chunk : cols;
    float local = 0.0f;
    for (int64_t i = begin; i < end; ++i)
      if (order_key(in[i]) >= cut)
        local += weight(in[i]);
    scratch[threadIdx.x] = local;
    __syncthreads();
    if (threadIdx.x == 0) {
      float running = 0.0f;
      for (int t = 0; t < blockDim.x; ++t) {
        prefix[t] = running;
        running += scratch[t];
      }
      scratch[0] = running; // the kept mass, read below by every thread
    }
    __syncthreads();
    // u < 1 (the host clamps it; so does this) and the top token's weight is 1, so the
    // target lies below the mass and exactly one chunk holds it.
    float target = fminf(p.u, 0x1.fffffep-1f) * scratch[0];
    bool mine = local > 0.0f && prefix[threadIdx.x] <= target
                && target < prefix[threadIdx.x] + local;
    __syncthreads();
    if (mine) {
      float acc = prefix[threadIdx.x];
      int64_t last = -1;
      for (int64_t i = begin; i < end; ++i) {
        if (order_key(in[i]) < cut)
          continue;
        float w = weight(in[i]);
        if (w == 0.0f)
          continue;
        acc += w;
        last = i;
        if (acc > target)
          break;
      }
      if (last >= 0)
        pick = last;
    }
    __syncthreads();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ids[row] = static_cast<int32_t>(pick);
    logprobs[row] = in[pick] - max_value - logf(sum);
  }
}

__global__ void write_kv_kernel(const float* k, const float* v, float* k_cache, float* v_cache,
                                const int32_t* slots, int64_t tokens, int64_t row) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * row)
    return;
  int64_t t = i / row;
  int64_t dst = static_cast<int64_t>(slots[t]) * row + i % row;
  k_cache[dst] = k[i];
  v_cache[dst] = v[i];
}

constexpr int attention_warps = 4;
constexpr int max_head_dim = 256;
constexpr int per_lane_max = max_head_dim / 32;

// One block per (token, head). Warp w takes positions w, w + 4, ...: the 32 lanes share each
// dot product (lane i holds dimensions i, i + 32, ...), and the warp keeps a running softmax
// (max, sum of weights, weighted values). The block then merges its warps' states.
__global__ void paged_attention_kernel(const float* q, float* out, const float* k_cache,
                                       const float* v_cache, paged_layout l, float scale) {
  __shared__ float warp_max[attention_warps];
  __shared__ float warp_sum[attention_warps];
  __shared__ float warp_acc[attention_warps][max_head_dim];
  int64_t token = blockIdx.x / l.heads;
  int64_t head = blockIdx.x % l.heads;
  int warp = threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  int64_t len = static_cast<int64_t>(l.positions[token]) + 1;
  // A sliding window starts at the window's first position.
  int64_t first = l.window > 0 && len > l.window ? len - l.window : 0;
  int64_t row = l.kv_heads * l.head_dim;
  int64_t kv_head = (l.head_begin + head) / l.group_size - l.kv_offset;
  const float* query = q + (token * l.heads + head) * l.head_dim;
  const int32_t* table = l.block_tables + static_cast<int64_t>(l.token_seq[token]) * l.max_blocks;
  int per_lane = static_cast<int>((l.head_dim + 31) / 32);
  // Loops over the compile-time bound, unrolled, keep these arrays in registers.
  float qv[per_lane_max];
  float acc[per_lane_max];
#pragma unroll
  for (int i = 0; i < per_lane_max; ++i) {
    int64_t d = lane + 32 * i;
    qv[i] = i < per_lane && d < l.head_dim ? query[d] : 0.0f;
    acc[i] = 0.0f;
  }
  float running_max = -INFINITY;
  float running_sum = 0.0f;
  for (int64_t p = first + warp; p < len; p += attention_warps) {
    int64_t slot = static_cast<int64_t>(table[p / l.block_size]) * l.block_size + p % l.block_size;
    const float* key = k_cache + slot * row + kv_head * l.head_dim;
    const float* value = v_cache + slot * row + kv_head * l.head_dim;
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < per_lane_max; ++i) {
      int64_t d = lane + 32 * i;
      if (i < per_lane && d < l.head_dim)
        dot += qv[i] * key[d];
    }
    for (int offset = 16; offset > 0; offset /= 2)
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    float score = dot * scale;
    if (l.softcap > 0)
      score = l.softcap * tanhf(score / l.softcap);
    float next_max = fmaxf(running_max, score);
    float rescale = expf(running_max - next_max); // 0 for the first position
    float weight = expf(score - next_max);
    running_sum = running_sum * rescale + weight;
#pragma unroll
    for (int i = 0; i < per_lane_max; ++i) {
      int64_t d = lane + 32 * i;
      if (i < per_lane && d < l.head_dim)
        acc[i] = acc[i] * rescale + weight * value[d];
    }
    running_max = next_max;
  }
  if (lane == 0) {
    warp_max[warp] = running_max;
    warp_sum[warp] = running_sum;
  }
#pragma unroll
  for (int i = 0; i < per_lane_max; ++i) {
    int64_t d = lane + 32 * i;
    if (i < per_lane && d < l.head_dim)
      warp_acc[warp][d] = acc[i];
  }
  __syncthreads();
  // Warps that saw no position (fewer than attention_warps) have max -inf and weigh nothing.
  float block_max = -INFINITY;
  for (int w = 0; w < attention_warps; ++w)
    block_max = fmaxf(block_max, warp_max[w]);
  float total = 0.0f;
  for (int w = 0; w < attention_warps; ++w)
    total += warp_sum[w] * expf(warp_max[w] - block_max);
  float* result = out + (token * l.heads + head) * l.head_dim;
  for (int64_t d = threadIdx.x; d < l.head_dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < attention_warps; ++w)
      sum += warp_acc[w][d] * expf(warp_max[w] - block_max);
    result[d] = sum / total;
  }
}

} // namespace

void write_kv(const float* k, const float* v, float* k_cache, float* v_cache,
              const int32_t* slots, int64_t tokens, int64_t row, cudaStream_t stream) {
  if (tokens * row == 0)
    return;
  write_kv_kernel<<<blocks_for(tokens * row), threads, 0, stream>>>(k, v, k_cache, v_cache,
                                                                    slots, tokens, row);
  launched("write_kv_kernel");
}

void paged_attention(const float* q, float* out, const float* k_cache, const float* v_cache,
                     const paged_layout& layout, int64_t tokens, float scale,
                     cudaStream_t stream) {
  if (layout.head_dim > max_head_dim)
    throw error{errc::unsupported, "paged_attention: head_dim " +
                                     std::to_string(layout.head_dim) + " is above " +
                                     std::to_string(max_head_dim)};
  if (tokens * layout.heads == 0)
    return;
  paged_attention_kernel<<<static_cast<unsigned>(tokens * layout.heads), attention_warps * 32, 0,
                           stream>>>(q, out, k_cache, v_cache, layout, scale);
  launched("paged_attention_kernel");
}

void rms_norm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps,
              cudaStream_t stream) {
  if (rows == 0)
    return;
  // Without the residual the kernel only reads x.
  rms_norm_kernel<false><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
    const_cast<float*>(x), nullptr, weight, y, dim, eps);
  launched("rms_norm_kernel");
}

void add_rms_norm(float* x, const float* h, const float* weight, float* y, int64_t rows,
                  int64_t dim, float eps, cudaStream_t stream) {
  if (rows == 0)
    return;
  rms_norm_kernel<true><<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, h, weight, y,
                                                                             dim, eps);
  launched("add_rms_norm_kernel");
}

void add_bias(float* y, const float* bias, int64_t m, int64_t n, cudaStream_t stream) {
  if (m * n == 0)
    return;
  add_bias_kernel<<<blocks_for(m * n), threads, 0, stream>>>(y, bias, m, n);
  launched("add_bias_kernel");
}

void rotary(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t rows,
            int64_t head_dim, const float* cos, const float* sin, cudaStream_t stream) {
  auto n = rows * (q_heads + k_heads) * (head_dim / 2);
  if (n == 0)
    return;
  rotary_kernel<<<blocks_for(n), threads, 0, stream>>>(q, q_heads, k, k_heads, rows, head_dim,
                                                       cos, sin);
  launched("rotary_kernel");
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  silu_mul_kernel<<<blocks_for(n), threads, 0, stream>>>(gate, up, out, n);
  launched("silu_mul_kernel");
}

void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n,
                   cudaStream_t stream) {
  if (n == 0)
    return;
  gelu_tanh_mul_kernel<<<blocks_for(n), threads, 0, stream>>>(gate, up, out, n);
  launched("gelu_tanh_mul_kernel");
}

void scale(float* y, float factor, int64_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  scale_kernel<<<blocks_for(n), threads, 0, stream>>>(y, factor, n);
  launched("scale_kernel");
}

void soft_cap(float* y, float cap, int64_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  soft_cap_kernel<<<blocks_for(n), threads, 0, stream>>>(y, cap, n);
  launched("soft_cap_kernel");
}

void add(float* y, const float* x, int64_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  add_kernel<<<blocks_for(n), threads, 0, stream>>>(y, x, n);
  launched("add_kernel");
}

void gather_rows(const int32_t* ids, const void* table, dtype type, float* out, int64_t rows,
                 int64_t dim, cudaStream_t stream) {
  if (rows * dim == 0)
    return;
  auto blocks = blocks_for(rows * dim);
  switch (type) {
    case dtype::f32:
      gather_rows_kernel<<<blocks, threads, 0, stream>>>(ids, static_cast<const float*>(table),
                                                         out, rows, dim);
      break;
    case dtype::f16:
      gather_rows_kernel<<<blocks, threads, 0, stream>>>(ids, static_cast<const __half*>(table),
                                                         out, rows, dim);
      break;
    case dtype::bf16:
      gather_rows_kernel<<<blocks, threads, 0, stream>>>(
        ids, static_cast<const __nv_bfloat16*>(table), out, rows, dim);
      break;
  }
  launched("gather_rows_kernel");
}

void sample(const float* x, const row_sampling* params, int32_t* ids, float* logprobs,
            int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0)
    return;
  sample_kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, params, ids, logprobs,
                                                                      cols);
  launched("sample_kernel");
}

void to_half(const float* x, void* y, dtype type, int64_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  if (type == dtype::bf16) {
    to_bf16_kernel<<<blocks_for(n), threads, 0, stream>>>(x, static_cast<__nv_bfloat16*>(y), n);
  } else if (type == dtype::f16) {
    to_f16_kernel<<<blocks_for(n), threads, 0, stream>>>(x, static_cast<__half*>(y), n);
  } else {
    throw error{errc::invalid_argument, "to_half: the target must be float16 or bfloat16"};
  }
  launched("to_half");
}

void gemm_nt(cublasHandle_t handle, const float* x, const float* w, float* y, int64_t m,
             int64_t n, int64_t k, bool accumulate, int64_t ldy) {
  if (m == 0 || n == 0)
    return;
  // Row-major y = x · wᵀ is column-major yᵀ = w · xᵀ: w is a column-major k×n matrix used
  // transposed, x a column-major k×m one.
  float alpha = 1.0f;
  float beta = accumulate ? 1.0f : 0.0f;
  TROUPE_CUDA_CHECK(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                static_cast<int>(m), static_cast<int>(k), &alpha, w,
                                static_cast<int>(k), x, static_cast<int>(k), &beta, y,
                                static_cast<int>(ldy > 0 ? ldy : n)));
}

void gemm_nt_half(cublasHandle_t handle, const void* x, const void* w, dtype type, float* y,
                  int64_t m, int64_t n, int64_t k, bool accumulate, int64_t ldy) {
  if (type != dtype::bf16 && type != dtype::f16)
    throw error{errc::invalid_argument, "gemm_nt_half: inputs must be float16 or bfloat16"};
  if (m == 0 || n == 0)
    return;
  auto in_type = type == dtype::bf16 ? CUDA_R_16BF : CUDA_R_16F;
  float alpha = 1.0f;
  float beta = accumulate ? 1.0f : 0.0f;
  // The same transposition as gemm_nt; float32 output and accumulation.
  TROUPE_CUDA_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                 static_cast<int>(m), static_cast<int>(k), &alpha, w, in_type,
                                 static_cast<int>(k), x, in_type, static_cast<int>(k), &beta, y,
                                 CUDA_R_32F, static_cast<int>(ldy > 0 ? ldy : n),
                                 CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
}

} // namespace troupe::cuda
