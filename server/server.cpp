// The HTTP side (Boost.Beast's parser on Asio sockets) and the engine's thread, which talk
// by messages: a connection hands its request to the engine's queue; the engine posts each
// update to the connection's strand.

#include "troupe/server.hpp"

#include "server/metrics.hpp"
#include "server/openai.hpp"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <atomic>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <functional>
#include <iostream>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

namespace troupe {

namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using clock_type = std::chrono::steady_clock;
using nlohmann::json;

/// Bytes of a next request a connection may send while its generation runs.
constexpr size_t watch_limit = 64 << 10;
/// Bytes a connection may have waiting to be sent (a client that does not read).
constexpr size_t write_limit = 16 << 20;

const char* reason_of(int status) {
  switch (status) {
  case 200: return "OK";
  case 400: return "Bad Request";
  case 401: return "Unauthorized";
  case 404: return "Not Found";
  case 405: return "Method Not Allowed";
  case 409: return "Conflict";
  case 413: return "Payload Too Large";
  case 429: return "Too Many Requests";
  case 503: return "Service Unavailable";
  default: return "Internal Server Error";
  }
}

std::string head(int status, const std::string& type, bool keep_alive,
                 std::optional<size_t> length, bool chunked = true) {
  std::string h = "HTTP/1.1 " + std::to_string(status) + " " + reason_of(status) +
                  "\r\nServer: troupe\r\nContent-Type: " + type + "\r\n";
  h += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  if (length)
    h += "Content-Length: " + std::to_string(*length) + "\r\n\r\n";
  else
    h += chunked ? "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
                 : "Cache-Control: no-cache\r\n\r\n";
  return h;
}

std::string chunked(const std::string& data) {
  char size[32];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  return size + data + "\r\n";
}

/// Whether `given` is `expected`, in time that does not depend on where they differ.
bool same_key(const std::string& given, const std::string& expected) {
  unsigned char a[SHA256_DIGEST_LENGTH], b[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(given.data()), given.size(), a);
  SHA256(reinterpret_cast<const unsigned char*>(expected.data()), expected.size(), b);
  return CRYPTO_memcmp(a, b, sizeof a) == 0;
}

/// The http_error of a troupe::error from the engine or the executor.
http_error from_engine(const error& e) {
  switch (e.code()) {
  case errc::invalid_argument:
  case errc::unsupported:
    return {400, "invalid_request_error", e.what()};
  case errc::sleeping:
    return {503, "server_error", e.what()};
  default:
    return {500, "server_error", e.what()};
  }
}

/// Where a request's updates go (its connection), and what the engine's thread keeps of
/// it for the metrics.
struct request_sink {
  virtual ~request_sink() = default;
  virtual void update(const generation_update& u) = 0;
  virtual void fail(const http_error& e) = 0;

  int64_t id = -1; // the engine's, once added
  std::atomic<bool> cancelled{false};
  clock_type::time_point arrived = clock_type::now();
  clock_type::time_point last_token;
  double first_token = -1;
  std::vector<double> gaps;
};

/// The engine's thread: runs commands (adds, aborts, admin calls) between steps, steps
/// while requests are unfinished, and hands each update to its request's sink.
class engine_loop {
public:
  engine_loop(llm& model, server_metrics& metrics, int64_t capacity)
    : model_(model), metrics_(metrics), capacity_(capacity), thread_([this] { run(); }) {
  }

