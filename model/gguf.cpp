// GGUF: "GGUF", version, tensor count, metadata count, the metadata (key, type, value), the
// tensor infos (name, dims innermost first, ggml type, offset), then the tensor data from
// the next multiple of general.alignment (32 by default).

#include "model/gguf.hpp"

#include "kernels/dtype.hpp"
#include "troupe/errors.hpp"

#include <cmath>
#include <cstring>
#include <optional>

namespace troupe {

namespace {

// ggml tensor types troupe reads, and the bytes of one block of each.
enum ggml_type : uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  bf16 = 30
};

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw error{errc::invalid_argument, "GGUF file '" + path + "': " + what};
}

/// Reads little-endian values from the mapping, refusing to run past its end.
struct cursor {
  const uint8_t* base;
  size_t size;
  size_t pos;
  const std::string& path;

  void need(size_t n) {
    if (n > size - pos)
      bad(path, "truncated at byte " + std::to_string(pos));
  }
  template <class T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, base + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string str() {
    auto len = get<uint64_t>();
    need(len);
    std::string s(reinterpret_cast<const char*>(base + pos), len);
    pos += len;
    return s;
  }
};

/// The element type of a ggml type id; nothing for a type troupe does not read.
std::optional<dtype> dtype_of(uint32_t type) {
  switch (type) {
  case f32:
    return dtype::f32;
  case f16:
    return dtype::f16;
  case bf16:
    return dtype::bf16;
  case q8_0:
    return dtype::q8_0;
  case q4_0:
    return dtype::q4_0;
  case q4_1:
    return dtype::q4_1;
  case q5_0:
    return dtype::q5_0;
  case q5_1:
    return dtype::q5_1;
  case q4_k:
    return dtype::q4_k;
  case q5_k:
    return dtype::q5_k;
  case q6_k:
    return dtype::q6_k;
  default:
    return std::nullopt;
  }
}

/// The bytes of one element of a metadata array of `type`; 0 for strings, whose lengths
/// vary.
uint64_t element_bytes(const cursor& c, uint32_t type) {
  switch (type) {
  case 0:
  case 1:
  case 7:
    return 1;
  case 2:
  case 3:
    return 2;
  case 4:
  case 5:
  case 6:
    return 4;
  case 10:
  case 11:
  case 12:
    return 8;
  case 8:
    return 0;
  default:
    bad(c.path, "unknown metadata type " + std::to_string(type));
  }
}

gguf_file::value read_value(cursor& c, uint32_t type) {
  switch (type) {
  case 0:
    return int64_t{c.get<uint8_t>()};
  case 1:
    return int64_t{c.get<int8_t>()};
  case 2:
    return int64_t{c.get<uint16_t>()};
  case 3:
    return int64_t{c.get<int16_t>()};
  case 4:
    return int64_t{c.get<uint32_t>()};
  case 5:
    return int64_t{c.get<int32_t>()};
  case 6:
    return double{c.get<float>()};
  case 7:
    return c.get<uint8_t>() != 0;
  case 8:
    return c.str();
  case 10:
    return static_cast<int64_t>(c.get<uint64_t>());
  case 11:
    return c.get<int64_t>();
  case 12:
    return c.get<double>();
  case 9: {
    gguf_file::array a;
    a.element_type = c.get<uint32_t>();
    a.count = c.get<uint64_t>();
    a.offset = c.pos;
    if (a.element_type == 9)
      bad(c.path, "nested metadata arrays are not supported");
    auto size = element_bytes(c, a.element_type);
    if (size == 0) {
      // Strings: each one's length is read to find the next.
      for (uint64_t i = 0; i < a.count; ++i) {
        auto len = c.get<uint64_t>();
        c.need(len);
        c.pos += len;
      }
    } else {
      uint64_t bytes = 0;
      if (__builtin_mul_overflow(a.count, size, &bytes))
        bad(c.path, "a metadata array's size overflows");
      c.need(bytes);
      c.pos += bytes;
    }
    return a;
  }
  default:
    bad(c.path, "unknown metadata type " + std::to_string(type));
  }
}

} // namespace

