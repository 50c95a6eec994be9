#include "model/make_model.hpp"

#include "model/safetensors.hpp"
#include "troupe/errors.hpp"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <cstdio>
#include <cstring>
#include <random>

namespace troupe {

namespace {

struct spec {
  std::string name;
  std::vector<int64_t> shape;
  enum { normal, ones, zeros } init;
};

std::vector<spec> tensor_specs(const model_config& c) {
  const auto H = c.hidden_size;
  const auto Q = c.num_attention_heads * c.head_dim;
  const auto KV = c.num_key_value_heads * c.head_dim;
  const auto I = c.intermediate_size;
  // Norms that multiply by 1 + w (Gemma) store 0 for a norm of 1.
  const auto norm = c.norm_weight_offset != 0 ? spec::zeros : spec::ones;
  // Phi-3 stores q, k and v as one matrix, and gate over up as another.
  const bool fused = c.architecture == "Phi3ForCausalLM";
  std::vector<spec> specs;
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, H}, spec::normal});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    auto p = "model.layers." + std::to_string(i) + ".";
    specs.push_back({p + "input_layernorm.weight", {H}, norm});
    if (fused) {
      specs.push_back({p + "self_attn.qkv_proj.weight", {Q + 2 * KV, H}, spec::normal});
    } else {
      specs.push_back({p + "self_attn.q_proj.weight", {Q, H}, spec::normal});
      specs.push_back({p + "self_attn.k_proj.weight", {KV, H}, spec::normal});
      specs.push_back({p + "self_attn.v_proj.weight", {KV, H}, spec::normal});
    }
    if (c.attention_bias) {
      specs.push_back({p + "self_attn.q_proj.bias", {Q}, spec::zeros});
      specs.push_back({p + "self_attn.k_proj.bias", {KV}, spec::zeros});
      specs.push_back({p + "self_attn.v_proj.bias", {KV}, spec::zeros});
    }
    if (c.qk_norm) {
      specs.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, norm});
      specs.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, norm});
    }
    specs.push_back({p + "self_attn.o_proj.weight", {H, Q}, spec::normal});
    if (c.o_proj_bias)
      specs.push_back({p + "self_attn.o_proj.bias", {H}, spec::zeros});
    specs.push_back({p + "post_attention_layernorm.weight", {H}, norm});
    if (c.sandwich_norms) {
      specs.push_back({p + "pre_feedforward_layernorm.weight", {H}, norm});
      specs.push_back({p + "post_feedforward_layernorm.weight", {H}, norm});
    }
    if (c.sparse(i)) {
      specs.push_back({router_weight_name(c, i), {c.num_experts, H}, spec::normal});
      const auto EI = c.moe_intermediate_size;
      for (int64_t e = 0; e < c.num_experts; ++e) {
        specs.push_back({expert_weight_name(c, i, e, "gate"), {EI, H}, spec::normal});
        specs.push_back({expert_weight_name(c, i, e, "up"), {EI, H}, spec::normal});
        specs.push_back({expert_weight_name(c, i, e, "down"), {H, EI}, spec::normal});
      }
      continue;
    }
    if (fused) {
      specs.push_back({p + "mlp.gate_up_proj.weight", {2 * I, H}, spec::normal});
    } else {
      specs.push_back({p + "mlp.gate_proj.weight", {I, H}, spec::normal});
      specs.push_back({p + "mlp.up_proj.weight", {I, H}, spec::normal});
    }
    specs.push_back({p + "mlp.down_proj.weight", {H, I}, spec::normal});
    if (c.mlp_bias) {
      specs.push_back({p + "mlp.gate_proj.bias", {I}, spec::zeros});
      specs.push_back({p + "mlp.up_proj.bias", {I}, spec::zeros});
      specs.push_back({p + "mlp.down_proj.bias", {H}, spec::zeros});
    }
  }
  specs.push_back({"model.norm.weight", {H}, norm});
  if (!c.tie_word_embeddings)
    specs.push_back({"lm_head.weight", {c.vocab_size, H}, spec::normal});
  return specs;
}

} // namespace

void write_random_model(const model_config& config, const std::string& directory, dtype type,
                        uint64_t seed, int64_t max_shard_bytes) {
  namespace fs = std::filesystem;
  // Round-trip through the parser: it checks that the shape holds together.
  auto written = config;
  written.torch_dtype = dtype_name(type);
  auto text = to_config_json(written);
  // The tensors are those of the config as it will be read back.
  auto parsed = parse_model_config(text, directory + "/config.json");
  std::error_code ec;
  fs::create_directories(directory, ec);
  if (ec)
    throw error{errc::invalid_argument, "cannot create '" + directory + "': " + ec.message()};
  {
    std::ofstream out{directory + "/config.json"};
    if (!out)
      throw error{errc::invalid_argument, "cannot write '" + directory + "/config.json'"};
    out << text << "\n";
  }
  std::mt19937_64 rng{seed};
  std::normal_distribution<float> normal{0.0f, 0.02f};
  // Each tensor's bytes are kept until its shard is written.
  std::vector<std::vector<uint8_t>> storage;
  std::vector<safetensors_writer> shards(1);
  int64_t used = 0;
  nlohmann::json weight_map = nlohmann::json::object();
  std::vector<std::vector<std::string>> shard_names(1);
  for (auto& s : tensor_specs(parsed)) {
    int64_t numel = 1;
    for (auto d : s.shape)
      numel *= d;
    auto bytes = storage_bytes(type, static_cast<size_t>(numel));
    if (used > 0 && used + static_cast<int64_t>(bytes) > max_shard_bytes) {
      shards.emplace_back();
      shard_names.emplace_back();
      used = 0;
    }
    storage.emplace_back(bytes);
    auto* raw = storage.back().data();
    for (int64_t i = 0; i < numel; ++i) {
      float v = s.init == spec::normal ? normal(rng) : (s.init == spec::ones ? 1.0f : 0.0f);
      if (type == dtype::f32)
        std::memcpy(raw + i * 4, &v, 4);
      else {
        uint16_t h = type == dtype::f16 ? float_to_half(v) : float_to_bf16(v);
        std::memcpy(raw + i * 2, &h, 2);
      }
    }
    shards.back().add(s.name, type, s.shape, raw, bytes);
    shard_names.back().push_back(s.name);
    used += static_cast<int64_t>(bytes);
  }
  if (shards.size() == 1) {
    shards[0].add_metadata("format", "pt");
    shards[0].write(directory + "/model.safetensors");
    return;
  }
  int64_t total = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    shards[i].add_metadata("format", "pt");
    shards[i].write(directory + "/" + name);
    total += static_cast<int64_t>(shards[i].file_size());
    for (auto& t : shard_names[i])
      weight_map[t] = name;
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  std::ofstream out{directory + "/model.safetensors.index.json"};
  if (!out)
    throw error{errc::invalid_argument,
                "cannot write '" + directory + "/model.safetensors.index.json'"};
  out << index.dump(2) << "\n";
}

model_config smollm2_135m_config() {
  model_config c;
  c.architecture = "LlamaForCausalLM";
  c.num_hidden_layers = 30;
  c.hidden_size = 576;
  c.num_attention_heads = 9;
  c.num_key_value_heads = 3;
  c.head_dim = 64;
  c.intermediate_size = 1536;
  c.vocab_size = 49152;
  c.max_position_embeddings = 8192;
  c.rope_theta = 100000.0;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = true;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  return c;
}

} // namespace troupe
