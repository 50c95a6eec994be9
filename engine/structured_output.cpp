#include "engine/structured_output.hpp"

#include "engine/byte_regex.hpp"
#include "troupe/errors.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <set>

namespace troupe {

namespace {

// Ordered: a schema's properties come in its order.
using json = nlohmann::ordered_json;

[[noreturn]] void bad_schema(const std::string& what) {
  throw error{errc::invalid_argument, "guided_json: " + what};
}

/// Whitespace the automaton takes between JSON's tokens, at most this much in a row: a model
/// may lay out its JSON, but not loop on newlines for ever.
constexpr int16_t max_whitespace = 24;
/// Digits of a number's integer and fraction parts, and of its exponent (a double's range).
constexpr int32_t max_digits = 16;
constexpr int32_t max_exponent_digits = 2;
/// Values nested deeper than this are refused (an `any` value can nest without end).
constexpr size_t max_depth = 24;

bool is_space(uint8_t c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}
bool is_digit(uint8_t c) {
  return c >= '0' && c <= '9';
}
bool is_hex(uint8_t c) {
  return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

} // namespace

/// A compiled constraint: its nodes (one per schema part), and the masks of the states met
/// so far.
class output_grammar {
public:
  struct node {
    enum class kind : uint8_t {
      any,
      object,
      free_object,
      array,
      string,
      number,
      integer,
      literals,
      alternatives,
      regex
    };
    kind what = kind::any;
    /// object: each property's key as JSON text (quoted), its value's node, whether required.
    std::vector<std::string> keys;
    std::vector<int32_t> values;
    std::vector<bool> required;
    /// array: the items' node and how many.
    int32_t item = -1;
    int64_t min_items = 0;
    int64_t max_items = -1;
    /// string: characters.
    int64_t min_length = 0;
    int64_t max_length = -1;
    /// literals: the texts one of which comes (enum and const values as JSON, a choice);
    /// `exact`: with no whitespace before it (a choice is the whole output).
    std::vector<std::string> literals;
    bool exact = false;
    /// alternatives: the nodes one of which comes (anyOf, oneOf, a list of types).
    std::vector<int32_t> options;
    /// regex: its automaton (the frame's `a` is the automaton's state).
    std::shared_ptr<const byte_dfa> dfa;
  };

  /// One value being read: its node, where in it, and counts.
  struct frame {
    int32_t node;
    int16_t phase;
    int16_t space;
    /// object: the next property that may come; array: items begun; string: characters;
    /// number: digits in the current part.
    int32_t a;
    /// object: characters of the key read, then the property chosen; literals: characters
    /// read; string: hex digits of a \u escape.
    int32_t b;
    /// object: the properties the key read so far may be; literals: those still possible.
    uint64_t candidates;
  };
  using stack = std::vector<frame>;

  explicit output_grammar(std::shared_ptr<structured_output::vocabulary> vocab);

  std::vector<node> nodes;
  int32_t root = 0;
  /// The nodes of JSON's values, which an `any` value becomes.
  struct {
    int32_t any, free_object, array, string, number, constants;
  } builtin_{};

  /// The stacks that begin reading `n`'s value on top of `s`, into `out` (alternatives give
  /// several).
  void push(stack s, int32_t n, std::vector<stack>& out) const {
    if (nodes[static_cast<size_t>(n)].what == node::kind::alternatives) {
      for (auto option : nodes[static_cast<size_t>(n)].options)
        push(s, option, out);
      return;
    }
    if (s.size() >= max_depth)
      return;
    s.push_back({n, 0, 0, 0, 0, 0});
    out.push_back(std::move(s));
  }

  /// The stacks `s` becomes on byte `c`, into `out` (none: refused).
  void step(stack s, uint8_t c, std::vector<stack>& out) const;

  /// The stacks `states` become on byte `c`: alike ones merged, at most `max_stacks` (an
  /// ambiguous schema's alternatives multiply; past the cap the first are kept, which may
  /// refuse a valid output but never admits an invalid one).
  std::vector<stack> advance(const std::vector<stack>& states, uint8_t c) const {
    std::vector<stack> after;
    for (auto& s : states)
      step(s, c, after);
    if (after.size() > 1) {
      auto bytes = [](const stack& s) {
        return std::string(reinterpret_cast<const char*>(s.data()), s.size() * sizeof(frame));
      };
      std::sort(after.begin(), after.end(),
                [&](const stack& a, const stack& b) { return bytes(a) < bytes(b); });
      after.erase(std::unique(after.begin(), after.end(),
                              [&](const stack& a, const stack& b) { return bytes(a) == bytes(b); }),
                  after.end());
      if (after.size() > max_stacks)
        after.resize(max_stacks);
    }
    return after;
  }
  static constexpr size_t max_stacks = 64;

