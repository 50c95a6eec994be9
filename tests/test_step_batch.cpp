// The host side of a step, without a device: a request checked and flattened into the
// batch the forward pass runs.

#include "model/config.hpp"
#include "model/llama.hpp"
#include "model/step_batch.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>

using namespace troupe;

namespace {

model_config tiny() {
  model_config c;
  c.vocab_size = 100;
  c.max_position_embeddings = 64;
  return c;
}

sequence_group_metadata group(const std::string& id, int64_t seq_id, std::vector<int32_t> ids,
                              int32_t computed, int32_t chunk, std::vector<int32_t> blocks) {
  sequence_group_metadata g;
  g.request_id = id;
  g.token_chunk_size = chunk;
  sequence_data s;
  s.seq_id = seq_id;
  s.token_ids = std::move(ids);
  s.num_computed_tokens = computed;
  s.block_table = std::move(blocks);
  g.seqs.push_back(s);
  return g;
}

} // namespace

TEST_CASE("a batch flattens the scheduled tokens with their positions, tables and sampled rows") {
  execute_model_request req;
  req.seq_group_metadata_list.push_back(group("prompt", 0, {1, 2, 3, 4, 5}, 0, 5, {3, 7}));
  req.seq_group_metadata_list.push_back(
    group("decode", 1, {9, 8, 7, 6, 5, 4, 3, 2, 1}, 8, 1, {0, 1, 2}));
  auto b = prepare_batch(req, tiny(), 4, 8);
  REQUIRE(b.tokens.size() == 6);
  CHECK(b.tokens[0].id == 1);
  CHECK(b.tokens[4].position == 4);
  CHECK(b.tokens[5].id == 1);
  CHECK(b.tokens[5].position == 8);
  CHECK(b.tokens[5].seq == 1);
  CHECK(b.tokens[5].group == 1);
  CHECK(b.table_blocks == std::vector<int64_t>{2, 3});
  CHECK(b.max_blocks() == 4); // 3 rounded up to a power of two
  CHECK(b.lengths() == std::vector<int64_t>{5, 9});
  CHECK(b.sample_tokens == std::vector<int32_t>{4, 5}); // the last token of each sequence
  REQUIRE(b.rows.size() == 2);
  CHECK(b.rows[1].group == 1);
  CHECK(!b.decode_only);
  req.seq_group_metadata_list.erase(req.seq_group_metadata_list.begin());
  CHECK(prepare_batch(req, tiny(), 4, 8).decode_only);
}

TEST_CASE("tokens of groups with the same LoRA adapter in a row form one run") {
  execute_model_request req;
  for (int g = 0; g < 3; ++g)
    req.seq_group_metadata_list.push_back(group("r" + std::to_string(g), g, {1, 2}, 0, 2, {g}));
  lora_weights a;
  a.rank = 4;
  lora_weights b8;
  b8.rank = 8;
  auto b = prepare_batch(req, tiny(), 4, 8, {{&a, &a, &b8}, {}});
  REQUIRE(b.lora_runs.size() == 2);
  CHECK(b.lora_runs[0].begin == 0);
  CHECK(b.lora_runs[0].count == 4);
  CHECK(b.lora_runs[1].begin == 4);
  CHECK(b.lora_runs[1].weights == &b8);
  CHECK(b.max_lora_rank == 8);
  auto none = prepare_batch(req, tiny(), 4, 8, {{nullptr, &a, nullptr}, {}});
  REQUIRE(none.lora_runs.size() == 1);
  CHECK(none.lora_runs[0].begin == 2);
}

TEST_CASE("a malformed request is refused naming the request and what is wrong") {
  auto refused = [](sequence_group_metadata g, const char* what) {
    execute_model_request req;
    req.seq_group_metadata_list.push_back(std::move(g));
    CHECK_THROWS_WITH_AS(prepare_batch(req, tiny(), 4, 8), doctest::Contains(what), error);
  };
  refused(group("past", 0, {1, 2}, 1, 2, {0}), "request 'past': chunk of 2 tokens from position 1");
  refused(group("short", 0, {1, 2, 3, 4, 5}, 0, 5, {0}), "block table has 1 blocks, 2 needed");
  refused(group("outside", 0, {1}, 0, 1, {8}), "block 8 is not a device block");
  refused(group("vocab", 0, {100}, 0, 1, {0}), "token 100 is outside the vocabulary of 100");
  std::vector<int32_t> long_prompt(65, 1);
  refused(group("long", 0, long_prompt, 0, 65, std::vector<int32_t>(17, 0)),
          "reaches position 65, past the model's 64 positions");
  execute_model_request req;
  req.seq_group_metadata_list.push_back(group("a", 0, {1}, 0, 1, {0}));
  CHECK_THROWS_WITH_AS(prepare_batch(req, tiny(), 4, 8, {{nullptr, nullptr}, {}}),
                       doctest::Contains("adapters given for 2 and 0 groups of 1"), error);
}

