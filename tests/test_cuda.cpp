// The CUDA device (label gpu; run by scripts/gpu-check.sh on a machine with a GPU): every
// kernel against the CPU kernel it mirrors, and a sleep/wake cycle that gives the memory
// back to the GPU (cudaMemGetInfo) and brings the weights back bit-identical.

#include "kernels/backend.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cpu/ops.hpp"
#include "kernels/cuda/cuda_device.hpp"
#include "kernels/cuda/nccl_broadcaster.hpp"
#include "kernels/cuda/nccl_communicator.hpp"
#include "kernels/cuda/ops.hpp"
#include "kernels/dtype.hpp"
#include "kernels/sampler.hpp"
#include "tests/gpu.hpp"
#include "tests/ports.hpp"
#include "troupe/errors.hpp"
#include "troupe/weight_group.hpp"

#include "tests/random.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

using namespace troupe;
using troupe::testing::have_gpu;
using troupe::testing::random_floats;

namespace {

/// Device memory holding a copy of `host` (freed with the device).
template <class T>
T* upload(cuda_device& dev, const std::vector<T>& host) {
  auto ptr = static_cast<T*>(dev.allocate(host.size() * sizeof(T), memory_tag::kv_cache));
  dev.copy(ptr, host.data(), host.size() * sizeof(T));
  return ptr;
}

template <class T>
std::vector<T> download(cuda_device& dev, const T* ptr, size_t n) {
  std::vector<T> host(n);
  dev.copy(host.data(), ptr, n * sizeof(T));
  return host;
}

double max_relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0;
  double scale = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::fabs(got[i] - want[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(want[i])));
  }
  return diff / scale;
}

} // namespace