  /// Whether the output may end in `s`: all read, or a number or literal at the top level
  /// that is complete.
  bool may_end(const stack& s) const {
    if (s.empty())
      return true;
    if (s.size() != 1)
      return false;
    auto& f = s.back();
    auto& n = nodes[static_cast<size_t>(f.node)];
    if (n.what == node::kind::number || n.what == node::kind::integer)
      return f.phase == 2 || f.phase == 3 || f.phase == 5 || f.phase == 8;
    if (n.what == node::kind::regex)
      return n.dfa->accepting[static_cast<size_t>(f.a)];
    if (n.what == node::kind::literals && f.phase == 1)
      for (size_t i = 0; i < n.literals.size(); ++i)
        if ((f.candidates >> i & 1) && n.literals[i].size() == static_cast<size_t>(f.b))
          return true;
    return false;
  }

  /// Refuses alternatives that lead back to themselves before any value begins (a `$ref`
  /// to itself, an anyOf holding its own definition): nothing could ever be read.
  void refuse_empty_loops() const {
    std::vector<int> mark(nodes.size(), 0); // 0 new, 1 on the path, 2 done
    std::function<void(int32_t)> visit = [&](int32_t n) {
      auto& m = mark[static_cast<size_t>(n)];
      if (m == 1)
        bad_schema("a '$ref' or anyOf leads back to itself before any value begins");
      if (m == 2 || nodes[static_cast<size_t>(n)].what != node::kind::alternatives)
        return;
      m = 1;
      for (auto o : nodes[static_cast<size_t>(n)].options)
        visit(o);
      m = 2;
    };
    for (size_t n = 0; n < nodes.size(); ++n)
      visit(static_cast<int32_t>(n));
  }

  /// The mask of a set of stacks, computed once.
  const token_mask& mask(const std::vector<stack>& states);

  /// Whether an object's properties from `from` on hold a required one.
  static bool requires_after(const node& n, int32_t from) {
    for (size_t i = static_cast<size_t>(from); i < n.required.size(); ++i)
      if (n.required[i])
        return true;
    return false;
  }
  /// The properties that may come next: from `from` up to the first required one.
  static uint64_t candidates(const node& n, int32_t from) {
    uint64_t out = 0;
    for (size_t i = static_cast<size_t>(from); i < n.keys.size(); ++i) {
      out |= uint64_t{1} << i;
      if (n.required[i])
        break;
    }
    return out;
  }

  /// A token's bytes.
  const std::string& token_text(int32_t token) const;

  std::shared_ptr<structured_output::vocabulary> vocab_;
  std::unordered_map<std::string, token_mask> masks_;
  /// Bytes of `masks_` (counted in the vocabulary's `cached_bytes` too).
  size_t cached_bytes_ = 0;
  /// What the masks of all grammars may take.
  static constexpr size_t vocabulary_budget = size_t{256} << 20;

  ~output_grammar();
};

struct structured_output::vocabulary {
  /// A trie of the tokens' bytes: each node's children by byte, and the tokens it ends.
  struct trie_node {
    std::vector<std::pair<uint8_t, int32_t>> children;
    std::vector<int32_t> tokens;
  };
  std::vector<trie_node> trie;
  /// Each token's bytes (empty: a special token, or one the tokenizer lacks).
  std::vector<std::string> bytes;
  std::vector<int32_t> end_tokens;
  int64_t size = 0;
  double seconds = 0;
  /// Bytes of every grammar's cached masks.
  size_t cached_bytes = 0;

  int32_t child(int32_t at, uint8_t c) {
    auto& kids = trie[static_cast<size_t>(at)].children;
    for (auto& [byte, next] : kids)
      if (byte == c)
        return next;
    trie.emplace_back();
    trie[static_cast<size_t>(at)].children.emplace_back(c, static_cast<int32_t>(trie.size() - 1));
    return static_cast<int32_t>(trie.size() - 1);
  }
};

namespace {

using grammar = output_grammar;
using node = grammar::node;

/// Reads a JSON schema into the grammar's nodes.
class schema_compiler {
public:
  schema_compiler(grammar& g, const json& document) : g_(g), document_(document) {}

  /// The node of schema `s`. Bounded: a schema nested deeper than 64 or of more than 10,000
  /// parts is refused (a request's schema must not exhaust the engine).
  int32_t compile(const json& s) {
    if (++depth_ > 64)
      bad_schema("the schema nests deeper than 64");
    struct leave {
      int& depth;
      ~leave() {
        --depth;
      }
    } left{depth_};
    if (g_.nodes.size() > 10000)
      bad_schema("the schema has more than 10000 parts");
    return compile_one(s);
  }

