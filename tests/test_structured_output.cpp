// Structured output's automata against the tiny byte-level tokenizer: valid texts pass token
// by token and may then end, invalid ones meet a token the mask refuses, and random walks
// through the masks end in JSON that holds to the schema.

#include "engine/structured_output.hpp"
#include "model/tokenizer.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <random>
#include <regex>

using namespace troupe;
using json = nlohmann::ordered_json;

namespace {

const std::string fixtures = TROUPE_SOURCE_DIR "/tests/fixtures";
constexpr int32_t end_token = 0; // the tiny tokenizer's <|endoftext|>
constexpr int64_t vocab = 512;

tokenizer& tiny() {
  static auto tok = tokenizer::from_json(fixtures + "/tiny-tokenizer/tokenizer.json");
  return tok;
}

structured_output& automata() {
  static structured_output so{tiny(), vocab, {end_token}};
  return so;
}

bool allows(const token_mask& mask, int32_t t) {
  return mask[static_cast<size_t>(t) / 32] >> (t % 32) & 1;
}

sampling_params schema(const json& s) {
  sampling_params p;
  p.guided_json = s.dump();
  return p;
}

/// Whether the guide takes `text` (as the tokenizer splits it) and may then end.
bool takes(const sampling_params& p, const std::string& text) {
  auto guide = automata().guide(p);
  for (auto t : tiny().encode(text, false, false)) {
    if (!allows(guide->allowed(), t))
      return false;
    guide->accept(t);
  }
  return allows(guide->allowed(), end_token);
}

/// A random walk through the masks (seeded), to the end token: the text it writes.
std::string walk(const sampling_params& p, uint64_t seed, int limit = 20000) {
  auto guide = automata().guide(p);
  std::mt19937_64 rng{seed};
  std::vector<int32_t> ids;
  for (int step = 0; step < limit; ++step) {
    auto& mask = guide->allowed();
    std::vector<int32_t> allowed;
    for (int32_t t = 0; t < vocab; ++t)
      if (allows(mask, t))
        allowed.push_back(t);
    REQUIRE(!allowed.empty());
    // The end as soon as it is allowed: walks end.
    int32_t t =
      allows(mask, end_token) ? end_token : allowed[static_cast<size_t>(rng() % allowed.size())];
    if (t == end_token)
      return tiny().decode(ids);
    guide->accept(t);
    ids.push_back(t);
  }
  return {};
}

} // namespace

TEST_CASE("a schema's valid texts pass token by token and end, invalid ones are refused") {
  auto person =
    schema({{"type", "object"},
            {"properties",
             {{"name", {{"type", "string"}, {"maxLength", 12}}},
              {"age", {{"type", "integer"}}},
              {"tags", {{"type", "array"}, {"items", {{"type", "string"}}}, {"maxItems", 3}}},
              {"kind", {{"enum", {"cat", "dog", 3}}}},
              {"score", {{"type", "number"}}},
              {"ok", {{"type", "boolean"}}}}},
            {"required", {"name", "age"}}});
  for (auto text : {R"({"name":"Zoë","age":3})",
                    R"({ "name" : "a\"b\\c\u00e9", "age" : -12, "tags" : [ "x" , "y" ] })",
                    R"({"name":"","age":0,"kind":"dog","score":-1.5e+3,"ok":false})",
                    R"({"name":"x","age":7,"tags":[],"kind":3})"})
    CHECK_MESSAGE(takes(person, text), text);
  // Surrogates: a pair is one character; alone, or a high one before another high one, not.
  auto short_name = [&](const std::string& name) {
    return takes(person, R"({"name":")" + name + R"(","age":1})");
  };
  CHECK(short_name(R"(\ud83d\ude00)"));
  CHECK_FALSE(short_name(R"(\ude00)"));
  CHECK_FALSE(short_name(R"(\ud83d\ud83d)"));
  CHECK_FALSE(short_name(R"(\ud83dx)"));
  for (auto text : {R"({"age":3,"name":"x"})",           // out of order
                    R"({"name":"x"})",                   // age missing
                    R"({"name":"x","age":3.5})",         // not an integer
                    R"({"name":"x","age":03})",          // a leading zero
                    R"({"name":"x","age":3,"other":1})", // not a property
                    R"({"name":"this is too long","age":3})",
                    R"({"name":"x","age":3,"tags":["a","b","c","d"]})",
                    R"({"name":"x","age":3,"kind":"cow"})", R"({"name":"x","age":3,"ok":nope})",
                    R"({"name":"a)"
                    "\n"
                    R"(b","age":3})", // a raw newline in a string
                    R"({"name":"x","age":3} trailing)"})
    CHECK_FALSE_MESSAGE(takes(person, text), text);
  // A number at the top level may end where it is complete.
  CHECK(takes(schema({{"type", "number"}}), "12.5"));
  CHECK_FALSE(takes(schema({{"type", "number"}}), "12."));
}

