#pragma once

/// @file
/// `troupe::llm`: offline generation for a batch of prompts (vLLM's `LLM.generate`), on an
/// executor of model workers with a continuous-batching scheduler.

#include "troupe/executor.hpp"
#include "troupe/model_worker.hpp"
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

/// How the engine batches requests into steps (the part of vLLM's `SchedulerConfig` that
/// `troupe::llm` reads).
struct scheduler_config {
  /// Tokens computed in one step, prompts and decodes together.
  int32_t max_num_batched_tokens = 2048;
  /// Sequences in one step.
  int32_t max_num_seqs = 64;
  /// How a running sequence gives way when blocks run out: by swapping its blocks out
  /// (when swap space allows) or by dropping them and computing the prompt again.
  bool preempt_by_swap = true;
  /// Asynchronous scheduling (vLLM's `async_scheduling`, opt-in there too): while a step
  /// runs, the engine schedules and sends the next one when it needs none of the running
  /// step's tokens on the host: every running request decodes once more, and the driver
  /// passes on the token it sampled. The workers then go from step to step without waiting
  /// for the host. The tokens are the same either way; a request that ends in a step is
  /// dropped from the step already sent after it. It pays where the host has a core to
  /// itself (a GPU's workers mostly wait for the device); on a CPU whose cores all run the
  /// model, the host's work competes with the step (`troupe bench generate
  /// --async-scheduling both` measures both).
  bool async_scheduling = false;
  /// Automatic prefix caching (vLLM's `enable_prefix_caching`, on by default as in vLLM
  /// V1): a request whose first tokens (whole blocks of them, under the same adapters) were
  /// computed before reuses their keys and values instead of computing them again. Off
  /// where the rope depends on the sequence's length: dynamic NTK scaling past
  /// max_position_embeddings, LongRoPE past its original length (when max_model_len
  /// reaches there).
  bool enable_prefix_caching = true;

  /// Throws `troupe::error` (`invalid_argument`) naming a limit below 1.
  void validate() const;
};

/// How to run the model: the workers' model options, the executor's, the scheduler's.
/// Each part keeps its own meaning (see its type); the engine fills in what they share:
/// the workers profile the largest step the scheduler sends
/// (`worker.max_num_batched_tokens` and `max_num_seqs` come from `scheduler`), and the
/// nodes are asked for model workers with `worker`'s options.
struct llm_config {
  /// The model (`worker.model_path`: a Hugging Face directory or a GGUF file) and how each
  /// worker holds it: dtype, KV-cache and swap sizes, adapter slots, load progress.
  model_worker_options worker;
  /// How many workers and where: `tensor_parallel_size`, `device_type`, `nodes` and their
  /// secret or TLS, `block_size`, timeouts. `max_model_len` 0 (the engine's default) takes
  /// the model's longest sequence (max_position_embeddings stretched by its rope scaling,
  /// as vLLM does); a larger value is cut to it.
  executor_config executor;
  scheduler_config scheduler;
  /// A chat template (Jinja text, as in tokenizer_config.json) used instead of the model's;
  /// empty keeps the model's.
  std::string chat_template;

  /// The engine's defaults where they differ from the parts': the model's own length, ten
  /// minutes for a call (a step of a long prompt on a CPU may take minutes), and 256 MiB
  /// of swap space per worker. Set fields one by one: assigning a whole
  /// `executor_config{}` or `model_worker_options{}` brings back those types' own defaults
  /// (a max_model_len of 2048, 60 s, no swap).
  llm_config();