TEST_CASE("every GPU kernel matches its CPU counterpart") {
  if (!have_gpu())
    return;
  cpu_device host{0};
  cuda_device dev{0};
  auto cpu = make_backend(host);
  auto gpu = make_backend(dev);
  const int64_t rows = 5, dim = 576, heads = 9, head_dim = 64, inter = 1536;
  auto zeros = [&](size_t n) { return upload(dev, std::vector<float>(n)); };

  auto x = random_floats(rows * dim, 1);
  auto w = random_floats(dim, 2);
  std::vector<float> want(x.size());
  cpu->rms_norm(x.data(), w.data(), want.data(), rows, dim, 1e-5f);
  auto dx = upload(dev, x);
  auto dy = zeros(x.size());
  gpu->rms_norm(dx, upload(dev, w), dy, rows, dim, 1e-5f);
  CHECK(max_relative_error(download(dev, dy, x.size()), want) < 1e-5);

  auto bias = random_floats(dim, 3);
  want = x;
  cpu->add_bias(want.data(), bias.data(), rows, dim);
  dev.copy(dy, x.data(), x.size() * sizeof(float));
  gpu->add_bias(dy, upload(dev, bias), rows, dim);
  CHECK(max_relative_error(download(dev, dy, x.size()), want) < 1e-6);

  auto other = random_floats(x.size(), 19);
  want = x;
  cpu->add(want.data(), other.data(), rows * dim);
  dev.copy(dy, x.data(), x.size() * sizeof(float));
  gpu->add(dy, upload(dev, other), rows * dim);
  CHECK(download(dev, dy, x.size()) == want);

  // Rotary of q and k together: one position per row, three quarters of each head rotated
  // (Phi-4-mini's partial rotation).
  const int64_t kv_heads = 3;
  const int64_t rotary_dim = head_dim / 4 * 3 / 2 * 2;
  auto q = random_floats(rows * heads * head_dim, 4);
  auto k = random_floats(rows * kv_heads * head_dim, 23);
  std::vector<float> cos(rows * rotary_dim / 2), sin(cos.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < rotary_dim / 2; ++i) {
      auto angle = (r + 3) / std::pow(10000.0, 2.0 * i / rotary_dim);
      cos[r * rotary_dim / 2 + i] = static_cast<float>(std::cos(angle));
      sin[r * rotary_dim / 2 + i] = static_cast<float>(std::sin(angle));
    }
  want = q;
  auto want_k = k;
  cpu->rotary(want.data(), heads, want_k.data(), kv_heads, rows, head_dim, rotary_dim, cos.data(),
              sin.data(), rope_pairs::halves);
  auto dq = upload(dev, q);
  auto dk = upload(dev, k);
  gpu->rotary(dq, heads, dk, kv_heads, rows, head_dim, rotary_dim, upload(dev, cos),
              upload(dev, sin), rope_pairs::halves);
  CHECK(max_relative_error(download(dev, dq, q.size()), want) < 1e-5);
  CHECK(max_relative_error(download(dev, dk, k.size()), want_k) < 1e-5);

  // The residual add fused with the next norm, written over its h input.
  auto residual = random_floats(x.size(), 24);
  auto sum_want = x;
  want.assign(x.size(), 0.0f);
  cpu->add_rms_norm(sum_want.data(), residual.data(), w.data(), want.data(), rows, dim, 1e-5f);
  auto dsum = upload(dev, x);
  auto dresidual = upload(dev, residual);
  gpu->add_rms_norm(dsum, dresidual, upload(dev, w), dresidual, rows, dim, 1e-5f);
  CHECK(max_relative_error(download(dev, dsum, x.size()), sum_want) < 1e-6);
  CHECK(max_relative_error(download(dev, dresidual, x.size()), want) < 1e-5);

  auto gate = random_floats(rows * inter, 5);
  auto up = random_floats(rows * inter, 6);
  want.assign(gate.size(), 0.0f);
  cpu->silu_mul(gate.data(), up.data(), want.data(), rows * inter);
  auto dout = zeros(gate.size());
  gpu->silu_mul(upload(dev, gate), upload(dev, up), dout, rows * inter);
  CHECK(max_relative_error(download(dev, dout, gate.size()), want) < 1e-5);

  // Row gathers from tables of every element type (the embedding lookup).
  auto table = random_floats(100 * dim, 7);
  std::vector<int32_t> ids{3, 99, 0, 42, 3};
  auto dids = upload(dev, ids);
  for (auto type : {dtype::f32, dtype::f16, dtype::bf16}) {
    std::vector<char> typed(storage_bytes(type, table.size()));
    from_float(type, table.data(), typed.data(), table.size());
    want.assign(rows * dim, 0.0f);
    cpu->gather_rows(ids.data(), typed.data(), type, want.data(), rows, dim);
    gpu->gather_rows(dids, upload(dev, typed), type, dy, rows, dim);
    CHECK_MESSAGE(download(dev, dy, want.size()) == want, dtype_name(type));
  }

  // Sampling: greedy rows (the first of equal maxima) and draws at a temperature with top-k
  // and top-p cuts, against the CPU backend for the same u; and each row's log-softmax.
  const int64_t vocab = 49152;
  auto logits = random_floats(rows * vocab, 8, 3.0f);
  logits[2 * vocab + 777] = 100.0f;
  logits[2 * vocab + 778] = 100.0f;
  auto dlogits = upload(dev, logits);
  auto dsampled = upload(dev, std::vector<int32_t>(rows));
  auto dlogprob = zeros(rows);
  auto dranks = upload(dev, std::vector<int32_t>(rows));
  for (float u : {0.013f, 0.21f, 0.5f, 0.77f, 0.994f, 0x1.fffffep-1f}) {
    std::vector<row_sampling> params(rows);
    params[1] = {0.8f, 50, 1.0f, u};
    params[3] = {1.0f, -1, 0.9f, u};
    params[4] = {1.0f, 200, 0.8f, u};
    std::vector<int32_t> want_ids(rows);
    std::vector<float> want_logprob(rows);
    std::vector<int32_t> want_ranks(rows);
    cpu->sample(logits.data(), nullptr, rows, vocab, params.data(), want_ids.data(),
                want_logprob.data(), want_ranks.data());
    CHECK(want_ids[2] == 777);
    CHECK(want_ranks[2] == 1);
    gpu->sample(dlogits, nullptr, rows, vocab, upload(dev, params), dsampled, dlogprob, dranks);
    CHECK_MESSAGE(download(dev, dsampled, rows) == want_ids, "u = " << u);
    CHECK(max_relative_error(download(dev, dlogprob, rows), want_logprob) < 1e-4);
    CHECK(download(dev, dranks, rows) == want_ranks);
  }
  // Ties at a cut (all are kept), -inf logits, top-k 1 and a top-k above the vocabulary.
  const int64_t small = 1000;
  std::vector<float> special(4 * small, 0.5f);
  auto noise = random_floats(small, 25);
  for (int64_t i = 0; i < small; ++i) {
    special[small + i] = i % 2 ? -INFINITY : noise[i];
    special[2 * small + i] = noise[i];
    special[3 * small + i] = noise[i];
  }
  auto dspecial = upload(dev, special);
  auto dspecial_ids = upload(dev, std::vector<int32_t>(4));
  auto dspecial_logprobs = zeros(4);
  for (float u : {0.05f, 0.45f, 0.95f}) {
    std::vector<row_sampling> params{
      {1.0f, 20, 1.0f, u}, {0.9f, 20, 0.5f, u}, {1.0f, 1, 1.0f, u}, {1.0f, 5000, 0.7f, u}};
    std::vector<int32_t> want_ids(4);
    std::vector<float> want_logprob(4);
    std::vector<int32_t> want_ranks(4);
    cpu->sample(special.data(), nullptr, 4, small, params.data(), want_ids.data(),
                want_logprob.data(), want_ranks.data());
    gpu->sample(dspecial, nullptr, 4, small, upload(dev, params), dspecial_ids, dspecial_logprobs,
                dranks);
    CHECK_MESSAGE(download(dev, dspecial_ids, 4) == want_ids, "u = " << u);
    CHECK(download(dev, dranks, 4) == want_ranks);
  }

  // The logits processors and structured output's mask on the device: penalties, a bias,
  // bans and a mask edit rows into the processed logits (the same bits as the CPU's), min_p
  // cuts the draw, and the logprobs stay the model's.
  {
    sampling_params sp;
    sp.repetition_penalty = 1.3f;
    sp.frequency_penalty = 0.4f;
    sp.presence_penalty = 0.2f;
    sp.logit_bias_ids = {5, 777};
    sp.logit_bias_values = {3.5f, -2.0f};
    sp.min_tokens = 8;
    sp.bad_words_token_ids = {{11, 12}};
    std::vector<int32_t> tokens{1, 2, 3, 777, 9, 9, 11, 40, 40, 40, 11};
    // Row 2 (two logits of 100) stays a plain greedy row; row 1 is masked alone (as when
    // the mask decides), rows 0, 3 and 4 are edited, row 3 masked too.
    std::vector<logit_edit> edits;
    for (int32_t row : {0, 3, 4})
      logit_edits(sp, vocab, tokens, 4, {0, 13}, row, edits);
    auto words = (vocab + 31) / 32;
    std::vector<uint32_t> masks(rows * words, ~0u);
    for (int64_t w = 0; w < words; ++w) {
      masks[1 * words + w] = w % 5 == 1 ? 0xf0f0f0f0u : 0u;
      masks[3 * words + w] = w % 3 == 0 ? 0x0f0f0f0fu : 0u;
    }
    for (float u : {0.02f, 0.5f, 0.97f}) {
      std::vector<row_sampling> params(rows);
      params[0] = {0.0f, -1, 1.0f, u, 0.0f, 1, 0};
      params[1] = {1.0f, -1, 1.0f, u, 0.3f, 1, 1};
      params[3] = {1.2f, -1, 1.0f, u, 0.01f, 1, 1};
      params[4] = {0.9f, 40, 0.9f, u, 0.05f, 1, 0};
      std::vector<float> processed(logits.size());
      cpu->edit_logits(logits.data(), processed.data(), rows, vocab, params.data(), edits.data(),
                       static_cast<int64_t>(edits.size()), masks.data(), words);
      std::vector<int32_t> want_ids(rows);
      std::vector<float> want_logprob(rows);
      std::vector<int32_t> want_ranks(rows);
      cpu->sample(logits.data(), processed.data(), rows, vocab, params.data(), want_ids.data(),
                  want_logprob.data(), want_ranks.data());
      auto dparams = upload(dev, params);
      auto dprocessed = zeros(logits.size());
      gpu->edit_logits(dlogits, dprocessed, rows, vocab, dparams, upload(dev, edits),
                       static_cast<int64_t>(edits.size()), upload(dev, masks), words);
      auto got = download(dev, dprocessed, logits.size());
      for (int64_t r : {0, 1, 3, 4})
        CHECK(std::equal(
          got.begin() + r * vocab, got.begin() + (r + 1) * vocab, processed.begin() + r * vocab,
          [](float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }));
      gpu->sample(dlogits, dprocessed, rows, vocab, dparams, dsampled, dlogprob, dranks);
      CHECK_MESSAGE(download(dev, dsampled, rows) == want_ids, "u = " << u);
      CHECK(max_relative_error(download(dev, dlogprob, rows), want_logprob) < 1e-4);
      CHECK(download(dev, dranks, rows) == want_ranks);
    }
  }

  // GEMMs: float32 (plain and accumulating), and half-precision weights, whose reference
  // is the CPU GEMM of the same values rounded to that type.
  auto weight = random_floats(inter * dim, 9, 0.05f);
  want.assign(rows * inter, 0.0f);
  cpu->gemm_nt(x.data(), weight.data(), dtype::f32, want.data(), rows, inter, dim);
  auto dweight = upload(dev, weight);
  gpu->gemm_nt(dx, dweight, dtype::f32, dout, rows, inter, dim);
  CHECK(max_relative_error(download(dev, dout, want.size()), want) < 1e-5);
  gpu->gemm_nt(dx, dweight, dtype::f32, dout, rows, inter, dim, true);
  for (auto& v : want)
    v *= 2;
  CHECK(max_relative_error(download(dev, dout, want.size()), want) < 1e-5);
  for (auto type : {dtype::f16, dtype::bf16}) {
    auto rounded = [&](const std::vector<float>& v) {
      std::vector<char> typed(storage_bytes(type, v.size()));
      from_float(type, v.data(), typed.data(), v.size());
      std::vector<float> back(v.size());
      to_float(type, typed.data(), back.data(), v.size());
      return std::make_pair(typed, back);
    };
    auto [w_typed, w_back] = rounded(weight);
    auto x_back = rounded(x).second;
    want.assign(rows * inter, 0.0f);
    cpu->gemm_nt(x_back.data(), w_back.data(), dtype::f32, want.data(), rows, inter, dim);
    auto dw_typed = upload(dev, w_typed);
    gpu->gemm_nt(dx, dw_typed, type, dout, rows, inter, dim);
    auto err = max_relative_error(download(dev, dout, want.size()), want);
    CHECK_MESSAGE(err < 1e-4, dtype_name(type) << " GEMM: relative error " << err);
    // Two GEMMs sharing the input (as q/k/v do): both outputs as the single GEMM's.
    auto dsecond = zeros(want.size());
    gpu->gemm_nt_shared(dx, type, rows, dim, {{dw_typed, dout, inter}, {dw_typed, dsecond, inter}});
    CHECK(max_relative_error(download(dev, dout, want.size()), want) < 1e-4);
    CHECK(max_relative_error(download(dev, dsecond, want.size()), want) < 1e-4);
  }
}

