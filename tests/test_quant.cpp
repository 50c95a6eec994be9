// The CPU kernels for weights kept as stored: every instruction set against the portable
// kernel and against float32 on the dequantized weights, on sizes with tails; the thread
// pool; the block formats' quantizers; and attention.

#include "kernels/cpu/ops.hpp"
#include "kernels/cpu/quant.hpp"
#include "kernels/cpu/quant_int8.hpp"
#include "kernels/cpu/thread_pool.hpp"
#include "kernels/dtype.hpp"
#include "kernels/sampler.hpp"

#include "tests/random.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

using namespace troupe;
using troupe::cpu::isa;
using troupe::testing::random_floats;

namespace {

/// A product's shape: n weight rows, m activation rows, k columns.
struct shape {
  int64_t n, m, k;
};

std::vector<isa> available() {
  std::vector<isa> out;
  for (auto i : {isa::portable, isa::avx2, isa::avx512})
    if (i <= cpu::best_isa())
      out.push_back(i);
  return out;
}

/// y[r][i] = Σ_j w[i][j] · x[r][j] in double, and Σ_j |w[i][j] · x[r][j]|: float32's
/// rounding error is relative to the latter.
struct products {
  std::vector<double> y;
  std::vector<double> magnitude;

  /// Whether `got` is y[at] up to float32 sums in another order.
  bool close(size_t at, double got, double offset = 0.0) const {
    return std::fabs(got - offset - y[at]) <= 1e-5 * magnitude[at] + 1e-30;
  }
};

/// Requires that y[m × n], computed for the weight rows [begin, n) over a y of ones, holds
/// `want` there and its ones elsewhere.
void require_rows_from(const std::vector<float>& y, const products& want, int64_t begin, int64_t m,
                       int64_t n) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      auto at = static_cast<size_t>(r * n + c);
      if (c < begin)
        REQUIRE(y[at] == 1.0f);
      else
        REQUIRE(want.close(at, y[at]));
    }
}

products reference(const std::vector<float>& w, const std::vector<float>& x, int64_t n, int64_t m,
                   int64_t k) {
  products p;
  p.y.resize(static_cast<size_t>(m * n));
  p.magnitude.resize(p.y.size());
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < n; ++i) {
      double s = 0;
      double a = 0;
      for (int64_t j = 0; j < k; ++j) {
        double v = static_cast<double>(w[i * k + j]) * x[r * k + j];
        s += v;
        a += std::fabs(v);
      }
      p.y[r * n + i] = s;
      p.magnitude[r * n + i] = a;
    }
  return p;
}

} // namespace

TEST_CASE("block formats: quantize then dequantize stays within a step of each block") {
  auto x = random_floats(32 * 7, 1);
  x[5] = 0.0f;
  std::fill(x.begin() + 64, x.begin() + 96, 0.0f); // an all-zero block
  for (auto t : {dtype::q8_0, dtype::q4_0, dtype::q4_1, dtype::q5_0, dtype::q5_1}) {
    std::vector<char> q(storage_bytes(t, x.size()));
    from_float(t, x.data(), q.data(), x.size());
    std::vector<float> back(x.size());
    to_float(t, q.data(), back.data(), x.size());
    for (size_t b = 0; b < x.size() / 32; ++b) {
      float lo = *std::min_element(x.begin() + b * 32, x.begin() + b * 32 + 32);
      float hi = *std::max_element(x.begin() + b * 32, x.begin() + b * 32 + 32);
      float amax = std::max(-lo, hi);
      // One quantization step of the block: Q8_0 amax/127, Q4_0 amax/8, Q5_0 amax/16, Q4_1
      // (hi-lo)/15, Q5_1 (hi-lo)/31; the float16 scale adds a little.
      float step = t == dtype::q8_0   ? amax / 127
                   : t == dtype::q4_0 ? amax / 8
                   : t == dtype::q5_0 ? amax / 16
                   : t == dtype::q4_1 ? (hi - lo) / 15
                                      : (hi - lo) / 31;
      // Q4_0 and Q5_0 map the extreme to the lowest level, so the other sign falls a level
      // short: a whole step there.
      bool centred = t == dtype::q4_0 || t == dtype::q5_0;
      // The float16 scale (and the float16 minimum) add up to 2^-11 of what they scale.
      float most = (centred ? 1.0f : 0.5f) * step + 0.07f * step + 1e-3f * amax;
      INFO(std::string{dtype_name(t)} << " block " << b);
      for (size_t i = b * 32; i < b * 32 + 32; ++i)
        REQUIRE(std::fabs(back[i] - x[i]) <= most + 1e-6f);
    }
  }
}