  /// Every part's `validate()`: throws `troupe::error` (`invalid_argument`) naming the
  /// first field out of range.
  void validate() const;
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

/// One message of a chat.
struct chat_message {
  /// "system", "user", "assistant" or "tool": whatever the model's template takes.
  std::string role;
  std::string content;
};

/// A conversation as OpenAI's API and transformers' `apply_chat_template` take it, in JSON
/// texts, so that messages may carry what a template reads beyond role and content
/// (`tool_calls`, `tool_call_id`, `name`).
struct chat_request {
  /// A JSON array of message objects, each with a string `role`.
  std::string messages_json;
  /// A JSON array of tool schemas (OpenAI's `tools`); empty: none.
  std::string tools_json;
  /// A JSON object of extra template variables (vLLM's `chat_template_kwargs`, e.g.
  /// `{"enable_thinking": false}`); empty: none.
  std::string variables_json;
  /// End the prompt where the assistant speaks next.
  bool add_generation_prompt = true;
};

/// What a request produced.
struct generation_output {
  /// Which of the request's `sampling.n` samples it is (OpenAI's choice index).
  int32_t index = 0;
  std::string prompt;
  std::vector<int32_t> prompt_token_ids;
  /// Generated text (empty for a model without a tokenizer).
  std::string text;
  std::vector<int32_t> token_ids;
  /// Logprob of each generated token, and its rank (1 + the tokens more likely there).
  std::vector<float> logprobs;
  std::vector<int32_t> ranks;
  /// The `sampling.logprobs` most likely tokens at each step, most likely first.
  std::vector<std::vector<token_logprob>> top_logprobs;
  /// With `sampling.prompt_logprobs`: the logprob of each prompt token from position 1 on
  /// (positions in `prompt_token_ids`).
  std::vector<prompt_logprob> prompt_logprobs;
  /// Why it ended (`to_string` gives OpenAI's and vLLM's name).
  troupe::finish_reason finish_reason = finish_reason::length;
  /// Seconds from the request's arrival (`add_request`, or the start of `generate`) to
  /// the first generated token and to the end.
  double first_token_seconds = 0;
  double finished_seconds = 0;
};

/// What one engine step did to a request (`llm::step`).
struct generation_update {
  int64_t request_id = 0;
  /// The sample it is about (`generation_output::index`).
  int32_t index = 0;
  /// Tokens sampled for it in the step (one, none for a prefill chunk, or more when steps
  /// overlap), with their logprobs and ranks.
  std::vector<int32_t> token_ids;
  std::vector<float> logprobs;
  std::vector<int32_t> ranks;
  std::vector<std::vector<token_logprob>> top_logprobs;
  /// The prompt's logprobs (`generation_output::prompt_logprobs`), with the first token.
  std::vector<prompt_logprob> prompt_logprobs;
  /// The text they add. Text that may still change is held back: a character whose bytes
  /// have not all come, or what may be the start of a stop string. Empty without a
  /// tokenizer.
  std::string text;
  /// The sample is done; `output` holds all of it (its text cut at a stop string). A
  /// request is done when each of its `n` samples is.
  bool finished = false;
  std::optional<generation_output> output;
};

/// The engine's counts, for metrics (`llm::stats`).
struct engine_stats {
  /// Sequences (a request's samples each count) in the running batch, waiting for their
  /// first step (or a recomputation), and swapped out.
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t swapped = 0;
  /// Fraction of the device's KV-cache blocks in use.
  double kv_cache_usage = 0;
  /// Tokens so far: prompts added, tokens generated.
  int64_t prompt_tokens = 0;
  int64_t generation_tokens = 0;
  /// Steps run, the requests in the last one and the most in any one.
  int64_t steps = 0;
  int64_t last_step_requests = 0;
  int64_t max_step_requests = 0;
  int64_t preemptions = 0;
  /// Tokens looked up in the prefix cache and found there (vLLM's `prefix_cache_queries`
  /// and `prefix_cache_hits`: each sequence's prompt when it starts, and its tokens so far
  /// when it is computed again), and tokens computed before a sequence's first sample or a
  /// recomputed one's next (prefill chunks).
  int64_t prefix_cache_queries = 0;
  int64_t prefix_cache_hits = 0;
  int64_t prefill_tokens = 0;
  /// The engine's own time in the last step, without the workers': scheduling, and
  /// taking the outputs in (detokenizing, stop strings, updates).
  double last_step_host_seconds = 0;
  /// The same on the engine thread's CPU clock: its own work, without the time other
  /// threads (the workers' among them, on a machine with few cores) held its core.
  double last_step_host_cpu_seconds = 0;
  /// Seconds the engine spent on structured output's masks, in all (part of the host's
  /// time of the steps).
  double structured_output_seconds = 0;
  /// Workers replaced under the restart policy that cost the engine a step, and the
  /// sequences computed again after them (from their prompts and tokens so far).
  int64_t recoveries = 0;
  int64_t recomputed_sequences = 0;
};

/// A model ready to generate. Throws `troupe::error` when the model cannot be loaded.
class llm {
public:
  explicit llm(llm_config config);
  /// The same with the workers `factory` makes: model workers for `config.worker`, or
  /// subclasses of them (to instrument a worker, or to test what a fault does).
  llm(llm_config config, worker_factory factory);
  ~llm();

