#include "kernels/cuda/check.hpp"
#include "kernels/cuda/ops.hpp"
#include "troupe/errors.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

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
                              int64_t head_dim, int64_t rotary_dim, const float* cos,
                              const float* sin) {
  int64_t half = rotary_dim / 2;
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

__global__ void gelu_tanh_mul_kernel(const float* gate, const float* up, float* out, int64_t n) {
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

__global__ void scatter_add_rows_kernel(const float* x, const int32_t* rows, const float* weights,
                                        float* y, int64_t n, int64_t dim) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n * dim) {
    auto r = i / dim;
    y[static_cast<int64_t>(rows[r]) * dim + i % dim] += weights[r] * x[i];
  }
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
struct max_op {
  __device__ float operator()(float a, float b) const {
    return fmaxf(a, b);
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

// A whole multiprocessor's threads per row: a row is read a few times and each pass is bound by
// the latency of the reads each thread waits for.
constexpr int sample_threads = 1024;

// One block per row. The largest logit (the lower index on ties, as the CPU sampler) and
// the log-softmax's normaliser; at a temperature, the top-k and top-p cuts as thresholds on
// the logits found by bisection (then snapped to the logit at the cut), and the draw found
// in the running sum of the kept weights in token order: each thread sums a contiguous
// chunk, and the thread whose chunk holds u × total walks it.
__global__ void __launch_bounds__(sample_threads)
  sample_kernel(const float* x, const float* processed, const row_sampling* params, int32_t* ids,
                float* logprobs, int32_t* ranks, int64_t cols) {
  __shared__ float scratch[sample_threads];
  __shared__ int64_t at[sample_threads];
  // The draw sums in double, as the CPU's choose_token does: a float target of u × mass
  // can round up onto a sum of whole weights (ties) and pick the next token.
  __shared__ double chunk_mass[sample_threads];
  __shared__ double prefix[sample_threads];
  __shared__ double kept_mass;
  __shared__ int64_t pick;
  auto row = blockIdx.x;
  row_sampling p = params[row];
  const float* raw = x + row * cols;
  const float* in = p.edited != 0 ? processed + row * cols : raw;
  float b = -INFINITY;
  int64_t a = cols;
#pragma unroll 8
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
  // The log-softmax's sum (an edited row's comes from its raw logits, below).
  float sum = 0.0f;
  if (p.edited == 0) {
#pragma unroll 8
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
      sum += expf(in[i] - max_value);
    sum = block_reduce(sum, scratch, add_op{});
  }
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
    if (p.min_p > 0.0f) {
      // The lowest kept key whose weight (in double, as the CPU's) reaches min_p; the most
      // likely token's is 1, so there is one.
      uint32_t least = ~0u;
      for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
        auto k = order_key(in[i]);
        if (k >= cut && k < least &&
            exp(static_cast<double>(in[i] - max_value) / static_cast<double>(p.temperature)) >=
              static_cast<double>(p.min_p))
          least = k;
      }
      at[threadIdx.x] = least;
      __syncthreads();
      for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride && at[threadIdx.x + stride] < at[threadIdx.x])
          at[threadIdx.x] = at[threadIdx.x + stride];
        __syncthreads();
      }
      cut = static_cast<uint32_t>(at[0]);
      __syncthreads();
    }
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
    double local = 0.0;
    for (int64_t i = begin; i < end; ++i)
      if (order_key(in[i]) >= cut)
        local += weight(in[i]);
    chunk_mass[threadIdx.x] = local;
    __syncthreads();
    if (threadIdx.x == 0) {
      double running = 0.0;
      for (int t = 0; t < blockDim.x; ++t) {
        prefix[t] = running;
        running += chunk_mass[t];
      }
      kept_mass = running;
    }
    __syncthreads();
    // u < 1 (the host clamps it; so does this) and the top token's weight is 1, so the
    // target lies below the mass and exactly one chunk holds it.
    double target = fmin(static_cast<double>(p.u), 0x1.fffffep-1) * kept_mass;
    bool mine =
      local > 0.0 && prefix[threadIdx.x] <= target && target < prefix[threadIdx.x] + local;
    __syncthreads();
    if (mine) {
      double acc = prefix[threadIdx.x];
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
  // The model's log-softmax: an edited row's from the logits before the edits.
  if (p.edited != 0) {
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
      m = fmaxf(m, raw[i]);
    max_value = block_reduce(m, scratch, max_op{});
    float z = 0.0f;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
      z += expf(raw[i] - max_value);
    sum = block_reduce(z, scratch, add_op{});
  }
  // The rank: how many raw logits lie above the pick's (counts below 2^24 are exact in float).
  float picked = raw[pick];
  float above = 0.0f;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
    above += raw[i] > picked ? 1.0f : 0.0f;
  above = block_reduce(above, scratch, add_op{});
  if (threadIdx.x == 0) {
    ids[row] = static_cast<int32_t>(pick);
    logprobs[row] = raw[pick] - max_value - logf(sum);
    ranks[row] = 1 + static_cast<int32_t>(above);
  }
}

// A block per row: an edited row copied, the tokens its mask leaves out at -inf.
__global__ void masked_copy_kernel(const float* x, float* processed, const row_sampling* params,
                                   const uint32_t* masks, int64_t mask_words, int64_t cols) {
  auto row = blockIdx.x;
  if (params[row].edited == 0)
    return;
  const float* in = x + row * cols;
  float* out = processed + row * cols;
  const uint32_t* mask = params[row].masked != 0 ? masks + row * mask_words : nullptr;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
    out[i] = mask == nullptr || token_allowed(mask, i) ? in[i] : -INFINITY;
}

// A thread per edit (the tokens of a row are distinct).
__global__ void apply_edits_kernel(float* processed, const logit_edit* edits, int64_t n,
                                   int64_t cols) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n)
    return;
  auto e = edits[i];
  float* v = processed + e.row * cols + e.token;
  *v = edited_logit(*v, e);
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

