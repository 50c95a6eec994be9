#include "kernels/cuda/cuda_backend.hpp"

#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda_device.hpp"
#include "kernels/cuda/ops.hpp"
#include "troupe/errors.hpp"

namespace troupe {

namespace {

/// cuBLAS's workspace, from the device's pool: fixed, so that captured GEMMs never make
/// cuBLAS allocate, and counted with the rest (NVIDIA suggests 32 MiB on Hopper).
constexpr size_t blas_workspace_bytes = size_t{32} << 20;

/// A CUDA graph, instantiated.
class cuda_graph final : public captured_calls {
public:
  cuda_graph(cudaGraphExec_t exec, cudaStream_t stream) : exec_(exec), stream_(stream) {}
  ~cuda_graph() override {
    cudaGraphExecDestroy(exec_);
  }
  void replay() override {
    TROUPE_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
  }

private:
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
};

class cuda_backend final : public backend {
public:
  explicit cuda_backend(cuda_device& dev)
    : dev_(dev), blas_workspace_(dev, blas_workspace_bytes, memory_tag::kv_cache) {
    TROUPE_CUDA_CHECK(cublasCreate(&blas_));
    try {
      TROUPE_CUDA_CHECK(cublasSetStream(blas_, dev.stream()));
      TROUPE_CUDA_CHECK(cublasSetWorkspace(blas_, blas_workspace_.data(), blas_workspace_.size()));
    } catch (...) {
      cublasDestroy(blas_);
      throw;
    }
  }

  ~cuda_backend() override {
    cudaStreamSynchronize(dev_.stream());
    cublasDestroy(blas_);
  }

  std::unique_ptr<captured_calls> capture(const std::function<void()>& record) override {
    auto stream = dev_.stream();
    // Thread-local mode: a call of this thread that cannot be recorded fails (and ends up
    // here) instead of silently running.
    if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    bool recorded = true;
    try {
      record();
    } catch (...) {
      recorded = false;
    }
    cudaGraph_t graph = nullptr;
    auto ended = cudaStreamEndCapture(stream, &graph);
    cudaGraphExec_t exec = nullptr;
    bool ok = recorded && ended == cudaSuccess && graph != nullptr &&
              cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
    if (graph != nullptr)
      cudaGraphDestroy(graph);
    if (!ok) {
      cudaGetLastError(); // a failed capture leaves its error behind, not sticky
      return nullptr;
    }
    return std::make_unique<cuda_graph>(exec, stream);
  }

  uint64_t scratch_epoch() const override {
    return epoch_;
  }

  bool computes_in(dtype) const override {
    return true;
  }

  void gemm_nt_shared(const float* x, dtype w_type, int64_t m, int64_t k,
                      std::initializer_list<gemm_output> outputs) override {
    if (w_type == dtype::f32) {
      for (auto& o : outputs)
        cuda::gemm_nt(blas_, x, static_cast<const float*>(o.w), o.y, m, o.n, k, o.accumulate,
                      o.row_stride());
      return;
    }
    // Decode steps: the weights read once, without converting x in a launch of its own.
    if (m <= cuda::gemv_max_rows && outputs.size() <= size_t{cuda::gemv_max_outputs}) {
      cuda::gemv_output gemv[cuda::gemv_max_outputs];
      int count = 0;
      for (auto& o : outputs)
        gemv[count++] = {o.w, o.y, o.n, o.ldy, o.accumulate};
      if (cuda::gemv_half(x, w_type, m, k, gemv, count, dev_.stream()))
        return;
    }
    auto x_half = scratch(half_, storage_bytes(w_type, static_cast<size_t>(m * k)));
    cuda::to_half(x, x_half, w_type, m * k, dev_.stream());
    for (auto& o : outputs)
      cuda::gemm_nt_half(blas_, x_half, o.w, w_type, o.y, m, o.n, k, o.accumulate, o.row_stride());
  }

  void zero(float* y, int64_t n) override {
    TROUPE_CUDA_CHECK(cudaMemsetAsync(y, 0, static_cast<size_t>(n) * sizeof(float), dev_.stream()));
  }

