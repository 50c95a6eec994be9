#pragma once

#include "kernels/backend.hpp"
#include "model/adapters.hpp"
#include "model/checkpoint.hpp"
#include "model/config.hpp"
#include "kernels/dtype.hpp"
#include "model/kv_cache.hpp"
#include "model/step_batch.hpp"
#include "model/step_graphs.hpp"
#include "troupe/device.hpp"
#include "troupe/types.hpp"
#include "troupe/worker.hpp"

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace troupe {

/// A LoRA adapter as one rank applies it: per layer and projection, y += B·(A·x) with the
/// scaling folded into B. Column-parallel projections (q/k/v/gate/up) hold all of A and
/// this rank's rows of B; row-parallel ones (o/down) hold this rank's columns of A and all
/// of B, so each rank adds a partial product that the layer's all-reduce sums like the rest.
/// The float32 factors share one allocation under `memory_tag::weights`.
struct lora_weights {
  struct factors {
    const float* a = nullptr;
    const float* b = nullptr;
    int64_t rank = 0; // 0: the projection is not adapted
  };
  std::vector<std::array<factors, projection_count>> layers;
  int64_t rank = 0;
  device_buffer memory;
};

/// A prompt-tuning adapter: the embeddings of its virtual tokens, which replace those of
/// the first `num_virtual_tokens` positions of a prompt. Lives under `memory_tag::weights`.
struct prompt_embeddings {
  int64_t num_virtual_tokens = 0;
  device_buffer table; // [num_virtual_tokens, hidden_size]
};

/// Reports weight loading: tensors done and in all.
using load_progress = std::function<void(size_t done, size_t total)>;

/// Sums a buffer of device memory over the ranks of a tensor-parallel group, in place.
using all_reduce_fn = std::function<void(float* data, size_t count)>;

/// How a worker holds its weights: the type it converts them to, or the checkpoint's own
/// types (`stored_types`).
struct weight_format {
  dtype type = dtype::f32;
  bool stored_types = false;
};

/// The weight format for vLLM's `dtype` name (`"auto"` or a type's name; checked by the
/// caller) on `dev`, for a checkpoint of `torch_dtype`: on the CPU `"auto"` keeps the
/// stored types (GGUF's block formats, 16-bit floats), on a GPU it picks bfloat16 or
/// float16.
weight_format weight_format_for(const device& dev, const std::string& dtype_name,
                                const std::string& torch_dtype);

/// A Llama-family decoder (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, and the mixtures of
/// experts Mixtral and Qwen3-MoE) on any device (through its `backend`), holding this
/// rank's shard of the weights: attention heads and MLP columns split across ranks in
/// near-even contiguous shares (column-parallel q/k/v/gate/up, row-parallel o/down followed
/// by an all-reduce), embeddings and the output head replicated. A sparse layer's experts
/// are split as the MLP is, each expert's columns across the ranks, or, with expert
/// parallelism, whole experts in near-even shares of them; either way every rank routes
/// every token (the router is replicated), computes the tokens its experts take, and the
/// layer's all-reduce sums the experts' weighted outputs. Projections,
/// embeddings and the output head are kept in `weight_type`, or, with `stored_types`, in
/// the type the checkpoint stores them in wherever the device computes in it (a GGUF
/// file's Q4_1 stays Q4_1); norms, biases, activations, the KV cache and the logits are
/// float32.
class llama_model : public troupe::model {
public:
  /// Throws `invalid_argument` when there are fewer attention heads than ranks, and
  /// `unsupported` when the device does not compute in `weight_type`. `int8_activations`:
  /// the CPU's fast path (`model_worker_options::cpu_precision`); `expert_parallel`:
  /// whole experts a rank (vLLM's `enable_expert_parallel`).
  llama_model(model_config cfg, device& dev, int32_t rank, int32_t world,
              dtype weight_type = dtype::f32, bool stored_types = false,
              bool int8_activations = false, bool expert_parallel = false);

  /// Loads this rank's shard from `ckpt` into the device under `memory_tag::weights`
  /// (converting to the weight type); `presharded` when `ckpt` holds only this rank's shard
  /// (vLLM's sharded_state format). Throws `invalid_argument` naming the tensor for a
  /// missing tensor or a shape that does not match the config. May be called again to
  /// reload into the same memory.
  void load(const checkpoint& ckpt, const load_progress& progress = {}, bool presharded = false);

  /// How `update` may change the weights.
  struct update_options {
    /// `src` must hold every weight (a new checkpoint); otherwise any subset.
    bool whole = false;
    /// A weight kept in a block format (GGUF's Q4_K …) may be written from another type,
    /// quantized again as the file's type; otherwise that is refused.
    bool requantize = false;
    /// Look for NaN and infinities (false: the tensors carry no data yet).
    bool check_values = true;
  };

  /// Writes the weights `src` holds (whole tensors under their Hugging Face names, in any
  /// type the loader reads) over this rank's part of them, in place: the same memory, the
  /// same layout and types (converted as a load converts). Everything is checked before
  /// anything is written (a name with no place in the model, a shape, a type that would
  /// need requantizing, NaN or an infinity), and the first problem throws
  /// `invalid_argument` naming the parameter, with nothing changed. `rope_freqs.weight`
  /// (a buffer of the config's rope) and the rotary `inv_freq` buffers are not weights and
  /// are passed over.
  void update(const checkpoint& src, const update_options& options);

  /// `update`'s checks alone: throws as `update` would, writes nothing.
  void check_update(const checkpoint& src, const update_options& options);

  /// Keeps the weights a load puts in new memory in a file under `directory`
  /// (`weight_cache_file`), and maps them from there instead when a later load (another
  /// process's) finds that file made from the same checkpoint files, as they are now, in
  /// the same layout; the empty string turns it off (the default). Only a device that maps
  /// files (the CPU) uses it.
  void use_weight_cache(std::string directory) {
    cache_directory_ = std::move(directory);
  }

  /// Makes `load` hash every byte of the checkpoint's tensors (`checkpoint::content_hash`),
  /// each as it is read for loading, and the rest of the file (other ranks' parts) after:
  /// what ranks compare to know they loaded the same files. A load from the weight cache
  /// takes the hash the cache file keeps.
  void hash_weights(bool on) {
    hash_weights_ = on;
  }

  /// The last load's `checkpoint::content_hash` (0 when `hash_weights` was off).
  uint64_t content_hash() const {
    return content_hash_;
  }

  std::string architecture() const override;
  int64_t num_parameters() const override;

  const model_config& config() const {
    return cfg_;
  }
  int64_t local_kv_heads() const {
    return local_kv_;
  }
  dtype weight_type() const {
    return weight_type_;
  }

  /// Whether decode steps are recorded and replayed (CUDA graphs on a GPU; on by default).
  /// vLLM's `enforce_eager` turns it off.
  void capture_decode_steps(bool on) {
    graphs_.enable(on);
  }

  /// Used after each row-parallel layer when the model is split; identity by default.
  void set_all_reduce(all_reduce_fn fn) {
    all_reduce_ = std::move(fn);
  }

  /// Runs one step: computes every scheduled token of `req` and writes its keys and values
  /// into `cache`, leaving on the device the logits of the last token of each sequence of
  /// every group that samples, in request order (`logits`, `sample`); `rows` says whose
  /// each row is. Throws `invalid_argument` for a malformed request (token out of
  /// vocabulary, block table too short, chunk past the tokens).
  void run(const execute_model_request& req, kv_cache& cache, std::vector<sample_row>& rows,
           const step_adapters& adapters = {});

  /// Runs a prepared batch (`prepare_batch`): the device part of `run`. The logits left are
  /// those of the batch's `sample_tokens`: its sampled rows, then its prompt rows.
  void forward(const step_batch& batch, kv_cache& cache);

  /// The logits of the last `run` (rows × vocab), copied to the host.
  std::vector<float> logits() const;

  /// The token each row of the last `run` samples (`params`, one per row), its logprob and
  /// its rank, picked on the device; only these come back to the host. The rows `edited` are drawn
  /// after their `edits` (in row order) and, where `masked`, their mask (`masks`: a row of
  /// `mask_words()` words for each row, any content in the others), applied on the device.
  void sample(const std::vector<row_sampling>& params, std::vector<int32_t>& ids,
              std::vector<float>& logprobs, std::vector<int32_t>& ranks,
              const std::vector<logit_edit>& edits = {}, const std::vector<uint32_t>& masks = {});

  /// Words of a row's token mask (`sample`).
  int64_t mask_words() const {
    return (cfg_.vocab_size + 31) / 32;
  }

  /// Grows the step workspace to what any step within these bounds needs: `tokens` tokens
  /// in at most `seqs` sequences of up to `max_len` positions in blocks of `block_size`,
  /// LoRA adapters up to `max_lora_rank`. Such steps then never grow it (a GPU's memory is
  /// budgeted once, after this). Returns the workspace's bytes: every activation of such a
  /// step lives there.
  int64_t reserve(int64_t tokens, int64_t seqs, int64_t max_len, int64_t block_size,
                  int64_t max_lora_rank);

  /// The logits at every position of `tokens` (rows × vocab), computed in one step as a
  /// new sequence in blocks 0, 1, … of `cache`: what perplexity and KL-divergence
  /// measurements read. Throws `invalid_argument` as `run` does (a token outside the
  /// vocabulary, a cache too small for them).
  std::vector<float> prompt_logits(const std::vector<int32_t>& tokens, kv_cache& cache);

  /// `run`, then `logits`.
  std::vector<float> run_logits(const execute_model_request& req, kv_cache& cache,
                                std::vector<sample_row>& rows, const step_adapters& adapters = {});

  /// This rank's part of the PEFT LoRA adapter in directory `path`. Throws
  /// `invalid_argument` naming the adapter for a rank above `max_rank`, a factor whose shape
  /// does not fit the model, or anything `read_peft_lora` refuses.
  lora_weights load_lora(const std::string& path, int64_t max_rank) const;

  /// The PEFT prompt-tuning adapter in directory `path`. Throws `invalid_argument` naming
  /// the adapter when its token_dim is not the model's hidden size, it has more than
  /// `max_tokens` virtual tokens (0: no limit), or its embeddings are missing.
  prompt_embeddings load_prompt_adapter(const std::string& path, int64_t max_tokens) const;

  /// The experts of each sparse layer this rank computes: [first, first + count); all of
  /// them (a share of each one's columns) unless experts are placed whole.
  std::pair<int64_t, int64_t> local_experts() const {
    return {expert_begin_, local_experts_};
  }

  /// The tokens this rank's experts computed in the last step, over every sparse layer
  /// (a token routed to two of them counts twice).
  int64_t routed_tokens() const {
    return routed_tokens_;
  }

  /// A weight of this rank, under its Hugging Face name; `data` is device memory.
  struct local_tensor {
    std::string name;
    std::vector<int64_t> shape;
    dtype type = dtype::f32;
    const void* data = nullptr;
    /// In the backend's packed layout: `download` gives it as stored.
    bool packed = false;
    /// q's or k's rows (a bias's entries) in neighbouring pairs within each head
    /// (`rope_pairs::neighbours`): `download` gives them in Hugging Face's order.
    bool neighbour_pairs = false;
  };

  /// Every weight this rank holds, as the last `load` placed them.
  const std::vector<local_tensor>& tensors() const {
    return held_;
  }

  /// Copies `t`'s elements to the host, laid out as the checkpoint stores them.
  std::vector<char> download(const local_tensor& t) const;

private:
  /// Where a weight lives in `weights_`.
  struct tensor_slot {
    void* ptr = nullptr;
    dtype type = dtype::f32;
    /// In the backend's packed layout (`backend::pack`).
    bool packed = false;
    void* data() const {
      return ptr;
    }
    /// This weight's product into y[· × n].
    backend::gemm_output into(float* y, int64_t n) const {
      return {ptr, y, n, false, 0, packed};
    }
    template <class T>
    T* as() const {
      return static_cast<T*>(ptr);
    }
  };

  struct layer_weights {
    /// `post_norm` comes before the MLP (Llama's post_attention_layernorm, Gemma's
    /// pre_feedforward_layernorm); with sandwich norms, `attn_out_norm` and `mlp_out_norm`
    /// norm the two halves' outputs.
    tensor_slot input_norm, q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, o, o_bias, post_norm,
      gate, up, down, gate_bias, up_bias, down_bias, attn_out_norm, mlp_out_norm;
    /// A sparse layer's router ([num_experts, hidden]) and this rank's experts.
    tensor_slot router;
    struct expert {
      tensor_slot gate, up, down;
    };
    std::vector<expert> experts;
  };

  /// The rotary frequencies of the config's scaling for a base of `theta`.
  std::vector<double> rotary_frequencies(double theta) const;

  /// The frequencies of a step's sequence that reaches `length` positions: `inv_freq_`,
  /// but for dynamic NTK scaling past max_position_embeddings (cached by length) and
  /// LongRoPE's long factors past its original length.
  const std::vector<double>& step_frequencies(int64_t length);

  /// cos and sin of `position` at `freqs` (YaRN and LongRoPE scale both).
  void rope_tables(int32_t position, const std::vector<double>& freqs, float* cos,
                   float* sin) const;

  /// Writes `count` floats from `values` to device memory at `dst` as elements of `type`.
  void upload(void* dst, const float* values, size_t count, dtype type) const;

  /// What a load reads for one weight: the whole tensor, this rank's rows (column-parallel
  /// layers) or this rank's columns (row-parallel layers), and how it is kept.
  enum class part { whole, rows, cols };
  struct weight_job {
    tensor_slot* slot;
    std::string name;
    /// The checkpoint's shape, and this rank's part of it.
    std::vector<int64_t> shape;
    part split;
    int64_t start;
    int64_t count;
    dtype type;
    /// The part is copied as the checkpoint stores it (`type` is its type).
    bool as_stored = false;
    /// In the backend's packed layout.
    bool packed = false;
    /// Added to every value (a norm's `model_config::norm_weight_offset`).
    float offset = 0;
    /// q's or k's weight or bias: its rows (entries) are a head's rotated pairs.
    bool rotated = false;
    std::vector<int64_t> local_shape() const;
  };
  /// `t` with its rows in the order this model holds them: where a `rotated` tensor's pairs
  /// are neighbours (`pairs_`), `reordered` reads Hugging Face's row p·D/2 + i of each head
  /// as row 2i + p (a GGUF llama file's own order needs no reordering); otherwise `t`.
  const tensor_view& in_model_order(bool rotated, const tensor_view& t,
                                    tensor_view& reordered) const;
  /// Every weight of the config, in load order, split for this rank; types and layouts
  /// are a load's to choose.
  std::vector<weight_job> plan_weights();
  /// Whether a checkpoint's tensor that is none of `plan_weights`' belongs to the model all
  /// the same: a buffer (`rope_freqs.weight`, `inv_freq`), an output head beside tied
  /// embeddings, another rank's expert (unless `presharded`).
  bool passed_over(const std::string& name, bool presharded) const;
  /// What a load reads and where it puts it.
  struct load_plan {
    /// Every weight in load order, its type and layout chosen.
    std::vector<weight_job> jobs;
    /// This rank's shape of each, and its bytes.
    std::vector<std::vector<int64_t>> local_shapes;
    std::vector<size_t> sizes;
    /// Where each is used from the checkpoint's file (nullptr: not), else its offset in
    /// `weights_`, of `total` bytes.
    std::vector<char*> in_place;
    std::vector<size_t> offsets;
    size_t total = 0;
  };
  /// The jobs of a load of `ckpt`, each weight's type and layout chosen, after checking
  /// its names and shapes against the config (`invalid_argument` naming the tensor);
  /// changes nothing but the rotary frequencies (`rope_freqs.weight`).
  load_plan plan_load(const checkpoint& ckpt, bool presharded);
  /// Maps the checkpoint's pages of the jobs that are used in place (`mapped_`, replacing
  /// any earlier) and returns where each job's weight is in them; nullptr for a job that is
  /// copied.
  std::vector<char*> map_in_place(const checkpoint& ckpt, const load_plan& plan, bool presharded);
  /// What the weights' bytes are made of, for the weight cache: a file holds them only
  /// under exactly this description.
  std::string layout_text(const load_plan& plan) const;
  /// Points the slots (and `held_`) at the places `plan` gives them.
  void point_slots(const load_plan& plan);
  /// Checks the values used in place and writes the others where `plan` says, hashing each
  /// as it is read when `hash_weights_`.
  void read_weights(const checkpoint& ckpt, const load_plan& plan, bool presharded,
                    const load_progress& progress);
  /// Writes this rank's part of `t` (as `j` says) at `dst`; `presharded`: `t` is the part.
  /// Throws `invalid_argument` naming `j.name` and `source` for NaN or an infinity, unless
  /// `checked` (an update looked at every value before writing any).
  void write_weight(const weight_job& j, const tensor_view& t, char* dst, bool presharded,
                    const std::string& source, bool checked = false) const;
  /// The jobs of an update from `src`, `as_stored` and the slots' types and layouts set,
  /// each with its tensor in the model's row order, after every check.
  std::vector<std::pair<weight_job, tensor_view>> plan_update(const checkpoint& src,
                                                              const update_options& options);

  /// The step's scratch memory of at least `bytes`, grown as needed.
  void* workspace(size_t bytes);

  /// Where a step's parts lie in the workspace, in 4-byte units (each 256-byte aligned):
  /// the metadata (`int_count` int32s, then the rotary tables), then the activations. The
  /// int32 metadata's arrays (token ids, positions, cache slots, each token's sequence, the
  /// block tables, the sampled rows) are at their offsets within it.
  struct step_layout {
    int64_t ids, positions, slots, token_seq, tables, samples, int_count;
    int64_t ints, rope, x, h, q, k, v, attn, gate, up, mid, last, logits, processed, masks,
      sampling, sampled_ids, sampled_logprobs, sampled_ranks, router, moe_in, expert_x, expert_gate,
      expert_up, expert_out, routes, route_weights, total;
  };
  step_layout layout_of(int64_t tokens, int64_t samples, int64_t seqs, int64_t max_blocks,
                        int64_t max_lora_rank) const;

  /// A step's buffers on the device (views into the workspace) and its attention layout.
  struct step_buffers {
    int64_t tokens = 0;
    int64_t samples = 0;
    /// Token ids first; the other int32 metadata at the layout's offsets.
    const int32_t* ints = nullptr;
    const int32_t* slots = nullptr;
    const int32_t* sample_rows = nullptr;
    const float* cos = nullptr;
    const float* sin = nullptr;
    /// The sliding layers' tables where they rotate with a base of their own.
    const float* local_cos = nullptr;
    const float* local_sin = nullptr;
    float *x = nullptr, *h = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *attn = nullptr,
          *gate = nullptr, *up = nullptr, *mid = nullptr, *last = nullptr, *logits = nullptr;
    /// A sparse layer's: router logits, its input, one expert's rows (in, gate, up, out),
    /// and the routes (each local expert's tokens, then their weights).
    float *router = nullptr, *moe_in = nullptr, *expert_x = nullptr, *expert_gate = nullptr,
          *expert_up = nullptr, *expert_out = nullptr;
    int32_t* routes = nullptr;
    float* route_weights = nullptr;
    paged_layout layout;
  };
  /// Writes the step's metadata (ids, positions, cache slots, block tables, rotary tables)
  /// to the device and lays out its buffers.
  step_buffers upload_step(const step_batch& batch, const kv_cache& cache);
  /// The halves of a layer, each ending with its row-parallel all-reduce (into `b.h`).
  void attention(size_t layer, const step_batch& batch, step_buffers& b, kv_cache& cache);
  void mlp(size_t layer, const step_batch& batch, const step_buffers& b);
  /// gate·x and up·x of `rows` rows into [rows × width] each: one GEMM over the shared
  /// input where both weights are of one type (a dense MLP's, an expert's).
  void gate_up(const float* x, int64_t rows, const tensor_slot& gate, const tensor_slot& up,
               float* gate_out, float* up_out, int64_t width);
  /// A sparse layer's MLP: the router's top experts of each token, computed by the experts
  /// this rank holds, summed into `b.h` with their weights (all-reduced).
  void experts(size_t layer, const step_buffers& b);
  /// The final norm of the sampled rows and the logits.
  void output_head(const step_buffers& b);
  /// Adds each LoRA run's B·(A·in) to `out` for projection `proj` of `layer`.
  void apply_lora(const step_batch& batch, const step_buffers& b, size_t layer, projection proj,
                  const float* in, int64_t in_width, float* out, int64_t out_width);
  /// Sums `data` over the ranks (nothing with one rank).
  void reduce(float* data, int64_t count);

  /// How a projection's weight [out, in] is split: this rank's rows (column-parallel) or
  /// columns (row-parallel) [start, start + count).
  struct shard {
    bool by_rows;
    int64_t start;
    int64_t count;
    int64_t out;
    int64_t in;
  };
  shard shard_of(projection p) const;

  model_config cfg_;
  device& dev_;
  std::unique_ptr<backend> backend_;
  int32_t rank_;
  int32_t world_;
  dtype weight_type_;
  bool stored_types_;
  /// This rank's attention heads: [head_begin_, head_begin_ + local_heads_).
  int64_t head_begin_;
  int64_t local_heads_;
  /// The kv heads those attention heads use: [kv_offset_, kv_offset_ + local_kv_).
  int64_t kv_offset_;
  int64_t local_kv_;
  /// This rank's columns of the MLP: [inter_begin_, inter_begin_ + local_inter_).
  int64_t inter_begin_;
  int64_t local_inter_;
  /// The experts this rank computes, and the columns of each: all experts with a share of
  /// their columns, or a share of the experts with all of theirs (`expert_parallel`).
  int64_t expert_begin_ = 0;
  int64_t local_experts_ = 0;
  int64_t moe_inter_begin_ = 0;
  int64_t local_moe_inter_ = 0;
  int64_t routed_tokens_ = 0;
  /// This rank's rows of the output head: [vocab_begin_, vocab_begin_ + local_vocab_).
  int64_t vocab_begin_;
  int64_t local_vocab_;
  /// Rotary frequencies from the config, and as used (divided by a checkpoint's
  /// `rope_freqs.weight` factors when it has them, as llama.cpp stores llama3 scaling).
  std::vector<double> base_inv_freq_;
  std::vector<double> inv_freq_;
  /// The sliding layers' frequencies (`model_config::local_rope_theta`).
  std::vector<double> local_inv_freq_;
  /// LongRoPE's frequencies past the original length.
  std::vector<double> long_inv_freq_;
  /// Dynamic NTK's frequencies by sequence length.
  std::map<int64_t, std::vector<double>> dynamic_freqs_;
  /// Every weight of this rank in one allocation under `memory_tag::weights`: a GPU maps
  /// memory in 2 MiB granules, so one allocation per tensor would round each small one up.
  device_buffer weights_;
  /// The checkpoint files' pages that weights kept as stored are used from in place (one
  /// private mapping a file, under `memory_tag::weights`): no copy, no fresh memory.
  std::vector<device_buffer> mapped_;
  /// `use_weight_cache`.
  std::string cache_directory_;
  bool hash_weights_ = false;
  uint64_t content_hash_ = 0;
  tensor_slot embed_;
  tensor_slot final_norm_;
  tensor_slot lm_head_; // empty when tied
  std::vector<layer_weights> layers_;
  std::vector<local_tensor> held_;
  /// How q's and k's entries pair up in rotation, chosen by the first load: neighbours where
  /// the checkpoint stores them so (a GGUF llama file) and the backend rotates them so,
  /// for those weights to be used as stored (in place, not copied); halves otherwise.
  std::optional<rope_pairs> pairs_;
  all_reduce_fn all_reduce_;
  /// Activations and step metadata, under `memory_tag::kv_cache` (it sleeps with the cache).
  device_buffer workspace_;
  step_graphs graphs_;
  /// Where the last `run` left its logits, and how many rows.
  const float* logits_ = nullptr;
  int64_t logit_rows_ = 0;
  row_sampling* sampling_ = nullptr;
  int32_t* sampled_ids_ = nullptr;
  float* sampled_logprobs_ = nullptr;
  int32_t* sampled_ranks_ = nullptr;
  /// The edited rows' logits and the rows' masks (in the workspace), and the edits.
  float* processed_ = nullptr;
  uint32_t* masks_ = nullptr;
  device_buffer edits_;
};

} // namespace troupe