  ~engine_loop() {
    {
      std::lock_guard<std::mutex> lk{mtx_};
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  /// Runs `f` on the engine's thread, between steps.
  void post(std::function<void(llm&)> f) {
    {
      std::lock_guard<std::mutex> lk{mtx_};
      commands_.push_back(std::move(f));
    }
    cv_.notify_all();
  }

  /// Queues a generation; refused with 429 beyond the capacity, 503 once the engine failed.
  void submit(generation_request g, std::shared_ptr<request_sink> sink) {
    if (failed_)
      throw http_error{503, "server_error", "the engine failed: " + failure()};
    if (active_.fetch_add(1) >= capacity_) {
      --active_;
      throw http_error{429, "rate_limit_error",
                       "too many requests: " + std::to_string(capacity_) +
                         " are running or waiting; try again later"};
    }
    post([this, g = std::move(g), sink](llm& m) {
      if (sink->cancelled) {
        --active_;
        return;
      }
      if (failed_) { // the engine failed after the request came
        --active_;
        sink->fail({503, "server_error", "the engine failed: " + failure()});
        return;
      }
      try {
        sink->id = m.add_request(g);
        sinks_[sink->id] = sink;
      } catch (const error& e) {
        --active_;
        sink->fail(from_engine(e));
      } catch (const std::exception& e) {
        --active_;
        sink->fail({500, "server_error", e.what()});
      }
    });
  }

  /// Aborts the request of `sink` (a client gone).
  void abort(std::shared_ptr<request_sink> sink) {
    sink->cancelled = true;
    post([sink](llm& m) {
      if (sink->id >= 0)
        m.abort_request(sink->id);
    });
  }

  /// Aborts every request (the end of a drain).
  void abort_all() {
    post([this](llm& m) {
      for (auto& [id, sink] : sinks_)
        m.abort_request(id);
    });
  }

  /// Requests added or queued and not finished.
  int64_t active() const {
    return active_;
  }

  bool failed() const {
    return failed_;
  }

  std::string failure() const {
    std::lock_guard<std::mutex> lk{mtx_};
    return failure_;
  }

private:
  void run() {
    for (;;) {
      std::deque<std::function<void(llm&)>> todo;
      {
        std::unique_lock<std::mutex> lk{mtx_};
        cv_.wait(lk, [&] {
          return stop_ || !commands_.empty() || (!failed_ && model_.has_unfinished_requests());
        });
        if (stop_)
          break;
        todo.swap(commands_);
      }
      for (auto& c : todo) {
        try {
          c(model_);
        } catch (const std::exception& e) {
          // Commands answer their own errors; this is a bug's last stop, not the thread's.
          std::cerr << "troupe serve: a command failed: " << e.what() << std::endl;
        }
      }
      if (!failed_ && model_.has_unfinished_requests()) {
        try {
          for (auto& u : model_.step())
            dispatch(u);
        } catch (const error& e) {
          if (e.code() == errc::worker_died || e.code() == errc::shut_down)
            fail_all(e);
          else
            fail_requests(from_engine(e));
        } catch (const std::exception& e) {
          fail_requests({500, "server_error", e.what()});
        }
      }
      metrics_.engine(model_.stats());
    }
    for (auto& [id, sink] : sinks_)
      sink->fail({503, "server_error", "the server stopped"});
  }

  void dispatch(const generation_update& u) {
    auto at = sinks_.find(u.request_id);
    if (at == sinks_.end())
      return;
    auto sink = at->second;
    auto now = clock_type::now();
    if (!u.token_ids.empty()) {
      if (sink->first_token < 0)
        sink->first_token = std::chrono::duration<double>(now - sink->arrived).count();
      else
        sink->gaps.push_back(std::chrono::duration<double>(now - sink->last_token).count());
      sink->last_token = now;
    }
    sink->update(u);
    if (u.finished) {
      metrics_.finished(u.output->finish_reason, std::max(0.0, sink->first_token), sink->gaps,
                        std::chrono::duration<double>(now - sink->arrived).count());
      sinks_.erase(at);
      --active_;
    }
  }

  /// A step failed and the engine can go on (the workers sleep, say): the requests in the
  /// engine get the error and are aborted there.
  void fail_requests(const http_error& why) {
    for (auto& [id, sink] : sinks_) {
      model_.abort_request(id);
      sink->fail(why);
      --active_;
    }
    sinks_.clear();
    try {
      model_.step(); // hands out the aborted requests, computing nothing
    } catch (const std::exception&) {
    }
  }

  /// The executor failed for good: every request gets the error, and later ones a 503.
  void fail_all(const error& e) {
    {
      std::lock_guard<std::mutex> lk{mtx_};
      failure_ = e.what();
    }
    failed_ = true;
    for (auto& [id, sink] : sinks_) {
      sink->fail({503, "server_error", std::string{"the engine failed: "} + e.what()});
      --active_;
    }
    sinks_.clear();
  }

  llm& model_;
  server_metrics& metrics_;
  const int64_t capacity_;
  mutable std::mutex mtx_;
  std::condition_variable cv_;
  std::deque<std::function<void(llm&)>> commands_;
  bool stop_ = false;
  std::atomic<bool> failed_{false};
  std::string failure_;
  std::atomic<int64_t> active_{0};
  /// Engine thread only.
  std::map<int64_t, std::shared_ptr<request_sink>> sinks_;
  std::thread thread_;
};

/// What the connections share: the model, the configuration, the engine's thread, the
/// served adapters.
struct server_core {
  llm& model;
  server_config cfg;
  server_metrics metrics;
  net::io_context io;
  tcp::acceptor acceptor{io};
  std::unique_ptr<engine_loop> engine;
  std::thread io_thread;
  /// Blocking executor calls that must not hold up the I/O thread (health checks).
  std::thread helper;
  std::mutex helper_mtx;
  std::condition_variable helper_cv;
  std::deque<std::function<void()>> helper_jobs;
  bool helper_stop = false;
  /// LoRA adapters served: name -> (id, path); loads add to it.
  std::mutex lora_mtx;
  std::map<std::string, std::pair<int64_t, std::string>> loras;
  int64_t next_lora_id = 1;
  std::atomic<int64_t> next_request{1};
  uint16_t port = 0;
  std::atomic<bool> draining{false};
  /// Put to sleep through /sleep (generations get 503 until /wake_up).
  std::atomic<bool> asleep{false};
  std::mutex state_mtx;
  std::condition_variable stopped_cv;
  bool stopped = false;
  std::thread drainer;
  std::unique_ptr<net::signal_set> signals;

  server_core(llm& m, server_config c)
    : model(m), cfg(std::move(c)), metrics(cfg.served_model_name) {}

  void run_helper(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lk{helper_mtx};
      helper_jobs.push_back(std::move(job));
    }
    helper_cv.notify_all();
  }

  void helper_loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lk{helper_mtx};
        helper_cv.wait(lk, [&] { return helper_stop || !helper_jobs.empty(); });
        if (helper_stop)
          return;
        job = std::move(helper_jobs.front());
        helper_jobs.pop_front();
      }
      job();
    }
  }

  void accept();
  void do_drain();
  void stop_all();
};