TEST_CASE("k-quants: quantize then dequantize stays within a step of each sub-block") {
  auto x = random_floats(256 * 3, 7);
  std::fill(x.begin() + 256, x.begin() + 288, 0.0f);   // an all-zero sub-block
  std::fill(x.begin() + 288, x.begin() + 320, -0.25f); // a constant negative one
  for (auto t : {dtype::q4_k, dtype::q5_k, dtype::q6_k}) {
    std::vector<char> q(storage_bytes(t, x.size()));
    CHECK(q.size() == x.size() / 256 * block_bytes(t));
    from_float(t, x.data(), q.data(), x.size());
    std::vector<float> back(x.size());
    to_float(t, q.data(), back.data(), x.size());
    for (size_t b = 0; b < x.size() / 256; ++b) {
      float amax = 0.0f;
      for (size_t i = b * 256; i < b * 256 + 256; ++i)
        amax = std::max(amax, std::fabs(x[i]));
      // Sub-block ranges span at most 2·amax in 15 (Q4_K), 31 (Q5_K) or 32 (Q6_K, each
      // side) levels; their 6-bit (8-bit) scales round up to 1/63 (1/127) of the largest,
      // which widens a step by at most that much.
      float step = t == dtype::q4_k ? 2 * amax / 15 : t == dtype::q5_k ? 2 * amax / 31 : amax / 32;
      float most = step * (0.5f + 0.1f) + 2 * amax / 63;
      INFO(std::string{dtype_name(t)} << " super-block " << b);
      for (size_t i = b * 256; i < b * 256 + 256; ++i)
        REQUIRE(std::fabs(back[i] - x[i]) <= most);
    }
  }
}

TEST_CASE(
  "block-format kernels: every instruction set gives float32's sums on the dequantized weights") {
  // Shapes with a single block, odd row counts, and activation row counts that exercise
  // every tile (12, 8 and 4 rows) and their tails.
  for (auto s : {shape{1, 1, 32}, shape{7, 3, 96}, shape{33, 5, 576}, shape{64, 9, 1536},
                 shape{1, 1, 256}, shape{5, 2, 512}, shape{19, 13, 768}, shape{7, 30, 96}}) {
    auto w = random_floats(static_cast<size_t>(s.n * s.k), 2, 0.05f);
    auto x = random_floats(static_cast<size_t>(s.m * s.k), 3);
    x[3] = 60.0f; // an outlier, as hidden states have
    std::vector<float> sums(static_cast<size_t>(s.m * s.k / 32));
    cpu::block_sums(x.data(), s.m, s.k, sums.data());
    for (auto t : {dtype::q8_0, dtype::q4_0, dtype::q4_1, dtype::q5_0, dtype::q5_1, dtype::q4_k,
                   dtype::q5_k, dtype::q6_k}) {
      if (s.k % block_elements(t) != 0)
        continue;
      std::vector<char> wq(storage_bytes(t, w.size()));
      from_float(t, w.data(), wq.data(), w.size());
      std::vector<float> wd(w.size());
      to_float(t, wq.data(), wd.data(), w.size());
      auto exact = reference(wd, x, s.n, s.m, s.k);
      for (auto i : available()) {
        INFO(std::string{dtype_name(t)} << " on " << std::string{cpu::isa_name(i)} << ", n " << s.n
                                        << " m " << s.m << " k " << s.k);
        std::vector<float> y(exact.y.size(), 1.0f);
        // Only rows [1, n) are written when n > 1: the first must keep its value.
        int64_t begin = s.n > 1 ? 1 : 0;
        cpu::dot_rows_quantized(i, t, wq.data(), x.data(), sums.data(), s.m, s.k, y.data(), s.n,
                                begin, s.n, false);
        require_rows_from(y, exact, begin, s.m, s.n);
        // Accumulating adds to what is there.
        std::vector<float> acc(exact.y.size(), 2.0f);
        cpu::dot_rows_quantized(i, t, wq.data(), x.data(), sums.data(), s.m, s.k, acc.data(), s.n,
                                0, s.n, true);
        for (size_t at = 0; at < acc.size(); ++at)
          REQUIRE(exact.close(at, acc[at], 2.0));
      }
    }
  }
}

