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

/// One step of a 64-bit hash (splitmix64's finalizer over the running value and the next).
uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

} // namespace

block_manager::block_manager(int32_t block_size, int64_t device_blocks, int64_t swap_blocks,
                             double watermark, bool prefix_caching)
  : block_size_(block_size), device_blocks_(device_blocks), prefix_caching_(prefix_caching) {
  if (block_size <= 0 || device_blocks < 0 || swap_blocks < 0 || watermark < 0 || watermark >= 1)
    misuse("needs block_size > 0, block counts >= 0 and a watermark in [0, 1)");
  watermark_blocks_ =
    static_cast<int64_t>(std::floor(watermark * static_cast<double>(device_blocks)));
  // Free lists are stacks: the lowest block numbers are handed out first.
  for (auto b = device_blocks; b > 0; --b)
    free_device_.push_back(static_cast<int32_t>(b - 1));
  for (auto b = swap_blocks; b > 0; --b)
    free_swap_.push_back(static_cast<int32_t>(b - 1));
  device_refs_.assign(static_cast<size_t>(device_blocks), 0);
  swap_refs_.assign(static_cast<size_t>(swap_blocks), 0);
  blocks_.resize(static_cast<size_t>(device_blocks));
  evictable_at_.resize(static_cast<size_t>(device_blocks));
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

void block_manager::note_hot(int64_t seq, hot_set& hot) const {
  auto at = tables_.find(seq);
  if (at == tables_.end())
    return;
  hot.add_hash_node(*at);
  auto& t = at->second;
  hot.add_end(t.blocks);
  hot.add_end(t.hashes);
  if (!t.blocks.empty() && !t.swapped) {
    auto last = static_cast<size_t>(t.blocks.back());
    hot.add(device_refs_[last]);
    if (last < blocks_.size())
      hot.add(blocks_[last]);
  }
}

void block_manager::blocks_to_send(int64_t seq, int32_t& first, std::vector<int32_t>& blocks) {
  auto& t = get(seq);
  if (t.swapped)
    misuse("sequence " + std::to_string(seq) + " is swapped out");
  first = static_cast<int32_t>(t.sent);
  blocks.assign(t.blocks.begin() + t.sent, t.blocks.end());
  t.sent = static_cast<int64_t>(t.blocks.size());
}

block_manager::allocation block_manager::can_allocate(int64_t tokens, prefix_hit hit) const {
  auto needed = blocks_for(tokens);
  if (device_blocks_ - needed < watermark_blocks_)
    return allocation::never;
  if (free_device_blocks() - (needed - hit.in_use) >= watermark_blocks_)
    return allocation::ok;
  return allocation::later;
}

int32_t block_manager::take_device() {
  int32_t b;
  if (!free_device_.empty()) { // an empty block before a cached one
    b = free_device_.back();
    free_device_.pop_back();
  } else if (!evictable_.empty()) {
    b = evictable_.front();
    evictable_.pop_front();
    uncache(b);
  } else {
    misuse("no free device block (ask can_allocate / can_append_slots first)");
  }
  device_refs_[static_cast<size_t>(b)] = 1;
  return b;
}

uint64_t block_manager::hash_block(const tokens_view& tokens, int64_t index,
                                   uint64_t parent) const {
  auto h = mix(parent, tokens.salt);
  for (int64_t i = index * block_size_; i < (index + 1) * block_size_; ++i)
    h = mix(h, static_cast<uint32_t>(tokens[i]));
  return h;
}

int32_t block_manager::lookup(const tokens_view& tokens, int64_t index, uint64_t parent,
                              uint64_t hash) const {
  auto found = by_hash_.find(hash);
  if (found == by_hash_.end())
    return -1;
  auto& c = blocks_[static_cast<size_t>(found->second)];
  if (c.parent != parent || c.salt != tokens.salt)
    return -1;
  for (int64_t i = 0; i < block_size_; ++i)
    if (c.tokens[static_cast<size_t>(i)] != tokens[index * block_size_ + i])
      return -1;
  return found->second;
}

void block_manager::uncache(int32_t block) {
  auto& c = blocks_[static_cast<size_t>(block)];
  if (!c.cached)
    return;
  auto found = by_hash_.find(c.hash);
  if (found != by_hash_.end() && found->second == block)
    by_hash_.erase(found);
  c = cached_block{};
}

std::vector<std::pair<int32_t, uint64_t>> block_manager::match(const tokens_view& tokens) const {
  std::vector<std::pair<int32_t, uint64_t>> found;
  if (!prefix_caching_ || tokens.size() == 0)
    return found;
  uint64_t parent = 0;
  for (int64_t i = 0; i < (tokens.size() - 1) / block_size_; ++i) {
    auto h = hash_block(tokens, i, parent);
    auto b = lookup(tokens, i, parent, h);
    if (b < 0)
      break;
    found.emplace_back(b, h);
    parent = h;
  }
  return found;
}

block_manager::prefix_hit block_manager::find_prefix(const tokens_view& tokens) const {
  prefix_hit hit;
  for (auto& [b, h] : match(tokens)) {
    ++hit.blocks;
    if (device_refs_[static_cast<size_t>(b)] > 0)
      ++hit.in_use;
  }
  return hit;
}

int64_t block_manager::allocate(int64_t seq, const tokens_view& tokens) {
  if (tables_.count(seq) > 0)
    misuse("sequence " + std::to_string(seq) + " already holds blocks");
  if (tokens.size() <= 0)
    misuse("a prompt needs at least one token");
  auto cached = match(tokens);
  auto hits = static_cast<int64_t>(cached.size());
  int64_t in_use = 0;
  for (auto& [b, h] : cached)
    in_use += device_refs_[static_cast<size_t>(b)] > 0 ? 1 : 0;
  auto needed = blocks_for(tokens.size());
  if (needed - in_use > free_device_blocks())
    misuse("not enough free device blocks for " + std::to_string(tokens.size()) + " tokens");
  table t;
  for (auto& [b, h] : cached) {
    auto& refs = device_refs_[static_cast<size_t>(b)];
    if (refs++ == 0)
      evictable_.erase(evictable_at_[static_cast<size_t>(b)]);
    t.blocks.push_back(b);
    t.hashes.push_back(h);
  }
  for (auto i = hits; i < needed; ++i)
    t.blocks.push_back(take_device());
  tables_.emplace(seq, std::move(t));
  if (prefix_caching_) {
    cache_queries_ += tokens.size();
    cache_hits_ += hits * block_size_;
  }
  return hits * block_size_;
}

void block_manager::cache_computed(int64_t seq, const tokens_view& tokens, int64_t computed) {
  auto found = tables_.find(seq);
  if (!prefix_caching_ || found == tables_.end() || found->second.swapped)
    return;
  auto& t = found->second;
  auto full = std::min<int64_t>(std::min(computed, tokens.size()) / block_size_,
                                static_cast<int64_t>(t.blocks.size()));
  uint64_t parent = t.hashes.empty() ? 0 : t.hashes.back();
  for (auto i = static_cast<int64_t>(t.hashes.size()); i < full; ++i) {
    auto h = hash_block(tokens, i, parent);
    auto b = t.blocks[static_cast<size_t>(i)];
    auto& c = blocks_[static_cast<size_t>(b)];
    // A block with the same tokens computed by another sequence first stays the one known.
    if (!c.cached && by_hash_.count(h) == 0) {
      c.cached = true;
      c.hash = h;
      c.parent = parent;
      c.salt = tokens.salt;
      c.tokens.resize(static_cast<size_t>(block_size_));
      for (int64_t j = 0; j < block_size_; ++j)
        c.tokens[static_cast<size_t>(j)] = tokens[i * block_size_ + j];
      by_hash_.emplace(h, b);
    }
    t.hashes.push_back(h);
    parent = h;
  }
}

void block_manager::reset_cache() {
  for (auto b : evictable_)
    free_device_.push_back(b);
  evictable_.clear();
  for (auto& c : blocks_)
    c = cached_block{};
  by_hash_.clear();
  for (auto& entry : tables_)
    entry.second.hashes.clear();
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
    t.sent = std::min<int64_t>(t.sent, static_cast<int64_t>(t.blocks.size()) - 1);
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
  auto& c = tables_.emplace(child, p).first->second;
  c.sent = 0; // the ranks know the child by its own id
}

void block_manager::release(int32_t block, bool swapped) {
  auto& refs = swapped ? swap_refs_ : device_refs_;
  if (--refs[static_cast<size_t>(block)] > 0)
    return;
  if (swapped) {
    free_swap_.push_back(block);
  } else if (blocks_[static_cast<size_t>(block)].cached) {
    evictable_.push_back(block);
    evictable_at_[static_cast<size_t>(block)] = std::prev(evictable_.end());
  } else {
    free_device_.push_back(block);
  }
}

void block_manager::free(int64_t seq) {
  auto& t = get(seq);
  // Last block first: a sequence's tail is the first of its cached blocks to be evicted.
  for (auto b = t.blocks.rbegin(); b != t.blocks.rend(); ++b)
    release(*b, t.swapped);
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
  return distinct_blocks(seqs, true) + static_cast<int64_t>(seqs.size()) <=
         free_device_blocks() - watermark_blocks_;
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
        if (to_swap) {
          target = free_swap_.back();
          free_swap_.pop_back();
          swap_refs_[static_cast<size_t>(target)] = 1;
        } else {
          target = take_device();
        }
        mapping.emplace(b, target);
        moves.push_back({b, target});
      }
      release(b, !to_swap);
      b = target;
    }
    // Blocks come back elsewhere: cache_computed makes them known again.
    t.hashes.clear();
    t.swapped = to_swap;
    t.sent = 0;
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
