#include "server/openai.hpp"

#include "troupe/errors.hpp"

#include <cmath>
#include <limits>
#include <set>

namespace troupe {

using nlohmann::json;

std::string dumped(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string http_error::body() const {
  json e = {{"message", what()}, {"type", type}, {"code", status}};
  e["param"] = param.empty() ? json(nullptr) : json(param);
  return dumped(json{{"error", e}});
}

http_error from_engine(errc code, const std::string& message) {
  switch (code) {
  case errc::invalid_argument:
  case errc::unsupported:
  case errc::unknown_method:
  case errc::bad_arguments:
  case errc::remote_callable:
    return {400, "invalid_request_error", message};
  case errc::sleeping:
    return {503, "server_error", message};
  default:
    return {500, "server_error", message};
  }
}

http_error from_engine(const request_failure& f) {
  switch (f.kind) {
  case request_failure_kind::engine_error:
    return from_engine(f.code, f.what());
  case request_failure_kind::overloaded:
    return {429, "rate_limit_error", f.what()};
  case request_failure_kind::adapter_unloaded:
    return {409, "invalid_request_error", f.what(), "model"};
  case request_failure_kind::adapter_missing:
    return {404, "not_found_error", f.what(), "model"};
  case request_failure_kind::engine_failed:
  case request_failure_kind::stopped:
    return {503, "server_error", f.what()};
  case request_failure_kind::internal:
    break;
  }
  return {500, "server_error", f.what()};
}

namespace {

[[noreturn]] void bad(const std::string& message, const std::string& param = {}) {
  throw http_error{400, "invalid_request_error", message, param};
}

/// `body[key]` as a T when present and not null; refuses another type, an integer out of
/// T's range and a number that is not finite as a T (1e308 as a float).
template <class T, class Json>
std::optional<T> field(const Json& body, const char* key, const char* what) {
  auto at = body.find(key);
  if (at == body.end() || at->is_null())
    return std::nullopt;
  auto wrong = [&] { bad(std::string{"'"} + key + "' must be " + what, key); };
  if constexpr (std::is_same_v<T, bool>) {
    if (!at->is_boolean())
      wrong();
  } else if constexpr (std::is_integral_v<T>) {
    if (!at->is_number_integer())
      wrong();
    bool fits =
      at->is_number_unsigned()
        ? at->template get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
        : at->template get<int64_t>() >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
            at->template get<int64_t>() <= static_cast<int64_t>(std::numeric_limits<T>::max());
    if (!fits)
      bad(std::string{"'"} + key + "' is out of range: " + at->dump(), key);
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!at->is_number())
      wrong();
    // Compared as a double: a cast of a value beyond T's range is undefined.
    if (!(std::fabs(at->template get<double>()) <=
          static_cast<double>(std::numeric_limits<T>::max())))
      bad(std::string{"'"} + key + "' is out of range: " + at->dump(), key);
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!at->is_string())
      wrong();
  }
  return at->template get<T>();
}

/// The UTF-8 bytes of a token's text, as OpenAI lists them (0..255).
std::vector<int> bytes_of(const std::string& text) {
  std::vector<int> bytes;
  for (unsigned char c : text)
    bytes.push_back(c);
  return bytes;
}

template <class Json>
std::vector<int32_t> token_ids(const Json& array, const char* key) {
  std::vector<int32_t> ids;
  for (auto& t : array) {
    if (!t.is_number_integer() || t.template get<int64_t>() < 0 ||
        t.template get<int64_t>() > INT32_MAX)
      bad(std::string{"'"} + key + "' holds a token id that is not a non-negative integer", key);
    ids.push_back(t.template get<int32_t>());
  }
  if (ids.empty())
    bad(std::string{"'"} + key + "' is empty", key);
  return ids;
}

/// A request body, refused unless it is a JSON object.
template <class Json>
Json parse_object(const std::string& text) {
  Json body;
  try {
    body = Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    bad(std::string{"the body is not JSON: "} + e.what());
  }
  if (!body.is_object())
    bad("the body must be a JSON object");
  return body;
}

} // namespace

