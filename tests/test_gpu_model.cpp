// The decoder on a GPU (label gpu; run by scripts/gpu-check.sh): transformers' logits and
// greedy tokens on the tiny fixtures, the CPU's on SmolLM2-135M, a model worker whose
// KV cache follows gpu_memory_utilization and whose sleep gives the memory back, and
// weights updated in place in GPU memory.

#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cuda/cuda_device.hpp"
#include "model/checkpoint.hpp"
#include "model/config.hpp"
#include "model/llama.hpp"
#include "model/make_model.hpp"
#include "tests/generation.hpp"
#include "tests/model_runner.hpp"
#include "tests/gpu.hpp"
#include "tests/weight_updates.hpp"
#include "troupe/errors.hpp"
#include "troupe/executor.hpp"
#include "troupe/llm.hpp"
#include "troupe/model_worker.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>

#include <unistd.h>

using namespace troupe;
using troupe::testing::have_gpu;
using troupe::testing::model_runner;
using troupe::testing::read_json;
using troupe::testing::relative_error;

namespace {

const std::string fixtures = testing::source_dir() + "/tests/fixtures";

/// The prompt's logits (into `prompt_logits`), then `steps` greedy tokens chosen on the
/// device.
std::vector<int32_t> generate(testing::model_runner& r, const std::vector<int32_t>& prompt,
                              int steps, std::vector<float>* prompt_logits = nullptr) {
  r.seq.token_ids = prompt;
  r.seq.num_computed_tokens = 0;
  auto logits = r.step(static_cast<int32_t>(prompt.size()));
  if (prompt_logits)
    *prompt_logits = logits;
  std::vector<int32_t> out;
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::vector<int32_t> ranks;
  for (int i = 0; i < steps; ++i) {
    r.model.sample(std::vector<row_sampling>(1), ids, logprobs, ranks);
    out.push_back(ids[0]);
    r.seq.token_ids.push_back(ids[0]);
    if (i + 1 < steps)
      r.step(1);
  }
  return out;
}

/// The first prompt of the llama-gqa fixture, its greedy tokens, and worker options for it.
struct llama_gqa_case {
  std::vector<int32_t> prompt;
  std::vector<int32_t> greedy;
  model_worker_options options;

  llama_gqa_case() {
    auto path = fixtures + "/llama-gqa";
    auto ref = read_json(path + "/reference.json")["prompts"][0];
    prompt = ref["token_ids"].get<std::vector<int32_t>>();
    greedy = ref["greedy"].get<std::vector<int32_t>>();
    options.model_path = path;
    options.dtype = "float32";
    options.kv_cache_memory_bytes = 64 << 20;
  }
};

/// Bytes resident on the workers' devices, over all tags.
int64_t resident_bytes(executor& exec) {
  int64_t total = 0;
  for (auto& m : exec.collective_rpc([](worker&w, const caf::message&, const caf::settings&) {
         int64_t bytes = 0;
         for (auto& u : w.device().usage())
           bytes += u.resident_bytes;
         return caf::make_message(bytes);
       }))
    total += m.get_as<int64_t>(0);
  return total;
}

} // namespace

TEST_CASE("tiny models on the GPU: transformers' logits and tokens in float32, close in bf16") {
  if (!have_gpu())
    return;
  cuda_device dev{0};
  double worst_f32 = 0;
  double worst_bf16 = 0;
  for (auto& name : testing::fixture_models) {
    auto cfg = load_model_config(fixtures + "/" + name);
    checkpoint ckpt{fixtures + "/" + name};
    auto ref = read_json(fixtures + "/" + name + "/reference.json");
    for (auto& prompt : ref["prompts"]) {
      auto ids = prompt["token_ids"].get<std::vector<int32_t>>();
      auto want = prompt["last_logits"].get<std::vector<float>>();
      model_runner f32{dev, cfg, ckpt, dtype::f32, 16};
      std::vector<float> logits;
      auto tokens = generate(f32, ids, 32, &logits);
      REQUIRE(logits.size() == want.size());
      auto err = relative_error(logits.data(), want);
      worst_f32 = std::max(worst_f32, err);
      CHECK_MESSAGE(err < 1e-4, name << " float32: relative error " << err);
      CHECK_MESSAGE(tokens == prompt["greedy"].get<std::vector<int32_t>>(), name);

      model_runner bf16{dev, cfg, ckpt, dtype::bf16, 16};
      generate(bf16, ids, 1, &logits);
      err = relative_error(logits.data(), want);
      worst_bf16 = std::max(worst_bf16, err);
      CHECK_MESSAGE(err < 3e-2, name << " bfloat16: relative error " << err);
    }
    // Decoding token by token through the paged cache, against every position.
    auto& prompt = ref["prompts"][0];
    model_runner r{dev, cfg, ckpt, dtype::f32, 16};
    r.seq.token_ids = prompt["token_ids"].get<std::vector<int32_t>>();
    auto all = prompt["all_logits"].get<std::vector<std::vector<float>>>();
    for (size_t p = 0; p < all.size(); ++p) {
      auto logits = r.step(1);
      auto err = relative_error(logits.data(), all[p]);
      CHECK_MESSAGE(err < 1e-4, name << " position " << p << ": relative error " << err);
    }
  }
  MESSAGE("tiny models, prefill logits against transformers: float32 " << worst_f32 << ", bfloat16 "
                                                                       << worst_bf16);
}

