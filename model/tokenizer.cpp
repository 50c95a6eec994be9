#include "model/tokenizer.hpp"

#include "model/checkpoint.hpp"
#include "model/gguf.hpp"
#include "model/sentencepiece.hpp"
#include "model/mapped_file.hpp"
#include "troupe/errors.hpp"

#include <boost/regex/icu.hpp>
#include <nlohmann/json.hpp>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <queue>
#include <tuple>

namespace troupe {

namespace {

[[noreturn]] void bad(const std::string& origin, const std::string& what) {
  throw error{errc::invalid_argument, "tokenizer '" + origin + "': " + what};
}

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xc0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    s.push_back(static_cast<char>(0xe0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
  return s;
}

/// GPT-2's map from bytes to printable characters: printable Latin-1 bytes stand for
/// themselves, the others for code points from 256 on.
struct byte_map {
  std::array<std::string, 256> to_text;
  std::unordered_map<std::string, uint8_t> to_byte;

  byte_map() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      to_text[b] = utf8(printable ? b : next++);
      to_byte[to_text[b]] = static_cast<uint8_t>(b);
    }
  }
};

const byte_map& bytes() {
  static const byte_map map;
  return map;
}

/// GPT-2's pre-tokenizer pattern (byte-level with `use_regex`).
constexpr const char* gpt2_pattern =
  R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

/// A tokenizer's regex (Oniguruma's syntax, as the tokenizers library reads it) for Boost
/// with ICU. Boost reads \p{L} as lowercase letters only, so Unicode's one-letter general
/// categories are spelled out by their two-letter ones, inside a bracket or as one.
boost::u32regex tokenizer_regex(const std::string& pattern, const std::string& origin) {
  static const std::map<char, const char*> categories = {
    {'L', "[:Lu:][:Ll:][:Lt:][:Lm:][:Lo:]"},
    {'N', "[:Nd:][:Nl:][:No:]"},
    {'M', "[:Mn:][:Mc:][:Me:]"},
    {'P', "[:Pc:][:Pd:][:Ps:][:Pe:][:Pi:][:Pf:][:Po:]"},
    {'S', "[:Sm:][:Sc:][:Sk:][:So:]"},
    {'Z', "[:Zs:][:Zl:][:Zp:]"}};
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      if (pattern[i + 1] == 'p' && i + 4 < pattern.size() && pattern[i + 2] == '{') {
        auto close = pattern.find('}', i + 3);
        auto name = close == std::string::npos ? "" : pattern.substr(i + 3, close - i - 3);
        std::string classes;
        if (name.size() == 1 && categories.count(name[0]))
          classes = categories.at(name[0]);
        else if (name.size() == 2 && std::isupper(static_cast<unsigned char>(name[0])))
          classes = "[:" + name + ":]";
        else
          bad(origin, "regex category \\p{" + name + "} is not supported");
        out += in_class ? classes : "[" + classes + "]";
        i = close;
        continue;
      }
      out += pattern.substr(i, 2);
      ++i;
      continue;
    }
    if (c == '[' && !in_class)
      in_class = true;
    else if (c == ']' && in_class)
      in_class = false;
    out += c;
  }
  try {
    return boost::make_u32regex(out);
  } catch (const std::exception& e) {
    bad(origin, "regex '" + pattern + "' is not supported: " + e.what());
  }
}

/// GPT-2's pattern, compiled once for every tokenizer that uses it.
const boost::u32regex& gpt2_regex() {
  static const auto re = tokenizer_regex(gpt2_pattern, "gpt2");
  return re;
}

/// Length of the UTF-8 sequence starting with `c`; 0 for a byte that cannot start one.
size_t sequence_length(unsigned char c) {
  if (c < 0x80)
    return 1;
  if ((c >> 5) == 0x6)
    return 2;
  if ((c >> 4) == 0xe)
    return 3;
  if ((c >> 3) == 0x1e)
    return 4;
  return 0;
}

/// The length of the well-formed UTF-8 character at text[i] (Unicode's table 3-7: no
/// overlong forms, no surrogates, nothing past U+10FFFF); 0 when there is none, with the
/// length of the maximal ill-formed subpart there (what one U+FFFD stands for) in `bad`.
size_t utf8_char(std::string_view text, size_t i, size_t* bad) {
  auto c = static_cast<unsigned char>(text[i]);
  if (c < 0x80)
    return 1;
  size_t n = 0;
  unsigned char low = 0x80; // the second byte's range; later ones are 80..BF
  unsigned char high = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    low = c == 0xe0 ? 0xa0 : 0x80;
    high = c == 0xed ? 0x9f : 0xbf;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    low = c == 0xf0 ? 0x90 : 0x80;
    high = c == 0xf4 ? 0x8f : 0xbf;
  } else {
    *bad = 1;
    return 0;
  }
  for (size_t k = 1; k < n; ++k) {
    auto b = i + k < text.size() ? static_cast<unsigned char>(text[i + k]) : 0;
    if (i + k >= text.size() || b < (k == 1 ? low : 0x80) || b > (k == 1 ? high : 0xbf)) {
      *bad = k;
      return 0;
    }
  }
  return n;
}

bool is_utf8(std::string_view text) {
  size_t bad = 0;
  for (size_t i = 0; i < text.size();) {
    auto n = utf8_char(text, i, &bad);
    if (n == 0)
      return false;
    i += n;
  }
  return true;
}

void check_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    size_t bad = 0;
    auto n = utf8_char(text, i, &bad);
    if (n == 0)
      throw error{errc::invalid_argument,
                  "tokenizer: text is not valid UTF-8 in the sequence at byte " +
                    std::to_string(i)};
    i += n;
  }
}

/// SentencePiece's meta space, which stands for a space in its pieces.
constexpr const char* meta_space = "\xe2\x96\x81"; // U+2581