/// One client connection: reads requests (keep-alive), answers them in order, and for a
/// generation watches the socket so that a client that goes away aborts its request.
class session : public std::enable_shared_from_this<session> {
public:
  session(tcp::socket socket, server_core& srv)
    : socket_(std::move(socket)), strand_(socket_.get_executor()), srv_(srv) {}

  void start() {
    read();
  }

private:
  /// The sink of the generation in progress: posts to this session's strand.
  struct sink : request_sink {
    std::weak_ptr<session> owner;
    net::strand<net::any_io_executor> strand;
    explicit sink(std::weak_ptr<session> s, net::strand<net::any_io_executor> st)
      : owner(std::move(s)), strand(std::move(st)) {}
    void update(const generation_update& u) override {
      net::post(strand, [o = owner, u] {
        if (auto s = o.lock())
          s->on_update(u);
      });
    }
    void fail(const http_error& e) override {
      net::post(strand, [o = owner, e] {
        if (auto s = o.lock())
          s->on_failed(e);
      });
    }
  };

  void read() {
    if (closed_)
      return;
    parser_.emplace();
    parser_->body_limit(srv_.cfg.max_body_bytes);
    http::async_read(socket_, buffer_, *parser_,
                     net::bind_executor(strand_, [self = shared_from_this()](
                                                   beast::error_code ec, size_t) {
                       self->on_read(ec);
                     }));
  }

