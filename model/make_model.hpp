#pragma once

#include "model/config.hpp"
#include "kernels/dtype.hpp"

#include <cstdint>
#include <string>

namespace troupe {

/// Writes a random-weight model in Hugging Face format (`config.json` and
/// `model.safetensors`, or shards with `model.safetensors.index.json` when the weights
/// exceed `max_shard_bytes`) to `directory`, which is created. Weights are drawn from
/// N(0, 0.02) as transformers initialises them, norms are 1 (Gemma's stored 0) and biases 0,
/// all from `seed`; Phi-3's projections fused as its checkpoints hold them, each expert of a
/// mixture under its own names as Mixtral's and Qwen3-MoE's checkpoints hold them.
/// Throws `invalid_argument` for a config that does not hold together or a directory that
/// cannot be written.
void write_random_model(const model_config& config, const std::string& directory, dtype type,
                        uint64_t seed, int64_t max_shard_bytes = int64_t{2} << 30);

/// The shape of SmolLM2-135M (Llama, 30 layers, hidden 576, 9 heads over 3 kv heads, tied
/// embeddings), for benchmarks and tests that need its size but not its weights.
model_config smollm2_135m_config();

} // namespace troupe
