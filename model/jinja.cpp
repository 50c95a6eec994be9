#include "model/jinja.hpp"

#include "model/tokenizer.hpp"
#include "troupe/errors.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <ctime>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <vector>

namespace troupe {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw error{errc::invalid_argument, "chat template: " + what};
}

// ---------------------------------------------------------------------------------------
// Values: what Python values the templates see (None, bool, int, float, str, list, dict)
// and Jinja's own (undefined, callables, namespaces).

struct value;
using args_list = std::vector<value>;
using kwargs_list = std::vector<std::pair<std::string, value>>;
using callable = std::function<value(args_list&, kwargs_list&)>;

struct dict {
  std::vector<std::pair<std::string, value>> items;
  value* find(const std::string& key);
  void set(const std::string& key, value v);
};

struct value {
  enum class kind { undefined, none, boolean, integer, floating, string, list, object, function };
  kind k = kind::undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s; // a string; an undefined value's name
  std::shared_ptr<std::vector<value>> l;
  std::shared_ptr<dict> o;
  std::shared_ptr<callable> fn;
  bool is_namespace = false;

  static value undefined(std::string name = {}) {
    value v;
    v.s = std::move(name);
    return v;
  }
  static value none() {
    value v;
    v.k = kind::none;
    return v;
  }
  static value boolean(bool b) {
    value v;
    v.k = kind::boolean;
    v.b = b;
    return v;
  }
  static value integer(int64_t i) {
    value v;
    v.k = kind::integer;
    v.i = i;
    return v;
  }
  static value floating(double f) {
    value v;
    v.k = kind::floating;
    v.f = f;
    return v;
  }
  static value string(std::string s) {
    value v;
    v.k = kind::string;
    v.s = std::move(s);
    return v;
  }
  static value list(std::vector<value> items = {}) {
    value v;
    v.k = kind::list;
    v.l = std::make_shared<std::vector<value>>(std::move(items));
    return v;
  }
  static value object() {
    value v;
    v.k = kind::object;
    v.o = std::make_shared<dict>();
    return v;
  }
  static value function(callable c) {
    value v;
    v.k = kind::function;
    v.fn = std::make_shared<callable>(std::move(c));
    return v;
  }

  bool defined() const {
    return k != kind::undefined;
  }
  bool number() const {
    return k == kind::integer || k == kind::floating || k == kind::boolean;
  }
  double as_double() const {
    return k == kind::floating ? f : k == kind::boolean ? (b ? 1.0 : 0.0) : static_cast<double>(i);
  }
  int64_t as_int() const {
    return k == kind::floating ? static_cast<int64_t>(f) : k == kind::boolean ? (b ? 1 : 0) : i;
  }
};

value* dict::find(const std::string& key) {
  for (auto& [k, v] : items)
    if (k == key)
      return &v;
  return nullptr;
}

void dict::set(const std::string& key, value v) {
  if (auto* at = find(key))
    *at = std::move(v);
  else
    items.emplace_back(key, std::move(v));
}

const char* type_name(const value& v) {
  switch (v.k) {
  case value::kind::undefined:
    return "undefined";
  case value::kind::none:
    return "NoneType";
  case value::kind::boolean:
    return "bool";
  case value::kind::integer:
    return "int";
  case value::kind::floating:
    return "float";
  case value::kind::string:
    return "str";
  case value::kind::list:
    return "list";
  case value::kind::object:
    return v.is_namespace ? "Namespace" : "dict";
  case value::kind::function:
    return "function";
  }
  return "value";
}

value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
  case nlohmann::ordered_json::value_t::null:
    return value::none();
  case nlohmann::ordered_json::value_t::boolean:
    return value::boolean(j.get<bool>());
  case nlohmann::ordered_json::value_t::number_integer:
    return value::integer(j.get<int64_t>());
  case nlohmann::ordered_json::value_t::number_unsigned:
    return value::integer(static_cast<int64_t>(j.get<uint64_t>()));
  case nlohmann::ordered_json::value_t::number_float:
    return value::floating(j.get<double>());
  case nlohmann::ordered_json::value_t::string:
    return value::string(j.get<std::string>());
  case nlohmann::ordered_json::value_t::array: {
    auto out = value::list();
    for (auto& e : j)
      out.l->push_back(from_json(e));
    return out;
  }
  case nlohmann::ordered_json::value_t::object: {
    auto out = value::object();
    for (auto& [k, e] : j.items())
      out.o->items.emplace_back(k, from_json(e));
    return out;
  }
  default:
    return value::none();
  }
}

// ---------------------------------------------------------------------------------------
// UTF-8: Python counts code points.

std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    n = std::min(n, s.size() - i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

uint32_t decode_point(const std::string& cp) {
  auto c = static_cast<unsigned char>(cp[0]);
  if (cp.size() == 1)
    return c;
  uint32_t v = c & (0xff >> (cp.size() + 1));
  for (size_t i = 1; i < cp.size(); ++i)
    v = (v << 6) | (static_cast<unsigned char>(cp[i]) & 0x3f);
  return v;
}

// Python's str.isspace.
bool is_space(uint32_t c) {
  return (c >= 9 && c <= 13) || c == ' ' || (c >= 0x1c && c <= 0x1f) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

// Python's str.strip / lstrip / rstrip: whitespace, or the code points of `chars`.
std::string strip(const std::string& s, const value* chars, bool left, bool right) {
  auto cps = code_points(s);
  std::set<std::string> set;
  bool ws = chars == nullptr || chars->k == value::kind::none || !chars->defined();
  if (!ws)
    for (auto& c : code_points(chars->s))
      set.insert(c);
  auto strippable = [&](const std::string& c) {
    return ws ? is_space(decode_point(c)) : set.count(c) > 0;
  };
  size_t begin = 0;
  size_t end = cps.size();
  while (left && begin < end && strippable(cps[begin]))
    ++begin;
  while (right && end > begin && strippable(cps[end - 1]))
    --end;
  std::string out;
  for (size_t i = begin; i < end; ++i)
    out += cps[i];
  return out;
}

// ---------------------------------------------------------------------------------------
// Printing, as Python's str() and repr(), and JSON as Python's json.dumps.

std::string float_repr(double f) {
  if (std::isnan(f))
    return "nan";
  if (std::isinf(f))
    return f > 0 ? "inf" : "-inf";
  // The shortest digits that read back as f, laid out as Python's repr lays them out.
  char buf[64];
  int precision = 1;
  for (; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*e", precision - 1, f);
    if (std::strtod(buf, nullptr) == f)
      break;
  }
  std::string sci = buf;
  auto e = sci.find('e');
  int exponent = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : sci.substr(0, e))
    if (c >= '0' && c <= '9')
      digits += c;
  bool negative = sci[0] == '-';
  std::string out = negative ? "-" : "";
  if (exponent >= -4 && exponent < 16) {
    if (exponent >= 0) {
      auto whole = static_cast<size_t>(exponent) + 1;
      if (digits.size() <= whole)
        out += digits + std::string(whole - digits.size(), '0') + ".0";
      else
        out += digits.substr(0, whole) + "." + digits.substr(whole);
    } else {
      out += "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1)
    out += "." + digits.substr(1);
  char exp[16];
  std::snprintf(exp, sizeof exp, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
  return out + exp;
}

std::string repr(const value& v);

std::string str(const value& v) {
  switch (v.k) {
  case value::kind::undefined:
    return "";
  case value::kind::none:
    return "None";
  case value::kind::boolean:
    return v.b ? "True" : "False";
  case value::kind::integer:
    return std::to_string(v.i);
  case value::kind::floating:
    return float_repr(v.f);
  case value::kind::string:
    return v.s;
  default:
    return repr(v);
  }
}

std::string repr(const value& v) {
  switch (v.k) {
  case value::kind::string: {
    bool double_quotes = v.s.find('\'') != std::string::npos && v.s.find('"') == std::string::npos;
    char quote = double_quotes ? '"' : '\'';
    std::string out(1, quote);
    for (char c : v.s) {
      if (c == '\\')
        out += "\\\\";
      else if (c == quote)
        out += std::string("\\") + c;
      else if (c == '\n')
        out += "\\n";
      else if (c == '\r')
        out += "\\r";
      else if (c == '\t')
        out += "\\t";
      else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned char>(c));
        out += buf;
      } else
        out += c;
    }
    return out + quote;
  }
  case value::kind::list: {
    std::string out = "[";
    for (size_t i = 0; i < v.l->size(); ++i)
      out += (i ? ", " : "") + repr((*v.l)[i]);
    return out + "]";
  }
  case value::kind::object: {
    std::string out = v.is_namespace ? "<Namespace {" : "{";
    bool first = true;
    for (auto& [k, e] : v.o->items) {
      out += (first ? "" : ", ") + repr(value::string(k)) + ": " + repr(e);
      first = false;
    }
    return out + (v.is_namespace ? "}>" : "}");
  }
  case value::kind::function:
    return "<function>";
  default:
    return str(v);
  }
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
    case '"':
      out += "\\\"";
      break;
    case '\\':
      out += "\\\\";
      break;
    case '\n':
      out += "\\n";
      break;
    case '\r':
      out += "\\r";
      break;
    case '\t':
      out += "\\t";
      break;
    case '\b':
      out += "\\b";
      break;
    case '\f':
      out += "\\f";
      break;
    default:
      if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
        out += buf;
      } else {
        out += c;
      }
    }
  }
  return out + "\"";
}

