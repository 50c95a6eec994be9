#pragma once

/// @file
/// The extension point: the object a worker actor hosts. Subclass `troupe::worker` to run a
/// model on a device; register named methods to extend what `collective_rpc` can call (the
/// counterpart of vLLM's `worker_extension_cls`).

#include "troupe/device.hpp"
#include "troupe/types.hpp"

#include <caf/message.hpp>
#include <caf/settings.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace troupe {

/// What a worker learns when the executor starts it.
struct worker_context {
  int32_t rank = 0;
  int32_t world_size = 1;
  /// What the worker computes on; the device index is the rank on its node.
  device_kind device_type = device_kind::cpu;
  int32_t device_index = 0;
  int32_t block_size = 16;
  int32_t max_model_len = 2048;
  /// Where `stop_profile` writes its trace; empty keeps it in memory.
  std::string profile_dir;
  /// Address this worker's tensor-parallel collective listens on.
  std::string collective_host = "127.0.0.1";
  /// Microseconds the worker waits for the next message after a call before its thread
  /// sleeps (`executor_config::linger`).
  int64_t linger_us = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, worker_context& x) {
  return f(caf::meta::type_name("worker_context"), x.rank, x.world_size, x.device_type,
           x.device_index, x.block_size, x.max_model_len, x.profile_dir, x.collective_host,
           x.linger_us);
}

/// A model a worker runs, as `apply_model` hands it to a function. Concrete models derive
/// from it; callers `dynamic_cast` to the type they know.
class model {
public:
  virtual ~model();

  /// Architecture name, e.g. `"LlamaForCausalLM"`.
  virtual std::string architecture() const = 0;

  /// Parameters held by this worker (its shard).
  virtual int64_t num_parameters() const = 0;
};

class worker;

/// A named worker method: receives the worker, the positional arguments and the keyword
/// arguments, returns the result. Throw `troupe::error` (or any exception) to fail the call.
using worker_method =
  std::function<caf::message(worker& self, const caf::message& args, const caf::settings& kwargs)>;

/// Base class of every worker. The worker actor calls it from its own thread only, one call
/// at a time. Every built-in method below is also registered by name, so `collective_rpc`
/// reaches it as `"execute_model"`, `"sleep"`, … (names as in vLLM).
///
/// The defaults of the virtual methods: memory methods act on the device's tagged pool;
/// LoRA, prompt-adapter, cache and model methods throw `errc::unsupported` until a subclass
/// provides them.
class worker {
public:
  worker();
  virtual ~worker();

  worker(const worker&) = delete;
  worker& operator=(const worker&) = delete;

  // -- lifecycle ----------------------------------------------------------------

  /// Binds the device. Runs on the worker's own thread before anything else. The default
  /// creates `make_device(ctx.device_type, ctx.device_index)`.
  virtual void init_device(const worker_context& ctx);

  /// Loads the model onto the device. The default does nothing.
  virtual void load_model();

  /// The model for `apply_model`; `nullptr` when none is loaded.
  virtual troupe::model* get_model();

  // -- tensor-parallel collective ------------------------------------------------

  /// First round of the collective's bootstrap, run by the executor on every rank when
  /// the world has more than one: opens this rank's side and returns its address for each
  /// peer. The default (a worker that needs no collective) returns nothing.
  virtual std::vector<std::string> prepare_collective();

  /// Second round, on every rank at once: `table[j][i]` is rank j's address for rank i.
  virtual void connect_collective(const std::vector<std::vector<std::string>>& table);

  /// Called from another thread, while any method may run, when a member of the group is
  /// known to be gone: makes a reduction this worker waits in (or its next) fail at once
  /// with `worker_died` naming `why`. The executor forms the group anew before the next
  /// step. The default (a worker without a collective) does nothing.
  virtual void abort_collective(const std::string& why) noexcept;

  // -- KV cache and steps ------------------------------------------------------

  /// Blocks that fit in the device and in swap space.
  virtual cache_blocks determine_num_available_blocks();

  /// Allocates the KV cache under `memory_tag::kv_cache`.
  virtual void initialize_cache(const cache_blocks& blocks);

  /// Runs one model step.
  virtual std::vector<sampler_output> execute_model(const execute_model_request& request);