gguf_file::gguf_file(const std::string& path) : path_(path), file_(path, "GGUF file", 24) {
  {
    cursor c{reinterpret_cast<const uint8_t*>(file_.data()), file_.size(), 0, path_};
    if (std::memcmp(c.base, "GGUF", 4) != 0)
      bad(path, "not a GGUF file (bad magic)");
    c.pos = 4;
    auto version = c.get<uint32_t>();
    if (version != 2 && version != 3)
      bad(path, "GGUF version " + std::to_string(version) + " is not supported (2, 3)");
    auto tensor_count = c.get<uint64_t>();
    auto kv_count = c.get<uint64_t>();
    for (uint64_t i = 0; i < kv_count; ++i) {
      auto key = c.str();
      auto type = c.get<uint32_t>();
      metadata_[key] = read_value(c, type);
    }
    for (uint64_t i = 0; i < tensor_count; ++i) {
      tensor_info t;
      t.name = c.str();
      auto dims = c.get<uint32_t>();
      if (dims == 0 || dims > 4)
        bad(path, "tensor '" + t.name + "' has " + std::to_string(dims) + " dimensions");
      std::vector<int64_t> ne(dims);
      uint64_t count = 1;
      for (auto& d : ne) {
        auto dim = c.get<uint64_t>();
        // Bounded so that no size computed from it overflows.
        if (dim > (uint64_t{1} << 40) || __builtin_mul_overflow(count, dim, &count) ||
            count > (uint64_t{1} << 40))
          bad(path, "tensor '" + t.name + "' has an impossible size");
        d = static_cast<int64_t>(dim);
      }
      t.shape.assign(ne.rbegin(), ne.rend());
      t.type = c.get<uint32_t>();
      t.offset = c.get<uint64_t>();
      auto stored = dtype_of(t.type);
      t.bytes = stored ? storage_bytes(*stored, count) : 0;
      if (!stored && count > 0)
        bad(path, "tensor '" + t.name + "' has ggml type " + std::to_string(t.type) +
                    ", which troupe does not read (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, "
                    "Q5_1, Q4_K, Q5_K, Q6_K)");
      // Blocks run along rows, as llama.cpp lays them out: a row is whole blocks.
      if (stored && is_quantized(*stored) && !t.shape.empty() &&
          t.shape.back() % block_elements(*stored) != 0)
        bad(path, "tensor '" + t.name + "' is quantized in blocks of " +
                    std::to_string(block_elements(*stored)) + " but its rows have " +
                    std::to_string(t.shape.back()) + " elements");
      tensors_.push_back(std::move(t));
    }
    uint64_t alignment = 32;
    if (auto a = find<int64_t>("general.alignment")) {
      if (*a <= 0 || *a > (int64_t{1} << 20))
        bad(path, "general.alignment " + std::to_string(*a) + " is not a usable alignment");
      alignment = static_cast<uint64_t>(*a);
    }
    data_start_ = (c.pos + alignment - 1) / alignment * alignment;
    if (data_start_ > file_.size() && !tensors_.empty())
      bad(path, "the tensor data would start past the end of the file (truncated?)");
    for (auto& t : tensors_) {
      // Compared without adding to the offset, which may be anything up to 2^64.
      if (t.offset > file_.size() - data_start_ || t.bytes > file_.size() - data_start_ - t.offset)
        bad(path, "tensor '" + t.name + "': its data lies past the end of the file (truncated?)");
      if (t.offset % alignment != 0)
        bad(path, "tensor '" + t.name + "': offset " + std::to_string(t.offset) +
                    " is not a multiple of general.alignment " + std::to_string(alignment));
    }
  }
}

gguf_file::~gguf_file() = default;

dtype gguf_file::stored_type(const tensor_info& t) const {
  auto stored = dtype_of(t.type);
  if (!stored)
    bad(path_, "tensor '" + t.name + "' has ggml type " + std::to_string(t.type) +
                 ", which troupe does not read");
  return *stored;
}

const std::byte* gguf_file::data(const tensor_info& t) const {
  return reinterpret_cast<const std::byte*>(file_.data()) + data_start_ + t.offset;
}

std::vector<float> gguf_file::read(const tensor_info& t) const {
  uint64_t count = 1;
  for (auto d : t.shape)
    count *= static_cast<uint64_t>(d);
  std::vector<float> out(count);
  to_float(stored_type(t), data(t), out.data(), count);
  return out;
}

