#pragma once

#include "engine/hot_set.hpp"
#include "troupe/types.hpp"

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

namespace troupe {

/// Bookkeeping of KV-cache blocks for the scheduler (vLLM's block space manager): which
/// physical blocks each sequence holds on the device or in swap, shared blocks after a fork
/// (copy-on-write), and the block moves a step must carry out. Bad use (an unknown sequence,
/// allocating twice, swapping what is not there) throws `troupe::error`
/// (`invalid_argument`); running out of blocks is answered by the `can_*` queries first.
///
/// With prefix caching (vLLM's automatic prefix caching), a full block whose keys and
/// values are computed is known by a hash of its tokens, of the blocks before it and of
/// the adapter in use (`salt`). A new sequence starting with the same tokens shares those
/// blocks instead of computing them; a cached block no sequence holds stays filled until
/// its memory is needed (least recently used first). Full blocks are never written again,
/// so sharing them needs no copy.
class block_manager {
public:
  /// Whether a prompt can get its blocks: now, after others finish, or never.
  enum class allocation { ok, later, never };

  /// A sequence's tokens: its prompt, then its output.
  struct tokens_view {
    const std::vector<int32_t>& prompt;
    const std::vector<int32_t>& output;
    /// Adapters in use (LoRA, prompt adapter): blocks computed under others differ.
    uint64_t salt = 0;
    int64_t size() const {
      return static_cast<int64_t>(prompt.size() + output.size());
    }
    int32_t operator[](int64_t i) const {
      auto n = static_cast<int64_t>(prompt.size());
      return i < n ? prompt[static_cast<size_t>(i)] : output[static_cast<size_t>(i - n)];
    }
  };

  /// The cached blocks a sequence would start with, and how many of them other sequences
  /// hold (those cost no free block).
  struct prefix_hit {
    int64_t blocks = 0;
    int64_t in_use = 0;
  };

  /// `watermark` is the fraction of device blocks kept free when admitting prompts, so that
  /// running sequences can still grow.
  block_manager(int32_t block_size, int64_t device_blocks, int64_t swap_blocks,
                double watermark = 0.01, bool prefix_caching = false);

  int32_t block_size() const {
    return block_size_;
  }

  /// Can a prompt of `tokens` tokens get device blocks (`hit` of them cached)?
  allocation can_allocate(int64_t tokens, prefix_hit hit) const;
  allocation can_allocate(int64_t tokens) const {
    return can_allocate(tokens, prefix_hit{});
  }

  /// Gives sequence `seq` the blocks for `tokens` tokens.
  void allocate(int64_t seq, int64_t tokens);

  /// The cached full blocks `tokens` starts with; never its last token's block, whose
  /// token must be computed to sample. None without prefix caching.
  prefix_hit find_prefix(const tokens_view& tokens) const;

  /// Gives `seq` the blocks for all of `tokens`, sharing the cached prefix; returns the
  /// number of tokens whose keys and values are cached (counted in the queries and hits).
  int64_t allocate(int64_t seq, const tokens_view& tokens);

  /// Makes the full blocks of `seq` among its first `computed` tokens (computed, or being
  /// computed in the step being made) known to later sequences (none while it is swapped
  /// out or holds no blocks). Only the blocks filled since the last call cost anything.
  void cache_computed(int64_t seq, const tokens_view& tokens, int64_t computed);

  /// Forgets every cached block (the workers' caches were discarded): none is shared from
  /// now on until computed again.
  void reset_cache();

  /// Prompt tokens looked up in the cache and found there, so far (vLLM's
  /// `prefix_cache_queries` and `prefix_cache_hits`).
  int64_t cache_queries() const {
    return cache_queries_;
  }
  int64_t cache_hits() const {
    return cache_hits_;
  }

  /// Can every sequence in `seqs` grow by one token (one new block each at most)?
  bool can_append_slots(const std::vector<int64_t>& seqs) const;

  /// Makes room for the token at position `tokens - 1` of `seq`: a new block when the last
  /// one is full, or a private copy when the last block is shared (copy-on-write: the move
  /// is appended to `copies`).
  void append_slot(int64_t seq, int64_t tokens, std::vector<block_move>& copies);

  /// `child` shares every block of `parent` (reference counted).
  void fork(int64_t parent, int64_t child);

