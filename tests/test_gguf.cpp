// GGUF loading against transformers reading the same files: llama-gqa written by
// scripts/make-reference-fixtures.py as F32, F16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, with
// llama.cpp's interleaved q/k rows; and a llama with rows of 256 that llama.cpp quantized to its
// k-quant mixes (scripts/make-kquant-fixtures.py).

#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cpu/quant_int8.hpp"
#include "model/checkpoint.hpp"
#include "tests/generation.hpp"
#include "tests/ranks.hpp"
#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/make_model.hpp"
#include "model/config.hpp"
#include "troupe/errors.hpp"
#include "troupe/executor.hpp"
#include "troupe/llm.hpp"
#include "troupe/model_worker.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <sys/stat.h>
#include <unistd.h>

using namespace troupe;

namespace {

const std::string dir = TROUPE_SOURCE_DIR "/tests/fixtures/llama-gqa-gguf";
const char* types[] = {"F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"};
const std::string k_dir = TROUPE_SOURCE_DIR "/tests/fixtures/llama-k-gguf";
const char* k_mixes[] = {"q4_k_m", "q5_k_m", "q6_k"};

std::string file_of(const std::string& type) {
  std::string lower = type;
  for (auto& c : lower)
    c = static_cast<char>(std::tolower(c));
  return dir + "/llama-gqa-" + lower + ".gguf";
}

nlohmann::json reference(const std::string& from = dir) {
  std::ifstream in{from + "/reference.json"};
  return nlohmann::json::parse(in);
}

/// The last position's logits of one prefill of `prompt`.
std::vector<float> prefill_logits(llama_model& model, device& dev, const model_config& cfg,
                                  const std::vector<int32_t>& prompt) {
  kv_cache cache{dev, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16, 4, 0};
  execute_model_request req;
  req.seq_group_metadata_list.push_back(
    {"r",
     true,
     {{0, prompt, static_cast<int32_t>(prompt.size()), 0, {0, 1, 2, 3}}},
     {},
     static_cast<int32_t>(prompt.size()),
     true,
     0,
     0});
  std::vector<sample_row> rows;
  return model.run_logits(req, cache, rows);
}

/// KL(p || q) of the softmax distributions of two logit vectors, in nats.
double kl_divergence(const std::vector<float>& p_logits, const std::vector<float>& q_logits) {
  auto log_softmax = [](const std::vector<float>& l) {
    double most = *std::max_element(l.begin(), l.end());
    double total = 0;
    for (float v : l)
      total += std::exp(v - most);
    std::vector<double> out(l.size());
    for (size_t i = 0; i < l.size(); ++i)
      out[i] = l[i] - most - std::log(total);
    return out;
  };
  auto lp = log_softmax(p_logits), lq = log_softmax(q_logits);
  double kl = 0;
  for (size_t i = 0; i < lp.size(); ++i)
    kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return kl;
}

/// Greedy generation through the engine on `path` (dtype auto: the stored types) with
/// `tensor_parallel_size` workers, a mixture's experts whole on each with `expert_parallel`:
/// the runs' prompts in one batch.
void check_greedy_runs(const std::string& path, const nlohmann::json& runs,
                       int32_t tensor_parallel_size = 1, bool expert_parallel = false) {
  llm_config cfg;
  cfg.executor.block_size = 4;
  cfg.executor.tensor_parallel_size = tensor_parallel_size;
  cfg.worker.model_path = path;
  cfg.worker.enable_expert_parallel = expert_parallel;
  cfg.worker.cpu_precision =
    cpu_precision_kind::exact; // transformers' numbers, whatever the format
  cfg.worker.kv_cache_memory_bytes = 4 << 20;
  llm engine{cfg};
  std::vector<generation_request> requests;
  for (auto& run : runs) {
    generation_request r;
    r.prompt_token_ids = run["token_ids"].get<std::vector<int32_t>>();
    r.sampling.temperature = 0.0f;
    r.sampling.max_tokens = 32;
    r.sampling.ignore_eos = true;
    requests.push_back(r);
  }
  auto outs = engine.generate(requests);
  REQUIRE(outs.size() == runs.size());
  for (size_t i = 0; i < outs.size(); ++i)
    CHECK_MESSAGE(outs[i].token_ids == runs[i]["greedy"].get<std::vector<int32_t>>(),
                  path << " prompt " << i);
}

/// Whether `bytes` are the checkpoint's tensor `t` as stored, its rows in Hugging Face's
/// order (GGUF's q and k rows are stored interleaved).
template <class Bytes>
bool same_as_stored(const Bytes& bytes, const tensor_view& t) {
  if (bytes.size() != t.bytes)
    return false;
  auto row = t.bytes / static_cast<size_t>(t.shape[0]);
  for (int64_t r = 0; r < t.shape[0]; ++r)
    if (std::memcmp(bytes.data() + static_cast<size_t>(r) * row, t.row(r, row), row) != 0)
      return false;
  return true;
}

std::string error_of(const std::string& path) {
  try {
    gguf_file f{path};
  } catch (const error& e) {
    return e.what();
  }
  return {};
}

} // namespace

