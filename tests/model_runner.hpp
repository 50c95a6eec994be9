#pragma once

// One sequence stepping through a model on one rank of a device, for the tests that compare
// a model's logits and tokens with transformers'.

#include "model/checkpoint.hpp"
#include "model/config.hpp"
#include "model/llama.hpp"

#include <string>
#include <vector>

namespace troupe::testing {

/// The tiny transformers fixtures (tests/fixtures, one per family and feature) whose
/// reference.json holds the prompts' logits and greedy tokens.
inline const std::vector<std::string> fixture_models = {
  "llama-gqa",         "llama3-rope-tied",   "qwen2-bias",      "llama-odd-heads",
  "llama-rope-linear", "llama-rope-dynamic", "llama-rope-yarn", "llama-bias",
  "mistral-window",    "qwen2-window",       "qwen3-norms",     "phi3-fused",
  "phi3-longrope",     "gemma3-layers",      "gemma2-softcap",  "gemma2-standard",
  "gemma3-standard",   "mixtral-experts",    "qwen3-moe",       "qwen3-moe-mixed",
  "phi4-partial"};

struct model_runner {
  llama_model model;
  kv_cache cache;
  sequence_data seq;

  /// 64 blocks of `block_size`, used out of order on purpose. Rank `rank` of `world`
  /// holds its shard of the model (whole experts with `expert_parallel`); `reduce` sums over
  /// the ranks (needed when `world` > 1).
  model_runner(device& dev, const model_config& cfg, const checkpoint& ckpt,
               dtype type = dtype::f32, int64_t block_size = 4, int32_t rank = 0, int32_t world = 1,
               all_reduce_fn reduce = {}, bool expert_parallel = false)
    : model(cfg, dev, rank, world, type, false, false, expert_parallel),
      cache(dev, cfg.num_hidden_layers, model.local_kv_heads(), cfg.head_dim, block_size, 64, 0) {
    if (reduce)
      model.set_all_reduce(std::move(reduce));
    model.load(ckpt);
    for (int32_t b = 0; b < 64; ++b)
      seq.block_table.push_back(63 - b);
  }

  /// Computes `chunk` more tokens of the sequence and returns the last token's logits.
  std::vector<float> step(int32_t chunk) {
    execute_model_request req;
    sequence_group_metadata g;
    g.request_id = "r";
    g.seqs.push_back(seq);
    g.token_chunk_size = chunk;
    req.seq_group_metadata_list.push_back(g);
    std::vector<sample_row> rows;
    auto logits = model.run_logits(req, cache, rows);
    seq.num_computed_tokens += chunk;
    return logits;
  }
};

} // namespace troupe::testing
