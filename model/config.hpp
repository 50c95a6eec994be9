#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace troupe {

/// Hugging Face's `rope_scaling` (`rope_parameters` since transformers 5): how the rotary
/// frequencies stretch past the length a model was trained for.
struct rope_scaling_config {
  enum class kind {
    none,
    /// Every frequency divided by `factor` (positions interpolated).
    linear,
    /// NTK-aware: a step of a sequence longer than max_position_embeddings raises the
    /// rotary base with its length, as transformers does it for that step.
    dynamic,
    /// YaRN: frequencies interpolated below a band of wavelengths, kept above it, blended
    /// within (`beta_fast`, `beta_slow` rotations); cos and sin scaled by
    /// `attention_factor`.
    yarn,
    /// Llama 3.1: long wavelengths divided by `factor`, short ones kept, smoothed between.
    llama3,
    /// LongRoPE (Phi-3): each frequency divided by its own factor, `short_factor` while a
    /// sequence is at most `original_max_position_embeddings` long, `long_factor` past it
    /// (decided per step, as transformers does); cos and sin scaled by `attention_factor`.
    longrope,
  };
  kind type = kind::none;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  /// YaRN's scale of cos and sin (from `factor`, or `mscale` / `mscale_all_dim`, when the
  /// config does not give it).
  double attention_factor = 1.0;
  /// YaRN rounds its band of dimensions outwards (transformers' `truncate`).
  bool truncate = true;
  /// LongRoPE's factors, one per rotary frequency (`rotated_dims()` / 2).
  std::vector<double> short_factor;
  std::vector<double> long_factor;
};

/// The shape of a Llama-family decoder, read from a Hugging Face `config.json`.
struct model_config {
  /// `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
  /// `Phi3ForCausalLM` (whose checkpoints fuse q, k and v into `qkv_proj` and gate and up
  /// into `gate_up_proj`: `checkpoint` splits them), `Gemma2ForCausalLM`,
  /// `Gemma3ForCausalLM`, or the mixtures of experts `MixtralForCausalLM` and
  /// `Qwen3MoeForCausalLM`.
  std::string architecture;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  /// The leading entries of each q and k head that rotate (Phi-4-mini's
  /// `partial_rotary_factor` × head_dim); the rest pass through. 0: the whole head.
  int64_t rotary_dim = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  rope_scaling_config rope_scaling;
  bool tie_word_embeddings = false;
  /// q, k and v projections carry a bias (Qwen2, and Llama's `attention_bias`).
  bool attention_bias = false;
  /// o_proj carries a bias too (Llama's `attention_bias`; not Qwen2).
  bool o_proj_bias = false;
  /// gate, up and down projections carry biases (Llama's `mlp_bias`).
  bool mlp_bias = false;
  /// Each head of q and k goes through an RMSNorm of its own weights (`q_norm`, `k_norm`)
  /// before the rotary embedding (Qwen3).
  bool qk_norm = false;
  /// Embeddings times √hidden_size (Gemma).
  bool scale_embeddings = false;
  /// Added to every RMSNorm weight as a checkpoint stores it: Gemma's norms multiply by
  /// (1 + w) and store w; llama.cpp's converter writes 1 + w, so its files say 0.
  double norm_weight_offset = 0;
  /// Gemma's four norms a layer: the attention's and the MLP's outputs are normed before
  /// their residual adds (`post_attention_layernorm`, `post_feedforward_layernorm`), and
  /// `pre_feedforward_layernorm` comes before the MLP.
  bool sandwich_norms = false;
  /// The MLP's activation of the gate: `silu` (SwiGLU) or `gelu_pytorch_tanh` (GeGLU).
  std::string hidden_act = "silu";
  /// Attention scores are scaled by query_pre_attn_scalar^-1/2 (Gemma); 0: head_dim^-1/2.
  double query_pre_attn_scalar = 0;
  /// Gemma 2's soft-capping, c · tanh(x / c), of the attention scores and of the logits;
  /// 0: none.
  double attn_logit_softcapping = 0;
  double final_logit_softcapping = 0;
  /// The rotary base of the sliding layers, unscaled (Gemma 3's local base); 0: every layer
  /// rotates as `rope_theta` and `rope_scaling` say.
  double local_rope_theta = 0;
  /// In a sliding layer, each position attends to the last `sliding_window` positions,
  /// itself included (Mistral's sliding window, Qwen2's when `use_sliding_window`); 0: no
  /// layer slides.
  int64_t sliding_window = 0;
  /// Which layers slide (config.json's `layer_types`, or Qwen2's layers from
  /// `max_window_layers` on); empty: every layer, when there is a window.
  std::vector<bool> sliding_layers;
  /// Mixture of experts (Mixtral, Qwen3-MoE): the experts of each sparse layer, whose MLP
  /// is a router (`gate`, [num_experts, hidden]) and that many SwiGLU MLPs; 0: every MLP is
  /// dense.
  int64_t num_experts = 0;
  /// The experts each token goes to: the largest `num_experts_per_tok` of the router's
  /// softmax, their outputs summed with those weights.
  int64_t num_experts_per_tok = 0;
  /// Each expert's intermediate size (Qwen3-MoE's `moe_intermediate_size`; Mixtral's
  /// experts are `intermediate_size` wide).
  int64_t moe_intermediate_size = 0;
  /// The chosen weights are divided by their sum (Mixtral always; Qwen3-MoE's
  /// `norm_topk_prob`).
  bool norm_topk_prob = true;
  /// Layers whose MLP stays dense (`intermediate_size` wide) in a model with experts
  /// (Qwen3-MoE's `mlp_only_layers`, and the layers `decoder_sparse_step` skips); empty:
  /// none.
  std::vector<bool> dense_layers;
  int32_t bos_token_id = -1;
  /// Every token that ends a sequence: config.json's `eos_token_id` (one or a list) and
  /// generation_config.json's next to it, or a GGUF file's end-of-sequence and end-of-turn
  /// tokens; first come first, no repeats.
  std::vector<int32_t> eos_token_ids;
  /// The element type the checkpoint was saved in (`torch_dtype`): `"float32"`,
  /// `"float16"`, `"bfloat16"`.
  std::string torch_dtype = "float32";

