// The engine's block bookkeeping: allocation with a watermark, growth, fork with
// copy-on-write, free, and swapping out and in.

#include "engine/block_manager.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>

#include <set>

using namespace troupe;

TEST_CASE("prompts get whole blocks and the watermark keeps room to grow") {
  block_manager bm{4, 10, 4, 0.1}; // watermark: 1 block
  CHECK(bm.can_allocate(9) == block_manager::allocation::ok); // 3 blocks
  bm.allocate(1, 9);
  CHECK(bm.block_table(1).size() == 3);
  CHECK(bm.free_device_blocks() == 7);
  CHECK(bm.can_allocate(24) == block_manager::allocation::ok);     // 6 of 7, 1 left
  CHECK(bm.can_allocate(28) == block_manager::allocation::later);  // 7 of 7 would eat the watermark
  CHECK(bm.can_allocate(40) == block_manager::allocation::never);  // more than the device has
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
