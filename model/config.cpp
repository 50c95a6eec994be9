#include "model/config.hpp"

#include "model/mapped_file.hpp"
#include "troupe/errors.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

namespace troupe {

namespace {

using json = nlohmann::json;

[[noreturn]] void bad_config(const std::string& origin, const std::string& what) {
  throw error{errc::invalid_argument, "model config '" + origin + "': " + what};
}

int64_t positive_int(const json& j, const char* key, const std::string& origin) {
  if (!j.contains(key))
    bad_config(origin, std::string{"missing "} + key);
  if (!j[key].is_number_integer() || j[key].get<int64_t>() <= 0)
    bad_config(origin, std::string{key} + " must be a positive integer, got a " +
                         (j[key].is_number() ? "number " + std::to_string(j[key].get<double>())
                                             : std::string{j[key].type_name()}));
  return j[key].get<int64_t>();
}

/// Token ids under `key`: one, or a list (Llama 3's several end tokens), -1 left out; none
/// when absent or null. Anything else is refused, naming the key.
std::vector<int32_t> token_ids(const json& j, const char* key, const std::string& origin) {
  std::vector<int32_t> ids;
  if (!j.contains(key) || j[key].is_null())
    return ids;
  auto take = [&](const json& v) {
    if (!v.is_number_integer() || v.get<int64_t>() < std::numeric_limits<int32_t>::min() ||
        v.get<int64_t>() > std::numeric_limits<int32_t>::max())
      bad_config(origin, std::string{key} + " must be token ids, got " + v.dump());
    // -1 is "none"; other ids outside the vocabulary are refused by the validation.
    if (v.get<int32_t>() != -1)
      ids.push_back(v.get<int32_t>());
  };
  if (j[key].is_array()) {
    for (auto& v : j[key])
      take(v);
  } else {
    take(j[key]);
  }
  return ids;
}

int32_t token_id(const json& j, const char* key, const std::string& origin) {
  auto ids = token_ids(j, key, origin);
  return ids.empty() ? -1 : ids.front();
}

/// The experts of a Mixtral or Qwen3-MoE config: how many (`num_local_experts`, as
/// transformers 5 writes it, or `num_experts`), how many a token, how wide; Qwen3-MoE's
/// dense layers and `norm_topk_prob`.
void parse_experts(const json& j, model_config& c, const std::string& origin) {
  c.num_experts =
    positive_int(j, j.contains("num_local_experts") ? "num_local_experts" : "num_experts", origin);
  c.num_experts_per_tok = positive_int(j, "num_experts_per_tok", origin);
  if (c.architecture == "MixtralForCausalLM") {
    c.moe_intermediate_size = c.intermediate_size;
    return;
  }
  c.moe_intermediate_size = positive_int(j, "moe_intermediate_size", origin);
  // transformers' Qwen3-MoE default is off; the published models turn it on.
  c.norm_topk_prob = j.contains("norm_topk_prob") && j["norm_topk_prob"].is_boolean() &&
                     j["norm_topk_prob"].get<bool>();
  int64_t step =
    j.contains("decoder_sparse_step") ? positive_int(j, "decoder_sparse_step", origin) : 1;
  std::vector<bool> dense(static_cast<size_t>(c.num_hidden_layers), false);
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
    dense[static_cast<size_t>(layer)] = (layer + 1) % step != 0;
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
    if (!j["mlp_only_layers"].is_array())
      bad_config(origin, "mlp_only_layers must be a list of layers");
    for (auto& v : j["mlp_only_layers"]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.num_hidden_layers)
        bad_config(origin, "mlp_only_layers names " + v.dump() + ", not a layer of " +
                             std::to_string(c.num_hidden_layers));
      dense[static_cast<size_t>(v.get<int64_t>())] = true;
    }
  }
  if (std::find(dense.begin(), dense.end(), true) != dense.end())
    c.dense_layers = dense;
}

} // namespace

