#pragma once

/// @file
/// Structured output (vLLM's guided decoding): a JSON schema, JSON-object mode or a choice
/// of strings compiled into a pushdown automaton over bytes; each step, the tokens whose
/// bytes keep the output inside it, found by walking a trie of the vocabulary's bytes with
/// the automaton and cached per automaton state.

#include "model/tokenizer.hpp"
#include "troupe/types.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace troupe {

/// A bitmask over token ids: bit t of word t / 32.
using token_mask = std::vector<uint32_t>;

class output_grammar;

/// One request's place in its grammar: what it may sample next, advanced by what it did.
class output_guide {
public:
  explicit output_guide(std::shared_ptr<output_grammar> grammar);
  ~output_guide();

  /// The tokens the output may continue with (the end tokens once it is complete).
  const token_mask& allowed();

  /// Advances past `token` (one `allowed` gave). An end token completes the output.
  void accept(int32_t token);

private:
  struct state;
  std::shared_ptr<output_grammar> grammar_;
  std::unique_ptr<state> state_;
};

/// The vocabulary as the automata see it (each token's bytes, in a trie), and the grammars
/// compiled so far (by what the requests asked), whose masks are shared by every request
/// with the same constraint.
class structured_output {
public:
  /// `vocab_size`: the model's (ids past the tokenizer's are never allowed); `end_tokens`:
  /// the tokens that end an output (EOS), allowed once it is complete.
  structured_output(const tokenizer& tok, int64_t vocab_size, std::vector<int32_t> end_tokens);
  ~structured_output();

  /// A guide for `params`' constraint. Throws `invalid_argument` naming what is wrong for
  /// a schema that is not JSON or uses what troupe does not enforce (naming the keyword).
  std::unique_ptr<output_guide> guide(const sampling_params& params);

  /// Seconds spent computing masks so far.
  double mask_seconds() const;

  /// The tokens' bytes in a trie, and the end tokens (defined with the automata).
  struct vocabulary;

private:
  std::shared_ptr<vocabulary> vocab_;
  std::unordered_map<std::string, std::shared_ptr<output_grammar>> grammars_;
};

} // namespace troupe
