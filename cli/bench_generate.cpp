// `troupe bench generate`: offline throughput like vLLM's benchmark_throughput: N random
// prompts of I tokens, O output tokens each, all submitted at once.

#include "cli/commands.hpp"

#include "model/checkpoint.hpp"
#include "troupe/llm.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
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
}

double quantile(std::vector<double> values, double q) {
  if (values.empty())
    return 0.0;
  std::sort(values.begin(), values.end());
  return values[std::min(values.size() - 1, static_cast<size_t>(q * values.size()))];
}

std::vector<generation_request> make_workload(const workload_options& o,
                                              const std::string& model) {
  auto vocab = checkpoint::config_of(model).vocab_size;
  std::mt19937 rng{0};
  std::vector<generation_request> reqs;
  for (int i = 0; i < o.num_prompts; ++i) {
    generation_request r;
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
    int rounds = 3;
    bool json = false;
    device_options device;
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
  sub->add_option("--async-scheduling", o->async_scheduling,
                  "Send each step before the one in flight returns (on), wait for it (off), "
                  "or both, one after the other, with the ratio")
    ->check(CLI::IsMember({"on", "off", "both"}))
    ->capture_default_str();
  sub->add_option("--rounds", o->rounds,
                  "With --async-scheduling both: runs of each, alternating; the medians count")
    ->check(CLI::Range(1, 100))
    ->capture_default_str();
  sub->add_flag("--json", o->json, "Print only the JSON result (the last line)");
  add_device_options(*sub, o->device);
  cmd->run = [o] {
    auto reqs = make_workload(o->work, o->model);
    auto make = [&](bool async_scheduling) {
      llm_config cfg;
      cfg.worker.model_path = o->model;
      cfg.executor.tensor_parallel_size = o->tp;
      cfg.scheduler.async_scheduling = async_scheduling;
      apply_device_options(o->device, cfg.executor, cfg.worker);
      cfg.executor.max_model_len = o->work.input_len + o->work.output_len + 1;
      return std::make_unique<llm>(cfg);
    };
    auto run = [&](llm& model, bool async_scheduling) {
      auto start = std::chrono::steady_clock::now();
      auto outs = model.generate(reqs);
      std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      size_t tokens = 0;
      std::vector<double> tpot_ms;
      for (auto& out : outs) {
        tokens += out.token_ids.size();
        if (out.token_ids.size() > 1)
          tpot_ms.push_back((out.finished_seconds - out.first_token_seconds) * 1e3
                            / static_cast<double>(out.token_ids.size() - 1));
      }
      auto at = [&](double q) { return quantile(tpot_ms, q); };
      nlohmann::json result = {
        {"model", o->model},
        {"num_prompts", o->work.num_prompts},
        {"input_len", o->work.input_len},
        {"output_len", o->work.output_len},
        {"tensor_parallel_size", o->tp},
        {"async_scheduling", async_scheduling},
        {"device", o->device.device},
        {"dtype", o->device.dtype},
        {"enforce_eager", o->device.enforce_eager},
        {"elapsed_s", took.count()},
        {"requests_per_s", o->work.num_prompts / took.count()},
        {"output_tokens_per_s", static_cast<double>(tokens) / took.count()},
        {"tpot_p50_ms", at(0.5)},
        {"tpot_p99_ms", at(0.99)},
      };
      if (!o->json)
        std::cout << o->work.num_prompts << " requests in " << took.count() << " s"
                  << (async_scheduling ? " (asynchronous scheduling)" : "") << ": "
                  << result["requests_per_s"].get<double>() << " requests/s, "
                  << result["output_tokens_per_s"].get<double>() << " output tokens/s, "
                  << "time per output token p50 " << at(0.5) << " ms, p99 " << at(0.99)
                  << " ms\n";
      return result;
    };
    if (o->async_scheduling != "both") {
      bool on = o->async_scheduling == "on";
      std::cout << run(*make(on), on).dump() << std::endl;
      return 0;
    }
    // Both engines stay loaded and take turns, so that drift on a shared machine hits both.
    auto off_model = make(false);
    auto on_model = make(true);
    std::vector<nlohmann::json> offs, ons;
    for (int i = 0; i < o->rounds; ++i) {
      offs.push_back(run(*off_model, false));
      ons.push_back(run(*on_model, true));
    }
    auto median = [](std::vector<nlohmann::json> runs) {
      std::sort(runs.begin(), runs.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
        return a["output_tokens_per_s"].get<double>() < b["output_tokens_per_s"].get<double>();
      });
      return runs[runs.size() / 2];
    };
    auto off = median(offs);
    auto on = median(ons);
    auto ratio = on["output_tokens_per_s"].get<double>() / off["output_tokens_per_s"].get<double>();
    if (!o->json)
      std::cout << "asynchronous scheduling: " << ratio << "x the output tokens/s (medians of "
                << o->rounds << " runs each)\n";
    nlohmann::json both = {{"off", off}, {"on", on}, {"on_over_off_tokens_per_s", ratio}};
    std::cout << both.dump() << std::endl;
    return 0;
  };
  return cmd;
}

} // namespace troupe::cli
