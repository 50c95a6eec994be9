#include "troupe/model_worker.hpp"

#include "kernels/platform.hpp"
#include "kernels/sampler.hpp"
#include "model/adapter_slots.hpp"
#include "model/adapters.hpp"
#include "model/checkpoint.hpp"
#include "model/config.hpp"
#include "model/kv_cache.hpp"
#include "model/llama.hpp"
#include "model/safetensors.hpp"
#include "model/step_batch.hpp"
#include "troupe/errors.hpp"
#include "troupe/weight_group.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>

namespace troupe {

namespace {

/// Tensors without data from a method's arguments from `first` on: names, dtypes, every
/// dimension in order, and each tensor's number of dimensions; `after` arguments follow.
std::vector<host_tensor> tensor_metadata(const caf::message& args, size_t first, size_t after = 0) {
  using strings = std::vector<std::string>;
  using ints = std::vector<int64_t>;
  if (args.size() != first + 4 + after || !args.match_element<strings>(first) ||
      !args.match_element<strings>(first + 1) || !args.match_element<ints>(first + 2) ||
      !args.match_element<ints>(first + 3))
    throw error{errc::bad_arguments, "tensors are described by (names, dtypes, dims, ndims)"};
  auto& names = args.get_as<strings>(first);
  auto& dtypes = args.get_as<strings>(first + 1);
  auto& dims = args.get_as<ints>(first + 2);
  auto& ndims = args.get_as<ints>(first + 3);
  if (dtypes.size() != names.size() || ndims.size() != names.size())
    throw error{errc::invalid_argument, "a weight update names " + std::to_string(names.size()) +
                                          " tensors but gives " + std::to_string(dtypes.size()) +
                                          " dtypes and " + std::to_string(ndims.size()) +
                                          " shapes"};
  std::vector<host_tensor> out;
  size_t at = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    if (ndims[i] < 0 || ndims[i] > 8 || at + static_cast<size_t>(ndims[i]) > dims.size())
      throw error{errc::invalid_argument, "tensor '" + names[i] + "': a shape of " +
                                            std::to_string(ndims[i]) + " dimensions"};
    host_tensor t;
    t.name = names[i];
    t.dtype = dtypes[i];
    t.shape.assign(dims.begin() + static_cast<long>(at),
                   dims.begin() + static_cast<long>(at + static_cast<size_t>(ndims[i])));
    at += static_cast<size_t>(ndims[i]);
    out.push_back(std::move(t));
  }
  if (at != dims.size())
    throw error{errc::invalid_argument, "a weight update's shapes hold more dimensions than "
                                        "its tensors have"};
  return out;
}

std::function<lora_weights(const lora_request&)> lora_loader(const llama_model& model,
                                                             int64_t max_rank) {
  return
    [&model, max_rank](const lora_request& r) { return model.load_lora(r.lora_path, max_rank); };
}

std::function<prompt_embeddings(const prompt_adapter_request&)>
prompt_adapter_loader(const llama_model& model, int64_t max_tokens) {
  return [&model, max_tokens](const prompt_adapter_request& r) {
    auto loaded = model.load_prompt_adapter(r.prompt_adapter_local_path, max_tokens);
    if (r.prompt_adapter_num_virtual_tokens != 0 &&
        r.prompt_adapter_num_virtual_tokens != loaded.num_virtual_tokens)
      throw error{errc::invalid_argument, "prompt adapter '" + r.prompt_adapter_local_path +
                                            "' has " + std::to_string(loaded.num_virtual_tokens) +
                                            " virtual tokens, the request says " +
                                            std::to_string(r.prompt_adapter_num_virtual_tokens)};
    return loaded;
  };
}

} // namespace

struct model_worker::state {
  explicit state(const model_worker_options& o)
    : loras("LoRA", static_cast<size_t>(std::max(0, o.max_loras))),
      prompt_adapters("prompt adapter", static_cast<size_t>(std::max(0, o.max_prompt_adapters))) {}

  model_config config;
  std::unique_ptr<llama_model> model;
  adapter_slots<lora_request, lora_weights> loras;
  adapter_slots<prompt_adapter_request, prompt_embeddings> prompt_adapters;
  /// The virtual tokens of each prompt adapter added (loaded now or evicted).
  std::map<int64_t, int32_t> virtual_tokens;
  std::unique_ptr<kv_cache> cache;
  /// The block tables of the engine's sequences, into `cache`.
  kept_block_tables kept;
  std::mt19937_64 rng{std::random_device{}()};
  /// This rank's side of the group between `prepare_collective` and `connect_collective`.
  std::unique_ptr<collective_bootstrap> bootstrap;
  /// The connected group: NCCL on GPUs; on the CPU, memory when every rank lives in this
  /// process, else Gloo.
  std::unique_ptr<communicator> group;
  /// Guards `group` against `abort_collective` from another thread while it is replaced.
  std::mutex group_mtx;
  /// Sums device memory over the ranks once the collective is connected.
  all_reduce_fn reduce;
  /// One float of device memory for the ranks' agreement on a step's adapters.
  device_buffer flag;
  bool presharded = false;
  /// The weight-update group joined (`init_weights_update_group`), its member that speaks
  /// for the engine, and the tensors received over it, waiting to be applied.
  std::unique_ptr<weight_update_group> update_group;
  int32_t update_root = 1;
  /// Host buffers of the last tensors received, kept (with their sizes) for the next update
  /// of the same tensors until the group is left: fresh pages would be faulted in and
  /// zeroed by the kernel on every update. Not zeroed here: every byte is received before
  /// it is read.
  std::vector<std::unique_ptr<char[]>> received;
  std::vector<size_t> received_sizes;
  std::vector<host_tensor> received_tensors;
  /// `checkpoint::fingerprint` of the config and the files loaded (every byte of them when
  /// there are several ranks); of the config alone for a sharded state (each rank's files
  /// differ by design).
  std::string fingerprint;
};

const char* to_string(load_format_kind format) {
  return format == load_format_kind::sharded_state ? "sharded_state" : "auto";
}

load_format_kind parse_load_format(std::string_view name) {
  const load_format_kind formats[] = {load_format_kind::automatic, load_format_kind::sharded_state};
  if (auto format = value_named(name, formats))
    return *format;
  throw error{errc::invalid_argument,
              "load format '" + std::string{name} + "' is not known (auto, sharded_state)"};
}

