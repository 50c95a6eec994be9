// The OpenAI-compatible server (troupe::server) on loopback, driven by curl: greedy tokens
// as transformers gives them, streaming and not, errors as OpenAI's error objects, the
// API key, /metrics against the requests sent, 64 concurrent streams in one batch, and
// clients that disconnect leaving no KV-cache blocks behind.

#include "tests/generation.hpp"
#include "tests/skip.hpp"
#include "troupe/llm.hpp"
#include "troupe/server.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

using namespace troupe;
using namespace std::chrono_literals;
using nlohmann::json;
using troupe::testing::greedy;
using troupe::testing::read_json;

namespace {

const std::string fixtures = TROUPE_SOURCE_DIR "/tests/fixtures";

struct reply {
  int status = 0;
  std::string body;
};

/// Runs curl with `args` (shell words) and returns the HTTP status and the body.
reply curl(const std::string& args) {
  auto command = "curl -s -N -w '\\n%{http_code}' " + args + " 2>/dev/null";
  reply r;
  FILE* p = popen(command.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0)
    r.body.append(buf, n);
  pclose(p);
  auto nl = r.body.rfind('\n');
  if (nl != std::string::npos) {
    r.status = std::atoi(r.body.c_str() + nl + 1);
    r.body.resize(nl);
  }
  return r;
}

/// A JSON body in single quotes for the shell.
std::string quoted(const json& j) {
  std::string s = j.dump(), out = "'";
  for (char c : s)
    out += c == '\'' ? std::string{"'\\''"} : std::string(1, c);
  return out + "'";
}

std::string url(const server& s, const std::string& path) {
  return "http://127.0.0.1:" + std::to_string(s.port()) + path;
}

reply post(const server& s, const std::string& path, const json& body,
           const std::string& extra = "") {
  return curl(extra + " -H 'Content-Type: application/json' -d " + quoted(body) + " " +
              url(s, path));
}

/// The `data:` events of a server-sent stream, parsed; the last is "[DONE]" as a string.
std::vector<json> events(const std::string& stream) {
  std::vector<json> out;
  std::istringstream in{stream};
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("data: ", 0) != 0)
      continue;
    auto data = line.substr(6);
    out.push_back(data == "[DONE]" ? json("[DONE]") : json::parse(data));
  }
  return out;
}

/// The token ids a stream carried, in order, and its finish reason.
std::pair<std::vector<int32_t>, std::string> streamed(const std::vector<json>& evs) {
  std::vector<int32_t> ids;
  std::string reason;
  for (auto& e : evs) {
    if (!e.is_object() || e["choices"].empty())
      continue;
    auto& c = e["choices"][0];
    for (auto& t : c["token_ids"])
      ids.push_back(t.get<int32_t>());
    if (!c["finish_reason"].is_null())
      reason = c["finish_reason"].get<std::string>();
  }
  return {ids, reason};
}

/// The value of a sample of the exposition (`name{labels} value`), summed over the series
/// whose labels hold `with`.
double metric(const std::string& text, const std::string& name, const std::string& with = "") {
  double sum = 0;
  std::istringstream in{text};
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#')
      continue;
    auto brace = line.find('{');
    auto space = line.rfind(' ');
    REQUIRE_MESSAGE(space != std::string::npos, "malformed sample: " << line);
    auto series = line.substr(0, brace == std::string::npos ? space : brace);
    if (series != name || line.find(with) == std::string::npos)
      continue;
    sum += std::stod(line.substr(space + 1));
  }
  return sum;
}

/// A new TCP connection to `port` on loopback.
int connect_loopback(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_port = htons(port);
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&at), sizeof at) == 0);
  return fd;
}

/// Sends `bytes` on one new connection to `port` and returns all it gets until the server
/// closes it (or two seconds of silence).
std::string raw_exchange(uint16_t port, const std::string& bytes) {
  int fd = connect_loopback(port);
  timeval wait{2, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  REQUIRE(send(fd, bytes.data(), bytes.size(), 0) == static_cast<ssize_t>(bytes.size()));
  std::string got;
  char buf[4096];
  ssize_t n = 0;
  while ((n = recv(fd, buf, sizeof buf, 0)) > 0)
    got.append(buf, static_cast<size_t>(n));
  close(fd);
  return got;
}

llm_config tiny(int32_t max_num_seqs = 256) {
  llm_config cfg;
  cfg.worker.model_path = fixtures + "/llama-gqa";
  cfg.worker.kv_cache_memory_bytes = 4 << 20;
  cfg.executor.block_size = 4;
  cfg.scheduler.max_num_seqs = max_num_seqs;
  return cfg;
}

server_config on_any_port() {
  server_config sc;
  sc.port = 0;
  sc.served_model_name = "tiny";
  return sc;
}

} // namespace

