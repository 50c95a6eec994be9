// `troupe bench recovery`: what a worker's death costs under a restart policy. A model
// worker of one rank throws `worker_fault` at a chosen step of a batch generation, or (with
// --on-node) the node process that holds the last rank is killed (SIGKILL) as the driver
// starts that step; the executor replaces the worker (locally, or from a spare node) and
// the engine computes its requests again. Prints the cold start of the same executor, the
// time from the death to the first step after it, and whether the outputs equal an
// undisturbed run's.

#include "cli/commands.hpp"

#include "actors/cluster/node_auth.hpp"

#include "troupe/errors.hpp"
#include "troupe/llm.hpp"
#include "troupe/model_worker.hpp"

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <vector>

#include <csignal>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace troupe::cli {

namespace {

using clock_type = std::chrono::steady_clock;

/// When the fault struck and when each driver step ended, shared by a worker and its
/// replacement; `strike` is the fault (it may throw).
struct fault_log {
  std::atomic<bool> armed{true};
  std::mutex mtx;
  clock_type::time_point death;
  std::vector<clock_type::time_point> driver_steps;
  std::function<void()> strike;
};

/// A model worker that strikes at its `at`-th step on `rank`, once.
class dying_model_worker : public model_worker {
public:
  dying_model_worker(model_worker_options options, int32_t rank, int at,
                     std::shared_ptr<fault_log> log)
    : model_worker(std::move(options)), fail_rank_(rank), at_(at), log_(std::move(log)) {}

