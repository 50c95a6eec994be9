#include "model/llama.hpp"

#include "kernels/cpu/ops.hpp"
#include "troupe/errors.hpp"

#include <cmath>
#include <cstring>
#include <filesystem>

namespace troupe {

namespace {

[[noreturn]] void bad_request(const std::string& what) {
  throw error{errc::invalid_argument, what};
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// Copies rows [row0, row0 + rows) of a 2-D (or 1-D: elements) tensor as float32.
void read_rows(const tensor_view& t, int64_t row0, int64_t rows, float* dst) {
  int64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
  auto offset = static_cast<size_t>(row0 * cols) * element_size(t.type);
  to_float(t.type, t.data + offset, dst, static_cast<size_t>(rows * cols));
}

/// Copies columns [col0, col0 + cols) of every row of a 2-D tensor as float32.
void read_cols(const tensor_view& t, int64_t col0, int64_t cols, float* dst) {
  auto esize = element_size(t.type);
  for (int64_t r = 0; r < t.shape[0]; ++r)
    to_float(t.type, t.data + static_cast<size_t>(r * t.shape[1] + col0) * esize, dst + r * cols,
             static_cast<size_t>(cols));
}

} // namespace

llama_model::llama_model(model_config cfg, device& dev, int32_t rank, int32_t world)
  : cfg_(std::move(cfg)), dev_(dev), rank_(rank), world_(world) {
  if (world < 1 || world > cfg_.num_attention_heads)
    throw error{errc::invalid_argument,
                cfg_.architecture + " with " + std::to_string(cfg_.num_attention_heads) +
                  " attention heads cannot be split " + std::to_string(world) + " ways"};
  // Each rank takes a contiguous, near-even share of the attention heads and of the MLP.
  // Shares need not be equal (9 heads over 2 ranks: 4 and 5); a rank holds the kv heads
  // its attention heads use, so a kv head may live on several ranks.
  auto share = [&](int64_t n, int64_t r) { return r * n / world; };
  head_begin_ = share(cfg_.num_attention_heads, rank);
  local_heads_ = share(cfg_.num_attention_heads, rank + 1) - head_begin_;
  auto group = cfg_.num_attention_heads / cfg_.num_key_value_heads;
  kv_offset_ = head_begin_ / group;
  local_kv_ = (head_begin_ + local_heads_ + group - 1) / group - kv_offset_;
  inter_begin_ = share(cfg_.intermediate_size, rank);
  local_inter_ = share(cfg_.intermediate_size, rank + 1) - inter_begin_;
  // Rotary frequencies, with the llama3 rescaling of long wavelengths.
  auto half = cfg_.head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(cfg_.rope_theta, static_cast<double>(2 * i) / cfg_.head_dim);
    if (cfg_.rope_scaling.enabled) {
      auto& rs = cfg_.rope_scaling;
      double old_len = static_cast<double>(rs.original_max_position_embeddings);
      double low_wavelen = old_len / rs.low_freq_factor;
      double high_wavelen = old_len / rs.high_freq_factor;
      double wavelen = 2.0 * M_PI / f;
      if (wavelen > low_wavelen) {
        f /= rs.factor;
      } else if (wavelen >= high_wavelen) {
        double smooth = (old_len / wavelen - rs.low_freq_factor)
                        / (rs.high_freq_factor - rs.low_freq_factor);
        f = (1.0 - smooth) * f / rs.factor + smooth * f;
      }
    }
    base_inv_freq_.push_back(f);
  }
  inv_freq_ = base_inv_freq_;
}

std::string llama_model::architecture() const {
  return cfg_.architecture;
}

int64_t llama_model::num_parameters() const {
  int64_t n = 0;
  for (auto& t : tensors()) {
    int64_t numel = 1;
    for (auto d : t.shape)
      numel *= d;
    n += numel;
  }
  return n;
}

void llama_model::load(const checkpoint& ckpt, const load_progress& progress, bool presharded) {
  const auto H = cfg_.hidden_size;
  const auto V = cfg_.vocab_size;
  // What to read: a whole tensor, this rank's rows (column-parallel layers) or this rank's
  // columns (row-parallel layers).
  enum class part { whole, rows, cols };
  struct job {
    device_buffer* buf;
    std::string name;
    std::vector<int64_t> shape;
    part split;
    int64_t start;
    int64_t count;
  };
  std::vector<job> jobs;
  jobs.push_back({&embed_, "model.embed_tokens.weight", {V, H}, part::whole, 0, 0});
  jobs.push_back({&final_norm_, "model.norm.weight", {H}, part::whole, 0, 0});
  if (!cfg_.tie_word_embeddings)
    jobs.push_back({&lm_head_, "lm_head.weight", {V, H}, part::whole, 0, 0});
  layers_.resize(static_cast<size_t>(cfg_.num_hidden_layers));
  for (int64_t i = 0; i < cfg_.num_hidden_layers; ++i) {
    auto& l = layers_[static_cast<size_t>(i)];
    auto p = "model.layers." + std::to_string(i) + ".";
    jobs.push_back({&l.input_norm, p + "input_layernorm.weight", {H}, part::whole, 0, 0});
    jobs.push_back({&l.post_norm, p + "post_attention_layernorm.weight", {H}, part::whole, 0, 0});
    device_buffer* weights[] = {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down};
    for (size_t n = 0; n < projection_count; ++n) {
      auto proj = static_cast<projection>(n);
      auto sh = shard_of(proj);
      auto parent = proj <= projection::o ? "self_attn." : "mlp.";
      jobs.push_back({weights[n], p + parent + module_name(proj) + ".weight", {sh.out, sh.in},
                      sh.by_rows ? part::rows : part::cols, sh.start, sh.count});
    }
    if (cfg_.attention_bias) {
      device_buffer* biases[] = {&l.q_bias, &l.k_bias, &l.v_bias};
      for (size_t n = 0; n < 3; ++n) {
        auto proj = static_cast<projection>(n);
        auto sh = shard_of(proj);
        jobs.push_back({biases[n], p + "self_attn." + module_name(proj) + ".bias", {sh.out},
                        part::rows, sh.start, sh.count});
      }
    }
  }
  inv_freq_ = base_inv_freq_;
  if (ckpt.contains("rope_freqs.weight")) {
    auto& t = ckpt.at("rope_freqs.weight");
    if (t.shape != std::vector<int64_t>{static_cast<int64_t>(inv_freq_.size())})
      throw error{errc::invalid_argument, "model '" + ckpt.directory() +
                                            "': rope_freqs.weight has shape " + shape_text(t.shape)};
    std::vector<float> factors(inv_freq_.size());
    to_float(t.type, t.data, factors.data(), factors.size());
    for (size_t i = 0; i < factors.size(); ++i)
      inv_freq_[i] /= factors[i];
  }
  for (size_t n = 0; n < jobs.size(); ++n) {
    auto& j = jobs[n];
    // This rank's shape; a presharded checkpoint holds exactly that.
    auto local = j.shape;
    if (j.split == part::rows)
      local[0] = j.count;
    else if (j.split == part::cols)
      local[1] = j.count;
    auto& expected = presharded ? local : j.shape;
    auto& t = ckpt.at(j.name);
    if (t.shape != expected)
      throw error{errc::invalid_argument, "model '" + ckpt.directory() + "': tensor '" + j.name +
                                            "' has shape " + shape_text(t.shape) +
                                            ", the config needs " + shape_text(expected)};
    int64_t floats = 1;
    for (auto d : local)
      floats *= d;
    // Reloading writes into the memory already there, so addresses stay the same.
    auto bytes = static_cast<size_t>(floats) * sizeof(float);
    if (j.buf->size() != bytes)
      *j.buf = device_buffer(dev_, bytes, memory_tag::weights);
    auto dst = j.buf->as<float>();
    if (presharded || j.split == part::whole)
      read_rows(t, 0, t.shape[0], dst);
    else if (j.split == part::rows)
      read_rows(t, j.start, j.count, dst);
    else
      read_cols(t, j.start, j.count, dst);
    if (progress)
      progress(n + 1, jobs.size());
  }
}

llama_model::shard llama_model::shard_of(projection p) const {
  const auto H = cfg_.hidden_size;
  const auto D = cfg_.head_dim;
  const auto QH = cfg_.num_attention_heads * D;
  const auto KVH = cfg_.num_key_value_heads * D;
  const auto I = cfg_.intermediate_size;
  switch (p) {
    case projection::q:
      return {true, head_begin_ * D, local_heads_ * D, QH, H};
    case projection::k:
    case projection::v:
      return {true, kv_offset_ * D, local_kv_ * D, KVH, H};
    case projection::o:
      return {false, head_begin_ * D, local_heads_ * D, H, QH};
    case projection::gate:
    case projection::up:
      return {true, inter_begin_, local_inter_, I, H};
    case projection::down:
      return {false, inter_begin_, local_inter_, H, I};
  }
  throw error{errc::invalid_argument, "unknown projection"};
}

lora_weights llama_model::load_lora(const std::string& path, int64_t max_rank) const {
  auto peft = read_peft_lora(path, cfg_.num_hidden_layers);
  if (peft.rank > max_rank)
    throw error{errc::invalid_argument, "adapter '" + path + "' has rank " +
                                          std::to_string(peft.rank) + ", above max_lora_rank " +
                                          std::to_string(max_rank)};
  lora_weights out;
  out.rank = peft.rank;
  out.layers.resize(peft.layers.size());
  for (size_t l = 0; l < peft.layers.size(); ++l) {
    for (size_t n = 0; n < projection_count; ++n) {
      auto& f = peft.layers[l][n];
      if (!f.a)
        continue;
      auto proj = static_cast<projection>(n);
      auto sh = shard_of(proj);
      auto rank = f.a->shape[0];
      if (f.a->shape[1] != sh.in || f.b->shape[0] != sh.out)
        throw error{errc::invalid_argument,
                    "adapter '" + path + "': layer " + std::to_string(l) + " " +
                      module_name(proj) + " factors are " + shape_text(f.b->shape) + " x " +
                      shape_text(f.a->shape) + ", the model's weight is " +
                      shape_text({sh.out, sh.in})};
      auto& dst = out.layers[l][n];
      dst.rank = rank;
      auto a_cols = sh.by_rows ? sh.in : sh.count;
      auto b_rows = sh.by_rows ? sh.count : sh.out;
      dst.a = device_buffer(dev_, static_cast<size_t>(rank * a_cols) * sizeof(float),
                            memory_tag::weights);
      dst.b = device_buffer(dev_, static_cast<size_t>(b_rows * rank) * sizeof(float),
                            memory_tag::weights);
      if (sh.by_rows) {
        read_rows(*f.a, 0, rank, dst.a.as<float>());
        read_rows(*f.b, sh.start, sh.count, dst.b.as<float>());
      } else {
        read_cols(*f.a, sh.start, sh.count, dst.a.as<float>());
        read_rows(*f.b, 0, sh.out, dst.b.as<float>());
      }
      auto b = dst.b.as<float>();
      for (int64_t i = 0; i < b_rows * rank; ++i)
        b[i] *= f.scaling;
    }
  }
  return out;
}

prompt_embeddings llama_model::load_prompt_adapter(const std::string& path,
                                                   int64_t max_tokens) const {
  auto config = read_prompt_tuning_config(path);
  auto bad = [&](const std::string& what) {
    throw error{errc::invalid_argument, "adapter '" + path + "': " + what};
  };
  if (config.token_dim != cfg_.hidden_size)
    bad("token_dim is " + std::to_string(config.token_dim) + ", the model's hidden size " +
        std::to_string(cfg_.hidden_size));
  if (max_tokens > 0 && config.num_virtual_tokens > max_tokens)
    bad(std::to_string(config.num_virtual_tokens) +
        " virtual tokens, above max_prompt_adapter_token " + std::to_string(max_tokens));
  safetensors_file file{(std::filesystem::path{path} / "adapter_model.safetensors").string()};
  if (!file.contains("prompt_embeddings"))
    bad("adapter_model.safetensors has no prompt_embeddings");
  auto& t = file.at("prompt_embeddings");
  std::vector<int64_t> expected{config.num_virtual_tokens, cfg_.hidden_size};
  if (t.shape != expected)
    bad("prompt_embeddings has shape " + shape_text(t.shape) + ", the config says " +
        shape_text(expected));
  prompt_embeddings out;
  out.num_virtual_tokens = config.num_virtual_tokens;
  out.table = device_buffer(dev_, static_cast<size_t>(t.numel()) * sizeof(float),
                            memory_tag::weights);
  read_rows(t, 0, t.shape[0], out.table.as<float>());
  return out;
}

std::vector<llama_model::local_tensor> llama_model::tensors() const {
  const auto H = cfg_.hidden_size;
  const auto D = cfg_.head_dim;
  std::vector<local_tensor> out;
  out.push_back({"model.embed_tokens.weight", {cfg_.vocab_size, H}, embed_.as<float>()});
  out.push_back({"model.norm.weight", {H}, final_norm_.as<float>()});
  if (!cfg_.tie_word_embeddings)
    out.push_back({"lm_head.weight", {cfg_.vocab_size, H}, lm_head_.as<float>()});
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& l = layers_[i];
    auto p = "model.layers." + std::to_string(i) + ".";
    out.push_back({p + "input_layernorm.weight", {H}, l.input_norm.as<float>()});
    out.push_back({p + "post_attention_layernorm.weight", {H}, l.post_norm.as<float>()});
    out.push_back({p + "self_attn.q_proj.weight", {local_heads_ * D, H}, l.q.as<float>()});
    out.push_back({p + "self_attn.k_proj.weight", {local_kv_ * D, H}, l.k.as<float>()});
    out.push_back({p + "self_attn.v_proj.weight", {local_kv_ * D, H}, l.v.as<float>()});
    if (cfg_.attention_bias) {
      out.push_back({p + "self_attn.q_proj.bias", {local_heads_ * D}, l.q_bias.as<float>()});
      out.push_back({p + "self_attn.k_proj.bias", {local_kv_ * D}, l.k_bias.as<float>()});
      out.push_back({p + "self_attn.v_proj.bias", {local_kv_ * D}, l.v_bias.as<float>()});
    }
    out.push_back({p + "self_attn.o_proj.weight", {H, local_heads_ * D}, l.o.as<float>()});
    out.push_back({p + "mlp.gate_proj.weight", {local_inter_, H}, l.gate.as<float>()});
    out.push_back({p + "mlp.up_proj.weight", {local_inter_, H}, l.up.as<float>()});
    out.push_back({p + "mlp.down_proj.weight", {H, local_inter_}, l.down.as<float>()});
  }
  return out;
}

