#pragma once

/// @file
/// The kernels of a decoder step behind one interface, so that `llama_model` runs the same
/// step on any device: `kernels/cpu` implements it on host memory, `kernels/cuda` on a GPU.
/// Every pointer is memory of the backend's device; tensors are row-major, activations
/// float32, weights [out, in] in the element type given.

#include "kernels/dtype.hpp"
#include "troupe/device.hpp"

#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <vector>

namespace troupe {

/// Where each query token of `paged_attention` finds its sequence's cache.
struct paged_layout {
  /// Block tables of the step's sequences, `max_blocks` entries each, and the sequence of
  /// every query token.
  const int32_t* block_tables = nullptr;
  int64_t max_blocks = 0;
  const int32_t* token_seq = nullptr;
  /// Position of every query token: it attends to positions 0..position, or to the last
  /// `window` of them when `window` > 0 (a sliding window).
  const int32_t* positions = nullptr;
  int64_t window = 0;
  int64_t block_size = 0;
  /// Local query heads and the kv heads they use: query head h reads kv head
  /// (head_begin + h) / group_size - kv_offset of a row of `kv_heads` heads.
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t head_begin = 0;
  int64_t group_size = 1;
  int64_t kv_offset = 0;
  /// Gemma 2's soft-capping of the scores (scaled): cap · tanh(score / cap); 0: none.
  float softcap = 0;
};

#ifdef __CUDACC__
#define TROUPE_HOST_DEVICE __host__ __device__
#else
#define TROUPE_HOST_DEVICE
#endif

/// How `backend::sample` picks the token of one row: the most likely when `temperature` is
/// below `greedy_below`, else a draw at `temperature` among the `top_k` most likely (all when
/// <= 0) whose probability is at least `min_p` times the most likely one's, cut to `top_p`
/// of their mass, with `u` in [0, 1). A row that is `edited` is drawn from the logits
/// `backend::edit_logits` made of it; its logprob is still the model's.
struct row_sampling {
  /// Temperatures below this pick the most likely token (vLLM's `_SAMPLING_EPS`).
  static constexpr float greedy_below = 1e-5f;

  float temperature = 0.0f;
  int32_t top_k = -1;
  float top_p = 1.0f;
  float u = 0.0f;
  float min_p = 0.0f;
  /// Whether the row has edits or a mask (`backend::edit_logits`), and whether a mask.
  int32_t edited = 0;
  int32_t masked = 0;
};
static_assert(sizeof(row_sampling) % sizeof(float) == 0, "laid out in 4-byte units");

/// What the logits processors do to one token of one row before the draw (vLLM's order:
/// the bias, then the repetition penalty, then the frequency and presence penalties; a
/// banned token, a bad word's last one or a stop token under min_tokens, gets -inf). Made
/// on the host from the request's parameters and tokens (`logit_edits`), one per token a
/// row changes, and applied where the logits are.
struct logit_edit {
  int32_t row = 0;
  int32_t token = 0;
  float bias = 0.0f;
  /// 1: none.
  float repetition = 1.0f;
  /// frequency_penalty × the token's count in the output + presence_penalty.
  float subtract = 0.0f;
  int32_t banned = 0;
};
static_assert(sizeof(logit_edit) % sizeof(float) == 0, "laid out in 4-byte units");

/// Whether a row's token mask (bit t of word t / 32) allows token `t`.
TROUPE_HOST_DEVICE inline bool token_allowed(const uint32_t* mask, int64_t t) {
  return (mask[t / 32] >> (t % 32) & 1u) != 0;
}

/// The logit `x` after `e`: each operation in float, alone (never fused), so that every
/// device gets the same bits.
TROUPE_HOST_DEVICE inline float edited_logit(float x, const logit_edit& e) {
  if (e.banned != 0)
    return -INFINITY;
#ifdef __CUDA_ARCH__
  x = __fadd_rn(x, e.bias);
  if (e.repetition != 1.0f)
    x = x > 0.0f ? __fdiv_rn(x, e.repetition) : __fmul_rn(x, e.repetition);
  return __fsub_rn(x, e.subtract);
#else
  x += e.bias;
  if (e.repetition != 1.0f)
    x = x > 0.0f ? x / e.repetition : x * e.repetition;
  return x - e.subtract;
#endif
}

/// Which entries of a head rotate together: Hugging Face's halves (entry i with
/// i + rotary_dim/2) or neighbours (2i with 2i + 1), the order in which llama.cpp's
/// converter stores a llama model's q and k rows.
enum class rope_pairs { halves, neighbours };

/// Calls recorded once by `backend::capture`, run again by `replay` with the same arguments
/// (the memory they name must still be there; its contents may change).
class captured_calls {
public:
  virtual ~captured_calls();
  virtual void replay() = 0;
};

/// The kernels of one device, used from its worker's thread. Calls may run asynchronously
/// (on the GPU's stream); `device::copy` to the host waits for them.
class backend {
public:
  virtual ~backend();

