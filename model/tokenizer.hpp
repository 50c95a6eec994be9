#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace troupe {

/// `bytes` with each ill-formed UTF-8 sequence (its maximal ill-formed subpart: a cut-off
/// character, a stray continuation byte, an overlong form, a surrogate) replaced by U+FFFD,
/// as Python's and Rust's lossy decoders (and so transformers) do.
std::string valid_utf8(std::string_view bytes);

/// A byte-level BPE tokenizer (GPT-2 style, as SmolLM2, Llama 3 and Qwen2 use), read from a
/// Hugging Face `tokenizer.json` or from a GGUF file's `tokenizer.ggml.*` metadata.
/// Encoding splits out special tokens, then runs the file's pipeline on the rest: its
/// normalizer (NFC, NFD, NFKC, NFKD, or a sequence of them), its pre-tokenizer (byte-level
/// with or without GPT-2's pattern, a `Split` on the file's own regex, `Digits`, or a
/// sequence of them), maps bytes to printable characters and applies the merges by rank;
/// with `add_special_tokens`, the post-processor's template (`TemplateProcessing`: Llama
/// 3's `<|begin_of_text|>` first) wraps the ids. A step of another type is refused with
/// its name. A GGUF file gets GPT-2's pattern. Decoding reverses the bytes, so any valid
/// UTF-8 text round-trips exactly. Bad input (invalid UTF-8, an unknown id) throws
/// `troupe::error` (`invalid_argument`).
class tokenizer {
public:
  /// Reads `tokenizer.json`; throws `invalid_argument` naming the file for a model that is
  /// not byte-level BPE.
  static tokenizer from_json(const std::string& path);

  /// Reads the tokenizer of a GGUF file (`tokenizer.ggml.model` must be `gpt2`).
  static tokenizer from_gguf(const std::string& path);

  /// Token ids of `text`; special tokens written in the text become their ids when
  /// `parse_special`; the post-processor's template applies with `add_special_tokens` (as
  /// transformers' `add_special_tokens`).
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true,
                              bool add_special_tokens = false) const;

  /// Text of `ids`, always valid UTF-8 (see `valid_utf8`); special tokens are left out
  /// when `skip_special`.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  /// The id of a token's text, or -1.
  int32_t token_id(const std::string& token) const;

  size_t vocab_size() const {
    return id_to_token_.size();
  }
  int32_t bos_id() const {
    return bos_;
  }
  int32_t eos_id() const {
    return eos_;
  }
  bool is_special(int32_t id) const {
    return special_ids_.count(id) > 0;
  }
  /// The Jinja chat template shipped with the tokenizer; empty when none.
  const std::string& chat_template() const {
    return chat_template_;
  }

private:
  tokenizer();

  void add_merge(const std::string& left, const std::string& right, int32_t rank);
  /// Reads tokenizer.json's normalizer, pre-tokenizer, post-processor and decoder.
  void read_pipeline(const nlohmann::json& j, const std::string& origin);
  void finish(const std::string& origin);
  void encode_piece(const std::string& piece, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  /// Rank of the merge of two symbols, keyed by "left right" (a space never occurs inside
  /// a byte-level symbol: it is mapped to "Ġ").
  std::unordered_map<std::string, int32_t> merge_ranks_;
  /// Special tokens, longest first, for splitting text.
  std::vector<std::pair<std::string, int32_t>> specials_;
  std::set<int32_t> special_ids_;
  int32_t bos_ = -1;
  int32_t eos_ = -1;
  std::string chat_template_;
  /// Normalizer, pre-tokenizer and template (defined with the tokenizer).
  struct pipeline;
  std::shared_ptr<const pipeline> pipeline_;
};

} // namespace troupe