json parse_json_object(const std::string& text) {
  return parse_object<json>(text);
}

namespace {

/// OpenAI's response_format and vLLM's guided_json, guided_choice, guided_regex and
/// structured_outputs (json, choice, regex, json_object), into `sp`; at most one of them.
void structured_output_of(const nlohmann::ordered_json& body, sampling_params& sp) {
  int given = 0;
  auto schema_text = [&](const nlohmann::ordered_json& schema, const char* field) {
    if (schema.is_string())
      return schema.get<std::string>();
    if (!schema.is_object() && !schema.is_boolean())
      bad("'" + std::string{field} + "' must be a JSON schema (an object, or its text)", field);
    return schema.dump();
  };
  auto choices = [&](const nlohmann::ordered_json& list, const char* field) {
    if (!list.is_array() || list.empty())
      bad("'" + std::string{field} + "' must be a non-empty array of strings", field);
    std::vector<std::string> out;
    for (auto& c : list) {
      if (!c.is_string())
        bad("'" + std::string{field} + "' must be a non-empty array of strings", field);
      out.push_back(c.get<std::string>());
    }
    return out;
  };
  if (auto f = body.find("response_format"); f != body.end() && !f->is_null()) {
    if (!f->is_object() || !f->contains("type") || !(*f)["type"].is_string())
      bad("'response_format' must be an object with a 'type'", "response_format");
    auto type = (*f)["type"].get<std::string>();
    if (type == "json_object") {
      sp.guided_json_object = true;
      ++given;
    } else if (type == "json_schema") {
      auto& spec = (*f)["json_schema"];
      if (!spec.is_object() || !spec.contains("schema"))
        bad("'response_format' of type json_schema needs 'json_schema.schema'", "response_format");
      sp.guided_json = schema_text(spec["schema"], "response_format");
      ++given;
    } else if (type != "text") {
      bad("'response_format' type '" + type +
            "' is not supported (text, json_object, "
            "json_schema)",
          "response_format");
    }
  }
  if (auto f = body.find("guided_json"); f != body.end() && !f->is_null()) {
    sp.guided_json = schema_text(*f, "guided_json");
    ++given;
  }
  if (auto f = body.find("guided_choice"); f != body.end() && !f->is_null()) {
    sp.guided_choice = choices(*f, "guided_choice");
    ++given;
  }
  auto regex = [&](const nlohmann::ordered_json& value, const char* field) {
    if (!value.is_string() || value.get<std::string>().empty())
      bad("'" + std::string{field} + "' must be a non-empty regular expression", field);
    return value.get<std::string>();
  };
  if (auto f = body.find("guided_regex"); f != body.end() && !f->is_null()) {
    sp.guided_regex = regex(*f, "guided_regex");
    ++given;
  }
  if (auto f = body.find("structured_outputs"); f != body.end() && !f->is_null()) {
    if (!f->is_object())
      bad("'structured_outputs' must be an object", "structured_outputs");
    for (auto& [key, value] : f->items()) {
      if (value.is_null())
        continue;
      if (key == "json")
        sp.guided_json = schema_text(value, "structured_outputs");
      else if (key == "choice")
        sp.guided_choice = choices(value, "structured_outputs");
      else if (key == "json_object" && value.is_boolean())
        sp.guided_json_object = value.get<bool>();
      else if (key == "regex")
        sp.guided_regex = regex(value, "structured_outputs");
      else
        bad("'structured_outputs." + key + "' is not supported (json, choice, regex, json_object)",
            "structured_outputs");
      ++given;
    }
  }
  if (given > 1)
    bad("response_format, guided_json, guided_choice, guided_regex and structured_outputs "
        "exclude each other",
        "response_format");
}

} // namespace