const char* to_string(cpu_precision_kind precision) {
  return precision == cpu_precision_kind::fast ? "fast" : "exact";
}

cpu_precision_kind parse_cpu_precision(std::string_view name) {
  const cpu_precision_kind precisions[] = {cpu_precision_kind::exact, cpu_precision_kind::fast};
  if (auto precision = value_named(name, precisions))
    return *precision;
  throw error{errc::invalid_argument,
              "cpu_precision '" + std::string{name} + "' is neither exact nor fast"};
}

void model_worker_options::validate() const {
  auto bad = [](const std::string& what) {
    throw error{errc::invalid_argument, "model_worker: " + what};
  };
  if (dtype != "auto" && !parse_dtype_name(dtype))
    bad("dtype '" + dtype + "' is not known (auto, float32, float16, bfloat16)");
  if (max_loras < 1 || max_lora_rank < 1 || max_prompt_adapters < 1 || max_prompt_adapter_token < 0)
    bad("max_loras, max_lora_rank and max_prompt_adapters must be at least 1, "
        "max_prompt_adapter_token not negative");
  if (max_num_batched_tokens < 1 || max_num_seqs < 1)
    bad("max_num_batched_tokens and max_num_seqs must be at least 1");
  auto fraction = [&](const char* name, double v) {
    if (!(v > 0.0 && v <= 1.0))
      bad(std::string{name} + " must be in (0, 1], got " + std::to_string(v));
  };
  fraction("gpu_memory_utilization", gpu_memory_utilization);
  fraction("kv_cache_memory_fraction", kv_cache_memory_fraction);
  if (kv_cache_memory_bytes < 0 || swap_space_bytes < 0)
    bad("kv_cache_memory_bytes and swap_space_bytes must not be negative");
}

model_worker::model_worker(model_worker_options options)
  : options_(std::move(options)), state_(std::make_unique<state>(options_)) {
  options_.validate();
  register_method("reload_weights", [](worker& w, const caf::message&, const caf::settings&) {
    static_cast<model_worker&>(w).reload_weights();
    return caf::message{};
  });
  register_method("update_weights_from_disk", [](worker& w, const caf::message& args,
                                                 const caf::settings& kwargs) {
    if (args.size() != 1 || !args.match_element<std::string>(0))
      throw error{errc::bad_arguments, "update_weights_from_disk takes one argument, a path"};
    static_cast<model_worker&>(w).update_weights_from_disk(args.get_as<std::string>(0),
                                                           weight_update_options_of(kwargs));
    return caf::message{};
  });
  register_method("init_weights_update_group", [](worker& w, const caf::message& args,
                                                  const caf::settings& kwargs) {
    if (!args.match_elements<std::string, int64_t, int64_t, int64_t, std::string>())
      throw error{errc::bad_arguments,
                  "init_weights_update_group takes (master_address, master_port, rank_offset, "
                  "world_size, backend)"};
    auto seconds = caf::get_or(kwargs, "timeout", 60.0);
    if (!(seconds > 0 && seconds < 1e6))
      throw error{errc::invalid_argument, "init_weights_update_group: timeout must be positive"};
    auto narrow = [](int64_t v, const char* what) {
      if (v < 0 || v > std::numeric_limits<int32_t>::max())
        throw error{errc::invalid_argument,
                    std::string{"init_weights_update_group: "} + what + " out of range"};
      return static_cast<int32_t>(v);
    };
    static_cast<model_worker&>(w).init_weights_update_group(
      args.get_as<std::string>(0), narrow(args.get_as<int64_t>(1), "master_port"),
      narrow(args.get_as<int64_t>(2), "rank_offset"), narrow(args.get_as<int64_t>(3), "world_size"),
      args.get_as<std::string>(4),
      std::chrono::duration_cast<timeout_type>(std::chrono::duration<double>(seconds)));
    return caf::message{};
  });
  register_method("destroy_weights_update_group",
                  [](worker& w, const caf::message&, const caf::settings&) {
                    static_cast<model_worker&>(w).destroy_weights_update_group();
                    return caf::message{};
                  });
  register_method("check_weight_metadata",
                  [](worker& w, const caf::message& args, const caf::settings& kwargs) {
                    auto o = weight_update_options_of(kwargs);
                    o.metadata_only = true;
                    static_cast<model_worker&>(w).update_weights(tensor_metadata(args, 0), o);
                    return caf::message{};
                  });
  // (names, dtypes, dims, ndims, bytes): tensors whose elements come in the message, each
  // as a string of its bytes (how a replacement, leased from a node too, gets the updates
  // the replaced worker had).
  register_method("update_weights_from_bytes", [](worker& w, const caf::message& args,
                                                  const caf::settings& kwargs) {
    auto tensors = tensor_metadata(args, 0, 1);
    if (!args.match_element<std::vector<std::string>>(4))
      throw error{errc::bad_arguments,
                  "update_weights_from_bytes takes (names, dtypes, dims, ndims, bytes)"};
    auto& bytes = args.get_as<std::vector<std::string>>(4);
    if (bytes.size() != tensors.size())
      throw error{errc::invalid_argument, "a weight update names " +
                                            std::to_string(tensors.size()) + " tensors but gives " +
                                            std::to_string(bytes.size()) + " byte strings"};
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (bytes[i].size() != byte_size(tensors[i]))
        throw error{errc::invalid_argument,
                    "tensor '" + tensors[i].name + "': " + std::to_string(bytes[i].size()) +
                      " bytes for " + std::to_string(byte_size(tensors[i]))};
      tensors[i].data = bytes[i].data();
    }
    static_cast<model_worker&>(w).update_weights(tensors, weight_update_options_of(kwargs));
    return caf::message{};
  });
  register_method("receive_weights", [](worker& w, const caf::message& args, const caf::settings&) {
    if (args.empty() || !args.match_element<bool>(0))
      throw error{errc::bad_arguments, "receive_weights takes (go, names, dtypes, dims, ndims)"};
    auto go =
      static_cast<model_worker&>(w).receive_weights(args.get_as<bool>(0), tensor_metadata(args, 1));
    return caf::make_message(go);
  });
  register_method(
    "apply_received_weights", [](worker& w, const caf::message&, const caf::settings& kwargs) {
      static_cast<model_worker&>(w).apply_received_weights(weight_update_options_of(kwargs));
      return caf::message{};
    });
  register_method("expert_load", [](worker& w, const caf::message&, const caf::settings&) {
    auto load = static_cast<model_worker&>(w).expert_load();
    return caf::make_message(load[0], load[1], load[2]);
  });
}

