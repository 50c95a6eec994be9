// `troupe generate`: text from a model, for a few prompts, on the executor's workers
// (CPU or GPU, local or leased from nodes).

#include "cli/commands.hpp"

#include "model/weight_cache.hpp"
#include "troupe/llm.hpp"

#include <nlohmann/json.hpp>

#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include <unistd.h>

namespace troupe::cli {

namespace {

/// A count or size that may be 0 (the default) but not negative.
const CLI::Validator not_negative{[](std::string& text) {
                                    return !text.empty() && text[0] == '-'
                                             ? "must be 0 or more, got " + text
                                             : std::string{};
                                  },
                                  "NONNEGATIVE"};

std::vector<int32_t> parse_ids(const std::string& text) {
  if (text.empty())
    throw error{errc::invalid_argument, "--prompt-token-ids: an empty list (give ids as 1,2,3)"};
  std::vector<int32_t> ids;
  std::stringstream in{text};
  for (std::string part; std::getline(in, part, ',');) {
    try {
      size_t used = 0;
      auto v = std::stol(part, &used);
      if (used != part.size() || v < 0 || v > INT32_MAX)
        throw std::invalid_argument{part};
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      throw error{errc::invalid_argument, "--prompt-token-ids: '" + part + "' is not a token id"};
    }
  }
  return ids;
}

/// The LoRA adapter of each prompt (none where empty): --prompt-lora names them in prompt
/// order; without it a single --lora serves every prompt.
std::vector<std::optional<lora_request>> prompt_loras(const std::vector<std::string>& loras,
                                                      const std::vector<std::string>& choices,
                                                      size_t prompts) {
  std::map<std::string, lora_request> by_name;
  for (auto& spec : loras) {
    auto [name, path] = name_and_path("--lora", spec);
    if (by_name.count(name) > 0)
      throw error{errc::invalid_argument, "--lora: '" + name + "' is given twice"};
    auto id = static_cast<int64_t>(by_name.size()) + 1;
    by_name.emplace(name, lora_request{name, id, path});
  }
  std::vector<std::optional<lora_request>> out(prompts);
  if (choices.empty()) {
    if (by_name.size() > 1)
      throw error{errc::invalid_argument,
                  "several --lora adapters: say which prompt uses which with --prompt-lora"};
    if (by_name.size() == 1)
      for (auto& o : out)
        o = by_name.begin()->second;
    return out;
  }
  if (choices.size() != prompts)
    throw error{errc::invalid_argument, std::to_string(choices.size()) + " --prompt-lora for " +
                                          std::to_string(prompts) + " prompts"};
  for (size_t i = 0; i < prompts; ++i) {
    if (choices[i] == "none")
      continue;
    auto at = by_name.find(choices[i]);
    if (at == by_name.end())
      throw error{errc::invalid_argument,
                  "--prompt-lora: no --lora is called '" + choices[i] + "'"};
    out[i] = at->second;
  }
  return out;
}

} // namespace

/// "NAME=PATH" of --lora and --prompt-adapter.
std::pair<std::string, std::string> name_and_path(const std::string& flag,
                                                  const std::string& text) {
  auto eq = text.find('=');
  if (eq == 0 || eq == std::string::npos || eq + 1 == text.size())
    throw error{errc::invalid_argument, flag + ": '" + text + "' is not NAME=PATH"};
  return {text.substr(0, eq), text.substr(eq + 1)};
}

void add_device_options(CLI::App& app, device_options& o) {
  app.add_option("--device", o.device, "What the local workers compute on (worker i on GPU i)")
    ->check(CLI::IsMember({"cpu", "cuda"}))
    ->capture_default_str();
  app
    .add_option("--dtype", o.dtype,
                "The weights' element type (auto: as the checkpoint stores them on the "
                "CPU, GGUF blocks included; the checkpoint's bfloat16 or else float16 on a "
                "GPU)")
    ->check(CLI::IsMember({"auto", "float32", "float16", "bfloat16"}))
    ->capture_default_str();
  app
    .add_option("--gpu-memory-utilization", o.gpu_memory_utilization,
                "Share of each GPU's memory for weights, activations and KV cache")
    ->check(CLI::Range(0.01, 1.0))
    ->capture_default_str();
  app.add_flag("--enforce-eager", o.enforce_eager,
               "Run every step call by call, without CUDA graphs");
  app
    .add_option("--cpu-precision", o.cpu_precision,
                "exact: float activations against the weights as stored; fast: weights "
                "repacked at load, activations rounded to 8-bit integers and integer "
                "products for Q8_0, Q4_0, Q4_1, Q4_K, Q6_K (CPUs with AVX-512 VNNI), to "
                "bfloat16 for BF16 (AVX-512 BF16); F16 repacked only")
    ->check(CLI::IsMember({"exact", "fast"}))
    ->capture_default_str();
  app.add_flag("--enable-expert-parallel", o.expert_parallel,
               "Place a mixture's experts whole, a near-even share of them on each worker, "
               "instead of splitting every expert's columns across the workers");
  o.weight_cache = default_weight_cache();
  app
    .add_option("--weight-cache", o.weight_cache,
                "Directory where the CPU keeps each rank's weights as it computes on them, "
                "mapped at the next start instead of repacked (one file per model file and "
                "rank; 'off' for none; default $TROUPE_WEIGHT_CACHE, else "
                "~/.cache/troupe/weights)")
    ->capture_default_str();
}

void apply_device_options(const device_options& o, executor_config& executor,
                          model_worker_options& worker) {
  executor.device_type = parse_device_kind(o.device);
  worker.dtype = o.dtype;
  worker.gpu_memory_utilization = o.gpu_memory_utilization;
  worker.enforce_eager = o.enforce_eager;
  worker.cpu_precision = parse_cpu_precision(o.cpu_precision);
  worker.enable_expert_parallel = o.expert_parallel;
  worker.weight_cache = o.weight_cache_directory();
}

void add_engine_options(CLI::App& app, engine_options& o) {
  app.add_option("--model", o.model, "Hugging Face model directory or GGUF file")->required();
  app.add_option("--tensor-parallel-size", o.tp, "Worker actors the model is split over")
    ->check(CLI::Range(1, 64))
    ->capture_default_str();
  app
    .add_option("--kv-cache-memory", o.kv_cache_memory,
                "Bytes of KV cache per worker (0: --kv-cache-memory-fraction of free memory)")
    ->check(not_negative)
    ->capture_default_str();
  app
    .add_option("--kv-cache-memory-fraction", o.kv_fraction,
                "Share of free memory for the KV cache when --kv-cache-memory is 0")
    ->check(CLI::Range(0.01, 0.95))
    ->capture_default_str();
  app
    .add_option("--swap-space", o.swap_space_mib,
                "MiB of host memory per worker for swapped blocks")
    ->check(CLI::Range(0, 1 << 20))
    ->capture_default_str();
  app.add_option("--max-num-seqs", o.max_num_seqs, "Requests in one step (0: the engine's 256)")
    ->check(CLI::Range(0, 1 << 20))
    ->capture_default_str();
  app
    .add_option("--max-num-batched-tokens", o.max_num_batched_tokens,
                "Tokens in one step; longer prompts go in chunks (0: the engine's 2048)")
    ->check(CLI::Range(0, 1 << 24))
    ->capture_default_str();
  app.add_flag("--async-scheduling", o.async_scheduling,
               "Send the next step while one runs when it needs none of its tokens");
  app.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", o.prefix_caching,
               "Reuse the keys and values of prompts' shared beginnings (on by default)");
  app
    .add_option("--max-restarts", o.max_restarts,
                "Replace a worker that dies, up to this many times within --restart-window "
                "(0: a death ends the run)")
    ->check(CLI::Range(0, 1000000))
    ->capture_default_str();
  app.add_option("--restart-window", o.restart_window_s, "Seconds that --max-restarts counts over")
    ->check(CLI::PositiveNumber)
    ->capture_default_str();
  app.add_option("--max-model-len", o.max_model_len, "Longest prompt plus output (0: the model's)")
    ->check(not_negative)
    ->capture_default_str();
  app
    .add_option("--max-loras", o.max_loras,
                "LoRA adapters loaded at once (0: as many as --lora gives)")
    ->check(CLI::Range(0, 1024))
    ->capture_default_str();
  app.add_option("--max-lora-rank", o.max_lora_rank, "The highest LoRA rank accepted")
    ->check(CLI::Range(1, 1 << 16))
    ->capture_default_str();
  app
    .add_option("--max-prompt-adapter-token", o.max_prompt_adapter_token,
                "The most virtual tokens a prompt adapter may have (0: no limit)")
    ->check(CLI::Range(0, 1 << 20))
    ->capture_default_str();
  app.add_option("--chat-template", o.chat_template,
                 "A file holding a chat template (Jinja) to use instead of the model's");
  add_node_options(app, o.nodes);
  add_device_options(app, o.device);
}