TEST_CASE("a sequence sent from its first computed position flattens as the whole one does") {
  execute_model_request whole;
  whole.seq_group_metadata_list.push_back(
    group("decode", 1, {9, 8, 7, 6, 5, 4, 3, 2, 1}, 6, 3, {0, 1, 2}));
  auto cut = whole;
  auto& seq = cut.seq_group_metadata_list[0].seqs[0];
  seq.token_ids = {3, 2, 1};
  seq.first_token = 6;
  auto a = prepare_batch(whole, tiny(), 4, 8);
  auto b = prepare_batch(cut, tiny(), 4, 8);
  REQUIRE(a.tokens.size() == 3);
  REQUIRE(b.tokens.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(a.tokens[i].id == b.tokens[i].id);
    CHECK(a.tokens[i].position == b.tokens[i].position);
  }
  CHECK(a.lengths() == b.lengths());
  // Tokens the step computes may not be left out.
  seq.token_ids = {2, 1};
  seq.first_token = 7;
  CHECK_THROWS_WITH_AS(prepare_batch(cut, tiny(), 4, 8), doctest::Contains("from position 7"),
                       error);
}

TEST_CASE("kept block tables: a step sends only new blocks, finished requests are dropped") {
  kept_block_tables kept;
  execute_model_request req;
  req.keep_block_tables = true;
  req.seq_group_metadata_list.push_back(group("a", 0, {1, 2, 3, 4, 5}, 0, 5, {3, 7}));
  req.seq_group_metadata_list.push_back(group("b", 1, {1, 2}, 0, 2, {5}));
  kept.update(req, 8);
  auto b = prepare_batch(req, tiny(), 4, 8, {}, &kept);
  CHECK(b.tables[0] == kept.of(0).data());
  CHECK(kept.of(0) == std::vector<int32_t>{3, 7});
  // Decodes: "a" needs no new block, "b" one; each sends what it adds.
  execute_model_request next;
  next.keep_block_tables = true;
  next.seq_group_metadata_list.push_back(group("a", 0, {6}, 5, 1, {}));
  next.seq_group_metadata_list[0].seqs[0].first_token = 5;
  next.seq_group_metadata_list[0].seqs[0].first_block = 2;
  next.seq_group_metadata_list.push_back(group("b", 1, {3}, 2, 1, {}));
  next.seq_group_metadata_list[1].seqs[0].first_token = 2;
  next.seq_group_metadata_list[1].seqs[0].first_block = 1;
  kept.update(next, 8);
  b = prepare_batch(next, tiny(), 4, 8, {}, &kept);
  CHECK(b.table_blocks == std::vector<int64_t>{2, 1});
  CHECK(kept.of(0) == std::vector<int32_t>{3, 7});
  // A changed last block replaces the kept one from its place on.
  next.seq_group_metadata_list[1].seqs[0].block_table = {6};
  next.seq_group_metadata_list[1].seqs[0].first_block = 0;
  next.seq_group_metadata_list[0].seqs[0].block_table = {2};
  next.seq_group_metadata_list[0].seqs[0].first_block = 1;
  kept.update(next, 8);
  CHECK(kept.of(0) == std::vector<int32_t>{3, 2});
  CHECK(kept.of(1) == std::vector<int32_t>{6});
  // Past what is kept, or a block outside the cache: refused, nothing changed.
  next.seq_group_metadata_list[0].seqs[0].first_block = 3;
  CHECK_THROWS_AS(kept.update(next, 8), error);
  next.seq_group_metadata_list[0].seqs[0].first_block = 2;
  next.seq_group_metadata_list[1].seqs[0].block_table = {8};
  CHECK_THROWS_AS(kept.update(next, 8), error);
  CHECK(kept.of(0) == std::vector<int32_t>{3, 2});
  CHECK(kept.of(1) == std::vector<int32_t>{6});
  // A step that keeps nothing sends whole tables.
  next.keep_block_tables = false;
  next.seq_group_metadata_list[1].seqs[0].block_table = {6};
  CHECK_THROWS_AS(kept.update(next, 8), error);
  CHECK_THROWS_AS(prepare_batch(next, tiny(), 4, 8, {}, &kept), error);
  // Finished requests' tables go.
  execute_model_request finished;
  finished.finished_requests_ids = {"a"};
  kept.update(finished, 8);
  CHECK(kept.size() == 1);
  CHECK_THROWS_AS(kept.of(0), error);
}
