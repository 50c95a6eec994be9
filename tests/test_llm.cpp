// troupe::llm end to end: batched generation equal to transformers' greedy tokens, chat
// prompts as transformers renders them, and clear errors.

#include "tests/generation.hpp"
#include "model/tokenizer.hpp"
#include "tests/model_runner.hpp"
#include "troupe/engine_loop.hpp"
#include "troupe/llm.hpp"
#include "troupe/model_worker.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>

#include <unistd.h>

using namespace troupe;
using troupe::testing::greedy;
using troupe::testing::read_json;

namespace {

const std::string fixtures = TROUPE_SOURCE_DIR "/tests/fixtures";

/// A tiny model's engine: 2 MiB of KV cache in blocks of 4 tokens.
llm_config tiny(const std::string& model_path) {
  llm_config cfg;
  cfg.worker.model_path = model_path;
  cfg.worker.kv_cache_memory_bytes = 2 << 20;
  cfg.executor.block_size = 4;
  return cfg;
}

/// SmolLM2's engine: 32 MiB of KV cache, sequences of up to 512 tokens.
llm_config smollm2(const std::filesystem::path& path) {
  llm_config cfg;
  cfg.worker.model_path = path.string();
  cfg.worker.kv_cache_memory_bytes = 32 << 20;
  cfg.executor.max_model_len = 512;
  return cfg;
}

} // namespace

TEST_CASE("a batch of token-id prompts gives transformers' greedy tokens") {
  auto cfg = tiny(fixtures + "/qwen2-bias");
  llm model{cfg};
  CHECK(!model.has_tokenizer());
  auto ref = read_json(fixtures + "/qwen2-bias/reference.json");
  std::vector<generation_request> reqs;
  for (auto& p : ref["prompts"])
    reqs.push_back({"", p["token_ids"].get<std::vector<int32_t>>(), greedy(32), {}});
  auto check = [&](llm& m) {
    auto outs = m.generate(reqs);
    REQUIRE(outs.size() == reqs.size());
    for (size_t i = 0; i < outs.size(); ++i) {
      CHECK(outs[i].token_ids == ref["prompts"][i]["greedy"].get<std::vector<int32_t>>());
      CHECK(outs[i].logprobs.size() == 32);
      CHECK(outs[i].finish_reason == finish_reason::length);
    }
  };
  check(model);
  CHECK(model.last_tokens_per_second() > 0);
  SUBCASE("with asynchronous scheduling") {
    auto ahead = cfg;
    ahead.scheduler.async_scheduling = true;
    llm one{ahead};
    check(one);
    // Over two ranks, whose driver passes the pending tokens of steps ahead on.
    ahead.executor.tensor_parallel_size = 2;
    llm two{ahead};
    check(two);
  }
  CHECK_THROWS_WITH_AS(model.generate({"text"}, greedy(4)), doctest::Contains("no tokenizer"),
                       error);
  std::vector<generation_request> too_long{{"", std::vector<int32_t>(600, 5), greedy(4), {}}};
  CHECK_THROWS_WITH_AS(model.generate(too_long), doctest::Contains("600 tokens"), error);
  CHECK_THROWS_AS(model.chat_prompt("hi"), error);
}

TEST_CASE("a configuration out of range is refused naming the field, before anything loads") {
  auto refused = [](const std::function<void(llm_config&)>& change, const char* what) {
    llm_config cfg;
    cfg.worker.model_path = "/nonexistent/model"; // never reached
    change(cfg);
    CHECK_THROWS_WITH_AS(llm{cfg}, doctest::Contains(what), error);
  };
  refused([](llm_config& c) { c.scheduler.max_num_seqs = 0; },
          "max_num_batched_tokens and max_num_seqs must be at least 1");
  refused([](llm_config& c) { c.worker.dtype = "float8"; }, "dtype 'float8' is not known");
  refused([](llm_config& c) { c.worker.kv_cache_memory_fraction = 1.5; },
          "kv_cache_memory_fraction must be in (0, 1]");
  refused([](llm_config& c) { c.executor.tensor_parallel_size = 0; },
          "tensor_parallel_size must be at least 1");
  CHECK_THROWS_WITH_AS(parse_device_kind("tpu"), doctest::Contains("device kind 'tpu'"), error);
  refused(
    [](llm_config& c) {
      c.executor.cluster.nodes.push_back({"127.0.0.1", 1, 1});
    },
    "worker nodes need node_secret or TLS");
  llm_config fine;
  fine.worker.model_path = "x";
  CHECK_NOTHROW(fine.validate());
  CHECK(fine.executor.max_model_len == 0); // the model's own, filled in by the engine
}

TEST_CASE("every end token of config.json and generation_config.json ends a sequence") {
  // llama-gqa as Llama 3 Instruct ships its ends: a list in config.json, and more in
  // generation_config.json (the end of a turn).
  namespace fs = std::filesystem;
  auto ref = read_json(fixtures + "/llama-gqa/reference.json")["prompts"][0];
  auto run = ref["greedy"].get<std::vector<int32_t>>(); // 16, 247, 209, 139, 57, ...
  auto dir = fs::temp_directory_path() / ("troupe-eos-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::copy_file(fixtures + "/llama-gqa/model.safetensors", dir / "model.safetensors",
                fs::copy_options::overwrite_existing);
  auto config = read_json(fixtures + "/llama-gqa/config.json");
  config["eos_token_id"] = {2, run[4]};
  std::ofstream{dir / "config.json"} << config.dump();
  std::ofstream{dir / "generation_config.json"}
    << nlohmann::json{{"eos_token_id", {run[2], 2}}}.dump();
  auto cfg = tiny(dir.string());
  llm model{cfg};
  auto sp = greedy(32);
  sp.ignore_eos = false;
  auto prompt = ref["token_ids"].get<std::vector<int32_t>>();
  auto out = model.generate({{"", prompt, sp, {}}})[0];
  // The run reaches generation_config's end first, then config.json's second one.
  CHECK(out.token_ids == std::vector<int32_t>(run.begin(), run.begin() + 3));
  CHECK(out.finish_reason == finish_reason::stop);
  sp.ignore_eos = true;
  CHECK(model.generate({{"", prompt, sp, {}}})[0].token_ids == run);
  fs::remove_all(dir);
}