openai_request parse_openai_request(const std::string& text, bool chat) {
  // In the client's order of keys: a schema's properties are generated in it, and a
  // template renders messages and tools as they were written.
  auto body = parse_object<nlohmann::ordered_json>(text);
  // A field troupe would not act on is refused, never ignored.
  static const std::set<std::string> shared = {"model",
                                               "max_tokens",
                                               "temperature",
                                               "top_p",
                                               "top_k",
                                               "seed",
                                               "ignore_eos",
                                               "n",
                                               "stop",
                                               "stop_token_ids",
                                               "stream",
                                               "stream_options",
                                               "logprobs",
                                               "repetition_penalty",
                                               "presence_penalty",
                                               "frequency_penalty",
                                               "min_p",
                                               "min_tokens",
                                               "logit_bias",
                                               "bad_words",
                                               "prompt_logprobs",
                                               "response_format",
                                               "guided_json",
                                               "guided_choice",
                                               "guided_regex",
                                               "structured_outputs"};
  static const std::set<std::string> completion_only = {"prompt", "echo", "best_of"};
  static const std::set<std::string> chat_only = {
    "messages",    "max_completion_tokens", "top_logprobs",         "tools",
    "tool_choice", "chat_template_kwargs",  "add_generation_prompt"};
  for (auto& [key, value] : body.items())
    if (!shared.count(key) && !(chat ? chat_only : completion_only).count(key))
      bad("'" + key + "' is not supported", key);
  openai_request req;
  req.chat = chat;
  req.model = field<std::string>(body, "model", "a string").value_or("");
  auto& g = req.generation;
  auto& sp = g.sampling;
  if (chat) {
    auto messages = body.find("messages");
    if (messages == body.end() || !messages->is_array() || messages->empty())
      bad("'messages' must be a non-empty array", "messages");
    // Each message goes to the template as given (tool calls, tool_call_id, name...), its
    // content parts joined into one text.
    auto conversation = nlohmann::ordered_json::array();
    for (auto m : *messages) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
        bad("each message needs a string 'role'", "messages");
      auto& content = m["content"];
      if (content.is_array()) {
        std::string text;
        for (auto& part : content) {
          if (!part.is_object() || !part.contains("type") || part["type"] != "text" ||
              !part.contains("text") || !part["text"].is_string())
            bad("only text message parts are supported", "messages");
          text += part["text"].get<std::string>();
        }
        content = text;
      } else if (!content.is_string() && !content.is_null()) {
        bad("a message's 'content' must be a string or an array of text parts", "messages");
      }
      conversation.push_back(std::move(m));
    }
    req.conversation.messages_json = conversation.dump();
    if (auto tools = body.find("tools"); tools != body.end() && !tools->is_null()) {
      if (!tools->is_array())
        bad("'tools' must be an array of tool definitions", "tools");
      for (auto& t : *tools)
        if (!t.is_object())
          bad("'tools' must be an array of tool definitions", "tools");
      req.conversation.tools_json = tools->dump();
    }
    if (auto kwargs = body.find("chat_template_kwargs");
        kwargs != body.end() && !kwargs->is_null()) {
      if (!kwargs->is_object())
        bad("'chat_template_kwargs' must be an object", "chat_template_kwargs");
      req.conversation.variables_json = kwargs->dump();
    }
    req.conversation.add_generation_prompt =
      field<bool>(body, "add_generation_prompt", "a boolean").value_or(true);
    // The tools go into the prompt; the model decides whether to call one.
    if (auto choice = field<std::string>(body, "tool_choice", "a string");
        choice && *choice != "auto")
      bad("'tool_choice' must be \"auto\": the tools are shown to the model, which decides",
          "tool_choice");
    req.logprobs = field<bool>(body, "logprobs", "a boolean").value_or(false);
    req.top_logprobs = field<int32_t>(body, "top_logprobs", "an integer").value_or(0);
    req.max_tokens = field<int32_t>(body, "max_completion_tokens", "an integer");
    if (!req.max_tokens)
      req.max_tokens = field<int32_t>(body, "max_tokens", "an integer");
  } else {
    auto prompt = body.find("prompt");
    if (prompt == body.end())
      bad("'prompt' is required", "prompt");
    if (prompt->is_string()) {
      g.prompt = prompt->get<std::string>();
    } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_number()) {
      g.prompt_token_ids = token_ids(*prompt, "prompt");
    } else if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) {
      g.prompt = (*prompt)[0].get<std::string>();
    } else if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_array()) {
      g.prompt_token_ids = token_ids((*prompt)[0], "prompt");
    } else {
      bad("'prompt' must be a string, an array of token ids, or one of those in an array "
          "(one prompt per request)",
          "prompt");
    }
    if (auto n = field<int32_t>(body, "logprobs", "an integer")) {
      if (*n < 0)
        bad("'logprobs' must be 0 or more", "logprobs");
      req.logprobs = true;
      req.top_logprobs = *n;
    }
    req.max_tokens = field<int32_t>(body, "max_tokens", "an integer").value_or(16);
    if (field<bool>(body, "echo", "a boolean").value_or(false))
      bad("'echo' is not supported", "echo");
  }
  if (req.top_logprobs < 0 || req.top_logprobs > 20)
    bad("'top_logprobs' must be between 0 and 20", "top_logprobs");
  sp.logprobs = req.logprobs ? req.top_logprobs : 0;
  if (req.max_tokens && *req.max_tokens < 1)
    bad("'max_tokens' must be at least 1", "max_tokens");
  sp.temperature = field<float>(body, "temperature", "a number").value_or(1.0f);
  if (sp.temperature < 0)
    bad("'temperature' must be 0 or more", "temperature");
  sp.top_p = field<float>(body, "top_p", "a number").value_or(1.0f);
  if (!(sp.top_p > 0 && sp.top_p <= 1))
    bad("'top_p' must be in (0, 1]", "top_p");
  sp.top_k = field<int32_t>(body, "top_k", "an integer").value_or(-1);
  if (sp.top_k == 0 || sp.top_k < -1)
    bad("'top_k' must be -1 (off) or at least 1", "top_k");
  sp.seed = field<int64_t>(body, "seed", "an integer").value_or(-1);
  sp.ignore_eos = field<bool>(body, "ignore_eos", "a boolean").value_or(false);
  sp.n = field<int32_t>(body, "n", "an integer").value_or(1);
  if (sp.n < 1)
    bad("'n' must be at least 1", "n");
  if (auto best_of = field<int32_t>(body, "best_of", "an integer")) {
    if (*best_of < sp.n)
      bad("'best_of' must be at least 'n' (" + std::to_string(sp.n) + ")", "best_of");
    sp.best_of = *best_of;
  }
  if (auto ids = body.find("stop_token_ids"); ids != body.end() && !ids->is_null()) {
    if (!ids->is_array())
      bad("'stop_token_ids' must be an array of token ids", "stop_token_ids");
    sp.stop_token_ids = token_ids(*ids, "stop_token_ids");
  }
  if (auto stop = body.find("stop"); stop != body.end() && !stop->is_null()) {
    if (stop->is_string()) {
      g.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (auto& s : *stop) {
        if (!s.is_string())
          bad("'stop' must be a string or an array of strings", "stop");
        g.stop.push_back(s.get<std::string>());
      }
    } else {
      bad("'stop' must be a string or an array of strings", "stop");
    }
  }
  sp.repetition_penalty = field<float>(body, "repetition_penalty", "a number").value_or(1.0f);
  sp.presence_penalty = field<float>(body, "presence_penalty", "a number").value_or(0.0f);
  sp.frequency_penalty = field<float>(body, "frequency_penalty", "a number").value_or(0.0f);
  sp.min_p = field<float>(body, "min_p", "a number").value_or(0.0f);
  sp.min_tokens = field<int32_t>(body, "min_tokens", "an integer").value_or(0);
  if (auto bias = body.find("logit_bias"); bias != body.end() && !bias->is_null()) {
    if (!bias->is_object())
      bad("'logit_bias' must be an object of token ids and biases", "logit_bias");
    for (auto& [key, value] : bias->items()) {
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != key.size() || id < 0 || id > INT32_MAX)
        bad("'logit_bias' keys must be token ids, not '" + key + "'", "logit_bias");
      if (!value.is_number() || !(value.get<double>() >= -100 && value.get<double>() <= 100))
        bad("'logit_bias' values must be numbers in [-100, 100]", "logit_bias");
      sp.logit_bias_ids.push_back(static_cast<int32_t>(id));
      sp.logit_bias_values.push_back(value.get<float>());
    }
  }
  if (auto n = field<int32_t>(body, "prompt_logprobs", "an integer")) {
    if (*n < 0 || *n > 20)
      bad("'prompt_logprobs' must be between 0 and 20", "prompt_logprobs");
    sp.prompt_logprobs = *n;
    req.prompt_logprobs = true;
  }
  structured_output_of(body, sp);
  if (auto words = body.find("bad_words"); words != body.end() && !words->is_null()) {
    if (!words->is_array())
      bad("'bad_words' must be an array of strings", "bad_words");
    for (auto& w : *words) {
      if (!w.is_string())
        bad("'bad_words' must be an array of strings", "bad_words");
      sp.bad_words.push_back(w.get<std::string>());
    }
  }
  try {
    validate(sp);
  } catch (const error& e) {
    // Each of validate's messages starts with the parameter's name.
    std::string message = e.what();
    bad(message, message.substr(0, message.find(' ')));
  }
  req.stream = field<bool>(body, "stream", "a boolean").value_or(false);
  if (auto opts = body.find("stream_options"); opts != body.end() && !opts->is_null()) {
    if (!opts->is_object())
      bad("'stream_options' must be an object", "stream_options");
    req.include_usage = field<bool>(*opts, "include_usage", "a boolean").value_or(false);
  }
  if (req.stream && sp.best_of > sp.n)
    bad("'best_of' above 'n' cannot stream: the best samples are known only at the end", "best_of");
  return req;
}

