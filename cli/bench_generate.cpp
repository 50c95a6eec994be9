// `troupe bench generate`: offline throughput like vLLM's benchmark_throughput: N random
// prompts of I tokens, O output tokens each, all submitted at once.

#include "cli/commands.hpp"

#include "model/checkpoint.hpp"
#include "troupe/llm.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <random>

namespace troupe::cli {

void add_workload_options(CLI::App& app, workload_options& o) {
  app.add_option("--num-prompts", o.num_prompts, "Requests")
    ->check(CLI::Range(1, 100000))
    ->capture_default_str();
  app.add_option("--input-len", o.input_len, "Prompt tokens per request")
    ->check(CLI::Range(1, 100000))
    ->capture_default_str();
  app.add_option("--output-len", o.output_len, "Generated tokens per request")
    ->check(CLI::Range(2, 100000))
    ->capture_default_str();
  app
    .add_option("--shared-prefix-len", o.shared_prefix_len,
                "Tokens before each prompt that all prompts share")
    ->check(CLI::Range(0, 1000000))
    ->capture_default_str();
}

double quantile(std::vector<double> values, double q) {
  if (values.empty())
    return 0.0;
  std::sort(values.begin(), values.end());
  return values[std::min(values.size() - 1, static_cast<size_t>(q * values.size()))];
}

std::vector<generation_request> make_workload(const workload_options& o, const std::string& model,
                                              uint32_t seed) {
  auto vocab = checkpoint::config_of(model).vocab_size;
  std::mt19937 shared_rng{0x5eed};
  std::vector<int32_t> shared;
  for (int t = 0; t < o.shared_prefix_len; ++t)
    shared.push_back(static_cast<int32_t>(shared_rng() % static_cast<uint32_t>(vocab)));
  std::mt19937 rng{seed};
  std::vector<generation_request> reqs;
  for (int i = 0; i < o.num_prompts; ++i) {
    generation_request r;
    r.prompt_token_ids = shared;
    for (int t = 0; t < o.input_len; ++t)
      r.prompt_token_ids.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab)));
    r.sampling.temperature = 0.0f;
    r.sampling.max_tokens = o.output_len;
    r.sampling.ignore_eos = true; // every request produces output_len tokens
    reqs.push_back(std::move(r));
  }
  return reqs;
}

