// LoRA and prompt-tuning adapters against transformers + peft on the same PEFT files
// (tests/fixtures/llama-gqa-adapters, made by scripts/make-adapter-fixtures.py): prefill
// logits, greedy tokens of mixed batches at several tensor-parallel sizes, the slot rules
// (least recently used eviction, pinning, removal) and clear errors for bad adapters.

#include "kernels/cpu/cpu_device.hpp"
#include "model/config.hpp"
#include "model/llama.hpp"
#include "model/safetensors.hpp"
#include "tests/generation.hpp"
#include "troupe/llm.hpp"
#include "troupe/model_worker.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <unistd.h>

using namespace troupe;
using troupe::testing::greedy;
using troupe::testing::read_json;
using troupe::testing::relative_error;
namespace fs = std::filesystem;

namespace {

const std::string fixtures = TROUPE_SOURCE_DIR "/tests/fixtures";
const std::string base_model = fixtures + "/llama-gqa";
const std::string adapters = fixtures + "/llama-gqa-adapters";
const std::string lora_names[] = {"lora-all", "lora-qv", "lora-mlp"};
constexpr int64_t virtual_tokens = 4;

nlohmann::json reference() {
  return read_json(adapters + "/reference.json");
}

std::vector<int32_t> prompt_of(const nlohmann::json& ref, size_t i) {
  return ref["prompts"][i].get<std::vector<int32_t>>();
}

std::vector<int32_t> greedy_of(const nlohmann::json& ref, const std::string& adapter, size_t i) {
  return ref["adapters"][adapter][i]["greedy"].get<std::vector<int32_t>>();
}

lora_request lora(const std::string& name, int64_t id) {
  return {name, id, adapters + "/" + name};
}

prompt_adapter_request prompt_tuning(int64_t id) {
  return {"prompt-tuning", id, adapters + "/prompt-tuning", 0};
}

/// The last-position logits of `prompt` on one rank, with the given adapters.
std::vector<float> prefill_logits(llama_model& model, kv_cache& cache,
                                  const std::vector<int32_t>& prompt, const step_adapters& with) {
  execute_model_request req;
  sequence_group_metadata g;
  g.request_id = "r";
  sequence_data seq;
  seq.token_ids = prompt;
  seq.num_prompt_tokens = static_cast<int32_t>(prompt.size());
  for (int32_t b = 0; b < 16; ++b)
    seq.block_table.push_back(b);
  g.seqs.push_back(seq);
  g.token_chunk_size = static_cast<int32_t>(prompt.size());
  req.seq_group_metadata_list.push_back(g);
  std::vector<sample_row> rows;
  return model.run_logits(req, cache, rows, with);
}

std::unique_ptr<llm> make_llm(int32_t tp, int32_t max_loras) {
  llm_config cfg;
  cfg.worker.model_path = base_model;
  cfg.executor.tensor_parallel_size = tp;
  cfg.worker.kv_cache_memory_bytes = 2 << 20;
  cfg.executor.block_size = 4;
  cfg.worker.max_loras = max_loras;
  return std::make_unique<llm>(cfg);
}

std::unique_ptr<executor> make_executor(int32_t tp, int32_t max_loras, int32_t max_rank = 16) {
  executor_config cfg;
  cfg.tensor_parallel_size = tp;
  cfg.block_size = 4;
  cfg.max_model_len = 512;
  model_worker_options opts;
  opts.model_path = base_model;
  opts.kv_cache_memory_bytes = 2 << 20;
  opts.max_loras = max_loras;
  opts.max_lora_rank = max_rank;
  auto exec = std::make_unique<executor>(cfg, model_worker_factory(opts));
  exec->initialize_cache(exec->determine_num_available_blocks());
  return exec;
}

/// The greedy token after `prompt` in one prefill step with the given adapters (the
/// prompt adapter's placeholders put in front), on blocks `first_block`...+3.
int32_t first_token(executor& exec, std::vector<int32_t> prompt, int64_t lora_id,
                    int64_t prompt_adapter_id = 0, int32_t first_block = 0) {
  if (prompt_adapter_id != 0)
    prompt.insert(prompt.begin(), virtual_tokens, 0);
  sequence_group_metadata g;
  g.request_id = "r";
  g.is_prompt = true;
  g.seqs.push_back({0,
                    prompt,
                    static_cast<int32_t>(prompt.size()),
                    0,
                    {first_block, first_block + 1, first_block + 2, first_block + 3}});
  g.token_chunk_size = static_cast<int32_t>(prompt.size());
  g.sampling = greedy(1);
  g.lora_int_id = lora_id;
  g.prompt_adapter_id = prompt_adapter_id;
  execute_model_request req;
  req.seq_group_metadata_list.push_back(g);
  return exec.execute_model(req)[0].outputs[0].samples[0].output_token;
}

/// A scratch copy of an adapter directory whose config or weights a test may spoil.
struct adapter_copy {
  fs::path dir;

