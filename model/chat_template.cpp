#include "model/chat_template.hpp"

#include "model/checkpoint.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"
#include "troupe/errors.hpp"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace troupe {

namespace {

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in{path};
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A special token as tokenizer_config.json writes it: a text, or an object with `content`.
nlohmann::ordered_json token_text(const nlohmann::ordered_json& config, const char* key) {
  auto at = config.find(key);
  if (at == config.end())
    return nullptr;
  if (at->is_string())
    return *at;
  if (at->is_object() && at->contains("content") && (*at)["content"].is_string())
    return (*at)["content"];
  return nullptr;
}

} // namespace

chat_template::parsed chat_template::parse(const std::string& source) {
  parsed p;
  try {
    p.program.emplace(source);
  } catch (const error& e) {
    p.problem = e.what();
  }
  return p;
}

chat_template::chat_template(const std::string& source, nlohmann::ordered_json bos_token,
                             nlohmann::ordered_json eos_token, const std::string& tool_use_source)
  : default_(parse(source)), bos_(std::move(bos_token)), eos_(std::move(eos_token)) {
  if (!tool_use_source.empty())
    tool_use_ = parse(tool_use_source);
}

std::optional<chat_template> chat_template::of_model(const std::string& path, const tokenizer* tok,
                                                     const std::string& source) {
  namespace fs = std::filesystem;
  std::string text;
  std::string tool_use;
  nlohmann::ordered_json bos = nullptr;
  nlohmann::ordered_json eos = nullptr;
  if (tok) {
    if (tok->bos_id() >= 0)
      bos = tok->token_text(tok->bos_id());
    if (tok->eos_id() >= 0)
      eos = tok->token_text(tok->eos_id());
  }
  if (checkpoint::is_gguf(path)) {
    gguf_file file{path};
    if (auto s = file.find<std::string>("tokenizer.chat_template"))
      text = *s;
    if (auto s = file.find<std::string>("tokenizer.chat_template.tool_use"))
      tool_use = *s;
  } else if (fs::is_directory(path)) {
    auto config_path = fs::path{path} / "tokenizer_config.json";
    if (fs::exists(config_path)) {
      nlohmann::ordered_json config;
      try {
        config = nlohmann::ordered_json::parse(read_text(config_path));
      } catch (const nlohmann::json::exception& e) {
        throw error{errc::invalid_argument, config_path.string() + ": " + e.what()};
      }
      if (auto b = token_text(config, "bos_token"); !b.is_null())
        bos = b;
      if (auto e = token_text(config, "eos_token"); !e.is_null())
        eos = e;
      auto at = config.find("chat_template");
      if (at != config.end() && at->is_string()) {
        text = at->get<std::string>();
      } else if (at != config.end() && at->is_array()) {
        for (auto& named : *at) {
          if (!named.is_object() || !named.contains("name") || !named.contains("template"))
            continue;
          if (named["name"] == "default")
            text = named["template"].get<std::string>();
          else if (named["name"] == "tool_use")
            tool_use = named["template"].get<std::string>();
        }
      }
    }
    auto jinja = fs::path{path} / "chat_template.jinja";
    if (fs::exists(jinja))
      text = read_text(jinja);
  }
  if (!source.empty()) {
    text = source;
    tool_use.clear();
  }
  if (text.empty())
    return std::nullopt;
  return chat_template{text, bos, eos, tool_use};
}

std::string chat_template::render(const nlohmann::ordered_json& messages,
                                  const nlohmann::ordered_json& tools,
                                  const nlohmann::ordered_json& variables,
                                  bool add_generation_prompt) const {
  if (!messages.is_array() || messages.empty())
    throw error{errc::invalid_argument, "a chat needs at least one message"};
  for (auto& m : messages)
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw error{errc::invalid_argument, "each chat message needs a string 'role'"};
  if (!tools.is_null() && !tools.is_array())
    throw error{errc::invalid_argument, "'tools' must be an array of tool schemas"};
  if (!variables.is_object())
    throw error{errc::invalid_argument, "the chat template's variables must be an object"};
  const auto& chosen = !tools.is_null() && tool_use_ ? *tool_use_ : default_;
  if (!chosen.program)
    throw error{errc::unsupported,
                "the model's chat template cannot be rendered: " + chosen.problem};
  // What transformers passes: the special tokens, the caller's variables over them, then
  // the conversation.
  nlohmann::ordered_json context = {{"bos_token", bos_}, {"eos_token", eos_}};
  for (auto& [k, v] : variables.items())
    context[k] = v;
  context["messages"] = messages;
  context["tools"] = tools;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = add_generation_prompt;
  return chosen.program->render(context);
}

} // namespace troupe