TEST_CASE("integer kernels: the sums of the rounded activations, on every tile and tail, "
          "within half a rounding step of float32's") {
  // Block counts with every part of a row (Q8_0 and Q4_0 take blocks in groups of 8, then
  // pairs, then one: 11 blocks has all three), activation rows that exercise every tile
  // (8, 4, 1) and their tails.
  for (auto s : {shape{1, 1, 32}, shape{7, 3, 96}, shape{5, 1, 256}, shape{33, 5, 512},
                 shape{9, 8, 768}, shape{19, 13, 256}, shape{3, 30, 1536}, shape{6, 9, 352}}) {
    auto w = random_floats(static_cast<size_t>(s.n * s.k), 12, 0.05f);
    auto x = random_floats(static_cast<size_t>(s.m * s.k), 13);
    x[5] = 40.0f; // an outlier, as hidden states have
    if (s.k >= 64)
      std::fill(x.begin() + 32, x.begin() + 64, 0.0f); // a block of zeros
    for (auto t : {dtype::q8_0, dtype::q4_0, dtype::q4_1, dtype::q4_k, dtype::q6_k}) {
      if (s.k % block_elements(t) != 0)
        continue;
      INFO(std::string{dtype_name(t)} << ", n " << s.n << " m " << s.m << " k " << s.k);
      cpu::int8_rows xq;
      xq.quantize(x.data(), s.m, s.k, cpu::int8_block(t));
      // The activations as the kernels see them, and how far each moved: half a step, or a
      // whole one where a value the other side of the block's largest saturates at 127.
      std::vector<float> xr(x.size()), half_step(x.size());
      for (size_t j = 0; j < x.size(); ++j) {
        auto b = j / static_cast<size_t>(xq.block);
        xr[j] = xq.scale[b] * xq.q[j];
        auto step = std::fabs(xq.scale[b]);
        half_step[j] = xq.q[j] == 127 ? step : step / 2;
        REQUIRE(std::fabs(xr[j] - x[j]) <= half_step[j] * 1.0001f);
      }
      for (size_t h = 0; h < x.size() / 16; ++h) {
        int sum = 0;
        for (size_t j = 16 * h; j < 16 * h + 16; ++j)
          sum += xq.q[j];
        REQUIRE(xq.sums[h] == sum);
      }
      std::vector<char> wq(storage_bytes(t, w.size()));
      from_float(t, w.data(), wq.data(), w.size());
      std::vector<float> wd(w.size());
      to_float(t, wq.data(), wd.data(), w.size());
      auto rounded = reference(wd, xr, s.n, s.m, s.k);
      auto exact = reference(wd, x, s.n, s.m, s.k);
      std::vector<float> y(rounded.y.size(), 1.0f);
      cpu::dot_rows_int8_reference(t, wq.data(), xq, y.data(), s.n, 0, s.n, false);
      for (int64_t r = 0; r < s.m; ++r)
        for (int64_t i = 0; i < s.n; ++i) {
          auto at = static_cast<size_t>(r * s.n + i);
          REQUIRE(rounded.close(at, y[at]));
          // Rounding moved each activation by at most half its block's step.
          double bound = 0;
          for (int64_t j = 0; j < s.k; ++j)
            bound += std::fabs(wd[i * s.k + j]) * half_step[r * s.k + j];
          REQUIRE(std::fabs(y[at] - exact.y[at]) <= bound * 1.001 + 1e-5 * exact.magnitude[at]);
        }
      if (t == dtype::q4_1)
        continue; // a packed kernel only: the next test
      if (!cpu::has_int8_kernel(t)) {
        MESSAGE("no integer instructions on this CPU: the vector kernel of " << dtype_name(t)
                                                                             << " is not run");
        continue;
      }
      // Only rows [1, n) are written when n > 1: the first keeps its value.
      int64_t begin = s.n > 1 ? 1 : 0;
      std::vector<float> v(rounded.y.size(), 1.0f);
      cpu::dot_rows_int8(t, wq.data(), xq, v.data(), s.n, begin, s.n, false);
      std::vector<float> acc(rounded.y.size(), 2.0f);
      cpu::dot_rows_int8(t, wq.data(), xq, acc.data(), s.n, 0, s.n, true);
      require_rows_from(v, rounded, begin, s.m, s.n);
      for (size_t at = 0; at < acc.size(); ++at)
        REQUIRE(rounded.close(at, acc[at], 2.0));
    }
  }
}