llm_config engine_config(const engine_options& o, size_t loras) {
  llm_config cfg;
  cfg.worker.model_path = o.model;
  cfg.executor.tensor_parallel_size = o.tp;
  apply_device_options(o.device, cfg.executor, cfg.worker);
  cfg.worker.kv_cache_memory_bytes = o.kv_cache_memory;
  cfg.worker.kv_cache_memory_fraction = o.kv_fraction;
  cfg.worker.swap_space_bytes = o.swap_space_mib << 20;
  cfg.scheduler.async_scheduling = o.async_scheduling;
  cfg.scheduler.enable_prefix_caching = o.prefix_caching;
  if (o.max_num_seqs > 0)
    cfg.scheduler.max_num_seqs = o.max_num_seqs;
  if (o.max_num_batched_tokens > 0)
    cfg.scheduler.max_num_batched_tokens = o.max_num_batched_tokens;
  cfg.executor.restart.max_restarts = o.max_restarts;
  cfg.executor.restart.window =
    std::chrono::duration_cast<timeout_type>(std::chrono::duration<double>(o.restart_window_s));
  cfg.executor.max_model_len = o.max_model_len;
  cfg.worker.max_loras = o.max_loras > 0 ? o.max_loras : std::max(1, static_cast<int>(loras));
  cfg.worker.max_lora_rank = o.max_lora_rank;
  cfg.worker.max_prompt_adapter_token = o.max_prompt_adapter_token;
  apply_node_options(o.nodes, cfg.executor);
  if (!o.chat_template.empty())
    cfg.chat_template = read_text_file("--chat-template", o.chat_template);
  return cfg;
}

