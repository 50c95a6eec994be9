// Chat templates: the real templates of the families troupe runs, rendered by the Jinja
// interpreter (model/jinja.hpp) exactly as transformers renders them
// (tests/fixtures/chat-templates, made by scripts/make-chat-template-fixtures.py), and the
// interpreter's own rules (whitespace control, scoping, errors) on small templates.

#include "model/chat_template.hpp"
#include "model/jinja.hpp"
#include "model/tokenizer.hpp"
#include "tests/generation.hpp"
#include "troupe/errors.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

using namespace troupe;
using json = nlohmann::ordered_json;

namespace {

const std::string dir = TROUPE_SOURCE_DIR "/tests/fixtures/chat-templates";

std::string read(const std::string& path) {
  std::ifstream in{path};
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string render(const std::string& source, const json& context = json::object()) {
  return jinja_template{source}.render(context);
}

} // namespace

TEST_CASE("real chat templates render as transformers renders them") {
  auto fixture = json::parse(read(dir + "/renderings.json"));
  int rendered = 0;
  int refused = 0;
  for (auto& c : fixture["cases"]) {
    auto name = c["template"].get<std::string>();
    auto conversation = c["conversation"].get<std::string>();
    CAPTURE(name);
    CAPTURE(conversation);
    jinja_template tmpl{read(dir + "/" + name + ".jinja")};
    json context = c["variables"];
    context["messages"] = fixture["conversations"][conversation];
    context["tools"] = c["tools"];
    context["documents"] = nullptr;
    context["add_generation_prompt"] = true;
    context["bos_token"] = c["bos_token"];
    context["eos_token"] = c["eos_token"];
    if (c.contains("error")) {
      CHECK_THROWS_WITH_AS(tmpl.render(context), c["error"].get<std::string>().c_str(), error);
      ++refused;
    } else {
      CHECK(tmpl.render(context) == c["rendered"].get<std::string>());
      ++rendered;
    }
  }
  CHECK(rendered >= 80);
  CHECK(refused >= 5);
}

TEST_CASE("whitespace: trim_blocks, lstrip_blocks and the - and + markers") {
  CHECK(render("a\n{% if true %}\nb\n{% endif %}\nc") == "a\nb\nc");
  CHECK(render("  {% if true %}x{% endif %}") == "x");
  CHECK(render("  {%+ if true %}x{% endif %}") == "  x");
  CHECK(render("a  {{- ' b ' -}}  c") == "a b c");
  CHECK(render("a {# note #}\nb") == "a b");
  CHECK(render("{{ 'x' }}\ny") == "x\ny");                 // trim_blocks leaves expressions alone
  CHECK(render("x  {% if true %}y{% endif %}") == "x  y"); // not at a line's start
}

TEST_CASE("scoping: loops keep their sets, namespaces carry values out") {
  CHECK(render("{% set x = 1 %}{% for i in [1, 2] %}{% set x = i %}{% endfor %}{{ x }}") == "1");
  CHECK(render("{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}"
               "{% endfor %}{{ ns.n }}") == "6");
  CHECK(render("{% if true %}{% set x = 2 %}{% endif %}{{ x }}") == "2");
  CHECK(render("{% for a, b in {'k': 1, 'j': 2}.items() %}{{ a }}={{ b }}{% if not loop.last %},"
               "{% endif %}{% endfor %}") == "k=1,j=2");
  CHECK(render("{% for i in [1, 2, 3, 4] if i is even %}{{ loop.index }}:{{ i }} {% endfor %}") ==
        "1:2 2:4 ");
  CHECK(render("{% for i in [] %}x{% else %}empty{% endfor %}") == "empty");
  CHECK(render("{% for i in range(10) %}{% if i == 3 %}{% break %}{% endif %}{% if i is odd %}"
               "{% continue %}{% endif %}{{ i }}{% endfor %}") == "02");
  CHECK(render("{% macro greet(who, punct='!') %}Hi {{ who }}{{ punct }}{% endmacro %}"
               "{{ greet('you') }} {{ greet('all', punct='.') }}") == "Hi you! Hi all.");
  CHECK(render("{% set block %}in {{ 1 + 1 }}{% endset %}[{{ block }}]") == "[in 2]");
}

TEST_CASE("expressions as Python evaluates them") {
  CHECK(render("{{ [1, 2, 3][::-1] }} {{ 'héllo'[1:3] }} {{ 'abc'[-1] }}") == "[3, 2, 1] él c");
  CHECK(render("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1.0 }}") ==
        "3 -4 1 3.5 1024 1.0");
  CHECK(render("{{ 'a' ~ 1 ~ none }} {{ 'b' if false }}|{{ 'yes' if 1 in [1] else 'no' }}") ==
        "a1None |yes");
  CHECK(render("{{ ' x '.strip() }}|{{ 'a,b'.split(',') }}|{{ 'a b  c'.split() }}") ==
        "x|['a', 'b']|['a', 'b', 'c']");
  CHECK(render("{{ '<think>x</think>y'.split('</think>')[-1].lstrip('\\n') }}") == "y");
  CHECK(render("{{ {'b': [1, 2.5, 'ü', none, true]} | tojson }}") ==
        "{\"b\": [1, 2.5, \"ü\", null, true]}");
  CHECK(render("{{ {'a': {'b': 1}} | tojson(indent=2) }}") ==
        "{\n  \"a\": {\n    \"b\": 1\n  }\n}");
  CHECK(
    render("{{ [{'r': 'u'}, {'r': 'a'}] | selectattr('r', 'equalto', 'u') | list | length }}") ==
    "1");
  CHECK(render("{{ ['a', 'b'] | map('upper') | join('-') }} {{ x | default('d') }}") == "A-B d");
  CHECK(render("{{ x is defined }} {{ none is none }} {{ 'a' is string }} {{ {} is mapping }}") ==
        "False True True True");
  CHECK(render("{{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1e-5 }}") == "0.30000000000000004 1e+20 1e-05");
}

TEST_CASE("errors name what went wrong") {
  CHECK_THROWS_WITH_AS(render("{{ raise_exception('roles must alternate') }}"),
                       "roles must alternate", error);
  CHECK_THROWS_WITH_AS(render("{{ x.y }}"), doctest::Contains("'x' is undefined"), error);
  CHECK_THROWS_WITH_AS(render("{{ 1 + 'a' }}"), doctest::Contains("unsupported operand"), error);
  CHECK_THROWS_WITH_AS(render("{% include 'x' %}"), doctest::Contains("'include' is not supported"),
                       error);
  CHECK_THROWS_WITH_AS(render("{{ x | urlize }}"), doctest::Contains("'urlize' is not supported"),
                       error);
  CHECK_THROWS_WITH_AS(render("{% if x %}"), doctest::Contains("ends before"), error);
  CHECK_THROWS_WITH_AS(render("{{ 'a' "), doctest::Contains("line 1"), error);
  try {
    render("{% include 'x' %}");
  } catch (const error& e) {
    CHECK(e.code() == errc::unsupported);
  }
}

TEST_CASE("SmolLM2's GGUF template gives the text and token ids of apply_chat_template") {
  auto model = troupe::testing::smollm2_or_skip();
  if (model.empty())
    return;
  auto tok = tokenizer::from_gguf(model.string());
  auto tmpl = chat_template::of_model(model.string(), &tok);
  REQUIRE(tmpl);
  auto fixture = json::parse(read(dir + "/renderings.json"));
  int compared = 0;
  for (auto& c : fixture["cases"]) {
    if (c["template"] != "smollm2" || !c.contains("token_ids"))
      continue;
    CAPTURE(c["conversation"]);
    auto text = tmpl->render(fixture["conversations"][c["conversation"].get<std::string>()],
                             c["tools"], c["variables"]);
    CHECK(text == c["rendered"].get<std::string>());
    CHECK(tok.encode(text, true, false) == c["token_ids"].get<std::vector<int32_t>>());
    ++compared;
  }
  CHECK(compared >= 8);
}

TEST_CASE("a Hugging Face directory's template: chat_template.jinja, else tokenizer_config.json") {
  namespace fs = std::filesystem;
  auto d = fs::temp_directory_path() / ("troupe-chat-" + std::to_string(::getpid()));
  fs::create_directories(d);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream{d / name} << text;
  };
  CHECK_FALSE(chat_template::of_model(d.string(), nullptr));
  json config = {
    {"bos_token", {{"content", "<s>"}, {"lstrip", false}}},
    {"eos_token", "</s>"},
    {"chat_template",
     json::array({{{"name", "default"}, {"template", "{{ bos_token }}d{{ eos_token }}"}},
                  {{"name", "tool_use"}, {"template", "t{{ tools | length }}"}}})}};
  write("tokenizer_config.json", config.dump());
  auto messages = json::array({{{"role", "user"}, {"content", "hi"}}});
  auto tmpl = chat_template::of_model(d.string(), nullptr);
  REQUIRE(tmpl);
  CHECK(tmpl->render(messages) == "<s>d</s>");
  CHECK(tmpl->render(messages, json::array({json::object()})) == "t1");
  // The caller's variables win over the file's tokens, as transformers' kwargs do.
  CHECK(tmpl->render(messages, nullptr, {{"bos_token", "B"}}) == "Bd</s>");
  write("chat_template.jinja", "{{ messages[0].content | upper }}");
  CHECK(chat_template::of_model(d.string(), nullptr)->render(messages) == "HI");
  // A template outside the subset is reported when rendered, not when the model loads.
  write("chat_template.jinja", "{% include 'other.jinja' %}");
  auto unsupported = chat_template::of_model(d.string(), nullptr);
  REQUIRE(unsupported);
  CHECK_THROWS_WITH_AS(unsupported->render(messages), doctest::Contains("'include'"), error);
  CHECK_THROWS_WITH_AS(tmpl->render(json::array()), doctest::Contains("at least one message"),
                       error);
  fs::remove_all(d);
}