TEST_CASE("packed layouts: they round-trip, and their kernels give the row kernels' sums on "
          "every tile and tail") {
  // Activation rows that exercise every tile (4, 2, 1); groups of 16 weight rows.
  for (auto s : {shape{16, 1, 256}, shape{32, 3, 512}, shape{48, 7, 768}, shape{16, 4, 256},
                 shape{64, 9, 1024}, shape{32, 2, 2048}}) {
    auto w = random_floats(static_cast<size_t>(s.n * s.k), 21, 0.05f);
    auto x = random_floats(static_cast<size_t>(s.m * s.k), 22);
    x[3] = -30.0f;
    for (auto t : {dtype::q8_0, dtype::q4_0, dtype::q4_1, dtype::q4_k, dtype::q6_k}) {
      INFO(dtype_name(t) << ", n " << s.n << " m " << s.m << " k " << s.k);
      std::vector<char> stored(storage_bytes(t, w.size()));
      from_float(t, w.data(), stored.data(), w.size());
      std::vector<char> packed(stored.size()), back(stored.size());
      cpu::pack_rows(t, stored.data(), packed.data(), s.n, s.k);
      REQUIRE(packed != stored);
      cpu::unpack_rows(t, packed.data(), back.data(), s.n, s.k);
      REQUIRE(back == stored);
      const auto row_bytes = storage_bytes(t, static_cast<size_t>(s.k));
      std::vector<char> row(row_bytes);
      for (int64_t i : {int64_t{0}, int64_t{5}, s.n - 1}) {
        cpu::unpack_row(t, packed.data(), i, s.k, row.data());
        REQUIRE(std::memcmp(row.data(), stored.data() + i * row_bytes, row_bytes) == 0);
      }
      if (!cpu::has_packed_layout(t)) {
        MESSAGE("no integer instructions on this CPU: the packed kernels are not run");
        continue;
      }
      cpu::int8_rows xq;
      xq.quantize(x.data(), s.m, s.k, cpu::int8_block(t));
      std::vector<float> want(static_cast<size_t>(s.m * s.n));
      cpu::dot_rows_int8_reference(t, stored.data(), xq, want.data(), s.n, 0, s.n, false);
      // The first group keeps its ones; the others are written, then added to.
      std::vector<float> y(want.size(), 1.0f);
      cpu::dot_packed_int8(t, packed.data(), xq, y.data(), s.n, 16, s.n, false);
      std::vector<float> acc(want.size(), 2.0f);
      cpu::dot_packed_int8(t, packed.data(), xq, acc.data(), s.n, 0, s.n, true);
      for (int64_t r = 0; r < s.m; ++r)
        for (int64_t i = 0; i < s.n; ++i) {
          auto at = static_cast<size_t>(r * s.n + i);
          // Float sums in another order.
          auto tolerance = 1e-5f * (std::fabs(want[at]) + 1.0f);
          REQUIRE(std::fabs(y[at] - (i < 16 ? 1.0f : want[at])) <= tolerance);
          REQUIRE(std::fabs(acc[at] - 2.0f - want[at]) <= tolerance);
        }
    }
  }
  // BF16: float32 sums of the bfloat16 activations and weights.
  // AMX (where the CPU has it) takes 4 rows or more when k is whole tiles of 32: one group
  // or two, one block of 16 rows or two, short blocks, and k in spans (600 rows).
  for (auto s :
       {shape{16, 1, 2}, shape{32, 3, 64}, shape{48, 9, 130}, shape{16, 17, 512}, shape{48, 40, 96},
        shape{80, 33, 64}, shape{32, 16, 32}, shape{32, 600, 1024}, shape{64, 13, 96}}) {
    INFO("BF16, n " << s.n << " m " << s.m << " k " << s.k);
    auto w = random_floats(static_cast<size_t>(s.n * s.k), 23);
    auto x = random_floats(static_cast<size_t>(s.m * s.k), 24);
    std::vector<char> stored(storage_bytes(dtype::bf16, w.size()));
    from_float(dtype::bf16, w.data(), stored.data(), w.size());
    std::vector<char> packed(stored.size()), back(stored.size());
    cpu::pack_rows(dtype::bf16, stored.data(), packed.data(), s.n, s.k);
    cpu::unpack_rows(dtype::bf16, packed.data(), back.data(), s.n, s.k);
    REQUIRE(back == stored);
    if (!cpu::has_packed_layout(dtype::bf16)) {
      MESSAGE("no AVX-512 BF16 on this CPU: the packed BF16 kernel is not run");
      break;
    }
    std::vector<uint16_t> xb(x.size());
    cpu::to_bf16_rows(x.data(), static_cast<int64_t>(x.size()), xb.data());
    std::vector<char> xb_bytes(xb.size() * 2);
    from_float(dtype::bf16, x.data(), xb_bytes.data(), x.size());
    REQUIRE(std::memcmp(xb_bytes.data(), xb.data(), xb_bytes.size()) == 0); // nearest even
    std::vector<float> wd(w.size()), xd(x.size());
    to_float(dtype::bf16, stored.data(), wd.data(), w.size());
    to_float(dtype::bf16, xb_bytes.data(), xd.data(), x.size());
    auto want = reference(wd, xd, s.n, s.m, s.k);
    for (auto layout : {cpu::bf16_layout::rows, cpu::bf16_layout_for(s.m, s.k)}) {
      INFO((layout == cpu::bf16_layout::tiles ? "AMX tiles" : "rows"));
      std::vector<uint16_t> xl(cpu::bf16_elements(layout, s.m, s.k));
      cpu::to_bf16(x.data(), s.m, s.k, layout, xl.data());
      std::vector<float> y(want.y.size(), 1.0f);
      cpu::dot_packed_bf16(packed.data(), xl.data(), layout, s.m, s.k, y.data(), s.n, 16, s.n,
                           false);
      require_rows_from(y, want, 16, s.m, s.n);
      std::vector<float> acc(want.y.size(), 2.0f);
      cpu::dot_packed_bf16(packed.data(), xl.data(), layout, s.m, s.k, acc.data(), s.n, 0, s.n,
                           true);
      for (size_t at = 0; at < acc.size(); ++at)
        REQUIRE(want.close(at, acc[at], 2.0));
    }
  }
  // F16: float32 sums of the widened weights and the float32 activations, as the row kernel
  // (another order). Pairs of groups against tiles of 6 rows where there are both (the
  // widened copy of one pair must not leak into the next), the rest one group at a time.
  for (auto s : {shape{16, 1, 2}, shape{32, 3, 64}, shape{48, 9, 130}, shape{16, 17, 576},
                 shape{64, 2, 1536}, shape{80, 20, 576}}) {
    INFO("F16, n " << s.n << " m " << s.m << " k " << s.k);
    auto w = random_floats(static_cast<size_t>(s.n * s.k), 25);
    auto x = random_floats(static_cast<size_t>(s.m * s.k), 26);
    std::vector<char> stored(storage_bytes(dtype::f16, w.size()));
    from_float(dtype::f16, w.data(), stored.data(), w.size());
    std::vector<char> packed(stored.size()), back(stored.size());
    cpu::pack_rows(dtype::f16, stored.data(), packed.data(), s.n, s.k);
    cpu::unpack_rows(dtype::f16, packed.data(), back.data(), s.n, s.k);
    REQUIRE(back == stored);
    if (!cpu::has_packed_layout(dtype::f16)) {
      MESSAGE("no AVX-512 VNNI on this CPU: the packed F16 kernel is not run");
      break;
    }
    std::vector<float> wd(w.size());
    to_float(dtype::f16, stored.data(), wd.data(), w.size());
    auto want = reference(wd, x, s.n, s.m, s.k);
    std::vector<float> y(want.y.size(), 1.0f);
    cpu::dot_packed_f16(packed.data(), x.data(), s.m, s.k, y.data(), s.n, 16, s.n, false);
    require_rows_from(y, want, 16, s.m, s.n);
    std::vector<float> acc(want.y.size(), 2.0f);
    cpu::dot_packed_f16(packed.data(), x.data(), s.m, s.k, acc.data(), s.n, 0, s.n, true);
    for (size_t at = 0; at < acc.size(); ++at)
      REQUIRE(want.close(at, acc[at], 2.0));
  }
  std::vector<char> odd(storage_bytes(dtype::q4_k, 16 * 256)), out(odd.size());
  CHECK_THROWS_WITH(cpu::pack_rows(dtype::q4_k, odd.data(), out.data(), 8, 256),
                    doctest::Contains("rows in groups of 16"));
  CHECK_THROWS_WITH(cpu::pack_rows(dtype::q5_k, odd.data(), out.data(), 16, 256),
                    doctest::Contains("no packed layout for Q5_K"));
}