/// The published Split patterns of the pre-tokenizers that GGUF files name in
/// `tokenizer.ggml.pre` (as llama.cpp's converter names them).
constexpr const char* llama3_pattern =
  R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* qwen2_pattern =
  R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty())
    return;
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
}

/// Calls `read(step, type)` for each step of a tokenizer.json component (normalizer,
/// pre-tokenizer, post-processor, decoder), a `Sequence`'s steps (under `list`) in turn.
template <class F>
void for_each_step(const nlohmann::json& t, const char* list, const F& read, int depth = 0) {
  if (t.is_null())
    return;
  auto type = t.value("type", std::string{});
  if (type != "Sequence")
    return read(t, type);
  if (depth > 16)
    throw error{errc::invalid_argument,
                std::string{"tokenizer: "} + list + " nest Sequences more than 16 deep"};
  for (auto& inner : t.value(list, nlohmann::json::array()))
    for_each_step(inner, list, read, depth + 1);
}

/// Runs `read`, turning what a malformed file makes the JSON library or the standard
/// library throw into a `troupe::error` naming the file.
template <class F>
auto reading(const std::string& path, F&& read) {
  try {
    return read();
  } catch (const error&) {
    throw;
  } catch (const std::exception& e) {
    bad(path, std::string{"is malformed: "} + e.what());
  }
}

/// A Metaspace step's prepend scheme; files before `prepend_scheme` say
/// `add_prefix_space` instead.
std::string prepend_scheme_of(const nlohmann::json& t) {
  return t.value("prepend_scheme", t.value("add_prefix_space", true) ? "always" : "never");
}

/// The byte of a byte-fallback piece ("<0x41>"), or -1.
int fallback_byte(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>' ||
      !std::isxdigit(static_cast<unsigned char>(token[3])) ||
      !std::isxdigit(static_cast<unsigned char>(token[4])))
    return -1;
  return std::stoi(token.substr(3, 2), nullptr, 16);
}

} // namespace

/// A tokenizer.json's steps (or a GGUF file's, written as tokenizer.json would write them).
struct tokenizer::pipeline {
  /// A normalizer step: a Unicode normal form, a prefix, or a replacement.
  struct normalizer {
    enum class kind { form, prepend, replace } what = kind::form;
    const icu::Normalizer2* form = nullptr; // owned by ICU
    std::string text;                       // prepend: the prefix; replace: a literal pattern
    std::string content;                    // replace: what the pattern becomes
    bool regex = false;                     // replace: `re` is the pattern
    boost::u32regex re;
  };
  std::vector<normalizer> normalizers;

  /// A pre-tokenizer step, splitting every piece the one before made.
  struct step {
    enum class kind { isolate, prefix_space, metaspace } what = kind::isolate;
    boost::u32regex re;
    std::string replacement; // metaspace
    enum class prepend { always, first, never } scheme = prepend::always;
    bool split = false; // metaspace: each replacement starts a piece
  };
  std::vector<step> steps;

  /// A decoder step, over the tokens' texts in turn (tokenizers' decode chain).
  struct decoder {
    enum class kind {
      byte_level,
      replace,
      byte_fallback,
      fuse,
      strip,
      metaspace
    } what = kind::byte_level;
    std::string pattern; // replace: literal; strip: the character; metaspace: replacement
    std::string content;
    size_t start = 0; // strip: at most this many from the front, `stop` from the back
    size_t stop = 0;
    bool strip_first = false; // metaspace: the first token loses a leading space
  };
  std::vector<decoder> decoders;

  /// Whether a text is its tokens' decoded bytes joined, each token decoded alone.
  bool joins_tokens() const {
    return decoders.size() == 1 && decoders[0].what == decoder::kind::byte_level;
  }

  /// What the template puts before and after the text's ids (add_special_tokens).
  std::vector<int32_t> prefix;
  std::vector<int32_t> suffix;

  /// `text` cut into pieces by every step; `at_start` when it begins the whole input (a
  /// Metaspace step that prepends only "first" prepends only there).
  std::vector<std::string> pieces(const std::string& text, bool at_start) const {
    std::vector<std::string> parts{text};
    for (auto& s : steps) {
      std::vector<std::string> next;
      for (size_t i = 0; i < parts.size(); ++i)
        split(s, parts[i], at_start && i == 0, next);
      parts = std::move(next);
    }
    return parts;
  }

  std::string normalize(std::string text, const std::string& origin) const {
    for (auto& n : normalizers) {
      if (n.what == normalizer::kind::prepend) {
        if (!text.empty())
          text = n.text + text;
      } else if (n.what == normalizer::kind::replace) {
        if (n.regex)
          text =
            boost::u32regex_replace(text, n.re, n.content, boost::regex_constants::format_literal);
        else
          replace_all(text, n.text, n.content);
      } else {
        auto u = icu::UnicodeString::fromUTF8(text);
        UErrorCode status = U_ZERO_ERROR;
        u = n.form->normalize(u, status);
        if (U_FAILURE(status))
          bad(origin, std::string{"normalization failed: "} + u_errorName(status));
        text.clear();
        u.toUTF8String(text);
      }
    }
    return text;
  }