model_worker::~model_worker() = default;

std::array<int64_t, 3> model_worker::expert_load() const {
  require_model("expert_load");
  auto [first, count] = state_->model->local_experts();
  return {first, count, state_->model->routed_tokens()};
}

void model_worker::load_model() {
  auto& st = *state_;
  st.config = checkpoint::config_of(options_.model_path);
  // validate() checked the dtype's name.
  auto format = weight_format_for(device(), options_.dtype, st.config.torch_dtype);
  platform_of(device()).share(context().world_size);
  bool presharded = options_.load_format == load_format_kind::sharded_state;
  st.presharded = presharded;
  st.model = std::make_unique<llama_model>(
    st.config, device(), rank(), context().world_size, format.type, format.stored_types,
    options_.cpu_precision == cpu_precision_kind::fast, options_.enable_expert_parallel);
  st.model->capture_decode_steps(!options_.enforce_eager);
  st.model->use_weight_cache(options_.weight_cache);
  // Ranks compare every byte of the files they loaded (the hash is made while loading);
  // one rank compares with nothing, and a sharded state's files differ by design.
  st.model->hash_weights(context().world_size > 1 && !presharded);
  auto ckpt = open_checkpoint();
  st.model->load(ckpt, rank() == 0 ? options_.progress : load_progress{}, presharded);
  st.fingerprint =
    ckpt.fingerprint(to_config_json(st.config), !presharded, st.model->content_hash());
  st.model->hash_weights(false); // a reload (waking from level 2) reads the same files
  if (st.reduce)
    st.model->set_all_reduce(st.reduce);
}

bool model_worker::measures_memory() {
  return platform_of(device()).measures_memory();
}

namespace {

/// How long a rank waits for the others to join the collective, or for a collective call.
constexpr auto collective_timeout = std::chrono::seconds(60);

} // namespace

std::vector<std::string> model_worker::prepare_collective() {
  auto& st = *state_;
  st.bootstrap = platform_of(device()).collective(device(), rank(), context().world_size,
                                                  context().collective_host, collective_timeout);
  return st.bootstrap->prepare();
}

void model_worker::connect_collective(const std::vector<std::vector<std::string>>& table) {
  auto& st = *state_;
  if (!st.bootstrap)
    throw error{errc::invalid_argument, "connect_collective before prepare_collective"};
  auto group = st.bootstrap->connect(table);
  st.bootstrap.reset();
  {
    std::lock_guard<std::mutex> lk{st.group_mtx};
    std::swap(st.group, group);
  }
  group.reset(); // the previous group, outside the lock
  st.reduce = [comm = st.group.get()](float* data, size_t count) { comm->all_reduce(data, count); };
  if (st.model)
    st.model->set_all_reduce(st.reduce);
}

void model_worker::abort_collective(const std::string& why) noexcept {
  auto& st = *state_;
  std::lock_guard<std::mutex> lk{st.group_mtx};
  if (st.group)
    st.group->abort(why);
}

void model_worker::require_awake(const char* what) {
  for (auto tag : device().sleeping_tags())
    throw error{errc::sleeping,
                std::string{what} + " while tag " + to_string(tag) + " sleeps; call wake_up first"};
}

void model_worker::reload_weights() {
  auto& st = *state_;
  require_model("reload_weights");
  require_awake("reload_weights");
  st.model->load(open_checkpoint(), {}, st.presharded);
  auto lora_failure = st.loras.reload(lora_loader(*st.model, options_.max_lora_rank));
  auto prompt_failure =
    st.prompt_adapters.reload(prompt_adapter_loader(*st.model, options_.max_prompt_adapter_token));
  for (auto& failure : {lora_failure, prompt_failure})
    if (failure)
      std::rethrow_exception(failure);
}

void model_worker::require_model(const char* what) const {
  if (!state_->model)
    throw error{errc::unsupported, std::string{what} + ": no model is loaded"};
}

bool model_worker::add_lora(const lora_request& request) {
  require_model("add_lora");
  require_awake("add_lora");
  state_->loras.add(request.lora_int_id, request,
                    lora_loader(*state_->model, options_.max_lora_rank));
  return true;
}

bool model_worker::remove_lora(int64_t lora_id) {
  return state_->loras.remove(lora_id);
}

bool model_worker::pin_lora(int64_t lora_id) {
  require_model("pin_lora");
  require_awake("pin_lora");
  state_->loras.pin(lora_id, lora_loader(*state_->model, options_.max_lora_rank));
  return true;
}

std::vector<int64_t> model_worker::list_loras() {
  return state_->loras.list();
}

bool model_worker::add_prompt_adapter(const prompt_adapter_request& request) {
  require_model("add_prompt_adapter");
  require_awake("add_prompt_adapter");
  // The count goes with the request the slots keep, so that a reload (after an eviction,
  // a level-2 sleep) checks the files against it again.
  auto checked = request;
  if (checked.prompt_adapter_num_virtual_tokens == 0)
    checked.prompt_adapter_num_virtual_tokens = static_cast<int32_t>(
      read_prompt_tuning_config(request.prompt_adapter_local_path).num_virtual_tokens);
  auto load = prompt_adapter_loader(*state_->model, options_.max_prompt_adapter_token);
  bool loaded = false;
  state_->prompt_adapters.add(checked.prompt_adapter_id, checked,
                              [&](const prompt_adapter_request& r) {
                                loaded = true;
                                return load(r);
                              });
  if (loaded) // else the id's adapter was in its slot already, and keeps its count
    state_->virtual_tokens[checked.prompt_adapter_id] = checked.prompt_adapter_num_virtual_tokens;
  return true;
}

bool model_worker::remove_prompt_adapter(int64_t adapter_id) {
  state_->virtual_tokens.erase(adapter_id);
  return state_->prompt_adapters.remove(adapter_id);
}

int32_t model_worker::prompt_adapter_virtual_tokens(int64_t adapter_id) {
  auto at = state_->virtual_tokens.find(adapter_id);
  if (at == state_->virtual_tokens.end())
    throw error{errc::invalid_argument,
                "prompt adapter " + std::to_string(adapter_id) + " was never added"};
  return at->second;
}

