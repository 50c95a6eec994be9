#include "engine/byte_regex.hpp"

#include "model/tokenizer.hpp"
#include "troupe/errors.hpp"

#include <algorithm>
#include <bitset>
#include <cctype>
#include <map>
#include <memory>

namespace troupe {

namespace {

using byte_set = std::bitset<256>;

[[noreturn]] void bad(const std::string& pattern, size_t at, const std::string& what) {
  throw error{errc::invalid_argument, "guided_regex '" + pattern + "': " + what +
                                        " (at character " + std::to_string(at) + ")"};
}

/// A parsed expression.
struct expr {
  enum class kind { bytes, concat, alternatives, repeat };
  kind what = kind::concat;
  byte_set set;
  std::vector<std::unique_ptr<expr>> parts;
  int min = 0;
  int max = -1; // -1: no bound
};
using expr_ptr = std::unique_ptr<expr>;

expr_ptr bytes_of(byte_set s) {
  auto e = std::make_unique<expr>();
  e->what = expr::kind::bytes;
  e->set = s;
  return e;
}

expr_ptr sequence(std::vector<expr_ptr> parts) {
  auto e = std::make_unique<expr>();
  e->what = expr::kind::concat;
  e->parts = std::move(parts);
  return e;
}

byte_set range(int lo, int hi) {
  byte_set s;
  for (int b = lo; b <= hi; ++b)
    s.set(static_cast<size_t>(b));
  return s;
}

/// The UTF-8 bytes of a code point.
std::string utf8(uint32_t cp) {
  std::string out;
  append_utf8(out, cp);
  return out;
}

expr_ptr literal(const std::string& bytes) {
  std::vector<expr_ptr> parts;
  for (auto c : bytes) {
    byte_set s;
    s.set(static_cast<uint8_t>(c));
    parts.push_back(bytes_of(s));
  }
  return parts.size() == 1 ? std::move(parts[0]) : sequence(std::move(parts));
}

/// Any character of `ascii`, or (with `multibyte`) any character of two to four bytes.
expr_ptr characters(const byte_set& ascii, bool multibyte,
                    const std::vector<std::string>& others = {}) {
  auto e = std::make_unique<expr>();
  e->what = expr::kind::alternatives;
  if (ascii.any())
    e->parts.push_back(bytes_of(ascii));
  if (multibyte) {
    auto cont = range(0x80, 0xbf);
    std::vector<expr_ptr> two, three, four;
    two.push_back(bytes_of(range(0xc2, 0xdf)));
    two.push_back(bytes_of(cont));
    three.push_back(bytes_of(range(0xe0, 0xef)));
    three.push_back(bytes_of(cont));
    three.push_back(bytes_of(cont));
    four.push_back(bytes_of(range(0xf0, 0xf4)));
    for (int i = 0; i < 3; ++i)
      four.push_back(bytes_of(cont));
    e->parts.push_back(sequence(std::move(two)));
    e->parts.push_back(sequence(std::move(three)));
    e->parts.push_back(sequence(std::move(four)));
  }
  for (auto& o : others)
    e->parts.push_back(literal(o));
  return e;
}

/// The parser: recursive descent over the pattern's UTF-8 text.
class parser {
public:
  explicit parser(const std::string& p) : p_(p) {}

  expr_ptr parse() {
    if (at_ < p_.size() && p_[at_] == '^')
      ++at_;
    auto e = alternatives();
    if (at_ < p_.size())
      fail(p_[at_] == ')' ? "an unopened ')'" : "an unexpected character");
    return e;
  }

private:
  [[noreturn]] void fail(const std::string& what) const {
    bad(p_, at_, what);
  }

  bool more() const {
    return at_ < p_.size();
  }

  expr_ptr alternatives() {
    std::vector<expr_ptr> options;
    options.push_back(concatenation());
    while (more() && p_[at_] == '|') {
      ++at_;
      options.push_back(concatenation());
    }
    if (options.size() == 1)
      return std::move(options[0]);
    auto e = std::make_unique<expr>();
    e->what = expr::kind::alternatives;
    e->parts = std::move(options);
    return e;
  }

