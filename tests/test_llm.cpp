// troupe::llm end to end: batched generation equal to transformers' greedy tokens, chat
// prompts as transformers renders them, and clear errors.

#include "tests/generation.hpp"
#include "troupe/llm.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>

using namespace troupe;
using troupe::testing::greedy;
using troupe::testing::read_json;

namespace {

const std::string fixtures = TROUPE_SOURCE_DIR "/tests/fixtures";

} // namespace

TEST_CASE("a batch of token-id prompts gives transformers' greedy tokens") {
  llm_config cfg;
  cfg.model = fixtures + "/qwen2-bias";
  cfg.kv_cache_memory_bytes = 2 << 20;
  cfg.block_size = 4;
  llm model{cfg};
  CHECK(!model.has_tokenizer());
  auto ref = read_json(fixtures + "/qwen2-bias/reference.json");
  std::vector<generation_request> reqs;
  for (auto& p : ref["prompts"])
    reqs.push_back({"", p["token_ids"].get<std::vector<int32_t>>(), greedy(32), {}});
  auto outs = model.generate(reqs);
  REQUIRE(outs.size() == reqs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    CHECK(outs[i].token_ids == ref["prompts"][i]["greedy"].get<std::vector<int32_t>>());
    CHECK(outs[i].logprobs.size() == 32);
    CHECK(outs[i].finish_reason == "length");
  }
  CHECK(model.last_tokens_per_second() > 0);
  CHECK_THROWS_WITH_AS(model.generate({"text"}, greedy(4)), doctest::Contains("no tokenizer"),
                       error);
  std::vector<generation_request> too_long{{"", std::vector<int32_t>(600, 5), greedy(4), {}}};
  CHECK_THROWS_WITH_AS(model.generate(too_long), doctest::Contains("600 tokens"), error);
  CHECK_THROWS_AS(model.chat_prompt("hi"), error);
}

TEST_CASE("SmolLM2: chat prompts and generation as transformers does them") {
  auto path = testing::smollm2_or_skip();
  if (path.empty())
    return;
  llm_config cfg;
  cfg.model = path.string();
  cfg.kv_cache_memory_bytes = 32 << 20;
  cfg.max_model_len = 512;
  llm model{cfg};
  auto ref = read_json(fixtures + "/smollm2-reference.json")["runs"];
  CHECK(model.chat_prompt("What is the capital of France?") == ref[0]["text"].get<std::string>());
  std::vector<std::string> texts;
  for (auto& run : ref)
    texts.push_back(run["text"].get<std::string>());
  auto outs = model.generate(texts, greedy(24));
  for (size_t i = 0; i < outs.size(); ++i) {
    CHECK(outs[i].prompt_token_ids == ref[i]["token_ids"].get<std::vector<int32_t>>());
    CHECK(outs[i].token_ids == ref[i]["greedy"].get<std::vector<int32_t>>());
  }
  // With end-of-sequence and a stop string honoured.
  sampling_params sp = greedy(40);
  sp.ignore_eos = false;
  auto answer = model.generate({model.chat_prompt("What is the capital of France?")}, sp);
  CHECK(answer[0].text == "The capital of France is Paris.");
  CHECK(answer[0].finish_reason == "stop");
  auto cut = model.generate({{"The capital of France is", {}, greedy(20), {"."}}});
  CHECK(cut[0].text == " Paris");
  CHECK(cut[0].finish_reason == "stop");
}