TEST_CASE("sleep gives the memory back to the GPU and wake-up restores the weights") {
  if (!have_gpu())
    return;
  cuda_device dev{0};
  const size_t weight_bytes = size_t{2} << 30;
  const size_t kv_bytes = size_t{4} << 30;
  auto weights = static_cast<float*>(dev.allocate(weight_bytes, memory_tag::weights));
  auto kv = dev.allocate(kv_bytes, memory_tag::kv_cache);
  auto pattern = random_floats(1 << 20, 10);
  for (size_t off = 0; off + pattern.size() <= weight_bytes / sizeof(float); off += pattern.size())
    dev.copy(weights + off, pattern.data(), pattern.size() * sizeof(float));
  dev.copy(kv, pattern.data(), pattern.size() * sizeof(float));
  for (int cycle = 0; cycle < 2; ++cycle) {
    auto awake = dev.free_memory();
    dev.sleep(sleep_level::offload_weights);
    auto asleep = dev.free_memory();
    auto returned = static_cast<double>(asleep - awake) / (weight_bytes + kv_bytes);
    MESSAGE("cycle " << cycle << ": " << returned * 100 << " % of weight and KV bytes returned");
    CHECK(returned >= 0.95);
    CHECK(dev.sleeping_tags().size() == 2);
    dev.wake_up({});
    CHECK(
      download(dev, weights + (weight_bytes / sizeof(float)) - pattern.size(), pattern.size()) ==
      std::vector<float>(pattern.end() - static_cast<std::ptrdiff_t>(pattern.size()),
                         pattern.end()));
    CHECK(download(dev, static_cast<float*>(kv), 16) == std::vector<float>(16, 0.0f));
  }
  dev.deallocate(weights);
  dev.deallocate(kv);
}