// json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=sort_keys).
void to_json(const value& v, int64_t indent, const std::string& item_sep,
             const std::string& key_sep, bool sort_keys, int depth, std::string& out) {
  auto newline = [&](int d) {
    if (indent >= 0)
      out += "\n" + std::string(static_cast<size_t>(indent * d), ' ');
  };
  switch (v.k) {
  case value::kind::none:
    out += "null";
    return;
  case value::kind::boolean:
    out += v.b ? "true" : "false";
    return;
  case value::kind::integer:
    out += std::to_string(v.i);
    return;
  case value::kind::floating:
    out += std::isnan(v.f)   ? "NaN"
           : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity")
                             : float_repr(v.f);
    return;
  case value::kind::string:
    out += json_string(v.s);
    return;
  case value::kind::list:
    if (v.l->empty()) {
      out += "[]";
      return;
    }
    out += "[";
    for (size_t i = 0; i < v.l->size(); ++i) {
      if (i)
        out += item_sep;
      newline(depth + 1);
      to_json((*v.l)[i], indent, item_sep, key_sep, sort_keys, depth + 1, out);
    }
    newline(depth);
    out += "]";
    return;
  case value::kind::object: {
    if (v.o->items.empty()) {
      out += "{}";
      return;
    }
    auto items = v.o->items;
    if (sort_keys)
      std::stable_sort(items.begin(), items.end(),
                       [](auto& a, auto& b) { return a.first < b.first; });
    out += "{";
    for (size_t i = 0; i < items.size(); ++i) {
      if (i)
        out += item_sep;
      newline(depth + 1);
      out += json_string(items[i].first) + key_sep;
      to_json(items[i].second, indent, item_sep, key_sep, sort_keys, depth + 1, out);
    }
    newline(depth);
    out += "}";
    return;
  }
  default:
    fail(std::string{"tojson: a value of type "} + type_name(v) + " is not JSON serializable");
  }
}

bool truthy(const value& v) {
  switch (v.k) {
  case value::kind::undefined:
  case value::kind::none:
    return false;
  case value::kind::boolean:
    return v.b;
  case value::kind::integer:
    return v.i != 0;
  case value::kind::floating:
    return v.f != 0;
  case value::kind::string:
    return !v.s.empty();
  case value::kind::list:
    return !v.l->empty();
  case value::kind::object:
    return v.is_namespace || !v.o->items.empty();
  case value::kind::function:
    return true;
  }
  return false;
}

bool equal(const value& a, const value& b) {
  if (a.number() && b.number())
    return a.as_double() == b.as_double();
  if (a.k != b.k)
    return false;
  switch (a.k) {
  case value::kind::undefined:
  case value::kind::none:
    return true;
  case value::kind::string:
    return a.s == b.s;
  case value::kind::list:
    if (a.l->size() != b.l->size())
      return false;
    for (size_t i = 0; i < a.l->size(); ++i)
      if (!equal((*a.l)[i], (*b.l)[i]))
        return false;
    return true;
  case value::kind::object:
    if (a.o == b.o)
      return true;
    if (a.o->items.size() != b.o->items.size())
      return false;
    for (auto& [k, v] : a.o->items) {
      auto* other = b.o->find(k);
      if (!other || !equal(v, *other))
        return false;
    }
    return true;
  default:
    return a.fn == b.fn;
  }
}

// a < b, for numbers, strings and lists, as Python orders them.
bool less(const value& a, const value& b) {
  if (a.number() && b.number())
    return a.as_double() < b.as_double();
  if (a.k == value::kind::string && b.k == value::kind::string)
    return a.s < b.s; // UTF-8 byte order is code point order
  if (a.k == value::kind::list && b.k == value::kind::list) {
    for (size_t i = 0; i < std::min(a.l->size(), b.l->size()); ++i) {
      if (less((*a.l)[i], (*b.l)[i]))
        return true;
      if (less((*b.l)[i], (*a.l)[i]))
        return false;
    }
    return a.l->size() < b.l->size();
  }
  fail(std::string{"'<' is not supported between "} + type_name(a) + " and " + type_name(b));
}

// ---------------------------------------------------------------------------------------
// Lexing: the template's text and tags, with transformers' whitespace rules.

struct token {
  enum class type { name, string, integer, floating, op, end } t = type::end;
  std::string text;
  int64_t i = 0;
  double f = 0;
};

struct chunk {
  enum class type { text, expression, statement } t = type::text;
  std::string text; // the text, or the tag's inside
  std::vector<token> tokens;
  int line = 1;
};

std::vector<token> tokenize(const std::string& src, int line) {
  std::vector<token> out;
  size_t i = 0;
  auto bad = [&](const std::string& what) {
    throw error{errc::invalid_argument,
                "chat template, line " + std::to_string(line) + ": " + what};
  };
  while (i < src.size()) {
    char c = src[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
      continue;
    }
    token t;
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < src.size() && (std::isalnum(static_cast<unsigned char>(src[j])) || src[j] == '_'))
        ++j;
      t.t = token::type::name;
      t.text = src.substr(i, j - i);
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool is_float = false;
      while (j < src.size() && (std::isdigit(static_cast<unsigned char>(src[j])) || src[j] == '_'))
        ++j;
      if (j + 1 < src.size() && src[j] == '.' &&
          std::isdigit(static_cast<unsigned char>(src[j + 1]))) {
        is_float = true;
        ++j;
        while (j < src.size() && std::isdigit(static_cast<unsigned char>(src[j])))
          ++j;
      }
      if (j < src.size() && (src[j] == 'e' || src[j] == 'E')) {
        size_t k = j + 1;
        if (k < src.size() && (src[k] == '+' || src[k] == '-'))
          ++k;
        if (k < src.size() && std::isdigit(static_cast<unsigned char>(src[k]))) {
          is_float = true;
          j = k;
          while (j < src.size() && std::isdigit(static_cast<unsigned char>(src[j])))
            ++j;
        }
      }
      std::string digits;
      for (size_t k = i; k < j; ++k)
        if (src[k] != '_')
          digits += src[k];
      if (is_float) {
        t.t = token::type::floating;
        t.f = std::stod(digits);
      } else {
        t.t = token::type::integer;
        t.i = std::stoll(digits);
      }
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string s;
      size_t j = i + 1;
      for (; j < src.size() && src[j] != c; ++j) {
        if (src[j] != '\\' || j + 1 >= src.size()) {
          s += src[j];
          continue;
        }
        char e = src[++j];
        switch (e) {
        case 'n':
          s += '\n';
          break;
        case 't':
          s += '\t';
          break;
        case 'r':
          s += '\r';
          break;
        case '0':
          s += '\0';
          break;
        case 'b':
          s += '\b';
          break;
        case 'f':
          s += '\f';
          break;
        case '\\':
          s += '\\';
          break;
        case '\'':
          s += '\'';
          break;
        case '"':
          s += '"';
          break;
        case '\n':
          break;
        case 'x':
        case 'u':
        case 'U': {
          size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          if (j + n >= src.size())
            bad("a cut-off \\" + std::string(1, e) + " escape");
          append_utf8(s, static_cast<uint32_t>(std::stoul(src.substr(j + 1, n), nullptr, 16)));
          j += n;
          break;
        }
        default:
          s += '\\';
          s += e;
        }
      }
      if (j >= src.size())
        bad("a string without its closing quote");
      t.t = token::type::string;
      t.text = s;
      i = j + 1;
    } else {
      static const char* ops[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*",
                                  "/",  "%",  "~",  "<",  ">",  "(",  ")", "[", "]",
                                  "{",  "}",  ",",  ".",  ":",  "|",  "="};
      bool found = false;
      for (auto* op : ops) {
        auto n = std::char_traits<char>::length(op);
        if (src.compare(i, n, op) == 0) {
          t.t = token::type::op;
          t.text = op;
          i += n;
          found = true;
          break;
        }
      }
      if (!found)
        bad(std::string{"unexpected character '"} + c + "'");
    }
    out.push_back(std::move(t));
  }
  out.push_back(token{});
  return out;
}

// Where a tag's `close` is, from `from`: outside string literals and, for `}}`, outside
// the braces of dict literals (as jinja's lexer balances them).
size_t tag_end(const std::string& src, size_t from, const std::string& close) {
  int depth = 0;
  for (size_t i = from; i < src.size(); ++i) {
    char c = src[i];
    if (c == '\'' || c == '"') {
      for (++i; i < src.size() && src[i] != c; ++i)
        if (src[i] == '\\')
          ++i;
      continue;
    }
    if (depth == 0 && src.compare(i, close.size(), close) == 0)
      return i;
    if (c == '{' || c == '(' || c == '[')
      ++depth;
    else if ((c == '}' || c == ')' || c == ']') && depth > 0)
      --depth;
  }
  return std::string::npos;
}