TEST_CASE("the metadata gives the model's shape") {
  auto c = checkpoint::gguf_config(file_of("F32"));
  CHECK(c.architecture == "LlamaForCausalLM");
  CHECK(c.hidden_size == 64);
  CHECK(c.num_hidden_layers == 2);
  CHECK(c.num_attention_heads == 4);
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.intermediate_size == 160);
  CHECK(c.vocab_size == 256);
  CHECK(!c.tie_word_embeddings);
  CHECK(c.eos_token_ids == std::vector<int32_t>{2});
}

TEST_CASE("prefill logits of every tensor type match transformers on the same file, "
          "dequantized to float32 or computed as stored") {
  auto ref = reference();
  for (auto type : types)
    for (bool stored : {false, true}) {
      INFO(std::string{type} << (stored ? " as stored" : " as float32"));
      auto cfg = checkpoint::gguf_config(file_of(type));
      auto ckpt = checkpoint::from_gguf(file_of(type), cfg);
      cpu_device dev{0};
      llama_model model{cfg, dev, 0, 1, dtype::f32, stored};
      model.load(ckpt);
      if (stored)
        CHECK(model.tensors()[0].type == ckpt.at(model.tensors()[0].name).type);
      for (auto& run : ref[type]) {
        auto logits = prefill_logits(model, dev, cfg, run["token_ids"].get<std::vector<int32_t>>());
        auto want = run["last_logits"].get<std::vector<float>>();
        auto error = testing::relative_error(logits.data(), want);
        // The kernels for stored types sum the same dequantized values in another order.
        CHECK_MESSAGE(error < 1e-4, "relative error " << error);
      }
    }
}

namespace {

/// A family fixture's GGUF file against transformers on its weights: prefill logits exact
/// (1e-4; also split over 2, 3 and 4 ranks) and fast (1e-3 nats), and the greedy tokens.
void check_family_file(const std::string& path, const model_config& cfg,
                       const nlohmann::json& runs) {
  auto ckpt = checkpoint::from_gguf(path, cfg);
  for (int32_t world : {2, 3, 4}) {
    if (world > cfg.num_attention_heads)
      continue;
    INFO("tensor parallel size " << world);
    std::vector<std::vector<float>> logits(runs.size());
    testing::on_ranks(cfg, ckpt, world, false, [&](testing::model_runner& run, int32_t rank) {
      for (size_t i = 0; i < runs.size(); ++i) {
        run.seq.token_ids = runs[i]["token_ids"].get<std::vector<int32_t>>();
        run.seq.num_computed_tokens = 0;
        auto out = run.step(static_cast<int32_t>(run.seq.token_ids.size()));
        if (rank == 0)
          logits[i] = std::move(out);
      }
    });
    for (size_t i = 0; i < runs.size(); ++i) {
      auto error =
        testing::relative_error(logits[i].data(), runs[i]["last_logits"].get<std::vector<float>>());
      CHECK_MESSAGE(error < 1e-4, "prompt " << i << ": relative error " << error);
    }
  }
  for (bool fast : {false, true}) {
    INFO((fast ? "fast" : "exact"));
    cpu_device dev{0};
    llama_model model{cfg, dev, 0, 1, dtype::f32, true, fast};
    model.load(ckpt);
    for (auto& run : runs) {
      auto logits = prefill_logits(model, dev, cfg, run["token_ids"].get<std::vector<int32_t>>());
      auto want = run["last_logits"].get<std::vector<float>>();
      if (fast) {
        // Spec as for the other block formats: at most 1e-3 nats.
        CHECK(kl_divergence(want, logits) <= 1e-3);
      } else {
        auto error = testing::relative_error(logits.data(), want);
        CHECK_MESSAGE(error < 1e-4, "relative error " << error);
      }
    }
  }
  check_greedy_runs(path, runs);
}

/// Each GGUF copy (f32, q8_0) of the family fixtures `names` (`<name>-gguf/<name>-<type>.gguf`
/// beside the Hugging Face directory `<name>`): the file's config against config.json's
/// (`check(path, file_config, hf_config)`), then `check_family_file`.
template <class Check>
void check_family_files(std::initializer_list<const char*> names, Check check) {
  for (std::string name : names) {
    const std::string dir = TROUPE_SOURCE_DIR "/tests/fixtures/" + name + "-gguf";
    auto hf = load_model_config(TROUPE_SOURCE_DIR "/tests/fixtures/" + name);
    auto ref = reference(dir);
    for (auto type : {"f32", "q8_0"}) {
      INFO(name << " " << type);
      auto path = dir + "/" + name + "-" + type + ".gguf";
      auto cfg = checkpoint::gguf_config(path);
      CHECK(cfg.architecture == hf.architecture);
      check(path, cfg, hf);
      check_family_file(path, cfg, ref[type]);
    }
  }
}

} // namespace

TEST_CASE("Qwen3 files of llama.cpp's converter (per-head q and k norms, head_dim apart from "
          "the hidden size): transformers' logits and greedy tokens, exact and fast") {
  check_family_files(
    {"qwen3-norms"}, [](const std::string& path, const model_config& cfg, const model_config&) {
      CHECK(cfg.qk_norm);
      CHECK(cfg.head_dim == 32);
      CHECK(cfg.num_attention_heads * cfg.head_dim != cfg.hidden_size);
      CHECK(checkpoint::from_gguf(path, cfg).contains("model.layers.1.self_attn.k_norm.weight"));
    });
}