  /// A copy of adapter `name` of llama-gqa's, or of another base's under `from`.
  explicit adapter_copy(const std::string& name, const std::string& from = adapters)
    : dir(fs::temp_directory_path() / ("troupe-adapter-" + std::to_string(getpid()) + "-" + name)) {
    fs::remove_all(dir);
    fs::copy(from + "/" + name, dir);
  }
  ~adapter_copy() {
    fs::remove_all(dir);
  }

  /// Replaces `"key": old` in adapter_config.json by `"key": value`.
  void set(const std::string& key, const std::string& value) {
    auto config = read_json((dir / "adapter_config.json").string());
    config[key] = nlohmann::json::parse(value);
    std::ofstream{dir / "adapter_config.json"} << config.dump();
  }
};

} // namespace

TEST_CASE("LoRA and prompt-tuning prefill logits match peft within 1e-4") {
  auto ref = reference();
  cpu_device dev{0};
  auto cfg = load_model_config(base_model);
  llama_model model{cfg, dev, 0, 1};
  model.load(checkpoint{base_model});
  kv_cache cache{dev, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, 16, 0};
  double worst = 0;
  // The same base as a GGUF file too, whose q and k rows are held in llama.cpp's order: the
  // adapters' q and k factors follow it.
  const auto gguf = fixtures + "/llama-gqa-gguf/llama-gqa-f32.gguf";
  auto gguf_cfg = checkpoint::gguf_config(gguf);
  llama_model from_gguf{gguf_cfg, dev, 0, 1, dtype::f32, true};
  from_gguf.load(checkpoint::from_gguf(gguf, gguf_cfg));
  for (auto* base : {&model, &from_gguf})
    for (auto& name : lora_names) {
      auto weights = base->load_lora(adapters + "/" + name, 16);
      for (size_t i = 0; i < ref["prompts"].size(); ++i) {
        auto logits = prefill_logits(*base, cache, prompt_of(ref, i), {{&weights}, {}});
        auto want = ref["adapters"][name][i]["last_logits"].get<std::vector<float>>();
        auto err = relative_error(logits.data(), want);
        worst = std::max(worst, err);
        CHECK_MESSAGE(err < 1e-4, (base == &model ? "" : "GGUF base, ")
                                    << name << " prompt " << i << ": relative error " << err);
      }
    }
  auto embeddings = model.load_prompt_adapter(adapters + "/prompt-tuning", 0);
  CHECK(embeddings.num_virtual_tokens == virtual_tokens);
  for (size_t i = 0; i < ref["prompts"].size(); ++i) {
    std::vector<int32_t> prompt(virtual_tokens, 0);
    auto user = prompt_of(ref, i);
    prompt.insert(prompt.end(), user.begin(), user.end());
    auto logits = prefill_logits(model, cache, prompt, {{}, {&embeddings}});
    auto want = ref["adapters"]["prompt-tuning"][i]["last_logits"].get<std::vector<float>>();
    auto err = relative_error(logits.data(), want);
    worst = std::max(worst, err);
    CHECK_MESSAGE(err < 1e-4, "prompt tuning, prompt " << i << ": relative error " << err);
  }
  MESSAGE("largest relative error of adapter logits: " << worst);
}