  void rms_norm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim,
                float eps) override {
    cuda::rms_norm(x, weight, y, rows, dim, eps, dev_.stream());
  }

  void add_bias(float* y, const float* bias, int64_t m, int64_t n) override {
    cuda::add_bias(y, bias, m, n, dev_.stream());
  }

  void add(float* y, const float* x, int64_t n) override {
    cuda::add(y, x, n, dev_.stream());
  }

  void add_rms_norm(float* x, const float* h, const float* weight, float* y, int64_t rows,
                    int64_t dim, float eps) override {
    cuda::add_rms_norm(x, h, weight, y, rows, dim, eps, dev_.stream());
  }

  void rotary(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t rows, int64_t head_dim,
              int64_t rotary_dim, const float* cos, const float* sin, rope_pairs pairs) override {
    if (pairs != rope_pairs::halves)
      throw error{errc::unsupported, "the CUDA rotary kernel pairs halves only"};
    cuda::rotary(q, q_heads, k, k_heads, rows, head_dim, rotary_dim, cos, sin, dev_.stream());
  }

  void silu_mul(const float* gate, const float* up, float* out, int64_t n) override {
    cuda::silu_mul(gate, up, out, n, dev_.stream());
  }

  void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) override {
    cuda::gelu_tanh_mul(gate, up, out, n, dev_.stream());
  }

  void scale(float* y, float factor, int64_t n) override {
    cuda::scale(y, factor, n, dev_.stream());
  }

  void soft_cap(float* y, float cap, int64_t n) override {
    cuda::soft_cap(y, cap, n, dev_.stream());
  }

  void scatter_add_rows(const float* x, const int32_t* rows, const float* weights, float* y,
                        int64_t n, int64_t dim) override {
    cuda::scatter_add_rows(x, rows, weights, y, n, dim, dev_.stream());
  }

  void gather_rows(const int32_t* ids, const void* table, dtype table_type, float* out,
                   int64_t rows, int64_t dim) override {
    cuda::gather_rows(ids, table, table_type, out, rows, dim, dev_.stream());
  }

  void write_kv(const float* k, const float* v, float* k_cache, float* v_cache,
                const int32_t* slots, int64_t tokens, const paged_layout& layout) override {
    // Slot-major: a slot's row of every KV head together.
    cuda::write_kv(k, v, k_cache, v_cache, slots, tokens, layout.kv_heads * layout.head_dim,
                   dev_.stream());
  }

  void paged_attention(const float* q, float* out, const float* k_cache, const float* v_cache,
                       const paged_layout& layout, int64_t tokens, float scale) override {
    cuda::paged_attention(q, out, k_cache, v_cache, layout, tokens, scale, dev_.stream());
  }

  void edit_logits(const float* logits, float* processed, int64_t rows, int64_t cols,
                   const row_sampling* params, const logit_edit* edits, int64_t num_edits,
                   const uint32_t* masks, int64_t mask_words) override {
    cuda::edit_logits(logits, processed, rows, cols, params, edits, num_edits, masks, mask_words,
                      dev_.stream());
  }

  void sample(const float* logits, const float* processed, int64_t rows, int64_t cols,
              const row_sampling* params, int32_t* ids, float* logprobs, int32_t* ranks) override {
    cuda::sample(logits, processed, params, ids, logprobs, ranks, rows, cols, dev_.stream());
  }

private:
  /// `buf`, grown to `bytes` when smaller (the profiled largest step sizes it once).
  void* scratch(device_buffer& buf, size_t bytes) {
    if (buf.size() < bytes) {
      buf.reset();
      ++epoch_; // before allocating: steps recorded with the old memory are stale even if
                // the allocation fails
      buf = device_buffer(dev_, bytes, memory_tag::kv_cache);
    }
    return buf.data();
  }

  cuda_device& dev_;
  device_buffer blas_workspace_;
  cublasHandle_t blas_ = nullptr;
  device_buffer half_;
  uint64_t epoch_ = 0;
};

} // namespace

std::unique_ptr<backend> make_cuda_backend(cuda_device& dev) {
  return std::make_unique<cuda_backend>(dev);
}

} // namespace troupe