std::optional<std::vector<std::string>> gguf_file::strings(const std::string& key) const {
  auto a = find<array>(key);
  if (a == nullptr || a->element_type != 8)
    return std::nullopt;
  // Checked by the parse: every string lies inside the file.
  cursor c{reinterpret_cast<const uint8_t*>(file_.data()), file_.size(), a->offset, path_};
  std::vector<std::string> out;
  out.reserve(a->count);
  for (uint64_t i = 0; i < a->count; ++i)
    out.push_back(c.str());
  return out;
}

std::optional<std::vector<double>> gguf_file::numbers(const std::string& key) const {
  auto a = find<array>(key);
  if (a == nullptr || a->element_type == 8)
    return std::nullopt;
  cursor c{reinterpret_cast<const uint8_t*>(file_.data()), file_.size(), a->offset, path_};
  std::vector<double> out;
  out.reserve(a->count);
  for (uint64_t i = 0; i < a->count; ++i) {
    auto v = read_value(c, a->element_type);
    if (auto x = std::get_if<int64_t>(&v))
      out.push_back(static_cast<double>(*x));
    else if (auto y = std::get_if<double>(&v))
      out.push_back(*y);
    else
      out.push_back(std::get<bool>(v) ? 1.0 : 0.0);
  }
  return out;
}

void gguf_file::phi3_config(model_config& c, double rotary_dims, double window,
                            double original_length, double attention_factor) const {
  // Phi-4-mini rotates the first three quarters of each head.
  auto rotated = static_cast<int64_t>(rotary_dims);
  if (rotated <= 0 || rotated > c.head_dim || rotated % 2 != 0)
    bad(path_, "phi3.rope.dimension_count " + std::to_string(rotated) +
                 " is not an even part of each head of " + std::to_string(c.head_dim));
  c.rotary_dim = rotated == c.head_dim ? 0 : rotated;
  // 0 says none (Phi-4); Phi-3 slides every layer, as transformers does.
  c.sliding_window = static_cast<int64_t>(window);
  auto factors = [&](const char* name) {
    std::vector<double> out;
    for (auto& t : tensors_)
      if (t.name == name && stored_type(t) == dtype::f32)
        for (auto v : read(t))
          out.push_back(v);
    return out;
  };
  auto& r = c.rope_scaling;
  r.long_factor = factors("rope_factors_long.weight");
  r.short_factor = factors("rope_factors_short.weight");
  if (r.long_factor.empty() && r.short_factor.empty())
    return;
  r.type = rope_scaling_config::kind::longrope;
  r.original_max_position_embeddings =
    original_length > 0 ? static_cast<int64_t>(original_length) : c.max_position_embeddings;
  r.factor = static_cast<double>(c.max_position_embeddings) /
             static_cast<double>(r.original_max_position_embeddings);
  // The converter writes transformers' factor; its default where absent.
  r.attention_factor =
    attention_factor > 0 ? attention_factor
    : r.factor <= 1
      ? 1.0
      : std::sqrt(1 + std::log(r.factor) /
                        std::log(static_cast<double>(r.original_max_position_embeddings)));
}

void gguf_file::gemma_config(model_config& c, bool gemma3, double window, double attn_cap,
                             double final_cap, double local_base) const {
  c.scale_embeddings = true;
  c.sandwich_norms = true;
  c.hidden_act = "gelu_pytorch_tanh";
  c.norm_weight_offset = 0; // the converter wrote 1 + w
  c.attn_logit_softcapping = attn_cap;
  c.final_logit_softcapping = final_cap;
  // llama.cpp's reading of Gemma's scalar, which the files do not hold: hidden / heads
  // for the 27B models (46 and 62 layers), head_dim for the others.
  bool large = c.num_hidden_layers == (gemma3 ? 62 : 46);
  c.query_pre_attn_scalar = large ? static_cast<double>(c.hidden_size / c.num_attention_heads)
                                  : static_cast<double>(c.head_dim);
  // Gemma 2 slides without a window in the file too (4096, llama.cpp's default).
  c.sliding_window = window > 0 ? static_cast<int64_t>(window) : gemma3 ? 0 : 4096;
  if (c.sliding_window == 0)
    return;
  // Every layer but each pattern-th slides (Gemma 2: every other one, Gemma 3: five of
  // six), unless the file lists them.
  auto key = find<std::string>("general.architecture");
  int64_t pattern = gemma3 ? 6 : 2;
  if (auto flags = numbers(*key + ".attention.sliding_window_pattern")) {
    for (auto f : *flags)
      c.sliding_layers.push_back(f != 0);
  } else {
    if (auto n = find<int64_t>(*key + ".attention.sliding_window_pattern"))
      pattern = *n;
    for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
      c.sliding_layers.push_back(pattern > 0 && layer % pattern < pattern - 1);
  }
  if (gemma3 && local_base > 0)
    c.local_rope_theta = local_base;
}