  void on_read(beast::error_code ec) {
    if (ec == http::error::body_limit) {
      keep_alive_ = false;
      return respond(413, http_error{413, "invalid_request_error",
                                     "the body is larger than " +
                                       std::to_string(srv_.cfg.max_body_bytes) + " bytes"}
                            .body());
    }
    if (ec) {
      close();
      return;
    }
    auto req = parser_->release();
    keep_alive_ = req.keep_alive() && !srv_.draining;
    http10_ = req.version() == 10;
    try {
      route(req);
    } catch (const http_error& e) {
      respond(e.status, e.body());
    } catch (const error& e) {
      auto he = from_engine(e);
      respond(he.status, he.body());
    } catch (const std::exception& e) {
      respond(500, http_error{500, "server_error", e.what()}.body());
    }
  }

  void route(const http::request<http::string_body>& req) {
    std::string target{req.target()};
    auto query_at = target.find('?');
    auto path = target.substr(0, query_at);
    auto query = query_at == std::string::npos ? std::string{} : target.substr(query_at + 1);
    auto method = req.method();
    auto only = [&](http::verb v) {
      if (method != v)
        throw http_error{405, "invalid_request_error",
                         std::string{"use "} + std::string{http::to_string(v)} + " for " + path};
    };
    if (path == "/health") {
      only(http::verb::get);
      return health();
    }
    if (path == "/metrics") {
      only(http::verb::get);
      return respond(200, srv_.metrics.render(), "text/plain; version=0.0.4; charset=utf-8");
    }
    if (path == "/is_sleeping") {
      only(http::verb::get);
      return on_helper([](llm& m) { return json{{"is_sleeping", m.executor().is_sleeping()}}; });
    }
    bool admin = path == "/sleep" || path == "/wake_up" || path == "/collective_rpc" ||
                 path == "/v1/load_lora_adapter" || path == "/v1/unload_lora_adapter";
    bool api = path.rfind("/v1/", 0) == 0;
    if (!admin && !api)
      throw http_error{404, "not_found_error", "no endpoint " + path};
    authorize(req);
    if (admin) {
      if (!srv_.cfg.enable_admin_api)
        throw http_error{404, "not_found_error",
                         path + " is an admin endpoint; start the server with --enable-admin-api"};
      only(http::verb::post);
      return admin_call(path, query, req.body());
    }
    if (path == "/v1/models") {
      only(http::verb::get);
      return respond(200, dumped(models()));
    }
    if (path == "/v1/completions" || path == "/v1/chat/completions") {
      only(http::verb::post);
      return generate(parse_openai_request(req.body(), path == "/v1/chat/completions"));
    }
    throw http_error{404, "not_found_error", "no endpoint " + path};
  }

  void authorize(const http::request<http::string_body>& req) {
    if (srv_.cfg.api_key.empty())
      return;
    auto given = std::string{req[http::field::authorization]};
    const std::string bearer = "Bearer ";
    if (given.rfind(bearer, 0) != 0 || !same_key(given.substr(bearer.size()), srv_.cfg.api_key))
      throw http_error{401, "authentication_error", "a missing or wrong API key"};
  }

  json models() {
    json data = json::array();
    auto created = static_cast<int64_t>(std::time(nullptr));
    data.push_back({{"id", srv_.cfg.served_model_name},
                    {"object", "model"},
                    {"created", created},
                    {"owned_by", "troupe"},
                    {"root", srv_.model.config().worker.model_path},
                    {"parent", nullptr},
                    {"max_model_len", srv_.model.max_model_len()}});
    std::lock_guard<std::mutex> lk{srv_.lora_mtx};
    for (auto& [name, lora] : srv_.loras)
      data.push_back({{"id", name},
                      {"object", "model"},
                      {"created", created},
                      {"owned_by", "troupe"},
                      {"root", lora.second},
                      {"parent", srv_.cfg.served_model_name}});
    return {{"object", "list"}, {"data", data}};
  }

