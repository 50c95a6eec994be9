#pragma once

/// @file
/// OpenAI's request and response shapes for completions and chat completions.

#include "troupe/engine_loop.hpp"
#include "troupe/llm.hpp"

#include <nlohmann/json.hpp>

#include <optional>
#include <stdexcept>
#include <string>

namespace troupe {

/// `j` as JSON text; bytes that are not UTF-8 (a client's raw path, a token's partial
/// character) become U+FFFD instead of an exception.
std::string dumped(const nlohmann::json& j);

/// A request the server refuses: the HTTP status and OpenAI's error object.
struct http_error : std::runtime_error {
  http_error(int status, std::string type, const std::string& message, std::string param = {})
    : std::runtime_error(message), status(status), type(std::move(type)), param(std::move(param)) {}
  int status;
  std::string type;
  std::string param;

  /// `{"error": {"message", "type", "param", "code"}}`.
  std::string body() const;
};

/// The http_error of an error from the engine or the executor: the client's own mistakes
/// are 400, a sleeping model 503, the rest 500.
http_error from_engine(errc code, const std::string& message);

/// The http_error of a request the engine's loop refused or ended: 429 beyond its
/// capacity, 503 when the engine failed or stopped, 409 / 404 for an unloaded adapter.
http_error from_engine(const request_failure& f);

/// A request body that must be a JSON object; throws `http_error` (400) naming what is
/// wrong.
nlohmann::json parse_json_object(const std::string& body);

/// A completion or chat completion request.
struct openai_request {
  bool chat = false;
  /// The weights' version it ran on (SGLang's `weight_version`; the server sets it).
  int64_t weight_version = 0;
  std::string model;
  /// The prompt (text or token ids; a chat's messages rendered by the server) and how to
  /// sample; `lora` is set by the server from `model`.
  generation_request generation;
  /// A chat's messages, tools and `chat_template_kwargs`, for the model's template.
  chat_request conversation;
  /// `max_tokens` (`max_completion_tokens`) as given: a chat without it may fill the model's
  /// length; a completion's default is OpenAI's 16. The server checks it against the
  /// prompt's length and sets `generation.sampling.max_tokens`.
  std::optional<int32_t> max_tokens;
  bool stream = false;
  bool include_usage = false;
  /// Whether the response carries logprobs, and how many alternatives at each token.
  bool logprobs = false;
  int32_t top_logprobs = 0;
  /// Whether the response carries the prompt's logprobs (`prompt_logprobs`).
  bool prompt_logprobs = false;
};

/// Parses a request body. Throws `http_error` (400) naming the field for bad JSON, a field
/// of the wrong type or out of its type's range (an integer that does not fit, a number
/// that is not finite as a float), or what the engine does not do (a field it does not
/// know, `best_of` above `n` in a stream).
openai_request parse_openai_request(const std::string& body, bool chat);

/// What a finished or streaming request sends, given its id and creation time.
class openai_response {
public:
  openai_response(const openai_request& req, std::string id, int64_t created, const llm& model);

  /// The whole response of a request that did not stream: a choice for each sample.
  std::string complete(const std::vector<generation_output>& outs) const;

  /// The server-sent event of an update (empty when it adds nothing to say), for the
  /// choice of its sample; the first of each chat choice names the assistant's role.
  std::string chunk(const generation_update& update);

  /// The last events, once every sample is done: the usage chunk when asked for, then
  /// `[DONE]`.
  std::string end(const std::vector<generation_output>& outs) const;

private:
  nlohmann::json logprobs_of(const std::vector<int32_t>& ids, const std::vector<float>& logprobs,
                             const std::vector<std::vector<token_logprob>>& top,
                             size_t text_offset) const;
  nlohmann::json usage(const std::vector<generation_output>& outs) const;
  /// vLLM's `prompt_logprobs` list of the prompt's positions.
  nlohmann::json prompt_logprobs_of(const std::vector<prompt_logprob>& entries) const;
  nlohmann::json envelope(bool streaming) const;

  const openai_request& req_;
  std::string id_;
  int64_t created_;
  const llm& model_;
  /// Per sample: whether a chat's role went out, and the bytes of text sent.
  std::vector<bool> role_sent_;
  std::vector<size_t> text_sent_;
};

} // namespace troupe