  /// Records the backend calls `record` makes, without running them, for replaying later
  /// at the cost of one launch (a CUDA graph). nullptr when the backend cannot record, or
  /// recording failed (a call that cannot be recorded, such as growing scratch memory): the
  /// caller then makes the calls itself.
  virtual std::unique_ptr<captured_calls> capture(const std::function<void()>& record) {
    (void)record;
    return nullptr;
  }

  /// Changes whenever the backend's own scratch memory moves: calls captured before name
  /// memory that is gone.
  virtual uint64_t scratch_epoch() const {
    return 0;
  }

  /// Whether the GEMMs take weights of type `t`.
  virtual bool computes_in(dtype t) const = 0;

  /// One of several GEMMs that share their input: y[m×n] = x · wᵀ (+ y when `accumulate`),
  /// y's rows `ldy` floats apart (0: n, contiguous).
  struct gemm_output {
    const void* w;
    float* y;
    int64_t n;
    bool accumulate = false;
    int64_t ldy = 0;
    /// `w` is in the backend's packed layout (`pack`).
    bool packed = false;

    int64_t row_stride() const {
      return ldy > 0 ? ldy : n;
    }
  };

  /// y_i[m×n_i] = x[m×k] · w_iᵀ for every output, weights all of type `w_type` (q/k/v, or
  /// gate/up), accumulating in float32: half-precision weights need the activations
  /// converted only once.
  virtual void gemm_nt_shared(const float* x, dtype w_type, int64_t m, int64_t k,
                              std::initializer_list<gemm_output> outputs) = 0;

  /// y[m×n] = x[m×k] · w[n×k]ᵀ (+ y when `accumulate`): one GEMM of its own.
  void gemm_nt(const float* x, const void* w, dtype w_type, float* y, int64_t m, int64_t n,
               int64_t k, bool accumulate = false) {
    gemm_nt_shared(x, w_type, m, k, {gemm_output{w, y, n, accumulate}});
  }

  /// Whether `pack` takes `rows` × `cols` weights of type `t`, in bands of a multiple of
  /// `pack_group()` rows: a layout the backend's GEMMs read faster than the stored one.
  virtual bool packs(dtype t, int64_t rows, int64_t cols) const {
    (void)t;
    (void)rows;
    (void)cols;
    return false;
  }

  /// The rows a band given to `pack` is a multiple of.
  virtual int64_t pack_group() const {
    return 1;
  }

  /// Writes `rows` × `cols` weights of type `t`, as stored at `src` (host memory), to
  /// `dst` (the device's) in the packed layout, where `packs` says yes; GEMMs then take
  /// them with `gemm_output::packed`.
  virtual void pack(dtype t, const void* src, void* dst, int64_t rows, int64_t cols) {
    (void)t;
    (void)src;
    (void)dst;
    (void)rows;
    (void)cols;
    throw_no_packing();
  }

  /// `gather_rows` from a table in the packed layout.
  virtual void gather_packed_rows(const int32_t* ids, const void* table, dtype table_type,
                                  float* out, int64_t rows, int64_t dim) {
    (void)ids;
    (void)table;
    (void)table_type;
    (void)out;
    (void)rows;
    (void)dim;
    throw_no_packing();
  }

  /// The inverse of `pack`, on host memory: packed weights at `src` to `dst` as stored.
  virtual void unpack(dtype t, const void* src, void* dst, int64_t rows, int64_t cols) const {
    (void)t;
    (void)src;
    (void)dst;
    (void)rows;
    (void)cols;
    throw_no_packing();
  }

  /// y[0..n) = 0.
  virtual void zero(float* y, int64_t n) = 0;

  /// y = x / rms(x) · weight, per row of `rows` × `dim`.
  virtual void rms_norm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim,
                        float eps) = 0;

  /// Adds `bias[n]` to every row of y[m×n].
  virtual void add_bias(float* y, const float* bias, int64_t m, int64_t n) = 0;

  /// y[i] += x[i].
  virtual void add(float* y, const float* x, int64_t n) = 0;