TEST_CASE("a failed CUDA call names the call, the place and the device") {
  if (!have_gpu())
    return;
  cuda_device dev{0};
  try {
    dev.allocate(size_t{1} << 50, memory_tag::weights);
    FAIL("a petabyte was allocated");
  } catch (const error& e) {
    CHECK(e.code() == errc::memory_error);
    CHECK(std::string{e.what()}.find("cuda:0") != std::string::npos);
    CHECK(std::string{e.what()}.find("cuda_device.cpp") != std::string::npos);
  }
  CHECK_THROWS_WITH_AS(cuda_device{99}, doctest::Contains("cuda:99 does not exist"), error);
}

TEST_CASE("paged attention over a paged cache matches the CPU attention, GQA and prefill") {
  if (!have_gpu())
    return;
  cuda_device dev{0};
  auto s = dev.stream();
  // Two sequences (lengths 37 and 5) in a 16-block cache of block size 4, blocks shuffled;
  // 6 local query heads over 2 kv heads, as a rank holding heads 3..8 of 12 (kv offset 1).
  const int64_t block_size = 4, blocks = 16, kv_heads = 2, head_dim = 32, heads = 6;
  const int64_t head_begin = 3, group = 3, kv_offset = 1, row = kv_heads * head_dim;
  std::vector<std::vector<int32_t>> tables{{9, 2, 14, 0, 7, 11, 3, 12, 5, 1}, {6, 15}};
  std::vector<int64_t> lengths{37, 5};
  auto k_host = random_floats(blocks * block_size * row, 11);
  auto v_host = random_floats(blocks * block_size * row, 12);
  // Keys and values of the tokens go in through write_kv, slot by slot.
  std::vector<int32_t> slots;
  std::vector<float> k_rows, v_rows;
  for (size_t seq = 0; seq < tables.size(); ++seq)
    for (int64_t p = 0; p < lengths[seq]; ++p) {
      int64_t slot = tables[seq][p / block_size] * block_size + p % block_size;
      slots.push_back(static_cast<int32_t>(slot));
      k_rows.insert(k_rows.end(), &k_host[slot * row], &k_host[(slot + 1) * row]);
      v_rows.insert(v_rows.end(), &v_host[slot * row], &v_host[(slot + 1) * row]);
    }
  auto k_cache = upload(dev, std::vector<float>(k_host.size()));
  auto v_cache = upload(dev, std::vector<float>(v_host.size()));
  cuda::write_kv(upload(dev, k_rows), upload(dev, v_rows), k_cache, v_cache, upload(dev, slots),
                 static_cast<int64_t>(slots.size()), row, s);
  // Queries: every position of sequence 0 (a prefill) and the last of sequence 1 (a decode),
  // and a long one (4000 positions, past any fixed scratch) in a cache of its own below.
  std::vector<int32_t> positions, token_seq, flat_tables;
  const int64_t max_blocks = 10;
  for (int64_t p = 0; p < lengths[0]; ++p) {
    positions.push_back(static_cast<int32_t>(p));
    token_seq.push_back(0);
  }
  positions.push_back(static_cast<int32_t>(lengths[1] - 1));
  token_seq.push_back(1);
  for (auto t : tables) {
    t.resize(max_blocks, 0);
    flat_tables.insert(flat_tables.end(), t.begin(), t.end());
  }
  const auto tokens = static_cast<int64_t>(positions.size());
  auto q = random_floats(tokens * heads * head_dim, 13);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> want(q.size());
  std::vector<float> scores(64);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      auto kv = (head_begin + h) / group - kv_offset;
      auto& table = tables[token_seq[t]];
      auto at = [&](std::vector<float>& cache) {
        return [&, kv](int64_t p) {
          return &cache[(table[p / block_size] * block_size + p % block_size) * row +
                        kv * head_dim];
        };
      };
      cpu::attend(&q[(t * heads + h) * head_dim], head_dim, positions[t] + 1, scale, at(k_host),
                  at(v_host), scores.data(), &want[(t * heads + h) * head_dim]);
    }
  paged_layout layout;
  layout.block_tables = upload(dev, flat_tables);
  layout.max_blocks = max_blocks;
  layout.token_seq = upload(dev, token_seq);
  layout.positions = upload(dev, positions);
  layout.block_size = block_size;
  layout.heads = heads;
  layout.kv_heads = kv_heads;
  layout.head_dim = head_dim;
  layout.head_begin = head_begin;
  layout.group_size = group;
  layout.kv_offset = kv_offset;
  auto out = upload(dev, std::vector<float>(q.size()));
  cuda::paged_attention(upload(dev, q), out, k_cache, v_cache, layout, tokens, scale, s);
  CHECK(max_relative_error(download(dev, out, q.size()), want) < 1e-5);

  // One decode at position 3999 through 1000 blocks, against the CPU backend.
  cpu_device host{0};
  auto cpu_backend = make_backend(host);
  const int64_t long_blocks = 1000;
  auto long_k = random_floats(long_blocks * block_size * row, 20);
  auto long_v = random_floats(long_blocks * block_size * row, 21);
  std::vector<int32_t> long_table(long_blocks);
  for (int64_t b = 0; b < long_blocks; ++b)
    long_table[b] = static_cast<int32_t>((b * 7) % long_blocks); // a permutation
  std::vector<int32_t> long_position{static_cast<int32_t>(long_blocks * block_size - 1)};
  std::vector<int32_t> first_seq{0};
  auto long_q = random_floats(heads * head_dim, 22);
  paged_layout cpu_layout = layout;
  cpu_layout.block_tables = long_table.data();
  cpu_layout.max_blocks = long_blocks;
  cpu_layout.token_seq = first_seq.data();
  cpu_layout.positions = long_position.data();
  // The same keys and values (slot by slot) through each backend's write_kv: where a slot
  // lies in a block is each backend's own layout.
  std::vector<int32_t> every_slot(static_cast<size_t>(long_blocks * block_size));
  std::iota(every_slot.begin(), every_slot.end(), 0);
  std::vector<float> cpu_k(long_k.size()), cpu_v(long_v.size());
  cpu_backend->write_kv(long_k.data(), long_v.data(), cpu_k.data(), cpu_v.data(), every_slot.data(),
                        static_cast<int64_t>(every_slot.size()), cpu_layout);
  want.assign(long_q.size(), 0.0f);
  cpu_backend->paged_attention(long_q.data(), want.data(), cpu_k.data(), cpu_v.data(), cpu_layout,
                               1, scale);
  paged_layout gpu_layout = cpu_layout;
  gpu_layout.block_tables = upload(dev, long_table);
  gpu_layout.token_seq = upload(dev, first_seq);
  gpu_layout.positions = upload(dev, long_position);
  auto long_out = upload(dev, std::vector<float>(long_q.size()));
  auto gpu_k = upload(dev, std::vector<float>(long_k.size()));
  auto gpu_v = upload(dev, std::vector<float>(long_v.size()));
  cuda::write_kv(upload(dev, long_k), upload(dev, long_v), gpu_k, gpu_v, upload(dev, every_slot),
                 static_cast<int64_t>(every_slot.size()), row, s);
  cuda::paged_attention(upload(dev, long_q), long_out, gpu_k, gpu_v, gpu_layout, 1, scale, s);
  CHECK(max_relative_error(download(dev, long_out, long_q.size()), want) < 1e-5);
}