  /// /health: 200 while the executor is healthy and awake; 503 when it failed, sleeps,
  /// or does not answer within two seconds (a worker being replaced).
  void health() {
    if (srv_.engine->failed())
      throw http_error{503, "server_error", "the engine failed: " + srv_.engine->failure()};
    on_helper([](llm& m) -> json {
      auto unhealthy = [](const std::string& why) { return http_error{503, "server_error", why}; };
      try {
        if (m.executor().is_sleeping())
          throw unhealthy("the model sleeps; POST /wake_up");
        auto check = m.executor().check_health_async();
        if (check.wait_for(std::chrono::seconds(2)) != std::future_status::ready)
          throw unhealthy("the workers did not answer within 2 s (busy or recovering)");
        check.get();
      } catch (const error& e) {
        throw unhealthy(e.what());
      }
      return json::object();
    });
  }


  /// Runs `f` (on the thread that calls this) and answers with its JSON, or with the error
  /// it throws.
  void answer(const std::function<json(llm&)>& f, llm& m) {
    int status = 200;
    std::string body;
    try {
      body = dumped(f(m));
    } catch (const http_error& e) {
      status = e.status;
      body = e.body();
    } catch (const error& e) {
      auto he = from_engine(e);
      status = he.status;
      body = he.body();
    } catch (const std::exception& e) {
      status = 500;
      body = http_error{500, "server_error", e.what()}.body();
    }
    net::post(strand_, [self = shared_from_this(), status, body] { self->respond(status, body); });
  }

  /// Answers with `f` run on the helper thread.
  void on_helper(std::function<json(llm&)> f) {
    auto& model = srv_.model;
    srv_.run_helper([self = shared_from_this(), &model, f] { self->answer(f, model); });
  }

  /// Answers with `f` run on the engine's thread, between steps.
  void on_engine(std::function<json(llm&)> f) {
    srv_.engine->post([self = shared_from_this(), f](llm& m) { self->answer(f, m); });
  }

  void admin_call(const std::string& path, const std::string& query, const std::string& text) {
    auto body = text.empty() ? json::object() : parse_json_object(text);
    auto param = [&](const std::string& key) -> std::vector<std::string> {
      std::vector<std::string> values;
      size_t at = 0;
      while (at <= query.size()) {
        auto end = query.find('&', at);
        auto pair = query.substr(at, end == std::string::npos ? std::string::npos : end - at);
        if (pair.rfind(key + "=", 0) == 0)
          values.push_back(pair.substr(key.size() + 1));
        if (end == std::string::npos)
          break;
        at = end + 1;
      }
      return values;
    };
    if (path == "/sleep") {
      int32_t level = 1;
      auto levels = param("level");
      if (!levels.empty()) {
        try {
          level = std::stoi(levels[0]);
        } catch (const std::exception&) {
          throw http_error{400, "invalid_request_error", "level must be 1 or 2", "level"};
        }
      }
      auto* srv = &srv_;
      return on_engine([srv, level](llm& m) -> json {
        if (m.has_unfinished_requests())
          throw http_error{409, "invalid_request_error",
                           "requests are running; sleep when the server is idle"};
        m.executor().sleep(level);
        srv->asleep = true;
        return json::object();
      });
    }
    if (path == "/wake_up") {
      auto tags = param("tags");
      auto* srv = &srv_;
      return on_engine([srv, tags](llm& m) -> json {
        m.executor().wake_up(tags);
        srv->asleep = m.executor().is_sleeping();
        return json::object();
      });
    }
    if (path == "/collective_rpc") {
      if (!body.contains("method") || !body["method"].is_string())
        throw http_error{400, "invalid_request_error", "'method' must be a string", "method"};
      auto name = body["method"].get<std::string>();
      rpc_call_options opts;
      if (body.contains("timeout") && body["timeout"].is_number())
        opts.timeout = std::chrono::milliseconds(
          static_cast<int64_t>(body["timeout"].get<double>() * 1000));
      return on_engine([name, opts](llm& m) -> json {
        json results = json::array();
        for (auto& r : m.executor().collective_rpc(name, opts))
          results.push_back(caf::to_string(r));
        return {{"results", results}};
      });
    }
    // LoRA adapters by name.
    if (!body.contains("lora_name") || !body["lora_name"].is_string())
      throw http_error{400, "invalid_request_error", "'lora_name' must be a string", "lora_name"};
    auto name = body["lora_name"].get<std::string>();
    auto* srv = &srv_;
    if (path == "/v1/load_lora_adapter") {
      if (!body.contains("lora_path") || !body["lora_path"].is_string())
        throw http_error{400, "invalid_request_error", "'lora_path' must be a string",
                         "lora_path"};
      auto lora_path = body["lora_path"].get<std::string>();
      return on_engine([srv, name, lora_path](llm& m) -> json {
        int64_t id = 0;
        {
          std::lock_guard<std::mutex> lk{srv->lora_mtx};
          if (srv->loras.count(name) > 0 || name == srv->cfg.served_model_name)
            throw http_error{400, "invalid_request_error",
                             "the model name '" + name + "' is taken", "lora_name"};
          id = srv->next_lora_id++;
        }
        m.executor().add_lora({name, id, lora_path});
        std::lock_guard<std::mutex> lk{srv->lora_mtx};
        srv->loras[name] = {id, lora_path};
        return json::object();
      });
    }
    return on_engine([srv, name](llm& m) -> json {
      int64_t id = 0;
      {
        std::lock_guard<std::mutex> lk{srv->lora_mtx};
        auto at = srv->loras.find(name);
        if (at == srv->loras.end())
          throw http_error{404, "not_found_error", "no LoRA adapter '" + name + "'", "lora_name"};
        id = at->second.first;
        srv->loras.erase(at);
      }
      m.executor().remove_lora(id);
      return json::object();
    });
  }