  expr_ptr concatenation() {
    std::vector<expr_ptr> parts;
    while (more() && p_[at_] != '|' && p_[at_] != ')') {
      if (p_[at_] == '$' && at_ + 1 == p_.size()) {
        ++at_; // the end: the whole output matches anyway
        break;
      }
      parts.push_back(repetition());
    }
    return sequence(std::move(parts));
  }

  int number() {
    if (!more() || !std::isdigit(static_cast<unsigned char>(p_[at_])))
      fail("a count expected in '{}'");
    long n = 0;
    while (more() && std::isdigit(static_cast<unsigned char>(p_[at_]))) {
      n = n * 10 + (p_[at_++] - '0');
      if (n > 1000)
        fail("a count above 1000");
    }
    return static_cast<int>(n);
  }

  expr_ptr repetition() {
    auto e = atom();
    while (more()) {
      int lo = 0, hi = -1;
      char c = p_[at_];
      if (c == '*') {
        ++at_;
      } else if (c == '+') {
        ++at_;
        lo = 1;
      } else if (c == '?') {
        ++at_;
        hi = 1;
      } else if (c == '{' && at_ + 1 < p_.size() &&
                 std::isdigit(static_cast<unsigned char>(p_[at_ + 1]))) {
        ++at_;
        lo = hi = number();
        if (more() && p_[at_] == ',') {
          ++at_;
          hi = more() && p_[at_] == '}' ? -1 : number();
        }
        if (!more() || p_[at_] != '}')
          fail("an unclosed '{'");
        ++at_;
        if (hi >= 0 && hi < lo)
          fail("a count range whose end is below its start");
      } else {
        break;
      }
      // A lazy or possessive quantifier matches the same outputs.
      if (more() && (p_[at_] == '?' || p_[at_] == '+'))
        ++at_;
      auto r = std::make_unique<expr>();
      r->what = expr::kind::repeat;
      r->min = lo;
      r->max = hi;
      r->parts.push_back(std::move(e));
      e = std::move(r);
    }
    return e;
  }

  /// One UTF-8 character at `at_`, as its code point; moves past it.
  uint32_t character() {
    auto c = static_cast<unsigned char>(p_[at_]);
    int len = c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
    if (at_ + static_cast<size_t>(len) > p_.size())
      fail("a broken UTF-8 character");
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
    for (int i = 1; i < len; ++i)
      cp = cp << 6 | (static_cast<unsigned char>(p_[at_ + static_cast<size_t>(i)]) & 0x3f);
    at_ += static_cast<size_t>(len);
    return cp;
  }

  uint32_t hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      if (!more() || !std::isxdigit(static_cast<unsigned char>(p_[at_])))
        fail("a hex escape needs " + std::to_string(digits) + " hex digits");
      auto c = static_cast<char>(std::tolower(static_cast<unsigned char>(p_[at_++])));
      v = v * 16 + static_cast<uint32_t>(c <= '9' ? c - '0' : c - 'a' + 10);
    }
    return v;
  }

  /// A class escape's ASCII set (\d \w \s), negated when upper case; false for another
  /// escape.
  static bool class_escape(char c, byte_set& set, bool& negated) {
    switch (std::tolower(static_cast<unsigned char>(c))) {
    case 'd':
      set = range('0', '9');
      break;
    case 'w':
      set = range('0', '9') | range('a', 'z') | range('A', 'Z');
      set.set('_');
      break;
    case 's':
      for (char s : {' ', '\t', '\n', '\r', '\f', '\v'})
        set.set(static_cast<uint8_t>(s));
      break;
    default:
      return false;
    }
    negated = std::isupper(static_cast<unsigned char>(c)) != 0;
    return true;
  }

