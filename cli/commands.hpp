#pragma once

#include "troupe/config.hpp"
#include "troupe/llm.hpp"
#include "troupe/worker.hpp"

#include <CLI/CLI.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace troupe::cli {

/// A parsed subcommand: `*this` is true when it was given on the command line.
struct command {
  CLI::App* app = nullptr;
  std::function<int()> run;
  explicit operator bool() const {
    return app != nullptr && app->parsed();
  }
};

/// Bytes per second at which `threads` threads sum the 64-bit words of `bytes` at `data`,
/// each its share, the best of `rounds`: the read floor the benchmarks compare with.
double cpu_read_bandwidth(const void* data, size_t bytes, unsigned threads, int rounds);

/// `troupe bench rpc`: collective_rpc latency of a no-op method.
std::shared_ptr<command> add_bench_rpc(CLI::App& bench);

/// `troupe bench kernels`: the CPU's attention and 16-bit row product at a model's shapes.
std::shared_ptr<command> add_bench_kernels(CLI::App& bench);

/// `troupe bench step`: prefill and decode throughput of a model.
std::shared_ptr<command> add_bench_step(CLI::App& bench);

/// `troupe bench generate`: offline request throughput and time per output token.
std::shared_ptr<command> add_bench_generate(CLI::App& bench);

/// `troupe bench recovery`: time from a worker's death to the next step, under a restart
/// policy.
std::shared_ptr<command> add_bench_recovery(CLI::App& bench);

/// `troupe bench sleep`: level-1 sleep and wake bandwidth of a device against plain copies.
std::shared_ptr<command> add_bench_sleep(CLI::App& bench);

/// `troupe generate`: text from a model.
std::shared_ptr<command> add_generate(CLI::App& app);

/// `troupe serve`.
std::shared_ptr<command> add_serve(CLI::App& app);

/// `troupe perplexity`: perplexity over a text and the KL divergence from a base model.
std::shared_ptr<command> add_perplexity(CLI::App& app);

/// "NAME=PATH" of --lora and --prompt-adapter (`flag` names the option in the error).
std::pair<std::string, std::string> name_and_path(const std::string& flag, const std::string& text);

/// The contents of a file, without a trailing newline; throws `invalid_argument` naming
/// `flag` when it cannot be read or is empty.
std::string read_text_file(const std::string& flag, const std::string& path);

/// `troupe bench serve`.
std::shared_ptr<command> add_bench_serve(CLI::App& bench);

/// The `q` quantile (0..1) of `values` (unsorted), by the nearest rank; 0 when empty.
double quantile(std::vector<double> values, double q);

/// `troupe node`: a worker node with the worker kinds "model" and "bench".
std::shared_ptr<command> add_node(CLI::App& app);

/// Where the workers of an executor live, from the command line.
struct node_options {
  std::vector<std::string> nodes;
  std::vector<std::string> spare_nodes;
  std::string secret_file;
  std::string tls_certificate;
  std::string tls_key;
  std::string tls_ca;
  int timeout_ms = 3000;
  int64_t network_linger_us = executor_config{}.cluster.network_linger.count();
  bool node_links = executor_config{}.cluster.node_links;
  bool node_local_links = executor_config{}.cluster.node_local_links;
  bool node_shared_memory = executor_config{}.cluster.node_shared_memory;
};

/// Adds --nodes, --spare-nodes, --secret-file, --tls-cert/--tls-key/--tls-ca,
/// --node-timeout-ms, --network-linger-us, --node-links, --node-local-links and
/// --node-shared-memory to `app`.
void add_node_options(CLI::App& app, node_options& o);

/// Puts the nodes, the secret and the timeout into `cfg`; throws `invalid_argument` for a
/// malformed node, a missing or empty secret file.
void apply_node_options(const node_options& o, executor_config& cfg);

/// The contents of a secret file, without a trailing newline.
std::string read_secret(const std::string& path);

/// The device the local workers compute on and how the model is split over them, from the
/// command line.
struct device_options {
  std::string device = "cpu";
  std::string dtype = "auto";
  double gpu_memory_utilization = 0.9;
  bool enforce_eager = false;
  std::string cpu_precision = "exact";
  /// `model_worker_options::enable_expert_parallel`.
  bool expert_parallel = false;
  /// `model_worker_options::weight_cache`; "off" for none.
  std::string weight_cache;

  /// `weight_cache` as the workers take it: empty for none.
  std::string weight_cache_directory() const {
    return weight_cache == "off" ? std::string{} : weight_cache;
  }
};

/// Adds --device, --dtype, --gpu-memory-utilization, --enforce-eager, --cpu-precision and
/// --weight-cache to `app`.
void add_device_options(CLI::App& app, device_options& o);

/// Puts the device options into the executor's and the workers' configuration.
void apply_device_options(const device_options& o, executor_config& executor,
                          model_worker_options& worker);

/// How `generate` and `serve` run the model: the model, its split, memory, scheduling,
/// recovery, adapters, nodes and device (the flags the two share).
struct engine_options {
  std::string model;
  int tp = 1;
  int64_t kv_cache_memory = 0;
  double kv_fraction = 0.5;
  int64_t swap_space_mib = 256;
  bool async_scheduling = false;
  bool prefix_caching = true;
  int max_num_seqs = 0;
  int max_num_batched_tokens = 0;
  int max_restarts = 0;
  double restart_window_s = 60;
  int max_model_len = 0;
  int max_loras = 0;
  int max_lora_rank = 16;
  int max_prompt_adapter_token = 0;
  std::string chat_template;
  node_options nodes;
  device_options device;
};

/// Adds the flags of `engine_options` to `app`.
void add_engine_options(CLI::App& app, engine_options& o);

/// The model's configuration from the flags; `loras` adapters come with it (for the
/// default of --max-loras). Throws `invalid_argument` for a malformed node.
llm_config engine_config(const engine_options& o, size_t loras);

/// The batch a generation benchmark runs: random prompts of `input_len` tokens, each
/// generating exactly `output_len` greedily (vLLM's benchmark_throughput), after a prefix
/// of `shared_prefix_len` tokens that all of them share (a system prompt, as in vLLM's
/// benchmark_prefix_caching).
struct workload_options {
  int num_prompts = 16;
  int input_len = 64;
  int output_len = 32;
  int shared_prefix_len = 0;
};

/// Adds --num-prompts, --input-len, --output-len and --shared-prefix-len to `app`.
void add_workload_options(CLI::App& app, workload_options& o);

/// The requests of `o` for `model`, the same for the same `seed` (the shared prefix is the
/// same for every seed).
std::vector<generation_request> make_workload(const workload_options& o, const std::string& model,
                                              uint32_t seed = 0);

/// The worker of `troupe bench rpc` (methods "noop" and "spin").
std::unique_ptr<worker> make_bench_worker();

/// `troupe make-model`: a random-weight model in Hugging Face format.
std::shared_ptr<command> add_make_model(CLI::App& app);

/// Resident set size of this process in bytes (the benchmarks report it).
int64_t resident_bytes();

} // namespace troupe::cli
