#pragma once

/// @file
/// `troupe::executor`: the host-facing facade of the supervisor actor, with the methods of
/// vLLM's `ExecutorBase` / `DistributedExecutorBase`. Blocking calls throw `troupe::error`;
/// `*_async` calls return a `std::future` that holds the result or the same exception.

#include "troupe/config.hpp"
#include "troupe/errors.hpp"
#include "troupe/types.hpp"
#include "troupe/worker.hpp"

#include <caf/message.hpp>
#include <caf/settings.hpp>

#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace caf {
class actor_system;
} // namespace caf

namespace troupe {

/// Options of one `collective_rpc` call.
struct rpc_call_options {
  /// Positional arguments handed to the method.
  caf::message args;
  /// Keyword arguments handed to the method.
  caf::settings kwargs;
  /// Deadline; unset takes `executor_config::rpc_timeout`, `wait_forever` waits without one.
  std::optional<timeout_type> timeout;
  /// Workers asked at once; unset asks all of them at once.
  std::optional<int32_t> max_concurrent_workers;
};

/// Whether the executor sleeps and which tags.
struct sleep_status {
  bool is_sleeping = false;
  /// Sleeping tags, by name (`"weights"`, `"kv_cache"`).
  std::vector<std::string> sleeping_tags;
};

/// An executor: one supervisor actor and `tensor_parallel_size` worker actors, each owning
/// one device. Rank 0 is the driver.
///
/// Thread safety: every method may be called from any thread; calls from several threads
/// run concurrently inside the actor system.
///
/// Failure: if a worker goes down, every pending call fails with `errc::worker_died` (naming
/// the rank and the reason) and every later call fails at once with the same error.
class executor {
public:
  /// Starts an actor system, spawns the local workers (each creates its worker object with
  /// `factory` on its own thread, binds its device and loads its model), connects to the
  /// remote ones in `cfg.cluster.remote_workers`. Blocks until every worker is ready or
  /// `cfg.startup_timeout` passes. Throws `troupe::error` when a worker cannot start.
  executor(executor_config cfg, worker_factory factory);

  /// Shuts down (see `shutdown`).
  ~executor();

  executor(const executor&) = delete;
  executor& operator=(const executor&) = delete;

  // -- collective calls ---------------------------------------------------------

  /// Runs the named method on every worker; all requests go out before any reply is
  /// awaited, results come back in rank order. Errors: `unknown_method`, `timeout`, the
  /// first error a worker raises (naming its rank), `worker_died`.
  std::vector<caf::message> collective_rpc(const std::string& method,
                                           const rpc_call_options& opts = {});

  /// Runs `fn` on every worker object, in the worker's thread. In-process only: refused
  /// with `errc::remote_callable` when a worker lives in another process. If the call
  /// fails (deadline, a rank's error), workers that have not run `fn` yet skip it, and runs
  /// in progress finish before this returns, so `fn` may capture the caller's locals by
  /// reference.
  std::vector<caf::message> collective_rpc(worker_method fn, const rpc_call_options& opts = {});

  /// `collective_rpc` whose results are all of type `T`. Throws `bad_arguments` when a
  /// result has another type.
  template <class T>
  std::vector<T> collective_rpc_as(const std::string& method, const rpc_call_options& opts = {}) {
    return unpack<T>(collective_rpc(method, opts), method);
  }

  /// Runs `fn` on the model of every worker (vLLM's `apply_model`). Throws `unsupported`
  /// when a worker has no model, `remote_callable` for workers in other processes.
  std::vector<caf::message> apply_model(std::function<caf::message(troupe::model&)> fn);

  // -- KV cache and steps -------------------------------------------------------

  /// Blocks available on every worker: the minimum over workers of both numbers.
  cache_blocks determine_num_available_blocks();

  /// Allocates the KV cache on every worker; logs the block counts and the maximum
  /// concurrency for `max_model_len` tokens per request.
  void initialize_cache(const cache_blocks& blocks);

  /// Runs one step and returns the driver's output. The first call starts the execution
  /// loop on the other workers; later steps go to the driver, which hands them on.
  /// Errors: `sleeping` while any memory tag sleeps, the loop's error if a peer failed.
  /// Taken by value: a caller done with its request moves it in, and nothing copies it.
  std::vector<sampler_output> execute_model(execute_model_request request);

  /// Stops the execution loop of the non-driver workers and waits for it to end; does
  /// nothing when no loop runs.
  void stop_remote_worker_execution_loop();

  // -- adapters -----------------------------------------------------------------

  /// Loads a LoRA adapter on every worker; true when all did. `lora_int_id` must be > 0.
  bool add_lora(const lora_request& request);
  bool remove_lora(int64_t lora_id);
  bool pin_lora(int64_t lora_id);
  /// Loaded LoRA ids; `inconsistent_workers` (naming the ranks) when workers disagree.
  std::vector<int64_t> list_loras();

  bool add_prompt_adapter(const prompt_adapter_request& request);
  bool remove_prompt_adapter(int64_t adapter_id);
  bool pin_prompt_adapter(int64_t adapter_id);
  std::vector<int64_t> list_prompt_adapters();
  /// The virtual tokens of prompt adapter `adapter_id`, as every worker read them from its
  /// files (`inconsistent_workers` when they differ): a prompt that uses it starts with as
  /// many placeholders. Not in vLLM, whose caller reads the adapter's config itself.
  int32_t prompt_adapter_virtual_tokens(int64_t adapter_id);