void validate_model_config(const model_config& c, const std::string& origin) {
  // Bounds keep every size product of the runtime far from overflow.
  auto check = [&](const char* name, int64_t v, int64_t limit) {
    if (v <= 0 || v > limit)
      bad_config(origin, std::string{name} + " must be in [1, " + std::to_string(limit) +
                           "], got " + std::to_string(v));
  };
  check("vocab_size", c.vocab_size, int64_t{1} << 24);
  check("hidden_size", c.hidden_size, int64_t{1} << 20);
  check("intermediate_size", c.intermediate_size, int64_t{1} << 22);
  check("num_hidden_layers", c.num_hidden_layers, 4096);
  check("num_attention_heads", c.num_attention_heads, 4096);
  check("num_key_value_heads", c.num_key_value_heads, 4096);
  check("head_dim", c.head_dim, 4096);
  check("max_position_embeddings", c.max_position_embeddings, int64_t{1} << 24);
  if (c.num_experts != 0) {
    check("num_experts", c.num_experts, 4096);
    check("num_experts_per_tok", c.num_experts_per_tok, c.num_experts);
    check("moe_intermediate_size", c.moe_intermediate_size, int64_t{1} << 22);
    if (!c.dense_layers.empty() &&
        static_cast<int64_t>(c.dense_layers.size()) != c.num_hidden_layers)
      bad_config(origin, "the dense layers name " + std::to_string(c.dense_layers.size()) +
                           " layers of " + std::to_string(c.num_hidden_layers));
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    bad_config(origin, "num_attention_heads " + std::to_string(c.num_attention_heads) +
                         " is not a multiple of num_key_value_heads " +
                         std::to_string(c.num_key_value_heads));
  if (c.head_dim % 2 != 0)
    bad_config(origin, "head_dim must be even for rotary embeddings");
  if (c.rotary_dim < 0 || c.rotary_dim > c.head_dim || c.rotary_dim % 2 != 0)
    bad_config(origin, "the rotated part of each head (" + std::to_string(c.rotary_dim) +
                         " of head_dim " + std::to_string(c.head_dim) +
                         ") must be even and at most head_dim");
  if (!(c.rms_norm_eps > 0) || !(c.rope_theta > 0))
    bad_config(origin, "rms_norm_eps and rope_theta must be positive");
  if (!(c.query_pre_attn_scalar >= 0) || !std::isfinite(c.query_pre_attn_scalar) ||
      !(c.local_rope_theta >= 0) || !std::isfinite(c.local_rope_theta))
    bad_config(origin, "query_pre_attn_scalar and the local rope base must be positive");
  if (!(c.attn_logit_softcapping >= 0) || !std::isfinite(c.attn_logit_softcapping) ||
      !(c.final_logit_softcapping >= 0) || !std::isfinite(c.final_logit_softcapping))
    bad_config(origin, "attn_logit_softcapping and final_logit_softcapping must be positive");
  using rope = rope_scaling_config::kind;
  auto& r = c.rope_scaling;
  if (r.type != rope::none) {
    // Every scaling divides by its factor; llama3 also by high_freq_factor - low_freq_factor.
    if (!(r.factor > 0) || !std::isfinite(r.factor))
      bad_config(origin, "rope_scaling.factor must be positive, got " + std::to_string(r.factor));
    if ((r.type == rope::yarn || r.type == rope::dynamic) && r.factor < 1)
      bad_config(origin, "rope_scaling.factor must be at least 1, got " + std::to_string(r.factor));
  }
  if (r.type == rope::llama3 &&
      (!(r.low_freq_factor > 0) || !(r.high_freq_factor > r.low_freq_factor) ||
       !std::isfinite(r.high_freq_factor)))
    bad_config(origin, "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got " +
                         std::to_string(r.low_freq_factor) + " and " +
                         std::to_string(r.high_freq_factor));
  if ((r.type == rope::llama3 || r.type == rope::yarn) && r.original_max_position_embeddings <= 0)
    bad_config(origin, "rope_scaling.original_max_position_embeddings must be positive, got " +
                         std::to_string(r.original_max_position_embeddings));
  if (r.type == rope::longrope) {
    auto half = static_cast<size_t>(c.rotated_dims() / 2);
    for (auto* f : {&r.short_factor, &r.long_factor}) {
      if (f->size() != half)
        bad_config(origin, "rope_scaling needs " + std::to_string(half) +
                             " short_factor and long_factor values (half the rotated part "
                             "of a head), got " +
                             std::to_string(f->size()));
      for (auto v : *f)
        if (!(v > 0) || !std::isfinite(v))
          bad_config(origin, "rope_scaling's short_factor and long_factor must be positive");
    }
    if (r.original_max_position_embeddings <= 0 || !(r.attention_factor > 0))
      bad_config(origin, "rope_scaling needs a positive original_max_position_embeddings "
                         "and attention_factor");
  }
  if (r.type == rope::yarn &&
      (!(r.beta_fast > r.beta_slow) || !(r.beta_slow > 0) || !(r.attention_factor > 0)))
    bad_config(origin, "rope_scaling needs beta_fast > beta_slow > 0 and a positive "
                       "attention_factor");
  auto in_vocabulary = [&](const char* key, int32_t id) {
    if (id != -1 && (id < 0 || id >= c.vocab_size))
      bad_config(origin, std::string{key} + " " + std::to_string(id) +
                           " is outside the vocabulary of " + std::to_string(c.vocab_size));
  };
  in_vocabulary("bos_token_id", c.bos_token_id);
  for (auto id : c.eos_token_ids)
    in_vocabulary("eos_token_id", id);
}

void model_config::add_eos_token(int32_t id) {
  if (id != -1 && std::find(eos_token_ids.begin(), eos_token_ids.end(), id) == eos_token_ids.end())
    eos_token_ids.push_back(id);
}

int64_t model_config::max_sequence_length() const {
  using rope = rope_scaling_config::kind;
  auto scaled = [](int64_t length, double factor) {
    return static_cast<int64_t>(static_cast<double>(length) * factor);
  };
  switch (rope_scaling.type) {
  case rope::linear:
  case rope::dynamic:
    return std::max(max_position_embeddings, scaled(max_position_embeddings, rope_scaling.factor));
  case rope::yarn:
    return std::max(max_position_embeddings,
                    scaled(rope_scaling.original_max_position_embeddings, rope_scaling.factor));
  default:
    return max_position_embeddings;
  }
}

int64_t model_config::window_of(int64_t layer) const {
  if (sliding_window <= 0)
    return 0;
  if (sliding_layers.empty())
    return sliding_window;
  return sliding_layers.at(static_cast<size_t>(layer)) ? sliding_window : 0;
}

bool model_config::sparse(int64_t layer) const {
  return num_experts > 0 && (dense_layers.empty() || !dense_layers.at(static_cast<size_t>(layer)));
}

std::string router_weight_name(const model_config& c, int64_t layer) {
  auto block = c.architecture == "MixtralForCausalLM" ? ".block_sparse_moe" : ".mlp";
  return "model.layers." + std::to_string(layer) + block + ".gate.weight";
}

std::string expert_weight_name(const model_config& c, int64_t layer, int64_t expert,
                               const std::string& proj) {
  auto prefix = "model.layers." + std::to_string(layer);
  auto e = std::to_string(expert);
  if (c.architecture == "MixtralForCausalLM")
    return prefix + ".block_sparse_moe.experts." + e + "." +
           (proj == "gate" ? "w1"
            : proj == "up" ? "w3"
                           : "w2") +
           ".weight";
  return prefix + ".mlp.experts." + e + "." + proj + "_proj.weight";
}

int64_t model_config::num_parameters() const {
  auto q = num_attention_heads * head_dim;
  auto kv = num_key_value_heads * head_dim;
  int64_t per_layer = hidden_size * (q + 2 * kv) + q * hidden_size + 2 * hidden_size;
  if (attention_bias)
    per_layer += q + 2 * kv;
  if (o_proj_bias)
    per_layer += hidden_size;
  if (mlp_bias)
    per_layer += 2 * intermediate_size + hidden_size;
  if (qk_norm)
    per_layer += 2 * head_dim;
  if (sandwich_norms)
    per_layer += 2 * hidden_size;
  int64_t total = num_hidden_layers * per_layer + vocab_size * hidden_size + hidden_size;
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer)
    total += sparse(layer) ? num_experts * (3 * hidden_size * moe_intermediate_size + hidden_size)
                           : 3 * hidden_size * intermediate_size;
  if (!tie_word_embeddings)
    total += vocab_size * hidden_size;
  return total;
}