  int32_t compile_one(const json& s) {
    if (s.is_boolean()) {
      if (!s.get<bool>())
        bad_schema("a schema of false admits nothing");
      return any();
    }
    if (!s.is_object())
      bad_schema("a schema must be an object, got " + s.dump());
    static const std::set<std::string> annotations = {
      "$schema", "$id",         "title",    "description", "default",    "examples", "$comment",
      "$defs",   "definitions", "readOnly", "writeOnly",   "deprecated", "strict"};
    static const std::set<std::string> enforced = {
      "type",      "properties", "required", "additionalProperties",
      "items",     "minItems",   "maxItems", "enum",
      "const",     "anyOf",      "oneOf",    "$ref",
      "minLength", "maxLength"};
    for (auto& [key, value] : s.items())
      if (!annotations.count(key) && !enforced.count(key))
        bad_schema("'" + key + "' is not supported (troupe enforces " + list(enforced) + ")");
    // A keyword that names the whole value leaves no room for constraints beside it (but
    // enum and const beside a type, which keeps the values of that type).
    for (auto whole : {"$ref", "anyOf", "oneOf", "enum", "const"}) {
      if (!s.contains(whole))
        continue;
      for (auto& [key, value] : s.items())
        if (key != whole && enforced.count(key) &&
            !((std::string{whole} == "enum" || std::string{whole} == "const") && key == "type"))
          bad_schema("'" + key + "' beside '" + whole + "' is not supported");
    }
    if (s.contains("$ref"))
      return reference(s["$ref"]);
    if (s.contains("const") || s.contains("enum")) {
      std::vector<json> values;
      if (s.contains("const"))
        values.push_back(s["const"]);
      else if (!s["enum"].is_array() || s["enum"].empty())
        bad_schema("'enum' must be a non-empty array");
      else
        values.assign(s["enum"].begin(), s["enum"].end());
      if (s.contains("type")) {
        auto kept = values;
        kept.erase(std::remove_if(kept.begin(), kept.end(),
                                  [&](const json& v) { return !of_type(v, s["type"]); }),
                   kept.end());
        if (kept.empty())
          bad_schema("no value of 'enum' or 'const' is of the schema's 'type'");
        values = kept;
      }
      return literals(values);
    }
    // oneOf as anyOf: a value its alternatives both admit breaks oneOf (rare in practice).
    for (auto key : {"anyOf", "oneOf"})
      if (s.contains(key)) {
        if (!s[key].is_array() || s[key].empty())
          bad_schema(std::string{"'"} + key + "' must be a non-empty array of schemas");
        node n;
        n.what = node::kind::alternatives;
        for (auto& option : s[key])
          n.options.push_back(compile(option));
        return add(std::move(n));
      }
    if (!s.contains("type"))
      return s.contains("properties") ? object(s) : any();
    auto& type = s["type"];
    if (type.is_array()) {
      node n;
      n.what = node::kind::alternatives;
      for (auto& t : type) {
        auto one = s;
        one["type"] = t;
        n.options.push_back(compile(one));
      }
      if (n.options.empty())
        bad_schema("'type' must name at least one type");
      return add(std::move(n));
    }
    if (!type.is_string())
      bad_schema("'type' must be a string or an array of strings");
    auto t = type.get<std::string>();
    if (t == "object")
      return object(s);
    if (t == "array") {
      node n;
      n.what = node::kind::array;
      n.item = s.contains("items") ? compile(s["items"]) : any();
      n.min_items = count(s, "minItems", 0);
      n.max_items = count(s, "maxItems", -1);
      return add(std::move(n));
    }
    if (t == "string") {
      node n;
      n.what = node::kind::string;
      n.min_length = count(s, "minLength", 0);
      n.max_length = count(s, "maxLength", -1);
      return add(std::move(n));
    }
    if (t == "number" || t == "integer") {
      node n;
      n.what = t == "number" ? node::kind::number : node::kind::integer;
      return add(std::move(n));
    }
    if (t == "boolean")
      return literals({true, false});
    if (t == "null")
      return literals({nullptr});
    bad_schema("type '" + t + "' is not a JSON Schema type");
  }

  int32_t any() {
    if (any_ < 0) {
      node n;
      n.what = node::kind::any;
      any_ = add(std::move(n));
    }
    return any_;
  }

private:
  static std::string list(const std::set<std::string>& keys) {
    std::string out;
    for (auto& k : keys)
      out += (out.empty() ? "" : ", ") + k;
    return out;
  }

  /// Whether `v` is of JSON Schema type `type` (a name, or a list of them).
  static bool of_type(const json& v, const json& type) {
    if (type.is_array())
      return std::any_of(type.begin(), type.end(), [&](const json& t) { return of_type(v, t); });
    if (!type.is_string())
      return false;
    auto t = type.get<std::string>();
    return (t == "string" && v.is_string()) || (t == "integer" && v.is_number_integer()) ||
           (t == "number" && v.is_number()) || (t == "boolean" && v.is_boolean()) ||
           (t == "null" && v.is_null()) || (t == "object" && v.is_object()) ||
           (t == "array" && v.is_array());
  }

