// The Llama-family decoder against Hugging Face transformers: logits and greedy
// continuations of tiny random-weight models (tests/fixtures, made by
// scripts/make-reference-fixtures.py).

#include "kernels/cpu/cpu_device.hpp"
#include "model/checkpoint.hpp"
#include "model/config.hpp"
#include "model/llama.hpp"
#include "model/make_model.hpp"
#include "tests/generation.hpp"
#include "tests/model_runner.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <unistd.h>

using namespace troupe;
using troupe::testing::relative_error;

namespace {

const std::string fixtures = TROUPE_SOURCE_DIR "/tests/fixtures";
const char* models[] = {"llama-gqa", "llama3-rope-tied", "qwen2-bias", "llama-odd-heads"};

nlohmann::json reference(const std::string& name) {
  std::ifstream in{fixtures + "/" + name + "/reference.json"};
  return nlohmann::json::parse(in);
}

/// A fixture model on the CPU, one sequence stepping through it.
struct runner {
  cpu_device dev{0};
  checkpoint ckpt;
  testing::model_runner run;

  explicit runner(const std::string& name)
    : ckpt(fixtures + "/" + name), run(dev, load_model_config(fixtures + "/" + name), ckpt) {
  }
};

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

} // namespace

TEST_CASE("prefill logits match transformers within 1e-4") {
  double worst = 0;
  for (auto name : models) {
    auto ref = reference(name);
    for (auto& prompt : ref["prompts"]) {
      runner r{name};
      r.run.seq.token_ids = prompt["token_ids"].get<std::vector<int32_t>>();
      auto logits = r.run.step(static_cast<int32_t>(r.run.seq.token_ids.size()));
      auto want = prompt["last_logits"].get<std::vector<float>>();
      REQUIRE(logits.size() == want.size());
      auto err = relative_error(logits.data(), want);
      worst = std::max(worst, err);
      CHECK_MESSAGE(err < 1e-4, name << ": relative error " << err);
    }
  }
  MESSAGE("largest relative error of prefill logits: " << worst);
}

TEST_CASE("decoding one token at a time through the paged cache matches every position") {
  for (auto name : models) {
    auto ref = reference(name);
    auto& prompt = ref["prompts"][0];
    runner r{name};
    r.run.seq.token_ids = prompt["token_ids"].get<std::vector<int32_t>>();
    auto all = prompt["all_logits"].get<std::vector<std::vector<float>>>();
    for (size_t p = 0; p < all.size(); ++p) {
      auto logits = r.run.step(1);
      auto err = relative_error(logits.data(), all[p]);
      CHECK_MESSAGE(err < 1e-4, name << " position " << p << ": relative error " << err);
    }
  }
}

TEST_CASE("greedy continuations of 32 tokens are identical to transformers") {
  for (auto name : models) {
    auto ref = reference(name);
    for (auto& prompt : ref["prompts"]) {
      runner r{name};
      r.run.seq.token_ids = prompt["token_ids"].get<std::vector<int32_t>>();
      auto logits = r.run.step(static_cast<int32_t>(r.run.seq.token_ids.size()));
      std::vector<int32_t> generated;
      for (int i = 0; i < 32; ++i) {
        auto next = argmax(logits);
        generated.push_back(next);
        r.run.seq.token_ids.push_back(next);
        if (i + 1 < 32)
          logits = r.run.step(1);
      }
      CHECK_MESSAGE(generated == prompt["greedy"].get<std::vector<int32_t>>(), name);
    }
  }
}

TEST_CASE("malformed requests are errors naming the request") {
  runner r{"llama-gqa"};
  r.run.seq.token_ids = {1, 2, 300};
  CHECK_THROWS_WITH_AS(r.run.step(3), doctest::Contains("token 300 is outside the vocabulary"), error);
  r.run.seq.token_ids = {1, 2};
  CHECK_THROWS_WITH_AS(r.run.step(5), doctest::Contains("does not fit"), error);
  r.run.seq.block_table = {0};
  r.run.seq.token_ids.assign(10, 3);
  CHECK_THROWS_WITH_AS(r.run.step(10), doctest::Contains("block table has 1 blocks"), error);
}

TEST_CASE("configs and checkpoints that do not fit are errors naming the file") {
  CHECK_THROWS_WITH_AS(load_model_config("/nonexistent"), doctest::Contains("/nonexistent/config.json"),
                       error);
  CHECK_THROWS_WITH_AS(parse_model_config(R"({"architectures":["GPT2LMHeadModel"]})", "x.json"),
                       doctest::Contains("GPT2LMHeadModel is not supported"), error);
  CHECK_THROWS_WITH_AS(
    parse_model_config(R"({"architectures":["LlamaForCausalLM"],"vocab_size":0})", "x.json"),
    doctest::Contains("vocab_size must be a positive integer"), error);
  auto cfg = load_model_config(fixtures + "/llama-gqa");
  cfg.hidden_size = 32; // no longer what the checkpoint holds
  cpu_device dev{0};
  llama_model model{cfg, dev, 0, 1};
  checkpoint ckpt{fixtures + "/llama-gqa"};
  CHECK_THROWS_WITH_AS(model.load(ckpt), doctest::Contains("model.embed_tokens.weight"), error);
  auto odd = load_model_config(fixtures + "/llama-odd-heads");
  CHECK_THROWS_WITH_AS(llama_model(odd, dev, 0, 4), doctest::Contains("cannot be split 4 ways"),
                       error);
}

TEST_CASE("make-model writes a sharded checkpoint that loads and runs") {
  model_config c;
  c.architecture = "Qwen2ForCausalLM";
  c.vocab_size = 100;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.attention_bias = true;
  auto dir = (std::filesystem::temp_directory_path() /
              ("troupe-make-model-" + std::to_string(::getpid())))
               .string();
  write_random_model(c, dir, dtype::bf16, 7, 4096); // small shards: an index is written
  CHECK(std::ifstream{dir + "/model.safetensors.index.json"}.good());
  cpu_device dev{0};
  auto loaded = load_model_config(dir);
  CHECK(loaded.architecture == "Qwen2ForCausalLM");
  CHECK(loaded.attention_bias);
  checkpoint ckpt{dir};
  llama_model model{loaded, dev, 0, 1};
  model.load(ckpt);
  CHECK(model.num_parameters() == loaded.num_parameters());
  kv_cache cache{dev, 2, 2, 8, 4, 8, 0};
  execute_model_request req;
  req.seq_group_metadata_list.push_back({"r", true, {{0, {1, 2, 3}, 3, 0, {0}}}, {}, 3, true, 0, 0});
  std::vector<sample_row> rows;
  auto logits = model.forward(req, cache, rows);
  CHECK(logits.size() == 100);
  CHECK(std::isfinite(logits[0]));
  std::filesystem::remove_all(dir);
}