TEST_CASE("SmolLM2: chat prompts and generation as transformers does them") {
  auto path = testing::smollm2_or_skip();
  if (path.empty())
    return;
  auto cfg = smollm2(path);
  cfg.worker.cpu_precision = cpu_precision_kind::exact; // transformers' numbers
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
  CHECK(answer[0].finish_reason == finish_reason::stop);
  auto cut = model.generate({{"The capital of France is", {}, greedy(20), {"."}}});
  CHECK(cut[0].text == " Paris");
  CHECK(cut[0].finish_reason == finish_reason::stop);
}

namespace {

/// A model worker that dies, as one whose device is lost, at its `at`-th step on `rank`,
/// while `faults` lasts (shared with its replacements).
class faulty_model_worker : public model_worker {
public:
  faulty_model_worker(model_worker_options options, int32_t rank, int at,
                      std::shared_ptr<std::atomic<int>> faults)
    : model_worker(std::move(options)), fail_rank_(rank), at_(at), faults_(std::move(faults)) {}

  std::vector<sampler_output> execute_model(const execute_model_request& request) override {
    if (rank() == fail_rank_ && ++steps_ == at_) {
      auto left = faults_->load();
      while (left > 0 && !faults_->compare_exchange_weak(left, left - 1)) {
      }
      if (left > 0)
        throw worker_fault{"injected fault at step " + std::to_string(at_)};
    }
    return model_worker::execute_model(request);
  }

private:
  int32_t fail_rank_;
  int at_;
  int steps_ = 0;
  std::shared_ptr<std::atomic<int>> faults_;
};

} // namespace

TEST_CASE("a worker that dies mid-generation is replaced and the outputs stay transformers'") {
  auto ref = read_json(fixtures + "/qwen2-bias/reference.json");
  std::vector<generation_request> reqs;
  for (auto& p : ref["prompts"])
    reqs.push_back({"", p["token_ids"].get<std::vector<int32_t>>(), greedy(32), {}});
  auto cfg = tiny(fixtures + "/qwen2-bias");
  cfg.executor.tensor_parallel_size = 2;
  cfg.executor.restart.max_restarts = 2;
  struct fault {
    int32_t rank;
    int at;
    bool async_scheduling;
    /// A small one makes the recomputed requests (prompt and tokens so far) go in chunks.
    int32_t max_num_batched_tokens;
    int32_t tensor_parallel_size;
  };
  for (auto f :
       {fault{1, 5, false, 2048, 2}, fault{0, 9, false, 2048, 2}, fault{1, 6, true, 2048, 2},
        fault{1, 12, false, 12, 2}, fault{2, 7, false, 2048, 3}}) {
    CAPTURE(f.rank);
    CAPTURE(f.at);
    CAPTURE(f.async_scheduling);
    CAPTURE(f.max_num_batched_tokens);
    CAPTURE(f.tensor_parallel_size);
    auto run = cfg;
    run.executor.tensor_parallel_size = f.tensor_parallel_size;
    run.scheduler.async_scheduling = f.async_scheduling;
    run.scheduler.max_num_batched_tokens = f.max_num_batched_tokens;
    auto faults = std::make_shared<std::atomic<int>>(1);
    auto options = run.worker;
    options.max_num_batched_tokens = run.scheduler.max_num_batched_tokens;
    options.max_num_seqs = run.scheduler.max_num_seqs;
    llm model{run, [=](int32_t) {
                return std::make_unique<faulty_model_worker>(options, f.rank, f.at, faults);
              }};
    auto outs = model.generate(reqs);
    CHECK(faults->load() == 0); // the fault happened
    REQUIRE(outs.size() == reqs.size());
    for (size_t i = 0; i < outs.size(); ++i)
      CHECK(outs[i].token_ids == ref["prompts"][i]["greedy"].get<std::vector<int32_t>>());
    model.executor().check_health();
    CHECK(model.executor().worker_healths()[static_cast<size_t>(f.rank)].restarts == 1);
    // Counted for /metrics: one recovery, and the requests running then computed again.
    CHECK(model.stats().recoveries == 1);
    CHECK(model.stats().recomputed_sequences >= 1);
    CHECK(model.stats().recomputed_sequences <= static_cast<int64_t>(reqs.size()));
  }
  SUBCASE("a death beyond max_restarts fails the generation with worker_died") {
    auto run = cfg;
    run.executor.restart.max_restarts = 1;
    auto faults = std::make_shared<std::atomic<int>>(2); // the replacement dies too
    auto options = run.worker;
    options.max_num_batched_tokens = run.scheduler.max_num_batched_tokens;
    options.max_num_seqs = run.scheduler.max_num_seqs;
    llm model{
      run, [=](int32_t) { return std::make_unique<faulty_model_worker>(options, 1, 3, faults); }};
    CHECK_THROWS_WITH_AS(model.generate(reqs), doctest::Contains("not replaced"), error);
  }
}