  static int64_t count(const json& s, const char* key, int64_t fallback) {
    if (!s.contains(key))
      return fallback;
    if (!s[key].is_number_integer() || s[key].get<int64_t>() < 0)
      bad_schema(std::string{"'"} + key + "' must be a non-negative integer");
    return s[key].get<int64_t>();
  }

  int32_t add(node n) {
    g_.nodes.push_back(std::move(n));
    return static_cast<int32_t>(g_.nodes.size() - 1);
  }

  int32_t literals(const std::vector<json>& values) {
    if (values.size() > 64)
      bad_schema("an enum of more than 64 values is not supported");
    node n;
    n.what = node::kind::literals;
    for (auto& v : values)
      n.literals.push_back(v.dump());
    return add(std::move(n));
  }

  int32_t object(const json& s) {
    node n;
    auto properties = s.value("properties", json::object());
    if (!properties.is_object())
      bad_schema("'properties' must be an object");
    auto extra = s.value("additionalProperties", json(true));
    if (properties.empty() && s.contains("required") && s["required"].is_array() &&
        !s["required"].empty())
      bad_schema("'required' names " + s["required"][0].dump() +
                 ", which is not among the properties");
    if (properties.empty()) {
      if (extra.is_boolean() && !extra.get<bool>())
        n.what = node::kind::object; // only {}
      else
        n.what = node::kind::free_object;
      if (!extra.is_boolean())
        bad_schema("'additionalProperties' as a schema is not supported (true or false)");
      return add(std::move(n));
    }
    // The properties in the schema's order, optional ones may be left out; no others (a
    // valid instance whatever additionalProperties says).
    if (properties.size() > 64)
      bad_schema("an object of more than 64 properties is not supported");
    std::set<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array())
        bad_schema("'required' must be an array of property names");
      for (auto& r : s["required"]) {
        if (!r.is_string() || !properties.contains(r.get<std::string>()))
          bad_schema("'required' names " + r.dump() + ", which is not among the properties");
        required.insert(r.get<std::string>());
      }
    }
    n.what = node::kind::object;
    auto index = add(n);
    std::vector<std::string> keys;
    std::vector<int32_t> values;
    std::vector<bool> needed;
    for (auto& [key, value] : properties.items()) {
      keys.push_back(json(key).dump());
      values.push_back(compile(value));
      needed.push_back(required.count(key) > 0);
    }
    auto& placed = g_.nodes[static_cast<size_t>(index)];
    placed.keys = std::move(keys);
    placed.values = std::move(values);
    placed.required = std::move(needed);
    return index;
  }

  int32_t reference(const json& ref) {
    if (!ref.is_string())
      bad_schema("'$ref' must be a string");
    auto path = ref.get<std::string>();
    auto known = refs_.find(path);
    if (known != refs_.end())
      return known->second;
    for (auto prefix : {"#/$defs/", "#/definitions/"}) {
      auto p = std::string{prefix};
      if (path.compare(0, p.size(), p) != 0)
        continue;
      auto name = path.substr(p.size());
      auto holder = std::string{prefix}.substr(2, p.size() - 3);
      if (!document_.contains(holder) || !document_[holder].contains(name))
        bad_schema("'$ref' " + path + " names no definition");
      // A placeholder first: a definition may refer to itself.
      node n;
      n.what = node::kind::alternatives;
      auto index = add(n);
      refs_[path] = index;
      auto target = compile(document_[holder][name]);
      g_.nodes[static_cast<size_t>(index)].options = {target};
      return index;
    }
    bad_schema("'$ref' " + path + " is not supported (#/$defs/… or #/definitions/…)");
  }

  grammar& g_;
  const json& document_;
  int32_t any_ = -1;
  int depth_ = 0;
  std::map<std::string, int32_t> refs_;
};

} // namespace