TEST_CASE("SmolLM2-135M on the GPU: the CPU's greedy tokens, logits within bf16 tolerance") {
  if (!have_gpu())
    return;
  auto path = testing::smollm2_or_skip();
  if (path.empty())
    return;
  auto cfg = checkpoint::config_of(path.string());
  auto ckpt = checkpoint::from_gguf(path.string(), cfg);
  cpu_device host{0};
  cuda_device dev{0};
  model_runner cpu{host, cfg, ckpt, dtype::f32, 16};
  model_runner f32{dev, cfg, ckpt, dtype::f32, 16};
  model_runner bf16{dev, cfg, ckpt, dtype::bf16, 16};
  double worst_f32 = 0;
  double worst_bf16 = 0;
  size_t same_bf16 = 0;
  size_t count = 0;
  // Kept in a variable: a range over a temporary's member outlives the temporary.
  auto reference = read_json(fixtures + "/smollm2-reference.json");
  for (auto& run : reference["runs"]) {
    auto ids = run["token_ids"].get<std::vector<int32_t>>();
    auto want_tokens = run["greedy"].get<std::vector<int32_t>>();
    auto steps = static_cast<int>(want_tokens.size());
    std::vector<float> want;
    auto cpu_tokens = generate(cpu, ids, steps, &want);
    CHECK(cpu_tokens == want_tokens);
    std::vector<float> logits;
    CHECK(generate(f32, ids, steps, &logits) == cpu_tokens);
    worst_f32 = std::max(worst_f32, relative_error(logits.data(), want));
    auto tokens = generate(bf16, ids, steps, &logits);
    worst_bf16 = std::max(worst_bf16, relative_error(logits.data(), want));
    CHECK(tokens[0] == cpu_tokens[0]);
    // bf16 may part ways with float32 where two tokens are nearly tied; count how far the
    // tokens agree.
    size_t agree = 0;
    while (agree < tokens.size() && tokens[agree] == cpu_tokens[agree])
      ++agree;
    same_bf16 += agree;
    count += tokens.size();
  }
  CHECK(worst_f32 < 1e-4);
  CHECK(worst_bf16 < 5e-2);
  MESSAGE("SmolLM2 prefill logits against the CPU: float32 "
          << worst_f32 << ", bfloat16 " << worst_bf16 << "; bfloat16 greedy " << same_bf16 << "/"
          << count << " tokens before parting");
}

