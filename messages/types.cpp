#include "troupe/types.hpp"

#include "troupe/errors.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

namespace troupe {

namespace {

/// The most samples one request may ask for.
constexpr int32_t max_samples = 1024;

} // namespace

bool reads_history(const sampling_params& params) {
  return params.repetition_penalty != 1.0f || params.presence_penalty != 0.0f ||
         params.frequency_penalty != 0.0f || params.min_tokens > 0 ||
         std::any_of(params.bad_words_token_ids.begin(), params.bad_words_token_ids.end(),
                     [](const std::vector<int32_t>& w) { return w.size() > 1; });
}

bool guided(const sampling_params& p) {
  return !p.guided_json.empty() || p.guided_json_object || !p.guided_choice.empty() ||
         !p.guided_regex.empty();
}

void validate(const sampling_params& params, int64_t vocab) {
  auto bad = [](const std::string& what) { throw error{errc::invalid_argument, what}; };
  // Written so that NaN fails too.
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f))
    bad("top_p must be in (0, 1], got " + std::to_string(params.top_p));
  if (!(params.temperature >= 0.0f))
    bad("temperature must be >= 0, got " + std::to_string(params.temperature));
  if (!(params.repetition_penalty > 0.0f) || std::isinf(params.repetition_penalty))
    bad("repetition_penalty must be > 0, got " + std::to_string(params.repetition_penalty));
  for (auto [name, v] : {std::pair{"presence_penalty", params.presence_penalty},
                         std::pair{"frequency_penalty", params.frequency_penalty}})
    if (!(v >= -2.0f && v <= 2.0f))
      bad(std::string{name} + " must be in [-2, 2], got " + std::to_string(v));
  if (!(params.min_p >= 0.0f && params.min_p <= 1.0f))
    bad("min_p must be in [0, 1], got " + std::to_string(params.min_p));
  if (params.min_tokens < 0)
    bad("min_tokens must be >= 0, got " + std::to_string(params.min_tokens));
  if (params.n < 1 || params.n > max_samples)
    bad("n must be in [1, " + std::to_string(max_samples) + "], got " + std::to_string(params.n));
  if (params.best_of != 0 && (params.best_of < params.n || params.best_of > max_samples))
    bad("best_of must be at least n (" + std::to_string(params.n) + ") and at most " +
        std::to_string(max_samples) + ", got " + std::to_string(params.best_of));
  if (params.logit_bias_ids.size() != params.logit_bias_values.size())
    bad("logit_bias has " + std::to_string(params.logit_bias_ids.size()) + " token ids for " +
        std::to_string(params.logit_bias_values.size()) + " biases");
  for (size_t i = 0; i < params.logit_bias_ids.size(); ++i) {
    auto id = params.logit_bias_ids[i];
    if (id < 0 || (vocab > 0 && id >= vocab))
      bad("logit_bias names token " + std::to_string(id) + ", outside the vocabulary" +
          (vocab > 0 ? " of " + std::to_string(vocab) : std::string{}));
    if (!std::isfinite(params.logit_bias_values[i]))
      bad("logit_bias of token " + std::to_string(id) + " is not a finite number");
  }
  // A token's bias once, as in OpenAI's map of them.
  std::vector<int32_t> biased = params.logit_bias_ids;
  std::sort(biased.begin(), biased.end());
  if (auto twice = std::adjacent_find(biased.begin(), biased.end()); twice != biased.end())
    bad("logit_bias names token " + std::to_string(*twice) + " twice");
  if (params.prompt_logprobs < -1 || params.prompt_logprobs > 20)
    bad("prompt_logprobs must be -1 (none) or between 0 and 20, got " +
        std::to_string(params.prompt_logprobs));
  for (auto& word : params.bad_words)
    if (word.empty())
      bad("bad_words holds an empty word");
  for (auto& ids : params.bad_words_token_ids) {
    if (ids.empty())
      bad("bad_words_token_ids holds an empty sequence");
    for (auto id : ids)
      if (id < 0 || (vocab > 0 && id >= vocab))
        bad("bad_words_token_ids names token " + std::to_string(id) + ", outside the vocabulary" +
            (vocab > 0 ? " of " + std::to_string(vocab) : std::string{}));
  }
}

sleep_level to_sleep_level(int64_t level) {
  if (level != 1 && level != 2)
    throw error{errc::invalid_argument, "sleep level must be 1 or 2, got " + std::to_string(level)};
  return static_cast<sleep_level>(level);
}

const char* to_string(device_kind kind) {
  switch (kind) {
  case device_kind::cpu:
    return "cpu";
  case device_kind::cuda:
    return "cuda";
  }
  return "unknown";
}

device_kind parse_device_kind(std::string_view name) {
  const device_kind kinds[] = {device_kind::cpu, device_kind::cuda};
  if (auto kind = value_named(name, kinds))
    return *kind;
  throw error{errc::invalid_argument,
              "device kind '" + std::string{name} + "' is not known (\"cpu\" or \"cuda\")"};
}

const char* to_string(finish_reason reason) {
  switch (reason) {
  case finish_reason::length:
    return "length";
  case finish_reason::stop:
    return "stop";
  case finish_reason::abort:
    return "abort";
  }
  return "unknown";
}

const char* to_string(adapter_kind kind) {
  switch (kind) {
  case adapter_kind::lora:
    return "lora";
  case adapter_kind::prompt_adapter:
    return "prompt_adapter";
  }
  return "unknown";
}

const char* to_string(memory_tag tag) {
  switch (tag) {
  case memory_tag::weights:
    return "weights";
  case memory_tag::kv_cache:
    return "kv_cache";
  }
  return "unknown";
}

std::optional<memory_tag> parse_memory_tag(std::string_view name) {
  return value_named(name, all_memory_tags);
}

std::vector<int32_t> step_positions(const sequence_data& seq, int32_t token_chunk_size) {
  std::vector<int32_t> positions(static_cast<size_t>(std::max(token_chunk_size, 0)));
  for (size_t i = 0; i < positions.size(); ++i)
    positions[i] = seq.num_computed_tokens + static_cast<int32_t>(i);
  return positions;
}

} // namespace troupe
