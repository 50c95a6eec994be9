// The engine's block bookkeeping: allocation with a watermark, growth, fork with
// copy-on-write, free, swapping out and in, and the prefix cache.

#include "engine/block_manager.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>

#include <set>

using namespace troupe;

TEST_CASE("prompts get whole blocks and the watermark keeps room to grow") {
  block_manager bm{4, 10, 4, 0.1};                            // watermark: 1 block
  CHECK(bm.can_allocate(9) == block_manager::allocation::ok); // 3 blocks
  bm.allocate(1, 9);
  CHECK(bm.block_table(1).size() == 3);
  CHECK(bm.free_device_blocks() == 7);
  CHECK(bm.can_allocate(24) == block_manager::allocation::ok);    // 6 of 7, 1 left
  CHECK(bm.can_allocate(28) == block_manager::allocation::later); // 7 of 7 would eat the watermark
  CHECK(bm.can_allocate(40) == block_manager::allocation::never); // more than the device has
  bm.free(1);
  CHECK(bm.free_device_blocks() == 10);
  CHECK_THROWS_AS(bm.free(1), error);
  CHECK_THROWS_AS(bm.allocate(2, 0), error);
}

TEST_CASE("a sequence grows block by block") {
  block_manager bm{4, 8, 0, 0.0};
  bm.allocate(1, 4); // one full block
  std::vector<block_move> copies;
  bm.append_slot(1, 5, copies); // needs a second block
  CHECK(bm.block_table(1).size() == 2);
  bm.append_slot(1, 6, copies); // fits
  CHECK(bm.block_table(1).size() == 2);
  CHECK(copies.empty());
  CHECK_THROWS_AS(bm.append_slot(1, 20, copies), error);
  CHECK(bm.can_append_slots({1}));
}

TEST_CASE("forked sequences share blocks until one writes into a shared block") {
  block_manager bm{4, 8, 0, 0.0};
  bm.allocate(1, 6); // blocks: one full, one half
  bm.fork(1, 2);
  CHECK(bm.block_table(2) == bm.block_table(1));
  CHECK(bm.free_device_blocks() == 6);
  std::vector<block_move> copies;
  bm.append_slot(2, 7, copies); // lands in the shared half block: copy-on-write
  REQUIRE(copies.size() == 1);
  CHECK(copies[0].src == bm.block_table(1)[1]);
  CHECK(copies[0].dst == bm.block_table(2)[1]);
  CHECK(bm.block_table(2)[0] == bm.block_table(1)[0]); // the full block stays shared
  copies.clear();
  bm.append_slot(1, 7, copies); // the parent's block is its own again
  CHECK(copies.empty());
  bm.free(1);
  CHECK(bm.free_device_blocks() == 6); // the first block still belongs to 2
  bm.free(2);
  CHECK(bm.free_device_blocks() == 8);
}

TEST_CASE("a step sends the blocks the ranks do not hold yet") {
  block_manager bm{4, 16, 4, 0.0};
  int32_t first = -1;
  std::vector<int32_t> blocks;
  auto send = [&](int64_t seq) {
    bm.blocks_to_send(seq, first, blocks);
    return first;
  };
  bm.allocate(1, 6);
  CHECK(send(1) == 0);
  CHECK(blocks == bm.block_table(1)); // new: whole
  std::vector<block_move> copies;
  bm.append_slot(1, 7, copies); // fits the last block
  CHECK(send(1) == 2);
  CHECK(blocks.empty());
  bm.append_slot(1, 8, copies);
  bm.append_slot(1, 9, copies); // a new block
  CHECK(send(1) == 2);
  CHECK(blocks == std::vector<int32_t>{bm.block_table(1)[2]});
  // A fork is new to the ranks; its copy-on-write changes only its last block.
  bm.fork(1, 2);
  CHECK(send(2) == 0);
  CHECK(blocks == bm.block_table(1));
  bm.append_slot(2, 10, copies);
  REQUIRE(copies.size() == 1);
  CHECK(send(2) == 2);
  CHECK(blocks == std::vector<int32_t>{copies[0].dst});
  // Swapped out and in, the blocks are elsewhere: whole again.
  bm.swap_out({1});
  CHECK_THROWS_AS(send(1), error);
  bm.swap_in({1});
  CHECK(send(1) == 0);
  CHECK(blocks == bm.block_table(1));
  // Freed and allocated again under the same id: whole.
  bm.free(2);
  bm.allocate(2, 3);
  CHECK(send(2) == 0);
  CHECK(blocks.size() == 1);
}