TEST_CASE("greedy completions through the server are transformers' tokens, streamed or not") {
  for (auto name : {"llama-gqa", "qwen2-bias", "llama3-rope-tied", "mistral-window"}) {
    CAPTURE(name);
    auto cfg = tiny();
    cfg.worker.model_path = fixtures + "/" + name;
    llm model{cfg};
    server s{model, on_any_port()};
    auto ref = read_json(fixtures + "/" + name + "/reference.json");
    for (auto& p : ref["prompts"]) {
      auto want = p["greedy"].get<std::vector<int32_t>>();
      json body = {{"model", "tiny"},
                   {"prompt", p["token_ids"]},
                   {"max_tokens", static_cast<int>(want.size())},
                   {"temperature", 0},
                   {"ignore_eos", true}};
      auto r = post(s, "/v1/completions", body);
      REQUIRE_MESSAGE(r.status == 200, r.body);
      auto j = json::parse(r.body);
      CHECK(j["object"] == "text_completion");
      CHECK(j["model"] == "tiny");
      CHECK(j["choices"][0]["token_ids"].get<std::vector<int32_t>>() == want);
      CHECK(j["choices"][0]["finish_reason"] == "length");
      CHECK(j["usage"]["prompt_tokens"] == p["token_ids"].size());
      CHECK(j["usage"]["completion_tokens"] == want.size());

      body["stream"] = true;
      body["stream_options"] = {{"include_usage", true}};
      auto st = post(s, "/v1/completions", body);
      REQUIRE(st.status == 200);
      auto evs = events(st.body);
      REQUIRE(evs.size() >= 3);
      CHECK(evs.back() == "[DONE]");
      auto [ids, reason] = streamed(evs);
      CHECK(ids == want);
      CHECK(reason == "length");
      auto& usage = evs[evs.size() - 2];
      CHECK(usage["choices"].empty());
      CHECK(usage["usage"]["completion_tokens"] == want.size());
    }
  }
}

TEST_CASE("bad requests get OpenAI's error objects with the right status, and the key is checked") {
  llm model{tiny()};
  auto sc = on_any_port();
  sc.api_key = "a key long enough";
  server s{model, sc};
  const std::string key = "-H 'Authorization: Bearer a key long enough'";
  json ok = {{"prompt", {1, 2, 3}}, {"max_tokens", 2}};
  CHECK(post(s, "/v1/completions", ok).status == 401);
  CHECK(post(s, "/v1/completions", ok, "-H 'Authorization: Bearer a key long enougH'").status ==
        401);
  CHECK(post(s, "/v1/completions", ok, key).status == 200);
  // Open without the key.
  CHECK(curl(url(s, "/health")).status == 200);
  CHECK(curl(url(s, "/metrics")).status == 200);
  struct bad {
    json body;
    int status;
    const char* param;
  };
  for (auto& b :
       {bad{{{"prompt", {1, 2}}, {"max_tokens", "many"}}, 400, "max_tokens"},
        bad{{{"prompt", {1, 2}}, {"temperature", -1}}, 400, "temperature"},
        bad{{{"prompt", {1, -2}}}, 400, "prompt"}, bad{{{"max_tokens", 2}}, 400, "prompt"},
        bad{{{"prompt", {1, 2}}, {"n", 0}}, 400, "n"},
        bad{{{"prompt", {1, 2}}, {"model", "nope"}}, 404, "model"},
        bad{{{"prompt", std::vector<int>(600, 1)}}, 400, ""}}) {
    CAPTURE(b.body.dump());
    auto r = post(s, "/v1/completions", b.body, key);
    CHECK(r.status == b.status);
    auto e = json::parse(r.body);
    REQUIRE(e.contains("error"));
    CHECK(e["error"]["message"].is_string());
    CHECK(e["error"]["code"] == b.status);
    if (*b.param)
      CHECK(e["error"]["param"] == b.param);
  }
  auto r =
    curl(key + " -H 'Content-Type: application/json' -d '{not json' " + url(s, "/v1/completions"));
  CHECK(r.status == 400);
  CHECK(json::parse(r.body)["error"]["type"] == "invalid_request_error");
  CHECK(curl(key + " " + url(s, "/v1/nothing")).status == 404);
  CHECK(curl(key + " " + url(s, "/v1/completions")).status == 405); // a GET
  // Admin endpoints are off unless asked for.
  CHECK(curl(key + " -X POST " + url(s, "/sleep?level=1")).status == 404);
  auto models = json::parse(curl(key + " " + url(s, "/v1/models")).body);
  CHECK(models["data"][0]["id"] == "tiny");
}