  /// The residual step between sublayers: x += h, then y = x / rms(x) · weight, per row of
  /// `rows` × `dim` (`y` may be `h`).
  virtual void add_rms_norm(float* x, const float* h, const float* weight, float* y, int64_t rows,
                            int64_t dim, float eps) = 0;

  /// Whether `rotary` takes `pairs` (every backend takes `rope_pairs::halves`).
  virtual bool rotates(rope_pairs pairs) const {
    return pairs == rope_pairs::halves;
  }

  /// Rotates, in place, the first `rotary_dim` entries of `q_heads` heads of each of `rows`
  /// rows of `q` and `k_heads` of `k` (heads of `head_dim`, entries paired as `pairs` says;
  /// the rest pass through), with per-row cos/sin tables of rotary_dim/2 entries (pair i
  /// turns by angle i).
  virtual void rotary(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t rows,
                      int64_t head_dim, int64_t rotary_dim, const float* cos, const float* sin,
                      rope_pairs pairs) = 0;

  /// out[i] = silu(gate[i]) · up[i].
  virtual void silu_mul(const float* gate, const float* up, float* out, int64_t n) = 0;

  /// out[i] = gelu(gate[i]) · up[i], GELU in its tanh form (PyTorch's `approximate="tanh"`:
  /// Gemma's GeGLU).
  virtual void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) = 0;

  /// y[i] *= factor.
  virtual void scale(float* y, float factor, int64_t n) = 0;

  /// y[i] = cap · tanh(y[i] / cap) (Gemma 2's soft-capping of the logits).
  virtual void soft_cap(float* y, float cap, int64_t n) = 0;

  /// out[r] = table[ids[r]] as float32, for `rows` rows of `dim` (embedding lookup, and
  /// gathering rows of activations).
  virtual void gather_rows(const int32_t* ids, const void* table, dtype table_type, float* out,
                           int64_t rows, int64_t dim) = 0;

  /// y[rows[r]] += weights[r] · x[r] for each of `n` rows of `dim` floats; `rows` holds no
  /// row twice (an expert's tokens, summed into the layer's output with their router
  /// weights).
  virtual void scatter_add_rows(const float* x, const int32_t* rows, const float* weights, float* y,
                                int64_t n, int64_t dim) = 0;

  /// Writes `tokens` rows of keys and values (`kv_heads` × `head_dim` floats each, as
  /// `layout` says) into one layer's cache: token t goes to slot `slots[t]` (block ×
  /// block_size + offset). Where in its block a slot's floats go is the backend's own
  /// layout, the one its `paged_attention` reads; a block is a whole: block moves copy it as
  /// bytes.
  virtual void write_kv(const float* k, const float* v, float* k_cache, float* v_cache,
                        const int32_t* slots, int64_t tokens, const paged_layout& layout) = 0;

  /// Causal grouped-query attention of `tokens` query rows ([tokens, heads, head_dim]) over
  /// one layer's paged cache.
  virtual void paged_attention(const float* q, float* out, const float* k_cache,
                               const float* v_cache, const paged_layout& layout, int64_t tokens,
                               float scale) = 0;

  /// Writes to `processed` each row of `logits` whose `params[r].edited` is set: the row
  /// with the tokens its mask leaves out at -inf (where `masked`: `masks` holds
  /// `mask_words` words a row, bit t of word t / 32 allowing token t), then `edits`
  /// (`edited_logit`; the tokens of a row distinct, the rows in order). Other rows of
  /// `processed` are left as they are.
  virtual void edit_logits(const float* logits, float* processed, int64_t rows, int64_t cols,
                           const row_sampling* params, const logit_edit* edits, int64_t num_edits,
                           const uint32_t* masks, int64_t mask_words) = 0;

  /// For each of `rows` rows of `cols` logits, the token `params` picks (the most likely,
  /// or the draw of `choose_token` in model/sampler.hpp), its log-softmax and its rank
  /// (`rank_of`); an `edited` row is drawn from its row of `processed`, its log-softmax and
  /// rank still those of `logits`.
  virtual void sample(const float* logits, const float* processed, int64_t rows, int64_t cols,
                      const row_sampling* params, int32_t* ids, float* logprobs,
                      int32_t* ranks) = 0;

private:
  [[noreturn]] static void throw_no_packing();
};

/// The backend of `dev`: CUDA kernels and cuBLAS for a `cuda_device`, the CPU kernels for
/// the rest, on `cpu_threads` threads (the caller's included), with `int8_activations`
/// the CPU's fast path (`kernels/cpu/quant_int8.hpp`).
std::unique_ptr<backend> make_backend(device& dev, int cpu_threads = 1,
                                      bool int8_activations = false);

} // namespace troupe
