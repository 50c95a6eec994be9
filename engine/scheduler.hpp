#pragma once

#include "engine/block_manager.hpp"
#include "troupe/llm.hpp"
#include "troupe/types.hpp"

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace troupe {

/// What the engine adds to the scheduler's configuration: the model's length, and the
/// adapter slots of the workers.
struct scheduler_limits {
  /// Longest prompt plus output a request may have.
  int64_t max_model_len = 2048;
  /// Distinct LoRA adapters among the running requests (vLLM's `max_loras`); a waiting
  /// request with another adapter waits while the limit is reached. 0: no limit.
  int64_t max_loras = 0;
  /// The same for prompt adapters (vLLM's `max_prompt_adapters`). 0: no limit.
  int64_t max_prompt_adapters = 0;
  /// A sequence whose next token lands at this position is computed again from its first
  /// token (LongRoPE's original length: past it every position rotates with the long
  /// factors, and transformers recomputes the cache there). 0: never.
  int64_t restart_at = 0;
};

/// One request as the scheduler tracks it.
struct engine_request {
  std::string request_id;
  int64_t seq_id = 0;
  std::vector<int32_t> prompt;
  sampling_params sampling;
  int64_t lora_int_id = 0;
  /// Prompt adapter of the request; 0 for none. Its placeholder tokens are in `prompt`.
  int64_t prompt_adapter_id = 0;
  /// Generated so far, with the logprob and rank of each token.
  std::vector<int32_t> output;
  std::vector<float> logprobs;
  std::vector<int32_t> ranks;
  /// The most likely tokens at each step (`sampling.logprobs` of them).
  std::vector<std::vector<token_logprob>> top_logprobs;
  /// With `sampling.prompt_logprobs`: each prompt position's from 1 on, as far as computed
  /// (a recomputation's come once).
  std::vector<prompt_logprob> prompt_logprobs;
  /// Tokens whose keys and values are in the cache.
  int64_t num_computed = 0;
  /// Tokens of steps in flight not yet in `output` (0 or 1).
  int64_t pending = 0;
  /// Tokens of a prefill chunk in flight that samples nothing: a prompt (or a recomputed
  /// request) longer than a step's token budget is computed over several steps.
  int64_t chunk = 0;
  bool finished = false;
  /// Why it finished (`abort`: it can never fit in the model's length or the cache).
  troupe::finish_reason finish_reason = finish_reason::length;

  int64_t length() const {
    return static_cast<int64_t>(prompt.size() + output.size());
  }
};

/// Continuous batching (after vLLM's v0 scheduler): every step runs the decodes of all
/// running requests and admits waiting prompts while the token budget, the sequence limit
/// and the free blocks allow, so prefills and decodes share a step. When a running request
/// cannot grow, the most recently admitted one is preempted (swapped out, or recomputed
/// later). A request longer than `max_num_batched_tokens` (a long prompt, or a request
/// recomputed with its tokens so far) is prefilled in chunks, one per step, sampling only
/// after the last. Requests that can never fit the model's length or the cache are
/// finished with reason "abort".
class scheduler {
public:
  /// A sampled token among `eos_token_ids` finishes its request ("stop") unless the
  /// request ignores end-of-sequence; its `stop_token_ids` always do.
  /// Throws `invalid_argument` when a limit is not positive.
  scheduler(scheduler_config config, scheduler_limits limits, int32_t block_size,
            int64_t device_blocks, int64_t swap_blocks, std::vector<int32_t> eos_token_ids);

  /// Queues a request. Throws `invalid_argument` for an empty prompt.
  void add(engine_request request);

  /// Whether any request is not finished.
  bool has_unfinished() const;

  /// The next step: the request for the executor (with its block moves). Empty when
  /// nothing can run. Only when no step is in flight (every step scheduled was updated).
  execute_model_request schedule();

  /// The step after the one in flight, made before its tokens are known (asynchronous
  /// scheduling): each running request decodes one more token, whose input is the one the
  /// step in flight samples (`pending_token`). None when the host's view is needed first:
  /// no step or more than one is in flight, requests wait or are swapped out, or a request
  /// needs a block when none is free. A request that the step in flight surely ends (its
  /// length) is left out.
  std::optional<execute_model_request> schedule_ahead();

  /// Applies the sampled tokens of the oldest step in flight (scheduled and not yet
  /// updated); finishes requests that hit a stop condition and frees their blocks. The
  /// outputs of requests finished since that step was scheduled are dropped.
  void update(const sampler_output& output);

  /// Steps scheduled and not yet updated.
  size_t in_flight() const {
    return in_flight_.size();
  }

  /// Forgets every step in flight and every KV cache: each unfinished request waits to be
  /// computed again from its prompt and the tokens it has (the workers' caches are gone, as
  /// after a worker was replaced). Running requests go first, in their order. Returns how
  /// many sequences are computed again.
  size_t recompute_all();

  /// Finishes an unfinished request now (e.g. a stop string appeared), freeing its blocks.
  void finish(int64_t seq, troupe::finish_reason reason);

  /// The unfinished requests, by sequence id.
  const std::map<int64_t, engine_request>& unfinished() const {
    return requests_;
  }

  /// Takes the finished requests out of the scheduler.
  std::vector<engine_request> take_finished();

  /// Requests running (in the batch), waiting for their first step or for a recomputation,
  /// and swapped out; the device blocks in use and in all (for metrics).
  size_t num_running() const {
    return running_.size();
  }
  size_t num_waiting() const {
    return waiting_.size();
  }
  size_t num_swapped() const {
    return swapped_.size();
  }
  int64_t used_device_blocks() const {
    return blocks_.device_blocks() - blocks_.free_device_blocks();
  }
  int64_t device_blocks() const {
    return blocks_.device_blocks();
  }

  /// Preemptions so far (for tests and metrics).
  int64_t preemptions() const {
    return preemptions_;
  }

  /// Steps made by `schedule_ahead` so far (for tests and metrics).
  int64_t steps_ahead() const {
    return steps_ahead_;
  }

  /// Prompt tokens looked up in the prefix cache and found there; prompt tokens computed.
  int64_t prefix_cache_queries() const {
    return blocks_.cache_queries();
  }
  int64_t prefix_cache_hits() const {
    return blocks_.cache_hits();
  }
  int64_t prefill_tokens() const {
    return prefill_tokens_;
  }

  /// Asks for the memory that the update of the step in flight and the next schedule read
  /// (see `hot_set`): called as the step's result comes.
  void prefetch() const {
    hot_.prefetch();
  }

  /// Forgets the prefix cache (the workers' KV caches were discarded, by a sleep say).
  void reset_prefix_cache() {
    blocks_.reset_cache();
  }

  /// Prompt tokens whose logprobs one step computes, at most (their rows of logits go to
  /// the host whole).
  static constexpr int64_t max_prompt_logprob_rows = 512;

private:
  void preempt(int64_t seq);
  /// Drops `seq`'s cache and puts it first among the waiting requests, to be computed again
  /// from its first token.
  void restart(int64_t seq);
  /// Whether a token computed at `position` starts its sequence over (`restart_at`).
  bool restarts_at(int64_t position) const;
  /// Adds `r`'s group to `step` computing `chunk` tokens; it samples unless `is_prompt` and
  /// the chunk leaves part of the request uncomputed.
  void append_group(engine_request& r, int64_t chunk, bool is_prompt, execute_model_request& step);
  /// Whether running request `r` has more than its last token to compute (a chunked prefill
  /// under way).
  static bool prefilling(const engine_request& r) {
    return r.num_computed + 1 < r.length();
  }
  /// Whether `r`'s tokens so far (known and pending) reach its max_tokens or the model's
  /// length.
  bool at_length_limit(const engine_request& r) const;
  /// `r`'s tokens, as the prefix cache knows them.
  static block_manager::tokens_view tokens_of(const engine_request& r);

  scheduler_config config_;
  scheduler_limits limits_;
  block_manager blocks_;
  std::vector<int32_t> eos_;
  std::map<int64_t, engine_request> requests_;
  std::deque<int64_t> waiting_;
  std::vector<int64_t> running_;
  std::deque<int64_t> swapped_;
  /// A step in flight: its sequences in request order, and the finished requests whose
  /// kept block tables it tells the ranks to drop (told again if the step is lost).
  struct flight {
    std::vector<int64_t> seqs;
    std::vector<std::string> finished_ids;
  };
  /// Puts the step's sequences (`scheduled_`) in flight, with the finished requests not
  /// yet told; a step of no sequences is not sent and tells nothing.
  void seal(execute_model_request& step);

  /// The steps in flight, oldest first; `scheduled_` collects the sequences of the step
  /// being made.
  std::deque<flight> in_flight_;
  std::vector<int64_t> scheduled_;
  std::vector<engine_request> finished_;
  /// Requests finished since the last step sent: the ranks still keep their block tables.
  std::vector<std::string> untold_finished_;
  hot_set hot_;
  int64_t preemptions_ = 0;
  int64_t steps_ahead_ = 0;
  int64_t prefill_tokens_ = 0;
};

} // namespace troupe