std::vector<chunk> lex(const std::string& src) {
  std::vector<chunk> out;
  size_t pos = 0;
  int line = 1;
  bool strip_next = false; // a `-` closed the last tag
  bool trim_next = false;  // a block tag closed the last tag (trim_blocks)
  auto add_text = [&](std::string text) {
    if (strip_next) {
      size_t k = 0;
      while (k < text.size() && std::isspace(static_cast<unsigned char>(text[k])))
        ++k;
      text.erase(0, k);
    } else if (trim_next) {
      if (text.compare(0, 1, "\n") == 0)
        text.erase(0, 1);
      else if (text.compare(0, 2, "\r\n") == 0)
        text.erase(0, 2);
    }
    strip_next = trim_next = false;
    chunk c;
    c.t = chunk::type::text;
    c.text = std::move(text);
    c.line = line;
    out.push_back(std::move(c));
  };
  while (pos < src.size()) {
    size_t open = src.find('{', pos);
    while (open != std::string::npos && open + 1 < src.size() && src[open + 1] != '{' &&
           src[open + 1] != '%' && src[open + 1] != '#')
      open = src.find('{', open + 1);
    if (open == std::string::npos || open + 1 >= src.size()) {
      add_text(src.substr(pos));
      break;
    }
    char kind = src[open + 1];
    std::string text = src.substr(pos, open - pos);
    line += static_cast<int>(std::count(text.begin(), text.end(), '\n'));
    size_t inner = open + 2;
    bool strip_before = inner < src.size() && src[inner] == '-';
    bool keep_before = inner < src.size() && src[inner] == '+';
    if (strip_before || keep_before)
      ++inner;
    // Whitespace before the tag: all of it for `-`; for a block or comment tag (lstrip_blocks)
    // the spaces and tabs between the line's start and the tag.
    if (strip_before) {
      while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back())))
        text.pop_back();
    } else if (kind != '{' && !keep_before) {
      size_t k = text.size();
      while (k > 0 && (text[k - 1] == ' ' || text[k - 1] == '\t'))
        --k;
      // Only at a line's start: the template's, or after a newline (a tag's end is not one).
      bool line_start = k > 0 ? text[k - 1] == '\n' : pos == 0;
      if (line_start)
        text.erase(k);
    }
    add_text(text);
    std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    size_t end = kind == '#' ? src.find(close, inner) : tag_end(src, inner, close);
    if (end == std::string::npos)
      throw error{errc::invalid_argument, "chat template, line " + std::to_string(line) +
                                            ": a tag without its closing '" + close + "'"};
    bool strip_after = end > inner && src[end - 1] == '-';
    std::string body = src.substr(inner, end - inner - (strip_after ? 1 : 0));
    int tag_line = line;
    line += static_cast<int>(std::count(body.begin(), body.end(), '\n'));
    pos = end + 2;
    strip_next = strip_after;
    trim_next = kind != '{';
    if (kind == '#')
      continue;
    chunk c;
    c.t = kind == '{' ? chunk::type::expression : chunk::type::statement;
    c.tokens = tokenize(body, tag_line);
    c.line = tag_line;
    out.push_back(std::move(c));
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// The syntax tree.

struct expr;
using expr_ptr = std::shared_ptr<expr>;

struct expr {
  enum class type {
    literal,
    name,
    list,
    tuple,
    dict,
    attr,
    item,
    slice,
    call,
    filter,
    test,
    unary,
    binary,
    conditional,
    logical_and,
    logical_or
  } t;
  value literal;
  std::string name; // a name, attribute, filter, test or operator
  std::vector<expr_ptr> args;
  std::vector<std::pair<std::string, expr_ptr>> kwargs;
  bool negated = false; // `is not`
  int line = 0;
};

struct node;
using node_list = std::vector<std::shared_ptr<node>>;

struct node {
  enum class type { text, output, if_, for_, set, set_block, macro, break_, continue_, block } t;
  std::string text;
  expr_ptr value;
  // if: conditions[i] guards bodies[i]; a last body without condition is the else.
  std::vector<expr_ptr> conditions;
  std::vector<node_list> bodies;
  // for / set targets; set's namespace attribute is target + "." + attribute.
  std::vector<std::string> targets;
  std::string attribute;
  expr_ptr filter;
  node_list body;
  node_list else_body;
  // macro parameters and defaults
  std::vector<std::pair<std::string, expr_ptr>> params;
  int line = 0;
};

const std::set<std::string> filters = {
  "abs",     "capitalize", "count",  "d",      "default",    "dictsort", "e",          "escape",
  "first",   "float",      "indent", "int",    "items",      "join",     "last",       "length",
  "list",    "lower",      "map",    "max",    "min",        "reject",   "rejectattr", "replace",
  "reverse", "round",      "safe",   "select", "selectattr", "sort",     "string",     "sum",
  "title",   "tojson",     "trim",   "unique", "upper",      "wordcount"};

const std::set<std::string> tests = {
  "boolean", "callable", "defined",  "divisibleby", "eq",   "equalto",   "even",
  "false",   "float",    "ge",       "gt",          "in",   "integer",   "iterable",
  "le",      "lower",    "lt",       "mapping",     "ne",   "none",      "number",
  "odd",     "sameas",   "sequence", "string",      "true", "undefined", "upper",
  "==",      "!=",       "<",        "<=",          ">",    ">="};

class parser {
public:
  explicit parser(std::vector<chunk> chunks) : chunks_(std::move(chunks)) {}

  node_list parse_all() {
    auto body = parse_body({});
    if (at_ < chunks_.size())
      error_at(chunks_[at_].line, "'" + chunks_[at_].tokens[0].text + "' without its opening tag");
    return body;
  }

private:
  [[noreturn]] void error_at(int line, const std::string& what) {
    throw troupe::error{errc::invalid_argument,
                        "chat template, line " + std::to_string(line) + ": " + what};
  }
  [[noreturn]] void syntax_error(const std::string& what) {
    error_at(line_, what);
  }

  // Statements up to (not including) one whose keyword is in `ends`.
  node_list parse_body(const std::set<std::string>& ends) {
    node_list out;
    while (at_ < chunks_.size()) {
      auto& c = chunks_[at_];
      line_ = c.line;
      if (c.t == chunk::type::text) {
        if (!c.text.empty()) {
          auto n = std::make_shared<node>();
          n->t = node::type::text;
          n->text = c.text;
          out.push_back(n);
        }
        ++at_;
        continue;
      }
      toks_ = &c.tokens;
      pos_ = 0;
      if (c.t == chunk::type::expression) {
        auto n = std::make_shared<node>();
        n->t = node::type::output;
        n->line = c.line;
        n->value = parse_expression();
        expect_end();
        out.push_back(n);
        ++at_;
        continue;
      }
      if (peek().t != token::type::name)
        syntax_error("a statement tag without a keyword");
      auto keyword = peek().text;
      if (ends.count(keyword))
        return out;
      ++at_;
      next();
      out.push_back(parse_statement(keyword, c.line));
    }
    if (!ends.empty())
      syntax_error("the template ends before '" + *ends.begin() + "'");
    return out;
  }

  // The tag that ended a body: its keyword, consumed.
  std::string end_tag() {
    auto& c = chunks_[at_];
    toks_ = &c.tokens;
    pos_ = 0;
    line_ = c.line;
    auto keyword = next().text;
    ++at_;
    return keyword;
  }

  std::shared_ptr<node> parse_statement(const std::string& keyword, int line) {
    auto n = std::make_shared<node>();
    n->line = line;
    if (keyword == "if") {
      n->t = node::type::if_;
      n->conditions.push_back(parse_expression());
      expect_end();
      for (;;) {
        n->bodies.push_back(parse_body({"elif", "else", "endif"}));
        auto tag = end_tag();
        if (tag == "elif") {
          n->conditions.push_back(parse_expression());
          expect_end();
        } else if (tag == "else") {
          expect_end();
          n->bodies.push_back(parse_body({"endif"}));
          end_tag();
          expect_end();
          break;
        } else {
          expect_end();
          break;
        }
      }
    } else if (keyword == "for") {
      n->t = node::type::for_;
      n->targets.push_back(expect_name());
      while (accept_op(","))
        n->targets.push_back(expect_name());
      if (!accept_name("in"))
        syntax_error("'for' without 'in'");
      n->value = parse_or_expression(); // `if` here filters, not a conditional
      if (accept_name("if"))
        n->filter = parse_or_expression();
      if (accept_name("recursive"))
        throw troupe::error{errc::unsupported, "chat template, line " + std::to_string(line) +
                                                 ": recursive loops are not supported"};
      expect_end();
      n->body = parse_body({"else", "endfor"});
      if (end_tag() == "else") {
        expect_end();
        n->else_body = parse_body({"endfor"});
        end_tag();
      }
      expect_end();
    } else if (keyword == "set") {
      auto target = expect_name();
      if (accept_op(".")) {
        n->attribute = expect_name();
      }
      n->targets.push_back(target);
      while (accept_op(","))
        n->targets.push_back(expect_name());
      if (accept_op("=")) {
        n->t = node::type::set;
        n->value = parse_tuple_or_expression();
        expect_end();
      } else {
        n->t = node::type::set_block;
        if (accept_op("|"))
          syntax_error("filtered set blocks are not supported");
        expect_end();
        n->body = parse_body({"endset"});
        end_tag();
        expect_end();
      }
    } else if (keyword == "macro") {
      n->t = node::type::macro;
      n->text = expect_name();
      expect_op("(");
      if (!accept_op(")")) {
        do {
          auto param = expect_name();
          expr_ptr def;
          if (accept_op("="))
            def = parse_expression();
          n->params.emplace_back(param, def);
        } while (accept_op(","));
        expect_op(")");
      }
      expect_end();
      n->body = parse_body({"endmacro"});
      end_tag();
      expect_end();
    } else if (keyword == "break" || keyword == "continue") {
      n->t = keyword == "break" ? node::type::break_ : node::type::continue_;
      expect_end();
    } else if (keyword == "generation") {
      // transformers' tag that marks the assistant's tokens: only its body is output.
      n->t = node::type::block;
      expect_end();
      n->body = parse_body({"endgeneration"});
      end_tag();
      expect_end();
    } else {
      throw troupe::error{errc::unsupported, "chat template, line " + std::to_string(line) +
                                               ": the tag '" + keyword + "' is not supported"};
    }
    return n;
  }

  // --- tokens

  const token& peek(size_t ahead = 0) const {
    auto i = std::min(pos_ + ahead, toks_->size() - 1);
    return (*toks_)[i];
  }
  const token& next() {
    auto& t = peek();
    if (pos_ < toks_->size() - 1)
      ++pos_;
    return t;
  }
  bool is_op(const char* op, size_t ahead = 0) const {
    return peek(ahead).t == token::type::op && peek(ahead).text == op;
  }
  bool is_name(const char* name, size_t ahead = 0) const {
    return peek(ahead).t == token::type::name && peek(ahead).text == name;
  }
  bool accept_op(const char* op) {
    if (!is_op(op))
      return false;
    next();
    return true;
  }
  bool accept_name(const char* name) {
    if (!is_name(name))
      return false;
    next();
    return true;
  }
  void expect_op(const char* op) {
    if (!accept_op(op))
      syntax_error(std::string{"expected '"} + op + "', found '" + describe(peek()) + "'");
  }
  std::string expect_name() {
    if (peek().t != token::type::name)
      syntax_error("expected a name, found '" + describe(peek()) + "'");
    return next().text;
  }
  void expect_end() {
    if (peek().t != token::type::end)
      syntax_error("unexpected '" + describe(peek()) + "'");
  }
  static std::string describe(const token& t) {
    switch (t.t) {
    case token::type::end:
      return "end of tag";
    case token::type::string:
      return "'" + t.text + "'";
    case token::type::integer:
      return std::to_string(t.i);
    case token::type::floating:
      return float_repr(t.f);
    default:
      return t.text;
    }
  }

