// The host-facing facade: turns calls into messages to the supervisor (of the actors that
// `executor_system` runs) and replies into values, exceptions or futures.

#include "troupe/executor.hpp"

#include "actors/executor_system.hpp"
#include "actors/supervisor.hpp"
#include "actors/supervisor_client.hpp"
#include "kernels/log.hpp"
#include "actors/cluster/node_auth.hpp"
#include "actors/cluster/remoting.hpp"
#include "messages/messages.hpp"

#include <caf/all.hpp>

#include <atomic>
#include <future>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <utility>

namespace troupe {

namespace {

/// A deadline for a call made of `n` steps, each bounded by `t`.
timeout_type times(timeout_type t, int64_t n) {
  return t >= wait_forever / n ? wait_forever : n * t;
}

int64_t to_us(timeout_type t) {
  return t == wait_forever ? wait_forever.count() : t.count();
}

} // namespace

struct executor::impl {
  explicit impl(executor_config c) : cfg(std::move(c)) {}

  executor_config cfg;
  /// Sleeps asked for (`sleep_count`).
  std::atomic<int64_t> sleeps{0};
  /// The actor system and the actors it runs.
  executor_system actors;
  /// How this facade's calls reach the supervisor.
  supervisor_client client{actors, !cfg.cluster.nodes.empty(), cfg.rpc_timeout};
  std::vector<worker_info> infos;
  std::shared_ptr<spdlog::logger> log = get_logger("troupe.executor");

  /// Starts the actors (`executor_system::start`) and brings the workers up. Throws what
  /// failed, with everything started so far stopped.
  void start(worker_factory factory);

  /// collective_rpc of a named method, made through `send_direct`.
  auto rpc_of(const std::string& method, const rpc_call_options& opts) {
    return [method, args = opts.args, kwargs = opts.kwargs, o = options(opts)](
             supervisor_access& access, reply_to<std::vector<caf::message>> reply) {
      access.collective_rpc(method, args, kwargs, o, std::move(reply));
    };
  }

  /// collective_rpc of a named method whose future says only that it succeeded; `seen`
  /// (when given) gets the replies first, on whichever thread finishes the call.
  std::future<void> rpc_done_async(const std::string& method,
                                   std::function<void(const std::vector<caf::message>&)> seen) {
    return client.ask_async_direct<void>(
      cfg.rpc_timeout,
      [rpc = rpc_of(method, {}), seen](supervisor_access& access, reply_to<void> reply) mutable {
        rpc(access, [reply, seen](caf::expected<std::vector<caf::message>> res) {
          if (res && seen)
            seen(*res);
          reply(res ? caf::expected<void>{} : caf::expected<void>{res.error()});
        });
      });
  }

  /// execute_model, made through `send_direct`.
  auto step_of(execute_model_request request) {
    return [request = std::move(request), t = cfg.rpc_timeout](
             supervisor_access& access, reply_to<std::vector<sampler_output>> reply) mutable {
      access.execute_model(std::move(request), t, std::move(reply));
    };
  }

  /// Runs a callable on every worker and waits. If the call fails (deadline, an error of
  /// one rank), workers that have not run the callable yet skip it: it may refer to the
  /// caller's stack, which is gone once this returns.
  std::vector<caf::message> run_callable(local_call call, const rpc_call_options& opts) {
    auto guard = std::make_shared<local_call::guard_type>();
    call.guard = guard;
    try {
      return client.ask<std::vector<caf::message>>(call_timeout(opts), rpc_atom::value,
                                                   std::move(call), options(opts));
    } catch (...) {
      std::unique_lock<std::shared_mutex> cancel{guard->mtx};
      guard->cancelled = true;
      throw;
    }
  }

  /// An adapter call whose answer is true when every worker said true.
  template <class Call>
  std::future<bool> all_true(Call call) {
    return client.ask_async<bool>(all_true_atom::value, std::move(call));
  }

  /// The adapters of `kind` every worker holds (they must agree).
  std::future<std::vector<int64_t>> same_set(adapter_kind kind) {
    return client.ask_async<std::vector<int64_t>>(same_set_atom::value, adapter_list{kind});
  }

  std::future<bool> change(adapter_kind kind, adapter_action action, int64_t id) {
    return all_true(adapter_change{kind, action, id});
  }

  rpc_options options(const rpc_call_options& opts) const {
    if (opts.timeout && *opts.timeout <= timeout_type::zero())
      throw error{errc::invalid_argument,
                  "a call's timeout must be positive (use troupe::wait_forever for none), got " +
                    std::to_string(opts.timeout->count()) + " us"};
    if (opts.max_concurrent_workers && *opts.max_concurrent_workers < 1)
      throw error{errc::invalid_argument, "max_concurrent_workers must be at least 1, got " +
                                            std::to_string(*opts.max_concurrent_workers)};
    rpc_options result;
    result.timeout_us = to_us(opts.timeout.value_or(cfg.rpc_timeout));
    result.max_concurrent_workers = opts.max_concurrent_workers.value_or(0);
    return result;
  }