bool model_worker::pin_prompt_adapter(int64_t adapter_id) {
  require_model("pin_prompt_adapter");
  require_awake("pin_prompt_adapter");
  state_->prompt_adapters.pin(
    adapter_id, prompt_adapter_loader(*state_->model, options_.max_prompt_adapter_token));
  return true;
}

std::vector<int64_t> model_worker::list_prompt_adapters() {
  return state_->prompt_adapters.list();
}

checkpoint model_worker::open_checkpoint() const {
  if (options_.load_format == load_format_kind::sharded_state &&
      !checkpoint::is_gguf(options_.model_path))
    return checkpoint{options_.model_path, rank_shards()};
  return open_checkpoint(options_.model_path, state_->config);
}

checkpoint model_worker::open_checkpoint(const std::string& path,
                                         const model_config& config) const {
  // Opened for each load and dropped after it: the mappings stay resident while it lives.
  if (checkpoint::is_gguf(path))
    return checkpoint::from_gguf(path, config);
  return checkpoint{path};
}

void model_worker::update_weights(const checkpoint& src, bool whole,
                                  const weight_update_options& options) {
  auto& st = *state_;
  require_model("update_weights");
  // Names, shapes and types are checked while the weights sleep; values need them awake.
  for (auto tag : options.metadata_only ? std::vector<memory_tag>{} : device().sleeping_tags())
    if (tag == memory_tag::weights)
      throw error{
        errc::sleeping,
        "update_weights while tag weights sleeps; call wake_up(tags=[\"weights\"]) first"};
  llama_model::update_options o{whole, options.quantize_on_update,
                                !options.metadata_only && !options.values_checked};
  if (options.check_only || options.metadata_only)
    st.model->check_update(src, o);
  else
    st.model->update(src, o);
}

void model_worker::update_weights(const std::vector<host_tensor>& tensors,
                                  const weight_update_options& options) {
  require_model("update_weights");
  std::vector<tensor_view> views;
  views.reserve(tensors.size());
  for (auto& t : tensors) {
    tensor_view v;
    v.name = t.name;
    v.bytes = byte_size(t);
    v.type = *parse_dtype_name(t.dtype);
    v.shape = t.shape;
    v.data = static_cast<const std::byte*>(t.data);
    if (v.data == nullptr && v.bytes > 0 && !options.metadata_only)
      throw error{errc::invalid_argument, "weight update: tensor '" + t.name + "' has no data"};
    views.push_back(std::move(v));
  }
  update_weights(checkpoint::from_tensors("the given tensors", std::move(views), state_->config),
                 false, options);
}

weight_update_options weight_update_options_of(const caf::settings& kwargs) {
  weight_update_options o;
  o.check_only = caf::get_or(kwargs, "check_only", false);
  o.quantize_on_update = caf::get_or(kwargs, "quantize_on_update", false);
  o.values_checked = caf::get_or(kwargs, "values_checked", false);
  return o;
}

caf::settings to_kwargs(const weight_update_options& options) {
  caf::settings kwargs;
  kwargs["check_only"] = options.check_only;
  kwargs["quantize_on_update"] = options.quantize_on_update;
  kwargs["values_checked"] = options.values_checked;
  return kwargs;
}

tensor_descriptions::tensor_descriptions(const std::vector<host_tensor>& tensors) {
  for (auto& t : tensors)
    add(t);
}

void tensor_descriptions::add(const host_tensor& t) {
  names.push_back(t.name);
  dtypes.push_back(t.dtype);
  dims.insert(dims.end(), t.shape.begin(), t.shape.end());
  ndims.push_back(static_cast<int64_t>(t.shape.size()));
}

size_t byte_size(const host_tensor& t) {
  auto type = parse_dtype_name(t.dtype);
  if (!type)
    throw error{errc::invalid_argument, "weight update: tensor '" + t.name + "' has dtype '" +
                                          t.dtype + "' (float32, float16 or bfloat16)"};
  size_t numel = 1;
  for (auto d : t.shape) {
    if (d < 0)
      throw error{errc::invalid_argument,
                  "weight update: tensor '" + t.name + "' has a negative dimension"};
    numel *= static_cast<size_t>(d);
  }
  return storage_bytes(*type, numel);
}

void model_worker::init_weights_update_group(const std::string& master_address, int32_t master_port,
                                             int32_t rank_offset, int32_t world_size,
                                             const std::string& backend, timeout_type timeout) {
  if (backend == "nccl" && context().device_type != device_kind::cuda)
    throw error{errc::unsupported, "init_weights_update_group: backend 'nccl' needs GPU "
                                   "workers; rank " +
                                     std::to_string(rank()) + " computes on " + device().name() +
                                     " (use 'gloo')"};
  auto member = rank_offset + rank();
  if (rank_offset < 1 || member >= world_size)
    throw error{errc::invalid_argument,
                "init_weights_update_group: rank_offset " + std::to_string(rank_offset) +
                  " puts rank " + std::to_string(rank()) + " outside a world of " +
                  std::to_string(world_size) + " (the trainer is member 0)"};
  // Formed before the old group goes: a call that fails (a bad backend, a trainer that
  // never comes) leaves the group that worked.
  auto next = std::make_unique<weight_update_group>(master_address, master_port, member, world_size,
                                                    timeout, backend, context().device_index);
  auto& st = *state_;
  st.update_group = std::move(next);
  st.update_root = rank_offset;
}

void model_worker::destroy_weights_update_group() {
  state_->update_group.reset();
  state_->received.clear();
  state_->received_sizes.clear();
  state_->received_tensors.clear();
}