model_config gguf_file::config() const {
  auto text = [&](const std::string& key) -> std::string {
    auto s = find<std::string>(key);
    if (s == nullptr)
      bad(path_, "metadata has no " + key);
    return *s;
  };
  auto arch = text("general.architecture");
  auto number = [&](const std::string& key, double fallback, bool required) -> double {
    auto i = metadata_.find(arch + "." + key);
    if (i == metadata_.end()) {
      if (required)
        bad(path_, "metadata has no " + arch + "." + key);
      return fallback;
    }
    double v = 0;
    if (auto x = std::get_if<int64_t>(&i->second))
      v = static_cast<double>(*x);
    else if (auto y = std::get_if<double>(&i->second))
      v = *y;
    else
      bad(path_, "metadata " + arch + "." + key + " is not a number");
    if (!(std::fabs(v) < 1e15))
      bad(path_, "metadata " + arch + "." + key + " is out of range");
    return v;
  };
  model_config c;
  // llama.cpp writes Mixtral as llama with experts.
  if (arch == "llama")
    c.architecture =
      number("expert_count", 0, false) > 0 ? "MixtralForCausalLM" : "LlamaForCausalLM";
  else if (arch == "qwen3moe")
    c.architecture = "Qwen3MoeForCausalLM";
  else if (arch == "qwen2")
    c.architecture = "Qwen2ForCausalLM";
  else if (arch == "qwen3")
    c.architecture = "Qwen3ForCausalLM";
  else if (arch == "phi3")
    c.architecture = "Phi3ForCausalLM";
  else if (arch == "gemma2")
    c.architecture = "Gemma2ForCausalLM";
  else if (arch == "gemma3")
    c.architecture = "Gemma3ForCausalLM";
  else
    bad(path_, "architecture " + arch +
                 " is not supported (llama, qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3)");
  c.qk_norm = arch == "qwen3" || arch == "qwen3moe" || arch == "gemma3";
  c.hidden_size = static_cast<int64_t>(number("embedding_length", 0, true));
  c.num_hidden_layers = static_cast<int64_t>(number("block_count", 0, true));
  c.intermediate_size = static_cast<int64_t>(number("feed_forward_length", 0, true));
  c.num_attention_heads = static_cast<int64_t>(number("attention.head_count", 0, true));
  if (c.num_attention_heads <= 0 || c.hidden_size <= 0)
    bad(path_, "metadata gives no attention heads or no embedding length");
  c.num_key_value_heads = static_cast<int64_t>(
    number("attention.head_count_kv", static_cast<double>(c.num_attention_heads), false));
  c.head_dim = static_cast<int64_t>(number(
    "attention.key_length", static_cast<double>(c.hidden_size / c.num_attention_heads), false));
  c.max_position_embeddings = static_cast<int64_t>(number("context_length", 2048, false));
  c.rope_theta = number("rope.freq_base", 10000.0, false);
  c.rms_norm_eps = number("attention.layer_norm_rms_epsilon", 1e-6, false);
  c.attention_bias = arch == "qwen2";
  if (auto type = find<std::string>(arch + ".rope.scaling.type"); type && *type == "linear") {
    c.rope_scaling.type = rope_scaling_config::kind::linear;
    c.rope_scaling.factor = number("rope.scaling.factor", 1.0, true);
  }
  if (arch == "gemma2" || arch == "gemma3")
    gemma_config(c, arch == "gemma3", number("attention.sliding_window", 0, false),
                 number("attn_logit_softcapping", 0, false),
                 number("final_logit_softcapping", 0, false),
                 number("rope.freq_base_swa", arch == "gemma3" ? 10000.0 : 0.0, false));
  if (arch != "phi3" && number("rope.dimension_count", static_cast<double>(c.head_dim), false) !=
                          static_cast<double>(c.head_dim))
    bad(path_, arch + ".rope.dimension_count rotates part of each head of " +
                 std::to_string(c.head_dim) + "; troupe rotates part of a head in phi3 only");
  if (arch == "phi3")
    phi3_config(c, number("rope.dimension_count", static_cast<double>(c.head_dim), false),
                number("attention.sliding_window", 0, false),
                number("rope.scaling.original_context_length", 0, false),
                number("rope.scaling.attn_factor", 0, false));
  if (c.architecture == "MixtralForCausalLM" || arch == "qwen3moe") {
    // llama.cpp renormalizes the chosen weights of both (Qwen3-MoE's published
    // norm_topk_prob).
    c.num_experts = static_cast<int64_t>(number("expert_count", 0, true));
    c.num_experts_per_tok = static_cast<int64_t>(number("expert_used_count", 0, true));
    c.moe_intermediate_size = static_cast<int64_t>(
      number("expert_feed_forward_length", static_cast<double>(c.intermediate_size), false));
  }
  if (auto vocab = find<array>("tokenizer.ggml.tokens"))
    c.vocab_size = static_cast<int64_t>(vocab->count);
  else
    c.vocab_size = static_cast<int64_t>(number("vocab_size", 0, true));
  c.tie_word_embeddings = true;
  for (auto& t : tensors_)
    if (t.name == "output.weight")
      c.tie_word_embeddings = false;
  auto token = [&](const std::string& key) -> int32_t {
    auto v = find<int64_t>(key);
    return v ? static_cast<int32_t>(*v) : -1;
  };
  c.bos_token_id = token("tokenizer.ggml.bos_token_id");
  // End of sequence, and llama.cpp's end of turn and end of message where the file has them.
  for (auto key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                   "tokenizer.ggml.eom_token_id"})
    c.add_eos_token(token(key));
  validate_model_config(c, path_);
  return c;
}

