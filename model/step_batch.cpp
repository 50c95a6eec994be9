#include "model/step_batch.hpp"

#include "model/llama.hpp" // lora_weights
#include "troupe/errors.hpp"

#include <algorithm>
#include <string>

namespace troupe {

namespace {

[[noreturn]] void bad_request(const std::string& what) {
  throw error{errc::invalid_argument, what};
}

} // namespace

int64_t table_width(int64_t blocks) {
  int64_t width = 1;
  while (width < blocks)
    width *= 2;
  return width;
}

int64_t step_batch::max_blocks() const {
  return table_blocks.empty()
           ? 1
           : table_width(*std::max_element(table_blocks.begin(), table_blocks.end()));
}

std::vector<int64_t> step_batch::lengths() const {
  std::vector<int64_t> length(tables.size(), 0);
  for (auto& tok : tokens) {
    auto& l = length[static_cast<size_t>(tok.seq)];
    l = std::max<int64_t>(l, tok.position + int64_t{1});
  }
  return length;
}

step_batch prepare_batch(const execute_model_request& req, const model_config& cfg,
                         int64_t block_size, int64_t device_blocks, const step_adapters& adapters) {
  const auto groups = req.seq_group_metadata_list.size();
  if ((!adapters.lora.empty() && adapters.lora.size() != groups) ||
      (!adapters.prompt.empty() && adapters.prompt.size() != groups))
    bad_request("adapters given for " + std::to_string(adapters.lora.size()) + " and " +
                std::to_string(adapters.prompt.size()) + " groups of " + std::to_string(groups));
  step_batch b;
  b.adapters = adapters;
  const auto bs = block_size;
  std::vector<int32_t> prompt_tokens; // after the sampled rows
  for (size_t g = 0; g < groups; ++g) {
    auto& group = req.seq_group_metadata_list[g];
    for (size_t s = 0; s < group.seqs.size(); ++s) {
      auto& seq = group.seqs[s];
      int64_t start = seq.num_computed_tokens;
      int64_t chunk = group.token_chunk_size;
      if (start < 0 || chunk <= 0 || start + chunk > seq.length())
        bad_request("request '" + group.request_id + "': chunk of " + std::to_string(chunk) +
                    " tokens from position " + std::to_string(start) + " does not fit its " +
                    std::to_string(seq.length()) + " tokens");
      if (seq.first_token < 0 || start < seq.first_token)
        bad_request("request '" + group.request_id + "': its step computes from position " +
                    std::to_string(start) + ", but its tokens were sent from position " +
                    std::to_string(seq.first_token));
      if (start + chunk > cfg.max_sequence_length())
        bad_request("request '" + group.request_id + "' reaches position " +
                    std::to_string(start + chunk) + ", past the model's " +
                    std::to_string(cfg.max_sequence_length()) + " positions");
      auto blocks_needed = (start + chunk + bs - 1) / bs;
      if (static_cast<int64_t>(seq.block_table.size()) < blocks_needed)
        bad_request("request '" + group.request_id + "': block table has " +
                    std::to_string(seq.block_table.size()) + " blocks, " +
                    std::to_string(blocks_needed) + " needed");
      for (int64_t k = 0; k < blocks_needed; ++k)
        if (seq.block_table[static_cast<size_t>(k)] < 0 ||
            seq.block_table[static_cast<size_t>(k)] >= device_blocks)
          bad_request("request '" + group.request_id + "': block " +
                      std::to_string(seq.block_table[static_cast<size_t>(k)]) +
                      " is not a device block");
      b.decode_only = b.decode_only && chunk == 1;
      auto seq_index = static_cast<int32_t>(b.tables.size());
      b.tables.push_back(seq.block_table.data());
      b.table_blocks.push_back(blocks_needed);
      b.known_lengths.push_back(seq.length());
      const bool prompt_logprobs = group.is_prompt && group.sampling.prompt_logprobs >= 0;
      for (int64_t p = start; p < start + chunk; ++p) {
        auto id = seq.token_ids[static_cast<size_t>(p - seq.first_token)];
        if (id < 0 || id >= cfg.vocab_size)
          bad_request("request '" + group.request_id + "': token " + std::to_string(id) +
                      " is outside the vocabulary of " + std::to_string(cfg.vocab_size));
        b.tokens.push_back({id, static_cast<int32_t>(p), seq_index, g});
        // The next prompt token's logprob comes from this token's logits.
        if (prompt_logprobs && p + 1 < seq.num_prompt_tokens && p + 1 < seq.length()) {
          prompt_tokens.push_back(static_cast<int32_t>(b.tokens.size()) - 1);
          b.prompt_rows.push_back({g, static_cast<int32_t>(p + 1),
                                   seq.token_ids[static_cast<size_t>(p + 1 - seq.first_token)]});
        }
      }
      if (group.do_sample) {
        b.sample_tokens.push_back(static_cast<int32_t>(b.tokens.size()) - 1);
        b.rows.push_back({g, s});
      }
    }
  }
  b.sample_tokens.insert(b.sample_tokens.end(), prompt_tokens.begin(), prompt_tokens.end());
  if (!adapters.lora.empty()) {
    for (int64_t t = 0; t < static_cast<int64_t>(b.tokens.size()); ++t) {
      auto* w = adapters.lora[b.tokens[static_cast<size_t>(t)].group];
      if (w == nullptr)
        continue;
      b.max_lora_rank = std::max(b.max_lora_rank, w->rank);
      auto& runs = b.lora_runs;
      if (!runs.empty() && runs.back().weights == w && runs.back().begin + runs.back().count == t)
        ++runs.back().count;
      else
        runs.push_back({t, 1, w});
    }
  }
  return b;
}

} // namespace troupe