  /// The texts of `tokens` as the decoder chain gives them, joined. `raw`: their bytes as
  /// they are inside a text, whether UTF-8 or not (no character fixed, nothing stripped at
  /// the start).
  std::string decode(std::vector<std::string> tokens, bool raw = false) const {
    auto text = [&](const std::string& bytes) { return raw ? bytes : valid_utf8(bytes); };
    for (auto& d : decoders) {
      switch (d.what) {
      case decoder::kind::byte_level: {
        // Each character of a token stands for one byte; other characters (an added
        // token's) stand for themselves.
        std::string joined;
        for (auto& token : tokens)
          for (size_t i = 0; i < token.size();) {
            auto n = std::max<size_t>(1, sequence_length(static_cast<unsigned char>(token[i])));
            auto b = bytes().to_byte.find(token.substr(i, n));
            if (b != bytes().to_byte.end())
              joined.push_back(static_cast<char>(b->second));
            else
              joined += token.substr(i, n);
            i += n;
          }
        tokens = {text(joined)};
        break;
      }
      case decoder::kind::replace:
        for (auto& token : tokens)
          replace_all(token, d.pattern, d.content);
        break;
      case decoder::kind::byte_fallback: {
        // Runs of byte pieces become their bytes; a run that is not UTF-8 becomes one
        // U+FFFD per byte, as the tokenizers library does.
        std::vector<std::string> next;
        std::string run;
        size_t run_pieces = 0;
        auto flush = [&] {
          if (run_pieces == 0)
            return;
          bool ok = raw || valid_utf8(run) == run;
          if (ok) {
            next.push_back(run);
          } else {
            for (size_t k = 0; k < run_pieces; ++k)
              next.emplace_back("\xef\xbf\xbd");
          }
          run.clear();
          run_pieces = 0;
        };
        for (auto& token : tokens) {
          auto b = fallback_byte(token);
          if (b >= 0) {
            run.push_back(static_cast<char>(b));
            ++run_pieces;
          } else {
            flush();
            next.push_back(token);
          }
        }
        flush();
        tokens = std::move(next);
        break;
      }
      case decoder::kind::fuse: {
        std::string joined;
        for (auto& token : tokens)
          joined += token;
        tokens = {joined};
        break;
      }
      case decoder::kind::strip:
        if (raw)
          break;
        for (auto& token : tokens) {
          size_t front = 0;
          while (front < d.start &&
                 token.compare(front * d.pattern.size(), d.pattern.size(), d.pattern) == 0)
            ++front;
          token.erase(0, front * d.pattern.size());
          for (size_t back = 0;
               back < d.stop && token.size() >= d.pattern.size() &&
               token.compare(token.size() - d.pattern.size(), d.pattern.size(), d.pattern) == 0;
               ++back)
            token.resize(token.size() - d.pattern.size());
        }
        break;
      case decoder::kind::metaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          replace_all(tokens[i], d.pattern, " ");
          if (i == 0 && !raw && d.strip_first && !tokens[i].empty() && tokens[i][0] == ' ')
            tokens[i].erase(0, 1);
        }
        break;
      }
    }
    std::string out;
    for (auto& token : tokens)
      out += token;
    return text(out);
  }

private:
  /// The tokenizers library's `Isolated` behaviour for a regex: matches and the text
  /// between them are pieces of their own.
  static void split(const step& s, const std::string& part, bool at_start,
                    std::vector<std::string>& out) {
    if (part.empty())
      return;
    if (s.what == step::kind::prefix_space) {
      out.push_back(part.front() == ' ' ? part : " " + part);
      return;
    }
    if (s.what == step::kind::metaspace) {
      auto text = part;
      replace_all(text, " ", s.replacement);
      bool prepend =
        s.scheme == step::prepend::always || (s.scheme == step::prepend::first && at_start);
      if (prepend && text.compare(0, s.replacement.size(), s.replacement) != 0)
        text = s.replacement + text;
      if (!s.split) {
        out.push_back(text);
        return;
      }
      // Each replacement begins a piece (tokenizers' MergedWithNext).
      size_t begin = 0;
      for (size_t at = text.find(s.replacement, 1); at != std::string::npos;
           at = text.find(s.replacement, at + 1)) {
        out.push_back(text.substr(begin, at - begin));
        begin = at;
      }
      out.push_back(text.substr(begin));
      return;
    }
    size_t last = 0;
    boost::u32regex_iterator<std::string::const_iterator> it(part.begin(), part.end(), s.re);
    boost::u32regex_iterator<std::string::const_iterator> end;
    for (; it != end; ++it) {
      auto at = static_cast<size_t>(it->position());
      if (at > last)
        out.push_back(part.substr(last, at - last));
      if (it->length() > 0)
        out.push_back(it->str());
      last = at + static_cast<size_t>(it->length());
    }
    if (last < part.size())
      out.push_back(part.substr(last));
  }
};

tokenizer::tokenizer() = default;

