#pragma once

/// @file
/// `troupe::llm`: offline generation for a batch of prompts (vLLM's `LLM.generate`), on an
/// executor of model workers with a continuous-batching scheduler.

#include "troupe/executor.hpp"
#include "troupe/types.hpp"

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace troupe {

/// How to run the model.
struct llm_config {
  /// Hugging Face model directory or GGUF file.
  std::string model;
  int32_t tensor_parallel_size = 1;
  /// The device of each local worker: `"cpu"` or `"cuda"` (worker i on GPU i).
  std::string device = "cpu";
  /// The weights' element type (`model_worker_options::dtype`).
  std::string dtype = "auto";
  /// No CUDA graphs (`model_worker_options::enforce_eager`).
  bool enforce_eager = false;
  /// Bytes for the KV cache per worker; 0 sizes it from the device's memory:
  /// `kv_cache_memory_fraction` of the free memory on the CPU, `gpu_memory_utilization` of
  /// a GPU (see `model_worker_options`).
  int64_t kv_cache_memory_bytes = 0;
  double kv_cache_memory_fraction = 0.5;
  double gpu_memory_utilization = 0.9;
  /// Host bytes per worker for swapped-out blocks.
  int64_t swap_space_bytes = 256 << 20;
  int32_t block_size = 16;
  /// 0 takes the model's longest sequence (max_position_embeddings, stretched by its rope
  /// scaling as vLLM does).
  int32_t max_model_len = 0;
  int64_t max_num_batched_tokens = 2048;
  int32_t max_num_seqs = 64;
  /// LoRA adapters loaded at once, and so used in one step (vLLM's `max_loras`).
  int32_t max_loras = 1;
  /// The highest LoRA rank accepted.
  int32_t max_lora_rank = 16;
  /// Prompt adapters loaded at once.
  int32_t max_prompt_adapters = 1;
  /// The most virtual tokens of a prompt adapter; 0 for no limit.
  int32_t max_prompt_adapter_token = 0;
  /// Worker nodes (`troupe node`) hosting the last ranks, the secret they expect, and how
  /// long a silent one may stay. The model path must name the model on the nodes too.
  std::vector<node_address> nodes;
  std::string node_secret;
  std::chrono::milliseconds node_timeout{3000};
  /// Mutual TLS with the nodes (see `executor_config`).
  std::string tls_certificate;
  std::string tls_key;
  std::string tls_ca;
  /// Weight loading progress (tensors done, in all).
  std::function<void(size_t, size_t)> progress;
};

/// One prompt: text (tokenized with the model's tokenizer) or token ids, and how to sample.
struct generation_request {
  std::string prompt;
  /// When not empty, used instead of `prompt` (for models without a tokenizer).
  std::vector<int32_t> prompt_token_ids;
  sampling_params sampling;
  /// Generation stops when the text ends with one of these; it is cut off the output.
  std::vector<std::string> stop;
  /// A PEFT LoRA adapter to compute this request with (vLLM's `lora_request`); loaded on
  /// the workers when it is not.
  std::optional<lora_request> lora;
  /// A PEFT prompt-tuning adapter whose virtual tokens go before the prompt.
  std::optional<prompt_adapter_request> prompt_adapter;
  /// The tokenizer's template wraps a text prompt (Llama 3's `<|begin_of_text|>` first), as
  /// transformers' and vLLM's default; false for text that already holds it (a rendered
  /// chat prompt).
  bool add_special_tokens = true;
};

/// What a request produced.
struct generation_output {
  std::string prompt;
  std::vector<int32_t> prompt_token_ids;
  /// Generated text (empty for a model without a tokenizer).
  std::string text;
  std::vector<int32_t> token_ids;
  /// Logprob of each generated token.
  std::vector<float> logprobs;
  /// "length", "stop" or "abort" (the prompt can never fit).
  std::string finish_reason;
  /// Seconds from the start of `generate` to the first generated token and to the end.
  double first_token_seconds = 0;
  double finished_seconds = 0;
};

/// A model ready to generate. Throws `troupe::error` when the model cannot be loaded.
class llm {
public:
  explicit llm(llm_config config);
  ~llm();

  /// Generates for every request, batched; outputs in request order. Throws
  /// `invalid_argument` for a text prompt when the model has no tokenizer, or a prompt
  /// longer than the model allows.
  std::vector<generation_output> generate(const std::vector<generation_request>& requests);

  /// The same sampling for every prompt.
  std::vector<generation_output> generate(const std::vector<std::string>& prompts,
                                          const sampling_params& sampling);

  /// The prompt for one user message in the model's chat format (ChatML templates).
  /// Throws `unsupported` when the model has no chat template troupe can render.
  std::string chat_prompt(const std::string& user_message) const;

  /// Whether the model came with a tokenizer.
  bool has_tokenizer() const;

  /// Generated tokens per second of the last `generate` (output tokens over wall time).
  double last_tokens_per_second() const;

  troupe::executor& executor();

private:
  /// Adds the adapters `requests` name that the workers have not loaded; returns the
  /// virtual tokens of each prompt adapter, by id.
  std::map<int64_t, int64_t> load_adapters(const std::vector<generation_request>& requests);

  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace troupe
