#include "model/tokenizer.hpp"

#include "model/gguf.hpp"
#include "troupe/errors.hpp"

#include <boost/regex/icu.hpp>
#include <nlohmann/json.hpp>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <fstream>
#include <functional>
#include <limits>
#include <map>

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
    {'L', "[:Lu:][:Ll:][:Lt:][:Lm:][:Lo:]"}, {'N', "[:Nd:][:Nl:][:No:]"},
    {'M', "[:Mn:][:Mc:][:Me:]"}, {'P', "[:Pc:][:Pd:][:Ps:][:Pe:][:Pi:][:Pf:][:Po:]"},
    {'S', "[:Sm:][:Sc:][:Sk:][:So:]"}, {'Z', "[:Zs:][:Zl:][:Zp:]"}};
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

} // namespace

struct tokenizer::pipeline {
  /// Normal forms applied in turn (ICU's instances, owned by ICU).
  std::vector<const icu::Normalizer2*> normalizers;
  /// Pre-tokenizer steps, each splitting every piece the one before made.
  struct step {
    enum class kind { isolate, digits, prefix_space } what = kind::isolate;
    boost::u32regex re;
    bool individual_digits = false;
  };
  std::vector<step> steps;
  /// What the template puts before and after the text's ids (add_special_tokens).
  std::vector<int32_t> prefix;
  std::vector<int32_t> suffix;

  /// `text` cut into pieces by every step.
  std::vector<std::string> pieces(const std::string& text) const {
    std::vector<std::string> parts{text};
    for (auto& s : steps) {
      std::vector<std::string> next;
      for (auto& part : parts)
        split(s, part, next);
      parts = std::move(next);
    }
    return parts;
  }

