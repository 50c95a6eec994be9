#include "kernels/cpu/cpu_backend.hpp"

#include "kernels/cpu/ops.hpp"
#include "kernels/cpu/quant.hpp"
#include "kernels/cpu/quant_int8.hpp"
#include "kernels/cpu/thread_pool.hpp"
#include "kernels/sampler.hpp"
#include "troupe/errors.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

namespace troupe {

namespace {

class cpu_backend final : public backend {
public:
  cpu_backend(int threads, bool int8_activations)
    : pool_(std::max(1, threads)), isa_(cpu::best_isa()), int8_(int8_activations) {}

  /// Every type: float32 through OpenBLAS, the rest with the kernels of quant.hpp.
  bool computes_in(dtype) const override {
    return true;
  }

  /// On the fast path, the block formats of the integer GEMM, BF16 and F16 in groups of 16
  /// rows (quant_int8.hpp).
  bool packs(dtype t, int64_t rows, int64_t cols) const override {
    return int8_ && cpu::packs(t, rows, cols);
  }

  int64_t pack_group() const override {
    return cpu::packed_rows;
  }

  void pack(dtype t, const void* src, void* dst, int64_t rows, int64_t cols) override {
    if (!packs(t, rows, cols))
      throw error{errc::unsupported, "no packed layout for " + std::to_string(rows) + " x " +
                                       std::to_string(cols) + " " + dtype_name(t)};
    // Group by group over the threads: writing the packed copy faults its pages in.
    const auto group_bytes = storage_bytes(t, static_cast<size_t>(cpu::packed_rows * cols));
    const int64_t groups = rows / cpu::packed_rows;
    const int64_t per_part = std::max<int64_t>(1, groups / (4 * pool_.size()));
    pool_.run((groups + per_part - 1) / per_part, [&](int64_t part) {
      auto first = part * per_part;
      auto count = std::min(per_part, groups - first);
      auto offset = static_cast<size_t>(first) * group_bytes;
      cpu::pack_rows(t, static_cast<const char*>(src) + offset, static_cast<char*>(dst) + offset,
                     count * cpu::packed_rows, cols);
    });
  }

  void unpack(dtype t, const void* src, void* dst, int64_t rows, int64_t cols) const override {
    cpu::unpack_rows(t, src, dst, rows, cols);
  }

  void gemm_nt_shared(const float* x, dtype w_type, int64_t m, int64_t k,
                      std::initializer_list<gemm_output> outputs) override {
    if (w_type == dtype::f32) {
      for (auto& o : outputs)
        cpu::gemm_nt(x, static_cast<const float*>(o.w), o.y, m, o.n, k, o.accumulate,
                     o.row_stride());
      return;
    }
    bool quantized = is_quantized(w_type);
    auto packed = [](const gemm_output& o) { return o.packed; };
    bool any_packed = std::any_of(outputs.begin(), outputs.end(), packed);
    bool all_packed = std::all_of(outputs.begin(), outputs.end(), packed);
    // Integer row kernels where there are; packed block formats need the rounded
    // activations too (Q4_1 has only the packed kernel), the float kernels their sums.
    bool integer = quantized && int8_ && cpu::has_int8_kernel(w_type);
    bool rounded = integer || (quantized && any_packed);
    bool float_sums = quantized && !integer && !all_packed;
    bool packed_bf16 = w_type == dtype::bf16 && any_packed;
    bool packed_f16 = w_type == dtype::f16 && any_packed;
    auto layout = cpu::bf16_layout_for(m, k);
    if (packed_bf16) {
      xb_.resize(cpu::bf16_elements(layout, m, k));
      cpu::to_bf16(x, m, k, layout, xb_.data());
    }
    if (quantized) {
      if (k % block_elements(w_type) != 0)
        throw error{errc::unsupported, std::string{dtype_name(w_type)} +
                                         " weights need rows "
                                         "of whole blocks of " +
                                         std::to_string(block_elements(w_type)) + ", not " +
                                         std::to_string(k)};
      // The activations rounded to integers, or their block sums: once for every output.
      if (rounded)
        xq_.quantize(x, m, k, cpu::int8_block(w_type));
      if (float_sums) {
        xsums_.resize(static_cast<size_t>(m * (k / 32)));
        cpu::block_sums(x, m, k, xsums_.data());
      }
    }
    // The outputs' rows are cut into parts, all spread over the threads in one go.
    const gemm_output* outs = outputs.begin();
    const int64_t wanted = 4 * pool_.size();
    int64_t total = 0;
    for (auto& o : outputs)
      total += o.n;
    // Whole groups of packed rows (16), pairs of them where parts are larger (the 16-bit
    // kernels take two groups at a time); as many rows for the others.
    const int64_t even = (total + wanted - 1) / wanted;
    const int64_t rows_per_part = even <= 16 ? 16 : (even + 31) / 32 * 32;
    starts_.clear();
    int64_t parts = 0;
    for (auto& o : outputs) {
      starts_.push_back(parts);
      parts += (o.n + rows_per_part - 1) / rows_per_part;
    }
    starts_.push_back(parts);
    pool_.run(parts, [&](int64_t p) {
      size_t which = 0;
      while (starts_[which + 1] <= p)
        ++which;
      auto& o = outs[which];
      int64_t begin = (p - starts_[which]) * rows_per_part;
      int64_t end = std::min(o.n, begin + rows_per_part);
      if (o.packed && packed_bf16)
        cpu::dot_packed_bf16(o.w, xb_.data(), layout, m, k, o.y, o.row_stride(), begin, end,
                             o.accumulate);
      else if (o.packed && packed_f16)
        cpu::dot_packed_f16(o.w, x, m, k, o.y, o.row_stride(), begin, end, o.accumulate);
      else if (o.packed)
        cpu::dot_packed_int8(w_type, o.w, xq_, o.y, o.row_stride(), begin, end, o.accumulate);
      else if (integer)
        cpu::dot_rows_int8(w_type, o.w, xq_, o.y, o.row_stride(), begin, end, o.accumulate);
      else if (quantized)
        cpu::dot_rows_quantized(isa_, w_type, o.w, x, xsums_.data(), m, k, o.y, o.row_stride(),
                                begin, end, o.accumulate);
      else
        cpu::dot_rows_half(isa_, w_type, o.w, x, m, k, o.y, o.row_stride(), begin, end,
                           o.accumulate);
    });
  }