openai_response::openai_response(const openai_request& req, std::string id, int64_t created,
                                 const llm& model)
  : req_(req), id_(std::move(id)), created_(created), model_(model),
    role_sent_(static_cast<size_t>(req.generation.sampling.n), false),
    text_sent_(static_cast<size_t>(req.generation.sampling.n), 0) {}

json openai_response::envelope(bool streaming) const {
  return {{"id", id_},
          {"object", req_.chat ? (streaming ? "chat.completion.chunk" : "chat.completion")
                               : "text_completion"},
          {"created", created_},
          {"model", req_.model},
          {"weight_version", req_.weight_version}};
}

json openai_response::usage(const std::vector<generation_output>& outs) const {
  // The prompt once, every sample's tokens.
  auto prompt = outs.empty() ? int64_t{0} : static_cast<int64_t>(outs[0].prompt_token_ids.size());
  int64_t completion = 0;
  for (auto& out : outs)
    completion += static_cast<int64_t>(out.token_ids.size());
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion}};
}

json openai_response::logprobs_of(const std::vector<int32_t>& ids,
                                  const std::vector<float>& logprobs,
                                  const std::vector<std::vector<token_logprob>>& top,
                                  size_t text_offset) const {
  auto text = [&](int32_t id) { return model_.decode({id}); };
  if (req_.chat) {
    json content = json::array();
    for (size_t i = 0; i < ids.size(); ++i) {
      auto t = text(ids[i]);
      json alternatives = json::array();
      if (i < top.size())
        for (auto& alt : top[i]) {
          auto a = text(alt.token);
          alternatives.push_back({{"token", a}, {"logprob", alt.logprob}, {"bytes", bytes_of(a)}});
        }
      content.push_back({{"token", t},
                         {"logprob", logprobs[i]},
                         {"bytes", bytes_of(t)},
                         {"top_logprobs", alternatives}});
    }
    return {{"content", content}};
  }
  json tokens = json::array(), token_logprobs = json::array(), tops = json::array(),
       offsets = json::array();
  for (size_t i = 0; i < ids.size(); ++i) {
    auto t = text(ids[i]);
    tokens.push_back(t);
    token_logprobs.push_back(logprobs[i]);
    json alternatives = json::object();
    if (i < top.size())
      for (auto& alt : top[i])
        alternatives[text(alt.token)] = alt.logprob;
    tops.push_back(alternatives);
    offsets.push_back(text_offset);
    text_offset += t.size();
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", tops},
          {"text_offset", offsets}};
}