TEST_CASE("64 concurrent streams share steps and get their own tokens, and clients that "
          "leave free their blocks") {
  llm model{tiny()};
  server s{model, on_any_port()};
  // Each prompt's tokens alone, for comparison.
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i)
    prompts.push_back({static_cast<int32_t>(3 + i), static_cast<int32_t>(40 + 7 * i), 9});
  std::vector<std::vector<int32_t>> alone;
  for (auto& p : prompts) {
    auto r = post(s, "/v1/completions",
                  {{"prompt", p}, {"max_tokens", 64}, {"temperature", 0}, {"ignore_eos", true}});
    REQUIRE(r.status == 200);
    alone.push_back(json::parse(r.body)["choices"][0]["token_ids"].get<std::vector<int32_t>>());
  }
  const int clients = 64;
  std::vector<std::thread> threads;
  std::vector<std::vector<int32_t>> got(clients);
  std::vector<std::string> reasons(clients);
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      auto r = post(s, "/v1/completions",
                    {{"prompt", prompts[c % 4]},
                     {"max_tokens", 64},
                     {"temperature", 0},
                     {"ignore_eos", true},
                     {"stream", true}});
      auto [ids, reason] = streamed(events(r.body));
      got[c] = ids;
      reasons[c] = reason;
    });
  for (auto& t : threads)
    t.join();
  for (int c = 0; c < clients; ++c) {
    CAPTURE(c);
    CHECK(got[c] == alone[c % 4]);
    CHECK(reasons[c] == "length");
  }
  auto text = curl(url(s, "/metrics")).body;
  INFO(text);
  CHECK(metric(text, "troupe:step_requests_max") >= 16);
  CHECK(metric(text, "vllm:request_success_total", "finished_reason=\"length\"") == clients + 4);
  CHECK(metric(text, "vllm:generation_tokens_total") == (clients + 4) * 64);
  CHECK(metric(text, "vllm:time_to_first_token_seconds_count") == clients + 4);
  CHECK(metric(text, "vllm:e2e_request_latency_seconds_count") == clients + 4);

  // 20 clients that hang up after the first event (head exits; curl's next write fails
  // and it closes the connection): their requests are aborted and their blocks freed.
  threads.clear();
  for (int c = 0; c < 20; ++c)
    threads.emplace_back([&, c] {
      auto command = "curl -s -N -H 'Content-Type: application/json' -d " +
                     quoted({{"prompt", prompts[c % 4]},
                             {"max_tokens", 500},
                             {"temperature", 0},
                             {"ignore_eos", true},
                             {"stream", true}}) +
                     " " + url(s, "/v1/completions") + " 2>/dev/null | head -n 1 > /dev/null";
      CHECK(std::system(command.c_str()) == 0);
    });
  for (auto& t : threads)
    t.join();
  double running = 1, usage = 1;
  for (int i = 0; i < 200 && (running > 0 || usage > 0); ++i) {
    std::this_thread::sleep_for(50ms);
    text = curl(url(s, "/metrics")).body;
    running = metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting");
    usage = metric(text, "vllm:kv_cache_usage_perc");
  }
  INFO(text);
  CHECK(running == 0);
  CHECK(usage == 0);
  CHECK(metric(text, "vllm:request_success_total", "finished_reason=\"abort\"") == 20);
}