TEST_CASE("LoRAs on Gemma 3's layers, on Phi-3's fused projections (B cut by rows) and on a "
          "mixture's attention match peft within 1e-4, at tensor parallel size 1") {
  for (auto [base, adapter] : {std::pair{"gemma3-layers", "lora-all"},
                               {"phi3-fused", "lora-fused"},
                               {"qwen3-moe", "lora-attention"}}) {
    INFO(base);
    const std::string model_dir = fixtures + "/" + base;
    const std::string dir = model_dir + "-adapters";
    auto ref = read_json(dir + "/reference.json");
    cpu_device dev{0};
    auto cfg = load_model_config(model_dir);
    llama_model model{cfg, dev, 0, 1};
    model.load(checkpoint{model_dir});
    kv_cache cache{dev, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, 16, 0};
    auto weights = model.load_lora(dir + "/" + adapter, 16);
    for (size_t i = 0; i < ref["prompts"].size(); ++i) {
      auto logits = prefill_logits(model, cache, prompt_of(ref, i), {{&weights}, {}});
      auto want = ref["adapters"][adapter][i]["last_logits"].get<std::vector<float>>();
      auto err = relative_error(logits.data(), want);
      CHECK_MESSAGE(err < 1e-4, "prompt " << i << ": relative error " << err);
      // Without the adapter the logits are not peft's: the LoRA is what the test sees.
      auto plain = prefill_logits(model, cache, prompt_of(ref, i), {});
      CHECK(relative_error(plain.data(), want) > 1e-3);
    }
  }
}

TEST_CASE("one batch mixing three LoRAs a prompt adapter and the base model gives peft's tokens") {
  auto ref = reference();
  for (int32_t tp : {1, 2, 4}) {
    CAPTURE(tp);
    auto model = make_llm(tp, 3);
    // Every prompt with every adapter and without, all in one generate call.
    std::vector<generation_request> reqs;
    std::vector<std::string> expected_adapter;
    for (size_t i = 0; i < ref["prompts"].size(); ++i) {
      generation_request base{"", prompt_of(ref, i), greedy(16), {}};
      reqs.push_back(base);
      expected_adapter.push_back("");
      for (int64_t id = 1; id <= 3; ++id) {
        auto r = base;
        r.lora = lora(lora_names[id - 1], id);
        reqs.push_back(r);
        expected_adapter.push_back(lora_names[id - 1]);
      }
      auto r = base;
      r.prompt_adapter = prompt_tuning(7);
      reqs.push_back(r);
      expected_adapter.push_back("prompt-tuning");
    }
    auto outs = model->generate(reqs);
    auto base_ref = read_json(base_model + "/reference.json");
    for (size_t n = 0; n < reqs.size(); ++n) {
      size_t prompt = n / 5;
      auto want = expected_adapter[n].empty()
                    ? [&] {
                        auto all = base_ref["prompts"][prompt]["greedy"].get<std::vector<int32_t>>();
                        return std::vector<int32_t>(all.begin(), all.begin() + 16);
                      }()
                    : greedy_of(ref, expected_adapter[n], prompt);
      CHECK_MESSAGE(outs[n].token_ids == want,
                    "prompt " << prompt << " adapter '" << expected_adapter[n] << "'");
      CHECK(outs[n].prompt_token_ids == prompt_of(ref, prompt));
    }
    CHECK(model->executor().list_loras() == std::vector<int64_t>{1, 2, 3});
    CHECK(model->executor().list_prompt_adapters() == std::vector<int64_t>{7});
  }
}

TEST_CASE("with fewer LoRA slots than adapters the steps take turns and outputs stay right") {
  auto ref = reference();
  auto model = make_llm(1, 1);
  std::vector<generation_request> reqs;
  for (int64_t id = 1; id <= 3; ++id) {
    generation_request r{"", prompt_of(ref, 0), greedy(16), {}};
    r.lora = lora(lora_names[id - 1], id);
    reqs.push_back(r);
  }
  auto outs = model->generate(reqs);
  for (size_t n = 0; n < 3; ++n)
    CHECK_MESSAGE(outs[n].token_ids == greedy_of(ref, lora_names[n], 0), lora_names[n]);
  CHECK(model->executor().list_loras().size() == 1);
}