TEST_CASE("a worker replaced while the model sleeps (level 1) sleeps too, and wake_up gives "
          "bit-identical outputs") {
  auto ref = read_json(fixtures + "/qwen2-bias/reference.json");
  std::vector<generation_request> reqs;
  for (auto& p : ref["prompts"])
    reqs.push_back({"", p["token_ids"].get<std::vector<int32_t>>(), greedy(16), {}});
  auto cfg = tiny(fixtures + "/qwen2-bias");
  cfg.executor.tensor_parallel_size = 2;
  cfg.executor.restart.max_restarts = 1;
  llm model{cfg};
  auto before = model.generate(reqs);
  auto& exec = model.executor();
  exec.sleep(1);
  CHECK_THROWS_WITH_AS(troupe::testing::kill_rank(exec, 1), doctest::Contains("worker_replaced"),
                       error);
  CHECK(exec.is_sleeping());
  auto health = exec.worker_healths();
  REQUIRE(health.size() == 2);
  CHECK(health[1].restarts == 1);
  CHECK(health[1].sleeping_tags == health[0].sleeping_tags);
  // The replacement's memory is released as the others' is: none of it resident.
  REQUIRE(health[1].memory.size() == health[0].memory.size());
  for (size_t i = 0; i < health[1].memory.size(); ++i) {
    CAPTURE(i);
    CHECK(health[1].memory[i].allocated_bytes > 0);
    CHECK(health[1].memory[i].resident_bytes == 0);
    CHECK(health[1].memory[i].resident_bytes == health[0].memory[i].resident_bytes);
  }
  exec.wake_up();
  auto after = model.generate(reqs);
  REQUIRE(after.size() == before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    CHECK(after[i].token_ids == before[i].token_ids);
    CHECK(after[i].logprobs == before[i].logprobs);
    CHECK(after[i].token_ids == std::vector<int32_t>(ref["prompts"][i]["greedy"].begin(),
                                                     ref["prompts"][i]["greedy"].begin() + 16));
  }
}