constexpr int max_head_dim = 256;
// Positions a block scores at once: their weights and cache slots stay in shared memory.
constexpr int attention_chunk = 1024;

// One block (of `threads`) per (token, head), over its positions a chunk at a time with a
// running softmax. Scores: each thread takes whole positions, so a warp has 32 key rows in
// flight rather than one (decode is bound by the latency of these reads, not their bytes).
// Values: thread (g, d) of G groups of head_dim sums dimension d over every G-th position
// of the chunk, reading rows coalesced; the groups are summed at the end.
__global__ void paged_attention_kernel(const float* q, float* out, const float* k_cache,
                                       const float* v_cache, paged_layout l, float scale) {
  __shared__ float query[max_head_dim];
  __shared__ float weights[attention_chunk];
  __shared__ int32_t slots[attention_chunk];
  __shared__ float scratch[threads];
  int64_t token = blockIdx.x / l.heads;
  int64_t head = blockIdx.x % l.heads;
  const int64_t D = l.head_dim;
  int64_t len = static_cast<int64_t>(l.positions[token]) + 1;
  // A sliding window starts at the window's first position.
  int64_t first = l.window > 0 && len > l.window ? len - l.window : 0;
  int64_t row = l.kv_heads * D;
  int64_t kv_head = (l.head_begin + head) / l.group_size - l.kv_offset;
  const float* keys = k_cache + kv_head * D;
  const float* values = v_cache + kv_head * D;
  const int32_t* table = l.block_tables + static_cast<int64_t>(l.token_seq[token]) * l.max_blocks;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
    query[d] = q[(token * l.heads + head) * D + d];
  const int groups = static_cast<int>(blockDim.x / D);
  const int group = static_cast<int>(threadIdx.x / D);
  const int64_t dim = threadIdx.x % D;
  const bool sums = group < groups;
  const bool vectors = D % 4 == 0 && row % 4 == 0;
  float running_max = -INFINITY;
  float running_sum = 0.0f;
  float acc = 0.0f;
  __syncthreads();
  for (int64_t begin = first; begin < len; begin += attention_chunk) {
    int n = static_cast<int>(len - begin < attention_chunk ? len - begin : attention_chunk);
    float local_max = -INFINITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      int64_t p = begin + i;
      int32_t slot = table[p / l.block_size] * static_cast<int32_t>(l.block_size) +
                     static_cast<int32_t>(p % l.block_size);
      slots[i] = slot;
      const float* key = keys + slot * row;
      float dot = 0.0f;
      if (vectors) {
        auto key4 = reinterpret_cast<const float4*>(key);
#pragma unroll 8
        for (int64_t d = 0; d < D / 4; ++d) {
          float4 k = key4[d];
          dot += query[4 * d] * k.x + query[4 * d + 1] * k.y + query[4 * d + 2] * k.z +
                 query[4 * d + 3] * k.w;
        }
      } else {
#pragma unroll 8
        for (int64_t d = 0; d < D; ++d)
          dot += query[d] * key[d];
      }
      float score = dot * scale;
      if (l.softcap > 0)
        score = l.softcap * tanhf(score / l.softcap);
      weights[i] = score;
      local_max = fmaxf(local_max, score);
    }
    float next_max = fmaxf(running_max, block_reduce(local_max, scratch, max_op{}));
    float rescale = expf(running_max - next_max); // 0 for the first chunk
    float local_sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      float w = expf(weights[i] - next_max);
      weights[i] = w;
      local_sum += w;
    }
    running_sum = running_sum * rescale + block_reduce(local_sum, scratch, add_op{});
    running_max = next_max;
    if (sums) {
      acc *= rescale;
#pragma unroll 4
      for (int i = group; i < n; i += groups)
        acc += weights[i] * values[slots[i] * row + dim];
    }
    __syncthreads(); // the next chunk overwrites weights and slots
  }
  scratch[threadIdx.x] = sums ? acc : 0.0f;
  __syncthreads();
  float* result = out + (token * l.heads + head) * D;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float sum = 0.0f;
    for (int g = 0; g < groups; ++g)
      sum += scratch[g * D + d];
    result[d] = sum / running_sum;
  }
}

