#pragma once

/// @file
/// Request and reply value types of the executor, after vLLM's `ExecuteModelRequest`,
/// `SamplerOutput`, `LoRARequest`, `PromptAdapterRequest` and friends. Each type is a plain
/// value struct with a free `inspect()` (CAF 0.17 form) so that it can cross the network.
/// The inspectors live beside the types so that every translation unit sees them.

#include <caf/meta/type_name.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace troupe {

// -- memory tags --------------------------------------------------------------

/// A class of device memory that sleeps and wakes together (vLLM's CuMemAllocator tags).
enum class memory_tag : uint8_t {
  /// Model weights: backed up to host memory by a level-1 sleep.
  weights = 0,
  /// The paged KV cache: discarded by every sleep, zeroed on wake-up.
  kv_cache = 1,
};

/// The one of `values` (an enum's values, each named by its `to_string`) that is called
/// `name`; none when no value is. The parsers of the closed sets read names through this.
template <class E, size_t N>
std::optional<E> value_named(std::string_view name, const E (&values)[N]) {
  for (auto v : values)
    if (name == to_string(v))
      return v;
  return std::nullopt;
}

/// Every tag, in order.
inline constexpr memory_tag all_memory_tags[] = {memory_tag::weights, memory_tag::kv_cache};

/// `"weights"` or `"kv_cache"`.
const char* to_string(memory_tag tag);

/// Parses a tag name; `std::nullopt` for an unknown name.
std::optional<memory_tag> parse_memory_tag(std::string_view name);

/// How deep a sleep goes (vLLM's levels).
enum class sleep_level : int32_t {
  /// Level 1: the weights are backed up to host memory, the KV cache is discarded.
  offload_weights = 1,
  /// Level 2: both are discarded (the weights are reloaded or replaced after waking).
  discard = 2,
};

/// The level of vLLM's number (1 or 2); throws `invalid_argument` ("sleep level must be 1
/// or 2, got N") for any other. Every number from outside passes here, once.
sleep_level to_sleep_level(int64_t level);

/// What a worker computes on (vLLM's `device_config.device_type`).
enum class device_kind : uint8_t {
  cpu = 0,
  cuda = 1,
};

/// `"cpu"` or `"cuda"`.
const char* to_string(device_kind kind);

/// The kind of a name; throws `invalid_argument` ("device kind 'tpu' is not known ...")
/// for any other. Every name from outside (a flag, Python) passes here, once.
device_kind parse_device_kind(std::string_view name);

/// Why a sequence ended (vLLM's `CompletionOutput.finish_reason`).
enum class finish_reason : uint8_t {
  /// It reached `max_tokens` or the model's length.
  length = 0,
  /// An end-of-sequence or stop token, or a stop string.
  stop = 1,
  /// `abort_request`, or a prompt that can never fit in the model's length or the cache.
  abort = 2,
};

/// `"length"`, `"stop"` or `"abort"`, as OpenAI's API and vLLM name them.
const char* to_string(finish_reason reason);

/// The two kinds of adapter a worker holds by id: LoRA (vLLM's `LoRARequest`) and prompt
/// tuning (vLLM's `PromptAdapterRequest`).
enum class adapter_kind : uint8_t {
  lora = 0,
  prompt_adapter = 1,
};

/// `"lora"` or `"prompt_adapter"`: the stem of the kind's methods (`add_lora`,
/// `list_prompt_adapters`).
const char* to_string(adapter_kind kind);

// CAF 0.17 serialises enums by their underlying value; an inspect() overload for an enum
// is ambiguous there, so memory_tag, sleep_level, device_kind, finish_reason and adapter_kind
// have none.

// -- sampling -----------------------------------------------------------------