TEST_CASE("a chat template given in the config renders conversations, and others are refused") {
  llm_config cfg;
  cfg.worker.model_path = fixtures + "/llama-gqa"; // no tokenizer, no template of its own
  cfg.worker.kv_cache_memory_bytes = 1 << 20;
  {
    llm plain{cfg};
    CHECK_THROWS_WITH_AS(plain.chat_prompt("hi"), doctest::Contains("has no chat template"), error);
  }
  // ChatML with a default system message, as SmolLM2's and Qwen's templates have, and a
  // refusal of its own.
  cfg.chat_template = "{% for message in messages %}{% if message['role'] == 'robot' %}"
                      "{{ raise_exception('robots may not speak') }}{% endif %}"
                      "{% if loop.first and messages[0]['role'] != 'system' %}"
                      "{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{% endif %}"
                      "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                      "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
                      "{{ '<|im_start|>assistant\\n' }}{% endif %}";
  llm model{cfg};
  CHECK(model.chat_prompt("hi") ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n");
  CHECK(model.chat_prompt(
          {{"system", "Be long."}, {"user", "hi"}, {"assistant", "Hello!"}, {"user", "more"}}) ==
        "<|im_start|>system\nBe long.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
        "<|im_start|>assistant\n");
  chat_request no_prompt;
  no_prompt.messages_json = R"([{"role": "user", "content": "hi"}])";
  no_prompt.add_generation_prompt = false;
  CHECK(model.render_chat(no_prompt) ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n");
  CHECK_THROWS_WITH_AS(model.chat_prompt({{"robot", "hi"}}), "robots may not speak", error);
  CHECK_THROWS_AS(model.chat_prompt(std::vector<chat_message>{}), error);
  no_prompt.messages_json = "[{";
  CHECK_THROWS_WITH_AS(model.render_chat(no_prompt), doctest::Contains("not JSON"), error);
}

TEST_CASE("greedy runs under vLLM's penalties, logit_bias and bad words give the reference's "
          "tokens") {
  llm_config cfg;
  cfg.worker.model_path = fixtures + "/llama-gqa";
  cfg.worker.kv_cache_memory_bytes = 1 << 20;
  llm model{cfg};
  auto f = read_json(fixtures + "/sampling.json");
  for (auto& run : f["greedy"]) {
    CAPTURE(run["params"].dump());
    auto sp = greedy(16);
    auto& p = run["params"];
    sp.repetition_penalty = p.value("repetition_penalty", 1.0f);
    sp.presence_penalty = p.value("presence_penalty", 0.0f);
    sp.frequency_penalty = p.value("frequency_penalty", 0.0f);
    sp.logit_bias_ids = p.value("logit_bias_ids", std::vector<int32_t>{});
    sp.logit_bias_values = p.value("logit_bias_values", std::vector<float>{});
    sp.bad_words_token_ids = p.value("bad_words_token_ids", std::vector<std::vector<int32_t>>{});
    auto prompt = run["prompt"].get<std::vector<int32_t>>();
    auto penalized = model.generate({generation_request{"", prompt, sp, {}}})[0];
    auto plain = model.generate({generation_request{"", prompt, greedy(16), {}}})[0];
    CHECK(penalized.token_ids == run["tokens"].get<std::vector<int32_t>>());
    CHECK(penalized.token_ids != plain.token_ids);
    // The logprobs stay the model's (vLLM's raw logprobs): where both runs picked the same
    // first token, the same logprob.
    if (penalized.token_ids[0] == plain.token_ids[0])
      CHECK(penalized.logprobs[0] == doctest::Approx(plain.logprobs[0]));
  }
  // min_tokens holds EOS and the stop tokens back: a stop token that greedy picks first
  // comes no sooner than the min_tokens-th token.
  auto prompt = f["greedy"][0]["prompt"].get<std::vector<int32_t>>();
  auto plain = model.generate({generation_request{"", prompt, greedy(8), {}}})[0];
  auto sp = greedy(8);
  sp.stop_token_ids = {plain.token_ids[0]};
  CHECK(model.generate({generation_request{"", prompt, sp, {}}})[0].token_ids.size() == 1);
  sp.min_tokens = 4;
  auto held = model.generate({generation_request{"", prompt, sp, {}}})[0];
  CHECK(held.token_ids.size() >= 4);
  for (size_t i = 0; i + 1 < std::min<size_t>(held.token_ids.size(), 4); ++i)
    CHECK(held.token_ids[i] != plain.token_ids[0]);
  sp.logit_bias_ids = {100000};
  sp.logit_bias_values = {1.0f};
  CHECK_THROWS_WITH_AS(model.generate({generation_request{"", prompt, sp, {}}}),
                       doctest::Contains("logit_bias names token 100000"), error);
  // Words need the tokenizer this model has none of.
  auto words = greedy(8);
  words.bad_words = {"hello"};
  CHECK_THROWS_WITH_AS(model.generate({generation_request{"", prompt, words, {}}}),
                       doctest::Contains("bad_words needs the model's tokenizer"), error);
  words.bad_words.clear();
  words.bad_words_token_ids = {{3, 256}};
  CHECK_THROWS_WITH_AS(model.generate({generation_request{"", prompt, words, {}}}),
                       doctest::Contains("bad_words_token_ids names token 256"), error);
}

TEST_CASE("each sampled token carries its rank, on the device's path and the host's alike") {
  auto ref = read_json(fixtures + "/qwen2-bias/reference.json")["prompts"][0];
  auto prompt = ref["token_ids"].get<std::vector<int32_t>>();
  llm model{tiny(fixtures + "/qwen2-bias")};
  auto g = model.generate({generation_request{"", prompt, greedy(16), {}}})[0];
  CHECK(g.ranks == std::vector<int32_t>(g.token_ids.size(), 1));
  // Seeded draws: without top logprobs the device samples; with them, the host, from the
  // same uniforms. Where the drawn token is among the top 20 (the model's logits), its rank
  // is its place there; a logit_bias changes the draws, not what a rank is counted from.
  for (bool biased : {false, true}) {
    CAPTURE(biased);
    auto sp = greedy(24);
    sp.temperature = 1.5f;
    sp.seed = 7;
    if (biased) {
      sp.logit_bias_ids = {g.token_ids[0], 5};
      sp.logit_bias_values = {4.0f, 3.0f};
    }
    auto device = model.generate({generation_request{"", prompt, sp, {}}})[0];
    sp.logprobs = 20;
    auto host = model.generate({generation_request{"", prompt, sp, {}}})[0];
    REQUIRE(device.token_ids == host.token_ids);
    CHECK(device.ranks == host.ranks);
    REQUIRE(host.ranks.size() == host.token_ids.size());
    int above_one = 0, placed = 0;
    for (size_t i = 0; i < host.token_ids.size(); ++i) {
      CAPTURE(i);
      auto& top = host.top_logprobs[i];
      auto at = std::find_if(top.begin(), top.end(),
                             [&](const token_logprob& t) { return t.token == host.token_ids[i]; });
      if (at != top.end()) {
        CHECK(host.ranks[i] == at - top.begin() + 1); // the fixture's logits have no ties
        ++placed;
      } else {
        CHECK(host.ranks[i] > 20);
      }
      above_one += host.ranks[i] > 1 ? 1 : 0;
    }
    CHECK(above_one > 0); // the draws were not all the most likely token
    CHECK(placed > 0);
  }
  // best_of's samples keep a rank per token.
  auto sp = greedy(6);
  sp.temperature = 1.0f;
  sp.seed = 3;
  sp.n = 2;
  sp.best_of = 3;
  for (auto& out : model.generate({generation_request{"", prompt, sp, {}}}))
    CHECK(out.ranks.size() == out.token_ids.size());
}

TEST_CASE("prompt logprobs are transformers' log-softmax at every prompt position, once each, "
          "chunked, preempted or with a cached prefix") {
  // qwen2-bias's first prompt with every position's logits from transformers.
  auto ref = read_json(fixtures + "/qwen2-bias/reference.json")["prompts"][0];
  auto prompt = ref["token_ids"].get<std::vector<int32_t>>();
  auto all = ref["all_logits"].get<std::vector<std::vector<float>>>();
  auto want = [&](size_t position, int32_t token) {
    auto& row = all[position - 1];
    double most = *std::max_element(row.begin(), row.end()), sum = 0;
    for (auto x : row)
      sum += std::exp(x - most);
    return row[static_cast<size_t>(token)] - most - std::log(sum);
  };
  auto check = [&](const generation_output& out, int32_t top) {
    REQUIRE(out.prompt_logprobs.size() == prompt.size() - 1);
    for (size_t i = 0; i < out.prompt_logprobs.size(); ++i) {
      auto& p = out.prompt_logprobs[i];
      CAPTURE(i);
      CHECK(p.position == static_cast<int32_t>(i) + 1);
      CHECK(p.token == prompt[i + 1]);
      CHECK(p.logprob == doctest::Approx(want(i + 1, p.token)).epsilon(1e-4));
      auto& row = all[i];
      CHECK(p.rank ==
            1 + std::count_if(row.begin(), row.end(), [&](float x) { return x > row[p.token]; }));
      REQUIRE(p.top_logprobs.size() == static_cast<size_t>(top));
      auto best = std::max_element(row.begin(), row.end()) - row.begin();
      if (top > 0) {
        CHECK(p.top_logprobs[0].token == best);
        CHECK(p.top_logprobs[0].logprob ==
              doctest::Approx(want(i + 1, static_cast<int32_t>(best))).epsilon(1e-4));
      }
    }
    CHECK(out.token_ids == ref["greedy"].get<std::vector<int32_t>>());
  };
  auto sp = greedy(32);
  sp.prompt_logprobs = 3;
  auto run = [&](llm_config cfg, int32_t top) {
    sp.prompt_logprobs = top;
    llm model{cfg};
    // The same prompt twice: the second finds the first's blocks in the cache, and
    // computes its prompt all the same.
    auto outs = model.generate(
      {generation_request{"", prompt, sp, {}}, generation_request{"", prompt, sp, {}}});
    for (auto& out : outs)
      check(out, top);
    auto plain = model.generate({generation_request{"", prompt, greedy(4), {}}})[0];
    CHECK(plain.prompt_logprobs.empty());
  };
  auto cfg = tiny(fixtures + "/qwen2-bias");
  run(cfg, 3);
  run(cfg, 0);
  // In chunks of 2 tokens.
  auto chunked = cfg;
  chunked.scheduler.max_num_batched_tokens = 2;
  run(chunked, 2);
  // Few blocks: preempted and recomputed, prompt positions computed again but told once.
  auto small = cfg;
  small.worker.kv_cache_memory_bytes = 20 * 1024;
  small.scheduler.preempt_by_swap = false;
  {
    llm model{small};
    std::vector<generation_request> reqs(4, generation_request{"", prompt, sp, {}});
    for (auto& r : reqs)
      r.sampling.prompt_logprobs = 1;
    for (auto& out : model.generate(reqs))
      check(out, 1);
    CHECK(model.stats().preemptions > 0);
  }
}

TEST_CASE("bad_words become the token sequences vLLM makes of them") {
  auto f = read_json(fixtures + "/sampling.json");
  auto tok = tokenizer::from_json(fixtures + "/tiny-tokenizer/tokenizer.json");
  CHECK(bad_words_token_ids(tok, f["bad_words"]["words"].get<std::vector<std::string>>()) ==
        f["bad_words"]["token_ids"].get<std::vector<std::vector<int32_t>>>());
}

TEST_CASE(
  "streamed text adds up to the whole output's decode, and stop strings cut where they first are") {
  auto path = troupe::testing::smollm2_or_skip();
  if (path.empty())
    return;
  auto cfg = smollm2(path);
  llm model{cfg};
  // Sampled at a high temperature from prompts in several scripts: the output's tokens cut
  // characters of two to four bytes.
  auto run = [&](const std::vector<generation_request>& reqs) {
    std::map<int64_t, size_t> index;
    for (size_t i = 0; i < reqs.size(); ++i)
      index[model.add_request(reqs[i])] = i;
    std::vector<std::string> streamed(reqs.size());
    std::vector<generation_output> outs(reqs.size());
    while (model.has_unfinished_requests())
      for (auto& u : model.step()) {
        streamed[index.at(u.request_id)] += u.text;
        if (u.finished)
          outs[index.at(u.request_id)] = *u.output;
      }
    for (size_t i = 0; i < reqs.size(); ++i)
      CHECK(streamed[i] == outs[i].text);
    return outs;
  };
  sampling_params hot;
  hot.temperature = 1.5f;
  hot.seed = 11;
  hot.max_tokens = 160;
  hot.ignore_eos = true;
  std::vector<generation_request> reqs;
  for (auto prompt : {"Écris un poème sur la mer 🌊", "用中文写一首关于月亮的诗", "Emoji story: 🐉🔥"})
    reqs.push_back({prompt, {}, hot, {}});
  for (auto& out : run(reqs))
    CHECK(out.text == model.decode(out.token_ids));
  // A stop string from the middle of a greedy output cuts it where it first appears.
  auto sp = greedy(64);
  auto whole = run({{"The capital of France is", {}, sp, {}}})[0];
  auto space = whole.text.find(' ', whole.text.size() / 2);
  REQUIRE(space != std::string::npos);
  auto stop = whole.text.substr(space, 4);
  auto cut = run({{"The capital of France is", {}, sp, {stop}}})[0];
  CHECK(cut.text == whole.text.substr(0, whole.text.find(stop)));
  CHECK(cut.finish_reason == finish_reason::stop);
  // A prompt of no tokens is refused, and nothing stays queued.
  generation_request nothing{"", {}, sp, {}};
  nothing.add_special_tokens = false;
  CHECK_THROWS_WITH_AS(model.add_request(nothing), doctest::Contains("empty"), error);
  CHECK(!model.has_unfinished_requests());
}

namespace {

/// `n` requests after one long system prompt of `system` tokens, each with a few tokens of
/// its own, greedy, with the two most likely tokens at each step.
std::vector<generation_request> after_system_prompt(int n, int system, int32_t vocab) {
  std::vector<int32_t> shared;
  for (int t = 0; t < system; ++t)
    shared.push_back((t * 29 + 7) % vocab);
  std::vector<generation_request> reqs;
  for (int i = 0; i < n; ++i) {
    auto prompt = shared;
    for (int t = 0; t <= (i * 3) % 7; ++t)
      prompt.push_back((i * 41 + t * 13 + 3) % vocab);
    auto sp = greedy(10);
    sp.logprobs = 2;
    reqs.push_back({"", prompt, sp, {}});
  }
  return reqs;
}

struct cached_run {
  std::vector<generation_output> outs;
  engine_stats stats;
};

/// The requests in three rounds: two of them (whose blocks are then cached), all of them,
/// and all again after a sleep (which empties the cache).
cached_run in_rounds(llm& model, const std::vector<generation_request>& reqs) {
  cached_run run;
  auto add = [&](const std::vector<generation_request>& some) {
    for (auto& out : model.generate(some))
      run.outs.push_back(std::move(out));
  };
  add({reqs.begin(), reqs.begin() + 2});
  add(reqs);
  model.sleep(1);
  model.executor().wake_up();
  add(reqs);
  run.stats = model.stats();
  return run;
}

/// The same tokens; the same logprobs, to the last bit unless `rounding` (where the
/// kernels round a row's sums differently in steps of other sizes, and cached requests
/// compute fewer tokens per step: within 1e-5).
void same_outputs(const cached_run& cached, const cached_run& uncached, bool rounding = false) {
  auto same = [&](float a, float b) {
    return rounding ? std::abs(a - b) <= 1e-5f * std::max(1.0f, std::abs(b)) : a == b;
  };
  REQUIRE(cached.outs.size() == uncached.outs.size());
  for (size_t i = 0; i < cached.outs.size(); ++i) {
    CAPTURE(i);
    auto& a = cached.outs[i];
    auto& b = uncached.outs[i];
    CHECK(a.token_ids == b.token_ids);
    REQUIRE(a.logprobs.size() == b.logprobs.size());
    REQUIRE(a.top_logprobs.size() == b.top_logprobs.size());
    for (size_t k = 0; k < a.logprobs.size(); ++k) {
      CHECK(same(a.logprobs[k], b.logprobs[k]));
      REQUIRE(a.top_logprobs[k].size() == b.top_logprobs[k].size());
      for (size_t j = 0; j < a.top_logprobs[k].size(); ++j) {
        CHECK(a.top_logprobs[k][j].token == b.top_logprobs[k][j].token);
        CHECK(same(a.top_logprobs[k][j].logprob, b.top_logprobs[k][j].logprob));
      }
    }
  }
  CHECK(uncached.stats.prefix_cache_hits == 0);
  // Every token found in the cache is one not computed (recomputations after preemptions
  // differ between the runs).
  if (cached.stats.preemptions == 0 && uncached.stats.preemptions == 0)
    CHECK(cached.stats.prefill_tokens ==
          uncached.stats.prefill_tokens - cached.stats.prefix_cache_hits);
}

} // namespace

TEST_CASE("prefix caching on and off give the same greedy tokens and logprobs") {
  auto reqs = after_system_prompt(12, 37, 256);
  auto both = [&](llm_config cfg, auto&& factory, bool rounding = false) {
    cfg.scheduler.enable_prefix_caching = true;
    llm on{cfg, factory(cfg)};
    auto cached = in_rounds(on, reqs);
    cfg.scheduler.enable_prefix_caching = false;
    llm off{cfg, factory(cfg)};
    auto uncached = in_rounds(off, reqs);
    same_outputs(cached, uncached, rounding);
    return cached;
  };
  auto plain = [](const llm_config& cfg) { return model_worker_factory(cfg.worker); };
  auto cfg = tiny(fixtures + "/llama-gqa");
  SUBCASE("every fixture family") {
    for (auto& name : troupe::testing::fixture_models) {
      CAPTURE(name);
      auto run = cfg;
      run.worker.model_path = fixtures + "/" + name;
      // A mixture's experts take as many rows as were routed to them in the step: their
      // GEMMs round as llama-odd-heads' do.
      bool experts = load_model_config(run.worker.model_path).num_experts > 0;
      auto cached = both(run, plain, name == "llama-odd-heads" || experts);
      if (name == "llama-rope-dynamic" || name == "phi3-longrope" || name == "phi4-partial") {
        // Their keys depend on the sequence's length (past 24 and 8 positions, below the
        // model's length): the engine turns the cache off.
        CHECK(cached.stats.prefix_cache_queries == 0);
        continue;
      }
      // The second round finds the system prompt's 9 blocks for its 10 later requests, and
      // the first two whole; the third starts cold.
      CHECK(cached.stats.prefix_cache_hits >= 10 * 36);
    }
  }
  SUBCASE("preempted by swapping and by recomputing, in chunks, over two ranks") {
    for (bool swap : {true, false}) {
      CAPTURE(swap);
      auto run = cfg;
      // 32 blocks on each rank (a block of one kv head there is 1 KiB): fewer than the
      // requests need at once, with their prefix shared or not.
      run.worker.kv_cache_memory_bytes = 32 * 1024;
      run.scheduler.preempt_by_swap = swap;
      run.scheduler.max_num_batched_tokens = 24;
      run.executor.tensor_parallel_size = 2;
      // Steps of a few tokens take the CPU kernels' narrow paths, which round a row's sums
      // in another order: cached requests make such steps where uncached ones do not.
      auto cached = both(run, plain, true);
      CHECK(cached.stats.preemptions > 0);
    }
  }
  SUBCASE("a worker replaced mid-run empties the cache and the outputs stay the same") {
    auto run = cfg;
    run.executor.tensor_parallel_size = 2;
    run.executor.restart.max_restarts = 2;
    auto faulty = [](const llm_config& c) -> worker_factory {
      auto faults = std::make_shared<std::atomic<int>>(1);
      auto options = c.worker;
      options.max_num_batched_tokens = c.scheduler.max_num_batched_tokens;
      options.max_num_seqs = c.scheduler.max_num_seqs;
      return [=](int32_t) { return std::make_unique<faulty_model_worker>(options, 1, 4, faults); };
    };
    auto cached = both(run, faulty, true); // the recomputation takes steps of other sizes
    CHECK(cached.stats.prefix_cache_hits > 0);
    CHECK(cached.outs.size() == 2 + 2 * reqs.size());
  }
  SUBCASE("requests under LoRA adapters share blocks only with their own adapter") {
    const std::string adapters = fixtures + "/llama-gqa-adapters";
    auto with_adapters = reqs;
    for (size_t i = 0; i < with_adapters.size(); ++i)
      if (i % 3 > 0) {
        auto name = i % 3 == 1 ? std::string{"lora-all"} : std::string{"lora-qv"};
        with_adapters[i].lora =
          lora_request{name, static_cast<int64_t>(i % 3), adapters + "/" + name};
      }
    auto run = cfg;
    run.worker.max_loras = 2;
    run.scheduler.enable_prefix_caching = true;
    llm on{run};
    auto cached = in_rounds(on, with_adapters);
    run.scheduler.enable_prefix_caching = false;
    llm off{run};
    same_outputs(cached, in_rounds(off, with_adapters));
  }
}

TEST_CASE("SmolLM2: chats after one system prompt give the same tokens with the prefix cached") {
  auto path = troupe::testing::smollm2_or_skip();
  if (path.empty())
    return;
  auto cfg = smollm2(path);
  std::string system = "You are a careful assistant for a public library. Answer in one or two "
                       "sentences, name the section of the library where the reader can find "
                       "more, and never invent a book title that you are not sure exists.";
  llm on{cfg};
  std::vector<generation_request> reqs;
  for (auto question : {"Where are books about birds?", "Do you have poetry in French?",
                        "How do I renew a loan?", "What is a good first novel to read?",
                        "Is there a quiet room?", "Can I print a document here?"}) {
    auto sp = greedy(24);
    sp.logprobs = 1;
    reqs.push_back({on.chat_prompt({{"system", system}, {"user", question}}), {}, sp, {}});
  }
  auto cached = in_rounds(on, reqs);
  cfg.scheduler.enable_prefix_caching = false;
  llm off{cfg};
  same_outputs(cached, in_rounds(off, reqs));
  CHECK(cached.stats.prefix_cache_hits >= 4 * 32);
}

TEST_CASE("requests running when the workers sleep through the executor are computed again after") {
  llm model{tiny(fixtures + "/llama-gqa")};
  std::vector<generation_request> reqs;
  for (int32_t i = 0; i < 3; ++i)
    reqs.push_back({"", {3, 14, 15, 92, 65, static_cast<int32_t>(10 + i)}, greedy(16), {}});
  auto want = model.generate(reqs);
  std::map<int64_t, size_t> index;
  for (size_t i = 0; i < reqs.size(); ++i)
    index[model.add_request(reqs[i])] = i;
  std::vector<generation_output> outs(reqs.size());
  auto take = [&](const std::vector<generation_update>& updates) {
    for (auto& u : updates)
      if (u.finished)
        outs[index.at(u.request_id)] = *u.output;
  };
  for (int s = 0; s < 4; ++s)
    take(model.step());
  // The sleep discards the KV caches under the running requests (and the cached prefixes).
  model.executor().sleep(1);
  model.executor().wake_up();
  while (model.has_unfinished_requests())
    take(model.step());
  for (size_t i = 0; i < reqs.size(); ++i)
    CHECK(outs[i].token_ids == want[i].token_ids);
}

TEST_CASE(
  "a seeded request draws the same tokens whenever it is sent and whatever runs beside it") {
  auto cfg = tiny(fixtures + "/llama-gqa");
  llm model{cfg};
  sampling_params hot;
  hot.temperature = 1.3f;
  hot.seed = 5;
  hot.max_tokens = 24;
  hot.ignore_eos = true;
  generation_request seeded{"", {3, 14, 15, 92, 65}, hot, {}};
  auto alone = model.generate({seeded})[0].token_ids;
  auto other = seeded;
  other.sampling.seed = 6;
  auto unseeded = seeded;
  unseeded.sampling.seed = -1;
  // Sent again later, after others and beside them: new sequence ids, other batches.
  auto outs = model.generate({unseeded, other, seeded, unseeded});
  CHECK(outs[2].token_ids == alone);
  CHECK(outs[1].token_ids != alone);
  hot.top_k = 5; // on the host sampler's path too (top logprobs asked for)
  hot.logprobs = 2;
  generation_request host{"", {3, 14, 15, 92, 65}, hot, {}};
  auto first = model.generate({host})[0].token_ids;
  CHECK(model.generate({unseeded, host})[1].token_ids == first);
}

TEST_CASE("n samples are the same seeds run one by one, share the prompt's blocks, and best_of "
          "keeps the most likely") {
  llm model{tiny(fixtures + "/llama-gqa")};
  sampling_params hot;
  hot.temperature = 1.3f;
  hot.seed = 40;
  hot.max_tokens = 12;
  hot.ignore_eos = true;
  const std::vector<int32_t> prompt{3, 14, 15, 92, 65, 35, 89, 79, 32};
  std::vector<generation_output> alone;
  for (int64_t i = 0; i < 4; ++i) {
    auto sp = hot;
    sp.seed = 40 + i;
    alone.push_back(model.generate({{"", prompt, sp, {}}})[0]);
  }
  auto n = hot;
  n.n = 3;
  model.reset_prefix_cache();
  auto before = model.stats();
  auto outs = model.generate({{"", prompt, n, {}}, {"", {5, 6, 7}, hot, {}}});
  REQUIRE(outs.size() == 4);
  for (int32_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(outs[static_cast<size_t>(i)].index == i);
    CHECK(outs[static_cast<size_t>(i)].token_ids == alone[static_cast<size_t>(i)].token_ids);
    // Within rounding: the samples' prompts are computed in steps of other sizes.
    auto& lp = outs[static_cast<size_t>(i)].logprobs;
    auto& want = alone[static_cast<size_t>(i)].logprobs;
    REQUIRE(lp.size() == want.size());
    for (size_t k = 0; k < lp.size(); ++k)
      CHECK(lp[k] == doctest::Approx(want[k]).epsilon(1e-5));
  }
  CHECK(outs[0].token_ids != outs[1].token_ids);
  CHECK(outs[3].index == 0);
  CHECK(outs[3].prompt_token_ids == std::vector<int32_t>{5, 6, 7});
  // The samples start in one step: the second and third take the first's two full prompt
  // blocks (the block of the last prompt token is each one's own).
  auto after = model.stats();
  CHECK(after.prefix_cache_hits - before.prefix_cache_hits == 2 * 8);
  CHECK(after.prompt_tokens - before.prompt_tokens == 9 + 3);

  // best_of 4, n 2: the two samples of the four whose logprobs sum highest, best first.
  auto score = [](const generation_output& o) {
    double sum = 0;
    for (auto lp : o.logprobs)
      sum += lp;
    return sum;
  };
  std::vector<size_t> order{0, 1, 2, 3};
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return score(alone[a]) > score(alone[b]); });
  auto best = hot;
  best.n = 2;
  best.best_of = 4;
  auto chosen = model.generate({{"", prompt, best, {}}});
  REQUIRE(chosen.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(chosen[i].index == static_cast<int32_t>(i));
    CHECK(chosen[i].token_ids == alone[order[i]].token_ids);
  }

  // Online: each sample's updates carry its index; an abort ends every sample.
  auto id = model.add_request({"", prompt, n, {}});
  std::map<int32_t, std::vector<int32_t>> streamed;
  std::set<int32_t> finished;
  for (int s = 0; s < 3; ++s)
    for (auto& u : model.step()) {
      CHECK(u.request_id == id);
      CHECK(!u.finished);
      for (auto t : u.token_ids)
        streamed[u.index].push_back(t);
    }
  CHECK(streamed.size() == 3);
  model.abort_request(id);
  while (model.has_unfinished_requests())
    for (auto& u : model.step())
      if (u.finished) {
        CHECK(u.output->finish_reason == finish_reason::abort);
        CHECK(u.output->index == u.index);
        finished.insert(u.index);
      }
  CHECK(finished == std::set<int32_t>{0, 1, 2});
  auto bad = hot;
  bad.n = 2;
  bad.best_of = 1;
  CHECK_THROWS_WITH_AS(model.add_request({"", prompt, bad, {}}), doctest::Contains("best_of"),
                       error);
}