  expr_ptr make(expr::type t) {
    auto e = std::make_shared<expr>();
    e->t = t;
    e->line = line_;
    return e;
  }

  // --- expressions, by jinja's precedence

  expr_ptr parse_tuple_or_expression() {
    auto first = parse_expression();
    if (!is_op(","))
      return first;
    auto t = make(expr::type::tuple);
    t->args.push_back(first);
    while (accept_op(",")) {
      if (peek().t == token::type::end)
        break;
      t->args.push_back(parse_expression());
    }
    return t;
  }

  expr_ptr parse_expression() {
    auto e = parse_or_expression();
    while (accept_name("if")) {
      auto c = make(expr::type::conditional);
      auto condition = parse_or_expression();
      expr_ptr otherwise;
      if (accept_name("else"))
        otherwise = parse_expression();
      c->args = {condition, e, otherwise};
      e = c;
    }
    return e;
  }

  expr_ptr parse_or_expression() {
    auto e = parse_and();
    while (accept_name("or")) {
      auto o = make(expr::type::logical_or);
      o->args = {e, parse_and()};
      e = o;
    }
    return e;
  }

  expr_ptr parse_and() {
    auto e = parse_not();
    while (accept_name("and")) {
      auto a = make(expr::type::logical_and);
      a->args = {e, parse_not()};
      e = a;
    }
    return e;
  }

  expr_ptr parse_not() {
    if (is_name("not") && !is_name("in", 1)) {
      next();
      auto u = make(expr::type::unary);
      u->name = "not";
      u->args = {parse_not()};
      return u;
    }
    return parse_compare();
  }

  expr_ptr parse_compare() {
    auto e = parse_math1();
    for (;;) {
      std::string op;
      if (peek().t == token::type::op &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == ">" ||
           peek().text == "<=" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next();
        next();
        op = "not in";
      } else {
        return e;
      }
      auto b = make(expr::type::binary);
      b->name = op;
      b->args = {e, parse_math1()};
      e = b;
    }
  }

  expr_ptr binary(const std::string& op, expr_ptr a, expr_ptr b) {
    auto e = make(expr::type::binary);
    e->name = op;
    e->args = {std::move(a), std::move(b)};
    return e;
  }

  expr_ptr parse_math1() {
    auto e = parse_concat();
    while (is_op("+") || is_op("-")) {
      auto op = next().text;
      e = binary(op, e, parse_concat());
    }
    return e;
  }

  expr_ptr parse_concat() {
    auto e = parse_math2();
    while (accept_op("~"))
      e = binary("~", e, parse_math2());
    return e;
  }

  expr_ptr parse_math2() {
    auto e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      auto op = next().text;
      e = binary(op, e, parse_pow());
    }
    return e;
  }

  expr_ptr parse_pow() {
    auto e = parse_unary();
    while (accept_op("**"))
      e = binary("**", e, parse_unary());
    return e;
  }

  expr_ptr parse_unary() {
    if (is_op("-") || is_op("+")) {
      auto op = next().text;
      auto u = make(expr::type::unary);
      u->name = op;
      u->args = {parse_unary()};
      return parse_filters(u);
    }
    return parse_filters(parse_postfix(parse_primary()));
  }

  expr_ptr parse_primary() {
    auto& t = peek();
    if (t.t == token::type::string) {
      auto e = make(expr::type::literal);
      std::string s = next().text;
      while (peek().t == token::type::string) // adjacent literals join, as in Python
        s += next().text;
      e->literal = value::string(s);
      return e;
    }
    if (t.t == token::type::integer) {
      auto e = make(expr::type::literal);
      e->literal = value::integer(next().i);
      return e;
    }
    if (t.t == token::type::floating) {
      auto e = make(expr::type::literal);
      e->literal = value::floating(next().f);
      return e;
    }
    if (t.t == token::type::name) {
      auto name = next().text;
      auto e = make(expr::type::literal);
      if (name == "true" || name == "True")
        e->literal = value::boolean(true);
      else if (name == "false" || name == "False")
        e->literal = value::boolean(false);
      else if (name == "none" || name == "None")
        e->literal = value::none();
      else {
        e->t = expr::type::name;
        e->name = name;
      }
      return e;
    }
    if (accept_op("(")) {
      if (accept_op(")"))
        return make(expr::type::tuple);
      auto first = parse_expression();
      if (accept_op(")"))
        return first;
      auto tuple = make(expr::type::tuple);
      tuple->args.push_back(first);
      while (accept_op(",")) {
        if (is_op(")"))
          break;
        tuple->args.push_back(parse_expression());
      }
      expect_op(")");
      return tuple;
    }
    if (accept_op("[")) {
      auto list = make(expr::type::list);
      while (!accept_op("]")) {
        list->args.push_back(parse_expression());
        if (!accept_op(",")) {
          expect_op("]");
          break;
        }
      }
      return list;
    }
    if (accept_op("{")) {
      auto d = make(expr::type::dict);
      while (!accept_op("}")) {
        auto key = parse_expression();
        expect_op(":");
        d->args.push_back(key);
        d->args.push_back(parse_expression());
        if (!accept_op(",")) {
          expect_op("}");
          break;
        }
      }
      return d;
    }
    syntax_error("unexpected '" + describe(t) + "'");
  }

  void parse_call_args(const expr_ptr& call) {
    while (!accept_op(")")) {
      if (peek().t == token::type::name && is_op("=", 1)) {
        auto name = next().text;
        next();
        call->kwargs.emplace_back(name, parse_expression());
      } else {
        call->args.push_back(parse_expression());
      }
      if (!accept_op(",")) {
        expect_op(")");
        break;
      }
    }
  }

  expr_ptr parse_postfix(expr_ptr e) {
    for (;;) {
      if (accept_op(".")) {
        auto a = make(expr::type::attr);
        if (peek().t == token::type::integer) {
          a->t = expr::type::item;
          auto index = make(expr::type::literal);
          index->literal = value::integer(next().i);
          a->args = {e, index};
        } else {
          a->name = expect_name();
          a->args = {e};
        }
        e = a;
      } else if (accept_op("[")) {
        expr_ptr parts[3];
        bool slice = false;
        for (int part = 0; part < 3; ++part) {
          if (!is_op(":") && !is_op("]"))
            parts[part] = parse_expression();
          if (part < 2 && accept_op(":")) {
            slice = true;
            continue;
          }
          break;
        }
        expect_op("]");
        auto s = make(slice ? expr::type::slice : expr::type::item);
        s->args = {e, parts[0], parts[1], parts[2]};
        e = s;
      } else if (accept_op("(")) {
        auto c = make(expr::type::call);
        c->args = {e};
        parse_call_args(c);
        e = c;
      } else {
        return e;
      }
    }
  }

  expr_ptr parse_filters(expr_ptr e) {
    for (;;) {
      if (accept_op("|")) {
        auto f = make(expr::type::filter);
        f->name = expect_name();
        if (!filters.count(f->name))
          throw troupe::error{errc::unsupported, "chat template, line " + std::to_string(line_) +
                                                   ": the filter '" + f->name +
                                                   "' is not supported"};
        f->args = {e};
        if (accept_op("("))
          parse_call_args(f);
        e = f;
      } else if (accept_name("is")) {
        auto t = make(expr::type::test);
        t->negated = accept_name("not");
        if (peek().t == token::type::op &&
            (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
             peek().text == "<=" || peek().text == ">" || peek().text == ">="))
          t->name = next().text;
        else
          t->name = expect_name();
        if (!tests.count(t->name))
          throw troupe::error{errc::unsupported, "chat template, line " + std::to_string(line_) +
                                                   ": the test '" + t->name + "' is not supported"};
        t->args = {e};
        if (accept_op("(")) {
          parse_call_args(t);
        } else if (peek().t == token::type::string || peek().t == token::type::integer ||
                   peek().t == token::type::floating ||
                   (peek().t == token::type::name && !is_name("and") && !is_name("or") &&
                    !is_name("else") && !is_name("if") && !is_name("in") && !is_name("not") &&
                    !is_name("is"))) {
          t->args.push_back(parse_postfix(parse_primary()));
        }
        e = t;
      } else {
        return e;
      }
    }
  }

  std::vector<chunk> chunks_;
  size_t at_ = 0;
  const std::vector<token>* toks_ = nullptr;
  size_t pos_ = 0;
  int line_ = 1;
};

// ---------------------------------------------------------------------------------------
// Rendering.

enum class flow { normal, break_, continue_ };