model_config parse_model_config(const std::string& json_text, const std::string& origin) {
  auto j = json::parse(json_text, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    bad_config(origin, "not a JSON object");
  model_config c;
  if (!j.contains("architectures") || !j["architectures"].is_array() ||
      j["architectures"].empty() || !j["architectures"][0].is_string())
    bad_config(origin, "missing architectures");
  c.architecture = j["architectures"][0].get<std::string>();
  if (c.architecture != "LlamaForCausalLM" && c.architecture != "MistralForCausalLM" &&
      c.architecture != "Qwen2ForCausalLM" && c.architecture != "Qwen3ForCausalLM" &&
      c.architecture != "Phi3ForCausalLM" && c.architecture != "Gemma2ForCausalLM" &&
      c.architecture != "Gemma3ForCausalLM" && c.architecture != "MixtralForCausalLM" &&
      c.architecture != "Qwen3MoeForCausalLM")
    bad_config(origin, "architecture " + c.architecture +
                         " is not supported (LlamaForCausalLM, MistralForCausalLM, "
                         "Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
                         "Gemma2ForCausalLM, Gemma3ForCausalLM, MixtralForCausalLM, "
                         "Qwen3MoeForCausalLM)");
  const bool gemma3 = c.architecture == "Gemma3ForCausalLM";
  const bool gemma = gemma3 || c.architecture == "Gemma2ForCausalLM";
  const bool qwen3_moe = c.architecture == "Qwen3MoeForCausalLM";
  c.qk_norm = c.architecture == "Qwen3ForCausalLM" || qwen3_moe || gemma3;
  if (gemma) {
    c.scale_embeddings = true;
    c.norm_weight_offset = 1;
    c.sandwich_norms = true;
    c.hidden_act = "gelu_pytorch_tanh";
  }
  for (auto key : {"hidden_activation", "hidden_act"})
    if (j.contains(key) && j[key].is_string()) {
      c.hidden_act = j[key].get<std::string>();
      break;
    }
  if (c.hidden_act != "silu" && c.hidden_act != "gelu_pytorch_tanh")
    bad_config(origin,
               "hidden activation " + c.hidden_act + " is not supported (silu, gelu_pytorch_tanh)");
  if (j.contains("query_pre_attn_scalar") && j["query_pre_attn_scalar"].is_number())
    c.query_pre_attn_scalar = j["query_pre_attn_scalar"].get<double>();
  // Numbers, or null for none.
  for (auto [key, value] : {std::pair{"attn_logit_softcapping", &c.attn_logit_softcapping},
                            {"final_logit_softcapping", &c.final_logit_softcapping}})
    if (j.contains(key) && j[key].is_number())
      *value = j[key].get<double>();
  c.vocab_size = positive_int(j, "vocab_size", origin);
  c.hidden_size = positive_int(j, "hidden_size", origin);
  c.intermediate_size = positive_int(j, "intermediate_size", origin);
  c.num_hidden_layers = positive_int(j, "num_hidden_layers", origin);
  c.num_attention_heads = positive_int(j, "num_attention_heads", origin);
  c.num_key_value_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                            ? positive_int(j, "num_key_value_heads", origin)
                            : c.num_attention_heads;
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    bad_config(origin, "num_attention_heads " + std::to_string(c.num_attention_heads) +
                         " is not a multiple of num_key_value_heads " +
                         std::to_string(c.num_key_value_heads));
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    c.head_dim = positive_int(j, "head_dim", origin);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      bad_config(origin, "hidden_size is not a multiple of num_attention_heads");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0)
    bad_config(origin, "head_dim must be even for rotary embeddings");
  if (j.contains("max_position_embeddings"))
    c.max_position_embeddings = positive_int(j, "max_position_embeddings", origin);
  if (j.contains("rms_norm_eps") && j["rms_norm_eps"].is_number())
    c.rms_norm_eps = j["rms_norm_eps"].get<double>();
  // transformers 4 writes rope_theta and rope_scaling; transformers 5 folds both into
  // rope_parameters.
  // Gemma 3's have one entry per layer type (the full layers' and the sliding ones'); 4.x
  // kept the sliding layers' base apart, as rope_local_base_freq.
  const json* rope = nullptr;
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object())
    rope = &j["rope_parameters"];
  else if (j.contains("rope_scaling") && j["rope_scaling"].is_object())
    rope = &j["rope_scaling"];
  if (rope && rope->contains("full_attention") && (*rope)["full_attention"].is_object()) {
    if (rope->contains("sliding_attention") && (*rope)["sliding_attention"].is_object()) {
      auto& local = (*rope)["sliding_attention"];
      auto type = local.value("rope_type", std::string{"default"});
      if (type != "default")
        bad_config(origin, "rope type " + type +
                             " of the sliding layers is not supported "
                             "(default)");
      if (local.contains("rope_theta") && local["rope_theta"].is_number())
        c.local_rope_theta = local["rope_theta"].get<double>();
    }
    rope = &(*rope)["full_attention"];
  }
  if (j.contains("rope_local_base_freq") && j["rope_local_base_freq"].is_number())
    c.local_rope_theta = j["rope_local_base_freq"].get<double>();
  // Phi-4-mini rotates only part of each head (transformers 5 keeps the factor with the
  // rope parameters): int(head_dim × factor) entries, as transformers counts them. Other
  // families rotate whole heads.
  for (const json* holder : {static_cast<const json*>(&j), rope})
    if (holder && holder->contains("partial_rotary_factor") &&
        (*holder)["partial_rotary_factor"].is_number() &&
        (*holder)["partial_rotary_factor"].get<double>() != 1.0) {
      auto factor = (*holder)["partial_rotary_factor"].get<double>();
      if (c.architecture != "Phi3ForCausalLM")
        bad_config(origin, "partial_rotary_factor " + (*holder)["partial_rotary_factor"].dump() +
                             " is supported for Phi3ForCausalLM only (" + c.architecture +
                             " rotates whole heads)");
      if (!(factor > 0 && factor < 1))
        bad_config(origin, "partial_rotary_factor must be in (0, 1], got " +
                             (*holder)["partial_rotary_factor"].dump());
      c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * factor);
    }
  if (j.contains("rope_theta") && j["rope_theta"].is_number())
    c.rope_theta = j["rope_theta"].get<double>();
  else if (rope && rope->contains("rope_theta") && (*rope)["rope_theta"].is_number())
    c.rope_theta = (*rope)["rope_theta"].get<double>();
  if (rope) {
    auto& rs = *rope;
    auto type = rs.value("rope_type", rs.value("type", std::string{}));
    auto& r = c.rope_scaling;
    auto number = [&](const char* key, double fallback) {
      return rs.contains(key) && rs[key].is_number() ? rs[key].get<double>() : fallback;
    };
    r.factor = number("factor", 1.0);
    r.original_max_position_embeddings = static_cast<int64_t>(
      number("original_max_position_embeddings", type == "llama3" ? 8192.0 : 0.0));
    if (type == "llama3") {
      r.type = rope_scaling_config::kind::llama3;
      r.factor = number("factor", 8.0);
      r.low_freq_factor = number("low_freq_factor", 1.0);
      r.high_freq_factor = number("high_freq_factor", 4.0);
    } else if (type == "linear") {
      r.type = rope_scaling_config::kind::linear;
    } else if (type == "dynamic") {
      r.type = rope_scaling_config::kind::dynamic;
    } else if (type == "yarn") {
      r.type = rope_scaling_config::kind::yarn;
      if (r.original_max_position_embeddings <= 0)
        r.original_max_position_embeddings = c.max_position_embeddings;
      // beta_fast and beta_slow of 0 or absent take the paper's 32 and 1, as transformers.
      r.beta_fast = number("beta_fast", 0.0) > 0 ? number("beta_fast", 0.0) : 32.0;
      r.beta_slow = number("beta_slow", 0.0) > 0 ? number("beta_slow", 0.0) : 1.0;
      r.truncate = rs.value("truncate", true);
      auto mscale = [](double scale, double m) {
        return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
      };
      auto m = number("mscale", 0.0);
      auto m_all = number("mscale_all_dim", 0.0);
      r.attention_factor = rs.contains("attention_factor") && rs["attention_factor"].is_number()
                             ? rs["attention_factor"].get<double>()
                           : m > 0 && m_all > 0 ? mscale(r.factor, m) / mscale(r.factor, m_all)
                                                : mscale(r.factor, 1.0);
    } else if (type == "longrope" || type == "su") {
      // Phi-3 keeps the trained length beside rope_scaling; the factor is how far past it
      // max_position_embeddings reaches (transformers' reading).
      r.type = rope_scaling_config::kind::longrope;
      if (j.contains("original_max_position_embeddings"))
        r.original_max_position_embeddings =
          positive_int(j, "original_max_position_embeddings", origin);
      if (r.original_max_position_embeddings > 0)
        r.factor = static_cast<double>(c.max_position_embeddings) /
                   static_cast<double>(r.original_max_position_embeddings);
      else
        r.original_max_position_embeddings = c.max_position_embeddings;
      r.attention_factor =
        rs.contains("attention_factor") && rs["attention_factor"].is_number()
          ? rs["attention_factor"].get<double>()
        : r.factor <= 1
          ? 1.0
          : std::sqrt(1 + std::log(r.factor) /
                            std::log(static_cast<double>(r.original_max_position_embeddings)));
      auto factors = [&](const char* key) {
        std::vector<double> out;
        if (rs.contains(key) && rs[key].is_array())
          for (auto& v : rs[key]) {
            if (!v.is_number())
              bad_config(origin, std::string{"rope_scaling."} + key + " holds a non-number");
            out.push_back(v.get<double>());
          }
        return out;
      };
      r.short_factor = factors("short_factor");
      r.long_factor = factors("long_factor");
    } else if (!type.empty() && type != "default") {
      bad_config(origin, "rope type " + type +
                           " is not supported (default, linear, dynamic, yarn, llama3, "
                           "longrope)");
    }
  }
  // A config with a `use_sliding_window` switch (Qwen2, Qwen3) slides only when it is on: real
  // Qwen2 checkpoints ship it off next to a 4096 window and 32K-128K positions. Mistral's
  // window has no switch and slides in every layer; Qwen2's in the layers from
  // max_window_layers on, unless `layer_types` names the sliding layers (as transformers
  // writes it).
  bool window = true;
  if (j.contains("use_sliding_window")) {
    auto& on = j["use_sliding_window"];
    window = on.is_boolean() && on.get<bool>();
  }
  if (window && j.contains("sliding_window") && j["sliding_window"].is_number_integer() &&
      j["sliding_window"].get<int64_t>() > 0)
    c.sliding_window = j["sliding_window"].get<int64_t>();
  if (j.contains("layer_types") && j["layer_types"].is_array()) {
    for (auto& type : j["layer_types"]) {
      auto name = type.is_string() ? type.get<std::string>() : type.dump();
      if (name != "sliding_attention" && name != "full_attention")
        bad_config(origin, "layer type '" + name +
                             "' is not supported (full_attention, sliding_attention)");
      c.sliding_layers.push_back(name == "sliding_attention");
    }
    if (static_cast<int64_t>(c.sliding_layers.size()) != c.num_hidden_layers)
      bad_config(origin, "layer_types has " + std::to_string(c.sliding_layers.size()) +
                           " entries for " + std::to_string(c.num_hidden_layers) + " layers");
  } else if (c.sliding_window > 0 && j.contains("sliding_window_pattern") &&
             j["sliding_window_pattern"].is_number_integer() &&
             j["sliding_window_pattern"].get<int64_t>() > 0) {
    // transformers 4's Gemma 3: every pattern-th layer is global.
    auto pattern = j["sliding_window_pattern"].get<int64_t>();
    for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
      c.sliding_layers.push_back((layer + 1) % pattern != 0);
  } else if (c.sliding_window > 0 && c.architecture == "Gemma2ForCausalLM") {
    // transformers 4's Gemma 2: the even layers slide.
    for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
      c.sliding_layers.push_back(layer % 2 == 0);
  } else if (c.sliding_window > 0 && j.contains("use_sliding_window")) {
    // transformers' Qwen2 default is 28.
    auto first = j.contains("max_window_layers") && j["max_window_layers"].is_number_integer()
                   ? j["max_window_layers"].get<int64_t>()
                   : 28;
    for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
      c.sliding_layers.push_back(layer >= first);
  }
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  // Qwen2 biases q, k and v always; Llama's (and Qwen3's) attention_bias biases o_proj as
  // well.
  auto flag = [&](const char* key) {
    return j.contains(key) && j[key].is_boolean() && j[key].get<bool>();
  };
  c.o_proj_bias = c.architecture != "Qwen2ForCausalLM" && flag("attention_bias");
  c.attention_bias = c.architecture == "Qwen2ForCausalLM" || c.o_proj_bias;
  c.mlp_bias = flag("mlp_bias");
  // transformers 5 writes dtype, earlier versions torch_dtype.
  for (auto key : {"dtype", "torch_dtype"})
    if (j.contains(key) && j[key].is_string()) {
      c.torch_dtype = j[key].get<std::string>();
      break;
    }
  if (c.architecture == "MixtralForCausalLM" || qwen3_moe)
    parse_experts(j, c, origin);
  c.bos_token_id = token_id(j, "bos_token_id", origin);
  for (auto id : token_ids(j, "eos_token_id", origin))
    c.add_eos_token(id);
  validate_model_config(c, origin);
  return c;
}

