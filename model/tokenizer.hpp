#pragma once

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
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

/// Appends code point `c` to `out` as UTF-8.
void append_utf8(std::string& out, uint32_t c);

/// A BPE tokenizer read from a Hugging Face `tokenizer.json` or from a GGUF file's
/// `tokenizer.ggml.*` metadata: byte-level (GPT-2 style, as SmolLM2, Llama 3 and Qwen2 use)
/// or SentencePiece-style with byte fallback (as Llama 2 and Mistral use).
/// Encoding splits out added tokens, then runs the file's pipeline on the rest: its
/// normalizer (NFC, NFD, NFKC, NFKD, Prepend, Replace, or a sequence of them), its
/// pre-tokenizer (byte-level with or without GPT-2's pattern, a `Split` on the file's own
/// regex, `Digits`, `Metaspace`, or a sequence of them) and the BPE model (merges by rank;
/// a character without a token becomes its bytes' `<0xXX>` pieces or the unknown token);
/// with `add_special_tokens`, the post-processor's template (`TemplateProcessing`: Llama
/// 3's `<|begin_of_text|>` or Llama 2's `<s>` first) wraps the ids. Decoding runs the file's
/// decoder chain (ByteLevel, or Replace, ByteFallback, Fuse, Strip, Metaspace). A GGUF file
/// gets the pipeline its `tokenizer.ggml.model` and `tokenizer.ggml.pre` name. A step of
/// another type is refused with its name. Any valid UTF-8 text round-trips exactly through
/// a byte-level tokenizer. Bad input (invalid UTF-8, an unknown id) throws `troupe::error`
/// (`invalid_argument`).
class tokenizer {
public:
  /// Reads `tokenizer.json`; throws `invalid_argument` naming the file and the step for a
  /// model or step of a type it does not know.
  static tokenizer from_json(const std::string& path);

  /// Reads the tokenizer of a GGUF file: `tokenizer.ggml.model` `gpt2` (byte-level, with the
  /// pre-tokenizer `tokenizer.ggml.pre` names) or `llama` (SentencePiece pieces and scores).
  static tokenizer from_gguf(const std::string& path);

  /// The tokenizer of a model: a GGUF file's own, or a Hugging Face directory's
  /// `tokenizer.json`, else its SentencePiece `tokenizer.model`; none when it has neither.
  static std::optional<tokenizer> of_model(const std::string& path);

  /// Reads a SentencePiece BPE model file (`tokenizer.model`, as Llama 2 ships it): its
  /// pieces, scores and normalization; `<s>` starts the ids with `add_special_tokens`.
  static tokenizer from_sentencepiece(const std::string& path);

  /// Token ids of `text`; added tokens written in the text become their ids (special ones
  /// only when `parse_special`); the post-processor's template applies with `add_special_tokens`
  /// (as transformers' `add_special_tokens`).
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true,
                              bool add_special_tokens = false) const;

  /// Text of `ids`, always valid UTF-8 (see `valid_utf8`); special tokens are left out
  /// when `skip_special`.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  /// `decode` of the `count` ids from `ids`, written over `out` (whose memory is reused):
  /// the engine decodes a few tokens of every sequence at each step.
  void decode_into(const int32_t* ids, size_t count, bool skip_special, std::string& out) const;

  /// The bytes token `id` adds inside a text, UTF-8 or not (a byte-level token may hold
  /// part of a character); throws `invalid_argument` for an id outside the vocabulary.
  std::string token_bytes(int32_t id) const;

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
  /// The vocabulary's entry for `id` (a special token's text); throws `invalid_argument`
  /// for an id outside the vocabulary.
  const std::string& token_text(int32_t id) const;

private:
  /// The normalizer, pre-tokenizer, template and decoder (defined with the tokenizer).
  struct pipeline;

  tokenizer();

  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  /// The readers behind `from_json` and `from_gguf` (which turn library exceptions into
  /// `troupe::error`s naming the file).
  static tokenizer read_json(const std::string& path);
  static tokenizer read_gguf(const std::string& path);
  static tokenizer read_sentencepiece(const std::string& path);
  /// Fills `vocab_` and the byte pieces' ids from `id_to_token_`.
  void index_vocabulary(const std::string& origin);
  void add_merge(const std::string& left, const std::string& right, int32_t rank,
                 const std::string& origin);
  /// A merge written as "left right" (tokenizer.json's older form, GGUF's).
  void add_merge(const std::string& pair, int32_t rank, const std::string& origin);
  /// Takes a SentencePiece vocabulary: unknown and control pieces are special, those and
  /// user-defined pieces split the text.
  void read_pieces(const std::vector<std::string>& pieces, const std::vector<int>& types,
                   const std::string& origin);
  /// The merges of a SentencePiece BPE vocabulary from its scores, and its normalizer and
  /// decoder as tokenizer.json would write them.
  nlohmann::json sentencepiece_pipeline(const std::vector<double>& scores,
                                        const std::vector<int>& types, bool dummy_prefix,
                                        bool trim_spaces, const std::string& origin);
  /// The template: `<s>` first and `</s>` last, as asked.
  void set_template(bool add_bos, bool add_eos);
  /// Reads tokenizer.json's normalizer, pre-tokenizer, post-processor and decoder.
  void read_pipeline(const nlohmann::json& j, const std::string& origin);
  void finish(const std::string& origin);
  /// Throws `invalid_argument` for an id outside the vocabulary.
  void check_id(int32_t id) const;
  void encode_piece(const std::string& piece, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  struct merge {
    int32_t rank;
    int32_t id; // of the merged token
  };
  /// Merges by the ids of the pair (`pair_key`).
  std::unordered_map<uint64_t, merge> merges_;
  /// Where the decoder is ByteLevel alone, a text is its tokens' bytes joined (then made
  /// valid UTF-8): each token's bytes, one after another, token i's from `piece_at_[i]` to
  /// `piece_at_[i + 1]`. Empty for other decoders, whose tokens change by their
  /// neighbours (a leading space stripped, byte pieces that join into a character).
  std::string piece_bytes_;
  std::vector<uint32_t> piece_at_;
  /// Pieces map bytes to GPT-2's printable characters first (a ByteLevel pre-tokenizer).
  bool byte_level_ = false;
  /// A character without a token becomes the `<0xXX>` pieces of its bytes.
  bool byte_fallback_ = false;
  /// A piece that is a token is that token, whatever the merges would make of it.
  bool ignore_merges_ = false;
  /// Unknown characters in a row become one unknown token.
  bool fuse_unk_ = false;
  int32_t unk_ = -1;
  /// The id of each byte's `<0xXX>` piece, or -1.
  std::array<int32_t, 256> byte_ids_{};
  /// Added tokens (special or not), which split the text before the pipeline runs.
  std::set<int32_t> added_ids_;
  std::set<int32_t> special_ids_;
  /// Added tokens' texts, longest first, and their indices by first byte.
  std::vector<std::pair<std::string, int32_t>> added_;
  std::array<std::vector<size_t>, 256> added_by_byte_;
  int32_t bos_ = -1;
  int32_t eos_ = -1;
  std::shared_ptr<const pipeline> pipeline_;
};

/// The token sequences of vLLM's `bad_words`, as its sampling parameters derive them: each
/// word without its leading spaces, and again after one space where that tokenizes to as
/// many tokens starting with another one (a word inside a text).
std::vector<std::vector<int32_t>> bad_words_token_ids(const tokenizer& tok,
                                                      const std::vector<std::string>& words);

} // namespace troupe