TEST_CASE("a model worker on the GPU: gpu_memory_utilization, sleep gives the memory back") {
  if (!have_gpu())
    return;
  auto dir =
    std::filesystem::temp_directory_path() / ("troupe-gpu-smollm2-" + std::to_string(::getpid()));
  write_random_model(smollm2_135m_config(), dir.string(), dtype::bf16, 7);
  executor_config cfg;
  cfg.device_type = device_kind::cuda;
  cfg.max_model_len = 512;
  model_worker_options mw;
  mw.model_path = dir.string();
  mw.gpu_memory_utilization = 0.3;
  mw.max_num_batched_tokens = 512;
  mw.max_num_seqs = 8;
  {
    executor exec{cfg, model_worker_factory(mw)};
    auto blocks = exec.determine_num_available_blocks();
    exec.initialize_cache(blocks);
    size_t free_bytes = 0;
    size_t total = 0;
    cudaSetDevice(0);
    cudaMemGetInfo(&free_bytes, &total);
    auto used = 1.0 - static_cast<double>(free_bytes) / static_cast<double>(total);
    MESSAGE(blocks.num_device_blocks << " KV blocks; the GPU is " << used * 100
                                     << " % used for gpu_memory_utilization 0.3");
    CHECK(std::fabs(used - 0.3) < 0.02);

    std::vector<int32_t> prompt;
    for (int32_t i = 0; i < 20; ++i)
      prompt.push_back(100 + 37 * i);
    auto before = testing::greedy_tokens(exec, prompt, 16);
    for (int level : {1, 2}) {
      auto resident = resident_bytes(exec);
      auto awake = testing::gpu_free_bytes();
      exec.sleep(level);
      auto asleep = testing::gpu_free_bytes();
      auto returned = static_cast<double>(asleep - awake) / static_cast<double>(resident);
      MESSAGE("sleep(" << level << ") returned " << returned * 100 << " % of " << resident
                       << " resident bytes to the GPU");
      CHECK(returned >= 0.95);
      exec.wake_up();
      if (level == 2)
        exec.collective_rpc("reload_weights");
      CHECK_MESSAGE(testing::greedy_tokens(exec, prompt, 16) == before, "after sleep " << level);
    }
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("the executor on the GPU: greedy tokens and logprobs as on the CPU") {
  if (!have_gpu())
    return;
  llama_gqa_case c;
  // A step asking for top logprobs samples on the host from the downloaded logits; compare
  // those logprobs with the CPU's.
  auto logprobs_of = [&](const std::string& kind) {
    executor_config cfg;
    cfg.device_type = parse_device_kind(kind);
    executor exec{cfg, model_worker_factory(c.options)};
    exec.initialize_cache(exec.determine_num_available_blocks());
    CHECK(testing::greedy_tokens(exec, c.prompt, c.greedy.size()) == c.greedy);
    execute_model_request req;
    sequence_group_metadata g;
    g.request_id = "p";
    g.is_prompt = true;
    g.seqs.push_back({0, c.prompt, static_cast<int32_t>(c.prompt.size()), 0, {0, 1, 2, 3}});
    g.token_chunk_size = static_cast<int32_t>(c.prompt.size());
    g.sampling.temperature = 0.0f;
    g.sampling.logprobs = 3;
    req.seq_group_metadata_list.push_back(g);
    return exec.execute_model(req)[0].outputs[0].samples[0];
  };
  auto gpu = logprobs_of("cuda");
  auto cpu = logprobs_of("cpu");
  CHECK(gpu.output_token == cpu.output_token);
  CHECK(std::fabs(gpu.logprob - cpu.logprob) < 1e-4);
  REQUIRE(gpu.top_logprobs.size() == cpu.top_logprobs.size());
  for (size_t i = 0; i < cpu.top_logprobs.size(); ++i)
    CHECK(std::fabs(gpu.top_logprobs[i].logprob - cpu.top_logprobs[i].logprob) < 1e-4);
}

TEST_CASE("tensor parallelism over GPUs with NCCL gives the tokens of one GPU") {
  if (!have_gpu())
    return;
  if (cuda_device::count() < 2)
    return testing::skip("one GPU visible; tensor parallelism over NCCL needs a GPU per rank");
  llama_gqa_case c;
  executor_config cfg;
  cfg.device_type = device_kind::cuda;
  cfg.tensor_parallel_size = 2;
  executor exec{cfg, model_worker_factory(c.options)};
  exec.initialize_cache(exec.determine_num_available_blocks());
  CHECK(testing::greedy_tokens(exec, c.prompt, c.greedy.size()) == c.greedy);
}

namespace {

/// The token ids `requests` generate through `troupe::llm` with a fixture model in float32
/// on `device`.
std::vector<std::vector<int32_t>> generated(const std::string& name, const std::string& device,
                                            bool eager,
                                            const std::vector<generation_request>& requests) {
  llm_config cfg;
  cfg.worker.model_path = fixtures + "/" + name;
  cfg.executor.device_type = parse_device_kind(device);
  cfg.worker.dtype = "float32";
  cfg.worker.enforce_eager = eager;
  cfg.worker.kv_cache_memory_bytes = 16 << 20;
  llm model{cfg};
  std::vector<std::vector<int32_t>> out;
  for (auto& o : model.generate(requests))
    out.push_back(o.token_ids);
  return out;
}

} // namespace

TEST_CASE("batched decode replayed from CUDA graphs gives transformers' tokens, as eager steps") {
  if (!have_gpu())
    return;
  for (std::string name : {"qwen2-bias", "llama-gqa"}) {
    auto ref = read_json(fixtures + "/" + name + "/reference.json");
    std::vector<generation_request> reqs;
    for (auto& p : ref["prompts"])
      reqs.push_back({"", p["token_ids"].get<std::vector<int32_t>>(), testing::greedy(32), {}});
    for (bool eager : {false, true}) {
      auto outs = generated(name, "cuda", eager, reqs);
      REQUIRE(outs.size() == reqs.size());
      for (size_t i = 0; i < outs.size(); ++i)
        CHECK_MESSAGE(outs[i] == ref["prompts"][i]["greedy"].get<std::vector<int32_t>>(),
                      name << (eager ? " eager" : " graphs") << " prompt " << i);
    }
  }
}

TEST_CASE("seeded sampling on the GPU draws the tokens the CPU draws") {
  if (!have_gpu())
    return;
  auto ref = read_json(fixtures + "/llama-gqa/reference.json");
  std::vector<generation_request> reqs;
  for (auto& p : ref["prompts"]) {
    generation_request r{"", p["token_ids"].get<std::vector<int32_t>>(), testing::greedy(24), {}};
    r.sampling.temperature = 0.8f;
    r.sampling.top_k = 40;
    r.sampling.top_p = 0.9f;
    r.sampling.seed = 1234;
    reqs.push_back(r);
  }
  auto plain = generated("llama-gqa", "cuda", false, reqs);
  CHECK(plain == generated("llama-gqa", "cpu", false, reqs));
  // The logits processors, applied on the device that samples: penalties over prompt and
  // output, logit_bias, min_p, min_tokens and a banned pair of tokens; greedy and seeded.
  auto edited = reqs;
  for (size_t i = 0; i < edited.size(); ++i) {
    auto& p = edited[i].sampling;
    auto greedy = ref["prompts"][i]["greedy"].get<std::vector<int32_t>>();
    if (i % 2 == 1)
      p.temperature = 0.0f;
    p.repetition_penalty = 1.3f;
    p.presence_penalty = 0.4f;
    p.frequency_penalty = 0.5f;
    p.min_p = 0.05f;
    p.min_tokens = 8;
    p.logit_bias_ids = {5, 17};
    p.logit_bias_values = {2.0f, -100.0f};
    p.bad_words_token_ids = {{greedy[0], greedy[1]}};
  }
  auto gpu = generated("llama-gqa", "cuda", false, edited);
  CHECK(gpu == generated("llama-gqa", "cpu", false, edited));
  CHECK(gpu != plain);
}

TEST_CASE("weights updated in place on the GPU, awake and asleep: transformers' tokens on the "
          "new weights") {
  if (!have_gpu())
    return;
  auto ref = read_json(fixtures + "/llama-gqa/reference.json");
  testing::scratch dir{"gpu"};
  auto other = testing::other_model(fixtures, "llama-gqa", dir, 29);
  llm_config cfg;
  cfg.worker.model_path = other;
  cfg.worker.dtype = "float32";
  cfg.worker.kv_cache_memory_bytes = 64 << 20;
  cfg.executor.block_size = 4;
  cfg.executor.device_type = device_kind::cuda;
  llm model{cfg};
  CHECK(!testing::gives_reference(model, ref));
  model.update_weights_from_disk(fixtures + "/llama-gqa");
  CHECK(testing::gives_reference(model, ref));
  model.update_weights_from_disk(other);
  CHECK(!testing::gives_reference(model, ref));
  safetensors_file file{fixtures + "/llama-gqa/model.safetensors"};
  model.update_weights_from_tensors(testing::host_tensors(file));
  CHECK(testing::gives_reference(model, ref));
  for (int32_t level : {1, 2}) {
    CAPTURE(level);
    model.update_weights_from_disk(other);
    model.sleep(level);
    model.update_weights_from_tensors(testing::host_tensors(file));
    model.executor().wake_up();
    CHECK(testing::gives_reference(model, ref));
  }
  CHECK(model.weight_version() == 7);
}
