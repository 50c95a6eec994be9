#include "model/llama.hpp"

#include "kernels/platform.hpp"
#include "model/weight_cache.hpp"
#include "troupe/errors.hpp"
#include "kernels/host_pages.hpp"

#include <algorithm>
#include <cstdint>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <thread>

#include <unistd.h>

namespace troupe {

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// The CPU threads of one rank: the ranks of a host share its cores.
int threads_per_rank(int32_t world) {
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, world));
}

/// Bytes of one row of a 2-D tensor (of one element of a 1-D one).
size_t row_bytes(const tensor_view& t) {
  return t.shape.size() == 2 ? storage_bytes(t.type, static_cast<size_t>(t.shape[1]))
                             : storage_bytes(t.type, 1);
}

/// q and k, whose entries the rotary embedding turns.
bool rotated(projection p) {
  return p == projection::q || p == projection::k;
}

/// Copies rows [row0, row0 + rows) of a 2-D (or 1-D: elements) tensor as float32.
void read_rows(const tensor_view& t, int64_t row0, int64_t rows, float* dst) {
  int64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
  if (cols == 1 && is_quantized(t.type)) {
    // A vector in a block format converts in whole blocks only: all of it, then the part.
    std::vector<float> all(static_cast<size_t>(t.numel()));
    to_float(t.type, t.data, all.data(), all.size());
    std::copy_n(all.data() + row0, rows, dst);
    return;
  }
  if (!t.row_order.empty()) {
    for (int64_t r = 0; r < rows; ++r)
      to_float(t.type, t.row(row0 + r, row_bytes(t)), dst + r * cols, static_cast<size_t>(cols));
    return;
  }
  to_float(t.type, t.data + static_cast<size_t>(row0) * row_bytes(t), dst,
           static_cast<size_t>(rows * cols));
}

/// Whether columns [col0, col0 + cols) of `t` are whole blocks of its type.
bool whole_blocks(const tensor_view& t, int64_t col0, int64_t cols) {
  auto block = block_elements(t.type);
  return col0 % block == 0 && cols % block == 0;
}

/// Places a tensor of `bytes` at the end of an allocation of `total` bytes (256-byte aligned,
/// as cuBLAS prefers); returns its offset.
size_t pack(size_t& total, size_t bytes) {
  auto at = total;
  total += (bytes + 255) / 256 * 256;
  return at;
}

/// Copies columns [col0, col0 + cols) of rows [row0, row0 + rows) of a 2-D tensor as
/// float32.
void read_cols(const tensor_view& t, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
               float* dst) {
  auto stride = row_bytes(t);
  bool direct = whole_blocks(t, col0, cols);
  std::vector<float> row(direct ? 0 : static_cast<size_t>(t.shape[1]));
  for (int64_t r = 0; r < rows; ++r) {
    auto src = t.row(row0 + r, stride);
    if (direct) {
      to_float(t.type, src + storage_bytes(t.type, static_cast<size_t>(col0)), dst + r * cols,
               static_cast<size_t>(cols));
    } else {
      // Columns that cut through blocks: the whole row, then the part.
      to_float(t.type, src, row.data(), row.size());
      std::copy_n(row.data() + col0, cols, dst + r * cols);
    }
  }
}

/// Copies columns [col0, col0 + cols) (whole blocks) of rows [row0, row0 + rows) of `t` as
/// stored to `dst`.
void copy_stored_cols(const tensor_view& t, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                      char* dst) {
  auto stride = row_bytes(t);
  auto offset = storage_bytes(t.type, static_cast<size_t>(col0));
  auto width = storage_bytes(t.type, static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(dst + static_cast<size_t>(r) * width, t.row(row0 + r, stride) + offset, width);
}

/// Runs `fn(i)` for i in [0, n) on `threads` threads (the rank's share of the cores): an
/// update reads and writes hundreds of megabytes, which one thread does at half the
/// memory's speed. The first exception is thrown once all are done.
void parallel_each(size_t n, int threads, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  std::exception_ptr failed;
  std::mutex failed_mtx;
  auto work = [&] {
    for (size_t i; (i = next++) < n;) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk{failed_mtx};
        if (!failed)
          failed = std::current_exception();
        next = n;
      }
    }
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads && static_cast<size_t>(t) < n; ++t)
    helpers.emplace_back(work);
  work();
  for (auto& h : helpers)
    h.join();
  if (failed)
    std::rethrow_exception(failed);
}

} // namespace

llama_model::llama_model(model_config cfg, device& dev, int32_t rank, int32_t world,
                         dtype weight_type, bool stored_types, bool int8_activations,
                         bool expert_parallel)
  : cfg_(std::move(cfg)), dev_(dev),
    backend_(make_backend(dev, threads_per_rank(world), int8_activations)), rank_(rank),
    world_(world), weight_type_(weight_type), stored_types_(stored_types) {
  if (!backend_->computes_in(weight_type))
    throw error{errc::unsupported,
                dev.name() + " does not compute with " + dtype_name(weight_type) + " weights"};
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
  if (cfg_.num_experts > 0 && expert_parallel) {
    expert_begin_ = share(cfg_.num_experts, rank);
    local_experts_ = share(cfg_.num_experts, rank + 1) - expert_begin_;
    local_moe_inter_ = cfg_.moe_intermediate_size;
  } else if (cfg_.num_experts > 0) {
    local_experts_ = cfg_.num_experts;
    moe_inter_begin_ = share(cfg_.moe_intermediate_size, rank);
    local_moe_inter_ = share(cfg_.moe_intermediate_size, rank + 1) - moe_inter_begin_;
  }
  vocab_begin_ = share(cfg_.vocab_size, rank);
  local_vocab_ = share(cfg_.vocab_size, rank + 1) - vocab_begin_;
  base_inv_freq_ = rotary_frequencies(cfg_.rope_theta);
  inv_freq_ = base_inv_freq_;
  const auto rotated = cfg_.rotated_dims();
  for (int64_t i = 0; cfg_.local_rope_theta > 0 && i < rotated / 2; ++i)
    local_inv_freq_.push_back(
      1.0 /
      std::pow(cfg_.local_rope_theta, static_cast<double>(2 * i) / static_cast<double>(rotated)));
  if (cfg_.rope_scaling.type == rope_scaling_config::kind::longrope) {
    // rotary_frequencies gives the short ones.
    long_inv_freq_ = base_inv_freq_;
    for (size_t i = 0; i < long_inv_freq_.size(); ++i)
      long_inv_freq_[i] *= cfg_.rope_scaling.short_factor[i] / cfg_.rope_scaling.long_factor[i];
  }
}