void output_grammar::step(stack s, uint8_t c, std::vector<stack>& out) const {
  using k = node::kind;
  for (;;) {
    if (s.empty())
      return; // complete: nothing more
    auto& f = s.back();
    auto& n = nodes[static_cast<size_t>(f.node)];
    auto space = [&] {
      if (!is_space(c) || f.space >= max_whitespace)
        return false;
      ++f.space;
      return true;
    };
    auto take = [&] { // c is consumed
      out.push_back(std::move(s));
    };
    auto done = [&] { // the value ends with c
      s.pop_back();
      out.push_back(std::move(s));
    };
    auto ends_before = [&] { // the value ended before c: c is the parent's
      s.pop_back();
    };
    auto child = [&](int32_t value) { // c begins a value
      std::vector<stack> begun;
      push(s, value, begun);
      for (auto& b : begun)
        step(std::move(b), c, out);
    };
    auto then = [&](int16_t phase) { // c is consumed: the next phase, no whitespace yet
      f.phase = phase;
      f.space = 0;
      take();
    };
    auto opening = [&](uint8_t bracket) { // the value's first byte, after whitespace
      if (space())
        return take();
      if (c == bracket)
        then(1);
    };
    auto value_after = [&](int16_t phase, int32_t value) { // c (':') is consumed
      f.phase = phase;
      f.space = 0;
      push(std::move(s), value, out);
    };
    switch (n.what) {
    case k::any:
      if (f.phase == 0 && space())
        return take();
      // Becomes the value its first byte starts, which then takes the byte.
      f.space = 0;
      if (c == '{')
        f.node = builtin_.free_object;
      else if (c == '[')
        f.node = builtin_.array;
      else if (c == '"')
        f.node = builtin_.string;
      else if (c == '-' || is_digit(c))
        f.node = builtin_.number;
      else if (c == 't' || c == 'f' || c == 'n')
        f.node = builtin_.constants;
      else
        return;
      continue;
    case k::object:
      switch (f.phase) {
      case 0:
        return opening('{');
      case 1: // after '{'
      case 5: // after ','
        if (space())
          return take();
        if (c == '}' && f.phase == 1 && !requires_after(n, f.a))
          return done();
        if (c != '"')
          return;
        f.candidates = candidates(n, f.a);
        if (f.candidates == 0)
          return;
        f.b = 1;
        return then(2);
      case 2: { // in a key
        uint64_t left = 0;
        int32_t complete = -1;
        for (size_t i = 0; i < n.keys.size(); ++i)
          if ((f.candidates >> i & 1) && static_cast<size_t>(f.b) < n.keys[i].size() &&
              static_cast<uint8_t>(n.keys[i][static_cast<size_t>(f.b)]) == c) {
            left |= uint64_t{1} << i;
            if (n.keys[i].size() == static_cast<size_t>(f.b) + 1)
              complete = static_cast<int32_t>(i);
          }
        if (left == 0)
          return;
        if (complete >= 0) { // the closing quote: keys differ before it
          f.phase = 3;
          f.b = complete;
          f.candidates = 0;
        } else {
          f.candidates = left;
          ++f.b;
        }
        return take();
      }
      case 3: // expect ':'
        if (space())
          return take();
        if (c != ':')
          return;
        f.a = f.b + 1;
        return value_after(4, n.values[static_cast<size_t>(f.b)]);
      case 4: // after a value
        if (space())
          return take();
        if (c == ',' && candidates(n, f.a) != 0)
          return then(5);
        if (c == '}' && !requires_after(n, f.a))
          return done();
        return;
      }
      return;
    case k::free_object:
      switch (f.phase) {
      case 0:
        return opening('{');
      case 1: // after '{'
      case 5: // after ','
        if (space())
          return take();
        if (c == '}' && f.phase == 1)
          return done();
        if (c != '"')
          return;
        f.phase = 3;
        f.space = 0;
        // The key: a string after its opening quote.
        s.push_back({builtin_.string, 1, 0, 0, 0, 0});
        return take();
      case 3:
        if (space())
          return take();
        if (c != ':')
          return;
        return value_after(4, builtin_.any);
      case 4:
        if (space())
          return take();
        if (c == ',')
          return then(5);
        if (c == '}')
          return done();
        return;
      }
      return;
    case k::array:
      switch (f.phase) {
      case 0:
        return opening('[');
      case 1: // after '['
      case 3: // after ','
        if (space())
          return take();
        if (c == ']' && f.phase == 1 && n.min_items == 0)
          return done();
        if (n.max_items >= 0 && f.a >= n.max_items)
          return;
        f.phase = 2;
        f.space = 0;
        ++f.a;
        return child(n.item);
      case 2: // after an item
        if (space())
          return take();
        if (c == ',' && (n.max_items < 0 || f.a < n.max_items))
          return then(3);
        if (c == ']' && f.a >= n.min_items)
          return done();
        return;
      }
      return;
    case k::string:
      switch (f.phase) {
      case 0:
        return opening('"');
      case 1:
        if (c == '"')
          return f.a >= n.min_length || n.min_length <= 0 ? done() : void();
        if (c < 0x20)
          return;
        // Each character counts at its first byte (the length is checked before it can
        // only be finished past the limit); only where there is a limit, so that the
        // states of an unlimited string are one (one cached mask).
        if (n.max_length >= 0 && f.a + 1 > n.max_length)
          return;
        // Counted up to what a limit needs only.
        if (n.max_length >= 0 || f.a < n.min_length)
          ++f.a;
        if (c == '\\') {
          f.phase = 2;
          return take();
        }
        // A character begins: ASCII, or the lead byte of well-formed UTF-8 (no overlong
        // forms, surrogates or code points past U+10FFFF): its continuation bytes, and the
        // range of the first (`candidates`: low << 8 | high).
        if (c >= 0x80) {
          f.b = c >= 0xC2 && c <= 0xDF   ? 1
                : c >= 0xE0 && c <= 0xEF ? 2
                : c >= 0xF0 && c <= 0xF4 ? 3
                                         : 0;
          if (f.b == 0)
            return;
          uint64_t low = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
          uint64_t high = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
          f.candidates = low << 8 | high;
          f.phase = 4;
        }
        return take();
      case 4: // the rest of a UTF-8 character
        if (c < (f.candidates >> 8) || c > (f.candidates & 0xFF))
          return;
        f.candidates = 0x80BF;
        if (--f.b == 0) {
          f.phase = 1;
          f.candidates = 0;
        }
        return take();
      case 2:
        if (std::strchr("\"\\/bfnrt", c) != nullptr && c != 0) {
          f.phase = 1;
          return take();
        }
        if (c == 'u') {
          f.phase = 3;
          f.b = 0;
          f.candidates = 0;
          return take();
        }
        return;
      case 3: // \uXXXX: its value in `candidates`
      case 7: // the low surrogate after a high one
      {
        if (!is_hex(c))
          return;
        f.candidates =
          f.candidates << 4 | static_cast<uint64_t>(is_digit(c) ? c - '0' : (c | 0x20) - 'a' + 10);
        ++f.b;
        // Refused as soon as it cannot end well: a low surrogate alone, or a high one
        // followed by anything but a low one.
        auto v = f.candidates;
        if (f.phase == 3 && f.b == 2 && v >= 0xDC && v <= 0xDF)
          return;
        if (f.phase == 7 && ((f.b == 1 && v != 0xD) || (f.b == 2 && (v < 0xDC || v > 0xDF))))
          return;
        if (f.b < 4)
          return take();
        bool high = v >= 0xD800 && v <= 0xDBFF, low = v >= 0xDC00 && v <= 0xDFFF;
        if (f.phase == 3 && high) {
          f.phase = 5; // a pair: "\u" and the low half must follow
          return take();
        }
        if ((f.phase == 3 && low) || (f.phase == 7 && !low))
          return;
        f.phase = 1;
        f.b = 0;
        f.candidates = 0;
        return take();
      }
      case 5:
        if (c != '\\')
          return;
        f.phase = 6;
        return take();
      case 6:
        if (c != 'u')
          return;
        f.phase = 7;
        f.b = 0;
        f.candidates = 0;
        return take();
      }
      return;
    case k::number:
    case k::integer: {
      bool real = n.what == k::number;
      auto digit = [&](int16_t next, int32_t limit) {
        f.a = f.phase == next ? f.a + 1 : 1;
        if (f.a > limit)
          return false;
        f.phase = next;
        return true;
      };
      switch (f.phase) {
      case 0:
        if (space())
          return take();
        if (c == '-') {
          f.phase = 1;
          return take();
        }
        [[fallthrough]];
      case 1:
        if (c == '0') {
          f.phase = 2;
          return take();
        }
        if (c >= '1' && c <= '9') {
          f.phase = 3;
          f.a = 1;
          return take();
        }
        return;
      case 2: // a leading zero
      case 3: // integer digits
        if (f.phase == 3 && is_digit(c))
          return digit(3, max_digits) ? take() : void();
        if (real && c == '.') {
          f.phase = 4;
          return take();
        }
        if (real && (c == 'e' || c == 'E')) {
          f.phase = 6;
          return take();
        }
        ends_before();
        continue;
      case 4: // after '.'
        if (!is_digit(c))
          return;
        f.phase = 5;
        f.a = 1;
        return take();
      case 5: // fraction digits
        if (is_digit(c))
          return digit(5, max_digits) ? take() : void();
        if (c == 'e' || c == 'E') {
          f.phase = 6;
          return take();
        }
        ends_before();
        continue;
      case 6: // after 'e'
        if (c == '+' || c == '-') {
          f.phase = 7;
          return take();
        }
        [[fallthrough]];
      case 7:
        if (!is_digit(c))
          return;
        f.phase = 8;
        f.a = 1;
        return take();
      case 8: // exponent digits
        if (is_digit(c))
          return digit(8, max_exponent_digits) ? take() : void();
        ends_before();
        continue;
      }
      return;
    }
    case k::literals: {
      if (f.phase == 0) {
        if (!n.exact && space())
          return take();
        f.phase = 1;
        f.b = 0;
        f.candidates =
          n.literals.size() >= 64 ? ~uint64_t{0} : (uint64_t{1} << n.literals.size()) - 1;
      }
      uint64_t left = 0;
      bool complete = false;
      for (size_t i = 0; i < n.literals.size(); ++i) {
        if (!(f.candidates >> i & 1))
          continue;
        auto& text = n.literals[i];
        if (static_cast<size_t>(f.b) < text.size() &&
            static_cast<uint8_t>(text[static_cast<size_t>(f.b)]) == c)
          left |= uint64_t{1} << i;
        else if (text.size() == static_cast<size_t>(f.b))
          complete = true;
      }
      if (left != 0) {
        f.candidates = left;
        ++f.b;
        // A literal that ends with c and is no other's beginning ends here.
        bool longer = false;
        for (size_t i = 0; i < n.literals.size(); ++i)
          if ((left >> i & 1) && n.literals[i].size() > static_cast<size_t>(f.b))
            longer = true;
        if (!longer)
          return done();
        return take();
      }
      if (complete && f.b > 0) {
        ends_before();
        continue;
      }
      return;
    }
    case k::regex: {
      auto next = n.dfa->next[static_cast<size_t>(f.a)][c];
      if (next < 0)
        return;
      f.a = next;
      // A match that cannot go on is complete.
      if (!n.dfa->continues[static_cast<size_t>(next)])
        return done();
      return take();
    }
    case k::alternatives:
      return; // expanded by push
    }
    return;
  }
}

