#include "model/checkpoint.hpp"

#include "model/gguf.hpp"
#include "model/mapped_file.hpp"
#include "troupe/errors.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

namespace troupe {

namespace fs = std::filesystem;

checkpoint::checkpoint(const std::string& directory) : directory_(directory) {
  if (!fs::is_directory(directory))
    throw error{errc::invalid_argument, "model directory '" + directory + "' does not exist"};
  std::vector<std::string> paths;
  auto index_path = fs::path{directory} / "model.safetensors.index.json";
  auto single_path = fs::path{directory} / "model.safetensors";
  if (fs::exists(index_path)) {
    auto index = nlohmann::json::parse(
      read_small_file(index_path.string(), "safetensors index", 64 << 20), nullptr, false);
    if (index.is_discarded() || !index.contains("weight_map") || !index["weight_map"].is_object())
      throw error{errc::invalid_argument, "'" + index_path.string() + "' has no weight_map object"};
    std::set<std::string> shards;
    for (auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string())
        throw error{errc::invalid_argument,
                    "'" + index_path.string() + "': tensor '" + name + "' maps to no file name"};
      shards.insert(file.get<std::string>());
    }
    for (auto& shard : shards)
      paths.push_back((fs::path{directory} / shard).string());
  } else if (fs::exists(single_path)) {
    paths.push_back(single_path.string());
  } else {
    throw error{errc::invalid_argument, "model directory '" + directory +
                                          "' has neither model.safetensors nor "
                                          "model.safetensors.index.json"};
  }
  open(paths);
  for (auto& [name, t] : index_)
    if (name.find("qkv_proj.") != std::string::npos ||
        name.find("gate_up_proj.") != std::string::npos) {
      split_fused(load_model_config(directory));
      break;
    }
}

checkpoint::checkpoint(const std::string& directory, const std::vector<std::string>& files)
  : directory_(directory) {
  if (files.empty())
    throw error{errc::invalid_argument, "no weight files given in '" + directory + "'"};
  open(files);
}

void checkpoint::open(const std::vector<std::string>& paths) {
  for (auto& path : paths) {
    files_.push_back(std::make_unique<safetensors_file>(path));
    for (auto& t : files_.back()->tensors()) {
      if (index_.count(t.name) > 0)
        throw error{errc::invalid_argument, "tensor '" + t.name + "' appears twice in '" +
                                              directory_ + "' (again in '" + path + "')"};
      index_[t.name] = &t;
    }
  }
}

model_config checkpoint::gguf_config(const std::string& path) {
  return gguf_file{path}.config();
}

bool checkpoint::is_gguf(const std::string& path) {
  return path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0;
}

model_config checkpoint::config_of(const std::string& path) {
  // A FIFO or a device would block the first read for ever.
  std::error_code ec;
  auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status))
    throw error{errc::invalid_argument, "model '" + path + "': no such file or directory"};
  if (!std::filesystem::is_directory(status) && !std::filesystem::is_regular_file(status))
    throw error{errc::invalid_argument,
                "model '" + path + "': neither a directory nor a regular file"};
  return is_gguf(path) ? gguf_config(path) : load_model_config(path);
}

checkpoint checkpoint::from_tensors(std::string label, std::vector<tensor_view> tensors,
                                    const model_config& config) {
  checkpoint result;
  result.directory_ = std::move(label);
  bool fused = false;
  for (auto& t : tensors) {
    if (result.index_.count(t.name) > 0)
      throw error{errc::invalid_argument,
                  result.directory_ + ": tensor '" + t.name + "' is given twice"};
    if (storage_bytes(t.type, static_cast<size_t>(t.numel())) != t.bytes)
      throw error{errc::invalid_argument,
                  result.directory_ + ": tensor '" + t.name + "' holds " + std::to_string(t.bytes) +
                    " bytes, its shape and type need " +
                    std::to_string(storage_bytes(t.type, static_cast<size_t>(t.numel())))};
    fused = fused || t.name.find("qkv_proj.") != std::string::npos ||
            t.name.find("gate_up_proj.") != std::string::npos;
    result.views_.push_back(std::make_unique<tensor_view>(std::move(t)));
    result.index_[result.views_.back()->name] = result.views_.back().get();
  }
  if (fused)
    result.split_fused(config);
  return result;
}

int64_t halves_row(int64_t s, int64_t head_dim) {
  auto within = s % head_dim;
  return s - within + within % 2 * (head_dim / 2) + within / 2;
}

