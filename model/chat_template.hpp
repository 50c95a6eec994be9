#pragma once

#include "model/jinja.hpp"

#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>

namespace troupe {

class tokenizer;

/// A model's chat template and what its files give the template besides the conversation
/// (the texts of its BOS and EOS tokens), rendered as transformers' `apply_chat_template`
/// renders it.
class chat_template {
public:
  /// The template of a model: a GGUF file's `tokenizer.chat_template` (and
  /// `tokenizer.chat_template.tool_use`); a Hugging Face directory's `chat_template.jinja`,
  /// else `tokenizer_config.json`'s `chat_template` (a text, or a list of named templates:
  /// `default` and `tool_use`). `source`, when not empty, replaces the model's. BOS and EOS
  /// come from `tokenizer_config.json`, else from `tok`'s special tokens. None when there
  /// is no template. A template outside the interpreter's subset is kept as the error a
  /// render throws, so that a model without a usable template still completes prompts.
  static std::optional<chat_template> of_model(const std::string& path, const tokenizer* tok,
                                               const std::string& source = {});

  /// A template from its text, with the BOS and EOS texts (null when the model has none).
  chat_template(const std::string& source, nlohmann::ordered_json bos_token,
                nlohmann::ordered_json eos_token, const std::string& tool_use_source = {});

  /// The prompt of a conversation: `messages` (an array of objects with `role` and
  /// `content`, and whatever else the template reads: `tool_calls`, `tool_call_id`...),
  /// `tools` (an array of JSON schemas, or null: then the `tool_use` template, when the
  /// model has one) and `variables` (an object of extra variables, as vLLM's
  /// `chat_template_kwargs`: `enable_thinking`, `date_string`...). Throws `invalid_argument`
  /// with the template's own message when it refuses the conversation, `unsupported` when
  /// the template is outside the subset.
  std::string render(const nlohmann::ordered_json& messages,
                     const nlohmann::ordered_json& tools = nullptr,
                     const nlohmann::ordered_json& variables = nlohmann::ordered_json::object(),
                     bool add_generation_prompt = true) const;

private:
  struct parsed {
    std::optional<jinja_template> program;
    std::string problem; // why it could not be parsed
  };
  static parsed parse(const std::string& source);

  parsed default_;
  std::optional<parsed> tool_use_;
  nlohmann::ordered_json bos_;
  nlohmann::ordered_json eos_;
};

} // namespace troupe