void tokenizer::read_pipeline(const nlohmann::json& j, const std::string& origin) {
  auto p = std::make_shared<pipeline>();
  using normalizer = pipeline::normalizer;
  using step = pipeline::step;
  using decoder = pipeline::decoder;
  // A Split's or Replace's pattern: {"Regex": …} or {"String": …}.
  auto pattern_of = [&](const nlohmann::json& t, const std::string& what, bool* regex) {
    auto pattern = t.value("pattern", nlohmann::json::object());
    *regex = pattern.contains("Regex");
    if (*regex)
      return pattern["Regex"].get<std::string>();
    if (pattern.contains("String"))
      return pattern["String"].get<std::string>();
    bad(origin, what + " has no Regex or String pattern");
  };

  auto norm = [&](const nlohmann::json& n, const std::string& type) {
    auto& s = p->normalizers.emplace_back();
    if (type == "Prepend") {
      s.what = normalizer::kind::prepend;
      s.text = n.value("prepend", std::string{});
      return;
    }
    if (type == "Replace") {
      s.what = normalizer::kind::replace;
      auto pattern = pattern_of(n, "normalizer Replace", &s.regex);
      s.content = n.value("content", std::string{});
      if (s.regex)
        s.re = tokenizer_regex(pattern, origin);
      else
        s.text = pattern;
      return;
    }
    UErrorCode status = U_ZERO_ERROR;
    if (type == "NFC")
      s.form = icu::Normalizer2::getNFCInstance(status);
    else if (type == "NFD")
      s.form = icu::Normalizer2::getNFDInstance(status);
    else if (type == "NFKC")
      s.form = icu::Normalizer2::getNFKCInstance(status);
    else if (type == "NFKD")
      s.form = icu::Normalizer2::getNFKDInstance(status);
    else
      bad(origin, "normalizer '" + type +
                    "' is not supported (NFC, NFD, NFKC, NFKD, Prepend, Replace, Sequence)");
    if (U_FAILURE(status) || s.form == nullptr)
      bad(origin, "normalizer " + type + " is not available from ICU");
  };
  for_each_step(j.value("normalizer", nlohmann::json()), "normalizers", norm);

  // Steps are filled in place: a regex left default-constructed in a temporary step trips
  // GCC's maybe-uninitialized warning inside Boost.
  auto isolate = [&](const boost::u32regex& re) {
    auto& s = p->steps.emplace_back();
    s.re = re;
  };
  auto pre = [&](const nlohmann::json& t, const std::string& type) {
    if (type == "ByteLevel") {
      byte_level_ = true;
      if (t.value("add_prefix_space", false))
        p->steps.emplace_back().what = step::kind::prefix_space;
      if (t.value("use_regex", true))
        isolate(gpt2_regex());
    } else if (type == "Split") {
      auto behavior = t.value("behavior", std::string{});
      if (behavior != "Isolated" || t.value("invert", false))
        bad(origin, "pre-tokenizer Split with behavior '" + behavior +
                      "' is not supported (Isolated, not inverted)");
      bool regex = false;
      auto pattern = pattern_of(t, "pre-tokenizer Split", &regex);
      if (!regex) { // a literal string: every character escaped
        std::string escaped;
        for (char c : pattern) {
          if (std::string{"\\^$.|?*+()[]{}"}.find(c) != std::string::npos)
            escaped += '\\';
          escaped += c;
        }
        pattern = escaped;
      }
      isolate(tokenizer_regex(pattern, origin));
    } else if (type == "Digits") {
      // Rust's char::is_numeric, as the tokenizers library uses: Unicode's N categories.
      isolate(tokenizer_regex(t.value("individual_digits", false) ? "\\p{N}" : "\\p{N}+", origin));
    } else if (type == "Metaspace") {
      auto& s = p->steps.emplace_back();
      s.what = step::kind::metaspace;
      s.replacement = t.value("replacement", std::string{meta_space});
      auto scheme = prepend_scheme_of(t);
      if (scheme == "always")
        s.scheme = step::prepend::always;
      else if (scheme == "first")
        s.scheme = step::prepend::first;
      else if (scheme == "never")
        s.scheme = step::prepend::never;
      else
        bad(origin, "Metaspace prepend_scheme '" + scheme + "' is unknown");
      s.split = t.value("split", true);
    } else {
      bad(origin, "pre-tokenizer '" + type +
                    "' is not supported (ByteLevel, Split, Digits, Metaspace, Sequence)");
    }
  };
  for_each_step(j.value("pre_tokenizer", nlohmann::json()), "pretokenizers", pre);

  auto post = [&](const nlohmann::json& t, const std::string& type) {
    if (type == "TemplateProcessing") {
      bool before = true;
      for (auto& item : t.value("single", nlohmann::json::array())) {
        if (item.contains("Sequence")) {
          before = false;
          continue;
        }
        auto name = item.at("SpecialToken").value("id", std::string{});
        auto specials = t.value("special_tokens", nlohmann::json::object());
        if (!specials.contains(name))
          bad(origin, "template names '" + name + "', which its special_tokens lack");
        for (auto& id : specials[name].value("ids", nlohmann::json::array())) {
          auto value = id.get<int64_t>();
          if (value < 0 || value >= static_cast<int64_t>(id_to_token_.size()))
            bad(origin, "template token '" + name + "' has id " + std::to_string(value) +
                          " outside the vocabulary");
          (before ? p->prefix : p->suffix).push_back(static_cast<int32_t>(value));
        }
      }
    } else if (type != "ByteLevel") { // byte-level post-processing moves offsets only
      bad(origin, "post-processor '" + type +
                    "' is not supported (TemplateProcessing, ByteLevel, Sequence)");
    }
  };
  for_each_step(j.value("post_processor", nlohmann::json()), "processors", post);

  auto dec = [&](const nlohmann::json& t, const std::string& type) {
    auto& d = p->decoders.emplace_back();
    if (type == "ByteLevel") {
      d.what = decoder::kind::byte_level;
    } else if (type == "Replace") {
      d.what = decoder::kind::replace;
      bool regex = false;
      d.pattern = pattern_of(t, "decoder Replace", &regex);
      if (regex)
        bad(origin, "decoder Replace with a Regex pattern is not supported (String)");
      d.content = t.value("content", std::string{});
    } else if (type == "ByteFallback") {
      d.what = decoder::kind::byte_fallback;
    } else if (type == "Fuse") {
      d.what = decoder::kind::fuse;
    } else if (type == "Strip") {
      d.what = decoder::kind::strip;
      d.pattern = t.value("content", std::string{" "});
      if (d.pattern.empty())
        bad(origin, "decoder Strip has no content to strip");
      d.start = t.value("start", size_t{0});
      d.stop = t.value("stop", size_t{0});
    } else if (type == "Metaspace") {
      d.what = decoder::kind::metaspace;
      d.pattern = t.value("replacement", std::string{meta_space});
      d.strip_first = prepend_scheme_of(t) != "never";
    } else {
      bad(origin, "decoder '" + type +
                    "' is not supported (ByteLevel, Replace, ByteFallback, Fuse, Strip, "
                    "Metaspace, Sequence)");
    }
  };
  for_each_step(j.value("decoder", nlohmann::json()), "decoders", dec);
  pipeline_ = p;
}