  std::string normalize(const std::string& text, const std::string& origin) const {
    if (normalizers.empty())
      return text;
    auto u = icu::UnicodeString::fromUTF8(text);
    for (auto* n : normalizers) {
      UErrorCode status = U_ZERO_ERROR;
      u = n->normalize(u, status);
      if (U_FAILURE(status))
        bad(origin, std::string{"normalization failed: "} + u_errorName(status));
    }
    std::string out;
    u.toUTF8String(out);
    return out;
  }

private:
  /// The tokenizers library's `Isolated` behaviour: matches and the text between them
  /// are pieces of their own.
  static void split(const step& s, const std::string& part, std::vector<std::string>& out) {
    if (part.empty())
      return;
    if (s.what == step::kind::prefix_space) {
      out.push_back(part.front() == ' ' ? part : " " + part);
      return;
    }
    if (s.what == step::kind::digits) {
      size_t i = 0;
      while (i < part.size()) {
        bool digit = std::isdigit(static_cast<unsigned char>(part[i])) != 0;
        size_t j = i + 1;
        if (!digit || !s.individual_digits)
          while (j < part.size() &&
                 (std::isdigit(static_cast<unsigned char>(part[j])) != 0) == digit)
            ++j;
        out.push_back(part.substr(i, j - i));
        i = j;
      }
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

tokenizer::tokenizer() {
  // GGUF files: GPT-2's pattern, one pipeline for all (tokenizer.json replaces it).
  static const auto gguf = [] {
    auto p = std::make_shared<pipeline>();
    p->steps.emplace_back();
    p->steps.back().re = gpt2_regex();
    return std::shared_ptr<const pipeline>(p);
  }();
  pipeline_ = gguf;
}

namespace {

/// The normal forms of a tokenizer.json normalizer; refuses other types by name.
void read_normalizer(const nlohmann::json& n, const std::string& origin,
                     std::vector<const icu::Normalizer2*>& out) {
  if (n.is_null())
    return;
  auto type = n.value("type", std::string{});
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* form = nullptr;
  if (type == "Sequence") {
    for (auto& inner : n.value("normalizers", nlohmann::json::array()))
      read_normalizer(inner, origin, out);
    return;
  }
  if (type == "NFC")
    form = icu::Normalizer2::getNFCInstance(status);
  else if (type == "NFD")
    form = icu::Normalizer2::getNFDInstance(status);
  else if (type == "NFKC")
    form = icu::Normalizer2::getNFKCInstance(status);
  else if (type == "NFKD")
    form = icu::Normalizer2::getNFKDInstance(status);
  else
    bad(origin, "normalizer '" + type + "' is not supported (NFC, NFD, NFKC, NFKD, Sequence)");
  if (U_FAILURE(status) || form == nullptr)
    bad(origin, "normalizer " + type + " is not available from ICU");
  out.push_back(form);
}

} // namespace

void tokenizer::read_pipeline(const nlohmann::json& j, const std::string& origin) {
  auto p = std::make_shared<pipeline>();
  read_normalizer(j.value("normalizer", nlohmann::json()), origin, p->normalizers);
  using kind = pipeline::step::kind;
  // Steps are filled in place: a regex left default-constructed in a temporary step trips
  // GCC's maybe-uninitialized warning inside Boost.
  auto add_step = [&](kind what, const boost::u32regex* re, bool individual_digits) {
    auto& s = p->steps.emplace_back();
    s.what = what;
    if (re != nullptr)
      s.re = *re;
    s.individual_digits = individual_digits;
  };
  std::function<void(const nlohmann::json&)> pre = [&](const nlohmann::json& t) {
    if (t.is_null())
      return;
    auto type = t.value("type", std::string{});
    if (type == "Sequence") {
      for (auto& inner : t.value("pretokenizers", nlohmann::json::array()))
        pre(inner);
    } else if (type == "ByteLevel") {
      if (t.value("add_prefix_space", false))
        add_step(kind::prefix_space, nullptr, false);
      if (t.value("use_regex", true))
        add_step(kind::isolate, &gpt2_regex(), false);
    } else if (type == "Split") {
      auto& pattern = t["pattern"];
      auto behavior = t.value("behavior", std::string{});
      if (behavior != "Isolated" || t.value("invert", false))
        bad(origin, "pre-tokenizer Split with behavior '" + behavior +
                      "' is not supported (Isolated, not inverted)");
      std::string regex;
      if (pattern.contains("Regex")) {
        regex = pattern["Regex"].get<std::string>();
      } else if (pattern.contains("String")) {
        // A literal string: every character escaped.
        for (char c : pattern["String"].get<std::string>()) {
          if (std::string{"\\^$.|?*+()[]{}"}.find(c) != std::string::npos)
            regex += '\\';
          regex += c;
        }
      } else {
        bad(origin, "pre-tokenizer Split has no Regex or String pattern");
      }
      auto re = tokenizer_regex(regex, origin);
      add_step(kind::isolate, &re, false);
    } else if (type == "Digits") {
      add_step(kind::digits, nullptr, t.value("individual_digits", false));
    } else {
      bad(origin, "pre-tokenizer '" + type +
                    "' is not supported (ByteLevel, Split, Digits, Sequence)");
    }
  };
  pre(j.value("pre_tokenizer", nlohmann::json()));
  std::function<void(const nlohmann::json&)> post = [&](const nlohmann::json& t) {
    if (t.is_null())
      return;
    auto type = t.value("type", std::string{});
    if (type == "Sequence") {
      for (auto& inner : t.value("processors", nlohmann::json::array()))
        post(inner);
    } else if (type == "TemplateProcessing") {
      bool before = true;
      for (auto& item : t.value("single", nlohmann::json::array())) {
        if (item.contains("Sequence")) {
          before = false;
          continue;
        }
        auto name = item["SpecialToken"].value("id", std::string{});
        auto& specials = t["special_tokens"];
        if (!specials.contains(name))
          bad(origin, "template names '" + name + "', which its special_tokens lack");
        for (auto& id : specials[name]["ids"])
          (before ? p->prefix : p->suffix).push_back(id.get<int32_t>());
      }
    } else if (type != "ByteLevel") { // byte-level post-processing moves offsets only
      bad(origin, "post-processor '" + type +
                    "' is not supported (TemplateProcessing, ByteLevel, Sequence)");
    }
  };
  post(j.value("post_processor", nlohmann::json()));
  auto decoder = j.value("decoder", nlohmann::json());
  if (!decoder.is_null() && decoder.value("type", std::string{}) != "ByteLevel")
    bad(origin, "decoder '" + decoder.value("type", std::string{}) +
                  "' is not supported (ByteLevel)");
  pipeline_ = p;
}

void tokenizer::add_merge(const std::string& left, const std::string& right, int32_t rank) {
  merge_ranks_.emplace(left + " " + right, rank);
}

void tokenizer::finish(const std::string& origin) {
  if (id_to_token_.empty())
    bad(origin, "has no vocabulary");
  for (size_t i = 0; i < id_to_token_.size(); ++i)
    vocab_.emplace(id_to_token_[i], static_cast<int32_t>(i));
  for (int id : special_ids_)
    specials_.emplace_back(id_to_token_[static_cast<size_t>(id)], id);
  std::sort(specials_.begin(), specials_.end(),
            [](auto& a, auto& b) { return a.first.size() > b.first.size(); });
  // Every printable ASCII byte must be a token on its own, or it is not byte-level BPE.
  // (Bytes that valid UTF-8 never contains may be missing.)
  for (int b = 33; b < 127; ++b)
    if (vocab_.count(bytes().to_text[static_cast<size_t>(b)]) == 0)
      bad(origin, "is not byte-level BPE: no token for the byte '" +
                    std::string(1, static_cast<char>(b)) + "'");
}

tokenizer tokenizer::from_json(const std::string& path) {
  std::ifstream in{path};
  if (!in)
    bad(path, "cannot be read");
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.contains("model"))
    bad(path, "is not a tokenizer.json");
  auto& model = j["model"];
  if (model.value("type", std::string{}) != "BPE" || !model.contains("vocab"))
    bad(path, "model is not BPE");
  tokenizer t;
  auto& vocab = model["vocab"];
  t.id_to_token_.resize(vocab.size());
  for (auto& [text, id] : vocab.items()) {
    auto i = id.get<int64_t>();
    if (i < 0 || i >= static_cast<int64_t>(vocab.size()))
      bad(path, "token '" + text + "' has id " + std::to_string(i) + " outside the vocabulary");
    t.id_to_token_[static_cast<size_t>(i)] = text;
  }
  int32_t rank = 0;
  for (auto& m : model.value("merges", nlohmann::json::array())) {
    if (m.is_string()) {
      auto s = m.get<std::string>();
      auto space = s.find(' ');
      if (space == std::string::npos)
        bad(path, "merge '" + s + "' has no space");
      t.add_merge(s.substr(0, space), s.substr(space + 1), rank++);
    } else if (m.is_array() && m.size() == 2) {
      t.add_merge(m[0].get<std::string>(), m[1].get<std::string>(), rank++);
    }
  }
  for (auto& added : j.value("added_tokens", nlohmann::json::array())) {
    auto id = added.value("id", -1);
    auto content = added.value("content", std::string{});
    if (id < 0)
      continue;
    if (static_cast<size_t>(id) >= t.id_to_token_.size())
      t.id_to_token_.resize(static_cast<size_t>(id) + 1);
    t.id_to_token_[static_cast<size_t>(id)] = content;
    if (added.value("special", false))
      t.special_ids_.insert(id);
  }
  t.read_pipeline(j, path);
  t.finish(path);
  return t;
}

tokenizer tokenizer::from_gguf(const std::string& path) {
  gguf_file file{path};
  auto string_of = [&](const char* key) {
    auto s = file.find<std::string>(key);
    return s ? *s : std::string{};
  };
  auto id_of = [&](const char* key) {
    auto v = file.find<int64_t>(key);
    return v ? static_cast<int32_t>(*v) : -1;
  };
  if (string_of("tokenizer.ggml.model") != "gpt2")
    bad(path, "tokenizer model '" + string_of("tokenizer.ggml.model") +
                "' is not byte-level BPE (gpt2)");
  auto tokens = file.find<std::vector<std::string>>("tokenizer.ggml.tokens");
  if (tokens == nullptr)
    bad(path, "has no tokenizer.ggml.tokens");
  tokenizer t;
  t.id_to_token_ = *tokens;
  if (auto merges = file.find<std::vector<std::string>>("tokenizer.ggml.merges")) {
    int32_t rank = 0;
    for (auto& m : *merges) {
      auto space = m.find(' ');
      if (space != std::string::npos)
        t.add_merge(m.substr(0, space), m.substr(space + 1), rank++);
    }
  }
  // Token type 3 is a control token: special.
  if (auto types = file.find<std::vector<double>>("tokenizer.ggml.token_type"))
    for (size_t i = 0; i < types->size() && i < t.id_to_token_.size(); ++i)
      if ((*types)[i] == 3.0)
        t.special_ids_.insert(static_cast<int32_t>(i));
  t.bos_ = id_of("tokenizer.ggml.bos_token_id");
  t.eos_ = id_of("tokenizer.ggml.eos_token_id");
  t.chat_template_ = string_of("tokenizer.chat_template");
  t.finish(path);
  return t;
}

int32_t tokenizer::token_id(const std::string& token) const {
  auto i = vocab_.find(token);
  return i == vocab_.end() ? -1 : i->second;
}

void tokenizer::encode_piece(const std::string& piece, std::vector<int32_t>& out) const {
  // One symbol per byte, in GPT-2's printable form.
  std::vector<std::string> symbols;
  for (unsigned char c : piece)
    symbols.push_back(bytes().to_text[c]);
  auto whole = std::string{};
  for (auto& s : symbols)
    whole += s;
  if (auto hit = vocab_.find(whole); hit != vocab_.end() && !special_ids_.count(hit->second)) {
    out.push_back(hit->second);
    return;
  }
  // Merge the adjacent pair of lowest rank until none is left.
  while (symbols.size() > 1) {
    int32_t best = std::numeric_limits<int32_t>::max();
    size_t at = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto rank = merge_ranks_.find(symbols[i] + " " + symbols[i + 1]);
      if (rank != merge_ranks_.end() && rank->second < best) {
        best = rank->second;
        at = i;
      }
    }
    if (best == std::numeric_limits<int32_t>::max())
      break;
    symbols[at] += symbols[at + 1];
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  for (auto& s : symbols) {
    auto id = vocab_.find(s);
    if (id == vocab_.end())
      throw error{errc::invalid_argument, "tokenizer: no token for symbol '" + s + "'"};
    out.push_back(id->second);
  }
}

std::vector<int32_t> tokenizer::encode(std::string_view text, bool parse_special,
                                       bool add_special_tokens) const {
  check_utf8(text);
  std::vector<int32_t> out;
  if (add_special_tokens)
    out = pipeline_->prefix;
  auto encode_plain = [&](std::string_view part) {
    if (part.empty())
      return;
    for (auto& piece : pipeline_->pieces(pipeline_->normalize(std::string{part}, "text")))
      encode_piece(piece, out);
  };
  size_t start = 0;
  size_t pos = 0;
  while (parse_special && pos < text.size()) {
    bool matched = false;
    for (auto& [special, id] : specials_) {
      if (text.compare(pos, special.size(), special) == 0) {
        encode_plain(text.substr(start, pos - start));
        out.push_back(id);
        pos += special.size();
        start = pos;
        matched = true;
        break;
      }
    }
    if (!matched)
      ++pos;
  }
  encode_plain(text.substr(start));
  if (add_special_tokens)
    out.insert(out.end(), pipeline_->suffix.begin(), pipeline_->suffix.end());
  return out;
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

std::string tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  for (auto id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size())
      throw error{errc::invalid_argument, "tokenizer: id " + std::to_string(id) +
                                            " is outside the vocabulary of " +
                                            std::to_string(id_to_token_.size())};
    auto& token = id_to_token_[static_cast<size_t>(id)];
    if (special_ids_.count(id)) {
      if (!skip_special)
        out += token;
      continue;
    }
    // Each UTF-8 character of the token stands for one byte.
    for (size_t i = 0; i < token.size();) {
      auto n = std::max<size_t>(1, sequence_length(static_cast<unsigned char>(token[i])));
      auto ch = token.substr(i, n);
      auto b = bytes().to_byte.find(ch);
      if (b != bytes().to_byte.end())
        out.push_back(static_cast<char>(b->second));
      else
        out += ch; // an added, non-byte-level token
      i += n;
    }
  }
  // Ids that end inside a character (an emoji over two tokens, a cut-off generation) give
  // bytes that are not UTF-8: as transformers, each broken sequence becomes U+FFFD.
  return valid_utf8(out);
}

} // namespace troupe