void llama_model::rope_tables(int32_t position, float* cos, float* sin) const {
  for (size_t i = 0; i < inv_freq_.size(); ++i) {
    double angle = position * inv_freq_[i];
    cos[i] = static_cast<float>(std::cos(angle));
    sin[i] = static_cast<float>(std::sin(angle));
  }
}

std::vector<float> llama_model::forward(const execute_model_request& req, kv_cache& cache,
                                        std::vector<sample_row>& rows,
                                        const step_adapters& adapters) {
  const auto H = cfg_.hidden_size;
  const auto D = cfg_.head_dim;
  const auto V = cfg_.vocab_size;
  const auto bs = cache.block_size();
  const auto q_width = local_heads_ * D;
  const auto kv_width = local_kv_ * D;
  const auto group_size = cfg_.num_attention_heads / cfg_.num_key_value_heads;

  // The tokens of the step, and where each one lives.
  struct token {
    int32_t id;
    int32_t position;
    const std::vector<int32_t>* block_table;
    size_t group;
  };
  const auto groups = req.seq_group_metadata_list.size();
  if ((!adapters.lora.empty() && adapters.lora.size() != groups)
      || (!adapters.prompt.empty() && adapters.prompt.size() != groups))
    bad_request("adapters given for " + std::to_string(adapters.lora.size()) + " and " +
                std::to_string(adapters.prompt.size()) + " groups of " + std::to_string(groups));
  std::vector<token> tokens;
  std::vector<int64_t> sample_token_rows;
  rows.clear();
  for (size_t g = 0; g < req.seq_group_metadata_list.size(); ++g) {
    auto& group = req.seq_group_metadata_list[g];
    for (size_t s = 0; s < group.seqs.size(); ++s) {
      auto& seq = group.seqs[s];
      int64_t start = seq.num_computed_tokens;
      int64_t chunk = group.token_chunk_size;
      if (start < 0 || chunk <= 0 || start + chunk > static_cast<int64_t>(seq.token_ids.size()))
        bad_request("request '" + group.request_id + "': chunk of " + std::to_string(chunk) +
                    " tokens from position " + std::to_string(start) + " does not fit its " +
                    std::to_string(seq.token_ids.size()) + " tokens");
      if (start + chunk > cfg_.max_position_embeddings)
        bad_request("request '" + group.request_id + "' reaches position " +
                    std::to_string(start + chunk) + ", past max_position_embeddings " +
                    std::to_string(cfg_.max_position_embeddings));
      auto blocks_needed = (start + chunk + bs - 1) / bs;
      if (static_cast<int64_t>(seq.block_table.size()) < blocks_needed)
        bad_request("request '" + group.request_id + "': block table has " +
                    std::to_string(seq.block_table.size()) + " blocks, " +
                    std::to_string(blocks_needed) + " needed");
      for (int64_t b = 0; b < blocks_needed; ++b)
        if (seq.block_table[b] < 0 || seq.block_table[b] >= cache.device_blocks())
          bad_request("request '" + group.request_id + "': block " +
                      std::to_string(seq.block_table[b]) + " is not a device block");
      for (int64_t p = start; p < start + chunk; ++p) {
        auto id = seq.token_ids[static_cast<size_t>(p)];
        if (id < 0 || id >= V)
          bad_request("request '" + group.request_id + "': token " + std::to_string(id) +
                      " is outside the vocabulary of " + std::to_string(V));
        tokens.push_back({id, static_cast<int32_t>(p), &seq.block_table, g});
      }
      if (group.do_sample) {
        sample_token_rows.push_back(static_cast<int64_t>(tokens.size()) - 1);
        rows.push_back({g, s});
      }
    }
  }
  const auto T = static_cast<int64_t>(tokens.size());
  std::vector<float> x(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t) {
    // A prompt adapter's virtual tokens take the first positions of the prompt.
    auto* virtual_tokens = adapters.prompt.empty() ? nullptr : adapters.prompt[tokens[t].group];
    auto row = virtual_tokens && tokens[t].position < virtual_tokens->num_virtual_tokens
                 ? virtual_tokens->table.as<float>() + tokens[t].position * H
                 : embed_.as<float>() + tokens[t].id * H;
    std::memcpy(&x[t * H], row, H * sizeof(float));
  }

  // Runs of consecutive tokens computed with the same LoRA adapter.
  struct lora_run {
    int64_t begin;
    int64_t count;
    const lora_weights* weights;
  };
  std::vector<lora_run> lora_runs;
  if (!adapters.lora.empty()) {
    for (int64_t t = 0; t < T; ++t) {
      auto* w = adapters.lora[tokens[t].group];
      if (w == nullptr)
        continue;
      if (!lora_runs.empty() && lora_runs.back().weights == w
          && lora_runs.back().begin + lora_runs.back().count == t)
        ++lora_runs.back().count;
      else
        lora_runs.push_back({t, 1, w});
    }
  }
  std::vector<float> lora_mid;
  // y[T×out] += B·(A·x[T×in]) for the tokens of each run whose adapter adapts `proj`.
  auto apply_lora = [&](size_t layer, projection proj, const float* in, int64_t in_width,
                        float* out, int64_t out_width) {
    for (auto& run : lora_runs) {
      auto& f = run.weights->layers[layer][static_cast<size_t>(proj)];
      if (f.rank == 0)
        continue;
      lora_mid.resize(static_cast<size_t>(run.count * f.rank));
      cpu::gemm_nt(in + run.begin * in_width, f.a.as<float>(), lora_mid.data(), run.count,
                   f.rank, in_width);
      cpu::gemm_nt(lora_mid.data(), f.b.as<float>(), out + run.begin * out_width, run.count,
                   out_width, f.rank, true);
    }
  };

  std::vector<float> h(x.size());
  std::vector<float> q(static_cast<size_t>(T * q_width));
  std::vector<float> k(static_cast<size_t>(T * kv_width));
  std::vector<float> v(static_cast<size_t>(T * kv_width));
  std::vector<float> attn(q.size());
  std::vector<float> gate(static_cast<size_t>(T * local_inter_));
  std::vector<float> up(gate.size());
  std::vector<float> half_cos(inv_freq_.size());
  std::vector<float> half_sin(inv_freq_.size());
  std::vector<float> scores;
  const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const auto eps = static_cast<float>(cfg_.rms_norm_eps);
  auto reduce = [&](std::vector<float>& buf) {
    if (all_reduce_ && world_ > 1)
      all_reduce_(buf.data(), buf.size());
  };

  for (size_t li = 0; li < layers_.size(); ++li) {
    auto& l = layers_[li];
    auto layer = static_cast<int64_t>(li);
    cpu::rms_norm(x.data(), l.input_norm.as<float>(), h.data(), T, H, eps);
    cpu::gemm_nt(h.data(), l.q.as<float>(), q.data(), T, q_width, H);
    cpu::gemm_nt(h.data(), l.k.as<float>(), k.data(), T, kv_width, H);
    cpu::gemm_nt(h.data(), l.v.as<float>(), v.data(), T, kv_width, H);
    apply_lora(li, projection::q, h.data(), H, q.data(), q_width);
    apply_lora(li, projection::k, h.data(), H, k.data(), kv_width);
    apply_lora(li, projection::v, h.data(), H, v.data(), kv_width);
    if (cfg_.attention_bias) {
      cpu::add_bias(q.data(), l.q_bias.as<float>(), T, q_width);
      cpu::add_bias(k.data(), l.k_bias.as<float>(), T, kv_width);
      cpu::add_bias(v.data(), l.v_bias.as<float>(), T, kv_width);
    }
    for (int64_t t = 0; t < T; ++t) {
      rope_tables(tokens[t].position, half_cos.data(), half_sin.data());
      cpu::rotary(&q[t * q_width], local_heads_, D, half_cos.data(), half_sin.data());
      cpu::rotary(&k[t * kv_width], local_kv_, D, half_cos.data(), half_sin.data());
      auto pos = tokens[t].position;
      auto block = (*tokens[t].block_table)[static_cast<size_t>(pos / bs)];
      std::memcpy(cache.key(layer, block, pos % bs, 0), &k[t * kv_width],
                  kv_width * sizeof(float));
      std::memcpy(cache.value(layer, block, pos % bs, 0), &v[t * kv_width],
                  kv_width * sizeof(float));
    }
    for (int64_t t = 0; t < T; ++t) {
      auto len = static_cast<int64_t>(tokens[t].position) + 1;
      scores.resize(static_cast<size_t>(len));
      auto& table = *tokens[t].block_table;
      for (int64_t head = 0; head < local_heads_; ++head) {
        auto global_head = head_begin_ + head;
        auto kv_head = global_head / group_size - kv_offset_;
        auto key_at = [&](int64_t p) {
          return cache.key(layer, table[static_cast<size_t>(p / bs)], p % bs, kv_head);
        };
        auto value_at = [&](int64_t p) {
          return cache.value(layer, table[static_cast<size_t>(p / bs)], p % bs, kv_head);
        };
        cpu::attend(&q[t * q_width + head * D], D, len, scale, key_at, value_at, scores.data(),
                    &attn[t * q_width + head * D]);
      }
    }
    cpu::gemm_nt(attn.data(), l.o.as<float>(), h.data(), T, H, q_width);
    apply_lora(li, projection::o, attn.data(), q_width, h.data(), H);
    reduce(h);
    for (size_t i = 0; i < x.size(); ++i)
      x[i] += h[i];
    cpu::rms_norm(x.data(), l.post_norm.as<float>(), h.data(), T, H, eps);
    cpu::gemm_nt(h.data(), l.gate.as<float>(), gate.data(), T, local_inter_, H);
    cpu::gemm_nt(h.data(), l.up.as<float>(), up.data(), T, local_inter_, H);
    apply_lora(li, projection::gate, h.data(), H, gate.data(), local_inter_);
    apply_lora(li, projection::up, h.data(), H, up.data(), local_inter_);
    cpu::silu_mul(gate.data(), up.data(), gate.data(), T * local_inter_);
    cpu::gemm_nt(gate.data(), l.down.as<float>(), h.data(), T, H, local_inter_);
    apply_lora(li, projection::down, gate.data(), local_inter_, h.data(), H);
    reduce(h);
    for (size_t i = 0; i < x.size(); ++i)
      x[i] += h[i];
  }

  const auto S = static_cast<int64_t>(sample_token_rows.size());
  std::vector<float> last(static_cast<size_t>(S * H));
  for (int64_t r = 0; r < S; ++r)
    cpu::rms_norm(&x[sample_token_rows[r] * H], final_norm_.as<float>(), &last[r * H], 1, H, eps);
  std::vector<float> logits(static_cast<size_t>(S * V));
  auto head = cfg_.tie_word_embeddings ? embed_.as<float>() : lm_head_.as<float>();
  cpu::gemm_nt(last.data(), head, logits.data(), S, V, H);
  return logits;
}

} // namespace troupe