bool model_worker::receive_weights(bool go, const std::vector<host_tensor>& metadata) {
  auto& st = *state_;
  if (!st.update_group)
    throw error{errc::invalid_argument,
                "update_weights_from_distributed: no weight-update group (call "
                "init_weights_update_group first)"};
  st.received_tensors.clear();
  std::exception_ptr problem;
  try {
    weight_update_options o;
    o.metadata_only = true;
    o.quantize_on_update = true; // types are checked again when the update is applied
    update_weights(metadata, o);
  } catch (...) {
    problem = std::current_exception();
  }
  // The trainer says first whether it can send (a tensor it cannot read must not leave
  // the engine waiting), then the engine's rank 0 whether the update goes ahead (a refused
  // one must not leave the trainer waiting to send).
  uint8_t ready = 0;
  st.update_group->broadcast(&ready, 1, 0);
  if (ready == 0) {
    if (problem)
      std::rethrow_exception(problem);
    throw error{errc::invalid_argument,
                "update_weights_from_distributed: the trainer called the update off (its "
                "exception says why); nothing changed"};
  }
  uint8_t flag = go && !problem ? 1 : 0;
  st.update_group->broadcast(&flag, 1, st.update_root);
  if (flag == 0) {
    if (problem)
      std::rethrow_exception(problem);
    return false;
  }
  st.received.resize(metadata.size());
  st.received_sizes.resize(metadata.size(), 0);
  for (size_t i = 0; i < metadata.size(); ++i) {
    auto& t = metadata[i];
    // A rank that found a problem its rank 0 did not still takes its part, so that the
    // group stays in step, and fails after.
    // Checked before the flag went out, when it is not `problem`.
    size_t bytes = 0;
    try {
      bytes = byte_size(t);
    } catch (const error&) {
    }
    if (!st.received[i] || st.received_sizes[i] != bytes) {
      st.received[i].reset(new char[std::max<size_t>(bytes, 1)]);
      st.received_sizes[i] = bytes;
    }
    st.update_group->broadcast(st.received[i].get(), bytes, 0);
    auto received = t;
    received.data = st.received[i].get();
    st.received_tensors.push_back(std::move(received));
  }
  if (problem) {
    st.received_tensors.clear();
    std::rethrow_exception(problem);
  }
  return true;
}

const std::vector<host_tensor>& model_worker::received_weights() const {
  return state_->received_tensors;
}

void model_worker::apply_received_weights(const weight_update_options& options) {
  auto& st = *state_;
  if (st.received_tensors.empty())
    throw error{errc::invalid_argument, "no received weights to apply"};
  update_weights(st.received_tensors, options);
  if (!options.check_only)
    st.received_tensors.clear(); // applied: the buffers stay for the next update
}

void model_worker::update_weights_from_disk(const std::string& path,
                                            const weight_update_options& options) {
  auto& st = *state_;
  require_model("update_weights_from_disk");
  // The same model shape, named field by field (a shape check alone would take a model
  // whose heads are cut differently).
  auto next = checkpoint::config_of(path);
  auto& now = st.config;
  std::pair<const char*, bool> same[] = {
    {"architecture", next.architecture == now.architecture},
    {"vocab_size", next.vocab_size == now.vocab_size},
    {"hidden_size", next.hidden_size == now.hidden_size},
    {"intermediate_size", next.intermediate_size == now.intermediate_size},
    {"num_hidden_layers", next.num_hidden_layers == now.num_hidden_layers},
    {"num_attention_heads", next.num_attention_heads == now.num_attention_heads},
    {"num_key_value_heads", next.num_key_value_heads == now.num_key_value_heads},
    {"head_dim", next.head_dim == now.head_dim},
    {"num_experts", next.num_experts == now.num_experts},
    {"moe_intermediate_size", next.moe_intermediate_size == now.moe_intermediate_size},
    {"tie_word_embeddings", next.tie_word_embeddings == now.tie_word_embeddings},
  };
  for (auto& [field, equal] : same)
    if (!equal)
      throw error{errc::invalid_argument, "update_weights_from_disk: '" + path +
                                            "' is not the loaded model's shape (its " + field +
                                            " differs)"};
  update_weights(open_checkpoint(path, next), true, options);
}

