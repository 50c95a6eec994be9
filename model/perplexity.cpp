#include "model/perplexity.hpp"

#include "model/kv_cache.hpp"
#include "model/llama.hpp"
#include "troupe/errors.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <istream>
#include <ostream>
#include <tuple>
#include <utility>

namespace troupe {

namespace {

constexpr char magic[8] = {'_', 'l', 'o', 'g', 'i', 't', 's', '_'};

/// The largest logit, where it is, and log Σ exp(logit − largest).
struct softmax_terms {
  float max = 0;
  int32_t argmax = 0;
  float log_sum = 0;
};

softmax_terms terms_of(const float* logits, int32_t vocab) {
  softmax_terms t;
  t.max = logits[0];
  for (int32_t i = 1; i < vocab; ++i)
    if (logits[i] > t.max) {
      t.max = logits[i];
      t.argmax = i;
    }
  double sum = 0;
  for (int32_t i = 0; i < vocab; ++i)
    sum += std::exp(logits[i] - t.max);
  t.log_sum = static_cast<float>(std::log(sum));
  return t;
}

/// `store_log_probs` with the logits' `terms_of` at hand.
void store_row(const float* logits, int32_t vocab, const softmax_terms& t, uint16_t* row) {
  float low = logits[0];
  for (int32_t i = 1; i < vocab; ++i)
    low = std::min(low, logits[i]);
  low = std::max(low, t.max - 16);
  const float min_log_prob = low - t.max - t.log_sum;
  const float scale = (t.max - low) / 65535.f;
  std::memcpy(row, &scale, sizeof scale);
  std::memcpy(row + 2, &min_log_prob, sizeof min_log_prob);
  uint16_t* q = row + 4;
  std::fill(q, row + logprob_file::row_width(vocab), uint16_t{0});
  if (scale > 0)
    for (int32_t i = 0; i < vocab; ++i)
      if (logits[i] > low)
        q[i] = static_cast<uint16_t>(std::lrint((logits[i] - low) / scale));
}

/// Mean of the values whose sum and sum of squares are given, and its standard error
/// (none for 10 values or fewer, as llama.cpp reports it).
std::pair<double, double> mean_and_error(double sum, double sum2, int64_t count) {
  if (count < 1)
    return {0, 0};
  double mean = sum / static_cast<double>(count);
  double var = sum2 / static_cast<double>(count) - mean * mean;
  return {mean, var > 0 && count > 10 ? std::sqrt(var / static_cast<double>(count - 1)) : 0};
}

/// The `fraction` quantile of sorted `values`, interpolated between neighbours.
double quantile_of(const std::vector<float>& values, double fraction) {
  if (values.empty())
    return 0;
  double at = fraction * static_cast<double>(values.size() - 1);
  auto below = static_cast<size_t>(at);
  auto above = std::min(below + 1, values.size() - 1);
  at -= static_cast<double>(below);
  return (1 - at) * values[below] + at * values[above];
}

/// The running sums of a comparison with a base.
struct kld_sums {
  double nll = 0, nll2 = 0, nll_base = 0, kld = 0, kld2 = 0, dp2 = 0;
  int64_t same_top = 0;
  std::vector<float> klds;

  /// One position: the model's logits (and their `terms_of`), the base's stored row.
  void add(const float* logits, int32_t vocab, const softmax_terms& t, const uint16_t* row,
           int32_t next) {
    float scale, min_log_prob;
    std::memcpy(&scale, row, sizeof scale);
    std::memcpy(&min_log_prob, row + 2, sizeof min_log_prob);
    const uint16_t* q = row + 4;
    const float nll_here = t.max + t.log_sum - logits[next];
    const float nll_of_base = -(scale * q[next] + min_log_prob);
    nll += nll_here;
    nll2 += static_cast<double>(nll_here) * nll_here;
    nll_base += nll_of_base;
    // KL(base ‖ model), over the tokens the base stored above its floor.
    const float shift = t.max + t.log_sum;
    double sum = 0;
    int32_t base_top = 0;
    float base_top_value = 0;
    for (int32_t i = 0; i < vocab; ++i) {
      float log_base = scale * q[i] + min_log_prob;
      if (i == 0 || log_base > base_top_value) {
        base_top_value = log_base;
        base_top = i;
      }
      if (log_base > -16.f)
        sum += std::exp(log_base) * (log_base - logits[i] + shift);
    }
    kld += sum;
    kld2 += sum * sum;
    klds.push_back(static_cast<float>(sum));
    same_top += t.argmax == base_top;
    double dp = std::exp(-nll_here) - std::exp(-nll_of_base);
    dp2 += dp * dp;
  }