TEST_CASE("LoRA on the GPU adds b·(a·x) as the CPU does") {
  if (!have_gpu())
    return;
  cuda_device dev{0};
  auto gpu = make_backend(dev);
  const int64_t m = 7, in = 64, rank = 8, out = 96;
  auto x = random_floats(m * in, 14);
  auto a = random_floats(rank * in, 15);
  auto b = random_floats(out * rank, 16);
  auto y = random_floats(m * out, 17);
  auto want = y;
  std::vector<float> mid(m * rank);
  cpu::gemm_nt(x.data(), a.data(), mid.data(), m, rank, in);
  cpu::gemm_nt(mid.data(), b.data(), want.data(), m, out, rank, true);
  auto dy = upload(dev, y);
  auto dmid = upload(dev, std::vector<float>(mid.size()));
  gpu->gemm_nt(upload(dev, x), upload(dev, a), dtype::f32, dmid, m, rank, in);
  gpu->gemm_nt(dmid, upload(dev, b), dtype::f32, dy, m, out, rank, true);
  CHECK(max_relative_error(download(dev, dy, y.size()), want) < 1e-5);
}

TEST_CASE("NCCL: a one-rank all-reduce, and a peer that never joins is reported, not waited on") {
  if (!have_gpu())
    return;
  cuda_device dev{0};
  auto id = nccl_communicator::make_id();
  CHECK(id != nccl_communicator::make_id());
  {
    nccl_communicator alone{0, 1, id, std::chrono::seconds(10)};
    auto values = random_floats(4096, 18);
    auto d = upload(dev, values);
    alone.all_reduce(d, values.size(), dev.stream());
    CHECK(download(dev, d, values.size()) == values);
    // Latency of one all-reduce of a decode step's activations (batch 1, hidden 576),
    // polled as the model calls it. With one GPU it is one rank: the cost of the call
    // itself, not of the link.
    std::vector<double> micros;
    for (int i = 0; i < 200; ++i) {
      auto start = std::chrono::steady_clock::now();
      alone.all_reduce(d, 576, dev.stream());
      micros.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
          .count());
    }
    std::sort(micros.begin(), micros.end());
    MESSAGE("NCCL all-reduce of 576 floats, 1 rank: p50 " << micros[100] << " us, p99 "
                                                          << micros[198] << " us");
  }
  auto start = std::chrono::steady_clock::now();
  try {
    nccl_communicator lonely{0, 2, nccl_communicator::make_id(), std::chrono::seconds(2)};
    FAIL("joined a communicator whose peer never came");
  } catch (const error& e) {
    CHECK(e.code() == errc::worker_died);
  }
  std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  MESSAGE("a missing NCCL peer was reported after " << took.count() << " s (timeout 2 s)");
  CHECK(took.count() < 10.0);
  CHECK_THROWS_WITH_AS(nccl_communicator(0, 1, "abc", std::chrono::seconds(1)),
                       doctest::Contains("hex digits"), error);
}