TEST_CASE("sampling fields act or are refused: penalties change tokens, unknown fields are 400s") {
  llm model{tiny()};
  server s{model, on_any_port()};
  json plain = {{"prompt", {1, 15, 27, 99, 3, 15, 27}},
                {"max_tokens", 16},
                {"temperature", 0},
                {"ignore_eos", true}};
  auto tokens = [&](const json& body) {
    auto r = post(s, "/v1/completions", body);
    REQUIRE_MESSAGE(r.status == 200, r.body);
    return json::parse(r.body)["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  };
  auto base = tokens(plain);
  for (auto [key, value] : {std::pair<const char*, json>{"repetition_penalty", 1.8},
                            {"frequency_penalty", 2.0},
                            {"presence_penalty", 2.0},
                            {"logit_bias", {{"7", 100}}}}) {
    CAPTURE(key);
    auto body = plain;
    body[key] = value;
    CHECK(tokens(body) != base);
  }
  auto refused = [&](json body, const std::string& param) {
    auto r = post(s, "/v1/completions", body);
    CHECK(r.status == 400);
    CHECK(json::parse(r.body)["error"]["param"] == param);
  };
  for (auto [key, value] : {std::pair<const char*, json>{"presence_penalty", "x"},
                            {"repetition_penalty", 0},
                            {"min_p", 2},
                            {"logit_bias", {{"x", 1}}},
                            {"logit_bias", {{"99999", 1}}},
                            {"logit_bias", {{"5", 101}}},
                            {"best_of", 0},
                            {"n", 0},
                            {"n", 5000},
                            {"response_format", {{"type", "xml"}}},
                            {"guided_choice", json::array()},
                            {"guided_regex", ""},
                            {"structured_outputs", {{"grammar", "x"}}},
                            {"bad_words", "x"},
                            {"bad_words", {1, 2}},
                            {"user", "me"}}) {
    CAPTURE(key);
    auto body = plain;
    body[key] = value;
    refused(body, key);
  }
  // The prompt's logprobs as vLLM gives them: null, then at each position the prompt's token
  // (with its rank) and the most likely ones; streamed with the first token.
  auto with_prompt = plain;
  with_prompt["prompt_logprobs"] = 2;
  auto reply = post(s, "/v1/completions", with_prompt);
  REQUIRE(reply.status == 200);
  auto list = json::parse(reply.body)["choices"][0]["prompt_logprobs"];
  auto prompt = plain["prompt"].get<std::vector<int32_t>>();
  REQUIRE(list.size() == prompt.size());
  CHECK(list[0].is_null());
  for (size_t i = 1; i < prompt.size(); ++i) {
    auto& at = list[i];
    auto own = at[std::to_string(prompt[i])];
    CHECK(own["logprob"].get<double>() <= 0);
    CHECK(own["rank"].get<int>() >= 1);
    CHECK((at.size() == 2 || at.size() == 3)); // the token, and the top 2 (it may be one)
  }
  with_prompt["stream"] = true;
  auto streamed_reply = post(s, "/v1/completions", with_prompt);
  REQUIRE(streamed_reply.status == 200);
  size_t carried = 0;
  for (auto& e : events(streamed_reply.body))
    if (e.contains("choices") && !e["choices"].empty() &&
        e["choices"][0].contains("prompt_logprobs")) {
      ++carried;
      CHECK(e["choices"][0]["prompt_logprobs"] == list);
    }
  CHECK(carried == 1);
  auto too_many = plain;
  too_many["prompt_logprobs"] = 21;
  refused(too_many, "prompt_logprobs");
  // Words need a tokenizer, which this model has none of.
  auto words = plain;
  words["bad_words"] = {"hello"};
  auto r = post(s, "/v1/completions", words);
  CHECK(r.status == 400);
  CHECK(r.body.find("bad_words needs the model's tokenizer") != std::string::npos);
  // So does structured output.
  auto shaped = plain;
  shaped["response_format"] = {{"type", "json_object"}};
  r = post(s, "/v1/completions", shaped);
  CHECK(r.status == 400);
  CHECK(r.body.find("structured output") != std::string::npos);
}

TEST_CASE("n samples come as n choices, streamed or not, and best_of keeps the most likely") {
  llm model{tiny()};
  server s{model, on_any_port()};
  json body = {{"prompt", {1, 15, 27, 99, 3, 15, 27}},
               {"max_tokens", 12},
               {"temperature", 1.2},
               {"seed", 21},
               {"ignore_eos", true},
               {"logprobs", 0}};
  auto one = [&](int64_t seed) {
    auto single = body;
    single["seed"] = seed;
    auto r = post(s, "/v1/completions", single);
    REQUIRE_MESSAGE(r.status == 200, r.body);
    return json::parse(r.body)["choices"][0];
  };
  // Sample i draws as a request seeded seed + i.
  std::vector<json> alone;
  for (int64_t i = 0; i < 4; ++i)
    alone.push_back(one(21 + i));
  auto answer = [&](const json& request, size_t choices) {
    auto r = post(s, "/v1/completions", request);
    REQUIRE_MESSAGE(r.status == 200, r.body);
    auto j = json::parse(r.body);
    REQUIRE(j["choices"].size() == choices);
    return j;
  };
  auto n = body;
  n["n"] = 3;
  auto j = answer(n, 3);
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(j["choices"][i]["index"] == i);
    CHECK(j["choices"][i]["token_ids"] == alone[static_cast<size_t>(i)]["token_ids"]);
  }
  CHECK(j["choices"][0]["token_ids"] != j["choices"][1]["token_ids"]);
  CHECK(j["usage"]["prompt_tokens"] == 7);
  CHECK(j["usage"]["completion_tokens"] == 36);

  // Streamed: each choice's chunks carry its index and end with its reason (a chat's, and
  // its role, in the SmolLM2 test).
  auto streaming = n;
  streaming["stream"] = true;
  streaming["stream_options"] = {{"include_usage", true}};
  auto st = post(s, "/v1/completions", streaming);
  REQUIRE_MESSAGE(st.status == 200, st.body);
  auto evs = events(st.body);
  REQUIRE(evs.size() >= 3);
  CHECK(evs.back() == "[DONE]");
  std::vector<std::vector<int32_t>> ids(3);
  std::vector<int> ends(3, 0);
  for (auto& e : evs) {
    if (!e.is_object() || e["choices"].empty())
      continue;
    auto& c = e["choices"][0];
    auto i = c["index"].get<size_t>();
    REQUIRE(i < 3);
    for (auto id : c["token_ids"])
      ids[i].push_back(id.get<int32_t>());
    if (!c["finish_reason"].is_null())
      ++ends[i];
  }
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(ends[i] == 1);
    CHECK(ids[i] == alone[i]["token_ids"].get<std::vector<int32_t>>());
  }
  CHECK(evs[evs.size() - 2]["usage"]["completion_tokens"] == 36);

  // best_of 4, n 2: the two of the four seeds whose tokens are the most likely, best first.
  auto score = [](const json& choice) {
    double sum = 0;
    for (auto lp : choice["logprobs"]["token_logprobs"])
      sum += lp.get<double>();
    return sum;
  };
  std::vector<size_t> order{0, 1, 2, 3};
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return score(alone[a]) > score(alone[b]); });
  auto best = body;
  best["n"] = 2;
  best["best_of"] = 4;
  auto bj = answer(best, 2);
  for (int i = 0; i < 2; ++i) {
    CHECK(bj["choices"][i]["index"] == i);
    CHECK(bj["choices"][i]["token_ids"] == alone[order[static_cast<size_t>(i)]]["token_ids"]);
  }
  best["stream"] = true;
  auto refused = post(s, "/v1/completions", best);
  CHECK(refused.status == 400);
  CHECK(json::parse(refused.body)["error"]["param"] == "best_of");
}