void tokenizer::index_vocabulary(const std::string& origin) {
  if (id_to_token_.empty())
    bad(origin, "has no vocabulary");
  vocab_.clear();
  for (size_t i = 0; i < id_to_token_.size(); ++i)
    vocab_.emplace(id_to_token_[i], static_cast<int32_t>(i));
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    byte_ids_[static_cast<size_t>(b)] = token_id(name);
  }
}

void tokenizer::add_merge(const std::string& pair, int32_t rank, const std::string& origin) {
  auto space = pair.find(' ');
  if (space == std::string::npos)
    bad(origin, "merge '" + pair + "' has no space");
  add_merge(pair.substr(0, space), pair.substr(space + 1), rank, origin);
}

void tokenizer::add_merge(const std::string& left, const std::string& right, int32_t rank,
                          const std::string& origin) {
  auto l = token_id(left);
  auto r = token_id(right);
  auto merged = token_id(left + right);
  if (l < 0 || r < 0 || merged < 0)
    bad(origin, "merge '" + left + " " + right + "' names a token the vocabulary lacks");
  merges_.emplace(pair_key(l, r), merge{rank, merged});
}

void tokenizer::finish(const std::string& origin) {
  if (pipeline_->joins_tokens()) {
    piece_at_.reserve(id_to_token_.size() + 1);
    piece_at_.push_back(0);
    for (auto& token : id_to_token_) {
      piece_bytes_ += pipeline_->decode({token}, true);
      if (piece_bytes_.size() > std::numeric_limits<uint32_t>::max())
        bad(origin, "has more than 4 GiB of token text");
      piece_at_.push_back(static_cast<uint32_t>(piece_bytes_.size()));
    }
  }
  for (auto id : added_ids_)
    added_.emplace_back(id_to_token_[static_cast<size_t>(id)], id);
  std::sort(added_.begin(), added_.end(),
            [](auto& a, auto& b) { return a.first.size() > b.first.size(); });
  for (size_t i = 0; i < added_.size(); ++i)
    if (!added_[i].first.empty())
      added_by_byte_[static_cast<unsigned char>(added_[i].first[0])].push_back(i);
  // Byte-level BPE needs every printable ASCII byte as a token of its own. (Bytes that
  // valid UTF-8 never contains may be missing.)
  if (byte_level_)
    for (int b = 33; b < 127; ++b)
      if (token_id(bytes().to_text[static_cast<size_t>(b)]) < 0)
        bad(origin, "is not byte-level BPE: no token for the byte '" +
                      std::string(1, static_cast<char>(b)) + "'");
}

tokenizer tokenizer::from_json(const std::string& path) {
  return reading(path, [&] { return read_json(path); });
}

tokenizer tokenizer::read_json(const std::string& path) {
  auto j = nlohmann::json::parse(read_small_file(path, "tokenizer", 1 << 30), nullptr, false);
  if (j.is_discarded() || !j.contains("model"))
    bad(path, "is not a tokenizer.json");
  auto& model = j["model"];
  auto type = model.value("type", std::string{});
  if (type != "BPE" || !model.contains("vocab"))
    bad(path, "model '" + type + "' is not supported (BPE)");
  for (auto* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(key) && !model[key].is_null())
      bad(path, std::string{"BPE with a "} + key + " is not supported");
  tokenizer t;
  auto& vocab = model["vocab"];
  t.id_to_token_.resize(vocab.size());
  for (auto& [text, id] : vocab.items()) {
    auto i = id.get<int64_t>();
    if (i < 0 || i >= static_cast<int64_t>(vocab.size()))
      bad(path, "token '" + text + "' has id " + std::to_string(i) + " outside the vocabulary");
    t.id_to_token_[static_cast<size_t>(i)] = text;
  }
  for (auto& added : j.value("added_tokens", nlohmann::json::array())) {
    auto id = added.value("id", int64_t{-1});
    if (id < 0)
      continue;
    if (id >= (int64_t{1} << 24))
      bad(path, "added token id " + std::to_string(id) + " is beyond any vocabulary");
    if (static_cast<size_t>(id) >= t.id_to_token_.size())
      t.id_to_token_.resize(static_cast<size_t>(id) + 1);
    t.id_to_token_[static_cast<size_t>(id)] = added.value("content", std::string{});
    t.added_ids_.insert(id);
    if (added.value("special", false))
      t.special_ids_.insert(id);
  }
  t.index_vocabulary(path);
  int32_t rank = 0;
  for (auto& m : model.value("merges", nlohmann::json::array())) {
    if (m.is_string()) {
      t.add_merge(m.get<std::string>(), rank++, path);
    } else if (m.is_array() && m.size() == 2) {
      t.add_merge(m[0].get<std::string>(), m[1].get<std::string>(), rank++, path);
    } else {
      bad(path, "merge " + m.dump() + " is neither \"left right\" nor [left, right]");
    }
  }
  t.byte_fallback_ = model.value("byte_fallback", false);
  t.ignore_merges_ = model.value("ignore_merges", false);
  t.fuse_unk_ = model.value("fuse_unk", false);
  auto unk = model.value("unk_token", nlohmann::json());
  if (unk.is_string()) {
    t.unk_ = t.token_id(unk.get<std::string>());
    if (t.unk_ < 0)
      bad(path, "unk_token '" + unk.get<std::string>() + "' is not in the vocabulary");
  }
  t.read_pipeline(j, path);
  t.finish(path);
  return t;
}

void tokenizer::read_pieces(const std::vector<std::string>& pieces, const std::vector<int>& types,
                            const std::string& origin) {
  using type = sentencepiece_model::piece_type;
  id_to_token_ = pieces;
  for (size_t i = 0; i < types.size(); ++i) {
    auto id = static_cast<int32_t>(i);
    if (types[i] == type::unknown || types[i] == type::control || types[i] == type::user_defined)
      added_ids_.insert(id);
    if (types[i] == type::unknown || types[i] == type::control)
      special_ids_.insert(id);
  }
  index_vocabulary(origin);
}

