// Every position's logits in one step against transformers', and the perplexity and KL
// divergence measured over them in llama.cpp's log-probability file.

#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cpu/quant_int8.hpp"
#include "model/checkpoint.hpp"
#include "model/config.hpp"
#include "model/kv_cache.hpp"
#include "model/llama.hpp"
#include "model/perplexity.hpp"
#include "tests/generation.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

using namespace troupe;

namespace {

const std::string fixtures = TROUPE_SOURCE_DIR "/tests/fixtures";

/// Chunks of random tokens, the first of each its BOS (1).
logprob_file random_chunks(int32_t vocab, uint32_t ctx, int32_t count) {
  logprob_file f;
  f.ctx = ctx;
  f.vocab = vocab;
  f.chunks = count;
  std::mt19937 rng{11};
  for (size_t i = 0; i < static_cast<size_t>(ctx) * static_cast<size_t>(count); ++i)
    f.tokens.push_back(i % ctx == 0 ? 1
                                    : static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab)));
  return f;
}

/// −log softmax(logits)[next], in double.
double nll_of(const float* logits, int32_t vocab, int32_t next) {
  double top = *std::max_element(logits, logits + vocab);
  double sum = 0;
  for (int32_t i = 0; i < vocab; ++i)
    sum += std::exp(logits[i] - top);
  return top + std::log(sum) - logits[next];
}

} // namespace

TEST_CASE("every position's logits in one step match transformers'") {
  for (auto name : {"llama-gqa", "llama3-rope-tied", "qwen2-bias"}) {
    auto dir = fixtures + "/" + name;
    nlohmann::json ref;
    std::ifstream{dir + "/reference.json"} >> ref;
    auto& prompt = ref["prompts"][0];
    auto cfg = load_model_config(dir);
    cpu_device dev{0};
    llama_model model{cfg, dev, 0, 1};
    model.load(checkpoint{dir});
    kv_cache cache{dev, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, 8, 0};
    auto tokens = prompt["token_ids"].get<std::vector<int32_t>>();
    auto logits = model.prompt_logits(tokens, cache);
    auto all = prompt["all_logits"].get<std::vector<std::vector<float>>>();
    REQUIRE(logits.size() == tokens.size() * static_cast<size_t>(cfg.vocab_size));
    for (size_t p = 0; p < tokens.size(); ++p) {
      auto err = testing::relative_error(&logits[p * static_cast<size_t>(cfg.vocab_size)], all[p]);
      CHECK_MESSAGE(err < 1e-4, name << " position " << p << ": relative error " << err);
    }
  }
}

TEST_CASE("log-probabilities stored as llama.cpp stores them read back within half a step") {
  std::mt19937 rng{3};
  std::normal_distribution<float> normal{0, 4};
  const int32_t vocab = 301; // odd: the row is padded
  std::vector<float> logits(vocab);
  for (auto& v : logits)
    v = normal(rng);
  std::vector<uint16_t> row(static_cast<size_t>(logprob_file::row_width(vocab)));
  CHECK(row.size() == 306);
  auto nll = store_log_probs(logits.data(), vocab, 17, row.data());
  CHECK(nll == doctest::Approx(nll_of(logits.data(), vocab, 17)).epsilon(1e-5));
  float scale, min_log_prob;
  std::memcpy(&scale, &row[0], sizeof scale);
  std::memcpy(&min_log_prob, &row[2], sizeof min_log_prob);
  CHECK(scale == doctest::Approx(16.0 / 65535)); // the range spans more than 16 nats
  double top = *std::max_element(logits.begin(), logits.end());
  double log_sum = nll_of(logits.data(), vocab, 0) - top + logits[0];
  for (int32_t i = 0; i < vocab; ++i) {
    double exact = logits[static_cast<size_t>(i)] - top - log_sum;
    double stored = scale * row[static_cast<size_t>(i) + 4] + min_log_prob;
    if (logits[static_cast<size_t>(i)] > top - 16)
      CHECK(std::abs(stored - exact) <= scale * 0.5 + 1e-5);
    else
      CHECK(stored == doctest::Approx(min_log_prob));
  }
}

