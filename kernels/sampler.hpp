#pragma once

#include "troupe/types.hpp"

#include <cstdint>
#include <random>

namespace troupe {

/// Picks the next token of one sequence from its logits (`vocab` floats), after vLLM's
/// sampler: greedy when `temperature` is (close to) 0; otherwise temperature, then top-k,
/// then top-p, then a draw (`choose_token`). The reported logprobs are those of the
/// model's distribution (log-softmax of the raw logits).
///
/// Determinism: with `params.seed >= 0` the draw depends only on the seed, the sequence
/// and `step` (its number of generated tokens), so a seeded request gives the same tokens
/// however it is batched; without a seed the draw comes from `rng`.
sequence_output sample_token(const float* logits, int64_t vocab, const sampling_params& params,
                             int64_t seq_id, int64_t step, std::mt19937_64& rng);

/// log Σ exp(logits): a logit less this is its log-softmax (the logprob reported).
float log_partition(const float* logits, int64_t vocab);

/// Throws `invalid_argument` naming the parameter for a temperature below 0 or a top_p
/// outside (0, 1].
void check_sampling(const sampling_params& params);

/// Whether `params` pick the most likely token.
bool is_greedy(const sampling_params& params);

/// The uniform number in [0, 1) of one draw, as a float (what the device samplers take):
/// from (seed, sequence, step) when the request has a seed, else from `rng`.
float draw_uniform(const sampling_params& params, int64_t seq_id, int64_t step,
                   std::mt19937_64& rng);

/// The token a draw `u` in [0, 1) picks: the tokens kept are the `top_k` most likely (all
/// when top_k <= 0) and of those the fewest most likely whose probability (at
/// `temperature`) reaches `top_p`, each cut keeping the tokens tied with its last one;
/// `u` × their mass is then found in the running sum of their probabilities in token order
/// (the order a GPU kernel can follow too).
int64_t choose_token(const float* logits, int64_t vocab, float temperature, int32_t top_k,
                     float top_p, double u);

} // namespace troupe
