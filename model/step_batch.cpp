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

void check_device_block(const std::string& request_id, int32_t block, int64_t device_blocks) {
  if (block < 0 || block >= device_blocks)
    bad_request("request '" + request_id + "': block " + std::to_string(block) +
                " is not a device block");
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

void kept_block_tables::update(const execute_model_request& req, int64_t device_blocks) {
  auto& finished = req.finished_requests_ids;
  for (auto i = tables_.begin(); !finished.empty() && i != tables_.end();) {
    if (std::find(finished.begin(), finished.end(), i->second.request_id) != finished.end())
      i = tables_.erase(i);
    else
      ++i;
  }
  // All checked before any is changed.
  for (auto& group : req.seq_group_metadata_list)
    for (auto& seq : group.seqs) {
      for (auto b : seq.block_table)
        check_device_block(group.request_id, b, device_blocks);
      auto found = tables_.find(seq.seq_id);
      size_t have =
        req.keep_block_tables && found != tables_.end() ? found->second.blocks.size() : 0;
      if (seq.first_block < 0 || static_cast<size_t>(seq.first_block) > have)
        bad_request("request '" + group.request_id + "': its block table starts at block " +
                    std::to_string(seq.first_block) + ", but this rank keeps " +
                    std::to_string(have) + " blocks of sequence " + std::to_string(seq.seq_id));
    }
  if (!req.keep_block_tables)
    return;
  for (auto& group : req.seq_group_metadata_list)
    for (auto& seq : group.seqs) {
      auto& k = tables_[seq.seq_id];
      k.request_id = group.request_id;
      k.blocks.resize(static_cast<size_t>(seq.first_block));
      k.blocks.insert(k.blocks.end(), seq.block_table.begin(), seq.block_table.end());
    }
}

const std::vector<int32_t>& kept_block_tables::of(int64_t seq_id) const {
  auto found = tables_.find(seq_id);
  if (found == tables_.end())
    bad_request("sequence " + std::to_string(seq_id) + ": no block table kept");
  return found->second.blocks;
}

step_batch prepare_batch(const execute_model_request& req, const model_config& cfg,
                         int64_t block_size, int64_t device_blocks, const step_adapters& adapters,
                         const kept_block_tables* kept) {
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
      // Kept tables were checked block by block as they came (update).
      const bool keeps = req.keep_block_tables && kept != nullptr;
      if (!keeps && seq.first_block != 0)
        bad_request("request '" + group.request_id + "': its block table starts at block " +
                    std::to_string(seq.first_block) + ", but no tables are kept");
      auto& table = keeps ? kept->of(seq.seq_id) : seq.block_table;
      if (static_cast<int64_t>(table.size()) < blocks_needed)
        bad_request("request '" + group.request_id + "': block table has " +
                    std::to_string(table.size()) + " blocks, " + std::to_string(blocks_needed) +
                    " needed");
      if (!keeps)
        for (int64_t k = 0; k < blocks_needed; ++k)
          check_device_block(group.request_id, table[static_cast<size_t>(k)], device_blocks);
      b.decode_only = b.decode_only && chunk == 1;
      auto seq_index = static_cast<int32_t>(b.tables.size());
      b.tables.push_back(table.data());
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