  /// `execute_model`, refused with `errc::sleeping` while any memory tag of the device
  /// sleeps (its memory is unmapped). Every step the worker actor runs goes through here.
  std::vector<sampler_output> run_step(const execute_model_request& request);

  // -- adapters -----------------------------------------------------------------

  virtual bool add_lora(const lora_request& request);
  virtual bool remove_lora(int64_t lora_id);
  virtual bool pin_lora(int64_t lora_id);
  /// Loaded LoRA ids, ascending.
  virtual std::vector<int64_t> list_loras();

  virtual bool add_prompt_adapter(const prompt_adapter_request& request);
  virtual bool remove_prompt_adapter(int64_t adapter_id);
  virtual bool pin_prompt_adapter(int64_t adapter_id);
  /// Loaded prompt adapter ids, ascending.
  virtual std::vector<int64_t> list_prompt_adapters();
  /// The virtual tokens of prompt adapter `adapter_id` (added, loaded now or not), as its
  /// files say: a prompt that uses it starts with as many placeholders.
  virtual int32_t prompt_adapter_virtual_tokens(int64_t adapter_id);

  // -- memory -------------------------------------------------------------------

  /// Releases device memory: `offload_weights` keeps a host copy of the weights, `discard`
  /// does not.
  virtual void sleep(sleep_level level);

  /// Maps memory of the given tags back (all when empty).
  virtual void wake_up(const std::vector<memory_tag>& tags);

  /// Writes this worker's weights to `request.path`.
  virtual void save_sharded_state(const sharded_state_request& request);

  // -- observability ------------------------------------------------------------

  /// Starts recording the duration of every method call. Throws `invalid_argument` when
  /// already recording.
  virtual void start_profile();

  /// Stops recording; writes a Chrome trace to the context's `profile_dir` (when set) and
  /// returns a one-line summary. Throws `invalid_argument` when not recording.
  virtual std::string stop_profile();

  /// Reports whether the worker can serve; the default checks that the device is bound.
  virtual worker_health check_health();

  /// Rank, device, host and process of this worker, and what `describe_model` adds.
  worker_info info() const;

  /// Fills `info.model` and `info.model_fingerprint` (see `worker_info`); the default leaves
  /// them empty.
  virtual void describe_model(worker_info& info) const;

  // -- the method registry ------------------------------------------------------

  /// Registers (or replaces) a named method, for `collective_rpc` by name. The executor's
  /// own calls (sleep, wake_up, initialize_cache, check_health, the adapters, ...) reach the
  /// virtual methods above directly: a method registered under one of their names changes
  /// only what `collective_rpc` of that name does.
  void register_method(const std::string& name, worker_method fn);

  /// Whether a method of that name exists.
  bool has_method(const std::string& name) const;

  /// Names of every registered method, sorted.
  std::vector<std::string> method_names() const;

  /// Runs a registered method. Throws `troupe::error` (`unknown_method`) for an unknown
  /// name and lets the method's own exceptions through. Records the call while profiling.
  caf::message call(const std::string& name, const caf::message& args, const caf::settings& kwargs);

  /// Runs `fn` under the profiler like a named method.
  caf::message call_local(const std::string& label, const std::function<caf::message(worker&)>& fn);

  // -- accessors ----------------------------------------------------------------

  const worker_context& context() const noexcept {
    return context_;
  }

  int32_t rank() const noexcept {
    return context_.rank;
  }

  /// The bound device. Throws `troupe::error` (`unsupported`) before `init_device`.
  troupe::device& device();

protected:
  /// Binds a device created by a subclass (for devices `make_device` does not know).
  void bind_device(const worker_context& ctx, std::unique_ptr<troupe::device> dev);

private:
  struct profile_event {
    std::string name;
    std::chrono::steady_clock::time_point start;
    std::chrono::nanoseconds duration;
  };

  template <class F>
  caf::message timed(const std::string& name, F&& f);

  void register_builtins();

  worker_context context_;
  std::unique_ptr<troupe::device> device_;
  std::unordered_map<std::string, worker_method> methods_;
  bool profiling_ = false;
  std::vector<profile_event> profile_events_;
};

/// Creates the worker object of one rank. Runs on the worker actor's own thread.
using worker_factory = std::function<std::unique_ptr<worker>(int32_t rank)>;

} // namespace troupe