TEST_CASE("JSON mode, choices, unions and references") {
  sampling_params object;
  object.guided_json_object = true;
  CHECK(takes(object, R"({"a":[1,{"b":null}],"c":"d"})"));
  CHECK_FALSE(takes(object, R"([1,2])"));
  CHECK_FALSE(takes(object, R"({"a":})"));
  sampling_params choice;
  choice.guided_choice = {"yes", "no", "maybe so"};
  CHECK(takes(choice, "maybe so"));
  CHECK(takes(choice, "no"));
  CHECK_FALSE(takes(choice, "nope"));
  CHECK_FALSE(takes(choice, " yes")); // the whole output: nothing before it
  auto either = schema(
    {{"anyOf", {{{"type", "string"}}, {{"type", "array"}, {"items", {{"type", "integer"}}}}}}});
  CHECK(takes(either, R"("x")"));
  CHECK(takes(either, "[1,2]"));
  CHECK_FALSE(takes(either, "[1.5]"));
  // An enum beside a type keeps the values of that type.
  auto strings = schema({{"type", "string"}, {"enum", {"a", 1}}});
  CHECK(takes(strings, R"("a")"));
  CHECK_FALSE(takes(strings, "1"));
  // Alternatives that stay alike for ever: the stacks are merged and capped, not multiplied.
  auto same = schema({{"$defs",
                       {{"a",
                         {{"anyOf",
                           {{{"type", "array"}, {"items", {{"$ref", "#/$defs/a"}}}},
                            {{"type", "array"}, {"items", {{"$ref", "#/$defs/a"}}}},
                            {{"type", "integer"}}}}}}}},
                      {"$ref", "#/$defs/a"}});
  CHECK(takes(same, "[[[[[[[[[[[[1]]]]]]]]]]]]"));
  auto nullable = schema({{"type", {"integer", "null"}}});
  CHECK(takes(nullable, "null"));
  CHECK(takes(nullable, "42"));
  // A tree: a definition that refers to itself.
  auto tree = schema({{"$ref", "#/$defs/node"},
                      {"$defs",
                       {{"node",
                         {{"type", "object"},
                          {"properties",
                           {{"v", {{"type", "integer"}}},
                            {"kids", {{"type", "array"}, {"items", {{"$ref", "#/$defs/node"}}}}}}},
                          {"required", {"v"}}}}}}});
  CHECK(takes(tree, R"({"v":1,"kids":[{"v":2},{"v":3,"kids":[]}]})"));
  CHECK_FALSE(takes(tree, R"({"v":1,"kids":[{"w":2}]})"));
}

TEST_CASE("random walks through the masks write JSON that holds to the schema") {
  auto s = json{
    {"type", "object"},
    {"properties",
     {{"id", {{"type", "integer"}}},
      {"label", {{"type", "string"}, {"maxLength", 8}}},
      {"point",
       {{"type", "object"},
        {"properties", {{"x", {{"type", "number"}}}, {"y", {{"type", "number"}}}}},
        {"required", {"x", "y"}}}},
      {"colors", {{"type", "array"}, {"items", {{"enum", {"red", "green"}}}}, {"maxItems", 4}}}}},
    {"required", {"id", "point"}}};
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    auto text = walk(schema(s), seed);
    CAPTURE(text);
    auto j = json::parse(text, nullptr, false);
    REQUIRE_FALSE(j.is_discarded());
    REQUIRE(j.is_object());
    CHECK(j["id"].is_number_integer());
    CHECK(j["point"]["x"].is_number());
    CHECK(j["point"]["y"].is_number());
    if (j.contains("label"))
      CHECK(j["label"].get<std::string>().size() <= 8 * 4); // 8 characters of UTF-8
    if (j.contains("colors"))
      for (auto& c : j["colors"])
        CHECK((c == "red" || c == "green"));
    for (auto& [key, value] : j.items())
      CHECK((key == "id" || key == "label" || key == "point" || key == "colors"));
  }
}