/// How to pick the next token of a sequence (a subset of vLLM's `SamplingParams`).
struct sampling_params {
  /// 0 means greedy.
  float temperature = 1.0f;
  /// Nucleus sampling mass; 1 disables it.
  float top_p = 1.0f;
  /// Keep only the k most likely tokens; -1 disables it.
  int32_t top_k = -1;
  /// Per-request seed; -1 draws from the worker's generator.
  int64_t seed = -1;
  /// Upper bound of generated tokens.
  int32_t max_tokens = 16;
  /// Number of most likely tokens whose logprobs are returned besides the sampled one.
  int32_t logprobs = 0;
  /// Generation stops at any of these tokens.
  std::vector<int32_t> stop_token_ids;
  /// Keep generating past the end-of-sequence token.
  bool ignore_eos = false;
  /// vLLM's penalties, applied to the logits before the temperature: a token of the prompt
  /// or the output has its logit divided by `repetition_penalty` (multiplied when the logit
  /// is negative; 1 disables it, > 0); a token the output holds loses `presence_penalty`
  /// once and `frequency_penalty` for each time it is there (both in [-2, 2]).
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  /// Tokens less likely than `min_p` times the most likely one (at the temperature) are not
  /// drawn; 0 disables it, at most 1.
  float min_p = 0.0f;
  /// OpenAI's logit_bias: `logit_bias_values[i]` is added to the logit of token
  /// `logit_bias_ids[i]` before anything else.
  std::vector<int32_t> logit_bias_ids;
  std::vector<float> logit_bias_values;
  /// The end-of-sequence and stop tokens are not drawn, and stop strings do not end the
  /// output, before it holds this many tokens.
  int32_t min_tokens = 0;
  /// Samples returned for the prompt (vLLM's parallel sampling): each its own sequence
  /// after the shared prompt; with a seed, sample i draws as a request seeded `seed + i`.
  int32_t n = 1;
  /// Samples drawn, of which the `n` most likely (highest sum of logprobs) are returned;
  /// 0 means `n`. At least `n`.
  int32_t best_of = 0;
  /// vLLM's bad_words: words the output must not hold. An engine with a tokenizer turns each
  /// into `bad_words_token_ids` as vLLM does (the word, and the word after a space where
  /// that starts with another token).
  std::vector<std::string> bad_words;
  /// Token sequences the output does not complete: a sequence's last token is not drawn
  /// where the output ends with the rest of it (a one-token sequence never).
  std::vector<std::vector<int32_t>> bad_words_token_ids;
  /// vLLM's prompt_logprobs: the logprob of each prompt token after the ones before it,
  /// with this many most likely tokens at its position (0: the prompt's token alone); -1:
  /// none. A request with them computes its whole prompt (no prefix cache hits).
  int32_t prompt_logprobs = -1;
  /// Structured output (vLLM's guided decoding), at most one of: the output is JSON valid
  /// under `guided_json` (a JSON schema, as text), a JSON object (`guided_json_object`,
  /// OpenAI's JSON mode), one of `guided_choice`, or text that `guided_regex` matches
  /// whole. An engine with a tokenizer enforces it with a mask of the tokens each step may
  /// sample.
  std::string guided_json;
  bool guided_json_object = false;
  std::vector<std::string> guided_choice;
  std::string guided_regex;
};

/// Whether `params` read a sequence's earlier tokens (the repetition, presence and
/// frequency penalties, min_tokens, bad words of several tokens): an engine sends such a
/// sequence's tokens whole.
bool reads_history(const sampling_params& params);

/// Whether `params` ask for structured output (`guided_json`, `guided_json_object`,
/// `guided_choice`, `guided_regex`).
bool guided(const sampling_params& params);

/// Throws `invalid_argument` naming the parameter for a temperature below 0, a top_p
/// outside (0, 1], a repetition penalty not above 0, presence or frequency penalties outside
/// [-2, 2], a min_p outside [0, 1], a negative min_tokens, logit_bias lists of different
/// lengths or a token outside `vocab` (when it is above 0) in logit_bias, an n outside
/// [1, 1024], a best_of other than 0 below n or above 1024, an empty bad word or one with
/// a token outside `vocab`, or prompt_logprobs outside [-1, 20]. Each message starts with
/// the parameter's name.
void validate(const sampling_params& params, int64_t vocab = 0);

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sampling_params& x) {
  return f(caf::meta::type_name("sampling_params"), x.temperature, x.top_p, x.top_k, x.seed,
           x.max_tokens, x.logprobs, x.stop_token_ids, x.ignore_eos, x.repetition_penalty,
           x.presence_penalty, x.frequency_penalty, x.min_p, x.logit_bias_ids, x.logit_bias_values,
           x.min_tokens, x.n, x.best_of, x.bad_words, x.bad_words_token_ids, x.prompt_logprobs,
           x.guided_json, x.guided_json_object, x.guided_choice, x.guided_regex);
}