TEST_CASE(
  "LoRA slots evict the least recently used unpinned adapter and refuse when all are pinned") {
  auto ref = reference();
  auto exec = make_executor(2, 2);
  auto ids = [&] { return exec->list_loras(); };
  CHECK(exec->add_lora(lora("lora-all", 1)));
  CHECK(exec->add_lora(lora("lora-qv", 2)));
  CHECK(ids() == std::vector<int64_t>{1, 2});
  CHECK(exec->add_lora(lora("lora-mlp", 3))); // evicts 1, the least recently used
  CHECK(ids() == std::vector<int64_t>{2, 3});
  CHECK(exec->add_lora(lora("lora-qv", 2)));  // already loaded: only marked used
  CHECK(exec->add_lora(lora("lora-all", 1))); // evicts 3 now, not 2
  CHECK(ids() == std::vector<int64_t>{1, 2});
  CHECK(exec->pin_lora(1));
  CHECK(exec->add_lora(lora("lora-mlp", 3))); // 1 is pinned: 2 goes
  CHECK(ids() == std::vector<int64_t>{1, 3});
  CHECK(exec->pin_lora(3));
  CHECK_THROWS_WITH_AS(exec->add_lora(lora("lora-qv", 2)), doctest::Contains("pinned"), error);
  CHECK(ids() == std::vector<int64_t>{1, 3}); // nothing lost
  CHECK_THROWS_WITH_AS(exec->pin_lora(9), doctest::Contains("LoRA 9 is not loaded"), error);

  // A step naming an evicted adapter loads it again, evicting an unpinned one of the slots;
  // its output is peft's.
  CHECK(exec->remove_lora(3));
  CHECK_FALSE(exec->remove_lora(3));
  CHECK(ids() == std::vector<int64_t>{1});
  sequence_group_metadata g;
  g.request_id = "r";
  g.is_prompt = true;
  g.seqs.push_back({0,
                    prompt_of(ref, 1),
                    static_cast<int32_t>(prompt_of(ref, 1).size()),
                    0,
                    {0, 1, 2, 3, 4, 5, 6, 7}});
  g.token_chunk_size = static_cast<int32_t>(g.seqs[0].token_ids.size());
  g.sampling = greedy(1);
  g.lora_int_id = 2; // added once, evicted since
  execute_model_request req;
  req.seq_group_metadata_list.push_back(g);
  auto out = exec->execute_model(req);
  CHECK(out[0].outputs[0].samples[0].output_token == greedy_of(ref, "lora-qv", 1)[0]);
  CHECK(ids() == std::vector<int64_t>{1, 2});

  req.seq_group_metadata_list[0].lora_int_id = 3; // removed
  CHECK_THROWS_WITH_AS(exec->execute_model(req), doctest::Contains("LoRA 3 was not added"), error);
  CHECK(exec->add_lora(lora("lora-mlp", 3))); // 1 is pinned: 2 goes
  CHECK(ids() == std::vector<int64_t>{1, 3});
  auto both = req;
  both.seq_group_metadata_list.push_back(g);
  both.seq_group_metadata_list[0].lora_int_id = 1;
  both.seq_group_metadata_list[1].lora_int_id = 2;
  both.seq_group_metadata_list[1].seqs[0].seq_id = 1;
  both.seq_group_metadata_list[1].seqs[0].block_table = {8, 9, 10, 11};
  both.seq_group_metadata_list[1].request_id = "r2";
  both.seq_group_metadata_list.push_back(both.seq_group_metadata_list[1]);
  both.seq_group_metadata_list[2].lora_int_id = 3;
  both.seq_group_metadata_list[2].seqs[0].seq_id = 2;
  both.seq_group_metadata_list[2].seqs[0].block_table = {12, 13, 14, 15};
  both.seq_group_metadata_list[2].request_id = "r3";
  CHECK_THROWS_WITH_AS(exec->execute_model(both), doctest::Contains("a step uses 3 LoRAs"), error);
}

TEST_CASE("LoRA and prompt adapters survive a level-2 sleep through reload_weights") {
  auto ref = reference();
  auto exec = make_executor(1, 1);
  exec->add_lora(lora("lora-all", 1));
  exec->add_prompt_adapter(prompt_tuning(1));
  exec->sleep(2);
  exec->wake_up();
  exec->collective_rpc("reload_weights");
  CHECK(first_token(*exec, prompt_of(ref, 0), 1) == greedy_of(ref, "lora-all", 0)[0]);
  CHECK(first_token(*exec, prompt_of(ref, 0), 0, 1, 4) == greedy_of(ref, "prompt-tuning", 0)[0]);
}

TEST_CASE("every worker reports a prompt adapter's virtual tokens from its files") {
  auto exec = make_executor(2, 1);
  // The request leaves the count out (0): the workers read it.
  exec->add_prompt_adapter({"p", 3, adapters + "/prompt-tuning", 0});
  CHECK(exec->prompt_adapter_virtual_tokens(3) == 4);
  // Evicted from its slot by another, it is still known.
  exec->add_prompt_adapter({"q", 4, adapters + "/prompt-tuning", 4});
  CHECK(exec->prompt_adapter_virtual_tokens(3) == 4);
  CHECK(exec->remove_prompt_adapter(3));
  CHECK_THROWS_WITH_AS(exec->prompt_adapter_virtual_tokens(3),
                       doctest::Contains("prompt adapter 3 was never added"), error);
}