// Decode-sized products: warp w of a block computes weight row blockIdx.x × warps + w (rows
// counted over all outputs) against the M rows of x, each lane reading 8 weights (16 bytes)
// a step; the lanes' partial sums meet in a warp reduction.
struct gemv_args {
  cuda::gemv_output out[cuda::gemv_max_outputs];
  int count;
};

__device__ float widen(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
__device__ float widen(__half v) {
  return __half2float(v);
}
__device__ float rounded(float v, __nv_bfloat16) {
  return __bfloat162float(__float2bfloat16_rn(v));
}
__device__ float rounded(float v, __half) {
  return __half2float(__float2half_rn(v));
}

template <class T, int M>
__global__ void gemv_kernel(const float* x, int64_t k, gemv_args args) {
  int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  int j = 0;
  while (j < args.count && r >= args.out[j].n) {
    r -= args.out[j].n;
    ++j;
  }
  if (j == args.count)
    return;
  const auto& o = args.out[j];
  const T* w = static_cast<const T*>(o.w) + r * k;
  float acc[M];
#pragma unroll
  for (int i = 0; i < M; ++i)
    acc[i] = 0.0f;
#pragma unroll 4
  for (int64_t c = lane * 8; c < k; c += 32 * 8) {
    uint4 raw = *reinterpret_cast<const uint4*>(w + c);
    const T* h = reinterpret_cast<const T*>(&raw);
    float wf[8];
#pragma unroll
    for (int e = 0; e < 8; ++e)
      wf[e] = widen(h[e]);
#pragma unroll
    for (int i = 0; i < M; ++i) {
      auto xv = reinterpret_cast<const float4*>(x + i * k + c);
      float4 a = xv[0];
      float4 b = xv[1];
      acc[i] += wf[0] * rounded(a.x, T{}) + wf[1] * rounded(a.y, T{}) + wf[2] * rounded(a.z, T{}) +
                wf[3] * rounded(a.w, T{}) + wf[4] * rounded(b.x, T{}) + wf[5] * rounded(b.y, T{}) +
                wf[6] * rounded(b.z, T{}) + wf[7] * rounded(b.w, T{});
    }
  }
#pragma unroll
  for (int i = 0; i < M; ++i)
    for (int offset = 16; offset > 0; offset /= 2)
      acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], offset);
  if (lane == 0) {
    int64_t ldy = o.ldy > 0 ? o.ldy : o.n;
#pragma unroll
    for (int i = 0; i < M; ++i) {
      float* y = o.y + i * ldy + r;
      *y = o.accumulate ? *y + acc[i] : acc[i];
    }
  }
}