std::vector<std::string> model_worker::rank_shards() const {
  namespace fs = std::filesystem;
  auto prefix = "model-rank-" + std::to_string(rank()) + "-part-";
  std::vector<std::pair<long, std::string>> parts;
  std::error_code ec;
  for (auto& entry : fs::directory_iterator(options_.model_path, ec)) {
    auto name = entry.path().filename().string();
    auto suffix = std::string{".safetensors"};
    if (name.rfind(prefix, 0) != 0 || name.size() <= prefix.size() + suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    auto number = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
    if (number.find_first_not_of("0123456789") != std::string::npos)
      continue;
    parts.emplace_back(std::stol(number), entry.path().string());
  }
  if (parts.empty())
    throw error{errc::invalid_argument, "no " + prefix + "*.safetensors in '" +
                                          options_.model_path + "' for load format sharded_state"};
  std::sort(parts.begin(), parts.end());
  std::vector<std::string> files;
  for (auto& p : parts)
    files.push_back(p.second);
  return files;
}

troupe::model* model_worker::get_model() {
  return state_->model.get();
}

int64_t model_worker::profile_step_bytes() {
  auto& st = *state_;
  // max_num_batched_tokens tokens in near-even prompts, as many as max_num_seqs allows and
  // as few as the model's longest sequence does.
  int64_t tokens = std::max(1, options_.max_num_batched_tokens);
  auto max_len = st.config.max_sequence_length();
  auto seqs = std::max<int64_t>((tokens + max_len - 1) / max_len,
                                std::min<int64_t>(std::max(1, options_.max_num_seqs), tokens));
  auto bs = context().block_size;
  // A GPU's free memory before the workspace is reserved: it counts towards the step.
  auto before = measures_memory() ? static_cast<int64_t>(device().free_memory()) : 0;
  // The workspace at its largest (long sequences need wide block tables).
  auto workspace = st.model->reserve(tokens, std::max(1, options_.max_num_seqs),
                                     context().max_model_len, bs, options_.max_lora_rank);
  if (!measures_memory()) {
    // On the CPU a step's activations all live in that workspace, and the logits come back
    // to the host once more; the kernels' own scratch (block sums, a row of attention
    // scores) is a fraction of a percent of that. Computed, not run: the widest step took
    // seconds of start-up.
    return workspace + seqs * st.config.vocab_size * static_cast<int64_t>(sizeof(float));
  }
  // Everything a step allocates on a GPU stays (the model's workspace, the backend's
  // scratch, cuBLAS's workspace): what the device lost once the widest step ran is its peak.
  int32_t blocks = 0;
  execute_model_request req;
  for (int64_t s = 0; s < seqs; ++s) {
    auto len = tokens * (s + 1) / seqs - tokens * s / seqs;
    sequence_group_metadata g;
    g.request_id = "profile-" + std::to_string(s);
    g.is_prompt = true;
    sequence_data seq;
    seq.seq_id = s;
    seq.token_ids.assign(static_cast<size_t>(len), 0);
    seq.num_prompt_tokens = static_cast<int32_t>(len);
    for (int64_t b = 0; b < (len + bs - 1) / bs; ++b)
      seq.block_table.push_back(blocks++);
    g.seqs.push_back(seq);
    g.token_chunk_size = static_cast<int32_t>(len);
    req.seq_group_metadata_list.push_back(std::move(g));
  }
  kv_cache scratch{device(),
                   st.config.num_hidden_layers,
                   st.model->local_kv_heads(),
                   st.config.head_dim,
                   bs,
                   blocks,
                   0};
  std::vector<sample_row> rows;
  st.model->run(req, scratch, rows);
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::vector<int32_t> ranks;
  st.model->sample(std::vector<row_sampling>(rows.size()), ids, logprobs, ranks); // waits for it
  return std::max<int64_t>(0, before - static_cast<int64_t>(device().free_memory()));
}

cache_blocks model_worker::determine_num_available_blocks() {
  auto& st = *state_;
  require_model("determine_num_available_blocks");
  require_awake("determine_num_available_blocks");
  auto block_bytes =
    kv_cache::bytes_per_block(st.config.num_hidden_layers, st.model->local_kv_heads(),
                              st.config.head_dim, context().block_size);
  int64_t budget = options_.kv_cache_memory_bytes;
  if (budget <= 0 && measures_memory()) {
    auto step = profile_step_bytes();
    auto total = static_cast<double>(device().total_memory());
    auto used = total - static_cast<double>(device().free_memory());
    // vLLM's rule: the cache gets what is left of gpu_memory_utilization of the GPU once
    // everything in use (weights, the profiled step's activations, the CUDA context) is
    // counted.
    budget = static_cast<int64_t>(options_.gpu_memory_utilization * total - used);
    if (budget < block_bytes)
      throw error{errc::memory_error,
                  "no room for a KV cache on " + device().name() + ": gpu_memory_utilization " +
                    std::to_string(options_.gpu_memory_utilization) + " of " +
                    std::to_string(static_cast<int64_t>(total)) + " bytes, with " +
                    std::to_string(static_cast<int64_t>(used)) +
                    " bytes in use (a profiled step took " + std::to_string(step) +
                    "), holds no block of " + std::to_string(block_bytes) + " bytes"};
  } else if (budget <= 0) {
    auto free_bytes = static_cast<double>(device().free_memory());
    auto step = profile_step_bytes();
    // Ranks of one process share its memory (and profile it at the same time): each takes
    // its share.
    auto ranks = std::max(1, context().world_size);
    budget = static_cast<int64_t>(options_.kv_cache_memory_fraction * free_bytes / ranks) - step;
    if (budget < block_bytes)
      throw error{errc::memory_error,
                  "no room for a KV cache: " + std::to_string(options_.kv_cache_memory_fraction) +
                    " of " + std::to_string(static_cast<int64_t>(free_bytes)) +
                    " free bytes, less a profiled step of " + std::to_string(step) +
                    " bytes, holds no block of " + std::to_string(block_bytes) + " bytes"};
  }
  auto most = kv_cache::max_device_blocks(context().block_size);
  return {std::min(budget / block_bytes, most),
          std::min(options_.swap_space_bytes / block_bytes, most)};
}

void model_worker::initialize_cache(const cache_blocks& blocks) {
  auto& st = *state_;
  require_model("initialize_cache");
  kv_cache::validate(st.config.num_hidden_layers, st.model->local_kv_heads(), st.config.head_dim,
                     context().block_size, blocks.num_device_blocks, blocks.num_swap_blocks);
  st.cache.reset(); // the old cache goes first: both at once may not fit
  st.kept.clear();
  st.cache = std::make_unique<kv_cache>(
    device(), st.config.num_hidden_layers, st.model->local_kv_heads(), st.config.head_dim,
    context().block_size, blocks.num_device_blocks, blocks.num_swap_blocks);
}

std::vector<sampler_output> model_worker::execute_model(const execute_model_request& request) {
  auto& st = *state_;
  if (!st.model || !st.cache)
    throw error{errc::unsupported, "execute_model before initialize_cache"};
  st.cache->swap_in(request.blocks_to_swap_in);
  st.cache->swap_out(request.blocks_to_swap_out);
  st.cache->copy(request.blocks_to_copy);
  st.kept.update(request, st.cache->device_blocks());
  if (request.seq_group_metadata_list.empty())
    return {};
  // The adapters of the step's groups, loading evicted ones that the step names again.
  std::set<int64_t> lora_ids;
  std::set<int64_t> prompt_ids;
  for (auto& g : request.seq_group_metadata_list) {
    lora_ids.insert(g.lora_int_id);
    prompt_ids.insert(g.prompt_adapter_id);
  }
  step_adapters adapters;
  bool uses_adapters = lora_ids != std::set<int64_t>{0} || prompt_ids != std::set<int64_t>{0};
  std::exception_ptr failed;
  try {
    if (lora_ids != std::set<int64_t>{0}) {
      auto loras = st.loras.use(lora_ids, lora_loader(*st.model, options_.max_lora_rank));
      for (auto& g : request.seq_group_metadata_list)
        adapters.lora.push_back(loras.at(g.lora_int_id));
    }
    if (prompt_ids != std::set<int64_t>{0}) {
      auto prompts = st.prompt_adapters.use(
        prompt_ids, prompt_adapter_loader(*st.model, options_.max_prompt_adapter_token));
      for (auto& g : request.seq_group_metadata_list)
        adapters.prompt.push_back(prompts.at(g.prompt_adapter_id));
    }
  } catch (...) {
    failed = std::current_exception();
  }
  // Loading an adapter may fail on one rank only (a file missing on one node): the ranks
  // agree first, so that none enters the step's all-reduces without the others.
  if (uses_adapters && st.reduce) {
    float failures = failed ? 1.0f : 0.0f;
    if (st.flag.size() == 0)
      st.flag = device_buffer(device(), sizeof(float), memory_tag::kv_cache);
    device().copy(st.flag.data(), &failures, sizeof failures);
    st.reduce(st.flag.as<float>(), 1);
    device().copy(&failures, st.flag.data(), sizeof failures);
    if (failures > 0 && !failed)
      throw error{errc::worker_error, "another rank could not load the step's adapters"};
  }
  if (failed)
    std::rethrow_exception(failed);
  auto batch = prepare_batch(request, st.config, st.cache->block_size(), st.cache->device_blocks(),
                             adapters, &st.kept);
  st.model->forward(batch, *st.cache);
  if (rank() != 0)
    return {}; // only the driver's output is used
  auto& rows = batch.rows;
  auto vocab = st.config.vocab_size;
  auto& groups = request.seq_group_metadata_list;
  // Unless a group asks for top logprobs or prompt logprobs, every row is sampled on the
  // device, after its logits processors and structured output's mask, and only the tokens
  // come back; otherwise the logits do, for the host sampler (which picks alike).
  bool on_device = batch.prompt_rows.empty();
  for (auto& g : groups)
    if (g.do_sample) {
      validate(g.sampling, vocab);
      on_device = on_device && g.sampling.logprobs <= 0;
    }
  auto step_of = [](const sequence_data& seq) { return seq.length() - seq.num_prompt_tokens; };
  // Structured output's mask of each row, if any.
  auto mask_of = [&](size_t row) -> const uint32_t* {
    auto& mask = groups[rows[row].group].allowed_tokens;
    return mask.empty() ? nullptr : mask.data();
  };
  // What each row's processors change: its edits, from `edits_from[row]` on.
  std::vector<logit_edit> edits;
  std::vector<size_t> edits_from(rows.size() + 1, 0);
  for (size_t row = 0; row < rows.size(); ++row) {
    auto& group = groups[rows[row].group];
    auto& seq = group.seqs[rows[row].seq];
    auto& mask = group.allowed_tokens;
    edits_from[row] = edits.size();
    if (!mask.empty() && static_cast<int64_t>(mask.size()) * 32 < vocab)
      throw error{errc::invalid_argument, "request '" + group.request_id +
                                            "': its token mask covers " +
                                            std::to_string(mask.size() * 32) + " of the " +
                                            std::to_string(vocab) + " tokens"};
    if (processes_logits(group.sampling)) {
      if (seq.first_token != 0 && reads_history(group.sampling))
        throw error{errc::invalid_argument,
                    "request '" + group.request_id +
                      "' samples with penalties or min_tokens, "
                      "which read all its tokens, but sent them from position " +
                      std::to_string(seq.first_token)};
      auto stop_ids = group.sampling.stop_token_ids;
      if (!group.sampling.ignore_eos)
        stop_ids.insert(stop_ids.end(), st.config.eos_token_ids.begin(),
                        st.config.eos_token_ids.end());
      logit_edits(group.sampling, vocab, seq.token_ids, static_cast<size_t>(seq.num_prompt_tokens),
                  stop_ids, static_cast<int32_t>(row), edits);
    }
    // The processing would leave nothing the mask allows (min_tokens holding back the end
    // a complete structured output allows only): the mask decides.
    if (!mask.empty() && bans_every_allowed(edits.data() + edits_from[row],
                                            edits.size() - edits_from[row], mask.data(), vocab))
      edits.resize(edits_from[row]);
  }
  edits_from[rows.size()] = edits.size();
  auto edited = [&](size_t row) {
    return mask_of(row) != nullptr || edits_from[row + 1] > edits_from[row];
  };
  std::vector<float> logits;
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::vector<int32_t> ranks;
  if (on_device) {
    std::vector<row_sampling> params;
    std::vector<uint32_t> masks;
    auto words = st.model->mask_words();
    for (size_t row = 0; row < rows.size(); ++row) {
      auto& group = groups[rows[row].group];
      auto& seq = group.seqs[rows[row].seq];
      row_sampling p;
      if (!is_greedy(group.sampling)) {
        p.temperature = group.sampling.temperature;
        p.top_k = group.sampling.top_k;
        p.top_p = group.sampling.top_p;
        p.min_p = group.sampling.min_p;
        p.u =
          draw_uniform(group.sampling, static_cast<int64_t>(rows[row].seq), step_of(seq), st.rng);
      }
      p.edited = edited(row) ? 1 : 0;
      p.masked = mask_of(row) != nullptr ? 1 : 0;
      if (p.masked != 0) {
        masks.resize(rows.size() * static_cast<size_t>(words));
        std::copy_n(group.allowed_tokens.begin(), words,
                    masks.begin() + static_cast<std::ptrdiff_t>(row) * words);
      }
      params.push_back(p);
    }
    st.model->sample(params, ids, logprobs, ranks, edits, masks);
  } else {
    logits = st.model->logits();
  }
  sampler_output out;
  // The prompt positions' logprobs, from the rows after the sampled ones.
  std::vector<std::vector<prompt_logprob>> prompt_logprobs(groups.size());
  for (size_t k = 0; k < batch.prompt_rows.size(); ++k) {
    auto& p = batch.prompt_rows[k];
    prompt_logprobs[p.group].push_back(
      prompt_logprob_of(&logits[(rows.size() + k) * static_cast<size_t>(vocab)], vocab, p.position,
                        p.token, groups[p.group].sampling.prompt_logprobs));
  }
  std::vector<float> processed;
  size_t row = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& group = groups[g];
    sequence_group_output group_out;
    group_out.request_id = group.request_id;
    group_out.prompt_logprobs = std::move(prompt_logprobs[g]);
    for (; row < rows.size() && rows[row].group == g; ++row) {
      auto& seq = group.seqs[rows[row].seq];
      sequence_output sample;
      if (on_device) {
        sample.output_token = ids[row];
        sample.logprob = logprobs[row];
        sample.rank = ranks[row];
      } else {
        const float* raw = &logits[row * vocab];
        const float* drawn_from = nullptr;
        if (edited(row)) {
          processed.resize(static_cast<size_t>(vocab));
          edit_row(raw, processed.data(), vocab, mask_of(row), edits.data() + edits_from[row],
                   edits_from[row + 1] - edits_from[row]);
          drawn_from = processed.data();
        }
        sample = sample_token(raw, vocab, group.sampling, static_cast<int64_t>(rows[row].seq),
                              step_of(seq), st.rng, drawn_from);
      }
      sample.parent_seq_id = seq.seq_id;
      group_out.samples.push_back(std::move(sample));
    }
    out.outputs.push_back(std::move(group_out));
  }
  return {out};
}