std::vector<double> llama_model::rotary_frequencies(double theta) const {
  using rope = rope_scaling_config::kind;
  const auto& rs = cfg_.rope_scaling;
  const auto dim = static_cast<double>(cfg_.rotated_dims());
  const auto half = cfg_.rotated_dims() / 2;
  // YaRN's band of dimensions between beta_fast and beta_slow rotations over the original
  // length: extrapolated below it, interpolated above, blended linearly within.
  double yarn_low = 0;
  double yarn_high = 0;
  if (rs.type == rope::yarn) {
    auto dim_of = [&](double rotations) {
      return dim *
             std::log(static_cast<double>(rs.original_max_position_embeddings) /
                      (rotations * 2 * M_PI)) /
             (2 * std::log(theta));
    };
    yarn_low = dim_of(rs.beta_fast);
    yarn_high = dim_of(rs.beta_slow);
    if (rs.truncate) {
      yarn_low = std::floor(yarn_low);
      yarn_high = std::ceil(yarn_high);
    }
    yarn_low = std::max(yarn_low, 0.0);
    yarn_high = std::min(yarn_high, dim - 1);
    if (yarn_low == yarn_high)
      yarn_high += 0.001;
  }
  std::vector<double> freqs;
  for (int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(theta, static_cast<double>(2 * i) / dim);
    if (rs.type == rope::linear) {
      f /= rs.factor;
    } else if (rs.type == rope::longrope) {
      f /= rs.short_factor[static_cast<size_t>(i)];
    } else if (rs.type == rope::yarn) {
      double ramp =
        std::clamp((static_cast<double>(i) - yarn_low) / (yarn_high - yarn_low), 0.0, 1.0);
      double extrapolated = 1.0 - ramp;
      f = f / rs.factor * (1.0 - extrapolated) + f * extrapolated;
    } else if (rs.type == rope::llama3) {
      double old_len = static_cast<double>(rs.original_max_position_embeddings);
      double low_wavelen = old_len / rs.low_freq_factor;
      double high_wavelen = old_len / rs.high_freq_factor;
      double wavelen = 2.0 * M_PI / f;
      if (wavelen > low_wavelen) {
        f /= rs.factor;
      } else if (wavelen >= high_wavelen) {
        double smooth =
          (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
        f = (1.0 - smooth) * f / rs.factor + smooth * f;
      }
    }
    freqs.push_back(f);
  }
  return freqs;
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

std::vector<int64_t> llama_model::weight_job::local_shape() const {
  auto local = shape;
  if (split == part::rows)
    local[0] = count;
  else if (split == part::cols)
    local[1] = count;
  return local;
}

std::vector<llama_model::weight_job> llama_model::plan_weights() {
  const auto H = cfg_.hidden_size;
  const auto V = cfg_.vocab_size;
  const auto f32 = dtype::f32;
  const auto wt = weight_type_;
  std::vector<weight_job> jobs;
  jobs.push_back({&embed_, "model.embed_tokens.weight", {V, H}, part::whole, 0, 0, wt});
  jobs.push_back({&final_norm_, "model.norm.weight", {H}, part::whole, 0, 0, f32});
  if (!cfg_.tie_word_embeddings)
    jobs.push_back({&lm_head_, "lm_head.weight", {V, H}, part::whole, 0, 0, wt});
  layers_.resize(static_cast<size_t>(cfg_.num_hidden_layers));
  for (int64_t i = 0; i < cfg_.num_hidden_layers; ++i) {
    auto& l = layers_[static_cast<size_t>(i)];
    auto p = "model.layers." + std::to_string(i) + ".";
    jobs.push_back({&l.input_norm, p + "input_layernorm.weight", {H}, part::whole, 0, 0, f32});
    if (cfg_.sandwich_norms) {
      jobs.push_back(
        {&l.attn_out_norm, p + "post_attention_layernorm.weight", {H}, part::whole, 0, 0, f32});
      jobs.push_back(
        {&l.post_norm, p + "pre_feedforward_layernorm.weight", {H}, part::whole, 0, 0, f32});
      jobs.push_back(
        {&l.mlp_out_norm, p + "post_feedforward_layernorm.weight", {H}, part::whole, 0, 0, f32});
    } else {
      jobs.push_back(
        {&l.post_norm, p + "post_attention_layernorm.weight", {H}, part::whole, 0, 0, f32});
    }
    if (cfg_.qk_norm) {
      const auto D = cfg_.head_dim;
      jobs.push_back({&l.q_norm, p + "self_attn.q_norm.weight", {D}, part::whole, 0, 0, f32});
      jobs.push_back({&l.k_norm, p + "self_attn.k_norm.weight", {D}, part::whole, 0, 0, f32});
    }
    tensor_slot* weights[] = {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down};
    const bool sparse = cfg_.sparse(i);
    if (sparse) {
      const auto I = cfg_.moe_intermediate_size;
      jobs.push_back(
        {&l.router, router_weight_name(cfg_, i), {cfg_.num_experts, H}, part::whole, 0, 0, wt});
      l.experts.resize(static_cast<size_t>(local_experts_));
      for (int64_t e = 0; e < local_experts_; ++e) {
        auto& x = l.experts[static_cast<size_t>(e)];
        auto name = [&](const char* proj) {
          return expert_weight_name(cfg_, i, expert_begin_ + e, proj);
        };
        jobs.push_back(
          {&x.gate, name("gate"), {I, H}, part::rows, moe_inter_begin_, local_moe_inter_, wt});
        jobs.push_back(
          {&x.up, name("up"), {I, H}, part::rows, moe_inter_begin_, local_moe_inter_, wt});
        jobs.push_back(
          {&x.down, name("down"), {H, I}, part::cols, moe_inter_begin_, local_moe_inter_, wt});
      }
    }
    for (size_t n = 0; n < projection_count; ++n) {
      auto proj = static_cast<projection>(n);
      if (sparse && proj > projection::o)
        continue;
      auto sh = shard_of(proj);
      auto parent = proj <= projection::o ? "self_attn." : "mlp.";
      jobs.push_back({weights[n],
                      p + parent + module_name(proj) + ".weight",
                      {sh.out, sh.in},
                      sh.by_rows ? part::rows : part::cols,
                      sh.start,
                      sh.count,
                      wt});
      jobs.back().rotated = rotated(proj);
      // A bias of a column-parallel projection is split as its rows; one of a row-parallel
      // projection (o, down) is whole, added once the partial sums are reduced.
      bool biased = proj <= projection::v   ? cfg_.attention_bias
                    : proj == projection::o ? cfg_.o_proj_bias
                                            : cfg_.mlp_bias;
      if (biased) {
        tensor_slot* biases[] = {&l.q_bias,    &l.k_bias,  &l.v_bias,   &l.o_bias,
                                 &l.gate_bias, &l.up_bias, &l.down_bias};
        jobs.push_back({biases[n],
                        p + parent + module_name(proj) + ".bias",
                        {sh.out},
                        sh.by_rows ? part::rows : part::whole,
                        sh.by_rows ? sh.start : 0,
                        sh.by_rows ? sh.count : 0,
                        f32});
        jobs.back().rotated = rotated(proj);
      }
    }
  }
  // Gemma's norms scale by 1 + w.
  for (auto& j : jobs)
    if (j.name.size() > 11 && j.name.compare(j.name.size() - 11, 11, "norm.weight") == 0)
      j.offset = static_cast<float>(cfg_.norm_weight_offset);
  return jobs;
}

bool llama_model::passed_over(const std::string& name, bool presharded) const {
  if (name == "rope_freqs.weight" || name.find("rotary_emb.inv_freq") != std::string::npos ||
      (cfg_.tie_word_embeddings && name == "lm_head.weight"))
    return true;
  // The experts other ranks hold (expert parallelism).
  for (int64_t i = 0; i < cfg_.num_hidden_layers && !presharded; ++i)
    for (int64_t e = 0; cfg_.sparse(i) && e < cfg_.num_experts; ++e)
      for (auto proj : {"gate", "up", "down"})
        if (name == expert_weight_name(cfg_, i, e, proj))
          return true;
  return false;
}

void llama_model::load(const checkpoint& ckpt, const load_progress& progress, bool presharded) {
  auto plan = plan_load(ckpt, presharded);
  plan.in_place = map_in_place(ckpt, plan, presharded);
  plan.offsets.assign(plan.jobs.size(), 0);
  for (size_t n = 0; n < plan.jobs.size(); ++n)
    if (plan.in_place[n] == nullptr)
      plan.offsets[n] = pack(plan.total, plan.sizes[n]);
  // The rest goes into one allocation; a reload of the same layout writes into the same
  // memory.
  const auto total = plan.total;
  std::optional<weight_cache_file> cache;
  bool cached = false;
  if (weights_.size() != total) {
    graphs_.clear();
    weights_.reset();
    if (!cache_directory_.empty() && total > 0) {
      std::error_code ec;
      auto model = std::filesystem::absolute(ckpt.directory(), ec).lexically_normal().string();
      weight_cache_key key{model, ckpt.identity(), layout_text(plan)};
      if ((cache = weight_cache_file::find(cache_directory_, key, total))) {
        weights_ = device_buffer::map_file(dev_, cache->fd(), cache->data_offset(), total,
                                           memory_tag::weights, false);
        cached = weights_.size() == total;
      } else if ((cache = weight_cache_file::create(cache_directory_, key, total))) {
        // Packed straight into the file's pages: no fresh memory beside them.
        weights_ = device_buffer::map_file(dev_, cache->fd(), cache->data_offset(), total,
                                           memory_tag::weights, true);
      }
      if (weights_.size() != total)
        cache.reset(); // a device that does not map files
    }
    if (weights_.size() != total)
      weights_ = device_buffer(dev_, total, memory_tag::weights);
  }
  point_slots(plan);
  content_hash_ = 0;
  if (cached) {
    // A file written without the hash (hashing was off then) is hashed now.
    if (hash_weights_)
      content_hash_ = cache->content_hash() != 0 ? cache->content_hash() : ckpt.content_hash({});
    if (progress)
      progress(plan.jobs.size(), plan.jobs.size());
    return;
  }
  read_weights(ckpt, plan, presharded, progress);
  if (cache) {
    // Named for the next start, then mapped copy-on-write from the page cache: what this
    // process writes into its weights from now on (an update, a reload) never reaches the
    // file. The pages are the ones just written, so nothing is read or copied.
    // The shared mapping goes first: both at once would count the pages twice in the
    // process's resident memory.
    cache->commit(content_hash_);
    weights_.reset();
    weights_ = device_buffer::map_file(dev_, cache->fd(), cache->data_offset(), total,
                                       memory_tag::weights, false);
    point_slots(plan);
  }
}

llama_model::load_plan llama_model::plan_load(const checkpoint& ckpt, bool presharded) {
  const auto wt = weight_type_;
  if (!pairs_)
    pairs_ = ckpt.neighbour_pairs() && backend_->rotates(rope_pairs::neighbours) &&
                 cfg_.rotated_dims() == cfg_.head_dim && !cfg_.qk_norm
               ? rope_pairs::neighbours
               : rope_pairs::halves;
  load_plan plan;
  auto& jobs = plan.jobs;
  jobs = plan_weights();
  // A sharded state holds the norms as loaded.
  if (presharded)
    for (auto& j : jobs)
      j.offset = 0;
  // A tensor the config has no place for means the config and the weights disagree (more
  // layers than num_hidden_layers, another architecture): refused, as vLLM does, rather
  // than silently run a smaller model. Buffers transformers once saved, and an output head
  // next to tied embeddings, are ignored as vLLM ignores them.
  std::set<std::string> wanted;
  for (auto& j : jobs)
    wanted.insert(j.name);
  for (auto& name : ckpt.names())
    if (wanted.count(name) == 0 && !passed_over(name, presharded))
      throw error{errc::invalid_argument, "model '" + ckpt.directory() + "': tensor '" + name +
                                            "' has no place in the model its config describes (" +
                                            std::to_string(cfg_.num_hidden_layers) + " layers" +
                                            (cfg_.attention_bias ? ", with" : ", without") +
                                            " attention biases)"};
  inv_freq_ = base_inv_freq_;
  dynamic_freqs_.clear();
  if (ckpt.contains("rope_freqs.weight")) {
    auto& t = ckpt.at("rope_freqs.weight");
    if (t.shape != std::vector<int64_t>{static_cast<int64_t>(inv_freq_.size())})
      throw error{errc::invalid_argument, "model '" + ckpt.directory() +
                                            "': rope_freqs.weight has shape " +
                                            shape_text(t.shape)};
    std::vector<float> factors(inv_freq_.size());
    to_float(t.type, t.data, factors.data(), factors.size());
    for (size_t i = 0; i < factors.size(); ++i)
      inv_freq_[i] /= factors[i];
  }
  // Every shape is checked first, so that a checkpoint that does not fit changes nothing.
  for (auto& j : jobs) {
    // A weight (not a norm or a bias) keeps the checkpoint's type when asked to, when the
    // device computes in it and when this rank's part is whole blocks of it.
    auto& stored = ckpt.at(j.name);
    j.as_stored = stored_types_ && j.type == wt && stored.shape.size() == 2 &&
                  backend_->computes_in(stored.type) &&
                  (presharded || j.split != part::cols || whole_blocks(stored, j.start, j.count));
    if (j.as_stored)
      j.type = stored.type;
    // This rank's shape; a presharded checkpoint holds exactly that.
    auto local = j.local_shape();
    auto& expected = presharded ? local : j.shape;
    auto& t = ckpt.at(j.name);
    if (t.shape != expected)
      throw error{errc::invalid_argument, "model '" + ckpt.directory() + "': tensor '" + j.name +
                                            "' has shape " + shape_text(t.shape) +
                                            ", the config needs " + shape_text(expected)};
    size_t numel = 1;
    for (auto d : local)
      numel *= static_cast<size_t>(d);
    // A weight goes into the backend's packed layout where it has one, but for a head split
    // by vocabulary (each rank reads it from its own first row).
    bool sliced =
      world_ > 1 && (j.slot == &lm_head_ || (j.slot == &embed_ && cfg_.tie_word_embeddings));
    j.packed =
      j.as_stored && local.size() == 2 && !sliced && backend_->packs(j.type, local[0], local[1]);
    plan.sizes.push_back(storage_bytes(j.type, numel));
    plan.local_shapes.push_back(local);
  }
  return plan;
}

std::string llama_model::layout_text(const load_plan& plan) const {
  std::string text =
    "world " + std::to_string(world_) + " rank " + std::to_string(rank_) + " pack_group " +
    std::to_string(backend_->pack_group()) + " total " + std::to_string(plan.total) +
    (pairs_ == rope_pairs::neighbours ? " q and k in neighbouring pairs" : "") + "\n";
  for (size_t n = 0; n < plan.jobs.size(); ++n) {
    auto& j = plan.jobs[n];
    text += j.name + " " + dtype_name(j.type) + (j.packed ? " packed" : "") +
            (plan.in_place[n] != nullptr ? " in place" : " at " + std::to_string(plan.offsets[n])) +
            " from " + std::to_string(j.start) + " split " +
            std::to_string(static_cast<int>(j.split)) + " shape " +
            shape_text(plan.local_shapes[n]) +
            (j.offset != 0 ? " plus " + std::to_string(j.offset) : "") + "\n";
  }
  return text;
}

void llama_model::point_slots(const load_plan& plan) {
  held_.clear();
  for (size_t n = 0; n < plan.jobs.size(); ++n) {
    auto& j = plan.jobs[n];
    j.slot->ptr = plan.in_place[n] != nullptr
                    ? plan.in_place[n]
                    : static_cast<char*>(weights_.data()) + plan.offsets[n];
    j.slot->type = j.type;
    j.slot->packed = j.packed;
    held_.push_back({j.name, plan.local_shapes[n], j.type, j.slot->ptr, j.packed,
                     j.rotated && pairs_ == rope_pairs::neighbours});
  }
}

void llama_model::read_weights(const checkpoint& ckpt, const load_plan& plan, bool presharded,
                               const load_progress& progress) {
  auto& jobs = plan.jobs;
  const auto source = "model '" + ckpt.directory() + "'";
  // In place, the values are checked where they are, as a copy's are as it is made; on all
  // of the rank's threads, as they only read.
  std::vector<size_t> used_in_place;
  for (size_t n = 0; n < jobs.size(); ++n)
    if (plan.in_place[n] != nullptr)
      used_in_place.push_back(n);
  parallel_each(used_in_place.size(), threads_per_rank(world_), [&](size_t i) {
    auto n = used_in_place[i];
    auto& j = jobs[n];
    auto elements = plan.local_shapes[n][0] * plan.local_shapes[n][1];
    if (auto at = first_non_finite(j.type, plan.in_place[n], static_cast<size_t>(elements)))
      throw error{errc::invalid_argument, source + ": tensor '" + j.name +
                                            "' holds NaN or an infinity (element " +
                                            std::to_string(*at) + " of this rank's part)"};
  });
  std::map<std::string, uint64_t> hashes;
  for (size_t n = 0; n < jobs.size(); ++n) {
    auto& t = ckpt.at(jobs[n].name);
    // Hashed as it is read for the copy: the file is read from the disk once.
    if (hash_weights_)
      hashes[jobs[n].name] = checkpoint::tensor_hash(t);
    tensor_view reordered;
    if (plan.in_place[n] == nullptr)
      write_weight(jobs[n], in_model_order(jobs[n].rotated, t, reordered),
                   static_cast<char*>(weights_.data()) + plan.offsets[n], presharded, source);
    ckpt.release(t);
    if (progress)
      progress(n + 1, jobs.size());
  }
  if (hash_weights_)
    content_hash_ = ckpt.content_hash(std::move(hashes));
}

std::vector<char*> llama_model::map_in_place(const checkpoint& ckpt, const load_plan& plan,
                                             bool presharded) {
  auto& jobs = plan.jobs;
  auto& local_shapes = plan.local_shapes;
  if (!mapped_.empty())
    graphs_.clear(); // recorded against the old mappings
  mapped_.clear();
  // A weight kept as stored, in the file's row order and of whole rows, is used where the
  // file has it, as llama.cpp does: a private mapping of the file, whose pages are the page
  // cache's, shared with every process that maps it, rather than a copy into fresh
  // memory. What is written into it (an update) stays in this process.
  struct stored_part {
    size_t job;
    std::size_t offset;
    std::size_t bytes;
  };
  std::map<int, std::vector<stored_part>> by_file;
  for (size_t n = 0; n < jobs.size(); ++n) {
    auto& j = jobs[n];
    tensor_view reordered;
    auto& t = in_model_order(j.rotated, ckpt.at(j.name), reordered);
    bool whole_rows = presharded || j.split != part::cols || j.count == t.shape[1];
    if (!j.as_stored || j.packed || local_shapes[n].size() != 2 || !t.row_order.empty() ||
        !whole_rows)
      continue;
    auto first = presharded || j.split != part::rows ? 0 : j.start;
    auto stride = row_bytes(t);
    if (auto at = ckpt.place_of(t.data + static_cast<size_t>(first) * stride))
      by_file[at->fd].push_back({n, at->offset, static_cast<size_t>(local_shapes[n][0]) * stride});
  }
  std::vector<char*> in_place(jobs.size(), nullptr);
  const auto page = host_page_size();
  for (auto& [fd, parts] : by_file) {
    std::size_t lo = SIZE_MAX;
    std::size_t hi = 0;
    std::size_t used = 0;
    for (auto& p : parts) {
      lo = std::min(lo, p.offset);
      hi = std::max(hi, p.offset + p.bytes);
      used += p.bytes;
    }
    lo = lo / page * page;
    // The whole span is mapped and resident: where the weights used in place are a small
    // part of it (the fast path packs most), they are copied instead.
    if (used * 2 < hi - lo)
      continue;
    auto mapping = device_buffer::map_file(dev_, fd, lo, hi - lo, memory_tag::weights, false);
    if (mapping.size() == 0)
      continue; // a device whose memory is not the host's
    for (auto& p : parts)
      in_place[p.job] = static_cast<char*>(mapping.data()) + (p.offset - lo);
    mapped_.push_back(std::move(mapping));
  }
  return in_place;
}

void llama_model::write_weight(const weight_job& j, const tensor_view& t, char* dst,
                               bool presharded, const std::string& source, bool checked) const {
  // A band of rows at a time through bounded buffers: a float32 copy of a whole embedding
  // would take more memory than the quantized model.
  constexpr int64_t staging_floats = int64_t{1} << 20;
  std::vector<float> staging;
  std::vector<char> raw;
  auto local = j.local_shape();
  // A 1-D tensor (a norm, a bias) is one band: a vector in a block format converts whole.
  bool matrix = local.size() == 2;
  int64_t rows = matrix ? local[0] : 1;
  int64_t cols = matrix ? local[1] : local[0];
  auto band = matrix ? std::max<int64_t>(1, staging_floats / cols) : 1;
  if (j.packed) {
    const auto group = backend_->pack_group();
    band = std::max(group, band / group * group);
  }
  auto dst_row = storage_bytes(j.type, static_cast<size_t>(cols));
  // The checkpoint's first row of this rank's part (for a row split).
  auto first = presharded || j.split != part::rows ? 0 : j.start;
  auto refuse = [&](int64_t element, const char* what) {
    throw error{errc::invalid_argument, source + ": tensor '" + j.name + "' holds " + what +
                                          " (element " + std::to_string(element) +
                                          " of this rank's part)"};
  };
  // Bytes in the slot's type at `src` (a band), packed or copied into place.
  auto place = [&](const char* src, char* band_dst, int64_t count) {
    if (j.packed)
      backend_->pack(j.type, src, band_dst, count, cols);
    else
      dev_.copy(band_dst, src, static_cast<size_t>(count) * dst_row);
  };
  for (int64_t r0 = 0; r0 < rows; r0 += band) {
    auto count = std::min(band, rows - r0);
    auto band_dst = dst + static_cast<size_t>(r0) * dst_row;
    auto band_bytes = static_cast<size_t>(count) * dst_row;
    if (j.as_stored) {
      // Copied as stored: its values are checked where they are, not converted.
      const char* src = nullptr;
      if (presharded || j.split != part::cols) {
        if (t.row_order.empty()) {
          src =
            reinterpret_cast<const char*>(t.data) + static_cast<size_t>(first + r0) * row_bytes(t);
        } else {
          raw.resize(band_bytes);
          copy_stored_cols(t, first + r0, count, 0, cols, raw.data());
          src = raw.data();
        }
      } else {
        raw.resize(band_bytes);
        copy_stored_cols(t, r0, count, j.start, j.count, raw.data());
        src = raw.data();
      }
      if (auto at = checked ? std::nullopt
                            : first_non_finite(j.type, src, static_cast<size_t>(count * cols)))
        refuse(r0 * cols + static_cast<int64_t>(*at), "NaN or an infinity");
      place(src, band_dst, count);
      continue;
    }
    staging.resize(static_cast<size_t>(count * cols));
    if (!matrix)
      read_rows(t, first, cols, staging.data());
    else if (presharded || j.split != part::cols)
      read_rows(t, first + r0, count, staging.data());
    else
      read_cols(t, r0, count, j.start, j.count, staging.data());
    // A NaN or an infinity in a weight turns every logit into NaN (token 0 at every
    // step); the values pass through here once anyway.
    auto bad = checked ? staging.end() : std::find_if(staging.begin(), staging.end(), [](float x) {
      return !std::isfinite(x);
    });
    if (bad != staging.end())
      refuse(r0 * cols + (bad - staging.begin()), std::isnan(*bad) ? "NaN" : "an infinity");
    if (j.offset != 0)
      for (auto& v : staging)
        v += j.offset;
    if (j.packed) {
      // Only an update writes a packed weight from another type.
      raw.resize(band_bytes);
      from_float(j.type, staging.data(), raw.data(), staging.size());
      place(raw.data(), band_dst, count);
    } else {
      upload(band_dst, staging.data(), staging.size(), j.type);
    }
  }
}

const tensor_view& llama_model::in_model_order(bool rotated, const tensor_view& t,
                                               tensor_view& reordered) const {
  if (!rotated || pairs_ != rope_pairs::neighbours)
    return t;
  const auto D = cfg_.head_dim;
  const auto rows = t.shape[0];
  reordered = t;
  reordered.row_order.resize(static_cast<size_t>(rows));
  bool as_stored = true;
  for (int64_t s = 0; s < rows; ++s) {
    auto hf = halves_row(s, D);
    auto stored = t.row_order.empty() ? hf : t.row_order[static_cast<size_t>(hf)];
    reordered.row_order[static_cast<size_t>(s)] = stored;
    as_stored = as_stored && stored == s;
  }
  if (as_stored)
    reordered.row_order.clear();
  return reordered;
}

std::vector<std::pair<llama_model::weight_job, tensor_view>>
llama_model::plan_update(const checkpoint& src, const update_options& options) {
  if (held_.empty())
    throw error{errc::unsupported, "no weights are loaded to update"};
  auto jobs = plan_weights();
  std::map<std::string, size_t> by_name;
  for (size_t n = 0; n < jobs.size(); ++n)
    by_name[jobs[n].name] = n;
  const std::string source = "weight update from " + src.directory();
  std::vector<std::pair<weight_job, tensor_view>> planned;
  for (auto& name : src.names()) {
    auto found = by_name.find(name);
    if (found == by_name.end()) {
      if (passed_over(name, false))
        continue;
      throw error{errc::invalid_argument, source + ": the model has no parameter '" + name + "'"};
    }
    auto j = jobs[found->second];
    auto& t = src.at(name);
    if (t.shape != j.shape)
      throw error{errc::invalid_argument, source + ": parameter '" + name + "' has shape " +
                                            shape_text(t.shape) + ", the model's is " +
                                            shape_text(j.shape)};
    // The memory, type and layout the load chose.
    j.type = j.slot->type;
    j.packed = j.slot->packed;
    // Copied as given where nothing changes on the way (Gemma's norms gain their offset).
    j.as_stored = t.type == j.type && j.offset == 0 &&
                  (j.split != part::cols || whole_blocks(t, j.start, j.count));
    // A block format is written from another type only by quantizing it again (a float
    // type's rounding is a load's too).
    if (!j.as_stored && is_quantized(j.type) && !options.requantize)
      throw error{errc::invalid_argument,
                  source + ": parameter '" + name + "' is held as " + dtype_name(j.type) +
                    "; an update in " + dtype_name(t.type) +
                    " would quantize it again: ask for that (quantize_on_update), or load the "
                    "model with a float dtype"};
    tensor_view reordered;
    auto& ordered = in_model_order(j.rotated, t, reordered);
    planned.emplace_back(std::move(j), ordered);
    by_name.erase(found);
  }
  if (options.whole && !by_name.empty())
    throw error{errc::invalid_argument, source + " lacks parameter '" + by_name.begin()->first +
                                          "' (and " + std::to_string(by_name.size() - 1) +
                                          " more)"};
  if (options.check_values) {
    // In checkpoint order, so that the first bad tensor is the one named.
    std::vector<std::optional<size_t>> bad(planned.size());
    parallel_each(planned.size(), threads_per_rank(world_), [&](size_t i) {
      auto& t = planned[i].second;
      bad[i] = first_non_finite(t.type, t.data, static_cast<size_t>(t.numel()));
    });
    for (size_t i = 0; i < planned.size(); ++i)
      if (bad[i])
        throw error{errc::invalid_argument, source + ": parameter '" + planned[i].first.name +
                                              "' holds NaN or an infinity (element " +
                                              std::to_string(*bad[i]) + ")"};
  }
  return planned;
}

void llama_model::check_update(const checkpoint& src, const update_options& options) {
  plan_update(src, options);
}

void llama_model::update(const checkpoint& src, const update_options& options) {
  const std::string source = "weight update from " + src.directory();
  auto planned = plan_update(src, options);
  auto write = [&](size_t i) {
    auto& [j, t] = planned[i];
    write_weight(j, t, static_cast<char*>(j.slot->ptr), false, source, true);
  };
  // Packing runs on the backend's own threads (one call at a time): those tensors go one
  // after another; the copies go on this rank's threads.
  std::vector<size_t> copied;
  for (size_t i = 0; i < planned.size(); ++i)
    if (planned[i].first.packed)
      write(i);
    else
      copied.push_back(i);
  parallel_each(copied.size(), threads_per_rank(world_), [&](size_t n) { write(copied[n]); });
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

void llama_model::upload(void* dst, const float* values, size_t count, dtype type) const {
  auto bytes = storage_bytes(type, count);
  if (type == dtype::f32) {
    dev_.copy(dst, values, bytes);
    return;
  }
  std::vector<char> converted(bytes);
  from_float(type, values, converted.data(), count);
  dev_.copy(dst, converted.data(), bytes);
}

llama_model::step_layout llama_model::layout_of(int64_t T, int64_t S, int64_t seqs,
                                                int64_t max_blocks, int64_t max_lora_rank) const {
  const auto H = cfg_.hidden_size;
  const auto q_width = local_heads_ * cfg_.head_dim;
  const auto kv_width = local_kv_ * cfg_.head_dim;
  step_layout l{};
  auto take = [&](int64_t size) {
    auto at = l.total;
    l.total += (size + 63) / 64 * 64;
    return at;
  };
  l.ids = 0;
  l.positions = T;
  l.slots = 2 * T;
  l.token_seq = 3 * T;
  l.tables = 4 * T;
  l.samples = l.tables + seqs * max_blocks;
  l.int_count = l.samples + S;
  l.ints = take(l.int_count);
  // cos and sin, half the rotated part of a head each; twice with a local base.
  l.rope = take(T * cfg_.rotated_dims() * (local_inv_freq_.empty() ? 1 : 2));
  l.x = take(T * H);
  l.h = take(T * H);
  l.q = take(T * q_width);
  l.k = take(T * kv_width);
  l.v = take(T * kv_width);
  l.attn = take(T * q_width);
  l.gate = take(T * local_inter_);
  l.up = take(T * local_inter_);
  l.mid = take(T * max_lora_rank);
  l.last = take(S * H);
  l.logits = take(S * cfg_.vocab_size);
  l.processed = take(S * cfg_.vocab_size);
  l.masks = take(S * mask_words());
  l.sampling = take(S * static_cast<int64_t>(sizeof(row_sampling) / sizeof(float)));
  l.sampled_ids = take(S);
  l.sampled_logprobs = take(S);
  l.sampled_ranks = take(S);
  // A sparse layer: one expert takes each token at most once.
  const bool moe = cfg_.num_experts > 0;
  l.router = take(moe ? T * cfg_.num_experts : 0);
  l.moe_in = take(moe ? T * H : 0);
  l.expert_x = take(moe ? T * H : 0);
  l.expert_gate = take(moe ? T * local_moe_inter_ : 0);
  l.expert_up = take(moe ? T * local_moe_inter_ : 0);
  l.expert_out = take(moe ? T * H : 0);
  l.routes = take(moe ? T * cfg_.num_experts_per_tok : 0);
  l.route_weights = take(moe ? T * cfg_.num_experts_per_tok : 0);
  return l;
}

int64_t llama_model::reserve(int64_t tokens, int64_t seqs, int64_t max_len, int64_t block_size,
                             int64_t max_lora_rank) {
  auto max_blocks = table_width((max_len + block_size - 1) / block_size);
  auto layout =
    layout_of(tokens, std::min(seqs, tokens), std::min(seqs, tokens), max_blocks, max_lora_rank);
  auto bytes = static_cast<size_t>(layout.total) * sizeof(float);
  workspace(bytes);
  return static_cast<int64_t>(bytes);
}

void* llama_model::workspace(size_t bytes) {
  // Grown to what a step needs (the profiled largest step sizes it once). Captured steps
  // name the old memory: they go.
  if (workspace_.size() < bytes) {
    graphs_.clear();
    workspace_.reset();
    workspace_ = device_buffer(dev_, bytes, memory_tag::kv_cache);
  }
  return workspace_.data();
}

lora_weights llama_model::load_lora(const std::string& path, int64_t max_rank) const {
  auto peft = read_peft_lora(path, cfg_);
  if (peft.rank > max_rank)
    throw error{errc::invalid_argument, "adapter '" + path + "' has rank " +
                                          std::to_string(peft.rank) + ", above max_lora_rank " +
                                          std::to_string(max_rank)};
  lora_weights out;
  out.rank = peft.rank;
  out.layers.resize(peft.layers.size());
  // Shapes are checked and the factors placed first, then all are read into one allocation.
  struct placed {
    size_t layer;
    size_t proj;
    size_t a_at;
    size_t b_at;
  };
  std::vector<placed> factors;
  size_t total = 0;
  for (size_t l = 0; l < peft.layers.size(); ++l) {
    for (size_t n = 0; n < projection_count; ++n) {
      auto& f = peft.layers[l][n];
      if (!f.a)
        continue;
      auto proj = static_cast<projection>(n);
      if (proj > projection::o && cfg_.sparse(static_cast<int64_t>(l)))
        throw error{errc::unsupported, "adapter '" + path + "' adapts " + module_name(proj) +
                                         " of layer " + std::to_string(l) +
                                         ", whose MLP is a mixture of experts: troupe " +
                                         "adapts the attention projections of such layers only"};
      auto sh = shard_of(proj);
      auto rank = f.a->shape[0];
      if (f.a->shape[1] != sh.in || f.b->shape[0] != sh.out)
        throw error{errc::invalid_argument,
                    "adapter '" + path + "': layer " + std::to_string(l) + " " + module_name(proj) +
                      " factors are " + shape_text(f.b->shape) + " x " + shape_text(f.a->shape) +
                      ", the model's weight is " + shape_text({sh.out, sh.in})};
      out.layers[l][n].rank = rank;
      auto a_cols = sh.by_rows ? sh.in : sh.count;
      auto b_rows = sh.by_rows ? sh.count : sh.out;
      auto a_at = pack(total, static_cast<size_t>(rank * a_cols) * sizeof(float));
      auto b_at = pack(total, static_cast<size_t>(b_rows * rank) * sizeof(float));
      factors.push_back({l, n, a_at, b_at});
    }
  }
  if (total == 0)
    return out;
  out.memory = device_buffer(dev_, total, memory_tag::weights);
  auto base = static_cast<char*>(out.memory.data());
  for (auto& at : factors) {
    auto& f = peft.layers[at.layer][at.proj];
    auto sh = shard_of(static_cast<projection>(at.proj));
    auto& dst = out.layers[at.layer][at.proj];
    auto rank = dst.rank;
    std::vector<float> a(static_cast<size_t>(rank * (sh.by_rows ? sh.in : sh.count)));
    std::vector<float> b(static_cast<size_t>((sh.by_rows ? sh.count : sh.out) * rank));
    if (sh.by_rows) {
      tensor_view reordered;
      read_rows(*f.a, 0, rank, a.data());
      read_rows(in_model_order(rotated(static_cast<projection>(at.proj)), *f.b, reordered),
                sh.start, sh.count, b.data());
    } else {
      read_cols(*f.a, 0, f.a->shape[0], sh.start, sh.count, a.data());
      read_rows(*f.b, 0, sh.out, b.data());
    }
    for (auto& value : b)
      value *= f.scaling;
    dst.a = reinterpret_cast<const float*>(base + at.a_at);
    dst.b = reinterpret_cast<const float*>(base + at.b_at);
    upload(base + at.a_at, a.data(), a.size(), dtype::f32);
    upload(base + at.b_at, b.data(), b.size(), dtype::f32);
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
  std::vector<float> table(static_cast<size_t>(t.numel()));
  read_rows(t, 0, t.shape[0], table.data());
  out.table = device_buffer(dev_, table.size() * sizeof(float), memory_tag::weights);
  upload(out.table.data(), table.data(), table.size(), dtype::f32);
  return out;
}

std::vector<char> llama_model::download(const local_tensor& t) const {
  size_t numel = 1;
  for (auto d : t.shape)
    numel *= static_cast<size_t>(d);
  std::vector<char> host(storage_bytes(t.type, numel));
  dev_.copy(host.data(), t.data, host.size());
  if (t.packed) {
    std::vector<char> stored(host.size());
    backend_->unpack(t.type, host.data(), stored.data(), t.shape[0], t.shape[1]);
    host.swap(stored);
  }
  if (!t.neighbour_pairs)
    return host;
  // Back in Hugging Face's order.
  const auto D = cfg_.head_dim;
  const auto rows = t.shape[0];
  const auto row = host.size() / static_cast<size_t>(rows);
  std::vector<char> hf(host.size());
  for (int64_t s = 0; s < rows; ++s) {
    auto to = halves_row(s, D);
    std::memcpy(hf.data() + static_cast<size_t>(to) * row,
                host.data() + static_cast<size_t>(s) * row, row);
  }
  return hf;
}

void llama_model::rope_tables(int32_t position, const std::vector<double>& freqs, float* cos,
                              float* sin) const {
  // YaRN and LongRoPE scale both (transformers' attention_scaling); the others by 1.
  using rope = rope_scaling_config::kind;
  const double scale =
    cfg_.rope_scaling.type == rope::yarn || cfg_.rope_scaling.type == rope::longrope
      ? cfg_.rope_scaling.attention_factor
      : 1.0;
  for (size_t i = 0; i < freqs.size(); ++i) {
    double angle = position * freqs[i];
    cos[i] = static_cast<float>(std::cos(angle) * scale);
    sin[i] = static_cast<float>(std::sin(angle) * scale);
  }
}

const std::vector<double>& llama_model::step_frequencies(int64_t length) {
  const auto& rs = cfg_.rope_scaling;
  if (rs.type == rope_scaling_config::kind::longrope &&
      length > rs.original_max_position_embeddings)
    return long_inv_freq_;
  if (rs.type != rope_scaling_config::kind::dynamic || length <= cfg_.max_position_embeddings)
    return inv_freq_;
  // Dynamic NTK for a step that reaches `length` positions: a larger base, as transformers
  // computes it for that step (the cache keeps the keys of earlier steps as they were).
  auto found = dynamic_freqs_.find(length);
  if (found != dynamic_freqs_.end())
    return found->second;
  if (dynamic_freqs_.size() >= 64)
    dynamic_freqs_.clear();
  const double dim = static_cast<double>(cfg_.rotated_dims());
  double theta = cfg_.rope_theta * std::pow(rs.factor * static_cast<double>(length) /
                                                static_cast<double>(cfg_.max_position_embeddings) -
                                              (rs.factor - 1),
                                            dim / (dim - 2));
  auto freqs = rotary_frequencies(theta);
  // A GGUF file's rope_freqs.weight divides these as it divides the base frequencies.
  for (size_t i = 0; i < freqs.size(); ++i)
    freqs[i] *= inv_freq_[i] / base_inv_freq_[i];
  return dynamic_freqs_.emplace(length, std::move(freqs)).first->second;
}

void llama_model::run(const execute_model_request& req, kv_cache& cache,
                      std::vector<sample_row>& rows, const step_adapters& adapters) {
  rows.clear();
  logits_ = nullptr;
  logit_rows_ = 0;
  auto batch = prepare_batch(req, cfg_, cache.block_size(), cache.device_blocks(), adapters);
  rows = batch.rows;
  forward(batch, cache);
}

llama_model::step_buffers llama_model::upload_step(const step_batch& batch, const kv_cache& cache) {
  const auto half = cfg_.rotated_dims() / 2;
  const auto bs = cache.block_size();
  auto& tokens = batch.tokens;
  auto& tables = batch.tables;
  const auto T = static_cast<int64_t>(tokens.size());
  const auto S = static_cast<int64_t>(batch.sample_tokens.size());
  const auto seqs = static_cast<int64_t>(tables.size());
  const auto max_blocks = batch.max_blocks();
  // The step's metadata, made on the host and copied to the device in two copies: token
  // ids, positions, cache slots, each token's sequence, the sequences' block tables and the
  // sampled rows (int32), and the rotary tables (float).
  auto parts = layout_of(T, S, seqs, max_blocks, batch.max_lora_rank);
  std::vector<int32_t> ints(static_cast<size_t>(parts.int_count));
  for (int64_t s = 0; s < seqs; ++s)
    std::copy(tables[s], tables[s] + batch.table_blocks[s], &ints[parts.tables + s * max_blocks]);
  const bool local = !local_inv_freq_.empty();
  std::vector<float> rope(static_cast<size_t>((local ? 4 : 2) * T * half));
  // Dynamic NTK scales with the positions a step reaches (as transformers' per-forward
  // update); LongRoPE with the sequence's whole known length, so that every chunk of a
  // prompt longer than the original length rotates as transformers' one forward does.
  auto step_length = cfg_.rope_scaling.type == rope_scaling_config::kind::longrope
                       ? batch.known_lengths
                       : batch.lengths();
  for (int64_t t = 0; t < T; ++t) {
    auto& tok = tokens[t];
    ints[parts.ids + t] = tok.id;
    ints[parts.positions + t] = tok.position;
    ints[parts.slots + t] = tables[tok.seq][tok.position / bs] * static_cast<int32_t>(bs) +
                            tok.position % static_cast<int32_t>(bs);
    ints[parts.token_seq + t] = tok.seq;
    rope_tables(tok.position, step_frequencies(step_length[static_cast<size_t>(tok.seq)]),
                &rope[t * half], &rope[(T + t) * half]);
    for (int64_t i = 0; local && i < half; ++i) {
      double angle = tok.position * local_inv_freq_[static_cast<size_t>(i)];
      rope[static_cast<size_t>((2 * T + t) * half + i)] = static_cast<float>(std::cos(angle));
      rope[static_cast<size_t>((3 * T + t) * half + i)] = static_cast<float>(std::sin(angle));
    }
  }
  std::copy(batch.sample_tokens.begin(), batch.sample_tokens.end(), &ints[parts.samples]);

  auto base = static_cast<float*>(workspace(static_cast<size_t>(parts.total) * sizeof(float)));
  dev_.copy(base + parts.ints, ints.data(), ints.size() * sizeof(int32_t));
  dev_.copy(base + parts.rope, rope.data(), rope.size() * sizeof(float));
  step_buffers b;
  b.tokens = T;
  b.samples = S;
  b.ints = reinterpret_cast<int32_t*>(base + parts.ints);
  b.cos = base + parts.rope;
  b.sin = b.cos + T * half;
  if (local) {
    b.local_cos = b.sin + T * half;
    b.local_sin = b.local_cos + T * half;
  }
  for (auto [buffer, offset] : {std::pair{&b.x, parts.x},
                                {&b.h, parts.h},
                                {&b.q, parts.q},
                                {&b.k, parts.k},
                                {&b.v, parts.v},
                                {&b.attn, parts.attn},
                                {&b.gate, parts.gate},
                                {&b.up, parts.up},
                                {&b.mid, parts.mid},
                                {&b.last, parts.last},
                                {&b.logits, parts.logits},
                                {&b.router, parts.router},
                                {&b.moe_in, parts.moe_in},
                                {&b.expert_x, parts.expert_x},
                                {&b.expert_gate, parts.expert_gate},
                                {&b.expert_up, parts.expert_up},
                                {&b.expert_out, parts.expert_out},
                                {&b.route_weights, parts.route_weights}})
    *buffer = base + offset;
  b.routes = reinterpret_cast<int32_t*>(base + parts.routes);
  b.layout.block_tables = b.ints + parts.tables;
  b.layout.max_blocks = max_blocks;
  b.layout.token_seq = b.ints + parts.token_seq;
  b.layout.positions = b.ints + parts.positions;
  b.layout.block_size = bs;
  b.layout.heads = local_heads_;
  b.layout.kv_heads = local_kv_;
  b.layout.head_dim = cfg_.head_dim;
  b.layout.head_begin = head_begin_;
  b.layout.group_size = cfg_.num_attention_heads / cfg_.num_key_value_heads;
  b.layout.kv_offset = kv_offset_;
  b.slots = b.ints + parts.slots;
  b.sample_rows = b.ints + parts.samples;
  sampling_ = reinterpret_cast<row_sampling*>(base + parts.sampling);
  sampled_ids_ = reinterpret_cast<int32_t*>(base + parts.sampled_ids);
  sampled_logprobs_ = base + parts.sampled_logprobs;
  sampled_ranks_ = reinterpret_cast<int32_t*>(base + parts.sampled_ranks);
  processed_ = base + parts.processed;
  masks_ = reinterpret_cast<uint32_t*>(base + parts.masks);
  return b;
}

void llama_model::reduce(float* data, int64_t count) {
  if (all_reduce_ && world_ > 1)
    all_reduce_(data, static_cast<size_t>(count));
}

void llama_model::apply_lora(const step_batch& batch, const step_buffers& b, size_t layer,
                             projection proj, const float* in, int64_t in_width, float* out,
                             int64_t out_width) {
  // y[T×out] += B·(A·x[T×in]) for the tokens of each run whose adapter adapts `proj`.
  for (auto& run : batch.lora_runs) {
    auto& f = run.weights->layers[layer][static_cast<size_t>(proj)];
    if (f.rank == 0)
      continue;
    backend_->gemm_nt(in + run.begin * in_width, f.a, dtype::f32, b.mid, run.count, f.rank,
                      in_width);
    backend_->gemm_nt(b.mid, f.b, dtype::f32, out + run.begin * out_width, run.count, out_width,
                      f.rank, true);
  }
}

void llama_model::attention(size_t li, const step_batch& batch, step_buffers& b, kv_cache& cache) {
  auto& be = *backend_;
  auto& l = layers_[li];
  const auto layer = static_cast<int64_t>(li);
  const auto T = b.tokens;
  const auto H = cfg_.hidden_size;
  const auto q_width = local_heads_ * cfg_.head_dim;
  const auto kv_width = local_kv_ * cfg_.head_dim;
  if (l.q.type == l.k.type && l.k.type == l.v.type) {
    be.gemm_nt_shared(b.h, l.q.type, T, H,
                      {l.q.into(b.q, q_width), l.k.into(b.k, kv_width), l.v.into(b.v, kv_width)});
  } else {
    be.gemm_nt_shared(b.h, l.q.type, T, H, {l.q.into(b.q, q_width)});
    be.gemm_nt_shared(b.h, l.k.type, T, H, {l.k.into(b.k, kv_width)});
    be.gemm_nt_shared(b.h, l.v.type, T, H, {l.v.into(b.v, kv_width)});
  }
  apply_lora(batch, b, li, projection::q, b.h, H, b.q, q_width);
  apply_lora(batch, b, li, projection::k, b.h, H, b.k, kv_width);
  apply_lora(batch, b, li, projection::v, b.h, H, b.v, kv_width);
  if (cfg_.attention_bias) {
    be.add_bias(b.q, l.q_bias.as<float>(), T, q_width);
    be.add_bias(b.k, l.k_bias.as<float>(), T, kv_width);
    be.add_bias(b.v, l.v_bias.as<float>(), T, kv_width);
  }
  if (cfg_.qk_norm) {
    // Each head on its own, as a row of head_dim.
    const auto eps = static_cast<float>(cfg_.rms_norm_eps);
    be.rms_norm(b.q, l.q_norm.as<float>(), b.q, T * local_heads_, cfg_.head_dim, eps);
    be.rms_norm(b.k, l.k_norm.as<float>(), b.k, T * local_kv_, cfg_.head_dim, eps);
  }
  b.layout.window = cfg_.window_of(layer);
  b.layout.softcap = static_cast<float>(cfg_.attn_logit_softcapping);
  // Gemma 3's sliding layers rotate with their own base.
  bool local = b.local_cos && b.layout.window > 0;
  be.rotary(b.q, local_heads_, b.k, local_kv_, T, cfg_.head_dim, cfg_.rotated_dims(),
            local ? b.local_cos : b.cos, local ? b.local_sin : b.sin,
            pairs_.value_or(rope_pairs::halves));
  be.write_kv(b.k, b.v, cache.keys(layer), cache.values(layer), b.slots, T, b.layout);
  const double scaled_by = cfg_.query_pre_attn_scalar > 0 ? cfg_.query_pre_attn_scalar
                                                          : static_cast<double>(cfg_.head_dim);
  const auto scale = static_cast<float>(1.0 / std::sqrt(scaled_by));
  be.paged_attention(b.q, b.attn, cache.keys(layer), cache.values(layer), b.layout, T, scale);
  be.gemm_nt_shared(b.attn, l.o.type, T, q_width, {l.o.into(b.h, H)});
  apply_lora(batch, b, li, projection::o, b.attn, q_width, b.h, H);
  reduce(b.h, T * H);
  if (cfg_.o_proj_bias)
    be.add_bias(b.h, l.o_bias.as<float>(), T, H);
}

void llama_model::gate_up(const float* x, int64_t rows, const tensor_slot& gate,
                          const tensor_slot& up, float* gate_out, float* up_out, int64_t width) {
  auto& be = *backend_;
  const auto H = cfg_.hidden_size;
  if (gate.type == up.type) {
    be.gemm_nt_shared(x, gate.type, rows, H, {gate.into(gate_out, width), up.into(up_out, width)});
  } else {
    be.gemm_nt_shared(x, gate.type, rows, H, {gate.into(gate_out, width)});
    be.gemm_nt_shared(x, up.type, rows, H, {up.into(up_out, width)});
  }
}

void llama_model::experts(size_t li, const step_buffers& b) {
  auto& be = *backend_;
  auto& l = layers_[li];
  const auto T = b.tokens;
  const auto H = cfg_.hidden_size;
  const auto E = cfg_.num_experts;
  const auto K = cfg_.num_experts_per_tok;
  const auto I = local_moe_inter_;
  // Which experts run depends on the router's logits: they come to the host (a step with
  // experts is never replayed as a graph).
  be.gemm_nt_shared(b.h, l.router.type, T, H, {l.router.into(b.router, E)});
  std::vector<float> logits(static_cast<size_t>(T * E));
  dev_.copy(logits.data(), b.router, logits.size() * sizeof(float));
  // Each token's top K of the softmax (float32, as transformers computes it), renormalized
  // where the model does; then each local expert's tokens and weights, in token order.
  std::vector<std::vector<std::pair<int32_t, float>>> taken(static_cast<size_t>(local_experts_));
  std::vector<float> probs(static_cast<size_t>(E));
  std::vector<int64_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* row = &logits[static_cast<size_t>(t * E)];
    float top = *std::max_element(row, row + E);
    float sum = 0;
    for (int64_t e = 0; e < E; ++e)
      sum += probs[static_cast<size_t>(e)] = std::exp(row[e] - top);
    for (auto& p : probs)
      p /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int64_t a, int64_t c) {
      auto pa = probs[static_cast<size_t>(a)], pc = probs[static_cast<size_t>(c)];
      return pa > pc || (pa == pc && a < c);
    });
    float chosen = 0;
    for (int64_t k = 0; k < K; ++k)
      chosen += probs[static_cast<size_t>(order[static_cast<size_t>(k)])];
    for (int64_t k = 0; k < K; ++k) {
      auto e = order[static_cast<size_t>(k)];
      auto w = probs[static_cast<size_t>(e)];
      if (cfg_.norm_topk_prob)
        w /= chosen;
      if (e >= expert_begin_ && e < expert_begin_ + local_experts_)
        taken[static_cast<size_t>(e - expert_begin_)].emplace_back(static_cast<int32_t>(t), w);
    }
  }
  std::vector<int32_t> rows;
  std::vector<float> weights;
  for (auto& list : taken)
    for (auto& [t, w] : list) {
      rows.push_back(t);
      weights.push_back(w);
    }
  routed_tokens_ += static_cast<int64_t>(rows.size());
  if (!rows.empty()) {
    dev_.copy(b.routes, rows.data(), rows.size() * sizeof(int32_t));
    dev_.copy(b.route_weights, weights.data(), weights.size() * sizeof(float));
  }
  dev_.copy(b.moe_in, b.h, static_cast<size_t>(T * H) * sizeof(float));
  be.zero(b.h, T * H);
  int64_t at = 0;
  for (size_t e = 0; e < taken.size(); ++e) {
    auto n = static_cast<int64_t>(taken[e].size());
    if (n == 0)
      continue;
    auto& x = l.experts[e];
    be.gather_rows(b.routes + at, b.moe_in, dtype::f32, b.expert_x, n, H);
    gate_up(b.expert_x, n, x.gate, x.up, b.expert_gate, b.expert_up, I);
    be.silu_mul(b.expert_gate, b.expert_up, b.expert_gate, n * I);
    be.gemm_nt_shared(b.expert_gate, x.down.type, n, I, {x.down.into(b.expert_out, H)});
    be.scatter_add_rows(b.expert_out, b.routes + at, b.route_weights + at, b.h, n, H);
    at += n;
  }
  reduce(b.h, T * H);
}

void llama_model::mlp(size_t li, const step_batch& batch, const step_buffers& b) {
  if (cfg_.sparse(static_cast<int64_t>(li)))
    return experts(li, b);
  auto& be = *backend_;
  auto& l = layers_[li];
  const auto T = b.tokens;
  const auto H = cfg_.hidden_size;
  gate_up(b.h, T, l.gate, l.up, b.gate, b.up, local_inter_);
  apply_lora(batch, b, li, projection::gate, b.h, H, b.gate, local_inter_);
  apply_lora(batch, b, li, projection::up, b.h, H, b.up, local_inter_);
  if (cfg_.mlp_bias) {
    be.add_bias(b.gate, l.gate_bias.as<float>(), T, local_inter_);
    be.add_bias(b.up, l.up_bias.as<float>(), T, local_inter_);
  }
  if (cfg_.hidden_act == "silu")
    be.silu_mul(b.gate, b.up, b.gate, T * local_inter_);
  else
    be.gelu_tanh_mul(b.gate, b.up, b.gate, T * local_inter_);
  be.gemm_nt_shared(b.gate, l.down.type, T, local_inter_, {l.down.into(b.h, H)});
  apply_lora(batch, b, li, projection::down, b.gate, local_inter_, b.h, H);
  reduce(b.h, T * H);
  if (cfg_.mlp_bias)
    be.add_bias(b.h, l.down_bias.as<float>(), T, H);
}

void llama_model::output_head(const step_buffers& b) {
  auto& be = *backend_;
  const auto H = cfg_.hidden_size;
  const auto V = cfg_.vocab_size;
  const auto S = b.samples;
  const auto eps = static_cast<float>(cfg_.rms_norm_eps);
  be.gather_rows(b.sample_rows, b.x, dtype::f32, b.last, S, H);
  be.rms_norm(b.last, final_norm_.as<float>(), b.h, S, H, eps);
  auto& head = cfg_.tie_word_embeddings ? embed_ : lm_head_;
  const auto cap = static_cast<float>(cfg_.final_logit_softcapping);
  if (world_ == 1) {
    be.gemm_nt_shared(b.h, head.type, S, H, {head.into(b.logits, V)});
    if (cap > 0)
      be.soft_cap(b.logits, cap, S * V);
    return;
  }
  // The head split by vocabulary, as vLLM's: each rank writes its share of every row into
  // zeros, and the sum over the ranks gives each rank the logits (every entry from one
  // rank, so the values one rank alone computes).
  be.zero(b.logits, S * V);
  auto rows = static_cast<const char*>(head.data()) +
              storage_bytes(head.type, static_cast<size_t>(vocab_begin_ * H));
  be.gemm_nt_shared(b.h, head.type, S, H,
                    {backend::gemm_output{rows, b.logits + vocab_begin_, local_vocab_, false, V}});
  reduce(b.logits, S * V);
  if (cap > 0)
    be.soft_cap(b.logits, cap, S * V);
}

void llama_model::forward(const step_batch& batch, kv_cache& cache) {
  logits_ = nullptr;
  logit_rows_ = 0;
  routed_tokens_ = 0;
  if (batch.tokens.empty())
    return;
  auto b = upload_step(batch, cache);
  const auto T = b.tokens;
  const auto H = cfg_.hidden_size;
  const auto eps = static_cast<float>(cfg_.rms_norm_eps);
  auto& be = *backend_;
  auto& adapters = batch.adapters;

  // The step's device work: embeddings, the layers, the head.
  auto compute = [&] {
    if (embed_.packed)
      be.gather_packed_rows(b.ints, embed_.data(), embed_.type, b.x, T, H);
    else
      be.gather_rows(b.ints, embed_.data(), embed_.type, b.x, T, H);
    // A prompt adapter's virtual tokens take the first positions of the prompt.
    if (!adapters.prompt.empty())
      for (int64_t t = 0; t < T; ++t) {
        auto& tok = batch.tokens[static_cast<size_t>(t)];
        auto* virtual_tokens = adapters.prompt[tok.group];
        if (virtual_tokens && tok.position < virtual_tokens->num_virtual_tokens)
          dev_.copy(b.x + t * H, virtual_tokens->table.as<float>() + tok.position * H,
                    static_cast<size_t>(H) * sizeof(float));
      }
    // Gemma's embeddings are scaled, by √hidden rounded to float as transformers does.
    if (cfg_.scale_embeddings)
      be.scale(b.x, static_cast<float>(std::sqrt(static_cast<double>(H))), T * H);
    // The residual adds are fused with the norm that follows them: the input norm of the
    // next layer, or the post-attention norm.
    be.rms_norm(b.x, layers_.front().input_norm.as<float>(), b.h, T, H, eps);
    for (size_t li = 0; li < layers_.size(); ++li) {
      auto& l = layers_[li];
      attention(li, batch, b, cache);
      if (cfg_.sandwich_norms)
        be.rms_norm(b.h, l.attn_out_norm.as<float>(), b.h, T, H, eps);
      be.add_rms_norm(b.x, b.h, l.post_norm.as<float>(), b.h, T, H, eps);
      mlp(li, batch, b);
      if (cfg_.sandwich_norms)
        be.rms_norm(b.h, l.mlp_out_norm.as<float>(), b.h, T, H, eps);
      if (li + 1 < layers_.size())
        be.add_rms_norm(b.x, b.h, layers_[li + 1].input_norm.as<float>(), b.h, T, H, eps);
      else
        be.add(b.x, b.h, T * H);
    }
    output_head(b);
  };

  // A decode step of one process is recorded once per shape and then replayed; steps with
  // adapters, all-reduces, prompts or experts (routed on the host) run call by call.
  bool replayable = graphs_.enabled() && world_ == 1 && batch.decode_only &&
                    cfg_.num_experts == 0 && T <= step_graphs::max_tokens &&
                    batch.lora_runs.empty() && adapters.prompt.empty();
  if (replayable)
    graphs_.run(be,
                {T, b.samples, static_cast<int64_t>(batch.tables.size()), b.layout.max_blocks,
                 cache.keys(0), cache.device_blocks(), cache.block_size(),
                 backend_->scratch_epoch()},
                compute);
  else
    compute();
  logits_ = b.logits;
  logit_rows_ = b.samples;
}

std::vector<float> llama_model::logits() const {
  std::vector<float> out(static_cast<size_t>(logit_rows_ * cfg_.vocab_size));
  if (!out.empty())
    dev_.copy(out.data(), logits_, out.size() * sizeof(float));
  return out;
}

void llama_model::sample(const std::vector<row_sampling>& params, std::vector<int32_t>& ids,
                         std::vector<float>& logprobs, std::vector<int32_t>& ranks,
                         const std::vector<logit_edit>& edits, const std::vector<uint32_t>& masks) {
  auto rows = static_cast<int64_t>(params.size());
  if (rows != logit_rows_)
    throw error{errc::invalid_argument, "sample: " + std::to_string(params.size()) +
                                          " rows of parameters for " + std::to_string(logit_rows_) +
                                          " rows of logits"};
  const auto vocab = cfg_.vocab_size;
  bool edited = false, masked = false;
  for (auto& p : params) {
    edited = edited || p.edited != 0;
    masked = masked || p.masked != 0;
  }
  if ((masked || !masks.empty()) && static_cast<int64_t>(masks.size()) != rows * mask_words())
    throw error{errc::invalid_argument, "sample: " + std::to_string(masks.size()) +
                                          " mask words for " + std::to_string(rows) + " rows of " +
                                          std::to_string(mask_words())};
  for (size_t i = 0; i < edits.size(); ++i) {
    auto& e = edits[i];
    bool in_order = i == 0 || e.row > edits[i - 1].row ||
                    (e.row == edits[i - 1].row && e.token > edits[i - 1].token);
    if (e.row < 0 || e.row >= rows || params[static_cast<size_t>(e.row)].edited == 0 ||
        e.token < 0 || e.token >= vocab || !in_order)
      throw error{errc::invalid_argument,
                  "sample: edit " + std::to_string(i) + " (row " + std::to_string(e.row) +
                    ", token " + std::to_string(e.token) +
                    ") is outside the edited rows or the vocabulary, or not after the edit "
                    "before it (rows in order, a row's tokens rising)"};
  }
  ids.resize(params.size());
  logprobs.resize(params.size());
  ranks.resize(params.size());
  if (params.empty())
    return;
  dev_.copy(sampling_, params.data(), params.size() * sizeof(row_sampling));
  if (edited) {
    // Grown by doubling: penalties add an edit with most new tokens.
    auto bytes = edits.size() * sizeof(logit_edit);
    if (edits_.size() < bytes) {
      auto grown = std::max({bytes, 2 * edits_.size(), size_t{64} << 10});
      edits_.reset();
      edits_ = device_buffer(dev_, grown, memory_tag::kv_cache);
    }
    if (bytes > 0)
      dev_.copy(edits_.data(), edits.data(), bytes);
    if (!masks.empty())
      dev_.copy(masks_, masks.data(), masks.size() * sizeof(uint32_t));
    backend_->edit_logits(logits_, processed_, rows, vocab, sampling_,
                          static_cast<const logit_edit*>(edits_.data()),
                          static_cast<int64_t>(edits.size()), masks_, mask_words());
  }
  backend_->sample(logits_, processed_, logit_rows_, vocab, sampling_, sampled_ids_,
                   sampled_logprobs_, sampled_ranks_);
  dev_.copy(ids.data(), sampled_ids_, ids.size() * sizeof(int32_t));
  dev_.copy(logprobs.data(), sampled_logprobs_, logprobs.size() * sizeof(float));
  dev_.copy(ranks.data(), sampled_ranks_, ranks.size() * sizeof(int32_t));
}

std::vector<float> llama_model::prompt_logits(const std::vector<int32_t>& tokens, kv_cache& cache) {
  logits_ = nullptr;
  logit_rows_ = 0;
  auto blocks = (static_cast<int64_t>(tokens.size()) + cache.block_size() - 1) / cache.block_size();
  sequence_data seq;
  seq.token_ids = tokens;
  seq.num_prompt_tokens = static_cast<int32_t>(tokens.size());
  for (int64_t b = 0; b < blocks; ++b)
    seq.block_table.push_back(static_cast<int32_t>(b));
  sequence_group_metadata group;
  group.request_id = "prompt_logits";
  group.seqs.push_back(std::move(seq));
  group.token_chunk_size = static_cast<int32_t>(tokens.size());
  execute_model_request req;
  req.seq_group_metadata_list.push_back(std::move(group));
  auto batch = prepare_batch(req, cfg_, cache.block_size(), cache.device_blocks());
  // Every token's row, not only the last one's.
  batch.sample_tokens.resize(batch.tokens.size());
  std::iota(batch.sample_tokens.begin(), batch.sample_tokens.end(), 0);
  batch.rows.assign(batch.tokens.size(), sample_row{0, 0});
  forward(batch, cache);
  return logits();
}

std::vector<float> llama_model::run_logits(const execute_model_request& req, kv_cache& cache,
                                           std::vector<sample_row>& rows,
                                           const step_adapters& adapters) {
  run(req, cache, rows, adapters);
  return logits();
}

weight_format weight_format_for(const device& dev, const std::string& dtype_name,
                                const std::string& torch_dtype) {
  if (dtype_name != "auto")
    return {*parse_dtype_name(dtype_name), false};
  auto chosen = platform_of(dev).auto_weight_type(torch_dtype);
  return {chosen.value_or(dtype::f32), !chosen};
}

} // namespace troupe
