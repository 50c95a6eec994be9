// The sampler on its own: greedy, temperature, top-k, top-p, seeds and logprobs; vLLM's
// penalties, logit_bias, min_tokens and min_p against transformers' processors and a
// re-implementation of vLLM's formulas (tests/fixtures/sampling.json, made by
// scripts/make-sampling-fixtures.py).

#include "kernels/sampler.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "tests/generation.hpp"
#include "tests/random.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <algorithm>
#include <map>
#include <set>
#include <vector>

using namespace troupe;

namespace {

const std::vector<float> logits = {1.0f, 3.0f, 2.5f, -1.0f, 0.0f, 2.9f};

float log_softmax(int i) {
  double z = 0;
  for (auto l : logits)
    z += std::exp(l);
  return static_cast<float>(logits[i] - std::log(z));
}

sampling_params with(float temperature, int32_t top_k = -1, float top_p = 1.0f, int64_t seed = -1) {
  sampling_params p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

} // namespace

TEST_CASE("greedy picks the largest logit and reports the model's logprobs") {
  std::mt19937_64 rng{1};
  auto params = with(0.0f);
  params.logprobs = 2;
  auto out = sample_token(logits.data(), 6, params, 7, 0, rng);
  CHECK(out.output_token == 1);
  CHECK(out.logprob == doctest::Approx(log_softmax(1)));
  REQUIRE(out.top_logprobs.size() == 2);
  CHECK(out.top_logprobs[0].token == 1);
  CHECK(out.top_logprobs[1].token == 5);
}

TEST_CASE("top-k 1 and a tiny top-p are greedy whatever the temperature") {
  std::mt19937_64 rng{2};
  for (int i = 0; i < 20; ++i) {
    CHECK(sample_token(logits.data(), 6, with(5.0f, 1), 0, i, rng).output_token == 1);
    CHECK(sample_token(logits.data(), 6, with(5.0f, -1, 0.01f), 0, i, rng).output_token == 1);
  }
}

TEST_CASE("top-k keeps draws among the k best and temperature follows the distribution") {
  std::mt19937_64 rng{3};
  std::map<int32_t, int> counts;
  for (int i = 0; i < 3000; ++i)
    ++counts[sample_token(logits.data(), 6, with(1.0f, 3), 0, i, rng).output_token];
  for (auto& [token, n] : counts)
    CHECK((token == 1 || token == 2 || token == 5));
  // Among tokens 1 (3.0), 5 (2.9) and 2 (2.5) at temperature 1: p(1) = e^3 / (e^3 + e^2.9 + e^2.5).
  double p1 = std::exp(3.0) / (std::exp(3.0) + std::exp(2.9) + std::exp(2.5));
  CHECK(counts[1] / 3000.0 == doctest::Approx(p1).epsilon(0.1));
}

TEST_CASE("a seed gives the same token for the same sequence and step") {
  std::mt19937_64 a{10};
  std::mt19937_64 b{20};
  for (int step = 0; step < 20; ++step) {
    auto x = sample_token(logits.data(), 6, with(2.0f, -1, 1.0f, 99), 3, step, a);
    auto y = sample_token(logits.data(), 6, with(2.0f, -1, 1.0f, 99), 3, step, b);
    CHECK(x.output_token == y.output_token);
  }
}

TEST_CASE("out-of-range sampling parameters are errors") {
  std::mt19937_64 rng{4};
  CHECK_THROWS_AS(sample_token(logits.data(), 6, with(1.0f, -1, 0.0f), 0, 0, rng), error);
  CHECK_THROWS_AS(sample_token(logits.data(), 6, with(-1.0f), 0, 0, rng), error);
}

TEST_CASE("a draw walks the kept tokens in token order") {
  std::vector<float> logits{0.0f, 2.0f, 1.0f, 3.0f};
  // top-k 2 keeps tokens 3 and 1 (weights 1 and e^-1); token 1 comes first in the walk.
  auto w1 = std::exp(-1.0);
  auto total = 1.0 + w1;
  CHECK(choose_token(logits.data(), 4, 1.0f, 2, 1.0f, 0.5 * w1 / total) == 1);
  CHECK(choose_token(logits.data(), 4, 1.0f, 2, 1.0f, (w1 + 0.5) / total) == 3);
  CHECK(choose_token(logits.data(), 4, 1.0f, 2, 1.0f, 0.999999) == 3);
  // top-p 0.5: token 3 alone holds 64 % of the mass.
  for (double u : {0.0, 0.3, 0.99})
    CHECK(choose_token(logits.data(), 4, 1.0f, -1, 0.5f, u) == 3);
  // Without cuts every token can be drawn, in token order.
  CHECK(choose_token(logits.data(), 4, 1.0f, -1, 1.0f, 0.0) == 0);
}

TEST_CASE("the cuts keep tokens tied with their last, and NaN parameters are refused") {
  std::vector<float> logits{1.0f, 3.0f, 2.0f, 2.0f, 0.0f};
  // top-k 2 keeps 3.0 and both 2.0s: the draw reaches token 3 only if ties are kept.
  CHECK(choose_token(logits.data(), 5, 1.0f, 2, 1.0f, 0.999) == 3);
  std::mt19937_64 rng{1};
  sampling_params nan_temperature;
  nan_temperature.temperature = std::nanf("");
  CHECK_THROWS_AS(sample_token(logits.data(), 5, nan_temperature, 0, 0, rng), error);
  sampling_params nan_top_p;
  nan_top_p.temperature = 1.0f;
  nan_top_p.top_p = std::nanf("");
  CHECK_THROWS_AS(sample_token(logits.data(), 5, nan_top_p, 0, 0, rng), error);
  // The largest draw stays below the whole mass.
  CHECK(draw_uniform(nan_top_p, 0, 0, rng) < 1.0f);
}

namespace {

sampling_params from_json(const nlohmann::json& j) {
  sampling_params p;
  p.repetition_penalty = j.value("repetition_penalty", 1.0f);
  p.presence_penalty = j.value("presence_penalty", 0.0f);
  p.frequency_penalty = j.value("frequency_penalty", 0.0f);
  p.min_tokens = j.value("min_tokens", 0);
  p.logit_bias_ids = j.value("logit_bias_ids", std::vector<int32_t>{});
  p.logit_bias_values = j.value("logit_bias_values", std::vector<float>{});
  p.bad_words_token_ids = j.value("bad_words_token_ids", std::vector<std::vector<int32_t>>{});
  return p;
}

} // namespace

TEST_CASE("bad words, penalties, logit_bias and min_tokens change the logits as vLLM's sampler "
          "does") {
  auto f = testing::read_json(TROUPE_SOURCE_DIR "/tests/fixtures/sampling.json");
  auto raw = f["logits"].get<std::vector<float>>();
  auto prompt = f["prompt"].get<std::vector<int32_t>>();
  auto output = f["output"].get<std::vector<int32_t>>();
  auto tokens = prompt;
  tokens.insert(tokens.end(), output.begin(), output.end());
  auto vocab = static_cast<int64_t>(raw.size());
  for (auto& c : f["cases"]) {
    CAPTURE(c["params"].dump());
    auto p = from_json(c["params"]);
    CHECK(processes_logits(p));
    std::vector<logit_edit> edits;
    logit_edits(p, vocab, tokens, prompt.size(),
                c["params"].value("stop_ids", std::vector<int32_t>{}), 0, edits);
    auto x = raw;
    edit_row(raw.data(), x.data(), vocab, nullptr, edits.data(), edits.size());
    auto want = c["processed"];
    for (int64_t i = 0; i < vocab; ++i) {
      if (want[i].is_null() || std::isinf(want[i].get<double>()) || want[i].get<double>() < -1e30) {
        CHECK(std::isinf(x[i]));
        continue;
      }
      CHECK(x[i] == doctest::Approx(want[i].get<float>()).epsilon(1e-6));
    }
  }
  CHECK_FALSE(processes_logits(sampling_params{}));
}

TEST_CASE("the CPU backend draws rows under edits, masks and min_p as the host sampler does") {
  cpu_device host{0};
  auto cpu = make_backend(host, 2);
  const int64_t rows = 5, vocab = 3000, words = (vocab + 31) / 32;
  auto logits = testing::random_floats(rows * vocab, 31, 2.0f);
  std::vector<int32_t> tokens{1, 2, 3, 777, 9, 9, 11, 40, 40, 40, 11, 2999};
  const size_t prompt_len = 4;
  std::vector<sampling_params> sp(rows);
  sp[0].temperature = 0.0f; // greedy, penalised
  sp[0].repetition_penalty = 1.5f;
  sp[1].temperature = 1.0f; // min_p alone: no edits
  sp[1].min_p = 0.2f;
  sp[2].temperature = 0.8f;
  sp[2].top_k = 50;
  sp[2].top_p = 0.9f;
  sp[2].frequency_penalty = 0.5f;
  sp[2].presence_penalty = -0.3f;
  sp[2].logit_bias_ids = {5, 777};
  sp[2].logit_bias_values = {4.0f, -1.0f};
  sp[2].min_p = 0.01f;
  sp[3].temperature = 1.1f; // masked, with bans
  sp[3].min_tokens = 20;
  sp[3].bad_words_token_ids = {{11, 12}};
  sp[4].temperature = 1.0f; // masked to stop tokens that min_tokens bans: the mask decides
  sp[4].min_tokens = 20;
  std::vector<uint32_t> masks(rows * words, ~0u);
  for (int64_t w = 0; w < words; ++w) {
    masks[3 * words + w] = w % 2 == 0 ? 0x00ff00ffu : 0u;
    masks[4 * words + w] = 0u;
  }
  masks[4 * words] = 1u << 7; // token 7 only, a stop token
  const std::vector<int32_t> stop_ids{7, 12, 0};
  for (int64_t seed : {1, 2, 3, 4}) {
    std::mt19937_64 rng{1};
    std::vector<logit_edit> edits;
    std::vector<row_sampling> params(rows);
    std::vector<std::vector<float>> processed(rows);
    std::vector<sequence_output> want;
    for (int64_t r = 0; r < rows; ++r) {
      auto p = sp[static_cast<size_t>(r)];
      p.seed = seed;
      auto first = edits.size();
      logit_edits(p, vocab, tokens, prompt_len, stop_ids, static_cast<int32_t>(r), edits);
      const uint32_t* mask = r >= 3 ? &masks[static_cast<size_t>(r * words)] : nullptr;
      if (mask != nullptr &&
          bans_every_allowed(edits.data() + first, edits.size() - first, mask, vocab))
        edits.resize(first);
      auto& row = params[static_cast<size_t>(r)];
      if (!is_greedy(p))
        row = {p.temperature, p.top_k, p.top_p, draw_uniform(p, r, 3, rng), p.min_p, 0, 0};
      row.masked = mask != nullptr ? 1 : 0;
      row.edited = mask != nullptr || edits.size() > first ? 1 : 0;
      const float* raw = &logits[static_cast<size_t>(r * vocab)];
      const float* drawn_from = nullptr;
      if (row.edited != 0) {
        processed[static_cast<size_t>(r)].resize(vocab);
        edit_row(raw, processed[static_cast<size_t>(r)].data(), vocab, mask, edits.data() + first,
                 edits.size() - first);
        drawn_from = processed[static_cast<size_t>(r)].data();
      }
      want.push_back(sample_token(raw, vocab, p, r, 3, rng, drawn_from));
    }
    CHECK(params[1].edited == 0);
    CHECK(params[4].edited == 1);
    std::vector<float> edited(logits.size());
    cpu->edit_logits(logits.data(), edited.data(), rows, vocab, params.data(), edits.data(),
                     static_cast<int64_t>(edits.size()), masks.data(), words);
    std::vector<int32_t> ids(rows);
    std::vector<float> logprobs(rows);
    std::vector<int32_t> ranks(rows);
    cpu->sample(logits.data(), edited.data(), rows, vocab, params.data(), ids.data(),
                logprobs.data(), ranks.data());
    for (int64_t r = 0; r < rows; ++r) {
      CAPTURE(r);
      CAPTURE(seed);
      auto& w = want[static_cast<size_t>(r)];
      CHECK(ids[static_cast<size_t>(r)] == w.output_token);
      CHECK(logprobs[static_cast<size_t>(r)] == doctest::Approx(w.logprob).epsilon(1e-5));
      CHECK(ranks[static_cast<size_t>(r)] == w.rank);
      if (params[static_cast<size_t>(r)].edited != 0)
        CHECK(std::equal(processed[static_cast<size_t>(r)].begin(),
                         processed[static_cast<size_t>(r)].end(), edited.begin() + r * vocab));
    }
    // The mask decides row 4; row 3 draws only what its mask allows and min_tokens does not ban.
    CHECK(ids[4] == 7);
    CHECK((masks[static_cast<size_t>(3 * words + ids[3] / 32)] >> (ids[3] % 32) & 1) == 1);
    CHECK(std::find(stop_ids.begin(), stop_ids.end(), ids[3]) == stop_ids.end());
  }
}

TEST_CASE("edits ban every allowed token only when each token the mask allows is banned") {
  const int64_t vocab = 70; // the last word's bits past token 69 are not tokens
  std::vector<uint32_t> mask(3, 0);
  auto allow = [&](int32_t t) { mask[static_cast<size_t>(t / 32)] |= 1u << (t % 32); };
  allow(3);
  allow(40);
  mask[2] |= 1u << 31; // token 95, past the vocabulary
  auto ban = [](int32_t t) {
    logit_edit e;
    e.token = t;
    e.banned = 1;
    return e;
  };
  std::vector<logit_edit> both{ban(3), ban(40)}, one{ban(3)}, others{ban(5), ban(6)};
  CHECK(bans_every_allowed(both.data(), both.size(), mask.data(), vocab));
  CHECK_FALSE(bans_every_allowed(one.data(), one.size(), mask.data(), vocab));
  CHECK_FALSE(bans_every_allowed(others.data(), others.size(), mask.data(), vocab));
  logit_edit biased;
  biased.token = 40;
  biased.bias = -5.0f; // changed, not banned
  std::vector<logit_edit> bias_only{ban(3), biased};
  CHECK_FALSE(bans_every_allowed(bias_only.data(), bias_only.size(), mask.data(), vocab));
  std::vector<uint32_t> none(3, 0);
  CHECK(bans_every_allowed(nullptr, 0, none.data(), vocab));
}

TEST_CASE("min_p keeps the tokens transformers' MinPLogitsWarper keeps") {
  auto f = testing::read_json(TROUPE_SOURCE_DIR "/tests/fixtures/sampling.json");
  auto raw = f["logits"].get<std::vector<float>>();
  auto vocab = static_cast<int64_t>(raw.size());
  for (auto& c : f["min_p"]) {
    auto min_p = c["min_p"].get<float>();
    auto t = c["temperature"].get<float>();
    CAPTURE(min_p);
    CAPTURE(t);
    auto kept = c["kept"].get<std::vector<int64_t>>();
    // Each kept token is drawn for a u in the middle of its share of the running sum in
    // token order; nothing else is ever drawn.
    float top = *std::max_element(raw.begin(), raw.end());
    double total = 0;
    for (auto i : kept)
      total += std::exp(static_cast<double>(raw[i] - top) / t);
    double before = 0;
    for (auto i : kept) {
      double w = std::exp(static_cast<double>(raw[i] - top) / t);
      CHECK(choose_token(raw.data(), vocab, t, -1, 1.0f, (before + w / 2) / total, min_p) == i);
      before += w;
    }
    std::set<int64_t> drawn;
    for (int k = 0; k < 2000; ++k)
      drawn.insert(choose_token(raw.data(), vocab, t, -1, 1.0f, (k + 0.5) / 2000, min_p));
    for (auto i : drawn)
      CHECK(std::find(kept.begin(), kept.end(), i) != kept.end());
  }
}

TEST_CASE("the new parameters out of range are refused, naming them") {
  auto refused = [](auto change, const char* name) {
    sampling_params p;
    change(p);
    CHECK_THROWS_WITH_AS(validate(p, 100), doctest::Contains(name), error);
  };
  refused([](sampling_params& p) { p.repetition_penalty = 0; }, "repetition_penalty");
  refused([](sampling_params& p) { p.presence_penalty = 2.5f; }, "presence_penalty");
  refused([](sampling_params& p) { p.frequency_penalty = NAN; }, "frequency_penalty");
  refused([](sampling_params& p) { p.min_p = 1.5f; }, "min_p");
  refused([](sampling_params& p) { p.min_tokens = -1; }, "min_tokens");
  refused(
    [](sampling_params& p) {
      p.logit_bias_ids = {100};
      p.logit_bias_values = {1};
    },
    "logit_bias names token 100");
  refused([](sampling_params& p) { p.logit_bias_ids = {1}; }, "logit_bias");
}
