#include "model/kv_cache.hpp"

#include "troupe/errors.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace troupe {

namespace {

/// Bytes of `blocks` blocks; refuses counts a block number (int32) cannot address and
/// products that overflow.
size_t checked_bytes(int64_t per_block, int64_t blocks, const char* what) {
  int64_t bytes = 0;
  if (blocks < 0 || blocks > std::numeric_limits<int32_t>::max() ||
      __builtin_mul_overflow(per_block, blocks, &bytes))
    throw error{errc::invalid_argument, std::string{"KV cache: "} + std::to_string(blocks) + " " +
                                          what + " blocks cannot be addressed"};
  return static_cast<size_t>(bytes);
}

/// The host swap space, zeroed; the bytes it wanted when they cannot be had. calloc, not a
/// vector: a large calloc maps fresh zero pages without writing them, so the space costs
/// resident memory only as blocks are swapped out.
std::unique_ptr<float[], void (*)(void*)> swap_space(size_t bytes) {
  auto p = static_cast<float*>(std::calloc(std::max<size_t>(bytes, 1), 1));
  if (p == nullptr)
    throw error{errc::memory_error, "KV cache: cannot allocate " + std::to_string(bytes) +
                                      " bytes of host memory for the swap space (swap_space)"};
  return {p, std::free};
}

} // namespace

kv_cache::kv_cache(device& dev, int64_t layers, int64_t kv_heads, int64_t head_dim,
                   int64_t block_size, int64_t device_blocks, int64_t swap_blocks)
  : dev_(dev), layers_(layers), head_dim_(head_dim), row_(kv_heads * head_dim),
    block_size_(block_size), device_blocks_(device_blocks), swap_blocks_(swap_blocks),
    device_memory_(dev,
                   checked_bytes(bytes_per_block(layers, kv_heads, head_dim, block_size),
                                 device_blocks, "device"),
                   memory_tag::kv_cache),
    base_(device_memory_.as<float>()),
    swap_(swap_space(checked_bytes(bytes_per_block(layers, kv_heads, head_dim, block_size),
                                   swap_blocks, "swap"))) {}

void kv_cache::validate(int64_t layers, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t device_blocks, int64_t swap_blocks) {
  if (device_blocks > max_device_blocks(block_size))
    throw error{errc::invalid_argument, "KV cache: " + std::to_string(device_blocks) +
                                          " device blocks of " + std::to_string(block_size) +
                                          " slots cannot be addressed"};
  auto per_block = bytes_per_block(layers, kv_heads, head_dim, block_size);
  checked_bytes(per_block, device_blocks, "device");
  checked_bytes(per_block, swap_blocks, "swap");
}

int64_t kv_cache::max_device_blocks(int64_t block_size) {
  // A step addresses cache slots (block × block_size + offset) as int32.
  return std::numeric_limits<int32_t>::max() / std::max<int64_t>(1, block_size);
}

int64_t kv_cache::bytes_per_block(int64_t layers, int64_t kv_heads, int64_t head_dim,
                                  int64_t block_size) {
  return layers * 2 * block_size * kv_heads * head_dim * static_cast<int64_t>(sizeof(float));
}

void kv_cache::check(int64_t block, int64_t limit, const char* what) const {
  if (block < 0 || block >= limit)
    throw error{errc::invalid_argument, std::string{what} + " block " + std::to_string(block) +
                                          " is out of range [0, " + std::to_string(limit) + ")"};
}

void kv_cache::swap_out(const std::vector<block_move>& moves) {
  move_blocks(
    moves, device_blocks_, "device", swap_blocks_, "swap",
    [&](int64_t block, int64_t layer, int64_t kv) { return at(layer, kv, block, 0, 0); },
    [&](int64_t block, int64_t layer, int64_t kv) { return swapped(block, layer, kv); });
}

void kv_cache::swap_in(const std::vector<block_move>& moves) {
  move_blocks(
    moves, swap_blocks_, "swap", device_blocks_, "device",
    [&](int64_t block, int64_t layer, int64_t kv) { return swapped(block, layer, kv); },
    [&](int64_t block, int64_t layer, int64_t kv) { return at(layer, kv, block, 0, 0); });
}

void kv_cache::copy(const std::vector<block_move>& moves) {
  auto device_block = [&](int64_t block, int64_t layer, int64_t kv) {
    return at(layer, kv, block, 0, 0);
  };
  move_blocks(moves, device_blocks_, "device", device_blocks_, "device", device_block,
              device_block);
}

} // namespace troupe