TEST_CASE("16-bit kernels: every instruction set gives float32's sums on the widened weights") {
  for (auto s : {shape{1, 1, 1}, shape{5, 2, 7}, shape{17, 3, 23}, shape{40, 4, 577},
                 shape{9, 1, 100}, shape{13, 9, 40}}) {
    auto w = random_floats(static_cast<size_t>(s.n * s.k), 4, 0.05f);
    auto x = random_floats(static_cast<size_t>(s.m * s.k), 5);
    for (auto t : {dtype::f16, dtype::bf16}) {
      std::vector<char> wh(storage_bytes(t, w.size()));
      from_float(t, w.data(), wh.data(), w.size());
      std::vector<float> wd(w.size());
      to_float(t, wh.data(), wd.data(), w.size());
      auto exact = reference(wd, x, s.n, s.m, s.k);
      for (auto i : available()) {
        INFO(std::string{dtype_name(t)} << " on " << std::string{cpu::isa_name(i)} << ", n " << s.n
                                        << " k " << s.k);
        std::vector<float> y(exact.y.size());
        cpu::dot_rows_half(i, t, wh.data(), x.data(), s.m, s.k, y.data(), s.n, 0, s.n, false);
        for (size_t at = 0; at < y.size(); ++at)
          REQUIRE(exact.close(at, y[at]));
      }
    }
  }
}

