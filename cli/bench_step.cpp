// `troupe bench step`: prefill and decode throughput of one model step through the
// executor, next to the memory-bandwidth floor of a decode step on this machine.

#include "cli/commands.hpp"

#include "model/checkpoint.hpp"
#include "troupe/device.hpp"
#include "troupe/errors.hpp"
#include "troupe/executor.hpp"
#include "troupe/model_worker.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

namespace troupe::cli {

namespace {

using clock_type = std::chrono::steady_clock;

/// The same on GPU 0: a copy of 1 GiB between two of its buffers, best of a few.
double gpu_copy_bandwidth() {
  const size_t bytes = size_t{1} << 30;
  auto dev = make_device(device_kind::cuda, 0);
  device_buffer src;
  device_buffer dst;
  try {
    src = device_buffer(*dev, bytes, memory_tag::kv_cache);
    dst = device_buffer(*dev, bytes, memory_tag::kv_cache);
  } catch (const error&) {
    throw error{errc::memory_error, "bench step: no room on cuda:0 for the bandwidth copy"};
  }
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    auto start = clock_type::now();
    dev->copy(dst.data(), src.data(), bytes); // waits for the copy
    std::chrono::duration<double> took = clock_type::now() - start;
    best = std::max(best, 2.0 * static_cast<double>(bytes) / took.count());
  }
  return best;
}

/// The bandwidth a decode step's weights can be read at: on the CPU, every core summing
/// its share of a buffer larger than the caches (a read, as the weights are read); on a
/// GPU, a device-to-device copy.
double read_bandwidth(const std::string& device) {
  if (device == "cuda")
    return gpu_copy_bandwidth();
  std::vector<uint64_t> buffer((size_t{512} << 20) / sizeof(uint64_t), 1);
  return cpu_read_bandwidth(buffer.data(), buffer.size() * sizeof(uint64_t),
                            std::max(1u, std::thread::hardware_concurrency()), 5);
}

} // namespace

double cpu_read_bandwidth(const void* data, size_t bytes, unsigned threads, int rounds) {
  const size_t words = bytes / sizeof(uint64_t);
  auto at = static_cast<const uint64_t*>(data);
  std::vector<uint64_t> sums(threads);
  double best = 0;
  for (int i = 0; i < rounds; ++i) {
    auto start = clock_type::now();
    std::vector<std::thread> readers;
    for (unsigned t = 0; t < threads; ++t)
      readers.emplace_back([&, t] {
        uint64_t sum = 0;
        for (size_t w = words * t / threads; w < words * (t + 1) / threads; ++w)
          sum += at[w];
        sums[t] = sum;
      });
    for (auto& r : readers)
      r.join();
    std::chrono::duration<double> took = clock_type::now() - start;
    best = std::max(best, static_cast<double>(words * sizeof(uint64_t)) / took.count());
  }
  // Used, so that the reads are not optimized away.
  volatile uint64_t total = std::accumulate(sums.begin(), sums.end(), uint64_t{0});
  (void)total;
  return best;
}