TEST_CASE("a chat its template refuses is a 400 with the template's message") {
  auto cfg = tiny();
  std::ifstream in{fixtures + "/chat-templates/gemma-3.jinja"};
  cfg.chat_template.assign(std::istreambuf_iterator<char>{in}, std::istreambuf_iterator<char>{});
  llm model{cfg};
  server s{model, on_any_port()};
  json body = {{"messages",
                {{{"role", "user"}, {"content", "One."}}, {{"role", "user"}, {"content", "Two."}}}},
               {"max_tokens", 4}};
  auto r = post(s, "/v1/chat/completions", body);
  CHECK(r.status == 400);
  CHECK(json::parse(r.body)["error"]["message"] ==
        "Conversation roles must alternate user/assistant/user/assistant/...");
  body["tools"] = "get_weather";
  r = post(s, "/v1/chat/completions", body);
  CHECK(r.status == 400);
  CHECK(json::parse(r.body)["error"]["param"] == "tools");
  body.erase("tools");
  body["chat_template_kwargs"] = json::array();
  r = post(s, "/v1/chat/completions", body);
  CHECK(r.status == 400);
  CHECK(json::parse(r.body)["error"]["param"] == "chat_template_kwargs");
}

TEST_CASE("chat completions of SmolLM2 through the server are troupe generate's") {
  auto path = troupe::testing::smollm2_or_skip();
  if (path.empty())
    return;
  llm_config cfg;
  cfg.worker.model_path = path.string();
  cfg.worker.kv_cache_memory_bytes = 16 << 20;
  cfg.executor.max_model_len = 512;
  llm model{cfg};
  auto question = "What is the capital of France?";
  generation_request chat{model.chat_prompt(question), {}, greedy(24), {}};
  chat.add_special_tokens = false; // the template holds them, as the server knows
  auto want = model.generate({chat})[0];
  generation_request scored{"The capital of France is", {}, greedy(5), {}};
  scored.sampling.logprobs = 2;
  auto scored_want = model.generate({scored})[0];
  server s{model, on_any_port()};
  json body = {{"model", "tiny"},
               {"messages", {{{"role", "user"}, {"content", question}}}},
               {"max_tokens", 24},
               {"temperature", 0},
               {"ignore_eos", true}};
  auto r = post(s, "/v1/chat/completions", body);
  REQUIRE_MESSAGE(r.status == 200, r.body);
  auto j = json::parse(r.body);
  CHECK(j["object"] == "chat.completion");
  CHECK(j["choices"][0]["message"]["role"] == "assistant");
  CHECK(j["choices"][0]["message"]["content"] == want.text);
  CHECK(j["choices"][0]["token_ids"].get<std::vector<int32_t>>() == want.token_ids);
  body["stream"] = true;
  auto evs = events(post(s, "/v1/chat/completions", body).body);
  std::string text;
  for (auto& e : evs)
    if (e.is_object() && !e["choices"].empty() && e["choices"][0]["delta"].contains("content"))
      text += e["choices"][0]["delta"]["content"].get<std::string>();
  CHECK(evs.front()["choices"][0]["delta"]["role"] == "assistant");
  CHECK(text == want.text);
  // Two choices (greedy, so alike): each streams its role, its text and its end.
  auto two = body;
  two["n"] = 2;
  std::vector<std::string> texts(2);
  std::vector<int> roles(2, 0), ends(2, 0);
  for (auto& e : events(post(s, "/v1/chat/completions", two).body)) {
    if (!e.is_object() || e["choices"].empty())
      continue;
    auto& c = e["choices"][0];
    auto i = c["index"].get<size_t>();
    REQUIRE(i < 2);
    if (c["delta"].contains("role"))
      ++roles[i];
    if (c["delta"].contains("content"))
      texts[i] += c["delta"]["content"].get<std::string>();
    if (!c["finish_reason"].is_null())
      ++ends[i];
  }
  for (size_t i = 0; i < 2; ++i) {
    CAPTURE(i);
    CHECK(roles[i] == 1);
    CHECK(ends[i] == 1);
    CHECK(texts[i] == want.text);
  }
  // Tools and template variables reach the model's template: the prompt is render_chat's.
  json tools =
    json::array({{{"type", "function"},
                  {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}}}}}}});
  json with_tools = {{"messages", {{{"role", "user"}, {"content", question}}}},
                     {"max_tokens", 2},
                     {"tools", tools},
                     {"chat_template_kwargs", {{"enable_thinking", false}}}};
  chat_request conversation;
  conversation.messages_json = with_tools["messages"].dump();
  conversation.tools_json = tools.dump();
  conversation.variables_json = with_tools["chat_template_kwargs"].dump();
  auto rendered = model.tokenize(model.render_chat(conversation), false);
  auto tool_reply = json::parse(post(s, "/v1/chat/completions", with_tools).body);
  CHECK(tool_reply["usage"]["prompt_tokens"] == rendered.size());
  // A text completion with a stop string: cut there, streamed or not.
  json cut = {{"model", "tiny"},
              {"prompt", "The capital of France is"},
              {"max_tokens", 20},
              {"temperature", 0},
              {"stop", "."}};
  auto plain = json::parse(post(s, "/v1/completions", cut).body);
  CHECK(plain["choices"][0]["text"] == " Paris");
  CHECK(plain["choices"][0]["finish_reason"] == "stop");
  cut["stream"] = true;
  std::string streamed_text;
  for (auto& e : events(post(s, "/v1/completions", cut).body))
    if (e.is_object() && !e["choices"].empty())
      streamed_text += e["choices"][0]["text"].get<std::string>();
  CHECK(streamed_text == " Paris");
  // Logprobs of the sampled tokens and the two most likely, as generate computes them.
  auto lp = json::parse(post(s, "/v1/completions",
                             {{"prompt", "The capital of France is"},
                              {"max_tokens", 5},
                              {"temperature", 0},
                              {"ignore_eos", true},
                              {"logprobs", 2}})
                          .body)["choices"][0]["logprobs"];
  REQUIRE(lp["token_logprobs"].size() == 5);
  for (size_t i = 0; i < 5; ++i) {
    CAPTURE(i);
    CHECK(lp["token_logprobs"][i].get<float>() == doctest::Approx(scored_want.logprobs[i]));
    CHECK(lp["tokens"][i] == model.decode({scored_want.token_ids[i]}));
    CHECK(lp["top_logprobs"][i].size() <= 2);
    // Greedy: the sampled token is the most likely one.
    CHECK(lp["top_logprobs"][i][lp["tokens"][i].get<std::string>()].get<float>() ==
          doctest::Approx(scored_want.logprobs[i]));
  }
}