  void generate(openai_request req) {
    if (srv_.draining)
      throw http_error{503, "server_error", "the server is shutting down"};
    if (srv_.asleep)
      throw http_error{503, "server_error", "the model sleeps; POST /wake_up"};
    auto& g = req.generation;
    if (req.model.empty())
      req.model = srv_.cfg.served_model_name;
    if (req.model != srv_.cfg.served_model_name) {
      std::lock_guard<std::mutex> lk{srv_.lora_mtx};
      auto at = srv_.loras.find(req.model);
      if (at == srv_.loras.end())
        throw http_error{404, "not_found_error",
                         "the model '" + req.model + "' does not exist", "model"};
      g.lora = lora_request{at->first, at->second.first, at->second.second};
    }
    if (req.chat) {
      g.prompt = srv_.model.chat_prompt(req.messages);
      g.add_special_tokens = false; // the template holds them
    }
    if (g.sampling.max_tokens < 0)
      g.sampling.max_tokens = static_cast<int32_t>(srv_.model.max_model_len());
    if (!req.chat && g.prompt.empty() && g.prompt_token_ids.empty())
      throw http_error{400, "invalid_request_error", "the prompt is empty", "prompt"};
    auto n = srv_.next_request++;
    req_ = std::make_unique<openai_request>(std::move(req));
    response_ = std::make_unique<openai_response>(
      *req_, (req_->chat ? "chatcmpl-" : "cmpl-") + std::to_string(n),
      static_cast<int64_t>(std::time(nullptr)), srv_.model);
    sink_ = std::make_shared<sink>(weak_from_this(), strand_);
    srv_.engine->submit(req_->generation, sink_); // may throw 429 / 503
    if (req_->stream) {
      streaming_ = true;
      if (http10_) // no chunked transfer in HTTP/1.0: the body ends with the connection
        keep_alive_ = false;
      write(head(200, "text/event-stream", keep_alive_, std::nullopt, !http10_));
    }
    watch();
  }

  void on_update(const generation_update& u) {
    if (!sink_ || closed_)
      return;
    if (req_->stream) {
      auto events = response_->chunk(u);
      if (u.finished)
        events += response_->end(*u.output);
      if (!events.empty())
        write(frame(events));
      if (u.finished) {
        if (!http10_)
          write(chunked(""));
        done_generating();
      }
    } else if (u.finished) {
      auto body = response_->complete(*u.output);
      done_generating();
      respond(200, body);
    }
  }