TEST_CASE("Mixtral and Qwen3-MoE files of llama.cpp's converter (experts merged into one "
          "tensor per projection, Mixtral as llama with experts): transformers' logits and "
          "greedy tokens, exact and fast") {
  check_family_files({"mixtral-experts", "qwen3-moe"},
                     [](const std::string& path, const model_config& cfg, const model_config& hf) {
                       CHECK(cfg.num_experts == hf.num_experts);
                       CHECK(cfg.num_experts_per_tok == hf.num_experts_per_tok);
                       CHECK(cfg.moe_intermediate_size == hf.moe_intermediate_size);
                       CHECK(cfg.norm_topk_prob);
                       auto ckpt = checkpoint::from_gguf(path, cfg);
                       CHECK(ckpt.contains(router_weight_name(cfg, 1)));
                       CHECK(
                         ckpt.at(expert_weight_name(cfg, 1, cfg.num_experts - 1, "down")).shape ==
                         std::vector<int64_t>{cfg.hidden_size, cfg.moe_intermediate_size});
                     });
  // Through the workers at tensor parallel size 2, the experts split or placed whole.
  for (std::string name : {"mixtral-experts", "qwen3-moe"}) {
    const std::string dir = TROUPE_SOURCE_DIR "/tests/fixtures/" + name + "-gguf";
    for (bool expert_parallel : {false, true}) {
      INFO(name << (expert_parallel ? " with expert parallelism" : " with experts split"));
      check_greedy_runs(dir + "/" + name + "-q8_0.gguf", reference(dir)["q8_0"], 2,
                        expert_parallel);
    }
  }
}

TEST_CASE("expert_load names each rank's experts and the tokens they took in the last step") {
  const std::string path = TROUPE_SOURCE_DIR "/tests/fixtures/qwen3-moe-gguf/qwen3-moe-q8_0.gguf";
  auto model = checkpoint::gguf_config(path);
  for (bool expert_parallel : {false, true}) {
    executor_config cfg;
    cfg.block_size = 4;
    cfg.tensor_parallel_size = 3;
    model_worker_options opts;
    opts.model_path = path;
    opts.kv_cache_memory_bytes = 4 << 20;
    opts.enable_expert_parallel = expert_parallel;
    executor exec{cfg, model_worker_factory(opts)};
    exec.initialize_cache(exec.determine_num_available_blocks());
    std::vector<int32_t> prompt{1, 15, 27, 99, 3};
    testing::greedy_tokens(exec, prompt, 1); // one step: the prompt
    auto loads = exec.collective_rpc("expert_load");
    REQUIRE(loads.size() == 3);
    int64_t next = 0;
    int64_t taken = 0;
    for (auto& m : loads) {
      auto first = m.get_as<int64_t>(0), count = m.get_as<int64_t>(1);
      auto tokens = m.get_as<int64_t>(2);
      if (expert_parallel) {
        // 8 experts in shares of 2 or 3, in rank order.
        CHECK(first == next);
        CHECK((count == 2 || count == 3));
        next += count;
        taken += tokens;
      } else {
        CHECK(first == 0);
        CHECK(count == model.num_experts);
        CHECK(tokens == 5 * model.num_experts_per_tok * model.num_hidden_layers);
      }
    }
    if (expert_parallel) {
      CHECK(next == model.num_experts);
      CHECK(taken == 5 * model.num_experts_per_tok * model.num_hidden_layers);
    }
  }
}

TEST_CASE("Phi-3 files of llama.cpp's converter (qkv and gate-up fused, LongRoPE's factors as "
          "tensors, a sliding window, Phi-4-mini's partial rotation): transformers' logits and "
          "greedy tokens, exact and fast") {
  check_family_files({"phi3-fused", "phi3-longrope", "phi4-partial"},
                     [](const std::string& path, const model_config& cfg, const model_config& hf) {
                       CHECK(cfg.sliding_window == hf.sliding_window);
                       CHECK(cfg.rotary_dim == hf.rotary_dim);
                       CHECK(cfg.rope_scaling.type == hf.rope_scaling.type);
                       CHECK(cfg.rope_scaling.original_max_position_embeddings ==
                             hf.rope_scaling.original_max_position_embeddings);
                       CHECK(cfg.rope_scaling.attention_factor ==
                             doctest::Approx(hf.rope_scaling.attention_factor));
                       CHECK(cfg.rope_scaling.long_factor == hf.rope_scaling.long_factor);
                       CHECK(cfg.rope_scaling.short_factor == hf.rope_scaling.short_factor);
                       auto ckpt = checkpoint::from_gguf(path, cfg);
                       CHECK(ckpt.contains("model.layers.1.self_attn.v_proj.weight"));
                       CHECK(ckpt.contains("model.layers.1.mlp.gate_proj.weight"));
                       CHECK_FALSE(ckpt.contains("model.layers.1.self_attn.qkv_proj.weight"));
                     });
}