class renderer {
public:
  explicit renderer(const nlohmann::ordered_json& context) {
    frames_.emplace_back();
    auto& globals = frames_.back();
    globals["range"] = value::function([](args_list& a, kwargs_list&) {
      int64_t start = 0, stop = 0, step = 1;
      if (a.size() == 1) {
        stop = a[0].as_int();
      } else if (a.size() >= 2) {
        start = a[0].as_int();
        stop = a[1].as_int();
        if (a.size() > 2)
          step = a[2].as_int();
      }
      if (step == 0)
        fail("range() arg 3 must not be zero");
      auto out = value::list();
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
        out.l->push_back(value::integer(i));
      return out;
    });
    auto make_dict = [](bool is_namespace) {
      return value::function([is_namespace](args_list& a, kwargs_list& kw) {
        auto out = value::object();
        out.is_namespace = is_namespace;
        for (auto& arg : a)
          if (arg.k == value::kind::object)
            for (auto& item : arg.o->items)
              out.o->set(item.first, item.second);
        for (auto& [k, v] : kw)
          out.o->set(k, v);
        return out;
      });
    };
    globals["namespace"] = make_dict(true);
    globals["dict"] = make_dict(false);
    globals["raise_exception"] = value::function([](args_list& a, kwargs_list&) -> value {
      throw error{errc::invalid_argument, a.empty() ? std::string{"raise_exception"} : str(a[0])};
    });
    globals["strftime_now"] = value::function([](args_list& a, kwargs_list&) {
      auto now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      char buf[256];
      auto n = std::strftime(buf, sizeof buf, a.empty() ? "" : str(a[0]).c_str(), &local);
      return value::string(std::string(buf, n));
    });
    for (auto& [k, v] : context.items())
      globals[k] = from_json(v);
  }

  std::string run(const node_list& body) {
    exec(body);
    return std::move(out_);
  }

private:
  using frame = std::map<std::string, value>;

  value lookup(const std::string& name) const {
    for (auto f = frames_.rbegin(); f != frames_.rend(); ++f) {
      auto at = f->find(name);
      if (at != f->end())
        return at->second;
    }
    return value::undefined(name);
  }

  flow exec(const node_list& body) {
    for (auto& n : body) {
      auto f = exec(*n);
      if (f != flow::normal)
        return f;
    }
    return flow::normal;
  }

  flow exec(const node& n) {
    switch (n.t) {
    case node::type::text:
      out_ += n.text;
      return flow::normal;
    case node::type::output:
      out_ += str(eval(*n.value));
      return flow::normal;
    case node::type::block:
      return exec(n.body);
    case node::type::break_:
      return flow::break_;
    case node::type::continue_:
      return flow::continue_;
    case node::type::if_:
      for (size_t i = 0; i < n.bodies.size(); ++i)
        if (i >= n.conditions.size() || truthy(eval(*n.conditions[i])))
          return exec(n.bodies[i]);
      return flow::normal;
    case node::type::set:
      assign(n, eval(*n.value));
      return flow::normal;
    case node::type::set_block: {
      std::string saved;
      std::swap(saved, out_);
      exec(n.body);
      std::swap(saved, out_);
      assign(n, value::string(saved));
      return flow::normal;
    }
    case node::type::macro:
      frames_.back()[n.text] = macro(n);
      return flow::normal;
    case node::type::for_:
      return exec_for(n);
    }
    return flow::normal;
  }

  void assign(const node& n, const value& v) {
    if (!n.attribute.empty()) {
      auto ns = lookup(n.targets[0]);
      if (ns.k != value::kind::object || !ns.is_namespace)
        fail("line " + std::to_string(n.line) +
             ": cannot assign attribute on non-namespace object '" + n.targets[0] + "'");
      ns.o->set(n.attribute, v);
      return;
    }
    if (n.targets.size() == 1) {
      frames_.back()[n.targets[0]] = v;
      return;
    }
    auto items = iterate(v, n.line);
    if (items.size() != n.targets.size())
      fail("line " + std::to_string(n.line) + ": cannot unpack " + std::to_string(items.size()) +
           " values into " + std::to_string(n.targets.size()));
    for (size_t i = 0; i < items.size(); ++i)
      frames_.back()[n.targets[i]] = items[i];
  }

  value macro(const node& n) {
    return value::function([this, &n](args_list& a, kwargs_list& kw) {
      frame locals;
      for (size_t p = 0; p < n.params.size(); ++p) {
        auto& [name, def] = n.params[p];
        value v = p < a.size() ? a[p] : value::undefined(name);
        for (auto& [k, kv] : kw)
          if (k == name)
            v = kv;
        if (!v.defined() && def)
          v = eval(*def);
        locals[name] = v;
      }
      frames_.push_back(std::move(locals));
      std::string saved;
      std::swap(saved, out_);
      try {
        exec(n.body);
      } catch (...) {
        std::swap(saved, out_);
        frames_.pop_back();
        throw;
      }
      std::swap(saved, out_);
      frames_.pop_back();
      return value::string(saved);
    });
  }

  std::vector<value> iterate(const value& v, int line) {
    switch (v.k) {
    case value::kind::undefined:
      return {};
    case value::kind::list:
      return *v.l;
    case value::kind::object: {
      std::vector<value> keys;
      for (auto& item : v.o->items)
        keys.push_back(value::string(item.first));
      return keys;
    }
    case value::kind::string: {
      std::vector<value> chars;
      for (auto& c : code_points(v.s))
        chars.push_back(value::string(c));
      return chars;
    }
    default:
      fail("line " + std::to_string(line) + ": '" + type_name(v) + "' object is not iterable");
    }
  }

  flow exec_for(const node& n) {
    auto all = iterate(eval(*n.value), n.line);
    frames_.emplace_back();
    struct pop {
      std::vector<frame>& f;
      ~pop() {
        f.pop_back();
      }
    } popper{frames_};
    auto bind = [&](const value& item) {
      if (n.targets.size() == 1) {
        frames_.back()[n.targets[0]] = item;
        return;
      }
      auto parts = iterate(item, n.line);
      if (parts.size() != n.targets.size())
        fail("line " + std::to_string(n.line) + ": cannot unpack " + std::to_string(parts.size()) +
             " values into " + std::to_string(n.targets.size()));
      for (size_t i = 0; i < parts.size(); ++i)
        frames_.back()[n.targets[i]] = parts[i];
    };
    std::vector<value> items;
    if (n.filter) {
      for (auto& item : all) {
        bind(item);
        if (truthy(eval(*n.filter)))
          items.push_back(item);
      }
    } else {
      items = std::move(all);
    }
    if (items.empty())
      return exec(n.else_body);
    auto length = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < length; ++i) {
      bind(items[static_cast<size_t>(i)]);
      auto loop = value::object();
      auto& o = *loop.o;
      o.set("index", value::integer(i + 1));
      o.set("index0", value::integer(i));
      o.set("revindex", value::integer(length - i));
      o.set("revindex0", value::integer(length - i - 1));
      o.set("first", value::boolean(i == 0));
      o.set("last", value::boolean(i == length - 1));
      o.set("length", value::integer(length));
      o.set("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : value::undefined("previtem"));
      o.set("nextitem",
            i + 1 < length ? items[static_cast<size_t>(i + 1)] : value::undefined("nextitem"));
      o.set("cycle", value::function([i](args_list& a, kwargs_list&) {
              return a.empty() ? value::none() : a[static_cast<size_t>(i) % a.size()];
            }));
      frames_.back()["loop"] = loop;
      if (exec(n.body) == flow::break_)
        break;
    }
    return flow::normal;
  }

  // --- expressions

  value eval(const expr& e) {
    switch (e.t) {
    case expr::type::literal:
      return e.literal;
    case expr::type::name:
      return lookup(e.name);
    case expr::type::list:
    case expr::type::tuple: {
      auto out = value::list();
      for (auto& a : e.args)
        out.l->push_back(eval(*a));
      return out;
    }
    case expr::type::dict: {
      auto out = value::object();
      for (size_t i = 0; i + 1 < e.args.size(); i += 2)
        out.o->set(str(eval(*e.args[i])), eval(*e.args[i + 1]));
      return out;
    }
    case expr::type::attr:
      return attribute(eval(*e.args[0]), e.name, e);
    case expr::type::item:
      return item(eval(*e.args[0]), eval(*e.args[1]), e);
    case expr::type::slice:
      return slice(e);
    case expr::type::call:
      return call(e);
    case expr::type::filter:
      return filter(e);
    case expr::type::test: {
      bool result = test(e);
      return value::boolean(e.negated ? !result : result);
    }
    case expr::type::unary: {
      auto v = eval(*e.args[0]);
      if (e.name == "not")
        return value::boolean(!truthy(v));
      if (!v.number())
        fail(where(e) + "bad operand type for unary " + e.name + ": '" + type_name(v) + "'");
      if (e.name == "+")
        return v;
      return v.k == value::kind::floating ? value::floating(-v.f) : value::integer(-v.as_int());
    }
    case expr::type::binary:
      return binary(e);
    case expr::type::conditional:
      if (truthy(eval(*e.args[0])))
        return eval(*e.args[1]);
      return e.args[2] ? eval(*e.args[2]) : value::undefined();
    case expr::type::logical_and: {
      auto a = eval(*e.args[0]);
      return truthy(a) ? eval(*e.args[1]) : a;
    }
    case expr::type::logical_or: {
      auto a = eval(*e.args[0]);
      return truthy(a) ? a : eval(*e.args[1]);
    }
    }
    return value::undefined();
  }

  static std::string where(const expr& e) {
    return "line " + std::to_string(e.line) + ": ";
  }

  [[noreturn]] void undefined_error(const value& v, const expr& e) {
    fail(where(e) + "'" + (v.s.empty() ? std::string{"value"} : v.s) + "' is undefined");
  }