  kl_divergence_summary summary() const {
    kl_divergence_summary s;
    auto n = static_cast<int64_t>(klds.size());
    s.positions = n;
    if (n == 0)
      return s;
    auto dn = static_cast<double>(n);
    s.ppl = std::exp(nll / dn);
    s.ppl_base = std::exp(nll_base / dn);
    std::tie(s.mean_kld, s.kld_uncertainty) = mean_and_error(kld, kld2, n);
    auto sorted = klds;
    std::sort(sorted.begin(), sorted.end());
    s.median_kld = quantile_of(sorted, 0.5);
    s.kld_99 = quantile_of(sorted, 0.99);
    s.max_kld = sorted.back();
    s.same_top = static_cast<double>(same_top) / dn;
    s.rms_dp = std::sqrt(dp2 / dn);
    return s;
  }
};

template <class T>
void read_value(std::istream& in, T& value, const std::string& path, const char* what) {
  if (!in.read(reinterpret_cast<char*>(&value), sizeof value))
    throw error{errc::invalid_argument, "'" + path + "' ends before its " + what};
}

} // namespace

int64_t logprob_file::row_width(int32_t vocab) {
  return 2 * ((static_cast<int64_t>(vocab) + 1) / 2) + 4;
}

logprob_file logprob_file::read_header(std::istream& in, const std::string& path) {
  char check[sizeof magic];
  if (!in.read(check, sizeof check) || std::memcmp(check, magic, sizeof magic) != 0)
    throw error{errc::invalid_argument,
                "'" + path + "' is not a log-probability file (it does not start with _logits_)"};
  logprob_file f;
  read_value(in, f.ctx, path, "context");
  read_value(in, f.vocab, path, "vocabulary size");
  read_value(in, f.chunks, path, "chunk count");
  if (f.ctx < 4 || f.ctx > (1u << 24) || f.vocab < 1 || f.chunks < 1 || f.chunks > (1 << 20))
    throw error{errc::invalid_argument, "'" + path + "' has context " + std::to_string(f.ctx) +
                                          ", vocabulary " + std::to_string(f.vocab) + " and " +
                                          std::to_string(f.chunks) + " chunks"};
  f.tokens.resize(static_cast<size_t>(f.ctx) * static_cast<size_t>(f.chunks));
  if (!in.read(reinterpret_cast<char*>(f.tokens.data()),
               static_cast<std::streamsize>(f.tokens.size() * sizeof(int32_t))))
    throw error{errc::invalid_argument, "'" + path + "' ends before its tokens"};
  return f;
}

void logprob_file::write_header(std::ostream& out) const {
  out.write(magic, sizeof magic);
  out.write(reinterpret_cast<const char*>(&ctx), sizeof ctx);
  out.write(reinterpret_cast<const char*>(&vocab), sizeof vocab);
  out.write(reinterpret_cast<const char*>(&chunks), sizeof chunks);
  out.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size() * sizeof(int32_t)));
}

double store_log_probs(const float* logits, int32_t vocab, int32_t next, uint16_t* row) {
  auto t = terms_of(logits, vocab);
  store_row(logits, vocab, t, row);
  return t.max + t.log_sum - logits[next];
}

perplexity_result perplexity(llama_model& model, kv_cache& cache, const logprob_file& chunks,
                             int32_t bos, std::istream* base, std::ostream* save) {
  const auto ctx = static_cast<int64_t>(chunks.ctx);
  if (ctx < 4)
    throw error{errc::invalid_argument,
                "perplexity: the context must hold at least 4 tokens, not " + std::to_string(ctx)};
  const int32_t vocab = chunks.vocab;
  if (vocab != model.config().vocab_size)
    throw error{errc::invalid_argument, "perplexity: the tokens are of a vocabulary of " +
                                          std::to_string(vocab) + ", the model's has " +
                                          std::to_string(model.config().vocab_size)};
  const int64_t first = ctx / 2;
  const int64_t scored = ctx - 1 - first;
  const auto width = logprob_file::row_width(vocab);
  // The stored rows of a chunk: the base's as read, then this model's to save.
  std::vector<uint16_t> rows(base || save ? static_cast<size_t>(scored * width) : 0);
  kld_sums sums;
  double nll = 0;
  perplexity_result result;
  for (int32_t c = 0; c < chunks.chunks; ++c) {
    auto begin = chunks.tokens.begin() + c * ctx;
    std::vector<int32_t> tokens(begin, begin + ctx);
    if (bos >= 0)
      tokens[0] = bos;
    auto logits = model.prompt_logits(tokens, cache);
    if (base && !base->read(reinterpret_cast<char*>(rows.data()),
                            static_cast<std::streamsize>(rows.size() * sizeof(uint16_t))))
      throw error{errc::invalid_argument, "the base's log-probabilities end before chunk " +
                                            std::to_string(c + 1) + " of " +
                                            std::to_string(chunks.chunks)};
    for (int64_t j = 0; j < scored; ++j) {
      const float* at = &logits[static_cast<size_t>((first + j) * vocab)];
      auto next = tokens[static_cast<size_t>(first + j + 1)];
      auto t = terms_of(at, vocab);
      nll += t.max + t.log_sum - at[next];
      if (base)
        sums.add(at, vocab, t, &rows[static_cast<size_t>(j * width)], next);
      if (save)
        store_row(at, vocab, t, &rows[static_cast<size_t>(j * width)]);
    }
    if (save)
      save->write(reinterpret_cast<const char*>(rows.data()),
                  static_cast<std::streamsize>(rows.size() * sizeof(uint16_t)));
    result.positions += scored;
  }
  result.ppl = std::exp(nll / static_cast<double>(result.positions));
  if (base) {
    result.compared = true;
    result.kld = sums.summary();
  }
  return result;
}

} // namespace troupe
