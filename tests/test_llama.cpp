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
#include "tests/ranks.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <unistd.h>

using namespace troupe;
using troupe::testing::relative_error;

namespace {

const std::string fixtures = TROUPE_SOURCE_DIR "/tests/fixtures";
const auto& models = testing::fixture_models;

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
    : ckpt(fixtures + "/" + name), run(dev, load_model_config(fixtures + "/" + name), ckpt) {}
};

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

/// `testing::on_ranks` of fixture `name`.
template <class Each>
void on_ranks(const std::string& name, int32_t world, bool expert_parallel, Each each) {
  INFO(name);
  testing::on_ranks(load_model_config(fixtures + "/" + name), checkpoint{fixtures + "/" + name},
                    world, expert_parallel, each);
}

} // namespace

TEST_CASE("prefill logits match transformers within 1e-4") {
  double worst = 0;
  for (auto& name : models) {
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

TEST_CASE("prefill logits match transformers within 1e-4 at tensor parallel sizes 2, 3 and 4") {
  // Each rank on a thread of its own with its shard and a Gloo communicator, as the model
  // workers run them; rank 0's logits (after the last all-reduce) are compared.
  double worst = 0;
  for (auto& name : models) {
    auto cfg = load_model_config(fixtures + "/" + name);
    auto ref = reference(name);
    for (int32_t world : {2, 3, 4}) {
      if (world > cfg.num_attention_heads)
        continue; // refused at start (the model worker's test checks the error)
      std::vector<std::vector<float>> logits(ref["prompts"].size());
      on_ranks(name, world, false, [&](testing::model_runner& run, int32_t rank) {
        for (size_t i = 0; i < logits.size(); ++i) {
          run.seq.token_ids = ref["prompts"][i]["token_ids"].get<std::vector<int32_t>>();
          run.seq.num_computed_tokens = 0;
          auto out = run.step(static_cast<int32_t>(run.seq.token_ids.size()));
          if (rank == 0)
            logits[i] = std::move(out);
        }
      });
      for (size_t i = 0; i < logits.size(); ++i) {
        auto want = ref["prompts"][i]["last_logits"].get<std::vector<float>>();
        REQUIRE(logits[i].size() == want.size());
        auto err = relative_error(logits[i].data(), want);
        worst = std::max(worst, err);
        CHECK_MESSAGE(err < 1e-4, name << " prompt " << i << " at tensor parallel size " << world
                                       << ": relative error " << err);
      }
    }
  }
  MESSAGE("largest relative error of prefill logits over tensor parallel sizes 2-4: " << worst);
}

TEST_CASE("mixtures of experts placed whole on the ranks (expert parallelism) match "
          "transformers' logits and greedy tokens at tensor parallel sizes 2, 3 and 4") {
  // 6 experts over 4 ranks: shares of 1 and 2. Every rank routes every token and computes
  // those its experts take; each counts them.
  for (std::string name : {"mixtral-experts", "qwen3-moe", "qwen3-moe-mixed"}) {
    auto ref = reference(name);
    auto cfg = load_model_config(fixtures + "/" + name);
    for (int32_t world : {2, 3, 4}) {
      std::vector<std::vector<float>> logits(ref["prompts"].size());
      std::vector<std::vector<int32_t>> greedy(ref["prompts"].size());
      std::vector<int64_t> routed(static_cast<size_t>(world));
      std::vector<int64_t> held(static_cast<size_t>(world));
      on_ranks(name, world, true, [&](testing::model_runner& run, int32_t rank) {
        held[rank] = run.model.local_experts().second;
        for (size_t i = 0; i < logits.size(); ++i) {
          run.seq = {};
          for (int32_t b = 0; b < 64; ++b)
            run.seq.block_table.push_back(63 - b);
          run.seq.token_ids = ref["prompts"][i]["token_ids"].get<std::vector<int32_t>>();
          auto out = run.step(static_cast<int32_t>(run.seq.token_ids.size()));
          if (i == 0)
            routed[rank] = run.model.routed_tokens();
          if (rank == 0)
            logits[i] = out;
          for (int t = 0; t < 32; ++t) {
            auto next = argmax(out);
            if (rank == 0)
              greedy[i].push_back(next);
            run.seq.token_ids.push_back(next);
            if (t + 1 < 32)
              out = run.step(1);
          }
        }
      });
      CHECK(std::accumulate(held.begin(), held.end(), int64_t{0}) == cfg.num_experts);
      // The first prompt's tokens, each sent to num_experts_per_tok experts in every sparse
      // layer, taken once over the ranks.
      int64_t sparse = 0;
      for (int64_t layer = 0; layer < cfg.num_hidden_layers; ++layer)
        sparse += cfg.sparse(layer) ? 1 : 0;
      CHECK(std::accumulate(routed.begin(), routed.end(), int64_t{0}) ==
            sparse * cfg.num_experts_per_tok *
              static_cast<int64_t>(ref["prompts"][0]["token_ids"].size()));
      for (size_t i = 0; i < logits.size(); ++i) {
        auto want = ref["prompts"][i]["last_logits"].get<std::vector<float>>();
        REQUIRE(logits[i].size() == want.size());
        auto err = relative_error(logits[i].data(), want);
        CHECK_MESSAGE(err < 1e-4, name << " prompt " << i << " with expert parallelism at size "
                                       << world << ": relative error " << err);
        CHECK_MESSAGE(greedy[i] == ref["prompts"][i]["greedy"].get<std::vector<int32_t>>(),
                      name << " prompt " << i << " at size " << world);
      }
    }
  }
}

TEST_CASE("decoding one token at a time through the paged cache matches every position") {
  for (auto& name : models) {
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
  for (auto& name : models) {
    auto ref = reference(name);
    for (auto& prompt : ref["prompts"]) {
      runner r{name};
      r.run.seq.token_ids = prompt["token_ids"].get<std::vector<int32_t>>();
      auto logits = r.run.step(static_cast<int32_t>(r.run.seq.token_ids.size()));
      // Past LongRoPE's original length the sequence is computed again with the long
      // factors, as transformers' generate and troupe's engine do.
      auto& rs = r.run.model.config().rope_scaling;
      auto restart_at =
        rs.type == rope_scaling_config::kind::longrope ? rs.original_max_position_embeddings : -1;
      std::vector<int32_t> generated;
      for (int i = 0; i < 32; ++i) {
        auto next = argmax(logits);
        generated.push_back(next);
        r.run.seq.token_ids.push_back(next);
        if (i + 1 == 32)
          break;
        if (r.run.seq.num_computed_tokens == restart_at) {
          r.run.seq.num_computed_tokens = 0;
          logits = r.run.step(static_cast<int32_t>(r.run.seq.token_ids.size()));
        } else {
          logits = r.run.step(1);
        }
      }
      CHECK_MESSAGE(generated == prompt["greedy"].get<std::vector<int32_t>>(), name);
    }
  }
}

TEST_CASE("malformed requests are errors naming the request") {
  runner r{"llama-gqa"};
  r.run.seq.token_ids = {1, 2, 300};
  CHECK_THROWS_WITH_AS(r.run.step(3), doctest::Contains("token 300 is outside the vocabulary"),
                       error);
  r.run.seq.token_ids = {1, 2};
  CHECK_THROWS_WITH_AS(r.run.step(5), doctest::Contains("does not fit"), error);
  r.run.seq.block_table = {0};
  r.run.seq.token_ids.assign(10, 3);
  CHECK_THROWS_WITH_AS(r.run.step(10), doctest::Contains("block table has 1 blocks"), error);
}

TEST_CASE("a mixture's config that does not hold together is refused, naming the field, and "
          "a checkpoint with other experts names the tensor") {
  std::ifstream in{fixtures + "/qwen3-moe/config.json"};
  auto good = nlohmann::json::parse(in);
  auto refused = [&](const char* key, const nlohmann::json& value, const char* what) {
    auto j = good;
    j[key] = value;
    CHECK_THROWS_WITH_AS(parse_model_config(j.dump(), "moe.json"), doctest::Contains(what), error);
  };
  refused("num_experts_per_tok", 9, "num_experts_per_tok must be in [1, 8]");
  refused("num_local_experts", 0, "num_local_experts must be a positive integer");
  refused("moe_intermediate_size", -3, "moe_intermediate_size must be a positive integer");
  refused("mlp_only_layers", nlohmann::json::array({2}),
          "mlp_only_layers names 2, not a layer of 2");
  refused("mlp_only_layers", "all", "mlp_only_layers must be a list of layers");
  // Every other layer sparse: layers 1, 3, … (transformers' (layer + 1) % step).
  auto j = good;
  j["decoder_sparse_step"] = 2;
  j["num_hidden_layers"] = 4;
  auto c = parse_model_config(j.dump(), "moe.json");
  CHECK_FALSE(c.sparse(0));
  CHECK(c.sparse(1));
  CHECK_FALSE(c.sparse(2));
  CHECK(c.sparse(3));
  // The config written back reads as the same mixture.
  auto again = parse_model_config(to_config_json(c), "again.json");
  CHECK(again.num_experts == c.num_experts);
  CHECK(again.moe_intermediate_size == c.moe_intermediate_size);
  CHECK(again.dense_layers == c.dense_layers);
  CHECK(again.norm_topk_prob == c.norm_topk_prob);
  CHECK(again.num_parameters() == c.num_parameters());

  // More experts than the file holds.
  auto cfg = load_model_config(fixtures + "/mixtral-experts");
  cfg.num_experts = 7;
  cpu_device dev{0};
  llama_model model{cfg, dev, 0, 1};
  checkpoint ckpt{fixtures + "/mixtral-experts"};
  CHECK_THROWS_WITH_AS(model.load(ckpt),
                       doctest::Contains("block_sparse_moe.gate.weight' has shape [6, 64], "
                                         "the config needs [7, 64]"),
                       error);
}

TEST_CASE("configs and checkpoints that do not fit are errors naming the file") {
  CHECK_THROWS_WITH_AS(load_model_config("/nonexistent"),
                       doctest::Contains("/nonexistent/config.json"), error);
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

TEST_CASE("configs and weights that would compute garbage are refused, naming the key or tensor") {
  auto config_text = [](const std::string& extra) {
    auto j = nlohmann::json::parse(std::ifstream{fixtures + "/llama-gqa/config.json"});
    j.update(nlohmann::json::parse(extra));
    return j.dump();
  };
  // llama3 rope scaling that divides by zero.
  CHECK_THROWS_WITH_AS(
    parse_model_config(config_text(R"({"rope_parameters":{"rope_type":"llama3","factor":0,
      "rope_theta":10000}})"),
                       "c.json"),
    doctest::Contains("rope_scaling.factor must be positive"), error);
  CHECK_THROWS_WITH_AS(
    parse_model_config(config_text(R"({"rope_parameters":{"rope_type":"llama3","factor":8,
      "low_freq_factor":2,"high_freq_factor":2,"rope_theta":10000}})"),
                       "c.json"),
    doctest::Contains("low_freq_factor < high_freq_factor"), error);
  // Special tokens outside the vocabulary (256 tokens).
  CHECK_THROWS_WITH_AS(parse_model_config(config_text(R"({"eos_token_id":256})"), "c.json"),
                       doctest::Contains("eos_token_id 256 is outside the vocabulary of 256"),
                       error);
  // Qwen2 ships use_sliding_window false next to a window: attention is full, over all of
  // max_position_embeddings. Mistral's window (no switch) slides.
  auto qwen2 = parse_model_config(config_text(R"({"architectures":["Qwen2ForCausalLM"],
      "model_type":"qwen2","use_sliding_window":false,"sliding_window":128,
      "max_position_embeddings":512})"),
                                  "c.json");
  CHECK(qwen2.max_position_embeddings == 512);
  CHECK(qwen2.sliding_window == 0);
  auto mistral = parse_model_config(config_text(R"({"architectures":["MistralForCausalLM"],
      "model_type":"mistral","sliding_window":128,"max_position_embeddings":512})"),
                                    "c.json");
  CHECK(mistral.max_position_embeddings == 512);
  CHECK(mistral.sliding_window == 128);
  CHECK(mistral.window_of(0) == 128);
  CHECK(mistral.window_of(1) == 128);
  // Qwen2's window, when on, slides in the layers from max_window_layers on (llama-gqa has
  // 2 layers), or in those layer_types names.
  auto sliding = parse_model_config(config_text(R"({"use_sliding_window":true,
      "sliding_window":128,"max_window_layers":1})"),
                                    "c.json");
  CHECK(sliding.window_of(0) == 0);
  CHECK(sliding.window_of(1) == 128);
  auto typed = parse_model_config(config_text(R"({"use_sliding_window":true,"sliding_window":128,
      "layer_types":["sliding_attention","full_attention"]})"),
                                  "c.json");
  CHECK(typed.window_of(0) == 128);
  CHECK(typed.window_of(1) == 0);
  CHECK_THROWS_WITH_AS(
    parse_model_config(config_text(R"({"layer_types":["full_attention"]})"), "c.json"),
    doctest::Contains("1 entries for 2 layers"), error);
  CHECK_THROWS_WITH_AS(parse_model_config(config_text(R"({"layer_types":["chunked_attention",
      "full_attention"]})"),
                                          "c.json"),
                       doctest::Contains("'chunked_attention'"), error);
  // End tokens come as one or as a list (Llama 3), all kept, each once.
  CHECK(parse_model_config(config_text(R"({"eos_token_id":[2, 7, 2]})"), "c.json").eos_token_ids ==
        std::vector<int32_t>{2, 7});
  CHECK(
    parse_model_config(config_text(R"({"eos_token_id":null})"), "c.json").eos_token_ids.empty());
  CHECK_THROWS_WITH_AS(parse_model_config(config_text(R"({"eos_token_id":[2, 300]})"), "c.json"),
                       doctest::Contains("eos_token_id 300 is outside the vocabulary of 256"),
                       error);
  CHECK_THROWS_WITH_AS(parse_model_config(config_text(R"({"eos_token_id":"2"})"), "c.json"),
                       doctest::Contains("eos_token_id must be token ids"), error);
  CHECK_THROWS_WITH_AS(parse_model_config(config_text(R"({"bos_token_id":-7})"), "c.json"),
                       doctest::Contains("bos_token_id -7 is outside"), error);
  cpu_device dev{0};
  checkpoint ckpt{fixtures + "/llama-gqa"};
  // A config with fewer layers than the weights: the file's extra layer has no place.
  auto fewer = load_model_config(fixtures + "/llama-gqa");
  fewer.num_hidden_layers = 1;
  llama_model short_model{fewer, dev, 0, 1};
  CHECK_THROWS_WITH_AS(short_model.load(ckpt), doctest::Contains("model.layers.1."), error);
  // A NaN or an infinity in a weight.
  auto dir = std::filesystem::temp_directory_path() / ("troupe-nan-" + std::to_string(getpid()));
  testing::copy_model_changing(fixtures + "/llama-gqa", dir, "model.layers.1.mlp.down_proj.weight",
                               [](float* w) { w[5] = std::nanf(""); });
  auto cfg = load_model_config(fixtures + "/llama-gqa");
  llama_model nan_model{cfg, dev, 0, 1};
  CHECK_THROWS_WITH_AS(nan_model.load(checkpoint{dir.string()}),
                       doctest::Contains("tensor 'model.layers.1.mlp.down_proj.weight' holds NaN"),
                       error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("make-model writes a sharded checkpoint that loads and runs, in every family") {
  for (std::string arch : {"Qwen2ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                           "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"}) {
    INFO(arch);
    model_config c;
    c.architecture = arch;
    c.vocab_size = 100;
    c.hidden_size = 32;
    c.intermediate_size = 48;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.attention_bias = c.architecture == "Qwen2ForCausalLM";
    if (arch == "MixtralForCausalLM" || arch == "Qwen3MoeForCausalLM") {
      c.num_experts = 4;
      c.num_experts_per_tok = 2;
      c.moe_intermediate_size = arch == "MixtralForCausalLM" ? 48 : 16;
    }
    auto dir =
      (std::filesystem::temp_directory_path() / ("troupe-make-model-" + std::to_string(::getpid())))
        .string();
    write_random_model(c, dir, dtype::bf16, 7, 4096); // small shards: an index is written
    CHECK(std::ifstream{dir + "/model.safetensors.index.json"}.good());
    cpu_device dev{0};
    auto loaded = load_model_config(dir);
    CHECK(loaded.architecture == arch);
    CHECK(loaded.attention_bias == c.attention_bias);
    CHECK(loaded.num_experts == c.num_experts);
    checkpoint ckpt{dir};
    llama_model model{loaded, dev, 0, 1};
    model.load(ckpt);
    CHECK(model.num_parameters() == loaded.num_parameters());
    kv_cache cache{dev, 2, 2, 8, 4, 8, 0};
    execute_model_request req;
    req.seq_group_metadata_list.push_back(
      {"r", true, {{0, {1, 2, 3}, 3, 0, {0}}}, {}, 3, true, 0, 0});
    std::vector<sample_row> rows;
    auto logits = model.run_logits(req, cache, rows);
    CHECK(logits.size() == 100);
    CHECK(std::isfinite(logits[0]));
    std::filesystem::remove_all(dir);
  }
}