TEST_CASE("Gemma 2 and 3 files of llama.cpp's converter (norms stored as 1 + w, soft-capping, "
          "sliding layers by llama.cpp's pattern, Gemma 3's local rope base): transformers' "
          "logits and greedy tokens, exact and fast") {
  // The file and llama.cpp's reading of it say what config.json says.
  check_family_files({"gemma2-standard", "gemma3-standard"},
                     [](const std::string&, const model_config& cfg, const model_config& hf) {
                       CHECK(cfg.sliding_window == hf.sliding_window);
                       CHECK(cfg.sliding_layers == hf.sliding_layers);
                       CHECK(cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar);
                       CHECK(cfg.local_rope_theta == hf.local_rope_theta);
                       CHECK(cfg.rope_scaling.type == hf.rope_scaling.type);
                       CHECK(cfg.attn_logit_softcapping == hf.attn_logit_softcapping);
                       CHECK(cfg.final_logit_softcapping == hf.final_logit_softcapping);
                       CHECK(cfg.qk_norm == hf.qk_norm);
                       CHECK(cfg.norm_weight_offset == 0);
                     });
}

TEST_CASE("llama.cpp's k-quant files (Q4_K, Q5_K, Q6_K): transformers' logits and greedy "
          "tokens, as stored and as float32") {
  auto ref = reference(k_dir);
  for (auto mix : k_mixes) {
    auto path = k_dir + "/llama-k-" + mix + ".gguf";
    auto cfg = checkpoint::gguf_config(path);
    auto ckpt = checkpoint::from_gguf(path, cfg);
    // The file holds the k-quants its name says (llama.cpp's mixes add Q6_K).
    std::set<std::string> held;
    for (auto& name : ckpt.names())
      held.insert(dtype_name(ckpt.at(name).type));
    for (auto& type : ref[mix]["tensor_types"])
      if (type != "F32")
        CHECK_MESSAGE(held.count(type.get<std::string>()) == 1, mix << " lacks " << type);
    for (bool stored : {false, true}) {
      INFO(std::string{mix} << (stored ? " as stored" : " as float32"));
      cpu_device dev{0};
      llama_model model{cfg, dev, 0, 1, dtype::f32, stored};
      model.load(ckpt);
      if (stored)
        for (auto& t : model.tensors())
          CHECK(t.type == ckpt.at(t.name).type);
      for (auto& run : ref[mix]["runs"]) {
        auto logits = prefill_logits(model, dev, cfg, run["token_ids"].get<std::vector<int32_t>>());
        auto want = run["last_logits"].get<std::vector<float>>();
        auto error = testing::relative_error(logits.data(), want);
        CHECK_MESSAGE(error < 1e-4, "relative error " << error);
      }
    }
    check_greedy_runs(path, ref[mix]["runs"]);
  }
}

TEST_CASE("the fast CPU path (8-bit activations) stays close to transformers' next-token "
          "distribution on Q8_0, Q4_0, Q4_1, Q4_K_M and Q6_K files") {
  // Spec: rounding the activations costs less than an 8-bit weight quantization does
  // (llama.cpp measures 1e-4 to 1e-3 nats of KL divergence for Q8_0 against 16-bit
  // weights on real models): at most 1e-3 nats against the same file computed exactly.
  struct file {
    std::string path;
    nlohmann::json runs;
  };
  auto gqa = reference();
  auto k = reference(k_dir);
  std::vector<file> files = {{file_of("Q8_0"), gqa["Q8_0"]},
                             {file_of("Q4_0"), gqa["Q4_0"]},
                             {file_of("Q4_1"), gqa["Q4_1"]},
                             {k_dir + "/llama-k-q4_k_m.gguf", k["q4_k_m"]["runs"]},
                             {k_dir + "/llama-k-q6_k.gguf", k["q6_k"]["runs"]}};
  if (!cpu::has_int8_kernel(dtype::q8_0))
    MESSAGE("this CPU has no AVX-512 VNNI: the fast path computes exactly here");
  int packed_tensors = 0;
  for (auto& f : files) {
    auto cfg = checkpoint::gguf_config(f.path);
    auto ckpt = checkpoint::from_gguf(f.path, cfg);
    cpu_device dev{0};
    llama_model model{cfg, dev, 0, 1, dtype::f32, true, true};
    model.load(ckpt);
    llama_model exact{cfg, dev, 0, 1, dtype::f32, true, false};
    exact.load(ckpt);
    // Block-format weights are packed for the integer GEMM; they still read back as stored.
    for (auto& t : model.tensors()) {
      CHECK(t.packed == (cpu::has_packed_layout(t.type) && t.shape[0] % 16 == 0));
      if (t.packed) {
        auto& stored = ckpt.at(t.name);
        auto bytes = model.download(t);
        REQUIRE(bytes.size() ==
                storage_bytes(t.type, static_cast<size_t>(t.shape[0] * t.shape[1])));
        CHECK(same_as_stored(bytes, stored));
        ++packed_tensors;
      }
    }
    for (auto& run : f.runs) {
      auto prompt = run["token_ids"].get<std::vector<int32_t>>();
      auto logits = prefill_logits(model, dev, cfg, prompt);
      // Where the CPU has the integer kernels, the fast path is taken (its logits differ).
      if (cpu::has_int8_kernel(dtype::q8_0))
        CHECK(logits != prefill_logits(exact, dev, cfg, prompt));
      auto want = run["last_logits"].get<std::vector<float>>();
      auto kl = kl_divergence(want, logits);
      INFO(f.path << ": KL divergence " << kl << ", relative error "
                  << testing::relative_error(logits.data(), want));
      CHECK(kl <= 1e-3);
      MESSAGE("KL divergence of the fast path, " << f.path << ": " << kl);
    }
  }
  if (cpu::has_packed_layout(dtype::q4_k))
    CHECK(packed_tensors > 0);
}