std::shared_ptr<command> add_bench_step(CLI::App& bench) {
  struct options {
    std::string model;
    int batch = 1;
    int tp = 1;
    int prompt_len = 64;
    int decode_steps = 16;
    bool json = false;
    device_options device;
    node_options nodes;
  };
  auto o = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  auto* sub = bench.add_subcommand("step", "Prefill and decode tokens per second of a model");
  cmd->app = sub;
  sub->add_option("--model", o->model, "Hugging Face model directory")->required();
  sub->add_option("--batch", o->batch, "Sequences per step")
    ->check(CLI::Range(1, 4096))
    ->capture_default_str();
  sub->add_option("--tensor-parallel-size", o->tp, "Worker actors")
    ->check(CLI::Range(1, 64))
    ->capture_default_str();
  sub->add_option("--prompt-len", o->prompt_len, "Prompt tokens per sequence")
    ->check(CLI::Range(1, 100000))
    ->capture_default_str();
  sub->add_option("--decode-steps", o->decode_steps, "Decode steps measured")
    ->check(CLI::Range(1, 100000))
    ->capture_default_str();
  sub->add_flag("--json", o->json, "Print only the JSON result");
  add_device_options(*sub, o->device);
  add_node_options(*sub, o->nodes);
  cmd->run = [o] {
    const int block_size = 16;
    executor_config cfg;
    model_worker_options mw;
    cfg.tensor_parallel_size = o->tp;
    apply_device_options(o->device, cfg, mw);
    apply_node_options(o->nodes, cfg);
    cfg.block_size = block_size;
    // Two decode steps before the measured ones: the first runs call by call, the second
    // records the step's CUDA graph (on a GPU).
    const int warmup_steps = 2;
    cfg.max_model_len = o->prompt_len + warmup_steps + o->decode_steps + 1;
    cfg.rpc_timeout = std::chrono::minutes(10);
    mw.model_path = o->model;
    mw.max_num_seqs = o->batch;
    mw.max_num_batched_tokens = o->batch * o->prompt_len;
    auto blocks_per_seq =
      (o->prompt_len + warmup_steps + o->decode_steps + block_size) / block_size;
    // Ranks on nodes run the same model worker with the same options.
    cfg.cluster.node_worker_kind = "model";
    cfg.cluster.node_worker_options = to_settings(mw);
    executor exec{cfg, model_worker_factory(mw)};
    // What the loaded model costs this process (its local workers, their weights).
    auto resident_after_load = resident_bytes();
    // The bytes a decode step reads at least once: every weight the workers hold, local or
    // on nodes.
    int64_t weight_bytes = 0;
    for (auto& health : exec.worker_healths())
      for (auto& u : health.memory)
        if (u.tag == memory_tag::weights)
          weight_bytes += u.allocated_bytes;
    auto available = exec.determine_num_available_blocks();
    int64_t needed = static_cast<int64_t>(o->batch) * blocks_per_seq;
    if (available.num_device_blocks < needed)
      throw error{errc::invalid_argument,
                  "the KV cache holds " + std::to_string(available.num_device_blocks) +
                    " blocks, the benchmark needs " + std::to_string(needed)};
    exec.initialize_cache({needed, 0});

    auto model_cfg = checkpoint::config_of(o->model);
    auto vocab = model_cfg.vocab_size;
    std::mt19937 rng{7};
    execute_model_request req;
    for (int s = 0; s < o->batch; ++s) {
      sequence_group_metadata g;
      g.request_id = "b" + std::to_string(s);
      g.is_prompt = true;
      g.sampling.temperature = 0.0f;
      sequence_data seq;
      seq.seq_id = s;
      for (int t = 0; t < o->prompt_len; ++t)
        seq.token_ids.push_back(static_cast<int32_t>(rng() % vocab));
      seq.num_prompt_tokens = o->prompt_len;
      for (int b = 0; b < blocks_per_seq; ++b)
        seq.block_table.push_back(s * blocks_per_seq + b);
      g.seqs.push_back(seq);
      g.token_chunk_size = o->prompt_len;
      req.seq_group_metadata_list.push_back(g);
    }
    auto advance = [&](const sampler_output& out) {
      for (size_t i = 0; i < req.seq_group_metadata_list.size(); ++i) {
        auto& g = req.seq_group_metadata_list[i];
        g.seqs[0].num_computed_tokens += g.token_chunk_size;
        g.seqs[0].token_ids.push_back(out.outputs[i].samples[0].output_token);
        g.token_chunk_size = 1;
        g.is_prompt = false;
      }
    };
    // One prefill before the measured one, as llama-bench warms up: the first touches the
    // KV cache's and the activations' pages, which a serving engine pays once, not per
    // prompt. The measured prefill writes the same cache slots again.
    exec.execute_model(req);
    auto start = clock_type::now();
    auto out = exec.execute_model(req);
    std::chrono::duration<double> prefill = clock_type::now() - start;
    advance(out[0]);
    for (int step = 0; step < warmup_steps; ++step)
      advance(exec.execute_model(req)[0]);
    // The median step: a step whose sequences cross into a wider block table records a new
    // CUDA graph, which should not count as decoding.
    std::vector<double> steps;
    for (int step = 0; step < o->decode_steps; ++step) {
      start = clock_type::now();
      advance(exec.execute_model(req)[0]);
      steps.push_back(std::chrono::duration<double>(clock_type::now() - start).count());
    }
    std::sort(steps.begin(), steps.end());
    // A mixture's experts: which each rank holds and the tokens they took in the last step.
    auto experts = nlohmann::json::array();
    if (model_cfg.num_experts > 0)
      for (auto& m : exec.collective_rpc("expert_load")) {
        auto load = m.get_as<int64_t>(0);
        experts.push_back({{"rank", experts.size()},
                           {"first_expert", load},
                           {"experts", m.get_as<int64_t>(1)},
                           {"tokens_last_step", m.get_as<int64_t>(2)}});
      }
    exec.stop_remote_worker_execution_loop();
    exec.shutdown();

    auto bandwidth = read_bandwidth(o->device.device);
    double step_s = steps[steps.size() / 2];
    double floor_step_s = static_cast<double>(weight_bytes) / bandwidth;
    nlohmann::json result = {
      {"model", o->model},
      {"batch", o->batch},
      {"tensor_parallel_size", o->tp},
      {"device", o->device.device},
      {"dtype", o->device.dtype},
      {"enforce_eager", o->device.enforce_eager},
      {"prompt_len", o->prompt_len},
      {"prefill_tokens_per_s", o->batch * o->prompt_len / prefill.count()},
      {"decode_tokens_per_s", o->batch / step_s},
      {"decode_step_ms", step_s * 1e3},
      {"weight_bytes", weight_bytes},
      {"resident_bytes_after_load", resident_after_load},
      {"read_bytes_per_s", bandwidth},
      {"bandwidth_floor_step_ms", floor_step_s * 1e3},
      {"bandwidth_bound_decode_tokens_per_s", o->batch / floor_step_s},
    };
    if (model_cfg.num_experts > 0) {
      result["enable_expert_parallel"] = o->device.expert_parallel;
      result["expert_load"] = experts;
    }
    if (!o->json)
      std::cout << "prefill " << result["prefill_tokens_per_s"].get<double>()
                << " tokens/s, decode " << result["decode_tokens_per_s"].get<double>()
                << " tokens/s (" << step_s * 1e3 << " ms a step; reading the weights once at "
                << bandwidth / 1e9 << " GB/s takes " << floor_step_s * 1e3 << " ms); "
                << resident_after_load / (1 << 20) << " MiB resident after load\n";
    std::cout << result.dump() << std::endl;
    return 0;
  };
  return cmd;
}

} // namespace troupe::cli
