#pragma once

#include "kernels/backend.hpp"
#include "troupe/types.hpp"

#include <cstdint>
#include <random>

namespace troupe {

/// Picks the next token of one sequence from its logits (`vocab` floats), after vLLM's
/// sampler: greedy when `temperature` is (close to) 0; otherwise temperature, then top-k,
/// then top-p, then a draw (`choose_token`). The reported logprobs are those of the
/// model's distribution (log-softmax of the raw logits).
///
/// Determinism: with `params.seed >= 0` the draw depends only on the seed, `stream` (the
/// sequence's place in its group, so that a group's samples differ) and `step` (its number
/// of generated tokens), so a seeded request gives the same tokens however it is batched
/// and whenever it is sent, as in vLLM; without a seed the draw comes from `rng`. The
/// caller sets the output's `parent_seq_id`.
/// `processed`, when given, holds the logits after `edit_row`: the token is drawn from
/// them, the logprobs still from `logits`.
sequence_output sample_token(const float* logits, int64_t vocab, const sampling_params& params,
                             int64_t stream, int64_t step, std::mt19937_64& rng,
                             const float* processed = nullptr);

/// The `n` most likely tokens of `logits` (most likely first, the lower id on a tie) with
/// their log-softmax (`log_z` is `log_partition`'s).
std::vector<token_logprob> most_likely(const float* logits, int64_t vocab, float log_z, int64_t n);

/// 1 + the number of tokens more likely than `token` under `logits` (vLLM's rank).
int32_t rank_of(const float* logits, int64_t vocab, int64_t token);

/// Prompt token `token` at `position` under the logits of the position before it: its
/// log-softmax, its rank, and the `top` most likely tokens there.
prompt_logprob prompt_logprob_of(const float* logits, int64_t vocab, int32_t position,
                                 int32_t token, int32_t top);

/// Whether `params` change the logits before the draw (bad words, penalties, logit_bias,
/// min_tokens): then `logit_edits` has work.
bool processes_logits(const sampling_params& params);

/// vLLM's processing of one row's logits before the temperature, as edits of row `row`
/// (one per token changed, in token order, appended to `edits`; see `logit_edit`): bad
/// words (a word's last token banned where the output ends with the rest of it);
/// logit_bias; min_tokens (the `stop_ids`, EOS and the request's stop tokens, banned while
/// the output is shorter); the repetition penalty over the prompt and the output; the
/// frequency and presence penalties over the output. `tokens` holds the prompt's
/// `prompt_len` tokens, then the output's.
void logit_edits(const sampling_params& params, int64_t vocab, const std::vector<int32_t>& tokens,
                 size_t prompt_len, const std::vector<int32_t>& stop_ids, int32_t row,
                 std::vector<logit_edit>& edits);

/// Whether `count` edits of a row ban every token that `mask` (`vocab` bits) allows: then
/// the mask alone decides (structured output's end, which min_tokens holds back).
bool bans_every_allowed(const logit_edit* edits, size_t count, const uint32_t* mask, int64_t vocab);

/// One row of `logits` into `out`: the tokens `mask` leaves out (when not null) at -inf,
/// then `count` edits of the row.
void edit_row(const float* logits, float* out, int64_t vocab, const uint32_t* mask,
              const logit_edit* edits, size_t count);

/// log Σ exp(logits): a logit less this is its log-softmax (the logprob reported).
float log_partition(const float* logits, int64_t vocab);

/// Whether `params` pick the most likely token.
bool is_greedy(const sampling_params& params);

/// The uniform number in [0, 1) of one draw, as a float (what the device samplers take):
/// from (seed, stream, step) when the request has a seed, else from `rng`.
float draw_uniform(const sampling_params& params, int64_t stream, int64_t step,
                   std::mt19937_64& rng);

/// The token a draw `u` in [0, 1) picks: the tokens kept are the `top_k` most likely (all
/// when top_k <= 0) and of those the fewest most likely whose probability (at
/// `temperature`) reaches `top_p`, each cut keeping the tokens tied with its last one;
/// `u` × their mass is then found in the running sum of their probabilities in token order
/// (the order a GPU kernel can follow too). With `min_p`, tokens whose probability is below
/// min_p times the most likely one's are dropped first, as vLLM does.
int64_t choose_token(const float* logits, int64_t vocab, float temperature, int32_t top_k,
                     float top_p, double u, float min_p = 0.0f);

} // namespace troupe