TEST_CASE("schemas troupe cannot enforce are refused naming the keyword") {
  auto refused = [](const json& s, const char* what) {
    CHECK_THROWS_WITH_AS(automata().guide(schema(s)), doctest::Contains(what), error);
  };
  refused({{"type", "string"}, {"pattern", "^a+$"}}, "'pattern' is not supported");
  refused({{"type", "integer"}, {"minimum", 3}}, "'minimum' is not supported");
  refused({{"type", "object"}, {"properties", {{"a", {{"type", "string"}}}}}, {"required", {"b"}}},
          "'required' names \"b\"");
  refused({{"$ref", "#/$defs/missing"}}, "names no definition");
  // What would loop or grow without end: a definition that is itself, deep nesting.
  refused({{"$defs", {{"a", {{"$ref", "#/$defs/a"}}}}}, {"$ref", "#/$defs/a"}},
          "leads back to itself");
  refused({{"$defs", {{"a", {{"anyOf", {{{"type", "null"}}, {{"$ref", "#/$defs/a"}}}}}}}},
           {"$ref", "#/$defs/a"}},
          "leads back to itself");
  json deep = {{"type", "string"}};
  for (int i = 0; i < 70; ++i)
    deep = {{"type", "array"}, {"items", deep}};
  refused(deep, "nests deeper than 64");
  // Constraints beside a keyword that names the whole value.
  refused({{"anyOf", {{{"type", "string"}}}}, {"properties", {{"a", {{"type", "string"}}}}}},
          "'properties' beside 'anyOf'");
  refused({{"type", "object"}, {"required", {"a"}}}, "'required' names \"a\"");
  refused({{"type", "string"}, {"enum", {1, 2}}}, "no value of 'enum'");
  refused({{"type", "strange"}}, "type 'strange'");
  sampling_params bad;
  bad.guided_json = "{not json";
  CHECK_THROWS_WITH_AS(automata().guide(bad), doctest::Contains("not JSON"), error);
  sampling_params both;
  both.guided_json_object = true;
  both.guided_choice = {"a"};
  CHECK_THROWS_WITH_AS(automata().guide(both), doctest::Contains("exclude each other"), error);
}

TEST_CASE("guided_regex: the whole output matches, token by token and in random walks") {
  auto pattern = [](const std::string& re) {
    sampling_params p;
    p.guided_regex = re;
    return p;
  };
  auto phone = pattern(R"(\d{3}-\d{4})");
  CHECK(takes(phone, "555-1234"));
  CHECK_FALSE(takes(phone, "5551234"));
  CHECK_FALSE(takes(phone, "555-12345"));
  CHECK_FALSE(takes(phone, "555-123")); // may not end before the match is whole
  auto pets = pattern("^(cat|dog)s?$");
  CHECK(takes(pets, "cats"));
  CHECK(takes(pets, "dog"));
  CHECK_FALSE(takes(pets, "cow"));
  auto name = pattern(R"([A-Z][a-z]+ (?:[0-9]{2,3}|[xX]+)\.?)");
  CHECK(takes(name, "Ada 42."));
  CHECK(takes(name, "Bob XXx"));
  CHECK_FALSE(takes(name, "ada 42"));
  CHECK_FALSE(takes(name, "Ada 4"));
  // '.' and negated classes take any UTF-8 character but a newline; listed ones are theirs.
  auto fields = pattern(R"([^,\n]+,.{1,3},[éa]+)");
  CHECK(takes(fields, "crème,ü€x,éaé"));
  CHECK_FALSE(takes(fields, "a,\n,a"));
  CHECK_FALSE(takes(fields, "a,b,e"));
  // Random walks through the masks write text the same expression matches (std::regex).
  for (std::string re : {R"(\d{3}-\d{4})", "(cat|dog)s?", R"([a-z]{1,8}@[a-z]{2,6}\.(com|org))",
                         R"(-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?)", "(ab|a)(bc|c)?x"}) {
    for (uint64_t seed = 1; seed <= 20; ++seed) {
      auto text = walk(pattern(re), seed);
      CAPTURE(re);
      CAPTURE(text);
      CHECK(std::regex_match(text, std::regex{re}));
    }
  }
  auto refused = [&](const std::string& re, const char* what) {
    CHECK_THROWS_WITH_AS(automata().guide(pattern(re)), doctest::Contains(what), error);
  };
  refused("(?=a)b", "lookaround");
  refused(R"((a)\1)", "backreferences");
  refused(R"(\bword)", "backreferences");
  refused("a{3,1}", "below its start");
  refused("[z-a]", "below its start");
  refused("(ab", "unclosed '('");
  refused("ab)", "unopened ')'");
  refused("*a", "nothing before it");
  refused("[à-ü]", "beyond ASCII");
  refused("a^b", "anchor");
  auto both = pattern("a");
  both.guided_choice = {"a"};
  CHECK_THROWS_AS(automata().guide(both), error);
}