const std::string& output_grammar::token_text(int32_t token) const {
  static const std::string none;
  auto& bytes = vocab_->bytes;
  return token >= 0 && static_cast<size_t>(token) < bytes.size() ? bytes[static_cast<size_t>(token)]
                                                                 : none;
}

output_grammar::output_grammar(std::shared_ptr<structured_output::vocabulary> vocab)
  : vocab_(std::move(vocab)) {
  auto add = [&](node n) {
    nodes.push_back(std::move(n));
    return static_cast<int32_t>(nodes.size() - 1);
  };
  node n;
  n.what = node::kind::any;
  builtin_.any = add(n);
  n.what = node::kind::free_object;
  builtin_.free_object = add(n);
  n.what = node::kind::array;
  n.item = builtin_.any;
  builtin_.array = add(n);
  n = node{};
  n.what = node::kind::string;
  builtin_.string = add(n);
  n.what = node::kind::number;
  builtin_.number = add(n);
  n.what = node::kind::literals;
  n.literals = {"true", "false", "null"};
  builtin_.constants = add(n);
}

const token_mask& output_grammar::mask(const std::vector<stack>& states) {
  std::string key;
  for (auto& s : states) {
    auto frames = static_cast<uint32_t>(s.size());
    key.append(reinterpret_cast<const char*>(&frames), sizeof frames);
    key.append(reinterpret_cast<const char*>(s.data()), s.size() * sizeof(frame));
  }
  auto found = masks_.find(key);
  if (found != masks_.end())
    return found->second;
  auto start = std::chrono::steady_clock::now();
  auto& v = *vocab_;
  token_mask mask(static_cast<size_t>((v.size + 31) / 32), 0);
  auto allow = [&](int32_t t) {
    if (t >= 0 && t < v.size)
      mask[static_cast<size_t>(t) / 32] |= uint32_t{1} << (t % 32);
  };
  // Every token whose bytes the automata take from here, found down the trie: a subtree is
  // left at the first byte they refuse.
  struct walker {
    const output_grammar& g;
    const structured_output::vocabulary& v;
    const std::function<void(int32_t)>& allow;
    void walk(int32_t at, const std::vector<stack>& states) {
      for (auto& [byte, next] : v.trie[static_cast<size_t>(at)].children) {
        auto after = g.advance(states, byte);
        if (after.empty())
          continue;
        for (auto t : v.trie[static_cast<size_t>(next)].tokens)
          allow(t);
        walk(next, after);
      }
    }
  };
  std::function<void(int32_t)> allow_fn = allow;
  walker{*this, v, allow_fn}.walk(0, states);
  bool may_stop =
    std::any_of(states.begin(), states.end(), [&](const stack& s) { return may_end(s); });
  bool any = std::any_of(mask.begin(), mask.end(), [](uint32_t w) { return w != 0; });
  // Complete, or nothing in the vocabulary continues it: the output ends.
  if (may_stop || !any)
    for (auto t : v.end_tokens)
      allow(t);
  v.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The masks of all grammars share a budget: past it, this grammar starts afresh.
  auto bytes = mask.size() * sizeof(uint32_t) + key.size();
  if (v.cached_bytes + bytes > vocabulary_budget) {
    v.cached_bytes -= std::min(v.cached_bytes, cached_bytes_);
    cached_bytes_ = 0;
    masks_.clear();
  }
  v.cached_bytes += bytes;
  cached_bytes_ += bytes;
  return masks_.emplace(std::move(key), std::move(mask)).first->second;
}

