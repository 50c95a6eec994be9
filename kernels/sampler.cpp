#include "kernels/sampler.hpp"

#include "kernels/backend.hpp"
#include "troupe/errors.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>
#include <vector>

namespace troupe {

bool processes_logits(const sampling_params& p) {
  return p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f ||
         p.frequency_penalty != 0.0f || !p.logit_bias_ids.empty() || p.min_tokens > 0 ||
         !p.bad_words_token_ids.empty();
}

void logit_edits(const sampling_params& p, int64_t vocab, const std::vector<int32_t>& tokens,
                 size_t prompt_len, const std::vector<int32_t>& stop_ids, int32_t row,
                 std::vector<logit_edit>& edits) {
  auto in_vocab = [&](int32_t t) { return t >= 0 && t < vocab; };
  auto output_len = tokens.size() - std::min(prompt_len, tokens.size());
  auto first = edits.size();
  // The edit of token t, made on first use.
  std::unordered_map<int32_t, size_t> at;
  auto of = [&](int32_t t) -> logit_edit& {
    auto [i, fresh] = at.emplace(t, edits.size());
    if (fresh) {
      logit_edit e;
      e.row = row;
      e.token = t;
      edits.push_back(e);
    }
    return edits[i->second];
  };
  // A bad word's last token, where the output ends with the rest of it.
  for (auto& word : p.bad_words_token_ids) {
    auto rest = word.size() - 1;
    if (word.empty() || rest > output_len || !in_vocab(word.back()))
      continue;
    if (std::equal(word.begin(), word.end() - 1, tokens.end() - static_cast<std::ptrdiff_t>(rest)))
      of(word.back()).banned = 1;
  }
  for (size_t i = 0; i < p.logit_bias_ids.size(); ++i) {
    auto t = p.logit_bias_ids[i];
    if (!in_vocab(t))
      throw error{errc::invalid_argument, "logit_bias names token " + std::to_string(t) +
                                            ", outside the vocabulary of " + std::to_string(vocab)};
    of(t).bias = p.logit_bias_values[i];
  }
  if (static_cast<int64_t>(output_len) < p.min_tokens)
    for (auto t : stop_ids)
      if (in_vocab(t))
        of(t).banned = 1;
  if (p.repetition_penalty != 1.0f)
    for (auto t : tokens)
      if (in_vocab(t))
        of(t).repetition = p.repetition_penalty;
  if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
    std::unordered_map<int32_t, int32_t> counts;
    for (size_t i = prompt_len; i < tokens.size(); ++i)
      if (in_vocab(tokens[i]))
        ++counts[tokens[i]];
    for (auto [t, n] : counts)
      of(t).subtract = p.frequency_penalty * static_cast<float>(n) + p.presence_penalty;
  }
  std::sort(edits.begin() + static_cast<std::ptrdiff_t>(first), edits.end(),
            [](const logit_edit& a, const logit_edit& b) { return a.token < b.token; });
}

bool bans_every_allowed(const logit_edit* edits, size_t count, const uint32_t* mask,
                        int64_t vocab) {
  int64_t banned = 0;
  for (size_t i = 0; i < count; ++i)
    banned += edits[i].banned != 0 && token_allowed(mask, edits[i].token) ? 1 : 0;
  // Every masked row asks each step: the allowed tokens are counted a word at a time, and
  // only until they outnumber the bans (a row's tokens are distinct in its edits).
  int64_t allowed = 0;
  auto words = (vocab + 31) / 32;
  for (int64_t w = 0; w < words && allowed <= banned; ++w) {
    auto bits = mask[w];
    if (w == words - 1 && vocab % 32 != 0)
      bits &= (1u << (vocab % 32)) - 1; // past the vocabulary
    allowed += __builtin_popcount(bits);
  }
  return banned == allowed;
}

void edit_row(const float* logits, float* out, int64_t vocab, const uint32_t* mask,
              const logit_edit* edits, size_t count) {
  if (mask != nullptr) {
    for (int64_t t = 0; t < vocab; ++t)
      out[t] = token_allowed(mask, t) ? logits[t] : -INFINITY;
  } else if (out != logits) {
    std::copy(logits, logits + vocab, out);
  }
  for (size_t i = 0; i < count; ++i)
    out[edits[i].token] = edited_logit(out[edits[i].token], edits[i]);
}

float log_partition(const float* logits, int64_t vocab) {
  float max_logit = *std::max_element(logits, logits + vocab);
  // Each term in float (within an ulp: a step's whole vocabulary goes through here), the
  // sum in double.
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i)
    sum += std::exp(logits[i] - max_logit);
  return static_cast<float>(max_logit + std::log(sum));
}

bool is_greedy(const sampling_params& params) {
  return params.temperature < row_sampling::greedy_below;
}