// -- execute-model request ----------------------------------------------------

/// A sequence's last token in `sequence_data::token_ids` when the host does not know it
/// yet: the token that the driver sampled for that sequence in the step before. An engine
/// that schedules step N+1 while step N runs (asynchronous scheduling) sends it, and the
/// driver puts the token in before the step reaches any rank. Only the last token may be
/// pending, and only for a sequence that the previous step sampled.
constexpr int32_t pending_token = -1;

/// One sequence of a group: its tokens so far and where its KV cache lives.
/// The tokens computed in this step sit at positions
/// `[num_computed_tokens, num_computed_tokens + token_chunk_size)` of the sequence.
struct sequence_data {
  /// vLLM's seq_id.
  int64_t seq_id = 0;
  /// Prompt tokens followed by the tokens generated so far, from position `first_token` on.
  std::vector<int32_t> token_ids;
  /// How many tokens of the sequence are the prompt.
  int32_t num_prompt_tokens = 0;
  /// Tokens whose keys and values are already in the cache (the first position of this step).
  int32_t num_computed_tokens = 0;
  /// Physical KV-cache block of each logical block of the sequence, from block
  /// `first_block` on.
  std::vector<int32_t> block_table;
  /// The index of `block_table[0]` among the sequence's blocks. Above 0 only in a step that
  /// `keep_block_tables`: the blocks before it are those the ranks kept from earlier steps,
  /// so that a step's request does not grow with its sequences.
  int32_t first_block = 0;
  /// The position of `token_ids[0]` in the sequence. The tokens before it are left out (at
  /// most up to `num_computed_tokens`, and only where the group's sampling does not
  /// `reads_history`), so that a step's request does not grow with its sequences.
  int32_t first_token = 0;

  /// The sequence's length, the tokens left out included.
  int64_t length() const {
    return first_token + static_cast<int64_t>(token_ids.size());
  }
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sequence_data& x) {
  return f(caf::meta::type_name("sequence_data"), x.seq_id, x.token_ids, x.num_prompt_tokens,
           x.num_computed_tokens, x.block_table, x.first_token, x.first_block);
}

/// The positions of the tokens a sequence computes in a step of `token_chunk_size` tokens.
std::vector<int32_t> step_positions(const sequence_data& seq, int32_t token_chunk_size);

/// A request's sequences for one step (vLLM's `SequenceGroupMetadata`).
struct sequence_group_metadata {
  std::string request_id;
  /// True while the prompt is being prefilled.
  bool is_prompt = false;
  std::vector<sequence_data> seqs;
  sampling_params sampling;
  /// Tokens per sequence computed in this step (the whole prompt or a chunk of it; 1 in decode).
  int32_t token_chunk_size = 0;
  /// Whether this step samples a token (false for a non-final prefill chunk).
  bool do_sample = true;
  /// LoRA adapter of the request; 0 for none.
  int64_t lora_int_id = 0;
  /// Prompt adapter of the request; 0 for none.
  int64_t prompt_adapter_id = 0;
  /// The tokens this step may sample, as a bitmask (bit t of word t / 32): structured
  /// output's. Empty: any.
  std::vector<uint32_t> allowed_tokens;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sequence_group_metadata& x) {
  return f(caf::meta::type_name("sequence_group_metadata"), x.request_id, x.is_prompt, x.seqs,
           x.sampling, x.token_chunk_size, x.do_sample, x.lora_int_id, x.prompt_adapter_id,
           x.allowed_tokens);
}

/// A block move of the cache manager: `src` to `dst`.
struct block_move {
  int32_t src = 0;
  int32_t dst = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, block_move& x) {
  return f(caf::meta::type_name("block_move"), x.src, x.dst);
}