output_grammar::~output_grammar() {
  vocab_->cached_bytes -= std::min(vocab_->cached_bytes, cached_bytes_);
}

struct output_guide::state {
  std::vector<output_grammar::stack> stacks;
  bool ended = false;
};

output_guide::output_guide(std::shared_ptr<output_grammar> grammar)
  : grammar_(std::move(grammar)), state_(std::make_unique<state>()) {
  grammar_->push({}, grammar_->root, state_->stacks);
}

output_guide::~output_guide() = default;

const token_mask& output_guide::allowed() {
  if (state_->ended) {
    // Only the end tokens: an empty set of stacks has no continuation.
    static const std::vector<output_grammar::stack> none;
    return grammar_->mask(none);
  }
  return grammar_->mask(state_->stacks);
}

void output_guide::accept(int32_t token) {
  auto& v = *grammar_->vocab_;
  if (std::find(v.end_tokens.begin(), v.end_tokens.end(), token) != v.end_tokens.end()) {
    state_->ended = true;
    return;
  }
  auto bytes = grammar_->token_text(token);
  auto& stacks = state_->stacks;
  for (auto c : bytes)
    stacks = grammar_->advance(stacks, static_cast<uint8_t>(c));
  if (stacks.empty())
    state_->ended = true; // a token the mask did not allow: nothing more is valid
}