namespace {

/// A model worker whose steps wait while the gate is shut: requests that hold a place in
/// the engine for as long as a test needs. A step waits at most 30 s, so a failing test
/// ends. With `dies_at`, it dies (as one whose device is lost) at that step.
class gated_model_worker : public model_worker {
public:
  struct gate {
    std::mutex mtx;
    std::condition_variable cv;
    bool shut = false;

    void set(bool s) {
      {
        std::lock_guard<std::mutex> lk{mtx};
        shut = s;
      }
      cv.notify_all();
    }
  };

  gated_model_worker(model_worker_options options, std::shared_ptr<gate> g, int dies_at = 0)
    : model_worker(std::move(options)), gate_(std::move(g)), dies_at_(dies_at) {}

  std::vector<sampler_output> execute_model(const execute_model_request& request) override {
    {
      std::unique_lock<std::mutex> lk{gate_->mtx};
      gate_->cv.wait_for(lk, 30s, [&] { return !gate_->shut; });
    }
    if (++steps_ == dies_at_)
      throw worker_fault{"injected fault at step " + std::to_string(steps_)};
    return model_worker::execute_model(request);
  }

private:
  std::shared_ptr<gate> gate_;
  int dies_at_ = 0;
  int steps_ = 0;
};

/// A streamed completion sent over HTTP/1.0 (the body ends with the connection) on a socket
/// of its own, so that the test sees when the server took it: at its status line.
class raw_stream {
public:
  raw_stream(uint16_t port, const json& body) : fd_(connect_loopback(port)) {
    timeval wait{10, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
    auto data = body.dump();
    auto request = "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                   "Content-Length: " +
                   std::to_string(data.size()) + "\r\n\r\n" + data;
    REQUIRE(send(fd_, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size()));
  }
  ~raw_stream() {
    close(fd_);
  }
  raw_stream(const raw_stream&) = delete;
  raw_stream& operator=(const raw_stream&) = delete;

  /// The status line, once the server wrote it (empty when it did not within 10 s).
  std::string status_line() {
    while (got_.find("\r\n") == std::string::npos && take()) {
    }
    return got_.substr(0, got_.find("\r\n"));
  }

  /// The body, once the server closed the connection.
  std::string body() {
    while (take()) {
    }
    auto end = got_.find("\r\n\r\n");
    return end == std::string::npos ? std::string{} : got_.substr(end + 4);
  }

private:
  bool take() {
    char buf[4096];
    auto n = recv(fd_, buf, sizeof buf, 0);
    if (n <= 0)
      return false;
    got_.append(buf, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  std::string got_;
};

} // namespace

TEST_CASE("beyond the running and waiting bounds a request gets 429, and nothing is lost") {
  // The workers' steps wait while the gate is shut, so the three requests stay in the
  // engine until the fourth has its answer, however slowly this machine runs.
  auto cfg = tiny(2);
  auto gate = std::make_shared<gated_model_worker::gate>();
  llm model{cfg, [&](int32_t) { return std::make_unique<gated_model_worker>(cfg.worker, gate); }};
  auto sc = on_any_port();
  sc.max_waiting_requests = 1; // 2 running + 1 waiting
  server s{model, sc};
  json held = {{"prompt", {1, 2, 3}},
               {"max_tokens", 20},
               {"temperature", 0},
               {"ignore_eos", true},
               {"stream", true}};
  gate->set(true);
  std::vector<std::unique_ptr<raw_stream>> streams;
  for (int c = 0; c < 3; ++c) {
    streams.push_back(std::make_unique<raw_stream>(s.port(), held));
    // The status line comes once the server has counted the request.
    REQUIRE(streams.back()->status_line().find(" 200 ") != std::string::npos);
  }
  auto refused = post(s, "/v1/completions", {{"prompt", {1, 2}}, {"max_tokens", 2}});
  gate->set(false);
  CHECK(refused.status == 429);
  CHECK(json::parse(refused.body)["error"]["type"] == "rate_limit_error");
  for (auto& st : streams) {
    auto [ids, reason] = streamed(events(st->body()));
    CHECK(ids.size() == 20);
    CHECK(reason == "length");
  }
  // Room again.
  CHECK(post(s, "/v1/completions", {{"prompt", {1, 2}}, {"max_tokens", 2}}).status == 200);
}

TEST_CASE("when the engine fails, its requests get 503 and /metrics counts none running or "
          "waiting") {
  // One request runs and three wait when the worker dies.
  auto cfg = tiny(1);
  auto gate = std::make_shared<gated_model_worker::gate>();
  llm model{cfg,
            [&](int32_t) { return std::make_unique<gated_model_worker>(cfg.worker, gate, 3); }};
  server s{model, on_any_port()};
  json held = {{"prompt", {1, 2, 3}},
               {"max_tokens", 20},
               {"temperature", 0},
               {"ignore_eos", true},
               {"stream", true}};
  gate->set(true);
  std::vector<std::unique_ptr<raw_stream>> streams;
  for (int c = 0; c < 4; ++c) {
    streams.push_back(std::make_unique<raw_stream>(s.port(), held));
    REQUIRE(streams.back()->status_line().find(" 200 ") != std::string::npos);
  }
  gate->set(false);
  for (auto& st : streams)
    CHECK(st->body().find("the engine failed") != std::string::npos);
  auto text = curl(url(s, "/metrics")).body;
  INFO(text);
  CHECK(metric(text, "vllm:num_requests_running") == 0);
  CHECK(metric(text, "vllm:num_requests_waiting") == 0);
  CHECK(curl(url(s, "/health")).status == 503);
  CHECK(post(s, "/v1/completions", {{"prompt", {1, 2}}, {"max_tokens", 2}}).status == 503);
}

TEST_CASE("the admin endpoints: sleep and wake, LoRA adapters by name, collective_rpc") {
  llm_config cfg = tiny();
  cfg.worker.max_loras = 2;
  llm model{cfg};
  auto sc = on_any_port();
  sc.enable_admin_api = true;
  sc.loras = {{"sql", fixtures + "/llama-gqa-adapters/lora-all"}};
  server s{model, sc};
  auto ref = read_json(fixtures + "/llama-gqa-adapters/reference.json");
  auto models = json::parse(curl(url(s, "/v1/models")).body);
  REQUIRE(models["data"].size() == 2);
  CHECK(models["data"][1]["id"] == "sql");
  CHECK(models["data"][1]["parent"] == "tiny");
  auto prompt = ref["prompts"][0];
  auto with_lora = [&](const std::string& name) {
    auto r = post(s, "/v1/completions",
                  {{"model", name},
                   {"prompt", prompt},
                   {"max_tokens", 16},
                   {"temperature", 0},
                   {"ignore_eos", true}});
    REQUIRE_MESSAGE(r.status == 200, r.body);
    return json::parse(r.body)["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  };
  CHECK(with_lora("sql") == ref["adapters"]["lora-all"][0]["greedy"].get<std::vector<int32_t>>());
  // Loaded and unloaded by name.
  CHECK(post(s, "/v1/load_lora_adapter",
             {{"lora_name", "qv"}, {"lora_path", fixtures + "/llama-gqa-adapters/lora-qv"}})
          .status == 200);
  CHECK(with_lora("qv") == ref["adapters"]["lora-qv"][0]["greedy"].get<std::vector<int32_t>>());
  CHECK(post(s, "/v1/unload_lora_adapter", {{"lora_name", "qv"}}).status == 200);
  CHECK(post(s, "/v1/completions", {{"model", "qv"}, {"prompt", prompt}}).status == 404);
  CHECK(post(s, "/v1/unload_lora_adapter", {{"lora_name", "qv"}}).status == 404);
  // Sleep: /health says 503 and a completion fails cleanly; wake_up brings it back.
  auto plain =
    post(s, "/v1/completions", {{"prompt", prompt}, {"max_tokens", 8}, {"temperature", 0}});
  CHECK(curl("-X POST " + url(s, "/sleep?level=1")).status == 200);
  CHECK(json::parse(curl(url(s, "/is_sleeping")).body)["is_sleeping"] == true);
  CHECK(curl(url(s, "/health")).status == 503);
  auto asleep = post(s, "/v1/completions", {{"prompt", prompt}, {"max_tokens", 8}});
  CHECK(asleep.status == 503);
  CHECK(curl("-X POST " + url(s, "/wake_up")).status == 200);
  CHECK(json::parse(curl(url(s, "/is_sleeping")).body)["is_sleeping"] == false);
  CHECK(curl(url(s, "/health")).status == 200);
  auto again =
    post(s, "/v1/completions", {{"prompt", prompt}, {"max_tokens", 8}, {"temperature", 0}});
  CHECK(json::parse(again.body)["choices"][0]["token_ids"] ==
        json::parse(plain.body)["choices"][0]["token_ids"]);
  // collective_rpc of a named method; a wrong one is the worker's error.
  auto rpc = post(s, "/collective_rpc", {{"method", "check_health"}});
  CHECK(rpc.status == 200);
  CHECK(json::parse(rpc.body)["results"].size() == 1);
  CHECK(post(s, "/collective_rpc", {{"method", "no_such_method"}}).status >= 400);
}

TEST_CASE("pipelined requests on one connection are all answered in order, and odd bytes "
          "in a path get a 404, not a crash") {
  llm model{tiny()};
  server s{model, on_any_port()};
  auto request = [](const std::string& body, bool last) {
    return "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           "Content-Length: " +
           std::to_string(body.size()) + "\r\n" + (last ? "Connection: close\r\n" : "") + "\r\n" +
           body;
  };
  std::string first = json{
    {"prompt", {1, 2, 3}},
    {"max_tokens", 4},
    {"temperature", 0},
    {"ignore_eos", true},
    {"stream", true}}.dump();
  std::string second =
    json{{"prompt", {4, 5}}, {"max_tokens", 3}, {"temperature", 0}, {"ignore_eos", true}}.dump();
  // Both in one write: the second is in the buffer while the first streams.
  auto got = raw_exchange(s.port(), request(first, false) + request(second, true));
  auto at = got.find("HTTP/1.1 200", 1);
  REQUIRE_MESSAGE(at != std::string::npos, got);
  CHECK(got.rfind("HTTP/1.1 200", 0) == 0);
  CHECK(got.find("data: [DONE]") < at);
  CHECK(got.find("\"completion_tokens\":3", at) != std::string::npos);
  // A raw byte that is not UTF-8 in the path.
  auto odd =
    raw_exchange(s.port(), "GET /\xff\xfe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  CHECK(odd.rfind("HTTP/1.1 404", 0) == 0);
  CHECK(curl(url(s, "/health")).status == 200); // still serving
}

TEST_CASE("a client that reads slowly holds up no other stream") {
  llm model{tiny()};
  server s{model, on_any_port()};
  json slow = {{"prompt", {1, 2, 3}},
               {"max_tokens", 500},
               {"temperature", 0},
               {"ignore_eos", true},
               {"stream", true}};
  // Reads 2 KB a second of a stream of about 100 KB, and gives up after 3 s.
  std::thread crawler([&] {
    curl("--limit-rate 2k --max-time 3 -H 'Content-Type: application/json' -d " + quoted(slow) +
         " " + url(s, "/v1/completions"));
  });
  std::this_thread::sleep_for(300ms);
  auto quick = post(s, "/v1/completions",
                    {{"prompt", {4, 5}},
                     {"max_tokens", 50},
                     {"temperature", 0},
                     {"ignore_eos", true},
                     {"stream", true}});
  auto [ids, reason] = streamed(events(quick.body));
  CHECK(quick.status == 200);
  CHECK(ids.size() == 50);
  CHECK(reason == "length");
  crawler.join();
}