  value method(const value& self, const std::string& name) {
    auto bound = [self](std::function<value(const value&, args_list&, kwargs_list&)> f) {
      return value::function(
        [self, f = std::move(f)](args_list& a, kwargs_list& kw) { return f(self, a, kw); });
    };
    auto arg = [](args_list& a, kwargs_list& kw, size_t i, const char* key) -> value* {
      if (i < a.size())
        return &a[i];
      for (auto& [k, v] : kw)
        if (k == key)
          return &v;
      return nullptr;
    };
    if (self.k == value::kind::string) {
      if (name == "strip" || name == "lstrip" || name == "rstrip")
        return bound([name, arg](const value& s, args_list& a, kwargs_list& kw) {
          return value::string(
            strip(s.s, arg(a, kw, 0, "chars"), name != "rstrip", name != "lstrip"));
        });
      if (name == "upper" || name == "lower")
        return bound([name](const value& s, args_list&, kwargs_list&) {
          auto out = s.s;
          for (auto& c : out)
            c = static_cast<char>(name == "upper" ? std::toupper(static_cast<unsigned char>(c))
                                                  : std::tolower(static_cast<unsigned char>(c)));
          return value::string(out);
        });
      if (name == "title" || name == "capitalize")
        return bound([name](const value& s, args_list&, kwargs_list&) {
          return value::string(name == "title" ? title_case(s.s) : capitalize(s.s));
        });
      if (name == "startswith" || name == "endswith")
        return bound([name](const value& s, args_list& a, kwargs_list&) {
          if (a.empty())
            fail(name + "() takes at least 1 argument");
          std::vector<value> options =
            a[0].k == value::kind::list ? *a[0].l : std::vector<value>{a[0]};
          for (auto& o : options) {
            auto& p = o.s;
            bool hit =
              name == "startswith"
                ? s.s.compare(0, p.size(), p) == 0
                : s.s.size() >= p.size() && s.s.compare(s.s.size() - p.size(), p.size(), p) == 0;
            if (hit)
              return value::boolean(true);
          }
          return value::boolean(false);
        });
      if (name == "split" || name == "rsplit")
        return bound([arg, name](const value& s, args_list& a, kwargs_list& kw) {
          auto* sep = arg(a, kw, 0, "sep");
          auto* max = arg(a, kw, 1, "maxsplit");
          return split(s.s, sep && sep->k == value::kind::string ? &sep->s : nullptr,
                       max ? max->as_int() : -1, name == "rsplit");
        });
      if (name == "replace")
        return bound([](const value& s, args_list& a, kwargs_list&) {
          if (a.size() < 2)
            fail("replace() takes at least 2 arguments");
          return value::string(
            replace_all(s.s, str(a[0]), str(a[1]), a.size() > 2 ? a[2].as_int() : -1));
        });
      if (name == "find" || name == "count")
        return bound([name](const value& s, args_list& a, kwargs_list&) {
          if (a.empty())
            fail(name + "() takes at least 1 argument");
          auto needle = str(a[0]);
          if (name == "find") {
            auto at = s.s.find(needle);
            return value::integer(at == std::string::npos
                                    ? -1
                                    : static_cast<int64_t>(code_points(s.s.substr(0, at)).size()));
          }
          int64_t n = 0;
          for (size_t at = s.s.find(needle); !needle.empty() && at != std::string::npos;
               at = s.s.find(needle, at + needle.size()))
            ++n;
          return value::integer(n);
        });
      if (name == "join")
        return bound([this](const value& s, args_list& a, kwargs_list&) {
          std::string out;
          bool first = true;
          for (auto& v : a.empty() ? std::vector<value>{} : iterate(a[0], 0)) {
            out += (first ? "" : s.s) + str(v);
            first = false;
          }
          return value::string(out);
        });
    }
    if (self.k == value::kind::object && !self.is_namespace) {
      if (name == "items" || name == "keys" || name == "values")
        return bound([name](const value& d, args_list&, kwargs_list&) {
          auto out = value::list();
          for (auto& [k, v] : d.o->items)
            out.l->push_back(name == "keys"     ? value::string(k)
                             : name == "values" ? v
                                                : value::list({value::string(k), v}));
          return out;
        });
      if (name == "get")
        return bound([](const value& d, args_list& a, kwargs_list&) {
          if (a.empty())
            fail("get() takes at least 1 argument");
          auto* v = d.o->find(str(a[0]));
          return v ? *v : a.size() > 1 ? a[1] : value::none();
        });
    }
    return value::undefined(name);
  }

  value attribute(const value& obj, const std::string& name, const expr& e) {
    if (!obj.defined())
      undefined_error(obj, e);
    if (obj.k == value::kind::object) {
      if (auto* v = obj.o->find(name))
        return *v;
    }
    auto m = method(obj, name);
    if (m.defined())
      return m;
    return value::undefined(name);
  }

  // Python's index of `i` into `n` items (negative from the end); -1 when outside.
  static int64_t index_of(int64_t i, size_t n) {
    if (i < 0)
      i += static_cast<int64_t>(n);
    return i < 0 || i >= static_cast<int64_t>(n) ? -1 : i;
  }

  value item(const value& obj, const value& key, const expr& e) {
    if (!obj.defined())
      undefined_error(obj, e);
    if (obj.k == value::kind::object && key.k == value::kind::string) {
      if (auto* v = obj.o->find(key.s))
        return *v;
      auto m = method(obj, key.s);
      return m.defined() ? m : value::undefined(key.s);
    }
    if (obj.k == value::kind::list &&
        (key.k == value::kind::integer || key.k == value::kind::boolean)) {
      auto i = index_of(key.as_int(), obj.l->size());
      return i < 0 ? value::undefined() : (*obj.l)[static_cast<size_t>(i)];
    }
    if (obj.k == value::kind::string && key.k == value::kind::integer) {
      auto cps = code_points(obj.s);
      auto i = index_of(key.i, cps.size());
      return i < 0 ? value::undefined() : value::string(cps[static_cast<size_t>(i)]);
    }
    if (key.k == value::kind::string)
      return attribute(obj, key.s, e);
    return value::undefined();
  }

  value slice(const expr& e) {
    auto obj = eval(*e.args[0]);
    if (!obj.defined())
      undefined_error(obj, e);
    auto bound = [&](const expr_ptr& p) -> std::optional<int64_t> {
      if (!p)
        return std::nullopt;
      auto v = eval(*p);
      if (v.k == value::kind::none)
        return std::nullopt;
      return v.as_int();
    };
    auto start = bound(e.args[1]);
    auto stop = bound(e.args[2]);
    int64_t step = bound(e.args[3]).value_or(1);
    if (step == 0)
      fail(where(e) + "slice step cannot be zero");
    std::vector<value> items;
    bool is_string = obj.k == value::kind::string;
    if (is_string)
      for (auto& c : code_points(obj.s))
        items.push_back(value::string(c));
    else if (obj.k == value::kind::list)
      items = *obj.l;
    else
      fail(where(e) + "'" + type_name(obj) + "' object is not subscriptable");
    auto n = static_cast<int64_t>(items.size());
    // Python's slice.indices.
    auto clamp = [&](std::optional<int64_t> v, int64_t def_pos, int64_t def_neg) {
      if (!v)
        return step > 0 ? def_pos : def_neg;
      int64_t x = *v < 0 ? *v + n : *v;
      if (step > 0)
        return std::clamp<int64_t>(x, 0, n);
      return std::clamp<int64_t>(x, -1, n - 1);
    };
    int64_t a = clamp(start, 0, n - 1);
    int64_t b = clamp(stop, n, -1);
    std::vector<value> out;
    for (int64_t i = a; step > 0 ? i < b : i > b; i += step)
      out.push_back(items[static_cast<size_t>(i)]);
    if (is_string) {
      std::string s;
      for (auto& c : out)
        s += c.s;
      return value::string(s);
    }
    return value::list(std::move(out));
  }

  value call(const expr& e) {
    auto fn = eval(*e.args[0]);
    if (fn.k != value::kind::function) {
      std::string what = e.args[0]->t == expr::type::name || e.args[0]->t == expr::type::attr
                           ? e.args[0]->name
                           : std::string{type_name(fn)};
      if (!fn.defined())
        fail(where(e) + "'" + what + "' is undefined");
      fail(where(e) + "'" + what + "' is not callable");
    }
    args_list a;
    for (size_t i = 1; i < e.args.size(); ++i)
      a.push_back(eval(*e.args[i]));
    kwargs_list kw;
    for (auto& [k, v] : e.kwargs)
      kw.emplace_back(k, eval(*v));
    return (*fn.fn)(a, kw);
  }

  static value arithmetic(const std::string& op, const value& a, const value& b, const expr& e) {
    if (op == "+" && a.k == value::kind::string && b.k == value::kind::string)
      return value::string(a.s + b.s);
    if (op == "+" && a.k == value::kind::list && b.k == value::kind::list) {
      auto out = *a.l;
      out.insert(out.end(), b.l->begin(), b.l->end());
      return value::list(std::move(out));
    }
    if (op == "*" && ((a.k == value::kind::string && b.k == value::kind::integer) ||
                      (a.k == value::kind::integer && b.k == value::kind::string))) {
      auto& s = a.k == value::kind::string ? a.s : b.s;
      auto n = a.k == value::kind::integer ? a.i : b.i;
      std::string out;
      for (int64_t i = 0; i < n; ++i)
        out += s;
      return value::string(out);
    }
    if (!a.number() || !b.number())
      fail(where(e) + "unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" +
           type_name(b) + "'");
    bool floats = a.k == value::kind::floating || b.k == value::kind::floating;
    if (op == "/") {
      if (b.as_double() == 0)
        fail(where(e) + "division by zero");
      return value::floating(a.as_double() / b.as_double());
    }
    if (floats) {
      double x = a.as_double(), y = b.as_double();
      if ((op == "//" || op == "%") && y == 0)
        fail(where(e) + "division by zero");
      if (op == "+")
        return value::floating(x + y);
      if (op == "-")
        return value::floating(x - y);
      if (op == "*")
        return value::floating(x * y);
      if (op == "//")
        return value::floating(std::floor(x / y));
      if (op == "%")
        return value::floating(x - std::floor(x / y) * y);
      return value::floating(std::pow(x, y));
    }
    int64_t x = a.as_int(), y = b.as_int();
    if ((op == "//" || op == "%") && y == 0)
      fail(where(e) + "integer division or modulo by zero");
    if (op == "+")
      return value::integer(x + y);
    if (op == "-")
      return value::integer(x - y);
    if (op == "*")
      return value::integer(x * y);
    if (op == "//" || op == "%") {
      int64_t q = x / y;
      if ((x % y != 0) && ((x < 0) != (y < 0)))
        --q;
      return value::integer(op == "//" ? q : x - q * y);
    }
    if (y < 0)
      return value::floating(std::pow(static_cast<double>(x), static_cast<double>(y)));
    int64_t r = 1;
    for (int64_t i = 0; i < y; ++i)
      r *= x;
    return value::integer(r);
  }