TEST_CASE("the fast CPU path on F16 weights: packed, read back as stored, and float32's "
          "logits up to the order of the sums") {
  auto path = file_of("F16");
  auto cfg = checkpoint::gguf_config(path);
  auto ckpt = checkpoint::from_gguf(path, cfg);
  cpu_device dev{0};
  llama_model fast{cfg, dev, 0, 1, dtype::f32, true, true};
  fast.load(ckpt);
  llama_model exact{cfg, dev, 0, 1, dtype::f32, true, false};
  exact.load(ckpt);
  int packed = 0;
  for (auto& t : fast.tensors())
    if (t.packed) {
      CHECK(t.type == dtype::f16);
      CHECK(same_as_stored(fast.download(t), ckpt.at(t.name)));
      ++packed;
    }
  if (!cpu::has_packed_layout(dtype::f16)) {
    MESSAGE("no AVX-512 VNNI on this CPU: F16 weights stay as stored on the fast path");
    CHECK(packed == 0);
    return;
  }
  CHECK(packed > 0);
  // The reference outlives the loop: a range over a member of a temporary would not.
  auto ref = reference();
  for (auto& run : ref["F16"]) {
    auto prompt = run["token_ids"].get<std::vector<int32_t>>();
    auto got = prefill_logits(fast, dev, cfg, prompt);
    auto want = prefill_logits(exact, dev, cfg, prompt);
    CHECK(testing::relative_error(got.data(), want) < 1e-5);
  }
}

TEST_CASE("the fast CPU path on BF16 weights: packed, read back as stored, and close to the "
          "exact path's next-token distribution") {
  // Spec: as for the block formats, at most 1e-3 nats; activations rounded to bfloat16.
  model_config c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 160;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.tie_word_embeddings = true;
  auto dir =
    (std::filesystem::temp_directory_path() / ("troupe-bf16-fast-" + std::to_string(::getpid())))
      .string();
  write_random_model(c, dir, dtype::bf16, 3);
  auto cfg = load_model_config(dir);
  checkpoint ckpt{dir};
  cpu_device dev{0};
  llama_model fast{cfg, dev, 0, 1, dtype::f32, true, true};
  fast.load(ckpt);
  llama_model exact{cfg, dev, 0, 1, dtype::f32, true, false};
  exact.load(ckpt);
  int packed = 0;
  for (auto& t : fast.tensors()) {
    CHECK(t.packed ==
          (cpu::has_packed_layout(dtype::bf16) && t.type == dtype::bf16 && t.shape.size() == 2));
    if (t.packed) {
      auto bytes = fast.download(t);
      CHECK(same_as_stored(bytes, ckpt.at(t.name)));
      ++packed;
    }
  }
  std::vector<int32_t> prompt{1, 17, 42, 99, 150, 3, 8};
  auto want = prefill_logits(exact, dev, cfg, prompt);
  auto got = prefill_logits(fast, dev, cfg, prompt);
  if (cpu::has_packed_layout(dtype::bf16)) {
    CHECK(packed > 0);
    CHECK(got != want);
  } else {
    MESSAGE("no AVX-512 BF16 on this CPU: the fast path computes exactly here");
  }
  auto kl = kl_divergence(want, got);
  CHECK(kl <= 1e-3);
  MESSAGE("KL divergence of the BF16 fast path against the exact one: " << kl);
  std::filesystem::remove_all(dir);
}

TEST_CASE("greedy generation from a GGUF file through the executor matches transformers") {
  auto ref = reference();
  for (auto type : types) // dtype auto: computed in the stored types
    check_greedy_runs(file_of(type), ref[type]);
}