template <class T>
void launch_gemv(const float* x, int64_t m, int64_t k, const gemv_args& args, unsigned blocks,
                 cudaStream_t stream) {
  switch (m) {
  case 1:
    gemv_kernel<T, 1><<<blocks, threads, 0, stream>>>(x, k, args);
    break;
  case 2:
    gemv_kernel<T, 2><<<blocks, threads, 0, stream>>>(x, k, args);
    break;
  case 3:
    gemv_kernel<T, 3><<<blocks, threads, 0, stream>>>(x, k, args);
    break;
  case 4:
    gemv_kernel<T, 4><<<blocks, threads, 0, stream>>>(x, k, args);
    break;
  case 5:
    gemv_kernel<T, 5><<<blocks, threads, 0, stream>>>(x, k, args);
    break;
  case 6:
    gemv_kernel<T, 6><<<blocks, threads, 0, stream>>>(x, k, args);
    break;
  case 7:
    gemv_kernel<T, 7><<<blocks, threads, 0, stream>>>(x, k, args);
    break;
  default:
    gemv_kernel<T, 8><<<blocks, threads, 0, stream>>>(x, k, args);
    break;
  }
}

} // namespace

void write_kv(const float* k, const float* v, float* k_cache, float* v_cache, const int32_t* slots,
              int64_t tokens, int64_t row, cudaStream_t stream) {
  if (tokens * row == 0)
    return;
  write_kv_kernel<<<blocks_for(tokens * row), threads, 0, stream>>>(k, v, k_cache, v_cache, slots,
                                                                    tokens, row);
  launched("write_kv_kernel");
}

void paged_attention(const float* q, float* out, const float* k_cache, const float* v_cache,
                     const paged_layout& layout, int64_t tokens, float scale, cudaStream_t stream) {
  if (layout.head_dim > max_head_dim)
    throw error{errc::unsupported, "paged_attention: head_dim " + std::to_string(layout.head_dim) +
                                     " is above " + std::to_string(max_head_dim)};
  if (tokens * layout.heads == 0)
    return;
  paged_attention_kernel<<<static_cast<unsigned>(tokens * layout.heads), threads, 0, stream>>>(
    q, out, k_cache, v_cache, layout, scale);
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
  rms_norm_kernel<true>
    <<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, h, weight, y, dim, eps);
  launched("add_rms_norm_kernel");
}

void add_bias(float* y, const float* bias, int64_t m, int64_t n, cudaStream_t stream) {
  if (m * n == 0)
    return;
  add_bias_kernel<<<blocks_for(m * n), threads, 0, stream>>>(y, bias, m, n);
  launched("add_bias_kernel");
}

void rotary(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t rows, int64_t head_dim,
            int64_t rotary_dim, const float* cos, const float* sin, cudaStream_t stream) {
  auto n = rows * (q_heads + k_heads) * (rotary_dim / 2);
  if (n == 0)
    return;
  rotary_kernel<<<blocks_for(n), threads, 0, stream>>>(q, q_heads, k, k_heads, rows, head_dim,
                                                       rotary_dim, cos, sin);
  launched("rotary_kernel");
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  silu_mul_kernel<<<blocks_for(n), threads, 0, stream>>>(gate, up, out, n);
  launched("silu_mul_kernel");
}