json openai_response::prompt_logprobs_of(const std::vector<prompt_logprob>& entries) const {
  // vLLM's form: null for the first token, then per position the prompt's token and the
  // most likely ones by id, each with its logprob, rank and text.
  json list = json::array({nullptr});
  auto entry = [&](int32_t token, float logprob, int32_t rank) {
    json e = {{"logprob", logprob}, {"rank", rank}};
    if (model_.has_tokenizer())
      e["decoded_token"] = model_.decode({token});
    return e;
  };
  for (auto& p : entries) {
    json at = json::object();
    at[std::to_string(p.token)] = entry(p.token, p.logprob, p.rank);
    for (size_t i = 0; i < p.top_logprobs.size(); ++i) {
      auto& t = p.top_logprobs[i];
      at[std::to_string(t.token)] = entry(t.token, t.logprob, static_cast<int32_t>(i) + 1);
    }
    list.push_back(std::move(at));
  }
  return list;
}

std::string openai_response::complete(const std::vector<generation_output>& outs) const {
  auto body = envelope(false);
  body["choices"] = json::array();
  if (req_.prompt_logprobs && req_.chat && !outs.empty())
    body["prompt_logprobs"] = prompt_logprobs_of(outs[0].prompt_logprobs);
  for (auto& out : outs) {
    json choice = {{"index", out.index}, {"finish_reason", to_string(out.finish_reason)}};
    if (req_.prompt_logprobs && !req_.chat)
      choice["prompt_logprobs"] = prompt_logprobs_of(out.prompt_logprobs);
    choice["logprobs"] =
      req_.logprobs ? logprobs_of(out.token_ids, out.logprobs, out.top_logprobs, 0) : json(nullptr);
    if (req_.chat)
      choice["message"] = {{"role", "assistant"}, {"content", out.text}};
    else
      choice["text"] = out.text;
    choice["token_ids"] = out.token_ids; // vLLM's extension: what a model without text gave
    body["choices"].push_back(choice);
  }
  body["usage"] = usage(outs);
  return dumped(body);
}