TEST_CASE("two members of an NCCL weight-update group on one GPU are refused, saying so, "
          "not left waiting") {
  if (!have_gpu())
    return;
  CHECK_THROWS_WITH_AS(nccl_broadcaster(cuda_device::count(), std::chrono::seconds(1)),
                       doctest::Contains("does not exist"), error);
  auto port = troupe::testing::free_port();
  std::string failures[2];
  auto member = [&](int32_t rank) {
    try {
      weight_update_group group{"127.0.0.1", port, rank, 2, std::chrono::seconds(20), "nccl", 0};
    } catch (const std::exception& e) {
      failures[rank] = e.what();
    }
  };
  auto start = std::chrono::steady_clock::now();
  std::thread other(member, 1);
  member(0);
  other.join();
  std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  MESSAGE("two NCCL members on cuda:0 were refused after " << took.count()
                                                           << " s: " << failures[0]);
  for (auto& f : failures)
    CHECK(f.find("NCCL takes one member per GPU") != std::string::npos);
  CHECK(took.count() < 15.0); // the refusal, not the 20 s deadline
}

TEST_CASE("a weight-update group over NCCL gives the other GPU the root's bytes, from host or "
          "GPU memory into host or GPU memory") {
  if (!have_gpu())
    return;
  if (cuda_device::count() < 2)
    return troupe::testing::skip("two GPUs needed: NCCL takes one member per GPU");
  const size_t piece = nccl_broadcaster::piece;
  // A flag, nothing, a piece exactly, and three pieces with a tail.
  const size_t sizes[] = {1, 0, piece, 2 * piece + 77};
  auto pattern = [](size_t bytes, int salt) {
    std::vector<uint8_t> v(bytes);
    for (size_t i = 0; i < bytes; ++i)
      v[i] = static_cast<uint8_t>(i * 31 + 7 + salt);
    return v;
  };
  auto port = troupe::testing::free_port();
  // got[kind][k]: what member 1 holds after size k went host to host, host to GPU, GPU to
  // host; back: what member 0 holds after member 1 sent it.
  std::vector<std::vector<uint8_t>> got[3], back;
  std::string failures[2];
  auto member = [&](int32_t rank) {
    try {
      cuda_device dev{rank};
      weight_update_group group{"127.0.0.1", port, rank, 2, std::chrono::seconds(60), "nccl", rank};
      for (auto bytes : sizes) {
        auto sent = pattern(bytes, 0);
        if (rank == 0) {
          group.broadcast(sent.data(), bytes, 0);
          group.broadcast(sent.data(), bytes, 0);
          group.broadcast_gpu(bytes ? upload(dev, sent) : nullptr, bytes, 0);
          std::vector<uint8_t> mine(bytes);
          group.broadcast(mine.data(), bytes, 1); // member 1 is the root now
          back.push_back(std::move(mine));
          continue;
        }
        std::vector<uint8_t> host(bytes);
        group.broadcast(host.data(), bytes, 0);
        got[0].push_back(std::move(host));
        auto* gpu = bytes ? upload(dev, std::vector<uint8_t>(bytes)) : nullptr;
        group.broadcast_gpu(gpu, bytes, 0);
        got[1].push_back(bytes ? download(dev, gpu, bytes) : std::vector<uint8_t>{});
        host.assign(bytes, 0);
        group.broadcast(host.data(), bytes, 0);
        got[2].push_back(std::move(host));
        auto mine = pattern(bytes, 1);
        group.broadcast_gpu(bytes ? upload(dev, mine) : nullptr, bytes, 1);
      }
    } catch (const std::exception& e) {
      failures[rank] = e.what();
    }
  };
  std::thread receiver(member, 1);
  member(0);
  receiver.join();
  CHECK(failures[0] == "");
  CHECK(failures[1] == "");
  for (auto& kind : got) {
    REQUIRE(kind.size() == std::size(sizes));
    for (size_t k = 0; k < std::size(sizes); ++k)
      CHECK(kind[k] == pattern(sizes[k], 0));
  }
  REQUIRE(back.size() == std::size(sizes));
  for (size_t k = 0; k < std::size(sizes); ++k)
    CHECK(back[k] == pattern(sizes[k], 1));
}