structured_output::structured_output(const tokenizer& tok, int64_t vocab_size,
                                     std::vector<int32_t> end_tokens)
  : vocab_(std::make_shared<vocabulary>()) {
  auto& v = *vocab_;
  v.size = vocab_size;
  v.end_tokens = std::move(end_tokens);
  v.trie.emplace_back();
  v.bytes.resize(static_cast<size_t>(vocab_size));
  auto known = std::min<int64_t>(vocab_size, static_cast<int64_t>(tok.vocab_size()));
  for (int32_t id = 0; id < known; ++id) {
    if (tok.is_special(id))
      continue; // never part of an output's text
    auto bytes = tok.token_bytes(id);
    if (bytes.empty())
      continue;
    v.bytes[static_cast<size_t>(id)] = bytes;
    int32_t at = 0;
    for (auto c : bytes)
      at = v.child(at, static_cast<uint8_t>(c));
    v.trie[static_cast<size_t>(at)].tokens.push_back(id);
  }
}

structured_output::~structured_output() = default;

double structured_output::mask_seconds() const {
  return vocab_->seconds;
}

std::unique_ptr<output_guide> structured_output::guide(const sampling_params& p) {
  int kinds = (!p.guided_json.empty() ? 1 : 0) + (p.guided_json_object ? 1 : 0) +
              (!p.guided_choice.empty() ? 1 : 0) + (!p.guided_regex.empty() ? 1 : 0);
  if (kinds == 0)
    return nullptr;
  if (kinds > 1)
    throw error{errc::invalid_argument, "guided_json, guided_json_object, guided_choice and "
                                        "guided_regex exclude each other"};
  std::string key = !p.guided_json.empty()    ? "json:" + p.guided_json
                    : p.guided_json_object    ? std::string{"object"}
                    : !p.guided_regex.empty() ? "regex:" + p.guided_regex
                                              : "choice:" + json(p.guided_choice).dump();
  auto found = grammars_.find(key);
  if (found == grammars_.end()) {
    auto g = std::make_shared<output_grammar>(vocab_);
    if (!p.guided_json.empty()) {
      auto schema = json::parse(p.guided_json, nullptr, false);
      if (schema.is_discarded())
        bad_schema("the schema is not JSON");
      schema_compiler compiler{*g, schema};
      g->root = compiler.compile(schema);
      g->refuse_empty_loops();
    } else if (p.guided_json_object) {
      g->root = g->builtin_.free_object;
    } else if (!p.guided_regex.empty()) {
      output_grammar::node n;
      n.what = output_grammar::node::kind::regex;
      n.dfa = std::make_shared<const byte_dfa>(compile_regex(p.guided_regex));
      if (!n.dfa->continues[0] && !n.dfa->accepting[0])
        throw error{errc::invalid_argument,
                    "guided_regex '" + p.guided_regex + "' matches no text"};
      g->nodes.push_back(std::move(n));
      g->root = static_cast<int32_t>(g->nodes.size() - 1);
    } else {
      if (p.guided_choice.size() > 64)
        throw error{errc::invalid_argument, "guided_choice: more than 64 choices"};
      output_grammar::node n;
      n.what = output_grammar::node::kind::literals;
      n.exact = true;
      for (auto& c : p.guided_choice) {
        if (c.empty())
          throw error{errc::invalid_argument, "guided_choice holds an empty choice"};
        n.literals.push_back(c);
      }
      g->nodes.push_back(std::move(n));
      g->root = static_cast<int32_t>(g->nodes.size() - 1);
    }
    if (grammars_.size() >= 64)
      grammars_.clear(); // guides in use keep theirs
    found = grammars_.emplace(key, std::move(g)).first;
  }
  return std::make_unique<output_guide>(found->second);
}

} // namespace troupe