/// One step of the model for a batch of sequence groups (vLLM's `ExecuteModelRequest`).
struct execute_model_request {
  std::vector<sequence_group_metadata> seq_group_metadata_list;
  /// Host (swap) blocks copied to device blocks before the step.
  std::vector<block_move> blocks_to_swap_in;
  /// Device blocks copied to host (swap) blocks before the step.
  std::vector<block_move> blocks_to_swap_out;
  /// Device blocks copied to other device blocks (copy-on-write) before the step.
  std::vector<block_move> blocks_to_copy;
  int32_t num_lookahead_slots = 0;
  int32_t running_queue_size = 0;
  int32_t virtual_engine = 0;
  /// Requests that finished since the last step; workers drop their per-request state.
  std::vector<std::string> finished_requests_ids;
  /// The ranks keep each sequence's block table after the step, until its request is among
  /// `finished_requests_ids` (or the cache is initialized again), and later steps send only
  /// the blocks added or changed since (`sequence_data::first_block`), as vLLM V1's cached
  /// requests do. A sequence sent with `first_block` 0 replaces what they kept of it.
  bool keep_block_tables = false;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, execute_model_request& x) {
  return f(caf::meta::type_name("execute_model_request"), x.seq_group_metadata_list,
           x.blocks_to_swap_in, x.blocks_to_swap_out, x.blocks_to_copy, x.num_lookahead_slots,
           x.running_queue_size, x.virtual_engine, x.finished_requests_ids, x.keep_block_tables);
}

// -- sampler output -----------------------------------------------------------

/// A token and its log-probability.
struct token_logprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, token_logprob& x) {
  return f(caf::meta::type_name("token_logprob"), x.token, x.logprob);
}

/// The token sampled for one sequence (vLLM's `SequenceOutput`).
struct sequence_output {
  int64_t parent_seq_id = 0;
  int32_t output_token = 0;
  /// Log-probability of `output_token`.
  float logprob = 0.0f;
  /// 1 + the number of tokens more likely than `output_token` (vLLM's rank).
  int32_t rank = 0;
  /// The `sampling_params::logprobs` most likely tokens, most likely first.
  std::vector<token_logprob> top_logprobs;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sequence_output& x) {
  return f(caf::meta::type_name("sequence_output"), x.parent_seq_id, x.output_token, x.logprob,
           x.rank, x.top_logprobs);
}

/// The logprob of one prompt token after the tokens before it (an entry of vLLM's
/// `prompt_logprobs`).
struct prompt_logprob {
  /// Its place in the prompt (1 or more: the first token has none).
  int32_t position = 0;
  int32_t token = 0;
  float logprob = 0.0f;
  /// 1 + the number of tokens more likely than it there (vLLM's rank).
  int32_t rank = 0;
  /// The `sampling_params::prompt_logprobs` most likely tokens there, most likely first.
  std::vector<token_logprob> top_logprobs;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, prompt_logprob& x) {
  return f(caf::meta::type_name("prompt_logprob"), x.position, x.token, x.logprob, x.rank,
           x.top_logprobs);
}

/// The samples of one sequence group (vLLM's `CompletionSequenceGroupOutput`).
struct sequence_group_output {
  std::string request_id;
  std::vector<sequence_output> samples;
  /// The prompt positions the step computed, for a group with `prompt_logprobs`.
  std::vector<prompt_logprob> prompt_logprobs;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sequence_group_output& x) {
  return f(caf::meta::type_name("sequence_group_output"), x.request_id, x.samples,
           x.prompt_logprobs);
}

/// Output of one model step for the whole batch (vLLM's `SamplerOutput`).
struct sampler_output {
  std::vector<sequence_group_output> outputs;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sampler_output& x) {
  return f(caf::meta::type_name("sampler_output"), x.outputs);
}

// -- adapters -----------------------------------------------------------------

/// A LoRA adapter to load (vLLM's `LoRARequest`). `lora_int_id` must be > 0.
struct lora_request {
  std::string lora_name;
  int64_t lora_int_id = 0;
  /// Directory with `adapter_config.json` and `adapter_model.safetensors`.
  std::string lora_path;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, lora_request& x) {
  return f(caf::meta::type_name("lora_request"), x.lora_name, x.lora_int_id, x.lora_path);
}

