#include "model/sampler.hpp"

#include "troupe/errors.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace troupe {

sequence_output sample_token(const float* logits, int64_t vocab, const sampling_params& params,
                             int64_t seq_id, int64_t step, std::mt19937_64& rng) {
  if (params.top_p <= 0.0f || params.top_p > 1.0f)
    throw error{errc::invalid_argument, "top_p must be in (0, 1], got " + std::to_string(params.top_p)};
  if (params.temperature < 0.0f)
    throw error{errc::invalid_argument,
                "temperature must be >= 0, got " + std::to_string(params.temperature)};
  // log-softmax of the model's distribution, for the reported logprobs.
  float max_logit = *std::max_element(logits, logits + vocab);
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i)
    sum += std::exp(static_cast<double>(logits[i] - max_logit));
  auto log_z = static_cast<float>(max_logit + std::log(sum));
  auto logprob = [&](int64_t i) { return logits[i] - log_z; };

  int64_t chosen = 0;
  if (params.temperature < 1e-5f) {
    chosen = std::max_element(logits, logits + vocab) - logits;
  } else {
    std::vector<int64_t> order(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    auto keep = static_cast<size_t>(vocab);
    if (params.top_k > 0)
      keep = std::min(keep, static_cast<size_t>(params.top_k));
    std::vector<double> probs(keep);
    double total = 0;
    for (size_t i = 0; i < keep; ++i) {
      probs[i] = std::exp(static_cast<double>(logits[order[i]] - max_logit) / params.temperature);
      total += probs[i];
    }
    // Nucleus: the smallest prefix whose mass reaches top_p (at least one token).
    if (params.top_p < 1.0f) {
      double mass = 0;
      size_t cut = 0;
      while (cut < keep) {
        mass += probs[cut] / total;
        ++cut;
        if (mass >= params.top_p)
          break;
      }
      keep = cut;
      probs.resize(keep);
      total = std::accumulate(probs.begin(), probs.end(), 0.0);
    }
    double u;
    if (params.seed >= 0) {
      std::seed_seq seq{static_cast<uint64_t>(params.seed), static_cast<uint64_t>(seq_id),
                        static_cast<uint64_t>(step)};
      std::mt19937_64 seeded{seq};
      u = std::uniform_real_distribution<double>{0.0, total}(seeded);
    } else {
      u = std::uniform_real_distribution<double>{0.0, total}(rng);
    }
    size_t pick = 0;
    for (double acc = probs[0]; acc < u && pick + 1 < keep; acc += probs[++pick]) {
    }
    chosen = order[pick];
  }
  sequence_output out;
  out.parent_seq_id = seq_id;
  out.output_token = static_cast<int32_t>(chosen);
  out.logprob = logprob(chosen);
  if (params.logprobs > 0) {
    auto n = std::min<int64_t>(params.logprobs, vocab);
    std::vector<int64_t> top(static_cast<size_t>(vocab));
    std::iota(top.begin(), top.end(), 0);
    std::partial_sort(top.begin(), top.begin() + n, top.end(),
                      [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
    for (int64_t i = 0; i < n; ++i)
      out.top_logprobs.push_back({static_cast<int32_t>(top[i]), logprob(top[i])});
  }
  return out;
}

} // namespace troupe