TEST_CASE("swapping out and in moves every block once and keeps the accounting") {
  block_manager bm{4, 8, 6, 0.0};
  bm.allocate(1, 8);
  bm.fork(1, 2); // shares both blocks
  bm.allocate(3, 4);
  CHECK(bm.can_swap_out({1, 2}));
  auto out = bm.swap_out({1, 2});
  CHECK(out.size() == 2); // shared blocks move once
  CHECK(bm.is_swapped(1));
  CHECK(bm.free_swap_blocks() == 4);
  CHECK(bm.free_device_blocks() == 7);
  CHECK_THROWS_AS(bm.block_table(1), error);
  CHECK_THROWS_AS(bm.swap_out({1}), error);
  CHECK(bm.can_swap_in({1, 2}));
  auto in = bm.swap_in({1, 2});
  CHECK(in.size() == 2);
  std::set<int32_t> swap_sources;
  for (auto& m : in)
    swap_sources.insert(m.src);
  for (auto& m : out)
    CHECK(swap_sources.count(m.dst) == 1); // what went out comes back
  CHECK(bm.block_table(1) == bm.block_table(2));
  CHECK(bm.free_swap_blocks() == 6);
  CHECK(bm.free_device_blocks() == 5);
  bm.free(1);
  bm.free(2);
  bm.free(3);
  CHECK(bm.free_device_blocks() == 8);
}

TEST_CASE("swap space that is too small is answered before anything moves") {
  block_manager bm{4, 8, 1, 0.0};
  bm.allocate(1, 8);
  CHECK(!bm.can_swap_out({1}));
  CHECK_THROWS_AS(bm.swap_out({1}), error);
  CHECK(!bm.is_swapped(1));
  CHECK(bm.free_device_blocks() == 6);
  CHECK_THROWS_AS(block_manager(0, 8, 0), error);
}

namespace {

std::vector<int32_t> counting(int32_t from, int32_t n) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < n; ++i)
    out.push_back(from + i);
  return out;
}

} // namespace

TEST_CASE("prefix caching shares the computed full blocks a new prompt starts with") {
  block_manager bm{4, 16, 0, 0.0, true};
  const std::vector<int32_t> none;
  auto a = counting(100, 10);
  CHECK(bm.allocate(1, block_manager::tokens_view{a, none}) == 0); // nothing computed yet
  CHECK(bm.find_prefix({a, none}).blocks == 0);
  bm.cache_computed(1, {a, none}, 9); // blocks 0 and 1 are full and computed
  // The same first 8 tokens, then others: both full blocks are shared, the third is new.
  auto b = counting(100, 8);
  b.push_back(7);
  b.push_back(8);
  auto hit = bm.find_prefix({b, none});
  CHECK(hit.blocks == 2);
  CHECK(hit.in_use == 2);
  CHECK(bm.allocate(2, block_manager::tokens_view{b, none}) == 8);
  CHECK(bm.block_table(2)[0] == bm.block_table(1)[0]);
  CHECK(bm.block_table(2)[1] == bm.block_table(1)[1]);
  CHECK(bm.block_table(2)[2] != bm.block_table(1)[2]);
  CHECK(bm.free_device_blocks() == 16 - 3 - 1);
  // A prompt made of cached blocks only computes its last block again, to sample.
  auto c = counting(100, 8);
  CHECK(bm.find_prefix({c, none}).blocks == 1);
  // Another adapter, another token in the first block, or another order: no hit.
  CHECK(bm.find_prefix({b, none, 7}).blocks == 0);
  auto d = b;
  d[1] = 5;
  CHECK(bm.find_prefix({d, none}).blocks == 0);
  // A prompt continued by its output is known up to its computed tokens.
  auto prompt = counting(100, 6);
  auto output = std::vector<int32_t>{106, 107, 108, 109};
  CHECK(bm.find_prefix({prompt, output}).blocks == 2);
  CHECK(bm.cache_queries() == 20);
  CHECK(bm.cache_hits() == 8);
}

