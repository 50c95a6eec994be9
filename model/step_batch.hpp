#pragma once

/// @file
/// A step's batch as the host prepares it from an `execute_model_request`, before any
/// device work: the request checked, its scheduled tokens flattened with their positions
/// and sequences, the rows that sample, and the runs of tokens that share a LoRA adapter.

#include "model/config.hpp"
#include "troupe/types.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace troupe {

struct lora_weights;
struct prompt_embeddings;

/// Where a row of logits comes from: the sequence that samples from it.
struct sample_row {
  size_t group = 0;
  size_t seq = 0;
};

/// The adapters of one step, per sequence group of the request (null: none). Empty
/// vectors mean no group uses any.
struct step_adapters {
  std::vector<const lora_weights*> lora;
  std::vector<const prompt_embeddings*> prompt;
};

struct step_batch {
  struct token {
    int32_t id;
    int32_t position;
    /// Index into `tables`.
    int32_t seq;
    /// Index of its sequence group in the request.
    size_t group;
  };
  /// Consecutive tokens computed with the same LoRA adapter.
  struct lora_run {
    int64_t begin;
    int64_t count;
    const lora_weights* weights;
  };

  std::vector<token> tokens;
  /// Each sequence's block table, and how many of its blocks the step reaches.
  std::vector<const int32_t*> tables;
  std::vector<int64_t> table_blocks;
  /// Each sequence's tokens as the engine knows them (`sequence_data::length()`: its
  /// prompt and outputs so far), computed in this step or not.
  std::vector<int64_t> known_lengths;
  /// A prompt position whose logprob the step computes (`sampling_params::prompt_logprobs`):
  /// from the logits after the token before it.
  struct prompt_row {
    size_t group;
    int32_t position;
    int32_t token;
  };
  /// The token whose logits each row takes: each sampled row (`rows`, in request order),
  /// then each of `prompt_rows`.
  std::vector<int32_t> sample_tokens;
  std::vector<sample_row> rows;
  std::vector<prompt_row> prompt_rows;
  /// Every sequence computes one token.
  bool decode_only = true;
  std::vector<lora_run> lora_runs;
  int64_t max_lora_rank = 0;
  step_adapters adapters;

  /// The width of the step's block tables: the longest table, rounded up to a power of two
  /// so that decode steps keep one layout (and one recorded graph) while sequences grow.
  int64_t max_blocks() const;
  /// Each sequence's length at the end of the step (dynamic rope scaling depends on it).
  std::vector<int64_t> lengths() const;
};

/// The block tables a rank keeps between steps that `keep_block_tables`, so that each
/// step sends only the blocks added or changed since (`sequence_data::first_block`).
class kept_block_tables {
public:
  /// Drops the tables of `req.finished_requests_ids`; then, when `req` keeps tables, puts
  /// in each sequence's blocks from its `first_block` on. Throws `invalid_argument` naming
  /// the request for a block outside a cache of `device_blocks` blocks, or a `first_block`
  /// past the blocks kept of its sequence (or above 0 in a step that keeps none).
  void update(const execute_model_request& req, int64_t device_blocks);

  /// The whole table of `seq_id`, a sequence of the last step that kept tables.
  const std::vector<int32_t>& of(int64_t seq_id) const;

  /// Forgets every table (the cache they point into is gone).
  void clear() {
    tables_.clear();
  }

  /// Sequences whose tables are kept.
  size_t size() const {
    return tables_.size();
  }

private:
  struct kept {
    std::string request_id;
    std::vector<int32_t> blocks;
  };
  std::unordered_map<int64_t, kept> tables_;
};

/// The batch of `req` for a model of `cfg` with a cache of `device_blocks` blocks of
/// `block_size` positions; when `req` keeps block tables, each sequence's table is the
/// one in `kept` (updated with `req` first). Throws `invalid_argument` naming the request
/// for a malformed one: adapters for another number of groups, a chunk past its tokens or
/// the model's positions or before the first token sent, a block table too short or naming
/// a block outside the cache, a token outside the vocabulary.
step_batch prepare_batch(const execute_model_request& req, const model_config& cfg,
                         int64_t block_size, int64_t device_blocks,
                         const step_adapters& adapters = {},
                         const kept_block_tables* kept = nullptr);

/// The width of block tables for sequences of up to `blocks` blocks (a power of two).
int64_t table_width(int64_t blocks);

} // namespace troupe