nlohmann::json tokenizer::sentencepiece_pipeline(const std::vector<double>& scores,
                                                 const std::vector<int>& types, bool dummy_prefix,
                                                 bool trim_spaces, const std::string& origin) {
  // Merges as transformers' converter makes them from the scores: every split of a normal
  // piece into two normal pieces, by the piece's score. (Pieces longer than 256 bytes are
  // not split: SentencePiece makes none longer than 16 characters, and splitting is
  // quadratic in the length.)
  for (size_t i = 0; i < scores.size(); ++i)
    if (!std::isfinite(scores[i]))
      bad(origin, "piece " + std::to_string(i) + " has a score that is not a finite number");
  auto normal = [&](int32_t id) {
    return id >= 0 && types[static_cast<size_t>(id)] == sentencepiece_model::normal;
  };
  std::vector<std::tuple<double, int32_t, std::string, std::string>> ranked;
  for (size_t i = 0; i < id_to_token_.size(); ++i) {
    auto& piece = id_to_token_[i];
    if (!normal(static_cast<int32_t>(i)) || piece.size() > 256)
      continue;
    for (size_t k = 1; k < piece.size(); ++k) {
      if ((static_cast<unsigned char>(piece[k]) & 0xc0) == 0x80)
        continue; // inside a character
      auto left = piece.substr(0, k);
      auto right = piece.substr(k);
      if (normal(token_id(left)) && normal(token_id(right)))
        ranked.emplace_back(-scores[i], static_cast<int32_t>(i), left, right);
    }
  }
  std::sort(ranked.begin(), ranked.end());
  int32_t rank = 0;
  for (auto& [score, id, left, right] : ranked)
    add_merge(left, right, rank++, origin);
  fuse_unk_ = true;
  // SentencePiece's own normalization: extra spaces go (leading ones and runs of spaces
  // before escaping, trailing ones after, so that a trailing meta space in the text goes
  // too), a space goes first, every space becomes the meta space; decoding undoes it.
  nlohmann::json normalizers = nlohmann::json::array();
  auto replace = [](const char* kind, const std::string& pattern, const char* content) {
    return nlohmann::json{
      {"type", "Replace"}, {"pattern", {{kind, pattern}}}, {"content", content}};
  };
  if (trim_spaces) {
    normalizers.push_back(replace("Regex", "\\A +", ""));
    normalizers.push_back(replace("Regex", " {2,}", " "));
  }
  nlohmann::json decoders = {
    replace("String", meta_space, " "), {{"type", "ByteFallback"}}, {{"type", "Fuse"}}};
  if (dummy_prefix) {
    normalizers.push_back({{"type", "Prepend"}, {"prepend", meta_space}});
    decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
  }
  normalizers.push_back(replace("String", " ", meta_space));
  if (trim_spaces)
    normalizers.push_back(replace("Regex", std::string{"(?:"} + meta_space + ")+\\z", ""));
  return {{"normalizer", {{"type", "Sequence"}, {"normalizers", normalizers}}},
          {"decoder", {{"type", "Sequence"}, {"decoders", decoders}}}};
}

void tokenizer::set_template(bool add_bos, bool add_eos) {
  auto p = std::make_shared<pipeline>(*pipeline_);
  p->prefix.clear();
  p->suffix.clear();
  if (add_bos && bos_ >= 0)
    p->prefix = {bos_};
  if (add_eos && eos_ >= 0)
    p->suffix = {eos_};
  pipeline_ = p;
}

const std::string& tokenizer::token_text(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size())
    throw error{errc::invalid_argument, "token id " + std::to_string(id) +
                                          " is outside the vocabulary of " +
                                          std::to_string(id_to_token_.size())};
  return id_to_token_[static_cast<size_t>(id)];
}

std::optional<tokenizer> tokenizer::of_model(const std::string& path) {
  if (checkpoint::is_gguf(path))
    return from_gguf(path);
  auto json = std::filesystem::path{path} / "tokenizer.json";
  if (std::filesystem::exists(json))
    return from_json(json.string());
  auto model = std::filesystem::path{path} / "tokenizer.model"; // SentencePiece's own
  if (std::filesystem::exists(model))
    return from_sentencepiece(model.string());
  return std::nullopt;
}

tokenizer tokenizer::from_gguf(const std::string& path) {
  return reading(path, [&] { return read_gguf(path); });
}

