#include "model/adapters.hpp"

#include "model/mapped_file.hpp"
#include "troupe/errors.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>

namespace troupe {

namespace {

using json = nlohmann::json;

[[noreturn]] void bad_adapter(const std::string& path, const std::string& what) {
  throw error{errc::invalid_argument, "adapter '" + path + "': " + what};
}

json read_adapter_config(const std::string& path) {
  auto file = (std::filesystem::path{path} / "adapter_config.json").string();
  if (!std::filesystem::exists(file))
    bad_adapter(path, "no adapter_config.json");
  auto config = json::parse(read_small_file(file, "adapter config", 1 << 20), nullptr, false);
  if (config.is_discarded() || !config.is_object())
    bad_adapter(path, "adapter_config.json is not a JSON object");
  return config;
}

std::string peft_type(const json& config) {
  auto i = config.find("peft_type");
  return i != config.end() && i->is_string() ? i->get<std::string>() : std::string{};
}

bool is_set(const json& config, const char* key) {
  auto i = config.find(key);
  if (i == config.end() || i->is_null())
    return false;
  if (i->is_boolean())
    return i->get<bool>();
  if (i->is_object() || i->is_array() || i->is_string())
    return !i->empty() && !(i->is_string() && i->get<std::string>().empty());
  return true;
}

/// A fused projection's name and the projections it holds, in row order.
struct fused_module {
  const char* name;
  std::vector<projection> parts;
};

const fused_module fused_modules[] = {
  {"self_attn.qkv_proj", {projection::q, projection::k, projection::v}},
  {"mlp.gate_up_proj", {projection::gate, projection::up}},
};

/// "model.layers.3.self_attn.q_proj.lora_A.weight" (after PEFT's "base_model.model."):
/// layer 3, {q}, A; a fused projection's name gives the projections it holds.
bool parse_factor_name(std::string name, int64_t& layer, std::vector<projection>& projs,
                       bool& is_a) {
  const std::string peft_prefix = "base_model.model.";
  if (name.rfind(peft_prefix, 0) == 0)
    name = name.substr(peft_prefix.size());
  const std::string layers_prefix = "model.layers.";
  if (name.rfind(layers_prefix, 0) != 0)
    return false;
  auto rest = name.substr(layers_prefix.size());
  auto dot = rest.find('.');
  if (dot == 0 || dot == std::string::npos ||
      rest.substr(0, dot).find_first_not_of("0123456789") != std::string::npos || dot > 9)
    return false;
  layer = std::stoll(rest.substr(0, dot));
  rest = rest.substr(dot + 1);
  std::vector<std::pair<std::string, std::vector<projection>>> modules;
  for (size_t p = 0; p < projection_count; ++p) {
    auto parent = p <= static_cast<size_t>(projection::o) ? "self_attn." : "mlp.";
    modules.push_back({parent + std::string{module_name(static_cast<projection>(p))},
                       {static_cast<projection>(p)}});
  }
  for (auto& f : fused_modules)
    modules.push_back({f.name, f.parts});
  for (auto& [module, parts] : modules)
    for (auto [suffix, a] :
         {std::pair<const char*, bool>{".lora_A.weight", true}, {".lora_B.weight", false}})
      if (rest == module + suffix) {
        projs = parts;
        is_a = a;
        return true;
      }
  return false;
}

} // namespace

const char* module_name(projection p) {
  switch (p) {
  case projection::q:
    return "q_proj";
  case projection::k:
    return "k_proj";
  case projection::v:
    return "v_proj";
  case projection::o:
    return "o_proj";
  case projection::gate:
    return "gate_proj";
  case projection::up:
    return "up_proj";
  case projection::down:
    return "down_proj";
  }
  return "?";
}

peft_lora read_peft_lora(const std::string& path, const model_config& model) {
  const auto num_layers = model.num_hidden_layers;
  // The rows of each projection's output, to cut a fused B.
  auto rows_of = [&](projection p) {
    switch (p) {
    case projection::q:
      return model.num_attention_heads * model.head_dim;
    case projection::k:
    case projection::v:
      return model.num_key_value_heads * model.head_dim;
    case projection::gate:
    case projection::up:
      return model.intermediate_size;
    default:
      return model.hidden_size;
    }
  };
  auto config = read_adapter_config(path);
  if (peft_type(config) != "LORA")
    bad_adapter(path, "peft_type is '" + peft_type(config) + "', not LORA");
  auto alpha_it = config.find("lora_alpha");
  if (alpha_it == config.end() || !alpha_it->is_number() || alpha_it->get<double>() <= 0)
    bad_adapter(path, "lora_alpha must be a positive number");
  auto alpha = alpha_it->get<double>();
  // peft's LoRA on parameters rather than layers: a mixture's merged experts.
  if (is_set(config, "target_parameters"))
    bad_adapter(path, "target_parameters " + config["target_parameters"].dump() +
                        " adapts parameters that are not linear layers (a mixture's experts); "
                        "troupe adapts q/k/v/o/gate/up/down_proj layers only");
  // Features that change the computation beyond y += scaling · B·A·x are refused, never
  // silently dropped.
  for (auto key : {"use_dora", "lora_bias", "fan_in_fan_out", "modules_to_save", "alpha_pattern",
                   "layer_replication", "trainable_token_indices"})
    if (is_set(config, key))
      bad_adapter(path, std::string{key} + " is set; troupe applies plain LoRA only");
  if (config.contains("bias") && config["bias"] != "none")
    bad_adapter(path, "bias is " + config["bias"].dump() + "; troupe applies LoRA without biases");
  bool rslora = is_set(config, "use_rslora");

  peft_lora out;
  out.path = path;
  auto file = (std::filesystem::path{path} / "adapter_model.safetensors").string();
  if (!std::filesystem::exists(file))
    bad_adapter(path, "no adapter_model.safetensors");
  out.file = std::make_unique<safetensors_file>(file);
  out.layers.resize(static_cast<size_t>(num_layers));
  for (auto& t : out.file->tensors()) {
    int64_t layer = 0;
    std::vector<projection> projs;
    bool is_a = false;
    if (!parse_factor_name(t.name, layer, projs, is_a))
      bad_adapter(path, "tensor '" + t.name +
                          "' is not a LoRA factor of q/k/v/o/gate/up/down_proj (or "
                          "qkv_proj, gate_up_proj) of a layer");
    if (layer >= num_layers)
      bad_adapter(path, "tensor '" + t.name + "' names layer " + std::to_string(layer) +
                          "; the model has " + std::to_string(num_layers));
    if (t.shape.size() != 2 || t.shape[0] <= 0 || t.shape[1] <= 0)
      bad_adapter(path, "tensor '" + t.name + "' is not a non-empty matrix");
    auto& layer_factors = out.layers[static_cast<size_t>(layer)];
    if (is_a || projs.size() == 1) {
      for (auto p : projs)
        (is_a ? layer_factors[static_cast<size_t>(p)].a : layer_factors[static_cast<size_t>(p)].b) =
          &t;
      continue;
    }
    // A fused B: each projection's rows, in order.
    int64_t rows = 0;
    for (auto p : projs)
      rows += rows_of(p);
    if (t.shape[0] != rows)
      bad_adapter(path, "tensor '" + t.name + "' has " + std::to_string(t.shape[0]) +
                          " rows; the model's fused projection has " + std::to_string(rows));
    int64_t first = 0;
    for (auto p : projs) {
      auto part = std::make_unique<tensor_view>(t.rows(first, rows_of(p)));
      first += rows_of(p);
      layer_factors[static_cast<size_t>(p)].b = part.get();
      out.parts.push_back(std::move(part));
    }
  }
  for (size_t l = 0; l < out.layers.size(); ++l) {
    for (size_t p = 0; p < projection_count; ++p) {
      auto& f = out.layers[l][p];
      if (!f.a && !f.b)
        continue;
      auto where = "layer " + std::to_string(l) + " " + module_name(static_cast<projection>(p));
      if (!f.a || !f.b)
        bad_adapter(path, where + " has only its lora_" + (f.a ? "A" : "B") + " factor");
      auto rank = f.a->shape[0];
      if (f.b->shape[1] != rank)
        bad_adapter(path, where + ": lora_A has rank " + std::to_string(rank) + ", lora_B " +
                            std::to_string(f.b->shape[1]));
      f.scaling = static_cast<float>(
        alpha / (rslora ? std::sqrt(static_cast<double>(rank)) : static_cast<double>(rank)));
      out.rank = std::max(out.rank, rank);
    }
  }
  if (out.rank == 0)
    bad_adapter(path, "adapter_model.safetensors holds no LoRA factors");
  return out;
}

peft_prompt_tuning read_prompt_tuning_config(const std::string& path) {
  auto config = read_adapter_config(path);
  if (peft_type(config) != "PROMPT_TUNING")
    bad_adapter(path, "peft_type is '" + peft_type(config) + "', not PROMPT_TUNING");
  if (config.contains("task_type") && config["task_type"] != "CAUSAL_LM")
    bad_adapter(path, "task_type is " + config["task_type"].dump() + ", not CAUSAL_LM");
  auto positive = [&](const char* key) {
    auto i = config.find(key);
    if (i == config.end() || !i->is_number_integer() || i->get<int64_t>() <= 0 ||
        i->get<int64_t>() > (int64_t{1} << 24))
      bad_adapter(path, std::string{key} + " must be a positive integer");
    return i->get<int64_t>();
  };
  peft_prompt_tuning out;
  out.num_virtual_tokens = positive("num_virtual_tokens");
  out.token_dim = positive("token_dim");
  if (config.contains("num_transformer_submodules") && config["num_transformer_submodules"] != 1)
    bad_adapter(path, "num_transformer_submodules is not 1 (an encoder-decoder adapter)");
  return out;
}

} // namespace troupe