std::shared_ptr<command> add_generate(CLI::App& app) {
  struct options {
    engine_options engine;
    std::vector<std::string> prompts;
    std::vector<std::string> prompt_ids;
    int max_tokens = 64;
    float temperature = 0.0f;
    float top_p = 1.0f;
    int top_k = -1;
    int64_t seed = -1;
    int logprobs = 0;
    float repetition_penalty = 1.0f;
    float presence_penalty = 0.0f;
    float frequency_penalty = 0.0f;
    float min_p = 0.0f;
    int min_tokens = 0;
    std::vector<std::string> bad_words;
    int prompt_logprobs = -1;
    std::string guided_json;
    bool json_object = false;
    std::vector<std::string> guided_choice;
    std::string guided_regex;
    int n = 1;
    int best_of = 0;
    std::vector<std::string> stop;
    bool chat = false;
    bool json = false;
    std::vector<std::string> loras;
    std::vector<std::string> prompt_loras;
    std::string prompt_adapter;
  };
  auto o = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  auto* sub = app.add_subcommand("generate", "Generate text from a model for one or more prompts");
  cmd->app = sub;
  sub->add_option("--prompt", o->prompts, "A prompt (repeat for a batch)");
  sub->add_option("--prompt-token-ids", o->prompt_ids,
                  "A prompt as comma-separated token ids, bypassing the tokenizer (repeatable)");
  sub->add_option("--max-tokens", o->max_tokens, "Tokens to generate per prompt")
    ->check(CLI::Range(1, 1 << 20))
    ->capture_default_str();
  sub->add_option("--temperature", o->temperature, "0 is greedy")
    ->check(CLI::Range(0.0f, 100.0f))
    ->capture_default_str();
  sub->add_option("--top-p", o->top_p, "Nucleus sampling mass")
    ->check(CLI::Range(0.0f, 1.0f))
    ->capture_default_str();
  sub->add_option("--top-k", o->top_k, "Keep the k most likely tokens; -1 keeps all")
    ->capture_default_str();
  sub->add_option("--seed", o->seed, "Seed of each request's sampling; -1 for none")
    ->capture_default_str();
  sub->add_option("--logprobs", o->logprobs, "Most likely tokens to report besides the sampled one")
    ->check(CLI::Range(0, 20))
    ->capture_default_str();
  sub
    ->add_option("--repetition-penalty", o->repetition_penalty,
                 "Divide the logits of the prompt's and output's tokens by this (vLLM's)")
    ->capture_default_str();
  sub
    ->add_option("--presence-penalty", o->presence_penalty,
                 "Subtracted once from the logit of each token the output holds")
    ->capture_default_str();
  sub
    ->add_option("--frequency-penalty", o->frequency_penalty,
                 "Subtracted from a token's logit for each time the output holds it")
    ->capture_default_str();
  sub
    ->add_option("--min-p", o->min_p, "Drop tokens less likely than this times the most likely one")
    ->capture_default_str();
  sub
    ->add_option("--min-tokens", o->min_tokens,
                 "Tokens generated before EOS, stop tokens or stop strings may end the output")
    ->capture_default_str();
  sub
    ->add_option("--prompt-logprobs", o->prompt_logprobs,
                 "With --json, each prompt token's logprob and this many most likely tokens at "
                 "its position (-1: none)")
    ->check(CLI::Range(-1, 20))
    ->capture_default_str();
  sub
    ->add_option("--guided-json", o->guided_json,
                 "A JSON schema file the output must hold to (structured output)")
    ->check(CLI::ExistingFile);
  sub->add_flag("--json-object", o->json_object, "The output is a JSON object (JSON mode)");
  sub->add_option("--guided-choice", o->guided_choice,
                  "One of the texts the output must be (repeatable)");
  sub->add_option("--guided-regex", o->guided_regex,
                  "A regular expression the whole output must match (structured output)");
  sub->add_option("--bad-words", o->bad_words,
                  "A word the output must not hold (repeatable; vLLM's bad_words)");
  sub->add_option("--n", o->n, "Samples per prompt (with --seed, sample i is seeded seed + i)")
    ->capture_default_str();
  sub
    ->add_option("--best-of", o->best_of,
                 "Samples drawn per prompt, of which the --n most likely are shown (0: --n)")
    ->capture_default_str();
  sub->add_option("--stop", o->stop, "Stop when the text contains this string (repeatable)");
  sub->add_flag("--chat", o->chat, "Wrap each prompt in the model's chat template");
  sub->add_flag("--json", o->json,
                "Print JSON: per prompt the text, the token ids, their logprobs and ranks");
  sub->add_option("--lora", o->loras,
                  "A PEFT LoRA adapter directory as NAME=PATH (repeatable); one alone serves "
                  "every prompt");
  sub->add_option("--prompt-lora", o->prompt_loras,
                  "The --lora NAME of each prompt in order, text prompts first ('none' for the "
                  "base model; repeatable)");
  sub->add_option("--prompt-adapter", o->prompt_adapter,
                  "A PEFT prompt-tuning adapter directory as NAME=PATH, for every prompt");
  add_engine_options(*sub, o->engine);
  cmd->run = [o] {
    if (o->prompts.empty() && o->prompt_ids.empty())
      throw error{errc::invalid_argument, "give at least one --prompt or --prompt-token-ids"};
    // Everything the command line can get wrong is refused before the model loads.
    sampling_params sp;
    sp.temperature = o->temperature;
    sp.top_p = o->top_p;
    sp.top_k = o->top_k;
    sp.seed = o->seed;
    sp.max_tokens = o->max_tokens;
    sp.logprobs = o->logprobs;
    sp.repetition_penalty = o->repetition_penalty;
    sp.presence_penalty = o->presence_penalty;
    sp.frequency_penalty = o->frequency_penalty;
    sp.min_p = o->min_p;
    sp.min_tokens = o->min_tokens;
    sp.bad_words = o->bad_words;
    sp.prompt_logprobs = o->prompt_logprobs;
    if (!o->guided_json.empty())
      sp.guided_json = read_text_file("--guided-json", o->guided_json);
    sp.guided_json_object = o->json_object;
    sp.guided_choice = o->guided_choice;
    sp.guided_regex = o->guided_regex;
    sp.n = o->n;
    sp.best_of = o->best_of;
    validate(sp);
    std::vector<std::vector<int32_t>> id_prompts;
    for (auto& ids : o->prompt_ids)
      id_prompts.push_back(parse_ids(ids));
    auto loras = prompt_loras(o->loras, o->prompt_loras, o->prompts.size() + o->prompt_ids.size());
    auto cfg = engine_config(o->engine, o->loras.size());
    std::optional<prompt_adapter_request> prompt_adapter;
    if (!o->prompt_adapter.empty()) {
      auto [name, path] = name_and_path("--prompt-adapter", o->prompt_adapter);
      prompt_adapter = prompt_adapter_request{name, 1, path, 0};
    }
    bool bar = isatty(STDERR_FILENO) != 0 && !o->json;
    if (bar)
      cfg.worker.progress = [](size_t done, size_t total) {
        int width = 40;
        auto filled = static_cast<int>(width * done / std::max<size_t>(total, 1));
        std::cerr << "\rloading weights [" << std::string(static_cast<size_t>(filled), '#')
                  << std::string(static_cast<size_t>(width - filled), ' ') << "] " << done << "/"
                  << total << (done == total ? "\n" : "") << std::flush;
      };
    llm model{cfg};
    std::vector<generation_request> reqs;
    for (auto& p : o->prompts) {
      // A rendered chat prompt holds the template's special tokens already.
      reqs.push_back({o->chat ? model.chat_prompt(p) : p, {}, sp, o->stop});
      reqs.back().add_special_tokens = !o->chat;
    }
    for (size_t i = 0; i < id_prompts.size(); ++i)
      reqs.push_back({o->prompt_ids[i], id_prompts[i], sp, o->stop});
    for (size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].lora = loras[i];
      reqs[i].prompt_adapter = prompt_adapter;
    }
    auto outputs = model.generate(reqs);
    // The samples of each prompt follow one another.
    auto prompt_of = [&](size_t i) { return i / static_cast<size_t>(sp.n); };
    if (o->json) {
      auto all = nlohmann::json::array();
      for (size_t k = 0; k < outputs.size(); ++k) {
        auto& out = outputs[k];
        auto i = prompt_of(k);
        all.push_back(
          {{"prompt", i < o->prompts.size() ? o->prompts[i] : out.prompt},
           {"index", out.index},
           {"prompt_token_ids", out.prompt_token_ids},
           {"text", out.text},
           {"token_ids", out.token_ids},
           {"logprobs", out.logprobs},
           {"ranks", out.ranks},
           {"finish_reason", to_string(out.finish_reason)},
           {"lora", loras[i] ? nlohmann::json(loras[i]->lora_name) : nlohmann::json()}});
        if (sp.prompt_logprobs >= 0) {
          auto& list = all.back()["prompt_logprobs"] = nlohmann::json::array({nullptr});
          for (auto& p : out.prompt_logprobs) {
            auto top = nlohmann::json::array();
            for (auto& t : p.top_logprobs)
              top.push_back({{"token", t.token}, {"logprob", t.logprob}});
            list.push_back({{"token", p.token},
                            {"logprob", p.logprob},
                            {"rank", p.rank},
                            {"top_logprobs", top}});
          }
        }
      }
      std::cout << all.dump(2) << std::endl;
    } else {
      for (size_t k = 0; k < outputs.size(); ++k) {
        auto& out = outputs[k];
        auto i = prompt_of(k);
        if (out.index == 0) {
          auto shown = i < o->prompts.size() ? o->prompts[i] : out.prompt;
          std::cout << "prompt: " << shown
                    << (loras[i] ? " [lora " + loras[i]->lora_name + "]" : "") << "\n";
        }
        auto label = sp.n > 1 ? "output " + std::to_string(out.index) : std::string{"output"};
        if (model.has_tokenizer())
          std::cout << label << ": " << out.text << "\n" << (out.index + 1 == sp.n ? "\n" : "");
        else
          std::cout << label << " ids: " << nlohmann::json(out.token_ids).dump() << "\n"
                    << (out.index + 1 == sp.n ? "\n" : "");
      }
      std::cout << model.last_tokens_per_second() << " generated tokens/s" << std::endl;
    }
    return 0;
  };
  return cmd;
}

} // namespace troupe::cli