TEST_CASE("the weight cache: a later load maps what the first packed and computes the same "
          "logits, and a changed model file or a broken cache file is packed again") {
  namespace fs = std::filesystem;
  auto root = fs::temp_directory_path() / ("troupe-weight-cache-" + std::to_string(getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  auto model_path = (root / "model.gguf").string();
  fs::copy_file(k_dir + "/llama-k-q4_k_m.gguf", model_path);
  auto cache_dir = (root / "cache").string();
  auto cfg = checkpoint::gguf_config(model_path);
  const std::vector<int32_t> prompt{1, 17, 42, 99, 150, 3, 8};
  cpu_device dev{0};
  auto cache_files = [&] {
    std::vector<fs::path> out;
    if (fs::exists(cache_dir))
      for (auto& e : fs::directory_iterator(cache_dir))
        out.push_back(e.path());
    std::sort(out.begin(), out.end());
    return out;
  };
  auto inode = [](const fs::path& p) {
    struct stat st {};
    REQUIRE(::stat(p.c_str(), &st) == 0);
    return st.st_ino;
  };
  for (bool fast : {false, true}) {
    INFO((fast ? "fast" : "exact"));
    auto ckpt = checkpoint::from_gguf(model_path, cfg);
    llama_model plain{cfg, dev, 0, 1, dtype::f32, true, fast};
    plain.load(ckpt);
    auto want = prefill_logits(plain, dev, cfg, prompt);
    auto before = cache_files().size();
    auto loaded = [&] {
      auto m = std::make_unique<llama_model>(cfg, dev, 0, 1, dtype::f32, true, fast);
      m->use_weight_cache(cache_dir);
      m->load(checkpoint::from_gguf(model_path, cfg));
      return m;
    };
    auto first = loaded();
    CHECK(prefill_logits(*first, dev, cfg, prompt) == want);
    auto files = cache_files();
    REQUIRE(files.size() == before + 1); // one file per layout: exact and fast differ
    std::map<fs::path, ino_t> inodes;
    for (auto& f : files)
      inodes[f] = inode(f);
    // Found, not rewritten: every file keeps its inode, and the logits are the same.
    auto second = loaded();
    CHECK(prefill_logits(*second, dev, cfg, prompt) == want);
    for (auto& f : cache_files())
      CHECK(inode(f) == inodes[f]);
    // The weights sleep and wake as any: level 1 keeps them, level 2 needs a reload.
    dev.sleep(sleep_level::offload_weights);
    dev.wake_up({});
    CHECK(prefill_logits(*second, dev, cfg, prompt) == want);
    dev.sleep(sleep_level::discard);
    dev.wake_up({});
    second->load(checkpoint::from_gguf(model_path, cfg));
    CHECK(prefill_logits(*second, dev, cfg, prompt) == want);
  }
  auto files = cache_files();
  REQUIRE(files.size() == 2);
  std::map<fs::path, ino_t> inodes;
  for (auto& f : files)
    inodes[f] = inode(f);
  // A model file changed since (its time, here): the next load packs it again, and the new
  // file takes the old one's place.
  fs::last_write_time(model_path, fs::last_write_time(model_path) + std::chrono::seconds(1));
  auto ckpt = checkpoint::from_gguf(model_path, cfg);
  llama_model plain{cfg, dev, 0, 1, dtype::f32, true, true};
  plain.load(ckpt);
  auto want = prefill_logits(plain, dev, cfg, prompt);
  {
    llama_model again{cfg, dev, 0, 1, dtype::f32, true, true};
    again.use_weight_cache(cache_dir);
    again.load(ckpt);
    CHECK(prefill_logits(again, dev, cfg, prompt) == want);
  }
  CHECK(cache_files() == files);
  int rewritten = 0;
  for (auto& f : files)
    rewritten += inode(f) != inodes[f];
  CHECK(rewritten == 1);
  // A cache file cut short is not used, and is written again whole.
  std::map<fs::path, uintmax_t> sizes;
  for (auto& f : files) {
    sizes[f] = fs::file_size(f);
    fs::resize_file(f, sizes[f] / 2);
  }
  {
    llama_model again{cfg, dev, 0, 1, dtype::f32, true, true};
    again.use_weight_cache(cache_dir);
    again.load(ckpt);
    CHECK(prefill_logits(again, dev, cfg, prompt) == want);
  }
  int whole = 0;
  for (auto& f : files)
    whole += fs::file_size(f) == sizes[f];
  CHECK(whole == 1); // the fast path's file; the exact one stays short until it is loaded
  // A directory that cannot be made costs the cache, not the load.
  {
    llama_model again{cfg, dev, 0, 1, dtype::f32, true, true};
    again.use_weight_cache(model_path + "/cache");
    again.load(ckpt);
    CHECK(prefill_logits(again, dev, cfg, prompt) == want);
  }
  // Each rank of a split model has its own file.
  for (int32_t rank = 0; rank < 2; ++rank) {
    llama_model part{cfg, dev, rank, 2, dtype::f32, true, true};
    part.use_weight_cache(cache_dir);
    part.load(ckpt);
  }
  CHECK(cache_files().size() == 4);
  fs::remove_all(root);
}

/// The file `p` is mapped from, as /proc/self/maps says; empty for memory that is no file's.
std::string mapped_from(const void* p) {
  std::ifstream maps{"/proc/self/maps"};
  auto at = reinterpret_cast<uintptr_t>(p);
  for (std::string line; std::getline(maps, line);) {
    std::istringstream in{line}; // begin-end perms offset device inode path
    std::string range, perms, offset, device, inode, path;
    in >> range >> perms >> offset >> device >> inode;
    std::getline(in >> std::ws, path);
    auto dash = range.find('-');
    if (at >= std::stoull(range.substr(0, dash), nullptr, 16) &&
        at < std::stoull(range.substr(dash + 1), nullptr, 16))
      return path;
  }
  return "";
}

TEST_CASE("weights kept as stored are used from the file's pages, not copied, and what an "
          "update writes or a sleep drops stays in the process") {
  namespace fs = std::filesystem;
  auto path =
    (fs::temp_directory_path() / ("troupe-in-place-" + std::to_string(getpid()) + ".gguf"))
      .string();
  const std::vector<int32_t> prompt{1, 17, 42, 99, 150, 3, 8};
  auto bytes_of = [](const std::string& p) {
    std::ifstream in{p, std::ios::binary};
    return std::string{std::istreambuf_iterator<char>{in}, {}};
  };
  for (auto type : {"F16", "Q8_0", "Q4_0"}) {
    CAPTURE(type);
    fs::copy_file(file_of(type), path, fs::copy_options::overwrite_existing);
    auto on_disk = bytes_of(path);
    auto cfg = checkpoint::gguf_config(path);
    cpu_device dev{0};
    llama_model model{cfg, dev, 0, 1, dtype::f32, true};
    model.load(checkpoint::from_gguf(path, cfg));
    auto held = [&](const std::string& name) {
      for (auto& t : model.tensors())
        if (t.name == name)
          return t.data;
      FAIL("no tensor " << name);
      return static_cast<const void*>(nullptr);
    };
    const std::string down = "model.layers.0.mlp.down_proj.weight";
    const std::string q = "model.layers.0.self_attn.q_proj.weight";
    // The down projection is the file's, and so is q, whose rows the file keeps in
    // llama.cpp's order (a head's rotated entries in neighbouring pairs): read back, they
    // come in Hugging Face's.
    CHECK(mapped_from(held(down)) == path);
    CHECK(mapped_from(held(q)) == path);
    auto ckpt = checkpoint::from_gguf(path, cfg);
    for (auto& t : model.tensors())
      if (t.name == q)
        CHECK(same_as_stored(model.download(t), ckpt.at(q)));
    auto want = prefill_logits(model, dev, cfg, prompt);
    {
      // Layer 1's q written over layer 0's, once as the file's view and once as plain bytes
      // in Hugging Face's order (as a trainer sends them): the same logits.
      auto file_order = ckpt.at("model.layers.1.self_attn.q_proj.weight");
      file_order.name = q;
      auto row = file_order.bytes / static_cast<size_t>(file_order.shape[0]);
      std::string hf_rows;
      for (int64_t r = 0; r < file_order.shape[0]; ++r)
        hf_rows.append(reinterpret_cast<const char*>(file_order.row(r, row)), row);
      auto hf_order = file_order;
      hf_order.row_order.clear();
      hf_order.data = reinterpret_cast<const std::byte*>(hf_rows.data());
      llama_model a{cfg, dev, 0, 1, dtype::f32, true};
      a.load(ckpt);
      a.update(checkpoint::from_tensors("file order", {file_order}, cfg), {});
      llama_model b{cfg, dev, 0, 1, dtype::f32, true};
      b.load(ckpt);
      b.update(checkpoint::from_tensors("Hugging Face order", {hf_order}, cfg), {});
      auto logits = prefill_logits(a, dev, cfg, prompt);
      CHECK(logits != want);
      CHECK(prefill_logits(b, dev, cfg, prompt) == logits);
      for (auto& t : b.tensors())
        if (t.name == q)
          CHECK(same_as_stored(b.download(t), file_order));
    }
    // An update writes layer 1's down projection over layer 0's: the logits change, the
    // file does not, and a new load reads the file's.
    auto other = ckpt.at("model.layers.1.mlp.down_proj.weight");
    other.name = down;
    model.update(checkpoint::from_tensors("update", {other}, cfg), {});
    auto updated = prefill_logits(model, dev, cfg, prompt);
    CHECK(updated != want);
    CHECK(bytes_of(path) == on_disk);
    {
      llama_model again{cfg, dev, 0, 1, dtype::f32, true};
      again.load(ckpt);
      CHECK(prefill_logits(again, dev, cfg, prompt) == want);
    }
    // Level 1 keeps the updated weights; level 2 drops them, and a reload maps the file again.
    dev.sleep(sleep_level::offload_weights);
    dev.wake_up({});
    CHECK(prefill_logits(model, dev, cfg, prompt) == updated);
    dev.sleep(sleep_level::discard);
    dev.wake_up({});
    model.load(ckpt);
    CHECK(mapped_from(held(down)) == path);
    CHECK(prefill_logits(model, dev, cfg, prompt) == want);
  }
  fs::remove(path);
}

TEST_CASE("broken GGUF files are errors naming the file and the tensor") {
  auto path =
    (std::filesystem::temp_directory_path() / ("troupe-gguf-" + std::to_string(getpid()))).string();
  std::ifstream in{file_of("Q8_0"), std::ios::binary};
  std::string whole{std::istreambuf_iterator<char>{in}, {}};
  auto write = [&](const std::string& bytes) {
    std::ofstream out{path, std::ios::binary};
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  write("GGML" + whole.substr(4));
  CHECK(error_of(path).find("bad magic") != std::string::npos);
  write(whole.substr(0, whole.size() - 100));
  auto truncated = error_of(path);
  CHECK(truncated.find("past the end") != std::string::npos);
  CHECK(truncated.find("tensor '") != std::string::npos);
  CHECK(truncated.find(path) != std::string::npos);
  write(whole.substr(0, 200));
  CHECK(error_of(path).find("truncated") != std::string::npos);
  std::filesystem::remove(path);
  CHECK(error_of("/nonexistent.gguf").find("/nonexistent.gguf") != std::string::npos);
  CHECK(hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight");
  CHECK(hf_tensor_name("rope_freqs.weight").empty());
}

TEST_CASE("a weight kept as stored whose block scale is NaN or infinite is refused, naming "
          "the tensor and the element") {
  auto path =
    (std::filesystem::temp_directory_path() / ("troupe-nan-" + std::to_string(getpid()) + ".gguf"))
      .string();
  for (auto type : {"Q4_0", "Q8_0"})
    for (uint16_t scale : {uint16_t{0x7e00}, uint16_t{0x7c00}}) { // NaN, infinity
      CAPTURE(type);
      CAPTURE(scale);
      std::string whole;
      size_t at = 0;
      {
        gguf_file f{file_of(type)};
        for (auto& t : f.tensors())
          if (t.name == "blk.1.ffn_down.weight")
            at = static_cast<size_t>(f.data(t) - f.file().data());
        REQUIRE(at > 0);
        std::ifstream in{file_of(type), std::ios::binary};
        whole.assign(std::istreambuf_iterator<char>{in}, {});
      }
      // The third block's scale.
      size_t block = std::string{type} == "Q4_0" ? 18 : 34;
      std::memcpy(&whole[at + 2 * block], &scale, sizeof scale);
      {
        std::ofstream out{path, std::ios::binary};
        out.write(whole.data(), static_cast<std::streamsize>(whole.size()));
      }
      auto cfg = checkpoint::gguf_config(path);
      auto ckpt = checkpoint::from_gguf(path, cfg);
      cpu_device dev{0};
      llama_model model{cfg, dev, 0, 1, dtype::f32, true};
      CHECK_THROWS_WITH_AS(model.load(ckpt),
                           doctest::Contains("tensor 'model.layers.1.mlp.down_proj.weight' holds "
                                             "NaN or an infinity (element 64 "),
                           error);
    }
  std::filesystem::remove(path);
}

namespace {

/// A minimal GGUF file: the given metadata (already encoded) and tensor infos.
std::string gguf_bytes(uint64_t tensors, uint64_t kvs, const std::string& body) {
  std::string out = "GGUF";
  auto put = [&](auto v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(uint32_t{3});
  put(tensors);
  put(kvs);
  return out + body;
}

std::string gguf_string(const std::string& s) {
  std::string out;
  uint64_t n = s.size();
  out.append(reinterpret_cast<const char*>(&n), 8);
  return out + s;
}

template <class T>
std::string raw(T v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof v);
}

} // namespace

TEST_CASE("hostile GGUF headers are refused without crashing") {
  auto path =
    (std::filesystem::temp_directory_path() / ("troupe-gguf-h-" + std::to_string(getpid())))
      .string();
  auto write = [&](const std::string& bytes) {
    std::ofstream out{path, std::ios::binary};
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
  };
  // Nested arrays.
  write(
    gguf_bytes(0, 1, gguf_string("k") + raw(uint32_t{9}) + raw(uint32_t{9}) + raw(uint64_t{1})));
  CHECK(error_of(path).find("nested") != std::string::npos);
  // An array longer than the file.
  write(gguf_bytes(
    0, 1, gguf_string("k") + raw(uint32_t{9}) + raw(uint32_t{4}) + raw(uint64_t{1} << 60)));
  CHECK(error_of(path).find("truncated") != std::string::npos);
  // Dimensions whose product overflows.
  write(gguf_bytes(1, 0,
                   gguf_string("blk.0.attn_q.weight") + raw(uint32_t{2}) + raw(uint64_t{1} << 32) +
                     raw(uint64_t{1} << 32) + raw(uint32_t{0}) + raw(uint64_t{0})));
  CHECK(error_of(path).find("impossible size") != std::string::npos);
  // No attention heads.
  auto md = gguf_string("general.architecture") + raw(uint32_t{8}) + gguf_string("llama") +
            gguf_string("llama.embedding_length") + raw(uint32_t{4}) + raw(uint32_t{64}) +
            gguf_string("llama.block_count") + raw(uint32_t{4}) + raw(uint32_t{1}) +
            gguf_string("llama.feed_forward_length") + raw(uint32_t{4}) + raw(uint32_t{64}) +
            gguf_string("llama.attention.head_count") + raw(uint32_t{4}) + raw(uint32_t{0}) +
            gguf_string("llama.vocab_size") + raw(uint32_t{4}) + raw(uint32_t{16});
  write(gguf_bytes(0, 6, md));
  CHECK_THROWS_WITH_AS(checkpoint::gguf_config(path), doctest::Contains("attention heads"), error);
  // One F32 tensor of 8 values at `offset`, with 64 bytes of data after the header's padding.
  auto one_tensor = [&](uint64_t offset) {
    auto bytes = gguf_bytes(1, 0,
                            gguf_string("blk.0.attn_q.weight") + raw(uint32_t{1}) +
                              raw(uint64_t{8}) + raw(uint32_t{0}) + raw(offset));
    bytes.resize((bytes.size() + 31) / 32 * 32 + 64, '\0');
    return bytes;
  };
  write(one_tensor(0));
  CHECK(error_of(path).empty());
  // An offset that wraps around when added to the data's start.
  write(one_tensor(~uint64_t{0} - 15));
  CHECK(error_of(path).find("past the end of the file") != std::string::npos);
  // An offset the format's alignment (32 by default) does not allow.
  write(one_tensor(4));
  CHECK(error_of(path).find("is not a multiple of general.alignment 32") != std::string::npos);
  // A tensor no Llama-family model has.
  auto mystery = gguf_bytes(1, 0,
                            gguf_string("mystery.weight") + raw(uint32_t{1}) + raw(uint64_t{8}) +
                              raw(uint32_t{0}) + raw(uint64_t{0}));
  mystery.resize((mystery.size() + 31) / 32 * 32 + 64, '\0');
  write(mystery);
  CHECK_THROWS_WITH_AS(
    checkpoint::from_gguf(path, load_model_config(TROUPE_SOURCE_DIR "/tests/fixtures/llama-gqa")),
    doctest::Contains("tensor 'mystery.weight' has no place"), error);
  std::filesystem::remove(path);
}