/// A prompt adapter to load (vLLM's `PromptAdapterRequest`). `prompt_adapter_id` must be > 0.
struct prompt_adapter_request {
  std::string prompt_adapter_name;
  int64_t prompt_adapter_id = 0;
  std::string prompt_adapter_local_path;
  int32_t prompt_adapter_num_virtual_tokens = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, prompt_adapter_request& x) {
  return f(caf::meta::type_name("prompt_adapter_request"), x.prompt_adapter_name,
           x.prompt_adapter_id, x.prompt_adapter_local_path, x.prompt_adapter_num_virtual_tokens);
}

// -- cache, memory, state -----------------------------------------------------

/// KV-cache block counts: vLLM's `(num_gpu_blocks, num_cpu_blocks)`.
struct cache_blocks {
  /// Blocks on the worker's device, usable by running sequences (vLLM's num_gpu_blocks).
  int64_t num_device_blocks = 0;
  /// Blocks in host memory that swapped-out sequences occupy (vLLM's num_cpu_blocks).
  int64_t num_swap_blocks = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, cache_blocks& x) {
  return f(caf::meta::type_name("cache_blocks"), x.num_device_blocks, x.num_swap_blocks);
}

/// Arguments of `sleep`.
struct sleep_request {
  sleep_level level = sleep_level::offload_weights;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sleep_request& x) {
  return f(caf::meta::type_name("sleep_request"), x.level);
}

/// Arguments of `wake_up`: the tags to wake; empty wakes every sleeping tag.
struct wake_request {
  std::vector<memory_tag> tags;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, wake_request& x) {
  return f(caf::meta::type_name("wake_request"), x.tags);
}

/// Arguments of `save_sharded_state` (vLLM's path, pattern, max_size).
struct sharded_state_request {
  /// Directory the shards go to.
  std::string path;
  /// File name pattern with `{rank}` and `{part}`; empty for
  /// `model-rank-{rank}-part-{part}.safetensors`.
  std::string pattern;
  /// Bytes per file; 0 for the default (5 GiB).
  int64_t max_size = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sharded_state_request& x) {
  return f(caf::meta::type_name("sharded_state_request"), x.path, x.pattern, x.max_size);
}

/// Bytes a worker holds per memory tag.
struct memory_usage {
  memory_tag tag = memory_tag::weights;
  /// Bytes allocated under the tag (reserved address space).
  int64_t allocated_bytes = 0;
  /// Bytes of the tag currently backed by device memory (0 while it sleeps).
  int64_t resident_bytes = 0;
  /// Bytes of host backup held for the tag.
  int64_t backup_bytes = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, memory_usage& x) {
  return f(caf::meta::type_name("memory_usage"), x.tag, x.allocated_bytes, x.resident_bytes,
           x.backup_bytes);
}

/// Who a worker is and where it runs.
struct worker_info {
  int32_t rank = 0;
  int32_t world_size = 1;
  /// Device the worker owns, e.g. `"cpu:0"` or `"cuda:1"`.
  std::string device;
  std::string hostname;
  int64_t pid = 0;
  /// The model the worker loaded (`model_worker_options::model_path`) and a fingerprint of
  /// its files and config; empty for workers without a model. The executor refuses to start
  /// when ranks loaded different files.
  std::string model;
  std::string model_fingerprint;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, worker_info& x) {
  return f(caf::meta::type_name("worker_info"), x.rank, x.world_size, x.device, x.hostname, x.pid,
           x.model, x.model_fingerprint);
}

/// Answer of a worker's health check.
struct worker_health {
  int32_t rank = 0;
  bool healthy = true;
  /// Why the worker is unhealthy; empty when healthy.
  std::string detail;
  std::vector<memory_usage> memory;
  /// Tags that sleep on this worker.
  std::vector<memory_tag> sleeping_tags;
  /// How many times the executor replaced the worker of this rank (`restart_policy`).
  int32_t restarts = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, worker_health& x) {
  return f(caf::meta::type_name("worker_health"), x.rank, x.healthy, x.detail, x.memory,
           x.sleeping_tags, x.restarts);
}

} // namespace troupe