TEST_CASE("the thread pool runs every part once, call after call") {
  for (int threads : {1, 2, 3}) {
    cpu::thread_pool pool{threads};
    CHECK(pool.size() == threads);
    for (int call = 0; call < 200; ++call) {
      int64_t parts = call % 17;
      std::vector<std::atomic<int>> hits(static_cast<size_t>(parts));
      pool.run(parts, [&](int64_t p) { hits[static_cast<size_t>(p)]++; });
      for (auto& h : hits)
        REQUIRE(h.load() == 1);
    }
  }
}

TEST_CASE("attention: every instruction set gives the portable attention's outputs, for "
          "query heads alone and in groups that share keys and values") {
  // Head sizes of whole vectors (1, 2, 4, 8 of them: held in registers) and with a tail;
  // positions scattered as a paged cache has them (offsets into one buffer, out of order);
  // groups of 1 to 9 heads (taken 4 at a time, the rest after).
  for (int64_t head_dim : {64, 24, 7, 16, 32, 128}) {
    for (int64_t len : {1, 5, 130}) {
      for (int64_t heads : {1, 3, 4, 9}) {
        const int64_t row = 3 * head_dim;
        auto keys = random_floats(static_cast<size_t>(len * row), 8);
        auto values = random_floats(static_cast<size_t>(len * row), 9);
        auto query = random_floats(static_cast<size_t>(heads * head_dim), 10);
        std::vector<int64_t> offsets(static_cast<size_t>(len));
        for (int64_t p = 0; p < len; ++p)
          offsets[static_cast<size_t>(p)] = ((p * 7) % len) * row + head_dim;
        std::vector<float> scores(static_cast<size_t>(heads * len));
        std::vector<float> want(static_cast<size_t>(heads * head_dim));
        auto at = [&](const std::vector<float>& cache) {
          return [&](int64_t p) { return cache.data() + offsets[static_cast<size_t>(p)]; };
        };
        for (int64_t g = 0; g < heads; ++g)
          cpu::attend(query.data() + g * head_dim, head_dim, len, 0.125f, at(keys), at(values),
                      scores.data(), want.data() + g * head_dim);
        for (auto i : available()) {
          INFO(std::string{cpu::isa_name(i)} << ", head_dim " << head_dim << " len " << len
                                             << " heads " << heads);
          std::vector<float> got(want.size(), -1.0f);
          cpu::attend(i, query.data(), head_dim, heads, len, 0.125f, keys.data(), values.data(),
                      offsets.data(), scores.data(), got.data());
          for (size_t d = 0; d < got.size(); ++d)
            REQUIRE(std::fabs(got[d] - want[d]) <= 1e-5f * (1.0f + std::fabs(want[d])));
          // Each head of a group computes what it computes alone, to the bit.
          if (heads > 1) {
            std::vector<float> alone(static_cast<size_t>(head_dim));
            cpu::attend(i, query.data() + (heads - 1) * head_dim, head_dim, 1, len, 0.125f,
                        keys.data(), values.data(), offsets.data(), scores.data(), alone.data());
            REQUIRE(std::equal(alone.begin(), alone.end(), got.end() - head_dim));
          }
        }
      }
    }
  }
}