void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream) {
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

void scatter_add_rows(const float* x, const int32_t* rows, const float* weights, float* y,
                      int64_t n, int64_t dim, cudaStream_t stream) {
  if (n * dim == 0)
    return;
  scatter_add_rows_kernel<<<blocks_for(n * dim), threads, 0, stream>>>(x, rows, weights, y, n, dim);
  launched("scatter_add_rows_kernel");
}

void gather_rows(const int32_t* ids, const void* table, dtype type, float* out, int64_t rows,
                 int64_t dim, cudaStream_t stream) {
  if (rows * dim == 0)
    return;
  auto blocks = blocks_for(rows * dim);
  switch (type) {
  case dtype::f32:
    gather_rows_kernel<<<blocks, threads, 0, stream>>>(ids, static_cast<const float*>(table), out,
                                                       rows, dim);
    break;
  case dtype::f16:
    gather_rows_kernel<<<blocks, threads, 0, stream>>>(ids, static_cast<const __half*>(table), out,
                                                       rows, dim);
    break;
  case dtype::bf16:
    gather_rows_kernel<<<blocks, threads, 0, stream>>>(
      ids, static_cast<const __nv_bfloat16*>(table), out, rows, dim);
    break;
  }
  launched("gather_rows_kernel");
}

void edit_logits(const float* x, float* processed, int64_t rows, int64_t cols,
                 const row_sampling* params, const logit_edit* edits, int64_t num_edits,
                 const uint32_t* masks, int64_t mask_words, cudaStream_t stream) {
  if (rows == 0)
    return;
  masked_copy_kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, processed, params,
                                                                          masks, mask_words, cols);
  launched("masked_copy_kernel");
  if (num_edits == 0)
    return;
  apply_edits_kernel<<<blocks_for(num_edits), threads, 0, stream>>>(processed, edits, num_edits,
                                                                    cols);
  launched("apply_edits_kernel");
}

void sample(const float* x, const float* processed, const row_sampling* params, int32_t* ids,
            float* logprobs, int32_t* ranks, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0)
    return;
  sample_kernel<<<static_cast<unsigned>(rows), sample_threads, 0, stream>>>(
    x, processed, params, ids, logprobs, ranks, cols);
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

bool gemv_half(const float* x, dtype type, int64_t m, int64_t k, const gemv_output* outputs,
               int count, cudaStream_t stream) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (m < 1 || m > gemv_max_rows || count < 1 || count > gemv_max_outputs || k % 8 != 0 ||
      !aligned(x) || (type != dtype::bf16 && type != dtype::f16))
    return false;
  gemv_args args{};
  args.count = count;
  int64_t rows = 0;
  for (int j = 0; j < count; ++j) {
    if (!aligned(outputs[j].w))
      return false;
    args.out[j] = outputs[j];
    rows += outputs[j].n;
  }
  if (rows == 0)
    return true;
  auto blocks = static_cast<unsigned>((rows + threads / 32 - 1) / (threads / 32));
  if (type == dtype::bf16)
    launch_gemv<__nv_bfloat16>(x, m, k, args, blocks, stream);
  else
    launch_gemv<__half>(x, m, k, args, blocks, stream);
  launched("gemv_kernel");
  return true;
}

void gemm_nt(cublasHandle_t handle, const float* x, const float* w, float* y, int64_t m, int64_t n,
             int64_t k, bool accumulate, int64_t ldy) {
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
  TROUPE_CUDA_CHECK(cublasGemmEx(
    handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
    &alpha, w, in_type, static_cast<int>(k), x, in_type, static_cast<int>(k), &beta, y, CUDA_R_32F,
    static_cast<int>(ldy > 0 ? ldy : n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

} // namespace troupe::cuda