float draw_uniform(const sampling_params& params, int64_t stream, int64_t step,
                   std::mt19937_64& rng) {
  std::uniform_real_distribution<double> uniform{0.0, 1.0};
  double u;
  if (params.seed >= 0) {
    std::seed_seq seq{static_cast<uint64_t>(params.seed), static_cast<uint64_t>(stream),
                      static_cast<uint64_t>(step)};
    std::mt19937_64 seeded{seq};
    u = uniform(seeded);
  } else {
    u = uniform(rng);
  }
  // A double just below 1 rounds to 1.0f, which would put u × mass at the very end.
  return std::min(static_cast<float>(u), std::nextafter(1.0f, 0.0f));
}

int64_t choose_token(const float* logits, int64_t vocab, float temperature, int32_t top_k,
                     float top_p, double u, float min_p) {
  float max_logit = *std::max_element(logits, logits + vocab);
  // The kept tokens: the most likely first (ties by token), cut by top-k, then by top-p.
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  // Tokens tied with the last one kept are kept too, at both cuts (as the GPU's threshold
  // cuts do).
  auto with_ties = [&](size_t n) {
    while (n < static_cast<size_t>(vocab) && logits[order[n]] == logits[order[n - 1]])
      ++n;
    return n;
  };
  auto keep = static_cast<size_t>(vocab);
  if (top_k > 0 && top_k < vocab)
    keep = with_ties(static_cast<size_t>(top_k));
  // min_p: the most likely token's weight is 1, so a token stays when its weight reaches
  // min_p (a prefix of `order`, like top-k's).
  if (min_p > 0.0f) {
    size_t above = 1;
    while (above < keep &&
           std::exp(static_cast<double>(logits[order[above]] - max_logit) / temperature) >= min_p)
      ++above;
    keep = above;
  }
  std::vector<double> weight(static_cast<size_t>(vocab), 0.0);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) {
    auto t = order[i];
    weight[t] = std::exp(static_cast<double>(logits[t] - max_logit) / temperature);
    total += weight[t];
  }
  // Nucleus: the smallest prefix whose mass reaches top_p (at least one token).
  if (top_p < 1.0f) {
    double mass = 0;
    size_t cut = 0;
    while (cut < keep) {
      mass += weight[order[cut]];
      ++cut;
      if (mass >= top_p * total)
        break;
    }
    cut = std::min(with_ties(cut), keep);
    mass = 0;
    for (size_t i = 0; i < keep; ++i) {
      if (i >= cut)
        weight[order[i]] = 0.0;
      mass += weight[order[i]];
    }
    total = mass;
  }
  // The draw, in token order.
  auto target = u * total;
  double acc = 0;
  int64_t last = order[0];
  for (int64_t t = 0; t < vocab; ++t) {
    if (weight[t] == 0.0)
      continue;
    acc += weight[t];
    last = t;
    if (acc > target)
      return t;
  }
  return last; // u × total rounded up to the whole mass
}

sequence_output sample_token(const float* logits, int64_t vocab, const sampling_params& params,
                             int64_t stream, int64_t step, std::mt19937_64& rng,
                             const float* processed) {
  validate(params, vocab);
  // log-softmax of the model's distribution, for the reported logprobs.
  auto log_z = log_partition(logits, vocab);
  auto logprob = [&](int64_t i) { return logits[i] - log_z; };

  const float* drawn_from = processed ? processed : logits;
  int64_t chosen = 0;
  if (is_greedy(params))
    chosen = std::max_element(drawn_from, drawn_from + vocab) - drawn_from;
  else
    chosen = choose_token(drawn_from, vocab, params.temperature, params.top_k, params.top_p,
                          draw_uniform(params, stream, step, rng), params.min_p);
  sequence_output out;
  out.output_token = static_cast<int32_t>(chosen);
  out.logprob = logprob(chosen);
  out.rank = rank_of(logits, vocab, chosen);
  if (params.logprobs > 0)
    out.top_logprobs = most_likely(logits, vocab, log_z, params.logprobs);
  return out;
}

std::vector<token_logprob> most_likely(const float* logits, int64_t vocab, float log_z, int64_t n) {
  n = std::min(n, vocab);
  std::vector<int64_t> top(static_cast<size_t>(vocab));
  std::iota(top.begin(), top.end(), 0);
  std::partial_sort(top.begin(), top.begin() + n, top.end(), [&](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  std::vector<token_logprob> out;
  for (int64_t i = 0; i < n; ++i)
    out.push_back({static_cast<int32_t>(top[static_cast<size_t>(i)]),
                   logits[top[static_cast<size_t>(i)]] - log_z});
  return out;
}

int32_t rank_of(const float* logits, int64_t vocab, int64_t token) {
  auto at = logits[token];
  int32_t above = 0;
  for (int64_t i = 0; i < vocab; ++i)
    above += logits[i] > at ? 1 : 0;
  return 1 + above;
}

prompt_logprob prompt_logprob_of(const float* logits, int64_t vocab, int32_t position,
                                 int32_t token, int32_t top) {
  auto log_z = log_partition(logits, vocab);
  prompt_logprob p;
  p.position = position;
  p.token = token;
  p.logprob = logits[token] - log_z;
  p.rank = rank_of(logits, vocab, token);
  if (top > 0)
    p.top_logprobs = most_likely(logits, vocab, log_z, top);
  return p;
}

} // namespace troupe