checkpoint checkpoint::from_gguf(const std::string& path, const model_config& config) {
  auto file = std::make_shared<gguf_file>(path);
  checkpoint result;
  result.directory_ = path;
  result.gguf_ = file;
  result.neighbour_pairs_ =
    config.architecture == "LlamaForCausalLM" || config.architecture == "MixtralForCausalLM";
  for (auto& t : file->tensors()) {
    // LongRoPE's factors are the config's (gguf_file::config reads them).
    if (t.name == "rope_factors_long.weight" || t.name == "rope_factors_short.weight")
      continue;
    if (config.num_experts > 0) {
      tensor_view merged;
      merged.name = t.name;
      merged.type = file->stored_type(t);
      merged.shape = t.shape;
      merged.data = file->data(t);
      merged.bytes = t.bytes;
      if (result.add_experts(merged, config))
        continue;
    }
    auto name =
      t.name == "rope_freqs.weight" ? t.name : hf_tensor_name(t.name, config.architecture);
    if (name.empty())
      throw error{errc::invalid_argument, "model '" + path + "': tensor '" + t.name +
                                            "' has no place in a Llama-family model"};
    auto view = std::make_unique<tensor_view>();
    view->name = name;
    view->type = file->stored_type(t);
    view->shape = t.shape;
    view->data = file->data(t);
    view->bytes = t.bytes;
    bool is_q = name.find("self_attn.q_proj.") != std::string::npos;
    bool is_k = name.find("self_attn.k_proj.") != std::string::npos;
    if (result.neighbour_pairs_ && (is_q || is_k) && !t.shape.empty()) {
      // Within each head, GGUF row (a bias's entry) 2i + j is Hugging Face row
      // j * head_dim / 2 + i: read in Hugging Face's order through row_order, or as stored
      // by a model that rotates neighbouring pairs.
      auto heads = is_q ? config.num_attention_heads : config.num_key_value_heads;
      auto rows = t.shape[0];
      view->row_order.resize(static_cast<size_t>(rows));
      for (int64_t s = 0; s < rows; ++s)
        view->row_order[static_cast<size_t>(halves_row(s, rows / heads))] = s;
    }
    result.index_[name] = view.get();
    result.views_.push_back(std::move(view));
  }
  result.split_fused(config);
  return result;
}

bool checkpoint::add_experts(const tensor_view& t, const model_config& config) {
  // blk.N.ffn_{gate,up,down}_exps.weight: [experts, rows, cols], each expert's matrix whole.
  static const std::pair<const char*, const char*> merged[] = {{"ffn_gate_exps.weight", "gate"},
                                                               {"ffn_up_exps.weight", "up"},
                                                               {"ffn_down_exps.weight", "down"}};
  auto dot = t.name.find('.', 4);
  if (t.name.rfind("blk.", 0) != 0 || dot == std::string::npos)
    return false;
  auto rest = t.name.substr(dot + 1);
  auto kind =
    std::find_if(std::begin(merged), std::end(merged), [&](auto& m) { return rest == m.first; });
  if (kind == std::end(merged))
    return false;
  auto layer_text = t.name.substr(4, dot - 4);
  if (layer_text.empty() || layer_text.size() > 4 ||
      layer_text.find_first_not_of("0123456789") != std::string::npos)
    return false; // no layer: refused as a tensor without a place
  if (t.shape.size() != 3 || t.shape[0] != config.num_experts)
    throw error{errc::invalid_argument, "model '" + directory_ + "': tensor '" + t.name +
                                          "' is not [" + std::to_string(config.num_experts) +
                                          " experts, rows, columns]"};
  auto layer = std::stoll(layer_text);
  auto bytes = t.bytes / static_cast<size_t>(t.shape[0]);
  for (int64_t e = 0; e < t.shape[0]; ++e) {
    auto view = std::make_unique<tensor_view>();
    view->name = expert_weight_name(config, layer, e, kind->second);
    view->type = t.type;
    view->shape = {t.shape[1], t.shape[2]};
    view->data = t.data + static_cast<size_t>(e) * bytes;
    view->bytes = bytes;
    index_[view->name] = view.get();
    views_.push_back(std::move(view));
  }
  return true;
}

