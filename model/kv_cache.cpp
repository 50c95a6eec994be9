#include "model/kv_cache.hpp"

#include "troupe/errors.hpp"

#include <cstring>

namespace troupe {

kv_cache::kv_cache(device& dev, int64_t layers, int64_t kv_heads, int64_t head_dim,
                   int64_t block_size, int64_t device_blocks, int64_t swap_blocks)
  : dev_(dev),
    layers_(layers),
    head_dim_(head_dim),
    row_(kv_heads * head_dim),
    block_size_(block_size),
    device_blocks_(device_blocks),
    swap_blocks_(swap_blocks),
    device_memory_(dev, static_cast<size_t>(bytes_per_block(layers, kv_heads, head_dim, block_size)
                                            * device_blocks),
                   memory_tag::kv_cache),
    base_(device_memory_.as<float>()),
    swap_(static_cast<size_t>(swap_blocks * layers * 2 * block_size * kv_heads * head_dim)) {
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
  auto bytes = static_cast<size_t>(block_floats()) * sizeof(float);
  for (auto& m : moves) {
    check(m.src, device_blocks_, "device");
    check(m.dst, swap_blocks_, "swap");
    for (int64_t layer = 0; layer < layers_; ++layer)
      for (int64_t kv = 0; kv < 2; ++kv)
        std::memcpy(swap_.data() + ((m.dst * layers_ + layer) * 2 + kv) * block_floats(),
                    at(layer, kv, m.src, 0, 0), bytes);
  }
}

void kv_cache::swap_in(const std::vector<block_move>& moves) {
  auto bytes = static_cast<size_t>(block_floats()) * sizeof(float);
  for (auto& m : moves) {
    check(m.src, swap_blocks_, "swap");
    check(m.dst, device_blocks_, "device");
    for (int64_t layer = 0; layer < layers_; ++layer)
      for (int64_t kv = 0; kv < 2; ++kv)
        std::memcpy(at(layer, kv, m.dst, 0, 0),
                    swap_.data() + ((m.src * layers_ + layer) * 2 + kv) * block_floats(), bytes);
  }
}

void kv_cache::copy(const std::vector<block_move>& moves) {
  auto bytes = static_cast<size_t>(block_floats()) * sizeof(float);
  for (auto& m : moves) {
    check(m.src, device_blocks_, "device");
    check(m.dst, device_blocks_, "device");
    for (int64_t layer = 0; layer < layers_; ++layer)
      for (int64_t kv = 0; kv < 2; ++kv)
        dev_.copy(at(layer, kv, m.dst, 0, 0), at(layer, kv, m.src, 0, 0), bytes);
  }
}

} // namespace troupe