std::string openai_response::chunk(const generation_update& u) {
  std::string events;
  auto event = [&](const json& j) { events += "data: " + dumped(j) + "\n\n"; };
  auto index = static_cast<size_t>(u.index);
  if (req_.chat && !role_sent_.at(index)) {
    role_sent_[index] = true;
    auto first = envelope(true);
    first["choices"] = json::array({{{"index", u.index},
                                     {"delta", {{"role", "assistant"}, {"content", ""}}},
                                     {"logprobs", nullptr},
                                     {"finish_reason", nullptr}}});
    event(first);
  }
  auto& text = u.text;
  auto& sent = text_sent_.at(index);
  sent += text.size();
  if (text.empty() && u.token_ids.empty() && !u.finished)
    return events;
  auto body = envelope(true);
  json choice = {{"index", u.index}};
  if (req_.chat)
    choice["delta"] = text.empty() ? json::object() : json{{"content", text}};
  else
    choice["text"] = text;
  choice["logprobs"] = req_.logprobs
                         ? logprobs_of(u.token_ids, u.logprobs, u.top_logprobs, sent - text.size())
                         : json(nullptr);
  choice["token_ids"] = u.token_ids;
  choice["finish_reason"] = u.finished ? json(to_string(u.output->finish_reason)) : json(nullptr);
  // With the first token, as vLLM streams them.
  if (req_.prompt_logprobs && !u.prompt_logprobs.empty()) {
    if (req_.chat)
      body["prompt_logprobs"] = prompt_logprobs_of(u.prompt_logprobs);
    else
      choice["prompt_logprobs"] = prompt_logprobs_of(u.prompt_logprobs);
  }
  body["choices"] = json::array({choice});
  if (req_.include_usage)
    body["usage"] = nullptr;
  event(body);
  return events;
}

std::string openai_response::end(const std::vector<generation_output>& outs) const {
  std::string events;
  if (req_.include_usage) {
    auto body = envelope(true);
    body["choices"] = json::array();
    body["usage"] = usage(outs);
    events += "data: " + dumped(body) + "\n\n";
  }
  return events + "data: [DONE]\n\n";
}

} // namespace troupe