  void on_failed(const http_error& e) {
    if (!sink_ || closed_)
      return;
    if (streaming_) { // the status line went out: the error is the stream's last event
      write(frame("data: " + e.body() + "\n\ndata: [DONE]\n\n"));
      if (!http10_)
        write(chunked(""));
      done_generating();
    } else {
      done_generating();
      respond(e.status, e.body());
    }
  }

  /// Stream data as the response's framing has it: a chunk, or raw bytes for HTTP/1.0.
  std::string frame(const std::string& data) const {
    return http10_ ? data : chunked(data);
  }

  void done_generating() {
    sink_.reset();
    if (streaming_) {
      streaming_ = false;
      finish_response();
    }
  }

  /// Reads while a generation runs: a client that closes the connection aborts it; bytes
  /// of a next request are kept for the parser.
  void watch() {
    if (watching_ || closed_)
      return;
    watching_ = true;
    socket_.async_read_some(
      buffer_.prepare(4096),
      net::bind_executor(strand_, [self = shared_from_this()](beast::error_code ec, size_t n) {
        self->watching_ = false;
        if (ec && ec != net::error::operation_aborted) {
          if (self->sink_)
            self->srv_.engine->abort(self->sink_);
          self->sink_.reset();
          self->close();
          return;
        }
        if (!ec)
          self->buffer_.commit(n);
        // Watching goes on while the generation does (a client that pipelines more than a
        // bound is no longer watched); the next request is read once the response is out.
        if (self->sink_ && !ec) {
          if (self->buffer_.size() < watch_limit)
            self->watch();
          return;
        }
        if (std::exchange(self->read_after_watch_, false))
          self->read();
      }));
  }

  void respond(int status, const std::string& body, const std::string& type = "application/json") {
    write(head(status, type, keep_alive_, body.size()) + body);
    finish_response();
  }

  void finish_response() {
    response_done_ = true;
    if (!writing_)
      after_response();
  }

  void after_response() {
    response_done_ = false;
    if (!keep_alive_) {
      close();
      return;
    }
    if (!watching_) {
      read();
      return;
    }
    // The watch read hands over to the parser (bytes it got stay in the buffer).
    read_after_watch_ = true;
    beast::error_code ignored;
    socket_.cancel(ignored);
  }

  void write(std::string data) {
    if (closed_)
      return;
    queued_bytes_ += data.size();
    if (queued_bytes_ > write_limit && sink_) {
      // A client that reads far slower than its tokens come: its request ends rather than
      // the server's memory growing without bound (nobody else waits on it either way).
      srv_.engine->abort(sink_);
      sink_.reset();
      close();
      return;
    }
    writes_.push_back(std::move(data));
    if (!writing_)
      write_next();
  }

  void write_next() {
    writing_ = true;
    net::async_write(socket_, net::buffer(writes_.front()),
                     net::bind_executor(strand_, [self = shared_from_this()](
                                                   beast::error_code ec, size_t) {
                       self->queued_bytes_ -= self->writes_.front().size();
                       self->writes_.pop_front();
                       if (ec) {
                         // The client is gone: its generation stops.
                         if (self->sink_)
                           self->srv_.engine->abort(self->sink_);
                         self->sink_.reset();
                         self->writing_ = false;
                         self->close();
                         return;
                       }
                       if (!self->writes_.empty())
                         return self->write_next();
                       self->writing_ = false;
                       if (self->response_done_)
                         self->after_response();
                     }));
  }