  timeout_type call_timeout(const rpc_call_options& opts) const {
    return opts.timeout.value_or(cfg.rpc_timeout);
  }

  void stop() {
    client.close();
  }
};

void cluster_config::validate() const {
  for (auto& n : nodes)
    if (n.workers < 1)
      throw error{errc::invalid_argument,
                  "node " + n.host + ":" + std::to_string(n.port) + ": workers must be at least 1"};
  auto tls = wants_tls(tls_certificate, tls_key, tls_ca);
  bool any_node = !nodes.empty() || !spare_nodes.empty();
  if (any_node && node_secret.empty() && !tls)
    throw error{errc::invalid_argument, "worker nodes need node_secret or TLS certificates"};
  if (any_node && !node_secret.empty())
    check_secret(node_secret, "node_secret");
  if (node_timeout <= timeout_type::zero())
    throw error{errc::invalid_argument, "node_timeout must be positive"};
  check_linger(network_linger, "network_linger");
}

bool cluster_config::empty() const {
  return remote_workers.empty() && nodes.empty() && spare_nodes.empty();
}

int32_t cluster_config::remote_count() const {
  auto count = static_cast<int32_t>(remote_workers.size());
  for (auto& n : nodes)
    count += n.workers;
  return count;
}

void executor_config::validate() const {
  auto positive = [](const char* name, int64_t v) {
    if (v < 1)
      throw error{errc::invalid_argument,
                  std::string{name} + " must be at least 1, got " + std::to_string(v)};
  };
  positive("tensor_parallel_size", tensor_parallel_size);
  positive("block_size", block_size);
  positive("max_model_len", max_model_len);
  cluster.validate();
  if (cluster.remote_count() > tensor_parallel_size)
    throw error{errc::invalid_argument, std::to_string(cluster.remote_count()) +
                                          " remote workers do not fit tensor_parallel_size " +
                                          std::to_string(tensor_parallel_size)};
  check_linger(linger, "linger");
  if (rpc_timeout <= timeout_type::zero() || startup_timeout <= timeout_type::zero())
    throw error{errc::invalid_argument, "rpc_timeout and startup_timeout must be positive"};
  if (restart.max_restarts < 0)
    throw error{errc::invalid_argument, "restart.max_restarts must be 0 or more, got " +
                                          std::to_string(restart.max_restarts)};
  if (restart.max_restarts > 0 && restart.window <= timeout_type::zero())
    throw error{errc::invalid_argument, "restart.window must be positive"};
}

void executor::impl::start(worker_factory factory) {
  actors.start(cfg, std::move(factory));
  try {
    // Three steps, each within startup_timeout: init, and the collective's two rounds.
    infos = client.ask<std::vector<worker_info>>(times(cfg.startup_timeout, 3), init_atom::value);
  } catch (...) {
    stop();
    throw;
  }
  log->info("executor ready: {} worker(s), driver on {}", infos.size(), infos[0].device);
}

executor::executor(executor_config cfg, worker_factory factory) {
  cfg.validate();
  if (cfg.tensor_parallel_size > cfg.cluster.remote_count() && !factory)
    throw error{errc::invalid_argument, "local workers need a worker factory"};
  impl_.reset(new impl{std::move(cfg)});
  impl_->start(std::move(factory));
}

executor::~executor() {
  try {
    shutdown();
  } catch (...) {
    // Destructors must not throw; shutdown already logged what went wrong.
  }
}

void executor::shutdown() {
  impl_->stop();
}

int32_t executor::world_size() const {
  return impl_->cfg.tensor_parallel_size;
}

const std::vector<worker_info>& executor::workers() const {
  return impl_->infos;
}

const executor_config& executor::config() const {
  return impl_->cfg;
}

caf::actor_system& executor::system() {
  impl_->client.check_open();
  return impl_->actors.system();
}

// -- collective calls -----------------------------------------------------------

std::vector<caf::message> executor::collective_rpc(const std::string& method,
                                                   const rpc_call_options& opts) {
  auto& d = *impl_;
  return d.client.ask_direct<std::vector<caf::message>>(d.call_timeout(opts),
                                                        d.rpc_of(method, opts));
}

std::vector<caf::message> executor::collective_rpc(worker_method fn, const rpc_call_options& opts) {
  auto& d = *impl_;
  if (!fn)
    throw error{errc::invalid_argument, "collective_rpc needs a callable"};
  return d.run_callable(local_call{"callable", std::move(fn), opts.args, opts.kwargs, nullptr},
                        opts);
}

std::vector<caf::message> executor::apply_model(std::function<caf::message(troupe::model&)> fn) {
  if (!fn)
    throw error{errc::invalid_argument, "apply_model needs a function"};
  auto& d = *impl_;
  worker_method on_model = [fn](worker& w, const caf::message&, const caf::settings&) {
    auto m = w.get_model();
    if (m == nullptr)
      throw error{errc::unsupported, "apply_model: no model is loaded"};
    return fn(*m);
  };
  return d.run_callable(local_call{"apply_model", std::move(on_model), {}, {}, nullptr}, {});
}

std::future<std::vector<caf::message>>
executor::collective_rpc_async(const std::string& method, const rpc_call_options& opts) {
  auto& d = *impl_;
  return d.client.ask_async_direct<std::vector<caf::message>>(d.call_timeout(opts),
                                                              d.rpc_of(method, opts));
}

std::future<std::vector<caf::message>>
executor::collective_rpc_async(worker_method fn, const rpc_call_options& opts) {
  auto& d = *impl_;
  return d.client.ask_async_within<std::vector<caf::message>>(
    d.call_timeout(opts), rpc_atom::value,
    local_call{"callable", std::move(fn), opts.args, opts.kwargs, nullptr}, d.options(opts));
}

// -- KV cache and steps -----------------------------------------------------------

cache_blocks executor::determine_num_available_blocks() {
  return determine_num_available_blocks_async().get();
}

std::future<cache_blocks> executor::determine_num_available_blocks_async() {
  return impl_->client.ask_async<cache_blocks>(blocks_atom::value);
}

void executor::initialize_cache(const cache_blocks& blocks) {
  impl_->client.ask<void>(impl_->cfg.rpc_timeout, init_cache_atom::value, blocks);
}

std::future<void> executor::initialize_cache_async(const cache_blocks& blocks) {
  return impl_->client.ask_async<void>(init_cache_atom::value, blocks);
}

std::vector<sampler_output> executor::execute_model(execute_model_request request) {
  auto& d = *impl_;
  return d.client.ask_direct<std::vector<sampler_output>>(d.cfg.rpc_timeout,
                                                          d.step_of(std::move(request)));
}

std::future<std::vector<sampler_output>>
executor::execute_model_async(execute_model_request request) {
  auto& d = *impl_;
  return d.client.ask_async_direct<std::vector<sampler_output>>(d.cfg.rpc_timeout,
                                                                d.step_of(std::move(request)));
}

void executor::stop_remote_worker_execution_loop() {
  impl_->client.ask<void>(impl_->cfg.rpc_timeout, stop_loop_atom::value);
}

std::future<void> executor::stop_remote_worker_execution_loop_async() {
  return impl_->client.ask_async<void>(stop_loop_atom::value);
}

// -- adapters ---------------------------------------------------------------------
// The blocking forms wait on the async ones: these calls are rare and the supervisor does
// the work (id checks, agreement across workers) for both.

bool executor::add_lora(const lora_request& request) {
  return add_lora_async(request).get();
}

std::future<bool> executor::add_lora_async(const lora_request& request) {
  return impl_->all_true(to_adapter_request(request));
}

bool executor::remove_lora(int64_t lora_id) {
  return remove_lora_async(lora_id).get();
}

std::future<bool> executor::remove_lora_async(int64_t lora_id) {
  return impl_->change(adapter_kind::lora, adapter_action::remove, lora_id);
}

bool executor::pin_lora(int64_t lora_id) {
  return pin_lora_async(lora_id).get();
}

std::future<bool> executor::pin_lora_async(int64_t lora_id) {
  return impl_->change(adapter_kind::lora, adapter_action::pin, lora_id);
}

std::vector<int64_t> executor::list_loras() {
  return list_loras_async().get();
}

std::future<std::vector<int64_t>> executor::list_loras_async() {
  return impl_->same_set(adapter_kind::lora);
}

bool executor::add_prompt_adapter(const prompt_adapter_request& request) {
  return add_prompt_adapter_async(request).get();
}

std::future<bool> executor::add_prompt_adapter_async(const prompt_adapter_request& request) {
  return impl_->all_true(to_adapter_request(request));
}

bool executor::remove_prompt_adapter(int64_t adapter_id) {
  return remove_prompt_adapter_async(adapter_id).get();
}

std::future<bool> executor::remove_prompt_adapter_async(int64_t adapter_id) {
  return impl_->change(adapter_kind::prompt_adapter, adapter_action::remove, adapter_id);
}

bool executor::pin_prompt_adapter(int64_t adapter_id) {
  return pin_prompt_adapter_async(adapter_id).get();
}

std::future<bool> executor::pin_prompt_adapter_async(int64_t adapter_id) {
  return impl_->change(adapter_kind::prompt_adapter, adapter_action::pin, adapter_id);
}

std::vector<int64_t> executor::list_prompt_adapters() {
  return list_prompt_adapters_async().get();
}

std::future<std::vector<int64_t>> executor::list_prompt_adapters_async() {
  return impl_->same_set(adapter_kind::prompt_adapter);
}

int32_t executor::prompt_adapter_virtual_tokens(int64_t adapter_id) {
  return prompt_adapter_virtual_tokens_async(adapter_id).get();
}

std::future<int32_t> executor::prompt_adapter_virtual_tokens_async(int64_t adapter_id) {
  return impl_->client.ask_async<int32_t>(agree_atom::value, adapter_tokens{adapter_id});
}

// -- profiling, sharded state, health -----------------------------------------------

void executor::start_profile() {
  collective_rpc("start_profile");
}

std::future<void> executor::start_profile_async() {
  return impl_->rpc_done_async("start_profile", nullptr);
}

void executor::stop_profile() {
  stop_profile_async().get();
}

std::future<void> executor::stop_profile_async() {
  auto log = impl_->log;
  return impl_->rpc_done_async("stop_profile", [log](const std::vector<caf::message>& replies) {
    for (auto& msg : replies)
      if (msg.match_elements<std::string>())
        log->info("profile: {}", msg.get_as<std::string>(0));
  });
}

namespace {

sharded_state_request sharded_state(const std::string& path, const std::string& pattern,
                                    int64_t max_size) {
  if (path.empty())
    throw error{errc::invalid_argument, "save_sharded_state needs a path"};
  if (max_size < 0)
    throw error{errc::invalid_argument,
                "save_sharded_state: max_size must be >= 0, got " + std::to_string(max_size)};
  return {path, pattern, max_size};
}

} // namespace

void executor::save_sharded_state(const std::string& path, const std::string& pattern,
                                  int64_t max_size) {
  auto& d = *impl_;
  // A staged save is two collective calls.
  d.client.ask<void>(times(d.cfg.rpc_timeout, 2), save_state_atom::value,
                     sharded_state(path, pattern, max_size));
}

std::future<void> executor::save_sharded_state_async(const std::string& path,
                                                     const std::string& pattern, int64_t max_size) {
  auto& d = *impl_;
  return d.client.ask_async<void>(save_state_atom::value, sharded_state(path, pattern, max_size));
}

std::vector<worker_health> executor::worker_healths() {
  return impl_->client.ask<std::vector<worker_health>>(impl_->cfg.rpc_timeout, health_atom::value);
}

void executor::check_health() {
  worker_healths();
}

std::future<void> executor::check_health_async() {
  return impl_->client.ask_async<void, discarded<std::vector<worker_health>>>(health_atom::value);
}

// -- sleep and wake -------------------------------------------------------------------

int64_t executor::sleep_count() const {
  return impl_->sleeps.load();
}

void executor::sleep(int32_t level) {
  ++impl_->sleeps;
  impl_->client.ask<void>(impl_->cfg.rpc_timeout, sleep_atom::value,
                          sleep_request{to_sleep_level(level)});
}

std::future<void> executor::sleep_async(int32_t level) {
  sleep_request request;
  try {
    request.level = to_sleep_level(level);
  } catch (...) {
    std::promise<void> refused;
    refused.set_exception(std::current_exception());
    return refused.get_future();
  }
  ++impl_->sleeps;
  return impl_->client.ask_async<void>(sleep_atom::value, request);
}

void executor::wake_up(const std::vector<std::string>& tags) {
  impl_->client.ask<void>(impl_->cfg.rpc_timeout, wake_atom::value, tags);
}

std::future<void> executor::wake_up_async(const std::vector<std::string>& tags) {
  return impl_->client.ask_async<void>(wake_atom::value, tags);
}

std::string executor::recovery() {
  auto& d = *impl_;
  auto open = d.client.hold_open();
  // A message of its own, not a call: calls made during a replacement wait for it.
  std::string answer;
  caf::error failed;
  {
    logger_release release;
    caf::scoped_actor self{d.actors.system()};
    self->request(d.actors.supervisor(), d.cfg.rpc_timeout, recovery_atom::value)
      .receive([&](std::string& text) { answer = std::move(text); },
               [&](caf::error& e) { failed = std::move(e); });
  }
  if (failed)
    throw error{to_errc(failed), "recovery: " + render(failed)};
  return answer;
}

sleep_status executor::sleep_state() {
  sleep_status status;
  status.sleeping_tags =
    impl_->client.ask<std::vector<std::string>>(impl_->cfg.rpc_timeout, sleep_state_atom::value);
  status.is_sleeping = !status.sleeping_tags.empty();
  return status;
}

} // namespace troupe