  static bool contains(const value& haystack, const value& needle, const expr& e) {
    switch (haystack.k) {
    case value::kind::string:
      if (needle.k != value::kind::string)
        fail(where(e) + "'in <string>' requires string as left operand, not " + type_name(needle));
      return haystack.s.find(needle.s) != std::string::npos;
    case value::kind::list:
      for (auto& v : *haystack.l)
        if (equal(v, needle))
          return true;
      return false;
    case value::kind::object:
      return needle.k == value::kind::string && haystack.o->find(needle.s);
    case value::kind::undefined:
      return false;
    default:
      fail(where(e) + "argument of type '" + type_name(haystack) + "' is not iterable");
    }
  }

  value binary(const expr& e) {
    auto a = eval(*e.args[0]);
    auto b = eval(*e.args[1]);
    const auto& op = e.name;
    if (op == "==")
      return value::boolean(equal(a, b));
    if (op == "!=")
      return value::boolean(!equal(a, b));
    if (op == "<")
      return value::boolean(less(a, b));
    if (op == ">")
      return value::boolean(less(b, a));
    if (op == "<=")
      return value::boolean(!less(b, a));
    if (op == ">=")
      return value::boolean(!less(a, b));
    if (op == "in")
      return value::boolean(contains(b, a, e));
    if (op == "not in")
      return value::boolean(!contains(b, a, e));
    if (op == "~")
      return value::string(str(a) + str(b));
    return arithmetic(op, a, b, e);
  }

  // --- filters and tests

  static std::string title_case(const std::string& s) {
    std::string out = s;
    bool start = true;
    for (auto& c : out) {
      auto u = static_cast<unsigned char>(c);
      if (std::isalpha(u)) {
        c = static_cast<char>(start ? std::toupper(u) : std::tolower(u));
        start = false;
      } else {
        start = u < 0x80;
      }
    }
    return out;
  }

  static std::string capitalize(const std::string& s) {
    std::string out = s;
    for (size_t i = 0; i < out.size(); ++i) {
      auto u = static_cast<unsigned char>(out[i]);
      out[i] = static_cast<char>(i == 0 ? std::toupper(u) : std::tolower(u));
    }
    return out;
  }

  static std::string replace_all(const std::string& s, const std::string& from,
                                 const std::string& to, int64_t count) {
    if (from.empty())
      return s;
    std::string out;
    size_t pos = 0;
    for (int64_t n = 0; count < 0 || n < count; ++n) {
      auto at = s.find(from, pos);
      if (at == std::string::npos)
        break;
      out += s.substr(pos, at - pos) + to;
      pos = at + from.size();
    }
    return out + s.substr(pos);
  }

  static value split(const std::string& s, const std::string* sep, int64_t max, bool from_right) {
    std::vector<std::string> parts;
    if (sep) {
      if (sep->empty())
        fail("split(): empty separator");
      if (!from_right) {
        size_t pos = 0;
        for (int64_t n = 0; max < 0 || n < max; ++n) {
          auto at = s.find(*sep, pos);
          if (at == std::string::npos)
            break;
          parts.push_back(s.substr(pos, at - pos));
          pos = at + sep->size();
        }
        parts.push_back(s.substr(pos));
      } else {
        size_t end = s.size();
        for (int64_t n = 0; max < 0 || n < max; ++n) {
          auto at = end >= sep->size() ? s.rfind(*sep, end - sep->size()) : std::string::npos;
          if (at == std::string::npos)
            break;
          parts.insert(parts.begin(), s.substr(at + sep->size(), end - at - sep->size()));
          end = at;
        }
        parts.insert(parts.begin(), s.substr(0, end));
      }
    } else {
      // Runs of whitespace separate; none at the ends.
      auto cps = code_points(s);
      std::string cur;
      bool in_word = false;
      int64_t n = 0;
      for (size_t i = 0; i < cps.size(); ++i) {
        bool space = is_space(decode_point(cps[i]));
        if (space && in_word && (max < 0 || n < max)) {
          parts.push_back(cur);
          cur.clear();
          in_word = false;
          ++n;
        } else if (!space || in_word) {
          if (!space)
            in_word = true;
          if (in_word)
            cur += cps[i];
        }
      }
      if (in_word)
        parts.push_back(strip(cur, nullptr, false, true));
    }
    auto out = value::list();
    for (auto& p : parts)
      out.l->push_back(value::string(p));
    return out;
  }

  value kwarg(const kwargs_list& kw, const char* name, value def) {
    for (auto& [k, v] : kw)
      if (k == name)
        return v;
    return def;
  }

  // Applies a test by name to `v` with `args` (for select/reject as for `is`).
  bool apply_test(const std::string& name, const value& v, const args_list& args, const expr& e) {
    auto arg = [&](size_t i) -> const value& {
      if (i >= args.size())
        fail(where(e) + "the test '" + name + "' needs an argument");
      return args[i];
    };
    if (name == "defined")
      return v.defined();
    if (name == "undefined")
      return !v.defined();
    if (name == "none")
      return v.k == value::kind::none;
    if (name == "boolean")
      return v.k == value::kind::boolean;
    if (name == "true")
      return v.k == value::kind::boolean && v.b;
    if (name == "false")
      return v.k == value::kind::boolean && !v.b;
    if (name == "string")
      return v.k == value::kind::string;
    if (name == "number")
      return v.number();
    if (name == "integer")
      return v.k == value::kind::integer;
    if (name == "float")
      return v.k == value::kind::floating;
    if (name == "mapping")
      return v.k == value::kind::object;
    if (name == "iterable")
      return v.k == value::kind::list || v.k == value::kind::object || v.k == value::kind::string ||
             !v.defined();
    if (name == "sequence")
      return v.k == value::kind::list || v.k == value::kind::object || v.k == value::kind::string;
    if (name == "callable")
      return v.k == value::kind::function;
    if (name == "odd")
      return v.as_int() % 2 != 0;
    if (name == "even")
      return v.as_int() % 2 == 0;
    if (name == "divisibleby")
      return arg(0).as_int() != 0 && v.as_int() % arg(0).as_int() == 0;
    if (name == "eq" || name == "equalto" || name == "==")
      return equal(v, arg(0));
    if (name == "ne" || name == "!=")
      return !equal(v, arg(0));
    if (name == "lt" || name == "<")
      return less(v, arg(0));
    if (name == "le" || name == "<=")
      return !less(arg(0), v);
    if (name == "gt" || name == ">")
      return less(arg(0), v);
    if (name == "ge" || name == ">=")
      return !less(v, arg(0));
    if (name == "in")
      return contains(arg(0), v, e);
    if (name == "sameas")
      return v.k == arg(0).k && equal(v, arg(0));
    if (name == "lower")
      return v.k == value::kind::string && replace_case(v.s, false) == v.s;
    if (name == "upper")
      return v.k == value::kind::string && replace_case(v.s, true) == v.s;
    fail(where(e) + "the test '" + name + "' is not supported");
  }

  static std::string replace_case(std::string s, bool upper) {
    for (auto& c : s)
      c = static_cast<char>(upper ? std::toupper(static_cast<unsigned char>(c))
                                  : std::tolower(static_cast<unsigned char>(c)));
    return s;
  }

  bool test(const expr& e) {
    auto v = eval(*e.args[0]);
    args_list args;
    for (size_t i = 1; i < e.args.size(); ++i)
      args.push_back(eval(*e.args[i]));
    return apply_test(e.name, v, args, e);
  }

  // The value at a dotted attribute path ("a.b"), for map/selectattr/sort/join.
  value path(const value& v, const std::string& dotted, const expr& e) {
    value cur = v;
    std::stringstream parts{dotted};
    std::string part;
    while (std::getline(parts, part, '.')) {
      if (!cur.defined())
        return cur;
      bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
      cur = numeric ? item(cur, value::integer(std::stoll(part)), e)
                    : item(cur, value::string(part), e);
    }
    return cur;
  }