  /// Releases the blocks of `seq` (device or swap).
  void free(int64_t seq);

  /// Can the device blocks of `seqs` move to swap / come back from it?
  bool can_swap_out(const std::vector<int64_t>& seqs) const;
  bool can_swap_in(const std::vector<int64_t>& seqs) const;

  /// Moves the blocks of `seqs` to swap (or back); returns the copies the worker makes.
  /// Blocks shared between the sequences move once.
  std::vector<block_move> swap_out(const std::vector<int64_t>& seqs);
  std::vector<block_move> swap_in(const std::vector<int64_t>& seqs);

  /// The device block table of a sequence; throws when it is unknown or swapped out.
  const std::vector<int32_t>& block_table(int64_t seq) const;

  /// Notes in `hot` what the next step of `seq` reads here: its table, the ends of its
  /// blocks and hashes, and the state of its last block.
  void note_hot(int64_t seq, hot_set& hot) const;

  /// What a step sends of the block table of `seq` when the ranks keep tables between
  /// steps (`execute_model_request::keep_block_tables`): sets `first` to the number of
  /// leading blocks the ranks already hold as they are and `blocks` to the rest. From now
  /// on the ranks hold them all. A new table (allocated, forked, swapped) is sent whole; a
  /// copied-on-write last block from its place on.
  void blocks_to_send(int64_t seq, int32_t& first, std::vector<int32_t>& blocks);

  bool is_swapped(int64_t seq) const;
  bool contains(int64_t seq) const;

  /// Free device blocks: empty ones and cached ones that no sequence holds.
  int64_t free_device_blocks() const {
    return static_cast<int64_t>(free_device_.size() + evictable_.size());
  }
  int64_t free_swap_blocks() const {
    return static_cast<int64_t>(free_swap_.size());
  }
  int64_t device_blocks() const {
    return device_blocks_;
  }

private:
  struct table {
    std::vector<int32_t> blocks;
    /// The hash of each full computed block, in order.
    std::vector<uint64_t> hashes;
    bool swapped = false;
    /// Leading blocks a step sent before and unchanged since (`blocks_to_send`).
    int64_t sent = 0;
  };
  /// What a cached block holds, to tell it from another whose hash is the same.
  struct cached_block {
    uint64_t hash = 0;
    uint64_t parent = 0;
    uint64_t salt = 0;
    std::vector<int32_t> tokens;
    bool cached = false;
  };

  int64_t blocks_for(int64_t tokens) const {
    return (tokens + block_size_ - 1) / block_size_;
  }
  table& get(int64_t seq);
  const table& get(int64_t seq) const;
  int32_t take_device();
  void release(int32_t block, bool swapped);
  /// The hash of block `index` of `tokens` after the blocks before it (`parent`), and its
  /// cached block (-1 for none).
  uint64_t hash_block(const tokens_view& tokens, int64_t index, uint64_t parent) const;
  int32_t lookup(const tokens_view& tokens, int64_t index, uint64_t parent, uint64_t hash) const;
  /// The cached blocks `tokens` starts with (as `find_prefix` counts them), with their hashes.
  std::vector<std::pair<int32_t, uint64_t>> match(const tokens_view& tokens) const;
  void uncache(int32_t block);
  /// Blocks of `seqs` counted once each.
  int64_t distinct_blocks(const std::vector<int64_t>& seqs, bool swapped) const;
  std::vector<block_move> move(const std::vector<int64_t>& seqs, bool to_swap);

  int32_t block_size_;
  int64_t device_blocks_;
  int64_t watermark_blocks_;
  std::vector<int32_t> free_device_;
  std::vector<int32_t> free_swap_;
  std::vector<int32_t> device_refs_;
  std::vector<int32_t> swap_refs_;
  std::unordered_map<int64_t, table> tables_;
  bool prefix_caching_;
  std::vector<cached_block> blocks_;
  std::unordered_map<uint64_t, int32_t> by_hash_;
  /// Cached blocks no sequence holds, least recently used first, and where each is.
  std::list<int32_t> evictable_;
  std::vector<std::list<int32_t>::iterator> evictable_at_;
  int64_t cache_queries_ = 0;
  int64_t cache_hits_ = 0;
};

} // namespace troupe