  void zero(float* y, int64_t n) override {
    std::fill(y, y + n, 0.0f);
  }

  void rms_norm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim,
                float eps) override {
    cpu::rms_norm(x, weight, y, rows, dim, eps);
  }

  void add_bias(float* y, const float* bias, int64_t m, int64_t n) override {
    cpu::add_bias(y, bias, m, n);
  }

  void add(float* y, const float* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i)
      y[i] += x[i];
  }

  void add_rms_norm(float* x, const float* h, const float* weight, float* y, int64_t rows,
                    int64_t dim, float eps) override {
    add(x, h, rows * dim);
    cpu::rms_norm(x, weight, y, rows, dim, eps);
  }

  /// Both: a GGUF llama file's q and k are used as stored, in neighbouring pairs.
  bool rotates(rope_pairs) const override {
    return true;
  }

  void rotary(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t rows, int64_t head_dim,
              int64_t rotary_dim, const float* cos, const float* sin, rope_pairs pairs) override {
    auto rotate = pairs == rope_pairs::neighbours ? cpu::rotary_neighbours : cpu::rotary;
    auto half = rotary_dim / 2;
    for (int64_t r = 0; r < rows; ++r) {
      rotate(q + r * q_heads * head_dim, q_heads, head_dim, rotary_dim, cos + r * half,
             sin + r * half);
      rotate(k + r * k_heads * head_dim, k_heads, head_dim, rotary_dim, cos + r * half,
             sin + r * half);
    }
  }

  void silu_mul(const float* gate, const float* up, float* out, int64_t n) override {
    // Split over the threads: a batch's MLP is wide.
    const int64_t chunk = 4096;
    pool_.run((n + chunk - 1) / chunk, [&](int64_t part) {
      auto begin = part * chunk;
      cpu::silu_mul(isa_, gate + begin, up + begin, out + begin, std::min(chunk, n - begin));
    });
  }