  /// The code point of a one-character escape after the backslash (`at_` on it).
  uint32_t escaped() {
    char c = p_[at_++];
    switch (c) {
    case 'n':
      return '\n';
    case 't':
      return '\t';
    case 'r':
      return '\r';
    case 'f':
      return '\f';
    case 'v':
      return '\v';
    case '0':
      return 0;
    case 'x':
      return hex(2);
    case 'u':
      return hex(4);
    case 'U':
      return hex(8);
    default:
      break;
    }
    if (std::isalnum(static_cast<unsigned char>(c))) {
      --at_;
      fail(std::string{"the escape '\\"} + c +
           "' (backreferences, \\b and the like are not "
           "supported)");
    }
    return static_cast<unsigned char>(c);
  }

  expr_ptr atom() {
    char c = p_[at_];
    if (c == '(') {
      ++at_;
      if (more() && p_[at_] == '?') {
        ++at_;
        if (more() && p_[at_] == ':') {
          ++at_;
        } else if (more() && (p_[at_] == 'P' || p_[at_] == '<') &&
                   !(p_[at_] == '<' && at_ + 1 < p_.size() &&
                     (p_[at_ + 1] == '=' || p_[at_ + 1] == '!'))) {
          auto close = p_.find('>', at_);
          if (close == std::string::npos)
            fail("an unclosed group name");
          at_ = close + 1;
        } else {
          fail("lookaround and inline flags are not supported");
        }
      }
      auto e = alternatives();
      if (!more() || p_[at_] != ')')
        fail("an unclosed '('");
      ++at_;
      return e;
    }
    if (c == '[')
      return char_class();
    if (c == '.') {
      ++at_;
      auto ascii = range(0, 0x7f);
      ascii.reset('\n');
      return characters(ascii, true);
    }
    if (c == '*' || c == '+' || c == '?' || c == '{')
      fail("a quantifier with nothing before it");
    if (c == '^' || c == '$')
      fail("an anchor inside the pattern");
    if (c == '\\') {
      ++at_;
      if (!more())
        fail("a trailing backslash");
      byte_set set;
      bool negated = false;
      if (class_escape(p_[at_], set, negated)) {
        ++at_;
        if (!negated)
          return characters(set, false);
        return characters(~set & range(0, 0x7f), true);
      }
      return literal(utf8(escaped()));
    }
    return literal(utf8(character()));
  }

  expr_ptr char_class() {
    ++at_; // '['
    bool negated = more() && p_[at_] == '^';
    if (negated)
      ++at_;
    byte_set ascii;
    std::vector<std::string> others;
    bool first = true;
    while (more() && (p_[at_] != ']' || first)) {
      first = false;
      uint32_t lo = 0;
      if (p_[at_] == '\\') {
        ++at_;
        if (!more())
          fail("a trailing backslash");
        byte_set set;
        bool neg = false;
        if (class_escape(p_[at_], set, neg)) {
          ++at_;
          if (neg)
            fail("a negated class escape inside a class");
          ascii |= set;
          continue;
        }
        lo = escaped();
      } else {
        lo = character();
      }
      uint32_t hi = lo;
      if (at_ + 1 < p_.size() && p_[at_] == '-' && p_[at_ + 1] != ']') {
        ++at_;
        if (p_[at_] == '\\') {
          ++at_;
          if (!more())
            fail("a trailing backslash");
          hi = escaped();
        } else {
          hi = character();
        }
        if (hi < lo)
          fail("a class range whose end is below its start");
      }
      if (hi < 0x80) {
        ascii |= range(static_cast<int>(lo), static_cast<int>(hi));
      } else if (lo == hi && !negated) {
        others.push_back(utf8(lo));
      } else {
        fail("a class range or negated character beyond ASCII");
      }
    }
    if (!more())
      fail("an unclosed '['");
    ++at_;
    if (negated) {
      auto rest = ~ascii & range(0, 0x7f);
      return characters(rest, true);
    }
    return characters(ascii, false, others);
  }

  const std::string& p_;
  size_t at_ = 0;
};

/// A Thompson automaton: byte-set edges and empty ones.
struct nfa {
  struct state {
    std::vector<std::pair<byte_set, int>> edges;
    std::vector<int> empty;
  };
  std::vector<state> states;
  size_t limit;
  const std::string& pattern;

