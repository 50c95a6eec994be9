#pragma once

#include "troupe/device.hpp"
#include "troupe/types.hpp"

#include <cstdint>
#include <memory>
#include <vector>

namespace troupe {

/// The paged KV cache of one worker: per layer, keys and values of `num_blocks` blocks of
/// `block_size` positions, each position holding `kv_heads × head_dim` floats. Device
/// blocks live in the device's pool under `memory_tag::kv_cache` (they sleep with it); swap
/// blocks live in host memory.
class kv_cache {
public:
  kv_cache(device& dev, int64_t layers, int64_t kv_heads, int64_t head_dim, int64_t block_size,
           int64_t device_blocks, int64_t swap_blocks);

  /// Throws `invalid_argument` when the block counts cannot be addressed or sized (what the
  /// constructor checks, without allocating).
  static void validate(int64_t layers, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                       int64_t device_blocks, int64_t swap_blocks);

  /// The most device blocks of `block_size` slots a step can address (slots are int32).
  static int64_t max_device_blocks(int64_t block_size);

  /// Bytes one block takes across all layers, keys and values.
  static int64_t bytes_per_block(int64_t layers, int64_t kv_heads, int64_t head_dim,
                                 int64_t block_size);

  /// The keys (values) of `layer`: device blocks of block_size slots, kv_heads × head_dim
  /// floats a slot (slot = block × block_size + offset), laid out within each block as the
  /// backend writes them (`backend::write_kv`).
  float* keys(int64_t layer) {
    return at(layer, 0, 0, 0, 0);
  }
  float* values(int64_t layer) {
    return at(layer, 1, 0, 0, 0);
  }

  /// Carries out the block moves of a step; throws `invalid_argument` for a block number
  /// out of range.
  void swap_in(const std::vector<block_move>& moves);
  void swap_out(const std::vector<block_move>& moves);
  void copy(const std::vector<block_move>& moves);

  int64_t device_blocks() const {
    return device_blocks_;
  }
  int64_t swap_blocks() const {
    return swap_blocks_;
  }
  int64_t block_size() const {
    return block_size_;
  }

private:
  float* at(int64_t layer, int64_t kv, int64_t block, int64_t slot, int64_t kv_head) {
    return base_ + (((layer * 2 + kv) * device_blocks_ + block) * block_size_ + slot) * row_ +
           kv_head * head_dim_;
  }

  /// Floats of one block in one layer, for keys or values.
  int64_t block_floats() const {
    return block_size_ * row_;
  }

  void check(int64_t block, int64_t limit, const char* what) const;

  /// Start of swap block `block`'s keys (kv 0) or values (kv 1) of `layer`.
  float* swapped(int64_t block, int64_t layer, int64_t kv) {
    return swap_.get() + ((block * layers_ + layer) * 2 + kv) * block_floats();
  }

  /// Checks every move, then copies each block's keys and values of every layer.
  template <class Src, class Dst>
  void move_blocks(const std::vector<block_move>& moves, int64_t src_limit, const char* src_kind,
                   int64_t dst_limit, const char* dst_kind, Src src, Dst dst) {
    for (auto& m : moves) {
      check(m.src, src_limit, src_kind);
      check(m.dst, dst_limit, dst_kind);
    }
    auto bytes = static_cast<size_t>(block_floats()) * sizeof(float);
    for (auto& m : moves)
      for (int64_t layer = 0; layer < layers_; ++layer)
        for (int64_t kv = 0; kv < 2; ++kv)
          dev_.copy(dst(m.dst, layer, kv), src(m.src, layer, kv), bytes);
  }

  device& dev_;
  int64_t layers_;
  int64_t head_dim_;
  int64_t row_;
  int64_t block_size_;
  int64_t device_blocks_;
  int64_t swap_blocks_;
  device_buffer device_memory_;
  float* base_;
  /// Swap blocks: [swap block][layer][k|v][block floats].
  std::unique_ptr<float[], void (*)(void*)> swap_;
};

} // namespace troupe