  void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) override {
    const int64_t chunk = 4096;
    pool_.run((n + chunk - 1) / chunk, [&](int64_t part) {
      auto begin = part * chunk;
      cpu::gelu_tanh_mul(gate + begin, up + begin, out + begin, std::min(chunk, n - begin));
    });
  }

  void scale(float* y, float factor, int64_t n) override {
    for (int64_t i = 0; i < n; ++i)
      y[i] *= factor;
  }

  void soft_cap(float* y, float cap, int64_t n) override {
    for (int64_t i = 0; i < n; ++i)
      y[i] = cpu::soft_capped(y[i], cap);
  }

  void gather_rows(const int32_t* ids, const void* table, dtype table_type, float* out,
                   int64_t rows, int64_t dim) override {
    auto bytes = storage_bytes(table_type, static_cast<size_t>(dim));
    for (int64_t r = 0; r < rows; ++r)
      to_float(table_type, static_cast<const char*>(table) + static_cast<size_t>(ids[r]) * bytes,
               out + r * dim, static_cast<size_t>(dim));
  }

  void scatter_add_rows(const float* x, const int32_t* rows, const float* weights, float* y,
                        int64_t n, int64_t dim) override {
    for (int64_t r = 0; r < n; ++r) {
      auto* out = y + static_cast<int64_t>(rows[r]) * dim;
      const auto* in = x + r * dim;
      const float w = weights[r];
      for (int64_t i = 0; i < dim; ++i)
        out[i] += w * in[i];
    }
  }

  void gather_packed_rows(const int32_t* ids, const void* table, dtype table_type, float* out,
                          int64_t rows, int64_t dim) override {
    std::vector<char> row(storage_bytes(table_type, static_cast<size_t>(dim)));
    for (int64_t r = 0; r < rows; ++r) {
      cpu::unpack_row(table_type, table, ids[r], dim, row.data());
      to_float(table_type, row.data(), out + r * dim, static_cast<size_t>(dim));
    }
  }

  // A block holds each KV head's slots together ([kv_heads, block_size, head_dim]), so that
  // attention reads one head's keys and values in runs of block_size · head_dim floats: a
  // row of every head between a head's positions is a stride the hardware's prefetchers do
  // not follow.
  void write_kv(const float* k, const float* v, float* k_cache, float* v_cache,
                const int32_t* slots, int64_t tokens, const paged_layout& l) override {
    const auto row = l.kv_heads * l.head_dim;
    const auto bytes = static_cast<size_t>(l.head_dim) * sizeof(float);
    for (int64_t t = 0; t < tokens; ++t) {
      auto block = slots[t] / l.block_size;
      auto at = block * l.block_size * row + slots[t] % l.block_size * l.head_dim;
      for (int64_t h = 0; h < l.kv_heads; ++h) {
        auto dst = at + h * l.block_size * l.head_dim;
        std::memcpy(k_cache + dst, k + t * row + h * l.head_dim, bytes);
        std::memcpy(v_cache + dst, v + t * row + h * l.head_dim, bytes);
      }
    }
  }

  void paged_attention(const float* q, float* out, const float* k_cache, const float* v_cache,
                       const paged_layout& l, int64_t tokens, float scale) override {
    const auto row = l.kv_heads * l.head_dim;
    // Tiles: up to `tile_tokens` consecutive tokens of one sequence (a prefill's) attend
    // together, each key and value read once for them all; a decode step's tokens alone.
    tiles_.clear();
    for (int64_t t = 0; t < tokens; ++t) {
      if (!tiles_.empty()) {
        auto& last = tiles_.back();
        auto prev = last.first + last.tokens - 1;
        if (last.tokens < tile_tokens && l.token_seq[t] == l.token_seq[prev] &&
            l.positions[t] == l.positions[prev] + 1) {
          ++last.tokens;
          continue;
        }
      }
      tiles_.push_back({t, 1});
    }
    const auto tiles = static_cast<int64_t>(tiles_.size());
    // Query heads that share a KV head attend together, so that each key and value is read
    // once for them all: whole groups, unless there are fewer tiles × groups than threads
    // (then groups are cut so that every thread has a part). A cut group reads its keys
    // and values once a run: at batch 1 SmolLM2's 3 groups cut in runs of 2 + 1 heads read
    // the cache twice, slower than two threads taking 2 + 1 whole groups.
    const auto pool = static_cast<int64_t>(pool_.size());
    const auto groups = (l.heads + l.group_size - 1) / l.group_size;
    const auto run_heads =
      tiles * groups >= pool
        ? l.group_size
        : std::max<int64_t>(1, std::min(l.group_size, (tiles * l.heads + pool - 1) / pool));
    runs_.clear();
    for (int64_t h = 0; h < l.heads; ++h) {
      auto kv_head = (l.head_begin + h) / l.group_size - l.kv_offset;
      if (runs_.empty() || runs_.back().kv_head != kv_head || runs_.back().heads == run_heads)
        runs_.push_back({h, 0, kv_head});
      ++runs_.back().heads;
    }
    const auto runs = static_cast<int64_t>(runs_.size());
    auto first_of = [&](int64_t t) {
      const int64_t end = l.positions[t] + int64_t{1};
      return l.window > 0 ? std::max<int64_t>(0, end - l.window) : 0;
    };
    // One part per (tile, run), spread over the worker's threads.
    pool_.run(tiles * runs, [&](int64_t part) {
      auto& tile = tiles_[static_cast<size_t>(part / runs)];
      auto& run = runs_[static_cast<size_t>(part % runs)];
      const auto t0 = tile.first;
      const int32_t* table = l.block_tables + l.token_seq[t0] * l.max_blocks;
      const auto lo = first_of(t0);
      const auto hi = l.positions[t0 + tile.tokens - 1] + int64_t{1};
      thread_local std::vector<int64_t> offsets, first, end;
      offsets.resize(static_cast<size_t>(hi - lo));
      // write_kv's layout.
      auto head_at = run.kv_head * l.block_size * l.head_dim;
      for (int64_t p = lo; p < hi; ++p)
        offsets[static_cast<size_t>(p - lo)] =
          int64_t{table[p / l.block_size]} * l.block_size * row + head_at +
          p % l.block_size * l.head_dim;
      auto offset = (t0 * l.heads + run.first) * l.head_dim;
      first.clear();
      end.clear();
      for (int64_t t = t0; t < t0 + tile.tokens; ++t) {
        first.push_back(first_of(t) - lo);
        end.push_back(l.positions[t] + 1 - lo);
      }
      cpu::attend_tokens(isa_, q + offset, l.heads * l.head_dim, l.head_dim, run.heads, tile.tokens,
                         first.data(), end.data(), hi - lo, scale, k_cache, v_cache, offsets.data(),
                         out + offset, l.softcap);
    });
  }

  void edit_logits(const float* logits, float* processed, int64_t rows, int64_t cols,
                   const row_sampling* params, const logit_edit* edits, int64_t num_edits,
                   const uint32_t* masks, int64_t mask_words) override {
    auto edits_of = [&](int64_t r) {
      return std::lower_bound(edits, edits + num_edits, r,
                              [](const logit_edit& e, int64_t row) { return e.row < row; });
    };
    pool_.run(rows, [&](int64_t r) {
      auto& p = params[r];
      if (p.edited == 0)
        return;
      auto first = edits_of(r);
      edit_row(logits + r * cols, processed + r * cols, cols,
               p.masked != 0 ? masks + r * mask_words : nullptr, first,
               static_cast<size_t>(edits_of(r + 1) - first));
    });
  }

  void sample(const float* logits, const float* processed, int64_t rows, int64_t cols,
              const row_sampling* params, int32_t* ids, float* logprobs, int32_t* ranks) override {
    // A row each: a batch's rows are independent (each draws with its own uniform).
    pool_.run(rows, [&](int64_t r) {
      const float* raw = logits + r * cols;
      auto& p = params[r];
      const float* row = p.edited != 0 ? processed + r * cols : raw;
      auto chosen = p.temperature < row_sampling::greedy_below
                      ? std::max_element(row, row + cols) - row // the first of equal maxima
                      : choose_token(row, cols, p.temperature, p.top_k, p.top_p, p.u, p.min_p);
      ids[r] = static_cast<int32_t>(chosen);
      // As sample_token reports it, on the vector unit.
      logprobs[r] = raw[chosen] - cpu::log_partition(isa_, raw, cols);
      ranks[r] = rank_of(raw, cols, chosen);
    });
  }

private:
  cpu::thread_pool pool_;
  cpu::isa isa_;
  bool int8_;
  std::vector<float> xsums_;
  cpu::int8_rows xq_;
  std::vector<uint16_t> xb_;
  /// The first part of each output of a gemm_nt_shared call, and the end.
  std::vector<int64_t> starts_;
  /// Consecutive query heads that read one KV head, as paged_attention takes them.
  struct head_run {
    int64_t first;
    int64_t heads;
    int64_t kv_head;
  };
  std::vector<head_run> runs_;
  /// Consecutive query tokens of one sequence, as paged_attention takes them.
  struct token_tile {
    int64_t first;
    int64_t tokens;
  };
  static constexpr int64_t tile_tokens = 16;
  std::vector<token_tile> tiles_;
};

} // namespace

std::unique_ptr<backend> make_cpu_backend(int threads, bool int8_activations) {
  return std::make_unique<cpu_backend>(threads, int8_activations);
}

} // namespace troupe