model_config load_model_config(const std::string& directory) {
  auto path = directory + "/config.json";
  auto c = parse_model_config(read_small_file(path, "model config", 16 << 20), path);
  // generation_config.json's end tokens end sequences too (as vLLM adds them to a
  // request's stop tokens): Llama 3 Instruct lists its end of turn there.
  auto generation = directory + "/generation_config.json";
  if (std::filesystem::exists(generation)) {
    auto j =
      json::parse(read_small_file(generation, "generation config", 16 << 20), nullptr, false);
    if (j.is_discarded() || !j.is_object())
      bad_config(generation, "not a JSON object");
    for (auto id : token_ids(j, "eos_token_id", generation))
      c.add_eos_token(id);
    validate_model_config(c, generation);
  }
  return c;
}

std::string to_config_json(const model_config& c) {
  using rope = rope_scaling_config::kind;
  json j;
  j["architectures"] = {c.architecture};
  j["model_type"] = c.architecture == "Qwen2ForCausalLM"      ? "qwen2"
                    : c.architecture == "Qwen3ForCausalLM"    ? "qwen3"
                    : c.architecture == "MistralForCausalLM"  ? "mistral"
                    : c.architecture == "Phi3ForCausalLM"     ? "phi3"
                    : c.architecture == "Gemma2ForCausalLM"   ? "gemma2"
                    : c.architecture == "Gemma3ForCausalLM"   ? "gemma3_text"
                    : c.architecture == "MixtralForCausalLM"  ? "mixtral"
                    : c.architecture == "Qwen3MoeForCausalLM" ? "qwen3_moe"
                                                              : "llama";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  if (c.rotary_dim > 0 && c.rotary_dim != c.head_dim)
    j["partial_rotary_factor"] =
      static_cast<double>(c.rotary_dim) / static_cast<double>(c.head_dim);
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  switch (c.rope_scaling.type) {
  case rope::none:
    break;
  case rope::linear:
  case rope::dynamic:
    j["rope_scaling"] = {{"rope_type", c.rope_scaling.type == rope::linear ? "linear" : "dynamic"},
                         {"factor", c.rope_scaling.factor}};
    break;
  case rope::yarn:
    j["rope_scaling"] = {
      {"rope_type", "yarn"},
      {"factor", c.rope_scaling.factor},
      {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings},
      {"beta_fast", c.rope_scaling.beta_fast},
      {"beta_slow", c.rope_scaling.beta_slow},
      {"attention_factor", c.rope_scaling.attention_factor},
      {"truncate", c.rope_scaling.truncate}};
    break;
  case rope::llama3:
    j["rope_scaling"] = {
      {"rope_type", "llama3"},
      {"factor", c.rope_scaling.factor},
      {"low_freq_factor", c.rope_scaling.low_freq_factor},
      {"high_freq_factor", c.rope_scaling.high_freq_factor},
      {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
    break;
  case rope::longrope:
    j["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings;
    j["rope_scaling"] = {{"rope_type", "longrope"},
                         {"attention_factor", c.rope_scaling.attention_factor},
                         {"short_factor", c.rope_scaling.short_factor},
                         {"long_factor", c.rope_scaling.long_factor}};
    break;
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  if (c.architecture != "Qwen2ForCausalLM")
    j["attention_bias"] = c.o_proj_bias;
  j["mlp_bias"] = c.mlp_bias;
  if (c.sliding_window > 0)
    j["sliding_window"] = c.sliding_window;
  if (!c.sliding_layers.empty()) {
    auto& types = j["layer_types"] = json::array();
    for (bool slides : c.sliding_layers)
      types.push_back(slides ? "sliding_attention" : "full_attention");
  }
  j["hidden_act"] = c.hidden_act;
  if (c.query_pre_attn_scalar > 0)
    j["query_pre_attn_scalar"] = c.query_pre_attn_scalar;
  if (c.attn_logit_softcapping > 0)
    j["attn_logit_softcapping"] = c.attn_logit_softcapping;
  if (c.final_logit_softcapping > 0)
    j["final_logit_softcapping"] = c.final_logit_softcapping;
  if (c.local_rope_theta > 0)
    j["rope_local_base_freq"] = c.local_rope_theta;
  if (c.num_experts > 0) {
    j["num_local_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
    auto& dense = j["mlp_only_layers"] = json::array();
    for (size_t layer = 0; layer < c.dense_layers.size(); ++layer)
      if (c.dense_layers[layer])
        dense.push_back(layer);
  }
  if (c.bos_token_id >= 0)
    j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1)
    j["eos_token_id"] = c.eos_token_ids.front();
  else if (!c.eos_token_ids.empty())
    j["eos_token_id"] = c.eos_token_ids;
  j["torch_dtype"] = c.torch_dtype;
  return j.dump(2);
}

} // namespace troupe