  void close() {
    if (closed_)
      return;
    closed_ = true;
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  tcp::socket socket_;
  net::strand<net::any_io_executor> strand_;
  server_core& srv_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::deque<std::string> writes_;
  bool writing_ = false;
  size_t queued_bytes_ = 0;
  bool watching_ = false;
  bool response_done_ = false;
  bool keep_alive_ = true;
  bool closed_ = false;
  bool streaming_ = false;
  bool http10_ = false;
  /// The response ended while a watch read was outstanding: it reads the next request.
  bool read_after_watch_ = false;
  std::unique_ptr<openai_request> req_;
  std::unique_ptr<openai_response> response_;
  std::shared_ptr<sink> sink_;
};

} // namespace

struct server::impl : server_core {
  using server_core::server_core;
};

void server_core::accept() {
  acceptor.async_accept(net::make_strand(io), [this](beast::error_code ec, tcp::socket socket) {
    if (ec)
      return; // closed by a drain or a stop
    std::make_shared<session>(std::move(socket), *this)->start();
    accept();
  });
}

void server_core::do_drain() {
  net::post(io, [this] {
    beast::error_code ignored;
    acceptor.close(ignored);
  });
  auto deadline = clock_type::now() + cfg.drain_timeout;
  while (engine->active() > 0 && clock_type::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (engine->active() > 0) {
    engine->abort_all();
    auto grace = clock_type::now() + std::chrono::seconds(5);
    while (engine->active() > 0 && clock_type::now() < grace)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The last responses go out before the connections close.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  stop_all();
}

void server_core::stop_all() {
  {
    std::lock_guard<std::mutex> lk{state_mtx};
    if (stopped)
      return;
    stopped = true;
  }
  io.stop();
  stopped_cv.notify_all();
}

server::server(llm& model, server_config config)
  : impl_(std::make_unique<impl>(model, std::move(config))) {
  auto& d = *impl_;
  auto& sc = model.config().scheduler;
  d.engine = std::make_unique<engine_loop>(model, d.metrics,
                                           sc.max_num_seqs + d.cfg.max_waiting_requests);
  for (auto& [name, path] : d.cfg.loras) {
    auto id = d.next_lora_id++;
    model.executor().add_lora({name, id, path});
    d.loras[name] = {id, path};
  }
  beast::error_code ec;
  auto address = net::ip::make_address(d.cfg.host, ec);
  if (ec)
    throw error{errc::invalid_argument, "serve: '" + d.cfg.host + "' is not an IP address"};
  tcp::endpoint at{address, d.cfg.port};
  d.acceptor.open(at.protocol(), ec);
  if (!ec)
    d.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec)
    d.acceptor.bind(at, ec);
  if (!ec)
    d.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec)
    throw error{errc::invalid_argument, "serve: cannot listen on " + d.cfg.host + ":" +
                                          std::to_string(d.cfg.port) + ": " + ec.message()};
  d.port = d.acceptor.local_endpoint().port();
  d.accept();
  d.helper = std::thread([&d] { d.helper_loop(); });
  d.io_thread = std::thread([&d] {
    d.io.run();
    d.stop_all();
  });
}

server::~server() {
  auto& d = *impl_;
  d.stop_all();
  if (d.io_thread.joinable())
    d.io_thread.join();
  if (d.drainer.joinable())
    d.drainer.join();
  {
    std::lock_guard<std::mutex> lk{d.helper_mtx};
    d.helper_stop = true;
  }
  d.helper_cv.notify_all();
  d.helper.join();
  d.engine.reset();
}

uint16_t server::port() const {
  return impl_->port;
}

void server::drain() {
  auto& d = *impl_;
  if (d.draining.exchange(true))
    return;
  d.do_drain();
}

void server::wait() {
  auto& d = *impl_;
  std::unique_lock<std::mutex> lk{d.state_mtx};
  d.stopped_cv.wait(lk, [&] { return d.stopped; });
}

void server::drain_on_signals() {
  auto& d = *impl_;
  d.signals = std::make_unique<net::signal_set>(d.io, SIGINT, SIGTERM);
  d.signals->async_wait([this](const beast::error_code& ec, int) {
    if (ec)
      return;
    // Draining waits; the I/O thread must go on meanwhile.
    impl_->drainer = std::thread([this] { drain(); });
  });
}

} // namespace troupe