  int add() {
    if (states.size() >= limit)
      bad(pattern, 0, "the pattern is too large (over " + std::to_string(limit) + " states)");
    states.emplace_back();
    return static_cast<int>(states.size() - 1);
  }

  /// Adds `e` from `from`; returns the state where it ends.
  int build(const expr& e, int from) {
    switch (e.what) {
    case expr::kind::bytes: {
      int to = add();
      states[static_cast<size_t>(from)].edges.emplace_back(e.set, to);
      return to;
    }
    case expr::kind::concat:
      for (auto& p : e.parts)
        from = build(*p, from);
      return from;
    case expr::kind::alternatives: {
      int end = add();
      for (auto& p : e.parts) {
        int start = add();
        states[static_cast<size_t>(from)].empty.push_back(start);
        states[static_cast<size_t>(build(*p, start))].empty.push_back(end);
      }
      return end;
    }
    case expr::kind::repeat: {
      for (int i = 0; i < e.min; ++i)
        from = build(*e.parts[0], from);
      if (e.max < 0) {
        int loop = add();
        states[static_cast<size_t>(from)].empty.push_back(loop);
        states[static_cast<size_t>(build(*e.parts[0], loop))].empty.push_back(loop);
        return loop;
      }
      int end = add();
      states[static_cast<size_t>(from)].empty.push_back(end);
      for (int i = e.min; i < e.max; ++i) {
        from = build(*e.parts[0], from);
        states[static_cast<size_t>(from)].empty.push_back(end);
      }
      return end;
    }
    }
    return from;
  }

  /// `set` and every state it reaches by empty edges, sorted.
  std::vector<int> closure(std::vector<int> set) const {
    std::vector<bool> seen(states.size(), false);
    std::vector<int> work = set;
    for (auto s : set)
      seen[static_cast<size_t>(s)] = true;
    while (!work.empty()) {
      int s = work.back();
      work.pop_back();
      for (int t : states[static_cast<size_t>(s)].empty)
        if (!seen[static_cast<size_t>(t)]) {
          seen[static_cast<size_t>(t)] = true;
          set.push_back(t);
          work.push_back(t);
        }
    }
    std::sort(set.begin(), set.end());
    return set;
  }
};

} // namespace

byte_dfa compile_regex(const std::string& pattern, size_t max_states) {
  auto e = parser{pattern}.parse();
  nfa n{{}, max_states * 16, pattern};
  int start = n.add();
  int accept = n.build(*e, start);
  byte_dfa dfa;
  std::map<std::vector<int>, int32_t> known;
  std::vector<std::vector<int>> sets;
  auto state_of = [&](std::vector<int> set) -> int32_t {
    auto found = known.find(set);
    if (found != known.end())
      return found->second;
    if (sets.size() >= max_states)
      bad(pattern, 0,
          "the pattern's automaton is too large (over " + std::to_string(max_states) + " states)");
    auto id = static_cast<int32_t>(sets.size());
    known.emplace(set, id);
    dfa.accepting.push_back(std::binary_search(set.begin(), set.end(), accept));
    sets.push_back(std::move(set));
    dfa.next.emplace_back();
    dfa.next.back().fill(-1);
    return id;
  };
  state_of(n.closure({start}));
  for (size_t s = 0; s < sets.size(); ++s) {
    std::array<std::vector<int>, 256> moves;
    for (int q : sets[s])
      for (auto& [set, to] : n.states[static_cast<size_t>(q)].edges)
        for (size_t b = 0; b < 256; ++b)
          if (set.test(b))
            moves[b].push_back(to);
    for (size_t b = 0; b < 256; ++b)
      if (!moves[b].empty()) {
        auto target = state_of(n.closure(std::move(moves[b])));
        dfa.next[s][b] = target;
      }
  }
  for (auto& row : dfa.next)
    dfa.continues.push_back(std::any_of(row.begin(), row.end(), [](int32_t t) { return t >= 0; }));
  return dfa;
}

} // namespace troupe