  std::vector<sampler_output> execute_model(const execute_model_request& request) override {
    if (rank() == fail_rank_ && ++steps_ == at_ && log_->armed.exchange(false)) {
      {
        std::lock_guard<std::mutex> lk{log_->mtx};
        log_->death = clock_type::now();
      }
      log_->strike();
    }
    auto out = model_worker::execute_model(request);
    if (rank() == 0) {
      std::lock_guard<std::mutex> lk{log_->mtx};
      log_->driver_steps.push_back(clock_type::now());
    }
    return out;
  }

private:
  int32_t fail_rank_;
  int at_;
  int steps_ = 0;
  std::shared_ptr<fault_log> log_;
};

/// A `troupe node` with one CPU worker slot, started from this executable on a loopback
/// port; killed with SIGKILL when it goes.
class node_process {
public:
  explicit node_process(const std::string& secret_file) {
    int out[2];
    if (pipe(out) != 0)
      throw error{errc::worker_error, "bench recovery: cannot make a pipe for a node"};
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    std::vector<std::string> args{"troupe",    "node",  "--listen",      "127.0.0.1:0",
                                  "--devices", "cpu:1", "--secret-file", secret_file};
    std::vector<char*> argv;
    for (auto& a : args)
      argv.push_back(a.data());
    argv.push_back(nullptr);
    auto spawned = posix_spawn(&pid_, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(out[1]);
    if (spawned != 0) {
      close(out[0]);
      throw error{errc::worker_error, "bench recovery: cannot start a node"};
    }
    // "troupe node listening on 127.0.0.1:PORT with ..."
    std::string line;
    char c = 0;
    while (read(out[0], &c, 1) == 1 && c != '\n')
      line += c;
    close(out[0]);
    auto at = line.find("127.0.0.1:");
    if (at == std::string::npos) {
      kill_now();
      throw error{errc::worker_error, "bench recovery: a node said '" + line + "'"};
    }
    port_ = static_cast<uint16_t>(std::stoi(line.substr(at + 10)));
  }
  node_process(const node_process&) = delete;
  node_process& operator=(const node_process&) = delete;
  ~node_process() {
    kill_now();
  }

  uint16_t port() const {
    return port_;
  }

  void kill_now() {
    if (pid_ <= 0)
      return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

private:
  pid_t pid_ = -1;
  uint16_t port_ = 0;
};

} // namespace

std::shared_ptr<command> add_bench_recovery(CLI::App& bench) {
  struct options {
    std::string model;
    int tp = 2;
    int rank = 1;
    int at = 8;
    workload_options work{4, 32, 32};
    bool json = false;
    bool on_node = false;
    device_options device;
  };
  auto o = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  auto* sub = bench.add_subcommand("recovery", "Time from a worker's death to the next step");
  cmd->app = sub;
  sub->add_option("--model", o->model, "Hugging Face model directory or GGUF file")->required();
  sub->add_option("--tensor-parallel-size", o->tp, "Worker actors")
    ->check(CLI::Range(1, 64))
    ->capture_default_str();
  sub->add_option("--rank", o->rank, "The rank whose worker dies")
    ->check(CLI::Range(0, 63))
    ->capture_default_str();
  sub->add_option("--at-step", o->at, "The step of that worker at which it dies")
    ->check(CLI::Range(1, 1000000))
    ->capture_default_str();
  add_workload_options(*sub, o->work);
  sub->add_flag(
    "--on-node", o->on_node,
    "Lease the last rank from a node (a `troupe node` process on loopback, with a "
    "spare one) and kill that node as the driver starts --at-step (--rank is not used)");
  sub->add_flag("--json", o->json, "Print only the JSON result");
  add_device_options(*sub, o->device);
  cmd->run = [o] {
    if (o->rank >= o->tp)
      throw error{errc::invalid_argument, "--rank " + std::to_string(o->rank) +
                                            " is not below --tensor-parallel-size " +
                                            std::to_string(o->tp)};
    auto reqs = make_workload(o->work, o->model);
    llm_config cfg;
    cfg.worker.model_path = o->model;
    cfg.executor.tensor_parallel_size = o->tp;
    cfg.executor.restart.max_restarts = 1;
    apply_device_options(o->device, cfg.executor, cfg.worker);
    cfg.executor.max_model_len =
      o->work.shared_prefix_len + o->work.input_len + o->work.output_len + 1;
    auto worker_options = cfg.worker;
    worker_options.max_num_batched_tokens = cfg.scheduler.max_num_batched_tokens;
    worker_options.max_num_seqs = cfg.scheduler.max_num_seqs;
    auto log = std::make_shared<fault_log>();
    auto rank = static_cast<int32_t>(o->rank);
    auto at = o->at;
    auto strike_at = std::to_string(at);
    log->strike = [strike_at] {
      throw worker_fault{"bench recovery: fault injected at step " + strike_at};
    };
    std::unique_ptr<node_process> node, spare;
    if (o->on_node) {
      if (o->tp < 2)
        throw error{errc::invalid_argument, "--on-node needs --tensor-parallel-size 2 or more"};
      char path[] = "/tmp/troupe-bench-secret-XXXXXX";
      int fd = mkstemp(path);
      if (fd < 0)
        throw error{errc::worker_error, "bench recovery: cannot write a secret file"};
      std::string secret_path = path;
      cfg.executor.cluster.node_secret = random_challenge();
      auto written =
        write(fd, cfg.executor.cluster.node_secret.data(), cfg.executor.cluster.node_secret.size());
      close(fd);
      if (written != static_cast<ssize_t>(cfg.executor.cluster.node_secret.size()))
        throw error{errc::worker_error, "bench recovery: cannot write a secret file"};
      try {
        node = std::make_unique<node_process>(secret_path);
        spare = std::make_unique<node_process>(secret_path);
      } catch (...) {
        std::remove(secret_path.c_str());
        throw;
      }
      std::remove(secret_path.c_str()); // the nodes read it as they started
      cfg.executor.cluster.nodes = {{"127.0.0.1", node->port(), 1}};
      cfg.executor.cluster.spare_nodes = {{"127.0.0.1", spare->port(), 1}};
      // The driver is the one to count steps; the node dies as it starts step `at`.
      rank = 0;
      auto* victim = node.get();
      log->strike = [victim] { victim->kill_now(); };
    }
    auto start = clock_type::now();
    llm model{cfg, [=](int32_t) {
                return std::make_unique<dying_model_worker>(worker_options, rank, at, log);
              }};
    std::chrono::duration<double> cold_start = clock_type::now() - start;
    auto disturbed = model.generate(reqs);
    if (log->armed)
      throw error{errc::invalid_argument, "the run ended before step " + std::to_string(at) +
                                            " of rank " + std::to_string(rank) +
                                            ": nothing died (ask for a smaller --at-step)"};
    double recovery_ms = -1;
    {
      std::lock_guard<std::mutex> lk{log->mtx};
      for (auto t : log->driver_steps)
        if (t > log->death) {
          recovery_ms = std::chrono::duration<double, std::milli>(t - log->death).count();
          break;
        }
    }
    auto undisturbed = model.generate(reqs);
    bool equal = true;
    for (size_t i = 0; i < reqs.size(); ++i)
      equal = equal && disturbed[i].token_ids == undisturbed[i].token_ids;
    nlohmann::json result = {
      {"model", o->model},
      {"tensor_parallel_size", o->tp},
      {"device", o->device.device},
      {"fault_rank", o->on_node ? o->tp - 1 : o->rank},
      {"fault", o->on_node ? "node killed (SIGKILL), replaced from a spare node"
                           : "worker_fault, replaced in this process"},
      {"fault_step", o->at},
      {"num_prompts", o->work.num_prompts},
      {"input_len", o->work.input_len},
      {"output_len", o->work.output_len},
      {"cold_start_s", cold_start.count()},
      {"death_to_next_step_ms", recovery_ms},
      {"outputs_equal_undisturbed", equal},
    };
    if (!o->json)
      std::cout << "rank " << (o->on_node ? o->tp - 1 : o->rank)
                << (o->on_node ? "'s node was killed at step " : " died at its step ") << o->at
                << "; the next step ended " << recovery_ms
                << " ms later (a cold start of the executor took " << cold_start.count()
                << " s); outputs " << (equal ? "equal" : "DIFFER FROM")
                << " an undisturbed run's\n";
    std::cout << result.dump() << std::endl;
    return equal ? 0 : 1;
  };
  return cmd;
}

} // namespace troupe::cli