TEST_CASE("bad adapters are refused naming the adapter and what is wrong, and nothing is lost") {
  auto exec = make_executor(1, 2, 4);
  CHECK(exec->add_lora(lora("lora-qv", 1)));
  auto refused = [&](const lora_request& r, const std::string& why) {
    CHECK_THROWS_WITH_AS(exec->add_lora(r), doctest::Contains(why.c_str()), error);
    CHECK(exec->list_loras() == std::vector<int64_t>{1});
  };
  refused(lora("lora-all", 2), "rank 8, above max_lora_rank 4");
  refused({"missing", 2, adapters + "/missing"}, "no adapter_config.json");
  refused({"prompt", 2, adapters + "/prompt-tuning"}, "not LORA");
  CHECK_THROWS_WITH_AS(exec->add_lora({"zero", 0, adapters + "/lora-qv"}),
                       doctest::Contains("lora_id"), error);
  {
    adapter_copy dora{"lora-qv"};
    dora.set("use_dora", "true");
    refused({"dora", 2, dora.dir.string()}, "use_dora is set");
  }
  {
    adapter_copy bias{"lora-qv"};
    bias.set("bias", "\"all\"");
    refused({"bias", 2, bias.dir.string()}, "without biases");
  }
  {
    // A factor of a module troupe does not adapt, and a factor without its partner.
    adapter_copy odd{"lora-qv"};
    safetensors_writer w;
    float a[4 * 64] = {};
    w.add("base_model.model.lm_head.lora_A.weight", dtype::f32, {4, 64}, a, sizeof(a));
    w.write((odd.dir / "adapter_model.safetensors").string());
    refused({"odd", 2, odd.dir.string()},
            "'base_model.model.lm_head.lora_A.weight' is not a LoRA factor");
    safetensors_writer half;
    half.add("base_model.model.model.layers.1.mlp.up_proj.lora_A.weight", dtype::f32, {4, 64}, a,
             sizeof(a));
    half.write((odd.dir / "adapter_model.safetensors").string());
    refused({"odd", 2, odd.dir.string()}, "layer 1 up_proj has only its lora_A factor");
  }
  {
    // Factors for a different model: the shapes do not fit this one.
    adapter_copy other{"lora-qv"};
    safetensors_writer w;
    float a[4 * 48] = {};
    float b[64 * 4] = {};
    w.add("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", dtype::f32, {4, 48}, a,
          sizeof(a));
    w.add("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", dtype::f32, {64, 4}, b,
          sizeof(b));
    w.write((other.dir / "adapter_model.safetensors").string());
    refused({"other", 2, other.dir.string()}, "layer 0 q_proj factors are [64, 4] x [4, 48]");
  }
  CHECK_THROWS_WITH_AS(exec->add_prompt_adapter({"lora", 1, adapters + "/lora-qv", 0}),
                       doctest::Contains("not PROMPT_TUNING"), error);
  CHECK_THROWS_WITH_AS(exec->add_prompt_adapter({"p", 1, adapters + "/prompt-tuning", 5}),
                       doctest::Contains("has 4 virtual tokens, the request says 5"), error);
  CHECK(exec->list_prompt_adapters().empty());
}

TEST_CASE("a LoRA of a mixture's experts is refused, naming what it adapts") {
  const std::string model_dir = fixtures + "/qwen3-moe";
  const std::string dir = model_dir + "-adapters";
  cpu_device dev{0};
  llama_model model{load_model_config(model_dir), dev, 0, 1};
  model.load(checkpoint{model_dir});
  // peft's LoRA of transformers' merged expert parameters.
  CHECK_THROWS_WITH_AS(model.load_lora(dir + "/lora-experts", 16),
                       doctest::Contains("target_parameters [\"gate_up_proj\",\"down_proj\"]"),
                       error);
  // One of a sparse layer's MLP projection, as a dense model's adapter would be.
  adapter_copy mlp{"lora-attention", dir};
  safetensors_writer w;
  std::vector<float> a(4 * 64), b(96 * 4);
  w.add("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight", dtype::f32, {4, 64}, a.data(),
        a.size() * sizeof(float));
  w.add("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight", dtype::f32, {96, 4}, b.data(),
        b.size() * sizeof(float));
  w.write((mlp.dir / "adapter_model.safetensors").string());
  CHECK_THROWS_WITH_AS(model.load_lora(mlp.dir.string(), 16),
                       doctest::Contains("adapts up_proj of layer 0, whose MLP is a mixture of "
                                         "experts"),
                       error);
}

