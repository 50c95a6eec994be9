#pragma once

/// @file
/// Perplexity of a model over chunks of tokens, and the KL divergence of its next-token
/// distributions from a base model's, measured as llama.cpp's `llama-perplexity` measures
/// them and stored in its log-probability file (`--kl-divergence-base`), so that either
/// tool reads what the other wrote.

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace troupe {

class llama_model;
class kv_cache;

/// llama.cpp's log-probability file: "_logits_", the context (uint32), the vocabulary and
/// the number of chunks (int32), every chunk's tokens (int32), then for each chunk the
/// stored rows (`store_log_probs`) of positions ctx/2 … ctx−2, each predicting the token
/// after it.
struct logprob_file {
  uint32_t ctx = 0;
  int32_t vocab = 0;
  int32_t chunks = 0;
  /// ctx × chunks tokens.
  std::vector<int32_t> tokens;

  /// Reads the header and tokens of `in`; throws `invalid_argument` naming `path` for a
  /// file that is not one, or is cut short.
  static logprob_file read_header(std::istream& in, const std::string& path);
  void write_header(std::ostream& out) const;

  /// uint16 values in one stored row: two floats (scale, smallest log-probability), then
  /// the vocabulary, padded to an even count.
  static int64_t row_width(int32_t vocab);
};

/// Stores one position's log-probabilities as llama.cpp does, in `row_width(vocab)`
/// values: log-probabilities from the largest down to 16 below it on a 16-bit grid, those
/// further below as the smallest. Returns −log p(`next`).
double store_log_probs(const float* logits, int32_t vocab, int32_t next, uint16_t* row);

/// How one model's next-token distributions compare with a base's over many positions
/// (llama.cpp's `--kl-divergence` figures).
struct kl_divergence_summary {
  int64_t positions = 0;
  double ppl = 0;
  double ppl_base = 0;
  /// KL(base ‖ model) in nats: mean, its standard error, and quantiles over positions.
  double mean_kld = 0;
  double kld_uncertainty = 0;
  double median_kld = 0;
  double kld_99 = 0;
  double max_kld = 0;
  /// Positions whose most likely token is the base's.
  double same_top = 0;
  /// Root mean square of p(next) − p_base(next).
  double rms_dp = 0;
};

/// What `perplexity` measured: the perplexity over the scored positions and, against a
/// base, the comparison.
struct perplexity_result {
  int64_t positions = 0;
  double ppl = 0;
  bool compared = false;
  kl_divergence_summary kld;
};

/// Runs `chunks.tokens` in chunks of `chunks.ctx` through `model`, each from position 0
/// with its first token replaced by `bos` (−1: kept), and scores the positions
/// ctx/2 … ctx−2 as llama.cpp does. With `base` (a stream past `chunks`' header), compares
/// each position with the base's stored row; with `save`, writes the rows (after the
/// caller wrote the header). `cache` holds at least `ctx` positions in its first blocks.
/// Throws `invalid_argument` for a context below 4 or a base cut short.
perplexity_result perplexity(llama_model& model, kv_cache& cache, const logprob_file& chunks,
                             int32_t bos, std::istream* base = nullptr,
                             std::ostream* save = nullptr);

} // namespace troupe