tokenizer tokenizer::read_gguf(const std::string& path) {
  gguf_file file{path};
  auto string_of = [&](const char* key) {
    auto s = file.find<std::string>(key);
    return s ? *s : std::string{};
  };
  auto tokens = file.strings("tokenizer.ggml.tokens");
  // A special token's id, checked against the vocabulary; -1 when absent.
  auto id_of = [&](const char* key) {
    auto v = file.find<int64_t>(key);
    if (v == nullptr)
      return int32_t{-1};
    if (*v < 0 || !tokens || *v >= static_cast<int64_t>(tokens->size()))
      bad(path, std::string{key} + " " + std::to_string(*v) + " is outside the vocabulary");
    return static_cast<int32_t>(*v);
  };
  auto flag = [&](const char* key, bool otherwise) {
    auto v = file.find<bool>(key);
    return v ? *v : otherwise;
  };
  auto kind = string_of("tokenizer.ggml.model");
  if (kind != "gpt2" && kind != "llama")
    bad(path, "tokenizer model '" + kind +
                "' is not supported (gpt2: byte-level BPE; llama: SentencePiece BPE)");
  if (!tokens)
    bad(path, "has no tokenizer.ggml.tokens");
  // Token types as SentencePiece numbers them; normal when absent.
  std::vector<int> types(tokens->size(), sentencepiece_model::normal);
  if (auto v = file.numbers("tokenizer.ggml.token_type"))
    for (size_t i = 0; i < std::min(v->size(), types.size()); ++i)
      types[i] = static_cast<int>((*v)[i]);
  tokenizer t;
  t.read_pieces(*tokens, types, path);
  t.bos_ = id_of("tokenizer.ggml.bos_token_id");
  t.eos_ = id_of("tokenizer.ggml.eos_token_id");
  // The pipeline as tokenizer.json would write it.
  nlohmann::json j;
  if (kind == "gpt2") {
    if (auto merges = file.strings("tokenizer.ggml.merges")) {
      int32_t rank = 0;
      for (auto& m : *merges)
        t.add_merge(m, rank++, path);
    }
    auto split = [](const char* pattern) {
      return nlohmann::json{
        {"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}};
    };
    auto byte_level = [](bool use_regex) {
      return nlohmann::json{{"type", "ByteLevel"}, {"use_regex", use_regex}};
    };
    auto pre = string_of("tokenizer.ggml.pre");
    nlohmann::json steps;
    if (pre.empty() || pre == "default" || pre == "gpt2") {
      steps = {byte_level(true)};
    } else if (pre == "llama3" || pre == "llama-v3" || pre == "llama-bpe") {
      steps = {split(llama3_pattern), byte_level(false)};
      t.ignore_merges_ = true; // Llama 3's tokenizer.json says so
    } else if (pre == "qwen2") {
      j["normalizer"] = {{"type", "NFC"}};
      steps = {split(qwen2_pattern), byte_level(false)};
    } else if (pre == "smollm" || pre == "starcoder" || pre == "refact") {
      steps = {{{"type", "Digits"}, {"individual_digits", true}}, byte_level(true)};
    } else {
      bad(path, "pre-tokenizer '" + pre +
                  "' (tokenizer.ggml.pre) is not supported (default, gpt2, llama3, llama-v3, "
                  "llama-bpe, qwen2, smollm, starcoder, refact)");
    }
    j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", steps}};
    j["decoder"] = {{"type", "ByteLevel"}};
  } else {
    auto scores = file.numbers("tokenizer.ggml.scores");
    if (!scores || scores->size() != tokens->size())
      bad(path,
          "has no tokenizer.ggml.scores for its " + std::to_string(tokens->size()) + " tokens");
    // llama.cpp puts a space before the text as SentencePiece does, and keeps spaces.
    j = t.sentencepiece_pipeline(*scores, types, flag("tokenizer.ggml.add_space_prefix", true),
                                 false, path);
    t.unk_ = id_of("tokenizer.ggml.unknown_token_id");
    t.byte_fallback_ = true; // llama.cpp's, where the <0xXX> pieces exist
  }
  t.read_pipeline(j, path);
  // SentencePiece vocabularies begin with <s>; byte-level ones say when they do.
  t.set_template(flag("tokenizer.ggml.add_bos_token", kind == "llama"),
                 flag("tokenizer.ggml.add_eos_token", false));
  t.finish(path);
  return t;
}

tokenizer tokenizer::from_sentencepiece(const std::string& path) {
  return reading(path, [&] { return read_sentencepiece(path); });
}

tokenizer tokenizer::read_sentencepiece(const std::string& path) {
  auto m = read_sentencepiece_model(path);
  if (m.model_type != 2)
    bad(path, std::string{"SentencePiece model type '"} +
                (m.model_type == 1   ? "unigram"
                 : m.model_type == 3 ? "word"
                                     : "char") +
                "' is not supported (bpe)");
  if (m.has_charsmap)
    bad(path, "SentencePiece normalization '" + m.normalizer_name +
                "' (a compiled character map) is not supported (identity)");
  if (m.treat_whitespace_as_suffix || !m.escape_whitespaces)
    bad(path, "SentencePiece models that keep spaces or put them last are not supported");
  tokenizer t;
  t.read_pieces(m.pieces, m.types, path);
  t.bos_ = m.bos_id;
  t.eos_ = m.eos_id;
  t.unk_ = m.unk_id;
  t.byte_fallback_ = m.byte_fallback;
  t.read_pipeline(t.sentencepiece_pipeline(m.scores, m.types, m.add_dummy_prefix,
                                           m.remove_extra_whitespaces, path),
                  path);
  t.set_template(true, false); // <s> first, as transformers' Llama tokenizer does
  t.finish(path);
  return t;
}

int32_t tokenizer::token_id(const std::string& token) const {
  auto i = vocab_.find(token);
  return i == vocab_.end() ? -1 : i->second;
}

void tokenizer::encode_piece(const std::string& piece, std::vector<int32_t>& out) const {
  std::string text;
  if (byte_level_) {
    for (unsigned char c : piece)
      text += bytes().to_text[c];
  } else {
    text = piece;
  }
  if (ignore_merges_)
    if (auto id = token_id(text); id >= 0 && !special_ids_.count(id)) {
      out.push_back(id);
      return;
    }
  // One symbol per character; a character without a token becomes its bytes' pieces
  // (byte fallback), else the unknown token.
  struct symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  std::vector<symbol> symbols;
  auto push = [&](int32_t id) {
    auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, n - 1, n + 1});
  };
  for (size_t i = 0; i < text.size();) {
    auto n = std::max<size_t>(1, sequence_length(static_cast<unsigned char>(text[i])));
    auto ch = text.substr(i, n);
    i += n;
    if (auto id = token_id(ch); id >= 0) {
      push(id);
      continue;
    }
    if (byte_fallback_ && std::all_of(ch.begin(), ch.end(), [&](char c) {
          return byte_ids_[static_cast<unsigned char>(c)] >= 0;
        })) {
      for (unsigned char c : ch)
        push(byte_ids_[c]);
      continue;
    }
    if (unk_ < 0)
      throw error{errc::invalid_argument,
                  "tokenizer: no token for '" + ch + "' and no unknown token to stand for it"};
    if (!(fuse_unk_ && !symbols.empty() && symbols.back().id == unk_))
      push(unk_);
  }
  if (symbols.empty())
    return;
  symbols.back().next = -1;
  // Merge the adjacent pair of lowest rank (leftmost first) until none is left: a heap of
  // candidate pairs, each checked to be still current when it comes up.
  struct candidate {
    int32_t rank;
    int32_t left;
    int32_t left_id;
    int32_t right_id;
    bool operator>(const candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<candidate, std::vector<candidate>, std::greater<>> queue;
  auto consider = [&](int32_t left) {
    if (left < 0 || symbols[static_cast<size_t>(left)].next < 0)
      return;
    auto& l = symbols[static_cast<size_t>(left)];
    auto& r = symbols[static_cast<size_t>(l.next)];
    auto m = merges_.find(pair_key(l.id, r.id));
    if (m != merges_.end())
      queue.push({m->second.rank, left, l.id, r.id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i)
    consider(i);
  while (!queue.empty()) {
    auto c = queue.top();
    queue.pop();
    auto& l = symbols[static_cast<size_t>(c.left)];
    if (l.id != c.left_id || l.next < 0 || symbols[static_cast<size_t>(l.next)].id != c.right_id)
      continue; // stale: one side has merged since
    auto& r = symbols[static_cast<size_t>(l.next)];
    l.id = merges_.at(pair_key(c.left_id, c.right_id)).id;
    r.id = -1; // gone
    l.next = r.next;
    if (l.next >= 0)
      symbols[static_cast<size_t>(l.next)].prev = c.left;
    consider(l.prev);
    consider(c.left);
  }
  for (int32_t i = 0; i >= 0; i = symbols[static_cast<size_t>(i)].next)
    out.push_back(symbols[static_cast<size_t>(i)].id);
}

std::vector<int32_t> tokenizer::encode(std::string_view text, bool parse_special,
                                       bool add_special_tokens) const {
  check_utf8(text);
  std::vector<int32_t> out;
  if (add_special_tokens)
    out = pipeline_->prefix;
  auto encode_plain = [&](std::string_view part, bool at_start) {
    if (part.empty())
      return;
    auto normal = pipeline_->normalize(std::string{part}, "text");
    for (auto& piece : pipeline_->pieces(normal, at_start))
      encode_piece(piece, out);
  };
  // Added tokens split the text first: special ones only when `parse_special`.
  size_t start = 0;
  for (size_t pos = 0; pos < text.size();) {
    bool matched = false;
    for (auto i : added_by_byte_[static_cast<unsigned char>(text[pos])]) {
      auto& [added, id] = added_[i];
      if ((parse_special || !special_ids_.count(id)) &&
          text.compare(pos, added.size(), added) == 0) {
        encode_plain(text.substr(start, pos - start), start == 0);
        out.push_back(id);
        pos += added.size();
        start = pos;
        matched = true;
        break;
      }
    }
    if (!matched)
      ++pos;
  }
  encode_plain(text.substr(start), start == 0);
  if (add_special_tokens)
    out.insert(out.end(), pipeline_->suffix.begin(), pipeline_->suffix.end());
  return out;
}

void append_utf8(std::string& out, uint32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xc0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3f));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xe0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (c & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (c & 0x3f));
  }
}

std::string valid_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    size_t bad = 0;
    if (auto n = utf8_char(bytes, i, &bad)) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out += "\xef\xbf\xbd"; // U+FFFD
      i += bad;
    }
  }
  return out;
}

