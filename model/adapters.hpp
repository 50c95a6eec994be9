#pragma once

#include "model/config.hpp"

#include "model/safetensors.hpp"

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace troupe {

/// The projections of a decoder layer a LoRA adapter may adapt.
enum class projection { q, k, v, o, gate, up, down };
constexpr size_t projection_count = 7;

/// The Hugging Face module name of a projection ("q_proj", ...).
const char* module_name(projection p);

/// A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`),
/// checked and opened: the factors of every adapted projection, still in the file.
struct peft_lora {
  struct factors {
    /// A: [rank, in_features]; B: [out_features, rank].
    const tensor_view* a = nullptr;
    const tensor_view* b = nullptr;
    /// What B·A is multiplied by: lora_alpha / rank (or / sqrt(rank) with use_rslora).
    float scaling = 0;
  };
  std::string path;
  std::unique_ptr<safetensors_file> file;
  /// Row views of the B factors of fused projections (Phi-3's `qkv_proj`, `gate_up_proj`),
  /// one for each projection they hold; the factors point into these.
  std::vector<std::unique_ptr<tensor_view>> parts;
  /// Per layer, per projection; `a` is null where the adapter leaves it alone.
  std::vector<std::array<factors, projection_count>> layers;
  /// The largest rank of any adapted projection.
  int64_t rank = 0;
};

/// Reads the adapter in directory `path` for a model of `config`'s shape. A factor pair of a
/// fused projection (Phi-3's `qkv_proj`, `gate_up_proj`) becomes one pair per projection
/// it holds: A shared, B cut by rows. Throws `invalid_argument` naming the file and what is
/// wrong: not a LoRA adapter, a feature troupe does not apply (DoRA, LoRA biases, alpha
/// patterns, saved modules), a tensor that is not a factor of q/k/v/o/gate/up/down_proj (or
/// their fused forms), a layer out of range, a missing or mismatched factor.
peft_lora read_peft_lora(const std::string& path, const model_config& config);

/// A PEFT prompt-tuning adapter: `num_virtual_tokens` embeddings prepended to a prompt.
struct peft_prompt_tuning {
  int64_t num_virtual_tokens = 0;
  int64_t token_dim = 0;
};

/// Reads `adapter_config.json` of the prompt-tuning adapter in directory `path`. Throws
/// `invalid_argument` naming the file when it is not a causal-LM prompt-tuning adapter.
peft_prompt_tuning read_prompt_tuning_config(const std::string& path);

} // namespace troupe
