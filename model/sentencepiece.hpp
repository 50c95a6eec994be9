#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace troupe {

/// What a SentencePiece model file (`tokenizer.model`, a `ModelProto` in protobuf's wire
/// format) says about its vocabulary and its normalization.
struct sentencepiece_model {
  /// Piece types, as SentencePiece (and GGUF's `tokenizer.ggml.token_type`) number them.
  enum piece_type { normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6 };

  std::vector<std::string> pieces;
  std::vector<double> scores;
  std::vector<int> types;
  /// 1 unigram, 2 BPE, 3 word, 4 char.
  int model_type = 1;
  bool byte_fallback = false;
  int32_t unk_id = 0;
  int32_t bos_id = 1;
  int32_t eos_id = 2;
  bool treat_whitespace_as_suffix = false;
  /// The normalizer: its rule name and whether it carries a compiled character map.
  std::string normalizer_name;
  bool has_charsmap = false;
  bool add_dummy_prefix = true;
  bool remove_extra_whitespaces = true;
  bool escape_whitespaces = true;
};

/// Reads a SentencePiece model file; throws `troupe::error` (`invalid_argument`) naming the
/// file when it cannot be read or is not a well-formed model.
sentencepiece_model read_sentencepiece_model(const std::string& path);

} // namespace troupe