TEST_CASE("adapters take turns within their slots and keep their ids and outputs") {
  auto ref = reference();
  auto model = make_llm(1, 1);
  // Two prompt adapters (ids 1 and 2, the same files) with one slot: they take turns.
  std::vector<generation_request> reqs;
  for (int64_t id = 1; id <= 2; ++id) {
    generation_request r{"", prompt_of(ref, 2), greedy(16), {}};
    r.prompt_adapter = prompt_tuning(id);
    reqs.push_back(r);
  }
  for (auto& out : model->generate(reqs))
    CHECK(out.token_ids == greedy_of(ref, "prompt-tuning", 2));
  // An id keeps the adapter it was first used with.
  generation_request other{"", prompt_of(ref, 0), greedy(4), {}};
  other.lora = lora("lora-all", 1);
  model->generate({other});
  other.lora = lora("lora-qv", 1);
  CHECK_THROWS_WITH_AS(model->generate({other}), doctest::Contains("LoRA id 1 names"), error);
  // Pinning an evicted adapter loads it again.
  auto& exec = model->executor();
  CHECK(exec.add_lora(lora("lora-mlp", 2))); // evicts 1
  CHECK(exec.list_loras() == std::vector<int64_t>{2});
  CHECK(exec.pin_lora(1)); // 1 comes back and 2 goes
  CHECK(exec.list_loras() == std::vector<int64_t>{1});
}

TEST_CASE("a reload that fails for one adapter leaves no adapter with discarded weights") {
  auto ref = reference();
  auto exec = make_executor(1, 2);
  adapter_copy gone{"lora-all"};
  exec->add_lora({"gone", 1, gone.dir.string()});
  exec->add_lora(lora("lora-qv", 2));
  exec->sleep(2);
  exec->wake_up();
  fs::remove_all(gone.dir);
  CHECK_THROWS_WITH_AS(exec->collective_rpc("reload_weights"),
                       doctest::Contains("no adapter_config.json"), error);
  CHECK(exec->list_loras() == std::vector<int64_t>{2}); // the broken one is unloaded
  CHECK(first_token(*exec, prompt_of(ref, 1), 2) == greedy_of(ref, "lora-qv", 1)[0]);
}

TEST_CASE("adapters added before a worker's death are applied after its replacement, with "
          "peft's tokens") {
  auto ref = reference();
  llm_config cfg;
  cfg.worker.model_path = base_model;
  cfg.worker.kv_cache_memory_bytes = 2 << 20;
  cfg.worker.max_loras = 2;
  cfg.executor.tensor_parallel_size = 2;
  cfg.executor.block_size = 4;
  cfg.executor.restart.max_restarts = 1;
  llm model{cfg};
  auto& exec = model.executor();
  CHECK(exec.add_lora(lora("lora-all", 1)));
  CHECK(exec.add_lora(lora("lora-qv", 2)));
  CHECK(exec.pin_lora(1));
  CHECK(exec.remove_lora(2));
  CHECK(exec.add_prompt_adapter(prompt_tuning(7)));
  CHECK_THROWS_WITH_AS(troupe::testing::kill_rank(exec, 1), doctest::Contains("worker_replaced"),
                       error);
  // Every rank, the replacement included, holds what the others hold (a disagreement
  // would be an error).
  CHECK(exec.list_loras() == std::vector<int64_t>{1});
  CHECK(exec.list_prompt_adapters() == std::vector<int64_t>{7});
  CHECK(exec.worker_healths()[1].restarts == 1);
  std::vector<generation_request> reqs;
  for (size_t i = 0; i < ref["prompts"].size(); ++i) {
    generation_request with_lora{"", prompt_of(ref, i), greedy(16), {}};
    with_lora.lora = lora("lora-all", 1);
    reqs.push_back(with_lora);
    generation_request with_prompt{"", prompt_of(ref, i), greedy(16), {}};
    with_prompt.prompt_adapter = prompt_tuning(7);
    reqs.push_back(with_prompt);
  }
  auto outs = model.generate(reqs);
  for (size_t i = 0; i < ref["prompts"].size(); ++i) {
    CHECK(outs[2 * i].token_ids == greedy_of(ref, "lora-all", i));
    CHECK(outs[2 * i + 1].token_ids == greedy_of(ref, "prompt-tuning", i));
  }
}
