#pragma once

#include "troupe/types.hpp"

#include <cstdint>
#include <random>

namespace troupe {

/// Picks the next token of one sequence from its logits (`vocab` floats), after vLLM's
/// sampler: greedy when `temperature` is (close to) 0; otherwise temperature, then top-k,
/// then top-p, then a draw. The reported logprobs are those of the model's distribution
/// (log-softmax of the raw logits).
///
/// Determinism: with `params.seed >= 0` the draw depends only on the seed, the sequence
/// and `step` (its number of generated tokens), so a seeded request gives the same tokens
/// however it is batched; without a seed the draw comes from `rng`.
sequence_output sample_token(const float* logits, int64_t vocab, const sampling_params& params,
                             int64_t seq_id, int64_t step, std::mt19937_64& rng);

} // namespace troupe