void model_worker::save_sharded_state(const sharded_state_request& request) {
  auto& st = *state_;
  require_model("save_sharded_state");
  require_awake("save_sharded_state");
  namespace fs = std::filesystem;
  if (!fs::is_directory(request.path))
    throw error{errc::invalid_argument,
                "save_sharded_state: '" + request.path + "' is not a directory"};
  auto pattern = request.pattern.empty() ? std::string{"model-rank-{rank}-part-{part}.safetensors"}
                                         : request.pattern;
  auto max_size = request.max_size > 0 ? request.max_size : int64_t{5} << 30;
  auto file_name = [&](int part) {
    auto name = pattern;
    for (auto [key, value] : {std::pair<std::string, std::string>{"{rank}", std::to_string(rank())},
                              {"{part}", std::to_string(part)}}) {
      auto at = name.find(key);
      if (at == std::string::npos)
        throw error{errc::invalid_argument,
                    "save_sharded_state: pattern '" + pattern + "' lacks " + key};
      name.replace(at, key.size(), value);
    }
    return (fs::path{request.path} / name).string();
  };
  // Parts of at most max_size bytes; a tensor larger than that gets a part to itself.
  std::vector<safetensors_writer> parts(1);
  // The tensors on the host, in their own types (the writers refer to them).
  const auto& tensors = st.model->tensors();
  std::vector<std::vector<char>> host;
  host.reserve(tensors.size());
  int64_t used = 0;
  for (auto& t : tensors) {
    host.push_back(st.model->download(t));
    auto type = t.type;
    if (is_quantized(type)) {
      // safetensors has no block formats: such weights are saved as float32.
      size_t numel =
        host.back().size() / block_bytes(type) * static_cast<size_t>(block_elements(type));
      std::vector<char> wide(numel * sizeof(float));
      to_float(type, host.back().data(), reinterpret_cast<float*>(wide.data()), numel);
      host.back() = std::move(wide);
      type = dtype::f32;
    }
    auto bytes = static_cast<int64_t>(host.back().size());
    if (used > 0 && used + bytes > max_size) {
      parts.emplace_back();
      used = 0;
    }
    parts.back().add(t.name, type, t.shape, host.back().data(), host.back().size());
    used += bytes;
  }
  std::vector<std::string> written;
  try {
    for (size_t part = 0; part < parts.size(); ++part) {
      auto path = file_name(static_cast<int>(part));
      parts[part].write(path);
      written.push_back(path);
    }
  } catch (...) {
    for (auto& path : written)
      fs::remove(path); // nothing partial stays behind
    throw;
  }
}