  // -- profiling, sharded state, health -------------------------------------------

  void start_profile();
  /// Stops profiling; each worker writes its trace to `executor_config::profile_dir`.
  void stop_profile();

  /// Each worker writes its shard of the weights to `path` (vLLM's `save_sharded_state`);
  /// `pattern` empty means `model-rank-{rank}-part-{part}.safetensors`, `max_size` 0 the
  /// default file size. All or nothing: the workers write into hidden staging folders in
  /// `path` and the files are moved into place only once every worker has succeeded; when
  /// one fails, the others' files are removed and its error is thrown. Blocks for up to
  /// twice `rpc_timeout` (the writes, then the moves).
  void save_sharded_state(const std::string& path, const std::string& pattern = {},
                          int64_t max_size = 0);

  /// Throws when the executor failed or a worker reports itself unhealthy.
  void check_health();

  /// While a dead worker is being replaced, what is going on ("recovering rank N for S s
  /// (cause)"); empty otherwise. Answers at once, where other calls wait for the
  /// replacement.
  std::string recovery();

  /// Health reports of every worker, in rank order.
  std::vector<worker_health> worker_healths();

  // -- sleep and wake -------------------------------------------------------------

  /// Releases device memory on every worker (level 1 keeps a host copy of the weights,
  /// level 2 discards them). Sleeping twice logs a warning and changes nothing.
  /// Throws `invalid_argument` for a level other than 1 or 2.
  void sleep(int32_t level = 1);

  /// Wakes the given tags (all sleeping tags when empty). Waking when awake, or a tag that
  /// is unknown or not asleep, logs a warning and changes nothing.
  void wake_up(const std::vector<std::string>& tags = {});

  /// Whether any tag sleeps, and which.
  sleep_status sleep_state();

  /// How many sleeps this executor was asked for so far. A sleep discards the workers' KV
  /// caches: an engine that keeps their contents in mind (a prefix cache) compares this
  /// count between steps to learn that they are gone.
  int64_t sleep_count() const;

  bool is_sleeping() {
    return sleep_state().is_sleeping;
  }

  // -- lifecycle ------------------------------------------------------------------

  /// Stops every worker and the actor system. Idempotent. Never hangs: a worker stuck in a
  /// long call is abandoned after `shutdown_grace` (its thread ends with the process).
  void shutdown();

  /// Workers in the executor.
  int32_t world_size() const;

  /// What every worker reported when it started, in rank order.
  const std::vector<worker_info>& workers() const;

  const executor_config& config() const;

  /// The executor's actor system, for hosts that add their own actors.
  caf::actor_system& system();

  // -- async variants -------------------------------------------------------------

  std::future<std::vector<caf::message>> collective_rpc_async(const std::string& method,
                                                              const rpc_call_options& opts = {});
  /// The async form runs `fn` whenever each worker gets to it, even after the future was
  /// dropped: capture by value.
  std::future<std::vector<caf::message>> collective_rpc_async(worker_method fn,
                                                              const rpc_call_options& opts = {});
  std::future<cache_blocks> determine_num_available_blocks_async();
  std::future<void> initialize_cache_async(const cache_blocks& blocks);
  std::future<std::vector<sampler_output>> execute_model_async(execute_model_request request);
  std::future<void> stop_remote_worker_execution_loop_async();
  std::future<bool> add_lora_async(const lora_request& request);
  std::future<bool> remove_lora_async(int64_t lora_id);
  std::future<bool> pin_lora_async(int64_t lora_id);
  std::future<std::vector<int64_t>> list_loras_async();
  std::future<bool> add_prompt_adapter_async(const prompt_adapter_request& request);
  std::future<bool> remove_prompt_adapter_async(int64_t adapter_id);
  std::future<bool> pin_prompt_adapter_async(int64_t adapter_id);
  std::future<std::vector<int64_t>> list_prompt_adapters_async();
  std::future<int32_t> prompt_adapter_virtual_tokens_async(int64_t adapter_id);
  std::future<void> start_profile_async();
  std::future<void> stop_profile_async();
  std::future<void> save_sharded_state_async(const std::string& path,
                                             const std::string& pattern = {}, int64_t max_size = 0);
  std::future<void> check_health_async();
  std::future<void> sleep_async(int32_t level = 1);
  std::future<void> wake_up_async(const std::vector<std::string>& tags = {});

  /// How long `shutdown` waits for workers before abandoning them.
  static constexpr std::chrono::seconds shutdown_grace{5};

private:
  template <class T>
  static std::vector<T> unpack(const std::vector<caf::message>& results,
                               const std::string& method) {
    std::vector<T> out;
    out.reserve(results.size());
    for (size_t rank = 0; rank < results.size(); ++rank) {
      auto& msg = results[rank];
      if (msg.size() != 1 || !msg.match_element<T>(0))
        throw error{errc::bad_arguments, "rank " + std::to_string(rank) + ": method '" + method +
                                           "' returned (" + to_string(msg) +
                                           "), not the expected type"};
      out.push_back(msg.get_as<T>(0));
    }
    return out;
  }

  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace troupe