  /// Generates for every request, batched; outputs in request order, the `sampling.n`
  /// samples of a request one after another (by `index`). Throws
  /// `invalid_argument` for a text prompt when the model has no tokenizer, or a prompt
  /// longer than the model allows.
  std::vector<generation_output> generate(const std::vector<generation_request>& requests);

  /// The same, calling `between_steps` after each step while requests are unfinished (a
  /// Python host checks for Ctrl-C there). What it throws aborts every request of the call,
  /// which ends before the exception goes on.
  std::vector<generation_output> generate(const std::vector<generation_request>& requests,
                                          const std::function<void()>& between_steps);

  /// The same sampling for every prompt.
  std::vector<generation_output> generate(const std::vector<std::string>& prompts,
                                          const sampling_params& sampling);

  // -- online use (vLLM's LLMEngine): requests join and leave between steps ------------
  // One thread drives these (and `generate`, which is built on them).

  /// Queues a request for the steps to come and returns its id. Throws `invalid_argument`
  /// as `generate` does (nothing is queued then), for a prompt token id the model does not
  /// know, or for a bad adapter: a request's own mistakes never reach a step, where they
  /// would fail the others. A request of `sampling.n` (or `best_of`) samples runs as that
  /// many sequences after the one prompt (whose blocks the prefix cache shares); each
  /// sample's updates carry its `index`, and with `best_of` above `n` only the chosen
  /// samples' last updates come, once all are drawn.
  int64_t add_request(const generation_request& request);

  /// Ends a request (all its samples) now with finish_reason "abort" and frees its KV-cache
  /// blocks; its last updates come from the next `step`. Unknown or finished ids are
  /// ignored.
  void abort_request(int64_t id);

  /// Whether any request is unfinished (or a step is in flight).
  bool has_unfinished_requests() const;

  /// Runs one step (with asynchronous scheduling: sends the next and waits for the oldest
  /// in flight) and returns what it did to each request it changed. A worker replaced
  /// under the restart policy costs the step: the requests are computed again, and the
  /// tokens stay those of an undisturbed run. Other executor errors are thrown; the
  /// requests stay queued (to be computed again, or aborted by the caller).
  std::vector<generation_update> step();

  /// Counts for metrics.
  engine_stats stats() const;

  /// Puts the workers to sleep (`executor::sleep`); the prefix cache, whose memory the
  /// sleep discards, is forgotten as vLLM's `LLM.sleep` does (also after a sleep through
  /// `executor()`). Wake them with `executor().wake_up`. Throws `invalid_argument` while
  /// requests are unfinished.
  void sleep(int32_t level = 1);

  /// Writes new weights over the loaded ones on every rank, in place, all ranks or none
  /// (`model_worker::update_weights`: any subset of the parameters, whole, under their
  /// Hugging Face names; each rank takes its shard). Every rank checks the update first;
  /// the first problem (a name, shape or type that does not fit, a float tensor for a
  /// quantized weight without `quantize_on_update`, NaN) throws `invalid_argument` naming
  /// the parameter, with every rank still on its old weights. While the weights sleep they
  /// are woken first (the KV cache stays asleep; after a level-2 sleep the update refills
  /// them). The prefix cache is forgotten and `weight_version` counts the update. Throws
  /// `invalid_argument` while requests are unfinished, and `remote_callable` when a worker
  /// lives in another process (the tensors are this process's memory). Under a restart
  /// policy a replaced worker of this process comes up with every update since the
  /// checkpoint (`executor_config::on_replacement`): the engine keeps the last checkpoint
  /// updated from and a host copy of each tensor written since, recorded once every rank
  /// has accepted an update and before any writes, so a rank that dies while the others
  /// write (the call then fails with `worker_replaced`) is replaced with it too.
  void update_weights_from_tensors(const std::vector<host_tensor>& tensors,
                                   const weight_update_options& options = {});