void tokenizer::check_id(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size())
    throw error{errc::invalid_argument, "tokenizer: id " + std::to_string(id) +
                                          " is outside the vocabulary of " +
                                          std::to_string(id_to_token_.size())};
}

std::string tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  decode_into(ids.data(), ids.size(), skip_special, out);
  return out;
}

void tokenizer::decode_into(const int32_t* ids, size_t count, bool skip_special,
                            std::string& out) const {
  auto kept = [&](int32_t id) { return !(skip_special && special_ids_.count(id)); };
  // Ids that end inside a character (an emoji over two tokens, a cut-off generation) give
  // bytes that are not UTF-8: as transformers, each broken sequence becomes U+FFFD.
  if (!piece_at_.empty()) {
    out.clear();
    for (size_t i = 0; i < count; ++i) {
      check_id(ids[i]);
      auto id = static_cast<size_t>(ids[i]);
      if (kept(ids[i]))
        out.append(piece_bytes_, piece_at_[id], piece_at_[id + 1] - piece_at_[id]);
    }
    if (!is_utf8(out))
      out = valid_utf8(out);
    return;
  }
  std::vector<std::string> tokens;
  tokens.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    check_id(ids[i]);
    if (kept(ids[i]))
      tokens.push_back(id_to_token_[static_cast<size_t>(ids[i])]);
  }
  out = pipeline_->decode(std::move(tokens));
}

std::string tokenizer::token_bytes(int32_t id) const {
  check_id(id);
  auto i = static_cast<size_t>(id);
  if (!piece_at_.empty()) // the same decoding, made once at load
    return piece_bytes_.substr(piece_at_[i], piece_at_[i + 1] - piece_at_[i]);
  return pipeline_->decode({id_to_token_[i]}, true);
}

std::vector<std::vector<int32_t>> bad_words_token_ids(const tokenizer& tok,
                                                      const std::vector<std::string>& words) {
  std::vector<std::vector<int32_t>> out;
  for (auto& word : words) {
    auto bare = word.substr(std::min(word.find_first_not_of(" \t\n\r\f\v"), word.size()));
    auto alone = tok.encode(bare, true, false);
    auto spaced = tok.encode(" " + bare, true, false);
    if (!alone.empty())
      out.push_back(alone);
    if (!spaced.empty() && !alone.empty() && spaced.front() != alone.front() &&
        spaced.size() == alone.size())
      out.push_back(spaced);
  }
  return out;
}

} // namespace troupe
