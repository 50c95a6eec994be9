#pragma once

/// @file
/// Regular expressions (vLLM's `guided_regex`) compiled into a deterministic automaton over
/// the bytes of UTF-8 text, for structured output: the whole output must match.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace troupe {

/// A DFA over bytes: state 0 is the start; `next[s][b]` is the state after byte b, or -1
/// when no match can go on.
struct byte_dfa {
  std::vector<std::array<int32_t, 256>> next;
  std::vector<bool> accepting;
  /// Whether a state has a byte to go on with.
  std::vector<bool> continues;
};

/// Compiles `pattern` (Python's `re` syntax as vLLM takes it: literals and escapes, `.`,
/// classes with ranges and negation, `\d \w \s` and their negations (ASCII), groups
/// `(...)`, `(?:...)` and named ones, `|`, and `* + ? {n} {n,} {n,m}`, greedy or lazy,
/// `^` at the start and `$` at the end). `.` and negated classes take any UTF-8 character
/// but a newline. Throws `invalid_argument` naming what is not supported
/// (backreferences, lookaround, `\b`, a class range beyond ASCII) or malformed, or an
/// automaton larger than `max_states`.
byte_dfa compile_regex(const std::string& pattern, size_t max_states = 4096);

} // namespace troupe
