#pragma once

/// @file
/// The product's worker: runs a Llama-family model from a Hugging Face directory on its
/// device, with a paged KV cache.

#include "troupe/node.hpp"
#include "troupe/worker.hpp"

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace troupe {

class checkpoint;
struct model_config;

/// How a model worker reads its checkpoint (vLLM's `load_format`).
enum class load_format_kind : uint8_t {
  /// "auto": the Hugging Face checkpoint or GGUF file, split for this rank at load.
  automatic = 0,
  /// "sharded_state": this rank's files as `save_sharded_state` wrote them.
  sharded_state = 1,
};

/// "auto" or "sharded_state".
const char* to_string(load_format_kind format);

/// The format of a name; throws `invalid_argument` naming the known ones for any other.
load_format_kind parse_load_format(std::string_view name);

/// How the CPU multiplies weights kept in a block format (see
/// `model_worker_options::cpu_precision`).
enum class cpu_precision_kind : uint8_t {
  /// "exact": float32 activations against the weights as stored.
  exact = 0,
  /// "fast": weights repacked, activations rounded to 8-bit integers or bfloat16.
  fast = 1,
};

/// "exact" or "fast".
const char* to_string(cpu_precision_kind precision);

/// The precision of a name; throws `invalid_argument` naming the known ones for any other.
cpu_precision_kind parse_cpu_precision(std::string_view name);

/// What a model worker loads and how much memory it may use.
struct model_worker_options {
  /// Hugging Face model directory (`config.json` + `*.safetensors`), or a `.gguf` file
  /// (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K tensors; see
  /// `dtype`).
  std::string model_path;
  /// `automatic`: the Hugging Face checkpoint, split for this rank at load.
  /// `sharded_state`: this rank's `model-rank-{rank}-part-{part}.safetensors` files as
  /// `save_sharded_state` wrote them (next to a `config.json`), loaded as they are.
  load_format_kind load_format = load_format_kind::automatic;
  /// The element type of the weights (vLLM's `dtype`): `"float32"`, `"float16"`,
  /// `"bfloat16"`, or `"auto"`: on the CPU the type the checkpoint stores each weight in
  /// (GGUF's block formats, 16-bit or 32-bit floats),
  /// computed without converting it; on a GPU the checkpoint's bfloat16, else float16 (as
  /// vLLM's `auto`).
  /// Activations, the KV cache and the logits are float32 either way; `"float32"` is the
  /// exact path.
  std::string dtype = "auto";
  /// Run every step call by call (vLLM's `enforce_eager`); otherwise a GPU records each
  /// decode shape once as a CUDA graph and replays it.
  bool enforce_eager = false;
  /// How the CPU multiplies weights kept in a block format. `exact`: float32 activations
  /// against the dequantized weights (transformers' numbers up to the order of sums).
  /// `fast`: the weights repacked at load for the CPU's GEMMs, activations rounded to
  /// 8-bit integers (per block of 32, or 256 for the k-quants) and products summed as
  /// integers for Q8_0, Q4_0, Q4_1, Q4_K and Q6_K weights (CPUs with AVX-512 VNNI), rounded
  /// to bfloat16 for BF16 weights (AVX-512 BF16), F16 weights repacked only (float32
  /// products, exact's up to the order of sums); other formats and CPUs compute exactly. As
  /// llama.cpp computes them: logits move slightly, as far as llama.cpp's do (`troupe
  /// perplexity` and scripts/fidelity.sh measure it), which can flip a near-tie.
  cpu_precision_kind cpu_precision = cpu_precision_kind::exact;
  /// How a mixture of experts (Mixtral, Qwen3-MoE) is split over the tensor-parallel ranks
  /// (vLLM's `enable_expert_parallel`): off, every expert's columns across the ranks, as a
  /// dense MLP's; on, whole experts, a near-even share of them on each rank. Either way
  /// every rank routes every token and the layer's all-reduce sums the experts' outputs.
  bool enable_expert_parallel = false;
  /// A directory where the CPU keeps each rank's weights as it computes on them (repacked,
  /// converted), one file per model file and rank, so that the next start maps them from
  /// the page cache instead of reading and repacking the checkpoint. A file is used only
  /// when it was made from the same model files, unchanged since, in the same layout. Empty
  /// (the default): none. The `troupe` commands default to `~/.cache/troupe/weights`.
  std::string weight_cache;
  /// Bytes for the device KV cache; 0 sizes it from the device's memory after a profiled
  /// step at the largest batch: on the CPU `kv_cache_memory_fraction` of the free memory
  /// (after the weights are loaded) less the step's peak; on a GPU what is left of
  /// `gpu_memory_utilization` of the GPU's memory once the weights and the step's
  /// activations are counted (as vLLM does).
  int64_t kv_cache_memory_bytes = 0;
  double kv_cache_memory_fraction = 0.5;
  double gpu_memory_utilization = 0.9;
  /// The largest step the scheduler will send (vLLM's `max_num_batched_tokens` and
  /// `max_num_seqs`); `determine_num_available_blocks` runs one such step to measure it.
  int32_t max_num_batched_tokens = 2048;
  int32_t max_num_seqs = 64;
  /// Bytes of host memory for swapped-out KV blocks (vLLM's `swap_space`).
  int64_t swap_space_bytes = 0;
  /// LoRA adapters held loaded at once (vLLM's `max_loras`); a step uses at most this many
  /// distinct ones. Adding one more evicts the least recently used unpinned adapter.
  int32_t max_loras = 1;
  /// The highest LoRA rank accepted (vLLM's `max_lora_rank`).
  int32_t max_lora_rank = 16;
  /// Prompt adapters held loaded at once (vLLM's `max_prompt_adapters`).
  int32_t max_prompt_adapters = 1;
  /// The most virtual tokens a prompt adapter may have; 0 for no limit.
  int32_t max_prompt_adapter_token = 0;
  /// Weight loading progress of rank 0: tensors done and in all.
  std::function<void(size_t done, size_t total)> progress;

  /// Throws `troupe::error` (`invalid_argument`) naming the first field out of range: an
  /// unknown dtype or load format, a memory fraction outside (0, 1], a negative size, a
  /// limit below 1.
  void validate() const;
};

/// A tensor in host memory as a weight update takes it: a Hugging Face parameter name,
/// the element type (`"float32"`, `"float16"`, `"bfloat16"`), the shape, and the elements
/// in row-major order, which must stay valid for the call.
struct host_tensor {
  std::string name;
  std::string dtype = "float32";
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

/// The bytes of `t`'s elements. Throws `invalid_argument` naming the tensor for a dtype
/// other than those above or a negative dimension.
size_t byte_size(const host_tensor& t);

/// Tensors described as the named update methods take them (`check_weight_metadata`,
/// `receive_weights`, `update_weights_from_bytes`): the names, the dtypes, every dimension
/// in order, and each tensor's number of dimensions.
struct tensor_descriptions {
  std::vector<std::string> names;
  std::vector<std::string> dtypes;
  std::vector<int64_t> dims;
  std::vector<int64_t> ndims;

  tensor_descriptions() = default;
  explicit tensor_descriptions(const std::vector<host_tensor>& tensors);
  void add(const host_tensor& t);
};

/// How a weight update goes (`model_worker::update_weights`).
struct weight_update_options {
  /// Check everything and change nothing (the first round of an update over the ranks).
  bool check_only = false;
  /// Weights kept in a block format (GGUF's Q4_K, Q8_0 …) may be written from float
  /// tensors, quantized again as the file's type; refused otherwise.
  bool quantize_on_update = false;
  /// Check names, shapes and types alone (implies `check_only`): the tensors' data may be
  /// null, before it is received.
  bool metadata_only = false;
  /// A `check_only` round just before looked at every value of these tensors: the update
  /// writes them without looking again (the engine's second round).
  bool values_checked = false;
};

/// `options` as the keyword arguments of the named update methods
/// (`update_weights_from_disk`, `apply_received_weights`): `check_only`,
/// `quantize_on_update`, `values_checked`.
caf::settings to_kwargs(const weight_update_options& options);

/// Options from those keyword arguments; missing ones are false.
weight_update_options weight_update_options_of(const caf::settings& kwargs);

/// Runs the model of `options.model_path`, this rank's shard of it, on the worker's device
/// (the CPU, or a GPU with NCCL between the ranks).
///
/// Beyond the built-in methods it registers `reload_weights` (reads the checkpoint again
/// into the same memory, the step after a level-2 sleep), `update_weights_from_disk` (a
/// path; keyword arguments `check_only` and `quantize_on_update`, see
/// `weight_update_options`) and `expert_load` (for a mixture of experts, the rank's experts
/// and what they took in the last step: three int64s, the first expert, how many, and the
/// tokens they computed over the sparse layers).
///
/// LoRA adapters (PEFT directories: `adapter_config.json` + `adapter_model.safetensors`,
/// any of q/k/v/o/gate/up/down_proj) and prompt-tuning adapters live in `max_loras` and
/// `max_prompt_adapters` slots under the `weights` tag (they sleep with the weights); the
/// groups of a step are computed with the adapters their `lora_int_id` and
/// `prompt_adapter_id` name, several different ones in one step. The engine puts
/// `num_virtual_tokens` placeholder tokens before a prompt whose adapter is a prompt
/// adapter; their embeddings are the adapter's. Errors (a missing or broken file,
/// a malformed request) are `troupe::error`s naming the file, tensor or request.
class model_worker : public worker {
public:
  explicit model_worker(model_worker_options options);
  ~model_worker() override;

  void load_model() override;
  /// On the CPU opens this rank's Gloo pairs (TCP on the context's collective_host); on a
  /// GPU rank 0 makes the NCCL unique id, which `connect_collective` hands to every rank.
  std::vector<std::string> prepare_collective() override;
  void connect_collective(const std::vector<std::vector<std::string>>& table) override;
  /// Aborts the connected group (Gloo's pairs fail, the in-process group is left, NCCL's
  /// communicator aborts).
  void abort_collective(const std::string& why) noexcept override;
  troupe::model* get_model() override;
  cache_blocks determine_num_available_blocks() override;
  void initialize_cache(const cache_blocks& blocks) override;
  std::vector<sampler_output> execute_model(const execute_model_request& request) override;
  void save_sharded_state(const sharded_state_request& request) override;
  void describe_model(worker_info& info) const override;
  bool add_lora(const lora_request& request) override;
  bool remove_lora(int64_t lora_id) override;
  bool pin_lora(int64_t lora_id) override;
  std::vector<int64_t> list_loras() override;
  bool add_prompt_adapter(const prompt_adapter_request& request) override;
  bool remove_prompt_adapter(int64_t adapter_id) override;
  bool pin_prompt_adapter(int64_t adapter_id) override;
  std::vector<int64_t> list_prompt_adapters() override;
  int32_t prompt_adapter_virtual_tokens(int64_t adapter_id) override;

  /// Reads the weights again from the checkpoint, into the memory they occupy, and the
  /// loaded adapters from their directories.
  void reload_weights();

  /// Writes new weights over the loaded ones, this rank's part of each, into the memory
  /// they occupy (same layout and types; converted as a load converts). `tensors` may be
  /// any subset of the model's parameters under their Hugging Face names, whole (each rank
  /// takes its shard). Everything is checked before anything is written: a name the model
  /// does not have, a shape or type that does not fit, a float tensor for a quantized
  /// weight (unless `quantize_on_update`), NaN or an infinity throw `invalid_argument`
  /// naming the parameter, with nothing changed. Throws `sleeping` while the weights tag
  /// sleeps (the KV cache may sleep).
  void update_weights(const std::vector<host_tensor>& tensors,
                      const weight_update_options& options = {});

  /// The same from a checkpoint of the same model shape (a Hugging Face directory or a
  /// GGUF file), which must hold every weight. Adapters are kept as loaded.
  void update_weights_from_disk(const std::string& path, const weight_update_options& options = {});

  /// Joins a weight-update group (`weight_update_group`) as its member
  /// `rank_offset + rank()` of `world_size` (SGLang's `init_weights_update_group`); the
  /// trainer is member 0. `backend` is `"gloo"`, or `"nccl"` on GPU workers (each rank on
  /// its GPU; what it receives is staged into host memory, as Gloo's is). Blocks until every
  /// member has come, or `timeout`. Replaces a group joined before.
  void init_weights_update_group(const std::string& master_address, int32_t master_port,
                                 int32_t rank_offset, int32_t world_size,
                                 const std::string& backend, timeout_type timeout);

  /// Leaves the weight-update group (and frees the buffers updates were received into);
  /// nothing when there is none.
  void destroy_weights_update_group();

  /// One round of an update over the group: member 0 (the trainer) broadcasts whether it
  /// can send (when not, this throws `invalid_argument`), then member `rank_offset` (the
  /// engine's rank 0) broadcasts `go`; when it is true every member receives the tensors
  /// `metadata` describes (names, types and shapes; no data), each broadcast by member 0 in
  /// turn, and keeps them for `apply_received_weights`. Returns `go`.
  bool receive_weights(bool go, const std::vector<host_tensor>& metadata);

  /// `update_weights` with the tensors the last `receive_weights` received, once (not after
  /// `check_only`). Their host buffers stay for the next update until the group is left.
  void apply_received_weights(const weight_update_options& options);

  /// `expert_load`'s answer: this rank's first expert, its number of experts, and the
  /// tokens they computed in the last step (a token routed to two counts twice).
  std::array<int64_t, 3> expert_load() const;

  /// The tensors the last `receive_weights` received, whole, until they are applied.
  const std::vector<host_tensor>& received_weights() const;

private:
  /// Throws `errc::sleeping` naming `what` while any memory tag sleeps.
  void require_awake(const char* what);

  /// Throws `errc::unsupported` naming `what` before a model is loaded.
  void require_model(const char* what) const;

  /// The peak memory in bytes of a step at the largest batch, whose activation memory the
  /// model keeps: run on a scratch cache on a GPU, computed from the workspace on the CPU.
  int64_t profile_step_bytes();

  /// Whether the device's memory is measured rather than computed (a GPU's; see
  /// `platform::measures_memory`).
  bool measures_memory();

  /// The weights to load, opened for one load: the model's, or those at `path`.
  checkpoint open_checkpoint() const;
  checkpoint open_checkpoint(const std::string& path, const model_config& config) const;

  /// `update_weights` from an opened checkpoint (`whole`: it must hold every weight).
  void update_weights(const checkpoint& src, bool whole, const weight_update_options& options);

  /// This rank's sharded-state files, in part order.
  std::vector<std::string> rank_shards() const;

  struct state;
  model_worker_options options_;
  std::unique_ptr<state> state_;
};

/// A factory for `executor` that gives every rank a `model_worker` with `options`.
worker_factory model_worker_factory(model_worker_options options);

/// `options` as settings under their field names (for `cluster_config::node_worker_options`;
/// the progress callback stays behind).
caf::settings to_settings(const model_worker_options& options);

/// Options from settings as `to_settings` writes them; missing keys keep their defaults.
/// Throws `invalid_argument` naming a key of the wrong type.
model_worker_options model_worker_options_from(const caf::settings& settings);

/// The worker kind `"model"` of a node (`node_config::kinds`): a `model_worker` from the
/// executor's options.
node_worker_factory model_worker_kind();

} // namespace troupe