  value filter(const expr& e) {
    auto v = eval(*e.args[0]);
    args_list a;
    for (size_t i = 1; i < e.args.size(); ++i)
      a.push_back(eval(*e.args[i]));
    kwargs_list kw;
    for (auto& [k, x] : e.kwargs)
      kw.emplace_back(k, eval(*x));
    const auto& f = e.name;
    auto need_list = [&]() {
      if (!v.defined())
        return std::vector<value>{};
      return iterate(v, e.line);
    };
    if (f == "default" || f == "d") {
      bool boolean =
        a.size() > 1 ? truthy(a[1]) : truthy(kwarg(kw, "boolean", value::boolean(false)));
      bool use_default = boolean ? !truthy(v) : !v.defined();
      return use_default ? (a.empty() ? value::string("") : a[0]) : v;
    }
    if (f == "safe" || f == "e" || f == "escape") {
      if (f != "safe")
        fail(where(e) + "the filter 'escape' is not supported (transformers does not autoescape)");
      return v;
    }
    if (!v.defined() && f != "length" && f != "count" && f != "list" && f != "string" &&
        f != "join" && f != "tojson")
      undefined_error(v, e);
    if (f == "tojson") {
      auto indent = a.empty() ? kwarg(kw, "indent", value::none()) : a[0];
      auto sort = kwarg(kw, "sort_keys", value::boolean(false));
      auto separators = kwarg(kw, "separators", value::none());
      int64_t n = indent.k == value::kind::none ? -1 : indent.as_int();
      std::string item_sep = n >= 0 ? "," : ", ";
      std::string key_sep = ": ";
      if (separators.k == value::kind::list && separators.l->size() == 2) {
        item_sep = str((*separators.l)[0]);
        key_sep = str((*separators.l)[1]);
      }
      std::string out;
      if (!v.defined())
        undefined_error(v, e);
      to_json(v, n, item_sep, key_sep, truthy(sort), 0, out);
      return value::string(out);
    }
    if (f == "string")
      return value::string(str(v));
    if (f == "trim")
      return value::string(strip(str(v), a.empty() ? nullptr : &a[0], true, true));
    if (f == "upper" || f == "lower")
      return value::string(replace_case(str(v), f == "upper"));
    if (f == "title")
      return value::string(title_case(str(v)));
    if (f == "capitalize")
      return value::string(capitalize(str(v)));
    if (f == "replace") {
      if (a.size() < 2)
        fail(where(e) + "replace needs two arguments");
      return value::string(
        replace_all(str(v), str(a[0]), str(a[1]), a.size() > 2 ? a[2].as_int() : -1));
    }
    if (f == "length" || f == "count") {
      if (v.k == value::kind::string)
        return value::integer(static_cast<int64_t>(code_points(v.s).size()));
      if (v.k == value::kind::object)
        return value::integer(static_cast<int64_t>(v.o->items.size()));
      if (v.k == value::kind::list)
        return value::integer(static_cast<int64_t>(v.l->size()));
      if (!v.defined())
        return value::integer(0);
      fail(where(e) + "object of type '" + type_name(v) + "' has no len()");
    }
    if (f == "wordcount")
      return value::integer(static_cast<int64_t>(split(str(v), nullptr, -1, false).l->size()));
    if (f == "int") {
      if (v.k == value::kind::string) {
        try {
          return value::integer(std::stoll(strip(v.s, nullptr, true, true)));
        } catch (...) {
          return a.empty() ? value::integer(0) : a[0];
        }
      }
      return v.number() ? value::integer(v.as_int()) : (a.empty() ? value::integer(0) : a[0]);
    }
    if (f == "float") {
      if (v.k == value::kind::string) {
        try {
          return value::floating(std::stod(v.s));
        } catch (...) {
          return a.empty() ? value::floating(0) : a[0];
        }
      }
      return v.number() ? value::floating(v.as_double()) : (a.empty() ? value::floating(0) : a[0]);
    }
    if (f == "abs") {
      if (v.k == value::kind::floating)
        return value::floating(std::fabs(v.f));
      return value::integer(std::llabs(v.as_int()));
    }
    if (f == "round") {
      int64_t digits =
        a.empty() ? kwarg(kw, "precision", value::integer(0)).as_int() : a[0].as_int();
      double scale = std::pow(10.0, static_cast<double>(digits));
      return value::floating(std::round(v.as_double() * scale) / scale);
    }
    if (f == "indent") {
      int64_t width = a.empty() ? kwarg(kw, "width", value::integer(4)).as_int() : a[0].as_int();
      bool first = a.size() > 1 ? truthy(a[1]) : truthy(kwarg(kw, "first", value::boolean(false)));
      bool blank = a.size() > 2 ? truthy(a[2]) : truthy(kwarg(kw, "blank", value::boolean(false)));
      std::string pad(static_cast<size_t>(std::max<int64_t>(0, width)), ' ');
      std::string s = str(v);
      std::string out;
      size_t pos = 0;
      bool first_line = true;
      while (true) {
        auto nl = s.find('\n', pos);
        auto line = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
        bool indent_it = first_line ? first : (blank || !line.empty());
        out += (indent_it ? pad : "") + line;
        if (nl == std::string::npos)
          break;
        out += "\n";
        pos = nl + 1;
        first_line = false;
      }
      return value::string(out);
    }
    auto items = need_list();
    if (f == "list")
      return value::list(items);
    if (f == "first")
      return items.empty() ? value::undefined() : items.front();
    if (f == "last")
      return items.empty() ? value::undefined() : items.back();
    if (f == "reverse") {
      if (v.k == value::kind::string) {
        auto cps = code_points(v.s);
        std::string out;
        for (auto it = cps.rbegin(); it != cps.rend(); ++it)
          out += *it;
        return value::string(out);
      }
      std::reverse(items.begin(), items.end());
      return value::list(items);
    }
    if (f == "items") {
      if (v.k != value::kind::object)
        fail(where(e) + "items needs a mapping, not " + type_name(v));
      return method(v, "items").fn->operator()(a, kw);
    }
    if (f == "dictsort") {
      if (v.k != value::kind::object)
        fail(where(e) + "dictsort needs a mapping, not " + type_name(v));
      auto pairs = v.o->items;
      std::stable_sort(pairs.begin(), pairs.end(),
                       [](auto& x, auto& y) { return x.first < y.first; });
      auto out = value::list();
      for (auto& [k, x] : pairs)
        out.l->push_back(value::list({value::string(k), x}));
      return out;
    }
    if (f == "join") {
      auto sep = a.empty() ? kwarg(kw, "d", value::string("")) : a[0];
      auto attr = kwarg(kw, "attribute", value::none());
      std::string out;
      for (size_t i = 0; i < items.size(); ++i)
        out += (i ? str(sep) : "") +
               str(attr.k == value::kind::none ? items[i] : path(items[i], str(attr), e));
      return value::string(out);
    }
    if (f == "unique") {
      std::vector<value> out;
      for (auto& x : items)
        if (std::none_of(out.begin(), out.end(), [&](const value& y) { return equal(x, y); }))
          out.push_back(x);
      return value::list(out);
    }
    if (f == "sort" || f == "max" || f == "min") {
      bool reverse = truthy(kwarg(kw, "reverse", value::boolean(a.empty() ? false : truthy(a[0]))));
      auto attr = kwarg(kw, "attribute", value::none());
      auto key = [&](const value& x) {
        return attr.k == value::kind::none ? x : path(x, str(attr), e);
      };
      std::stable_sort(items.begin(), items.end(),
                       [&](const value& x, const value& y) { return less(key(x), key(y)); });
      if (f == "max")
        return items.empty() ? value::undefined() : items.back();
      if (f == "min")
        return items.empty() ? value::undefined() : items.front();
      if (reverse)
        std::reverse(items.begin(), items.end());
      return value::list(items);
    }
    if (f == "sum") {
      auto attr = kwarg(kw, "attribute", value::none());
      value total = a.empty() ? kwarg(kw, "start", value::integer(0)) : a[0];
      for (auto& x : items)
        total = arithmetic("+", total, attr.k == value::kind::none ? x : path(x, str(attr), e), e);
      return total;
    }
    if (f == "map") {
      auto out = value::list();
      auto attr = kwarg(kw, "attribute", value::none());
      if (attr.k != value::kind::none) {
        auto def = kwarg(kw, "default", value::undefined());
        for (auto& x : items) {
          auto y = path(x, str(attr), e);
          out.l->push_back(y.defined() ? y : def);
        }
        return out;
      }
      if (a.empty())
        fail(where(e) + "map needs a filter name or attribute=");
      auto name = str(a[0]);
      if (!filters.count(name))
        throw troupe::error{errc::unsupported, "chat template, " + where(e) + "the filter '" +
                                                 name + "' is not supported"};
      for (auto& x : items) {
        expr call;
        call.t = expr::type::filter;
        call.name = name;
        call.line = e.line;
        auto arg = std::make_shared<expr>();
        arg->t = expr::type::literal;
        arg->literal = x;
        call.args.push_back(arg);
        for (size_t i = 1; i < a.size(); ++i) {
          auto extra = std::make_shared<expr>();
          extra->t = expr::type::literal;
          extra->literal = a[i];
          call.args.push_back(extra);
        }
        out.l->push_back(filter(call));
      }
      return out;
    }
    if (f == "select" || f == "reject" || f == "selectattr" || f == "rejectattr") {
      bool by_attr = f == "selectattr" || f == "rejectattr";
      bool keep_if = f == "select" || f == "selectattr";
      size_t first_test = by_attr ? 1 : 0;
      if (by_attr && a.empty())
        fail(where(e) + f + " needs an attribute");
      std::string test_name = a.size() > first_test ? str(a[first_test]) : "";
      if (!test_name.empty() && !tests.count(test_name))
        throw troupe::error{errc::unsupported, "chat template, " + where(e) + "the test '" +
                                                 test_name + "' is not supported"};
      args_list test_args(
        a.begin() + static_cast<std::ptrdiff_t>(std::min(a.size(), first_test + 1)), a.end());
      auto out = value::list();
      for (auto& x : items) {
        auto subject = by_attr ? path(x, str(a[0]), e) : x;
        bool pass =
          test_name.empty() ? truthy(subject) : apply_test(test_name, subject, test_args, e);
        if (pass == keep_if)
          out.l->push_back(x);
      }
      return out;
    }
    fail(where(e) + "the filter '" + f + "' is not supported");
  }

  std::vector<frame> frames_;
  std::string out_;
};

} // namespace

struct jinja_template::program {
  node_list body;
};

jinja_template::jinja_template(const std::string& source) {
  auto p = std::make_shared<program>();
  p->body = parser{lex(source)}.parse_all();
  program_ = std::move(p);
}

jinja_template::~jinja_template() = default;

std::string jinja_template::render(const nlohmann::ordered_json& context) const {
  if (!context.is_object())
    throw error{errc::invalid_argument, "chat template: the variables must be an object"};
  return renderer{context}.run(program_->body);
}

} // namespace troupe