TEST_CASE("cached blocks nobody holds count as free and are evicted least recently used first") {
  block_manager bm{4, 6, 0, 0.0, true};
  const std::vector<int32_t> none;
  auto a = counting(0, 9);  // 3 blocks, 2 of them cached once computed
  auto b = counting(50, 9); // the same
  bm.allocate(1, block_manager::tokens_view{a, none});
  bm.cache_computed(1, {a, none}, 9);
  bm.allocate(2, block_manager::tokens_view{b, none});
  bm.cache_computed(2, {b, none}, 9);
  CHECK(bm.free_device_blocks() == 0);
  bm.free(1);
  bm.free(2);
  CHECK(bm.free_device_blocks() == 6);
  // Freed blocks still hold what they held: a is found, and taking it costs no empty block.
  auto hit = bm.find_prefix({a, none});
  CHECK(hit.blocks == 2);
  CHECK(hit.in_use == 0);
  CHECK(bm.can_allocate(9, hit) == block_manager::allocation::ok);
  CHECK(bm.allocate(3, block_manager::tokens_view{a, none}) == 8);
  CHECK(bm.free_device_blocks() == 3);
  // A new prompt of 2 blocks takes the empty one first, then evicts: b was freed after a,
  // and its last block first, so b's second block goes before its first.
  auto c = counting(200, 8);
  bm.allocate(4, block_manager::tokens_view{c, none});
  CHECK(bm.free_device_blocks() == 1);
  CHECK(bm.find_prefix({b, none}).blocks == 1);
  CHECK(bm.find_prefix({a, none}).blocks == 2);
  bm.reset_cache();
  CHECK(bm.find_prefix({a, none}).blocks == 0);
  bm.free(3);
  bm.free(4);
  CHECK(bm.free_device_blocks() == 6);
  CHECK(bm.find_prefix({a, none}).blocks == 0);
}

TEST_CASE("swapped-out sequences leave their cached blocks behind and are cached again after") {
  block_manager bm{4, 8, 8, 0.0, true};
  const std::vector<int32_t> none;
  auto a = counting(0, 10);
  bm.allocate(1, block_manager::tokens_view{a, none});
  bm.cache_computed(1, {a, none}, 9);
  auto moves = bm.swap_out({1});
  CHECK(moves.size() == 3);
  bm.cache_computed(1, {a, none}, 10); // swapped out: nothing to cache
  CHECK(bm.free_device_blocks() == 8);
  CHECK(bm.find_prefix({a, none}).blocks == 2); // the device copies stay until evicted
  bm.reset_cache();
  bm.swap_in({1});
  CHECK(bm.find_prefix({a, none}).blocks == 0);
  bm.cache_computed(1, {a, none}, 9);
  CHECK(bm.find_prefix({a, none}).blocks == 2);
  CHECK(bm.block_table(1)[0] == [&] {
    bm.allocate(2, block_manager::tokens_view{a, none});
    return bm.block_table(2)[0];
  }());
}

TEST_CASE("without prefix caching nothing is looked up or shared") {
  block_manager bm{4, 8, 0, 0.0, false};
  const std::vector<int32_t> none;
  auto a = counting(0, 10);
  CHECK(bm.allocate(1, block_manager::tokens_view{a, none}) == 0);
  bm.cache_computed(1, {a, none}, 9);
  CHECK(bm.find_prefix({a, none}).blocks == 0);
  CHECK(bm.allocate(2, block_manager::tokens_view{a, none}) == 0);
  CHECK(bm.cache_queries() == 0);
  bm.free(1);
  bm.free(2);
  CHECK(bm.free_device_blocks() == 8);
}