std::string hf_tensor_name(const std::string& name, const std::string& architecture) {
  static const std::map<std::string, std::string> top = {
    {"token_embd.weight", "model.embed_tokens.weight"},
    {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"},
  };
  if (auto i = top.find(name); i != top.end())
    return i->second;
  static const std::map<std::string, std::string> in_block = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},
    {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_v.weight", "self_attn.v_proj.weight"},
    {"attn_qkv.weight", "self_attn.qkv_proj.weight"},
    {"attn_q.bias", "self_attn.q_proj.bias"},
    {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.bias", "self_attn.v_proj.bias"},
    {"attn_q_norm.weight", "self_attn.q_norm.weight"},
    {"attn_k_norm.weight", "self_attn.k_norm.weight"},
    {"attn_output.weight", "self_attn.o_proj.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},
    {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
  };
  // Where a family's names mean something else: Gemma's four norms a layer (ffn_norm is
  // the one before the MLP), phi3's ffn_up holding gate over up.
  static const std::map<std::string, std::string> gemma = {
    {"ffn_norm.weight", "pre_feedforward_layernorm.weight"},
    {"post_attention_norm.weight", "post_attention_layernorm.weight"},
    {"post_ffw_norm.weight", "post_feedforward_layernorm.weight"},
  };
  static const std::map<std::string, std::string> phi3 = {
    {"ffn_up.weight", "mlp.gate_up_proj.weight"},
  };
  // The routers (the experts' merged tensors are split by checkpoint::from_gguf).
  static const std::map<std::string, std::string> mixtral = {
    {"ffn_gate_inp.weight", "block_sparse_moe.gate.weight"},
  };
  static const std::map<std::string, std::string> qwen3_moe = {
    {"ffn_gate_inp.weight", "mlp.gate.weight"},
  };
  if (name.rfind("blk.", 0) != 0)
    return {};
  auto dot = name.find('.', 4);
  if (dot == std::string::npos)
    return {};
  auto layer = name.substr(4, dot - 4);
  auto rest = name.substr(dot + 1);
  const auto* family = architecture == "Gemma2ForCausalLM" || architecture == "Gemma3ForCausalLM"
                         ? &gemma
                       : architecture == "Phi3ForCausalLM"     ? &phi3
                       : architecture == "MixtralForCausalLM"  ? &mixtral
                       : architecture == "Qwen3MoeForCausalLM" ? &qwen3_moe
                                                               : nullptr;
  if (family)
    if (auto f = family->find(rest); f != family->end())
      return "model.layers." + layer + "." + f->second;
  auto i = in_block.find(rest);
  if (i == in_block.end())
    return {};
  return "model.layers." + layer + "." + i->second;
}

} // namespace troupe
