#include "kernels/cpu/cpu_backend.hpp"

#include "kernels/cpu/ops.hpp"
#include "model/sampler.hpp"
#include "troupe/errors.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

namespace troupe {

namespace {

class cpu_backend final : public backend {
public:
  bool computes_in(dtype t) const override {
    return t == dtype::f32;
  }

  void gemm_nt_shared(const float* x, dtype w_type, int64_t m, int64_t k,
                      std::initializer_list<gemm_output> outputs) override {
    if (w_type != dtype::f32)
      throw error{errc::unsupported,
                  std::string{"the CPU device computes with float32 weights, not "}
                    + dtype_name(w_type)};
    for (auto& o : outputs)
      cpu::gemm_nt(x, static_cast<const float*>(o.w), o.y, m, o.n, k, o.accumulate);
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

  void rotary(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t rows,
              int64_t head_dim, const float* cos, const float* sin) override {
    auto half = head_dim / 2;
    for (int64_t r = 0; r < rows; ++r) {
      cpu::rotary(q + r * q_heads * head_dim, q_heads, head_dim, cos + r * half, sin + r * half);
      cpu::rotary(k + r * k_heads * head_dim, k_heads, head_dim, cos + r * half, sin + r * half);
    }
  }

  void silu_mul(const float* gate, const float* up, float* out, int64_t n) override {
    cpu::silu_mul(gate, up, out, n);
  }

  void gather_rows(const int32_t* ids, const void* table, dtype table_type, float* out,
                   int64_t rows, int64_t dim) override {
    auto bytes = static_cast<size_t>(dim) * element_size(table_type);
    for (int64_t r = 0; r < rows; ++r)
      to_float(table_type, static_cast<const char*>(table) + static_cast<size_t>(ids[r]) * bytes,
               out + r * dim, static_cast<size_t>(dim));
  }

  void write_kv(const float* k, const float* v, float* k_cache, float* v_cache,
                const int32_t* slots, int64_t tokens, int64_t row) override {
    auto bytes = static_cast<size_t>(row) * sizeof(float);
    for (int64_t t = 0; t < tokens; ++t) {
      std::memcpy(k_cache + slots[t] * row, k + t * row, bytes);
      std::memcpy(v_cache + slots[t] * row, v + t * row, bytes);
    }
  }

  void paged_attention(const float* q, float* out, const float* k_cache, const float* v_cache,
                       const paged_layout& l, int64_t tokens, float scale) override {
    const auto row = l.kv_heads * l.head_dim;
    for (int64_t t = 0; t < tokens; ++t) {
      const int32_t* table = l.block_tables + l.token_seq[t] * l.max_blocks;
      scores_.resize(static_cast<size_t>(l.positions[t]) + 1);
      auto slot = [&](int64_t p) {
        return table[p / l.block_size] * l.block_size + p % l.block_size;
      };
      for (int64_t head = 0; head < l.heads; ++head) {
        auto kv_head = (l.head_begin + head) / l.group_size - l.kv_offset;
        auto at = [&](const float* cache, int64_t p) {
          return cache + slot(p) * row + kv_head * l.head_dim;
        };
        auto offset = (t * l.heads + head) * l.head_dim;
        cpu::attend(
          q + offset, l.head_dim, l.positions[t] + int64_t{1}, scale,
          [&](int64_t p) { return at(k_cache, p); }, [&](int64_t p) { return at(v_cache, p); },
          scores_.data(), out + offset);
      }
    }
  }

  void sample(const float* logits, int64_t rows, int64_t cols, const row_sampling* params,
              int32_t* ids, float* logprobs) override {
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits + r * cols;
      auto& p = params[r];
      auto chosen = p.temperature < row_sampling::greedy_below
                      ? std::max_element(row, row + cols) - row // the first of equal maxima
                      : choose_token(row, cols, p.temperature, p.top_k, p.top_p, p.u);
      ids[r] = static_cast<int32_t>(chosen);
      logprobs[r] = row[chosen] - log_partition(row, cols); // as sample_token reports it
    }
  }

private:
  std::vector<float> scores_;
};

} // namespace

std::unique_ptr<backend> make_cpu_backend() {
  return std::make_unique<cpu_backend>();
}

} // namespace troupe