std::shared_ptr<command> add_bench_generate(CLI::App& bench) {
  struct options {
    std::string model;
    workload_options work;
    int tp = 1;
    std::string async_scheduling = "off";
    std::string prefix_caching = "on";
    std::vector<int64_t> linger_us{executor_config{}.linger.count()};
    int rounds = 3;
    std::string guided_json;
    bool json = false;
    device_options device;
    node_options nodes;
  };
  auto o = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  auto* sub = bench.add_subcommand("generate", "Request throughput and time per output token");
  cmd->app = sub;
  sub->add_option("--model", o->model, "Hugging Face model directory or GGUF file")->required();
  add_workload_options(*sub, o->work);
  sub->add_option("--tensor-parallel-size", o->tp, "Worker actors")
    ->check(CLI::Range(1, 64))
    ->capture_default_str();
  sub
    ->add_option("--async-scheduling", o->async_scheduling,
                 "Send each step before the one in flight returns (on), wait for it (off), "
                 "or both, in turns, with the ratio")
    ->check(CLI::IsMember({"on", "off", "both"}))
    ->capture_default_str();
  sub
    ->add_option("--prefix-caching", o->prefix_caching,
                 "Automatic prefix caching on, off, or both, in turns, with the ratio")
    ->check(CLI::IsMember({"on", "off", "both"}))
    ->capture_default_str();
  sub
    ->add_option("--linger-us", o->linger_us,
                 "How long the executor's threads stay awake around a step "
                 "(executor_config::linger); several values, comma-separated, take turns")
    ->delimiter(',')
    ->check(CLI::Range(int64_t{0}, max_linger.count()))
    ->capture_default_str();
  sub
    ->add_option("--rounds", o->rounds,
                 "With more than one setting (--async-scheduling both, several --linger-us): "
                 "runs of each, in turns; the medians count")
    ->check(CLI::Range(1, 100))
    ->capture_default_str();
  sub
    ->add_option("--guided-json", o->guided_json,
                 "A JSON schema file every request's output must hold to (structured output); "
                 "the outputs then end when their JSON does, before --output-len")
    ->check(CLI::ExistingFile);
  sub->add_flag("--json", o->json, "Print only the JSON result (the last line)");
  add_device_options(*sub, o->device);
  add_node_options(*sub, o->nodes);
  cmd->run = [o] {
    auto reqs = make_workload(o->work, o->model);
    if (!o->guided_json.empty()) {
      auto schema = read_text_file("--guided-json", o->guided_json);
      for (auto& r : reqs) {
        r.sampling.guided_json = schema;
        r.sampling.ignore_eos = false; // the JSON's end ends the output
      }
    }
    struct setting {
      bool async_scheduling;
      int64_t linger_us;
      bool prefix_caching;
    };
    auto chosen = [](const std::string& option, bool on) {
      return option == "both" || (option == "on") == on;
    };
    std::vector<setting> settings;
    for (auto caching : {true, false})
      for (auto on : {false, true})
        if (chosen(o->prefix_caching, caching) && chosen(o->async_scheduling, on))
          for (auto linger : o->linger_us)
            settings.push_back({on, linger, caching});
    auto make = [&](const setting& s) {
      llm_config cfg;
      cfg.worker.model_path = o->model;
      cfg.executor.tensor_parallel_size = o->tp;
      cfg.executor.linger = std::chrono::microseconds(s.linger_us);
      cfg.scheduler.async_scheduling = s.async_scheduling;
      cfg.scheduler.enable_prefix_caching = s.prefix_caching;
      apply_device_options(o->device, cfg.executor, cfg.worker);
      apply_node_options(o->nodes, cfg.executor);
      cfg.executor.max_model_len =
        o->work.shared_prefix_len + o->work.input_len + o->work.output_len + 1;
      return std::make_unique<llm>(cfg);
    };
    auto run = [&](llm& model, const setting& s) {
      // Each run starts cold: the rounds before it cached the same prompts.
      model.reset_prefix_cache();
      auto before = model.stats();
      auto start = std::chrono::steady_clock::now();
      // Step by step, to read the engine's own time per step as the outputs grow.
      std::vector<generation_output> outs(reqs.size());
      std::map<int64_t, size_t> index;
      for (size_t i = 0; i < reqs.size(); ++i)
        index[model.add_request(reqs[i])] = i;
      std::vector<double> host_ms, host_cpu_ms;
      while (model.has_unfinished_requests()) {
        for (auto& u : model.step())
          if (u.finished)
            outs[index.at(u.request_id)] = std::move(*u.output);
        host_ms.push_back(model.stats().last_step_host_seconds * 1e3);
        host_cpu_ms.push_back(model.stats().last_step_host_cpu_seconds * 1e3);
      }
      model.executor().stop_remote_worker_execution_loop();
      std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      // The engine's time per step early in the outputs (steps 100-199, or the first tenth)
      // and at their end (the last hundred), median each: flat when nothing grows with the
      // output's length.
      auto median_of = [&](const std::vector<double>& ms, size_t from, size_t to) {
        to = std::min(to, ms.size());
        from = std::min(from, to);
        return quantile(std::vector<double>(ms.begin() + from, ms.begin() + to), 0.5);
      };
      size_t early = host_ms.size() >= 400 ? 100 : host_ms.size() / 10;
      size_t late = host_ms.size() > 100 ? host_ms.size() - 100 : 0;
      double host_early = median_of(host_ms, early, early + 100);
      double host_late = median_of(host_ms, late, host_ms.size());
      double host_cpu_early = median_of(host_cpu_ms, early, early + 100);
      double host_cpu_late = median_of(host_cpu_ms, late, host_cpu_ms.size());
      auto after = model.stats();
      size_t tokens = 0;
      std::vector<double> tpot_ms, ttft_ms;
      for (auto& out : outs) {
        tokens += out.token_ids.size();
        ttft_ms.push_back(out.first_token_seconds * 1e3);
        if (out.token_ids.size() > 1)
          tpot_ms.push_back((out.finished_seconds - out.first_token_seconds) * 1e3 /
                            static_cast<double>(out.token_ids.size() - 1));
      }
      auto at = [&](double q) { return quantile(tpot_ms, q); };
      nlohmann::json result = {
        {"model", o->model},
        {"num_prompts", o->work.num_prompts},
        {"input_len", o->work.input_len},
        {"output_len", o->work.output_len},
        {"tensor_parallel_size", o->tp},
        {"async_scheduling", s.async_scheduling},
        {"linger_us", s.linger_us},
        {"nodes", o->nodes.nodes.size()},
        {"device", o->device.device},
        {"dtype", o->device.dtype},
        {"enforce_eager", o->device.enforce_eager},
        {"elapsed_s", took.count()},
        {"requests_per_s", o->work.num_prompts / took.count()},
        {"output_tokens_per_s", static_cast<double>(tokens) / took.count()},
        {"tpot_p50_ms", at(0.5)},
        {"tpot_p99_ms", at(0.99)},
        {"ttft_p50_ms", quantile(ttft_ms, 0.5)},
        {"ttft_p99_ms", quantile(ttft_ms, 0.99)},
        {"shared_prefix_len", o->work.shared_prefix_len},
        {"prefix_caching", s.prefix_caching},
        {"prefill_tokens", after.prefill_tokens - before.prefill_tokens},
        {"prefix_cache_queries", after.prefix_cache_queries - before.prefix_cache_queries},
        {"prefix_cache_hits", after.prefix_cache_hits - before.prefix_cache_hits},
        {"steps", host_ms.size()},
        {"host_ms_per_step_early", host_early},
        {"host_ms_per_step_late", host_late},
        {"host_cpu_ms_per_step_early", host_cpu_early},
        {"host_cpu_ms_per_step_late", host_cpu_late},
      };
      if (!o->guided_json.empty()) {
        // The masks' share of a step: their time over the steps', both per step.
        auto masks = after.structured_output_seconds - before.structured_output_seconds;
        auto steps = static_cast<double>(std::max<size_t>(1, host_ms.size()));
        result["structured_output_ms_per_step"] = masks * 1e3 / steps;
        result["step_ms"] = took.count() * 1e3 / steps;
        result["structured_output_share"] = masks / took.count();
      }
      if (!o->json)
        std::cout << o->work.num_prompts << " requests in " << took.count() << " s"
                  << (s.async_scheduling ? " (asynchronous scheduling)" : "")
                  << (s.prefix_caching ? "" : " (no prefix caching)") << ", linger " << s.linger_us
                  << " us: " << result["requests_per_s"].get<double>() << " requests/s, "
                  << result["output_tokens_per_s"].get<double>()
                  << " output tokens/s, time per output token p50 " << at(0.5) << " ms, p99 "
                  << at(0.99) << " ms\n";
      return result;
    };
    if (settings.size() == 1) {
      std::cout << run(*make(settings[0]), settings[0]).dump() << std::endl;
      return 0;
    }
    // Every engine stays loaded and they take turns, so that drift on a shared machine
    // hits all of them.
    std::vector<std::unique_ptr<llm>> models;
    for (auto& s : settings)
      models.push_back(make(s));
    std::vector<std::vector<nlohmann::json>> runs(settings.size());
    for (int i = 0; i < o->rounds; ++i)
      for (size_t k = 0; k < settings.size(); ++k)
        runs[k].push_back(run(*models[k], settings[k]));
    auto tokens_per_s = [](const nlohmann::json& r) {
      return r["output_tokens_per_s"].get<double>();
    };
    nlohmann::json medians = nlohmann::json::array();
    for (auto& each : runs) {
      std::sort(each.begin(), each.end(), [&](const nlohmann::json& a, const nlohmann::json& b) {
        return tokens_per_s(a) < tokens_per_s(b);
      });
      auto median = each[each.size() / 2];
      auto first = medians.empty() ? tokens_per_s(median) : tokens_per_s(medians[0]);
      median["over_first_tokens_per_s"] = tokens_per_s(median) / first;
      medians.push_back(median);
    }
    if (!o->json)
      for (auto& m : medians)
        std::cout << "median of " << o->rounds
                  << (m["async_scheduling"].get<bool>() ? ", asynchronous scheduling" : "")
                  << (m["prefix_caching"].get<bool>() ? "" : ", no prefix caching") << ", linger "
                  << m["linger_us"].get<int64_t>() << " us: " << tokens_per_s(m)
                  << " output tokens/s, " << m["over_first_tokens_per_s"].get<double>()
                  << "x the first\n";
    std::cout << nlohmann::json{{"medians", medians}}.dump() << std::endl;
    return 0;
  };
  return cmd;
}

} // namespace troupe::cli