void model_worker::describe_model(worker_info& info) const {
  info.model = options_.model_path;
  info.model_fingerprint = state_->fingerprint;
}

worker_factory model_worker_factory(model_worker_options options) {
  return [options](int32_t) { return std::make_unique<model_worker>(options); };
}

} // namespace troupe

namespace troupe {

namespace {

/// An enum option's value from its name (the second argument picks the parser).
load_format_kind parse_option(const std::string& name, load_format_kind) {
  return parse_load_format(name);
}

cpu_precision_kind parse_option(const std::string& name, cpu_precision_kind) {
  return parse_cpu_precision(name);
}

// One list of the options that travel, used both ways.
template <class F>
void each_option(model_worker_options& o, F&& f) {
  f("model_path", o.model_path);
  f("load_format", o.load_format);
  f("dtype", o.dtype);
  f("enforce_eager", o.enforce_eager);
  f("cpu_precision", o.cpu_precision);
  f("enable_expert_parallel", o.enable_expert_parallel);
  f("weight_cache", o.weight_cache);
  f("kv_cache_memory_bytes", o.kv_cache_memory_bytes);
  f("kv_cache_memory_fraction", o.kv_cache_memory_fraction);
  f("gpu_memory_utilization", o.gpu_memory_utilization);
  f("max_num_batched_tokens", o.max_num_batched_tokens);
  f("max_num_seqs", o.max_num_seqs);
  f("swap_space_bytes", o.swap_space_bytes);
  f("max_loras", o.max_loras);
  f("max_lora_rank", o.max_lora_rank);
  f("max_prompt_adapters", o.max_prompt_adapters);
  f("max_prompt_adapter_token", o.max_prompt_adapter_token);
}

} // namespace

caf::settings to_settings(const model_worker_options& options) {
  caf::settings out;
  auto copy = options;
  each_option(copy, [&](const char* key, auto& value) {
    using value_type = std::decay_t<decltype(value)>;
    if constexpr (std::is_enum<value_type>::value)
      caf::put(out, key, std::string{to_string(value)});
    else if constexpr (std::is_integral<value_type>::value)
      caf::put(out, key, static_cast<int64_t>(value));
    else
      caf::put(out, key, value);
  });
  return out;
}

model_worker_options model_worker_options_from(const caf::settings& settings) {
  model_worker_options out;
  each_option(out, [&](const char* key, auto& value) {
    using value_type = std::decay_t<decltype(value)>;
    auto at = settings.find(key);
    if (at == settings.end())
      return;
    auto bad = [&](const char* want) {
      throw error{errc::invalid_argument,
                  std::string{"model worker option '"} + key + "' must be " + want};
    };
    if constexpr (std::is_enum<value_type>::value) {
      auto v = caf::get_if<std::string>(&at->second);
      if (!v)
        bad("a string");
      value = parse_option(*v, value);
    } else if constexpr (std::is_integral<value_type>::value) {
      auto v = caf::get_if<int64_t>(&at->second);
      if (!v || *v < std::numeric_limits<value_type>::min() ||
          *v > std::numeric_limits<value_type>::max())
        bad("an integer in range");
      value = static_cast<value_type>(*v);
    } else if constexpr (std::is_floating_point<value_type>::value) {
      auto v = caf::get_if<double>(&at->second);
      if (!v)
        bad("a number");
      value = *v;
    } else {
      auto v = caf::get_if<std::string>(&at->second);
      if (!v)
        bad("a string");
      value = *v;
    }
  });
  return out;
}

node_worker_factory model_worker_kind() {
  return [](int32_t, const caf::settings& settings) -> std::unique_ptr<worker> {
    return std::make_unique<model_worker>(model_worker_options_from(settings));
  };
}

} // namespace troupe