namespace {

/// A request's updates as the engine's loop hands them on.
struct collecting_sink : request_sink {
  std::mutex mtx;
  std::condition_variable cv;
  std::vector<int32_t> tokens;
  std::string finish_reason;
  std::optional<request_failure> failure;
  bool done = false;
  /// Runs on the loop's thread at the first update.
  std::function<void()> at_first;

  void update(const generation_update& u) override {
    if (at_first && tokens.empty() && !u.token_ids.empty())
      at_first();
    std::lock_guard<std::mutex> lk{mtx};
    tokens.insert(tokens.end(), u.token_ids.begin(), u.token_ids.end());
    if (u.finished) {
      finish_reason = to_string(u.output->finish_reason);
      done = true;
      cv.notify_all();
    }
  }

  void fail(const request_failure& f) override {
    std::lock_guard<std::mutex> lk{mtx};
    failure = f;
    done = true;
    cv.notify_all();
  }

  /// Whether it finished or failed within a minute (a hung loop fails the test, not CI).
  bool wait() {
    std::unique_lock<std::mutex> lk{mtx};
    return cv.wait_for(lk, std::chrono::minutes(1), [&] { return done; });
  }
};

struct counting_observer : engine_loop_observer {
  std::mutex mtx;
  std::vector<std::string> reasons;
  /// Whether every finished request's times were in order (checked on the test's thread).
  bool times_in_order = true;
  std::atomic<int64_t> rounds{0};

