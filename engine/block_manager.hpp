#pragma once

#include "troupe/types.hpp"

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace troupe {

/// Bookkeeping of KV-cache blocks for the scheduler (vLLM's block space manager): which
/// physical blocks each sequence holds on the device or in swap, shared blocks after a fork
/// (copy-on-write), and the block moves a step must carry out. Bad use (an unknown sequence,
/// allocating twice, swapping what is not there) throws `troupe::error`
/// (`invalid_argument`); running out of blocks is answered by the `can_*` queries first.
class block_manager {
public:
  /// Whether a prompt can get its blocks: now, after others finish, or never.
  enum class allocation { ok, later, never };

  /// `watermark` is the fraction of device blocks kept free when admitting prompts, so that
  /// running sequences can still grow.
  block_manager(int32_t block_size, int64_t device_blocks, int64_t swap_blocks,
                double watermark = 0.01);

  int32_t block_size() const {
    return block_size_;
  }

  /// Can a prompt of `tokens` tokens get device blocks?
  allocation can_allocate(int64_t tokens) const;

  /// Gives sequence `seq` the blocks for `tokens` tokens.
  void allocate(int64_t seq, int64_t tokens);

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

  bool is_swapped(int64_t seq) const;
  bool contains(int64_t seq) const;

  int64_t free_device_blocks() const {
    return static_cast<int64_t>(free_device_.size());
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
    bool swapped = false;
  };

  int64_t blocks_for(int64_t tokens) const {
    return (tokens + block_size_ - 1) / block_size_;
  }
  table& get(int64_t seq);
  const table& get(int64_t seq) const;
  int32_t take_device();
  void release(int32_t block, bool swapped);
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
};

} // namespace troupe