TEST_CASE("attention of a prefill's tokens together: each token's heads give the portable "
          "attention's outputs over its own positions, and to the bit their own alone") {
  // Whole vectors a head (held in registers) and not (a token at a time); one token to 17
  // (rows in tiles of 4 and the rest); context before the tokens, also past the 256
  // positions whose keys are transposed at a time; a sliding window and a soft cap; the
  // tokens' rows of other heads between them (stride), left alone. A single token is a
  // decode step's tile, which must give the bits of the per-position kernel (`attend`).
  for (int64_t head_dim : {64, 16, 32, 128, 24}) {
    for (int64_t heads : {1, 3, 4}) {
      for (int64_t tokens : {1, 2, 5, 17}) {
        for (int64_t before : {0, 3, 40, 300}) {
          for (int64_t window : {0, 6}) {
            const float softcap = window > 0 ? 3.0f : 0.0f;
            const int64_t len = before + tokens;
            const int64_t row = 2 * head_dim;
            const int64_t stride = (heads + 2) * head_dim;
            auto keys = random_floats(static_cast<size_t>(len * row), 11);
            auto values = random_floats(static_cast<size_t>(len * row), 12);
            auto query = random_floats(static_cast<size_t>(tokens * stride), 13);
            std::vector<int64_t> offsets(static_cast<size_t>(len)), first, end;
            for (int64_t p = 0; p < len; ++p)
              offsets[static_cast<size_t>(p)] = ((p * 5) % len) * row + head_dim;
            for (int64_t t = 0; t < tokens; ++t) {
              end.push_back(before + t + 1);
              first.push_back(window > 0 ? std::max<int64_t>(0, end.back() - window) : 0);
            }
            std::vector<float> want(query.size(), -1.0f), scores(static_cast<size_t>(len));
            auto at = [&](const std::vector<float>& cache) {
              return [&](int64_t p) { return cache.data() + offsets[static_cast<size_t>(p)]; };
            };
            for (int64_t t = 0; t < tokens; ++t)
              for (int64_t g = 0; g < heads; ++g) {
                auto f = first[static_cast<size_t>(t)];
                auto n = end[static_cast<size_t>(t)] - f;
                cpu::attend(
                  query.data() + t * stride + g * head_dim, head_dim, n, 0.125f,
                  [&](int64_t p) { return at(keys)(f + p); },
                  [&](int64_t p) { return at(values)(f + p); }, scores.data(),
                  want.data() + t * stride + g * head_dim, softcap);
              }
            for (auto i : available()) {
              INFO(std::string{cpu::isa_name(i)} << ", head_dim " << head_dim << " heads " << heads
                                                 << " tokens " << tokens << " before " << before
                                                 << " window " << window);
              std::vector<float> got(query.size(), -1.0f);
              cpu::attend_tokens(i, query.data(), stride, head_dim, heads, tokens, first.data(),
                                 end.data(), len, 0.125f, keys.data(), values.data(),
                                 offsets.data(), got.data(), softcap);
              for (size_t d = 0; d < got.size(); ++d)
                REQUIRE(std::fabs(got[d] - want[d]) <= 1e-5f * (1.0f + std::fabs(want[d])));
              // To the bit what the token computes alone, as a decode step does: a
              // prompt's outputs do not depend on how it is cut into steps (prefix caching,
              // chunks, recomputation).
              std::vector<float> alone(query.size(), -1.0f);
              std::vector<float> head_scores(static_cast<size_t>(heads * len));
              for (int64_t t = 0; t < tokens; ++t) {
                auto f = first[static_cast<size_t>(t)];
                cpu::attend(i, query.data() + t * stride, head_dim, heads,
                            end[static_cast<size_t>(t)] - f, 0.125f, keys.data(), values.data(),
                            offsets.data() + f, head_scores.data(), alone.data() + t * stride,
                            softcap);
              }
              REQUIRE(alone == got);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("silu: every instruction set gives the portable values, over the whole range") {
  auto gate = random_floats(1000, 11);
  for (size_t i = 0; i < gate.size(); ++i)
    gate[i] *= 40.0f; // well past where e^-x under- and overflows float
  gate[0] = -100.0f;
  gate[1] = 100.0f;
  gate[2] = 0.0f;
  auto up = random_floats(gate.size(), 12);
  std::vector<float> want(gate.size());
  cpu::silu_mul(gate.data(), up.data(), want.data(), static_cast<int64_t>(gate.size()));
  for (auto i : available()) {
    INFO(std::string{cpu::isa_name(i)});
    std::vector<float> got(gate.size());
    // An odd count leaves a tail to the portable loop.
    cpu::silu_mul(i, gate.data(), up.data(), got.data(), static_cast<int64_t>(gate.size()) - 3);
    for (size_t j = 0; j + 3 < got.size(); ++j)
      REQUIRE(std::fabs(got[j] - want[j]) <= 4e-7f * std::fabs(want[j]) + 1e-30f);
  }
}

TEST_CASE("log-partition: every instruction set gives the portable value") {
  for (int64_t n : {1, 17, 1000, 49152}) {
    auto logits = random_floats(static_cast<size_t>(n), 13, 8.0f);
    auto want = log_partition(logits.data(), n);
    for (auto i : available()) {
      INFO(std::string{cpu::isa_name(i)} << ", n " << n);
      auto got = cpu::log_partition(i, logits.data(), n);
      REQUIRE(std::fabs(got - want) <= 1e-6f * std::max(1.0f, std::fabs(want)));
    }
  }
}

TEST_CASE("first_non_finite finds the first infinity or NaN of a float tensor, across chunks") {
  const size_t count = 10000;                          // more than two chunks of the scan
  std::vector<uint32_t> f32(count, 0x3f800000u);       // 1.0f
  std::vector<uint16_t> f16(count, uint16_t{0x3c00});  // 1.0
  std::vector<uint16_t> bf16(count, uint16_t{0x3f80}); // 1.0
  CHECK_FALSE(first_non_finite(dtype::f32, f32.data(), count));
  CHECK_FALSE(first_non_finite(dtype::f16, f16.data(), count));
  CHECK_FALSE(first_non_finite(dtype::bf16, bf16.data(), count));
  for (size_t at : {size_t{0}, size_t{4095}, size_t{4096}, count - 1}) {
    INFO("at " << at);
    auto a = f32;
    auto b = f16;
    auto c = bf16;
    a[at] = 0x7fc00000u; // NaN
    b[at] = 0x7c00;      // infinity
    c[at] = 0xff80;      // −infinity
    CHECK(first_non_finite(dtype::f32, a.data(), count) == at);
    CHECK(first_non_finite(dtype::f16, b.data(), count) == at);
    CHECK(first_non_finite(dtype::bf16, c.data(), count) == at);
    // A later one does not hide it.
    if (at + 1 < count) {
      a[at + 1] = 0x7f800000u;
      CHECK(first_non_finite(dtype::f32, a.data(), count) == at);
    }
  }
}