  void finished(const std::string& reason, double first_token, const std::vector<double>&,
                double total) override {
    std::lock_guard<std::mutex> lk{mtx};
    reasons.push_back(reason);
    times_in_order = times_in_order && first_token >= 0 && total >= first_token;
  }

  void stepped(const engine_stats&) override {
    ++rounds;
  }
};

} // namespace

TEST_CASE("engine_loop: requests that join between steps get transformers' tokens, and the "
          "capacity, a refused request and a stopped loop each end as they say") {
  llm model{tiny(fixtures + "/qwen2-bias")};
  auto ref = read_json(fixtures + "/qwen2-bias/reference.json");
  counting_observer observer;
  auto loop = std::make_unique<engine_loop>(model, observer, 3);

  // The loop's thread held in a command while four requests come: three queue, the fourth
  // is beyond the capacity.
  std::promise<void> release;
  auto held = release.get_future().share();
  loop->post([held](llm&) { held.wait(); });
  std::vector<std::shared_ptr<collecting_sink>> sinks;
  for (size_t i = 0; i < 3; ++i) {
    sinks.push_back(std::make_shared<collecting_sink>());
    std::vector<int32_t> prompt = ref["prompts"][i]["token_ids"];
    loop->submit({"", prompt, greedy(32), {}}, sinks.back());
  }
  CHECK(loop->active() == 3);
  auto extra = std::make_shared<collecting_sink>();
  try {
    loop->submit({"", {1, 2, 3}, greedy(4), {}}, extra);
    FAIL("a request beyond the capacity was taken");
  } catch (const request_failure& f) {
    CHECK(f.kind == request_failure_kind::overloaded);
    CHECK(std::string{f.what()}.find("too many requests: 3") != std::string::npos);
  }
  release.set_value();
  for (size_t i = 0; i < 3; ++i) {
    REQUIRE(sinks[i]->wait());
    CHECK(!sinks[i]->failure);
    CHECK(sinks[i]->tokens == ref["prompts"][i]["greedy"].get<std::vector<int32_t>>());
    CHECK(sinks[i]->finish_reason == "length");
  }

  // A token id out of the vocabulary: that request fails with the engine's error.
  auto bad = std::make_shared<collecting_sink>();
  loop->submit({"", {1, 1 << 20}, greedy(4), {}}, bad);
  REQUIRE(bad->wait());
  REQUIRE(bad->failure);
  CHECK(bad->failure->kind == request_failure_kind::engine_error);
  CHECK(bad->failure->code == errc::invalid_argument);

  // The loop stopped while one request runs and another is queued (both from inside the
  // running request's first update, on the loop's thread): both fail as stopped, neither
  // stays in the engine, which outlives the loop, and a later submission is refused.
  auto running = std::make_shared<collecting_sink>();
  auto queued = std::make_shared<collecting_sink>();
  auto* l = loop.get();
  running->at_first = [l, queued] {
    l->submit({"", {4, 5, 6}, greedy(400), {}}, queued);
    l->stop();
  };
  loop->submit({"", {1, 2, 3}, greedy(400), {}}, running);
  REQUIRE(running->wait());
  try {
    loop->submit({"", {1, 2, 3}, greedy(4), {}}, std::make_shared<collecting_sink>());
    FAIL("a request was taken after the loop stopped");
  } catch (const request_failure& f) {
    CHECK(f.kind == request_failure_kind::stopped);
  }
  loop.reset();
  for (auto* sink : {running.get(), queued.get()}) {
    REQUIRE(sink->wait());
    REQUIRE(sink->failure);
    CHECK(sink->failure->kind == request_failure_kind::stopped);
    CHECK(sink->tokens.size() <= 1);
  }
  while (model.has_unfinished_requests())
    for (auto& u : model.step())
      if (u.finished)
        CHECK(u.output->finish_reason == finish_reason::abort);
  std::lock_guard<std::mutex> lk{observer.mtx};
  CHECK(observer.reasons == std::vector<std::string>(3, "length"));
  CHECK(observer.times_in_order);
  CHECK(observer.rounds > 0);
}
