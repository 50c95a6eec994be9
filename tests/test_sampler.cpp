// The sampler on its own: greedy, temperature, top-k, top-p, seeds and logprobs; vLLM's
// penalties, logit_bias, min_tokens and min_p against transformers' processors and a
// re-implementation of vLLM's formulas (tests/fixtures/sampling.json, made by
// scripts/make-sampling-fixtures.py).

#include "kernels/sampler.hpp"
#include "tests/generation.hpp"
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
    auto x = raw;
    process_logits(x.data(), vocab, p, tokens, prompt.size(),
                   c["params"].value("stop_ids", std::vector<int32_t>{}));
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