  /// Parameters of the whole model (all ranks together).
  int64_t num_parameters() const;

  /// Adds `id` to `eos_token_ids` unless it is there already or -1 ("none").
  void add_eos_token(int32_t id);

  /// The longest sequence the model runs, as vLLM derives it: max_position_embeddings,
  /// times the factor of linear or dynamic rope scaling; YaRN's original length times its
  /// factor.
  int64_t max_sequence_length() const;
  /// The window of layer `layer`'s attention: `sliding_window` when it slides, else 0.
  int64_t window_of(int64_t layer) const;
  /// The entries of each head that rotate: `rotary_dim`, or the whole head.
  int64_t rotated_dims() const {
    return rotary_dim > 0 ? rotary_dim : head_dim;
  }
  /// Whether layer `layer`'s MLP is a mixture of experts.
  bool sparse(int64_t layer) const;
};

/// The Hugging Face name of layer `layer`'s router weight ([num_experts, hidden]):
/// Mixtral's `block_sparse_moe.gate.weight`, Qwen3-MoE's `mlp.gate.weight`.
std::string router_weight_name(const model_config& config, int64_t layer);

/// The Hugging Face name of projection `proj` (`"gate"`, `"up"` or `"down"`) of expert
/// `expert` in layer `layer`: Mixtral's `block_sparse_moe.experts.E.w1` (gate), `w3` (up),
/// `w2` (down); Qwen3-MoE's `mlp.experts.E.gate_proj` and so on.
std::string expert_weight_name(const model_config& config, int64_t layer, int64_t expert,
                               const std::string& proj);

/// Reads `config.json` of a Hugging Face model directory. Throws `troupe::error`
/// (`invalid_argument`) naming the file and the field for a missing or bad value and for an
/// architecture troupe does not run.
model_config load_model_config(const std::string& directory);

/// Parses the text of a `config.json`; `origin` names it in errors.
model_config parse_model_config(const std::string& json_text, const std::string& origin);

/// Checks that a config holds together (positive sizes, heads divisible by kv heads, an
/// even head size); throws `invalid_argument` naming `origin` and the field.
void validate_model_config(const model_config& config, const std::string& origin);

/// Writes `config` as a Hugging Face `config.json` text.
std::string to_config_json(const model_config& config);

} // namespace troupe