void checkpoint::split_fused(const model_config& c) {
  struct fused {
    const char* name;
    std::vector<std::pair<const char*, int64_t>> parts; // name, rows
  };
  const auto q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  const fused kinds[] = {
    {"self_attn.qkv_proj.",
     {{"self_attn.q_proj.", q}, {"self_attn.k_proj.", kv}, {"self_attn.v_proj.", kv}}},
    {"mlp.gate_up_proj.",
     {{"mlp.gate_proj.", c.intermediate_size}, {"mlp.up_proj.", c.intermediate_size}}},
  };
  std::vector<std::string> names;
  for (auto& entry : index_)
    names.push_back(entry.first);
  for (auto& name : names)
    for (auto& kind : kinds) {
      auto at = name.find(kind.name);
      if (at == std::string::npos)
        continue;
      const tensor_view& whole = *index_.at(name);
      int64_t rows = 0;
      for (auto& part : kind.parts)
        rows += part.second;
      if (whole.shape.empty() || whole.shape[0] != rows || !whole.row_order.empty())
        throw error{errc::invalid_argument,
                    "model '" + directory_ + "': tensor '" + name + "' has shape " +
                      std::to_string(whole.shape.empty() ? 0 : whole.shape[0]) +
                      " rows, the config's parts need " + std::to_string(rows)};
      int64_t first = 0;
      for (auto& part : kind.parts) {
        auto view = std::make_unique<tensor_view>(whole.rows(first, part.second));
        view->name = name.substr(0, at) + part.first + name.substr(at + std::strlen(kind.name));
        first += part.second;
        if (index_.count(view->name) > 0)
          throw error{errc::invalid_argument, "model '" + directory_ + "' holds both '" + name +
                                                "' and '" + view->name + "'"};
        index_[view->name] = view.get();
        views_.push_back(std::move(view));
      }
      index_.erase(name);
    }
}

bool checkpoint::contains(const std::string& name) const {
  return index_.count(name) > 0;
}

const mapped_file* checkpoint::file_of(const void* p) const {
  if (gguf_ && gguf_->file().contains(p))
    return &gguf_->file();
  for (auto& f : files_)
    if (f->file().contains(p))
      return &f->file();
  return nullptr;
}

void checkpoint::release(const tensor_view& t) const {
  if (auto f = file_of(t.data))
    f->release(t.data, t.bytes);
}

std::optional<checkpoint::file_place> checkpoint::place_of(const std::byte* p) const {
  auto f = file_of(p);
  if (f == nullptr)
    return std::nullopt;
  return file_place{f->fd(), static_cast<std::size_t>(p - f->data())};
}

const tensor_view& checkpoint::at(const std::string& name) const {
  auto i = index_.find(name);
  if (i == index_.end())
    throw error{errc::invalid_argument, "model '" + directory_ + "' has no tensor '" + name + "'"};
  return *i->second;
}

std::vector<std::string> checkpoint::names() const {
  std::vector<std::string> result;
  for (auto& kvp : index_)
    result.push_back(kvp.first);
  return result;
}

std::string checkpoint::identity() const {
  std::string out;
  if (gguf_)
    out += gguf_->file().identity() + "\n";
  for (auto& f : files_)
    out += f->file().identity() + "\n";
  return out;
}

namespace {

constexpr uint64_t prime1 = 0x9e3779b185ebca87ull;
constexpr uint64_t prime2 = 0xc2b2ae3d27d4eb4full;

uint64_t rotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}

uint64_t mix_hash(uint64_t acc, uint64_t word) {
  return rotl(acc + word * prime2, 31) * prime1;
}

/// A 64-bit hash of `size` bytes that runs near the memory's read speed: four independent
/// multiply-rotate chains over 32-byte stripes (xxHash64's round), the tail folded in last.
/// Not for adversaries: it tells apart files that differ by accident or by a careless copy.
uint64_t hash_bytes(const void* data, size_t size) {
  auto p = static_cast<const unsigned char*>(data);
  uint64_t lanes[4] = {prime1 + prime2, prime2, 0, 0 - prime1};
  size_t i = 0;
  for (; i + 32 <= size; i += 32)
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      lanes[l] = mix_hash(lanes[l], w);
    }
  uint64_t hash = rotl(lanes[0], 1) + rotl(lanes[1], 7) + rotl(lanes[2], 12) + rotl(lanes[3], 18);
  hash = mix_hash(hash, size);
  for (; i < size; ++i)
    hash = mix_hash(hash, p[i]);
  return hash ^ (hash >> 29);
}

} // namespace

std::string checkpoint::fingerprint(const std::string& config_text, bool tensors,
                                    uint64_t content) const {
  auto hash = hash_bytes(config_text.data(), config_text.size());
  for (auto& [name, t] : index_) {
    if (!tensors)
      break;
    hash = mix_hash(hash, hash_bytes(name.data(), name.size()));
    hash = mix_hash(hash, static_cast<uint64_t>(t->type));
    for (auto d : t->shape)
      hash = mix_hash(hash, static_cast<uint64_t>(d));
  }
  hash = mix_hash(hash, content);
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

uint64_t checkpoint::tensor_hash(const tensor_view& t) {
  return hash_bytes(t.data, t.bytes);
}

uint64_t checkpoint::content_hash(std::map<std::string, uint64_t> known) const {
  uint64_t combined = 0;
  for (auto& [name, t] : index_) {
    auto i = known.find(name);
    auto hash = i != known.end() ? i->second : tensor_hash(*t);
    if (i == known.end())
      release(*t);
    combined = mix_hash(combined ^ hash_bytes(name.data(), name.size()), hash);
  }
  return combined;
}

} // namespace troupe