  /// The same from a checkpoint of the model's shape (a Hugging Face directory or a GGUF
  /// file, holding every weight), which each worker reads from `path` on its own host.
  void update_weights_from_disk(const std::string& path, const weight_update_options& options = {});

  /// Joins every rank to a weight-update group (`weight_update_group`, SGLang's
  /// `init_weights_update_group`): rank r as member `rank_offset + r` of `world_size`;
  /// the trainer is member 0 and joins at the same time (`troupe.WeightSender` in
  /// Python). Blocks until all have come, or `timeout`.
  void init_weights_update_group(const std::string& master_address, int32_t master_port,
                                 int32_t rank_offset, int32_t world_size,
                                 const std::string& backend = "gloo",
                                 timeout_type timeout = std::chrono::seconds(60));

  /// Leaves the weight-update group.
  void destroy_weights_update_group();

  /// New weights from the trainer over the group (SGLang's
  /// `update_weights_from_distributed`): `tensors` names each one the trainer broadcasts,
  /// in order, with its dtype and shape (no data). Every rank checks them first; the
  /// engine's rank 0 tells the group whether the update goes ahead (the trainer's sender
  /// raises when it does not, sending nothing), then every rank receives each tensor and
  /// the update goes as `update_weights_from_tensors`, all ranks or none.
  void update_weights_from_distributed(const std::vector<host_tensor>& tensors,
                                       const weight_update_options& options = {});

  /// Successful weight updates so far (SGLang's `weight_version`; 0 for the loaded
  /// checkpoint).
  int64_t weight_version() const;

  /// Forgets every cached prefix: later requests compute their prompts whole until cached
  /// again (vLLM's `reset_prefix_cache`). Call it after changing the workers' weights in
  /// place: the cached keys and values are the old weights'.
  void reset_prefix_cache();

  /// The prompt for one user message, rendered by the model's own chat template (its Jinja
  /// text, as transformers renders it). Throws `unsupported` when the model has no
  /// template, or one outside the interpreter's subset (naming the construct).
  std::string chat_prompt(const std::string& user_message) const;

  /// The prompt for a conversation, ending where the assistant speaks next. Throws
  /// `unsupported` as above, `invalid_argument` with the template's own message when it
  /// refuses the conversation (roles that do not alternate, say) or for no message.
  std::string chat_prompt(const std::vector<chat_message>& messages) const;

  /// The same for a conversation with tools, tool calls or template variables (a name of
  /// its own: `{{"user", "hi"}}` would fit a `chat_request` too).
  std::string render_chat(const chat_request& request) const;

  /// Whether the model came with a tokenizer.
  bool has_tokenizer() const;

  /// The token ids of a text prompt, as `add_request` makes them (the tokenizer's template
  /// around it when `add_special_tokens`). Any thread, while another drives the engine:
  /// a server tokenizes where its steps do not wait. Throws `invalid_argument` when the
  /// model has no usable tokenizer.
  std::vector<int32_t> tokenize(const std::string& text, bool add_special_tokens = true) const;

  /// The number of token ids the model knows; a prompt's ids are below it.
  int64_t vocab_size() const;

  /// The text of `token_ids` (special tokens skipped); empty without a tokenizer.
  std::string decode(const std::vector<int32_t>& token_ids) const;

  /// The model's longest sequence, prompt and output together.
  int64_t max_model_len() const;

  /// Generated tokens per second of the last `generate` (output tokens over wall time).
  double last_tokens_per_second() const;

  troupe::executor& executor();

  /// The configuration it runs with (as given, before the engine filled in defaults).
  const llm_config& config() const;

private:
  /// Adds the adapters `requests` name that the workers have not loaded; returns the
  /// virtual tokens of each prompt adapter, by id.
  std::map<int64_t, int64_t> load_adapters(const std::vector<generation_request>& requests);

  /// `add_request` once its adapters are loaded (`virtual_tokens`: of each prompt adapter).
  int64_t queue(const generation_request& request,
                const std::map<int64_t, int64_t>& virtual_tokens);

  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace troupe
