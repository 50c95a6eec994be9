#include "engine/block_manager.hpp"

#include "troupe/errors.hpp"

#include <algorithm>
#include <cmath>
#include <set>

namespace troupe {

namespace {

[[noreturn]] void misuse(const std::string& what) {
  throw error{errc::invalid_argument, "block manager: " + what};
}

} // namespace

block_manager::block_manager(int32_t block_size, int64_t device_blocks, int64_t swap_blocks,
                             double watermark)
  : block_size_(block_size), device_blocks_(device_blocks) {
  if (block_size <= 0 || device_blocks < 0 || swap_blocks < 0 || watermark < 0 || watermark >= 1)
    misuse("needs block_size > 0, block counts >= 0 and a watermark in [0, 1)");
  watermark_blocks_ = static_cast<int64_t>(std::floor(watermark * static_cast<double>(device_blocks)));
  // Free lists are stacks: the lowest block numbers are handed out first.
  for (auto b = device_blocks; b > 0; --b)
    free_device_.push_back(static_cast<int32_t>(b - 1));
  for (auto b = swap_blocks; b > 0; --b)
    free_swap_.push_back(static_cast<int32_t>(b - 1));
  device_refs_.assign(static_cast<size_t>(device_blocks), 0);
  swap_refs_.assign(static_cast<size_t>(swap_blocks), 0);
}

block_manager::table& block_manager::get(int64_t seq) {
  auto i = tables_.find(seq);
  if (i == tables_.end())
    misuse("sequence " + std::to_string(seq) + " holds no blocks");
  return i->second;
}

const block_manager::table& block_manager::get(int64_t seq) const {
  return const_cast<block_manager*>(this)->get(seq);
}

bool block_manager::contains(int64_t seq) const {
  return tables_.count(seq) > 0;
}

bool block_manager::is_swapped(int64_t seq) const {
  return get(seq).swapped;
}

const std::vector<int32_t>& block_manager::block_table(int64_t seq) const {
  auto& t = get(seq);
  if (t.swapped)
    misuse("sequence " + std::to_string(seq) + " is swapped out");
  return t.blocks;
}

block_manager::allocation block_manager::can_allocate(int64_t tokens) const {
  auto needed = blocks_for(tokens);
  if (device_blocks_ - needed < watermark_blocks_)
    return allocation::never;
  if (free_device_blocks() - needed >= watermark_blocks_)
    return allocation::ok;
  return allocation::later;
}

int32_t block_manager::take_device() {
  if (free_device_.empty())
    misuse("no free device block (ask can_allocate / can_append_slots first)");
  auto b = free_device_.back();
  free_device_.pop_back();
  device_refs_[static_cast<size_t>(b)] = 1;
  return b;
}

void block_manager::allocate(int64_t seq, int64_t tokens) {
  if (tables_.count(seq) > 0)
    misuse("sequence " + std::to_string(seq) + " already holds blocks");
  if (tokens <= 0)
    misuse("a prompt needs at least one token");
  auto needed = blocks_for(tokens);
  if (needed > free_device_blocks())
    misuse("not enough free device blocks for " + std::to_string(tokens) + " tokens");
  table t;
  for (int64_t i = 0; i < needed; ++i)
    t.blocks.push_back(take_device());
  tables_.emplace(seq, std::move(t));
}

bool block_manager::can_append_slots(const std::vector<int64_t>& seqs) const {
  // At most one new block per running sequence.
  return free_device_blocks() >= static_cast<int64_t>(seqs.size());
}

void block_manager::append_slot(int64_t seq, int64_t tokens, std::vector<block_move>& copies) {
  auto& t = get(seq);
  if (t.swapped)
    misuse("sequence " + std::to_string(seq) + " is swapped out");
  auto needed = blocks_for(tokens);
  if (needed > static_cast<int64_t>(t.blocks.size()) + 1)
    misuse("sequence " + std::to_string(seq) + " grew by more than one block");
  if (needed > static_cast<int64_t>(t.blocks.size())) {
    t.blocks.push_back(take_device());
    return;
  }
  // The token lands in the last block: copy it first when another sequence shares it.
  auto& last = t.blocks.back();
  if (device_refs_[static_cast<size_t>(last)] > 1) {
    auto fresh = take_device();
    --device_refs_[static_cast<size_t>(last)];
    copies.push_back({last, fresh});
    last = fresh;
  }
}

void block_manager::fork(int64_t parent, int64_t child) {
  auto& p = get(parent);
  if (p.swapped)
    misuse("cannot fork swapped-out sequence " + std::to_string(parent));
  if (tables_.count(child) > 0)
    misuse("sequence " + std::to_string(child) + " already holds blocks");
  for (auto b : p.blocks)
    ++device_refs_[static_cast<size_t>(b)];
  tables_.emplace(child, p);
}

void block_manager::release(int32_t block, bool swapped) {
  auto& refs = swapped ? swap_refs_ : device_refs_;
  if (--refs[static_cast<size_t>(block)] == 0)
    (swapped ? free_swap_ : free_device_).push_back(block);
}

void block_manager::free(int64_t seq) {
  auto& t = get(seq);
  for (auto b : t.blocks)
    release(b, t.swapped);
  tables_.erase(seq);
}

int64_t block_manager::distinct_blocks(const std::vector<int64_t>& seqs, bool swapped) const {
  std::set<int32_t> blocks;
  for (auto seq : seqs) {
    auto& t = get(seq);
    if (t.swapped != swapped)
      misuse("sequence " + std::to_string(seq) + (swapped ? " is not" : " is already") +
             " swapped out");
    blocks.insert(t.blocks.begin(), t.blocks.end());
  }
  return static_cast<int64_t>(blocks.size());
}

bool block_manager::can_swap_out(const std::vector<int64_t>& seqs) const {
  return distinct_blocks(seqs, false) <= free_swap_blocks();
}

bool block_manager::can_swap_in(const std::vector<int64_t>& seqs) const {
  // Leave the watermark, and one block per sequence to grow into.
  return distinct_blocks(seqs, true) + static_cast<int64_t>(seqs.size())
         <= free_device_blocks() - watermark_blocks_;
}

std::vector<block_move> block_manager::move(const std::vector<int64_t>& seqs, bool to_swap) {
  if (to_swap ? !can_swap_out(seqs) : distinct_blocks(seqs, true) > free_device_blocks())
    misuse(std::string{"not enough free "} + (to_swap ? "swap" : "device") + " blocks");
  std::unordered_map<int32_t, int32_t> mapping;
  std::vector<block_move> moves;
  for (auto seq : seqs) {
    auto& t = get(seq);
    for (auto& b : t.blocks) {
      auto known = mapping.find(b);
      int32_t target;
      if (known != mapping.end()) {
        target = known->second;
        ++(to_swap ? swap_refs_ : device_refs_)[static_cast<size_t>(target)];
      } else {
        auto& free_list = to_swap ? free_swap_ : free_device_;
        target = free_list.back();
        free_list.pop_back();
        (to_swap ? swap_refs_ : device_refs_)[static_cast<size_t>(target)] = 1;
        mapping.emplace(b, target);
        moves.push_back({b, target});
      }
      release(b, !to_swap);
      b = target;
    }
    t.swapped = to_swap;
  }
  return moves;
}

std::vector<block_move> block_manager::swap_out(const std::vector<int64_t>& seqs) {
  return move(seqs, true);
}

std::vector<block_move> block_manager::swap_in(const std::vector<int64_t>& seqs) {
  return move(seqs, false);
}

} // namespace troupe