TEST_CASE("perplexity and KL divergence from a saved base: zero against itself, small for the "
          "fast path, and malformed bases refused") {
  auto path = fixtures + "/llama-k-gguf/llama-k-q4_k_m.gguf";
  auto cfg = checkpoint::gguf_config(path);
  auto ckpt = checkpoint::from_gguf(path, cfg);
  cpu_device dev{0};
  llama_model exact{cfg, dev, 0, 1, dtype::f32, true, false};
  exact.load(ckpt);
  llama_model fast{cfg, dev, 0, 1, dtype::f32, true, true};
  fast.load(ckpt);
  kv_cache cache{dev, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16, 2, 0};
  auto chunks = random_chunks(static_cast<int32_t>(cfg.vocab_size), 32, 3);

  std::stringstream saved;
  chunks.write_header(saved);
  auto base = perplexity(exact, cache, chunks, -1, nullptr, &saved);
  CHECK(base.positions == 3 * 15);
  CHECK_FALSE(base.compared);
  // The perplexity over positions 16 … 30 of each chunk, computed here from the logits.
  double nll = 0;
  for (int32_t c = 0; c < 3; ++c) {
    std::vector<int32_t> tokens(chunks.tokens.begin() + c * 32,
                                chunks.tokens.begin() + (c + 1) * 32);
    auto logits = exact.prompt_logits(tokens, cache);
    for (int p = 16; p <= 30; ++p)
      nll += nll_of(&logits[static_cast<size_t>(p) * static_cast<size_t>(cfg.vocab_size)],
                    static_cast<int32_t>(cfg.vocab_size), tokens[static_cast<size_t>(p) + 1]);
  }
  CHECK(base.ppl == doctest::Approx(std::exp(nll / 45)).epsilon(1e-5));

  auto header = logprob_file::read_header(saved, "saved");
  CHECK(header.ctx == 32);
  CHECK(header.chunks == 3);
  CHECK(header.tokens == chunks.tokens);
  auto rows_at = saved.tellg();
  auto self = perplexity(exact, cache, header, -1, &saved);
  REQUIRE(self.compared);
  CHECK(self.kld.positions == 45);
  CHECK(std::abs(self.kld.mean_kld) < 1e-5); // only the 16-bit grid of the stored rows
  CHECK(self.kld.same_top == 1.0);
  CHECK(self.kld.ppl_base == doctest::Approx(base.ppl).epsilon(1e-4));

  saved.clear();
  saved.seekg(rows_at);
  auto quick = perplexity(fast, cache, header, -1, &saved);
  MESSAGE("the fast path's KL divergence from the exact one: "
          << quick.kld.mean_kld << ", same top " << quick.kld.same_top);
  CHECK(quick.kld.mean_kld <= 1e-3);
  if (cpu::has_int8_kernel(dtype::q4_k))
    CHECK(quick.kld.mean_kld > std::abs(self.kld.mean_kld));

  // A base cut short, of another vocabulary, or not a base at all.
  auto bytes = saved.str();
  std::stringstream cut{bytes.substr(0, bytes.size() - 100)};
  auto cut_header = logprob_file::read_header(cut, "cut");
  CHECK_THROWS_WITH_AS(perplexity(exact, cache, cut_header, -1, &cut),
                       "the base's log-probabilities end before chunk 3 of 3", error);
  auto other = chunks;
  other.vocab += 1;
  CHECK_THROWS_AS(perplexity(exact, cache, other, -1), error);
  std::stringstream text{"hello, world: not a base"};
  CHECK_THROWS_WITH_AS(logprob_file::read_header(text, "notes.txt"),
                       "'notes.txt' is not a log-probability file (it does not start with "
                       "_logits_)",
                       error);
}
