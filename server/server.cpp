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

/// Bytes of a request a connection's buffer holds before the parser takes them: bounds
/// any one line (a chunk header with an endless extension, say) and what a connection
/// pipelines while its generation runs.
constexpr size_t read_buffer_limit = 64 << 10;
/// Bytes of a next request a connection may send while its generation runs.
constexpr size_t watch_limit = 32 << 10;
/// Bytes of a request's line and headers.
constexpr uint32_t header_limit = 16 << 10;
/// Bytes a connection may have waiting to be sent (a client that does not read).
constexpr size_t write_limit = 16 << 20;

const char* reason_of(int status) {
  switch (status) {
  case 200:
    return "OK";
  case 400:
    return "Bad Request";
  case 401:
    return "Unauthorized";
  case 404:
    return "Not Found";
  case 405:
    return "Method Not Allowed";
  case 409:
    return "Conflict";
  case 413:
    return "Payload Too Large";
  case 429:
    return "Too Many Requests";
  case 431:
    return "Request Header Fields Too Large";
  case 503:
    return "Service Unavailable";
  default:
    return "Internal Server Error";
  }
}

std::string head(int status, const std::string& type, bool keep_alive, std::optional<size_t> length,
                 bool chunked = true) {
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

/// Threads that run jobs from one queue, in order of arrival.
class job_threads {
public:
  explicit job_threads(int count) {
    for (int i = 0; i < count; ++i)
      threads_.emplace_back([this] { loop(); });
  }

  ~job_threads() {
    {
      std::lock_guard<std::mutex> lk{mtx_};
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_)
      t.join();
  }

  void run(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lk{mtx_};
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

private:
  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lk{mtx_};
        cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
        if (stop_)
          return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mtx_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

/// What the connections share: the model, the configuration, the engine's thread, the
/// served adapters.
struct server_core {
  llm& model;
  server_config cfg;
  server_metrics metrics;
  /// Connections open now, and generations being prepared (not yet in the engine). Before
  /// `io`, whose destructor may destroy sessions.
  std::atomic<size_t> connections{0};
  std::atomic<int64_t> preparing{0};
  net::io_context io;
  tcp::acceptor acceptor{io};
  /// Retries an accept that failed (out of file descriptors, say) after a pause.
  net::steady_timer accept_retry{io};
  std::chrono::milliseconds accept_backoff{0};
  std::unique_ptr<engine_loop> engine;
  std::thread io_thread;
  /// Blocking executor calls that must not hold up the I/O thread (health checks).
  std::unique_ptr<job_threads> helper;
  /// What a generation needs before it joins the engine (parsing, the chat template,
  /// tokenizing): neither the I/O thread nor the engine's waits for it.
  std::unique_ptr<job_threads> preparers;
  /// LoRA adapters served: name -> (id, path); loads add to it.
  std::mutex lora_mtx;
  std::map<std::string, std::pair<int64_t, std::string>> loras;
  int64_t next_lora_id = 1;
  std::atomic<int64_t> next_request{1};
  uint16_t port = 0;
  std::atomic<bool> draining{false};
  /// Put to sleep through /sleep (generations get 503 until /wake_up).
  std::atomic<bool> asleep{false};
  /// `llm::weight_version`, for the I/O threads (the engine's thread writes it).
  std::atomic<int64_t> weight_version{0};
  std::mutex state_mtx;
  std::condition_variable stopped_cv;
  bool stopped = false;
  std::thread drainer;
  std::unique_ptr<net::signal_set> signals;

  server_core(llm& m, server_config c)
    : model(m), cfg(std::move(c)), metrics(cfg.served_model_name) {}

  /// Requests the engine may hold, running and waiting; also the bound on those being
  /// prepared.
  int64_t capacity() const {
    return model.config().scheduler.max_num_seqs + cfg.max_waiting_requests;
  }

  /// Requests not finished: in the engine, or being prepared for it.
  int64_t in_flight() const {
    return engine->active() + preparing;
  }

  void accept();
  void do_drain();
  void stop_all();
};

/// The status and body that answer the exception in flight.
std::pair<int, std::string> error_reply() {
  try {
    throw;
  } catch (const http_error& e) {
    return {e.status, e.body()};
  } catch (const request_failure& e) {
    auto he = from_engine(e);
    return {he.status, he.body()};
  } catch (const error& e) {
    auto he = from_engine(e.code(), e.what());
    return {he.status, he.body()};
  } catch (const std::exception& e) {
    return {500, http_error{500, "server_error", e.what()}.body()};
  }
}

/// The values of `key` in a query string ("a=1&b=2").
std::vector<std::string> query_values(const std::string& query, const std::string& key) {
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
}

/// One client connection: reads requests (keep-alive), answers them in order, and for a
/// generation watches the socket so that a client that goes away aborts its request.
/// Every wait on the client has a deadline: for a request to begin, for its header, for
/// its body, and for each write to make progress.
class session : public std::enable_shared_from_this<session> {
public:
  session(tcp::socket socket, server_core& srv)
    : socket_(std::move(socket)), strand_(socket_.get_executor()), deadline_(strand_), srv_(srv),
      buffer_(read_buffer_limit) {
    ++srv_.connections;
  }

  ~session() {
    --srv_.connections;
  }

  void start() {
    if (srv_.connections > srv_.cfg.max_connections) {
      // Closed at once, without lingering: a flood must not hold descriptors.
      keep_alive_ = false;
      return respond(
        503, http_error{503, "server_error",
                        "too many connections: " + std::to_string(srv_.cfg.max_connections) +
                          " are open; try again later"}
               .body());
    }
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
    void fail(const request_failure& f) override {
      net::post(strand, [o = owner, e = from_engine(f)] {
        if (auto s = o.lock())
          s->on_failed(e);
      });
    }
  };

  /// Closes the connection if `wait` passes before `disarm` or the next `arm`.
  void arm(std::chrono::milliseconds wait) {
    deadline_.expires_after(wait);
    deadline_.async_wait([self = shared_from_this(), epoch = ++epoch_](beast::error_code ec) {
      if (ec || epoch != self->epoch_)
        return;
      if (self->sink_)
        self->srv_.engine->abort(self->sink_);
      self->sink_.reset();
      self->close();
    });
  }

  void disarm() {
    ++epoch_;
    deadline_.cancel();
  }

  /// Waits for a request to begin (idle), then reads its header.
  void read() {
    if (closed_)
      return;
    parser_.emplace();
    parser_->header_limit(header_limit);
    parser_->body_limit(srv_.cfg.max_body_bytes);
    if (buffer_.size() > 0) // pipelined: it began already
      return read_header();
    arm(srv_.cfg.idle_timeout);
    socket_.async_wait(
      tcp::socket::wait_read,
      net::bind_executor(strand_, [self = shared_from_this()](beast::error_code ec) {
        if (ec)
          return self->close();
        self->read_header();
      }));
  }

  void read_header() {
    arm(srv_.cfg.header_timeout);
    http::async_read_header(
      socket_, buffer_, *parser_,
      net::bind_executor(strand_, [self = shared_from_this()](beast::error_code ec, size_t) {
        self->on_header(ec);
      }));
  }

  /// The header is in: the key is checked before a byte of the body is read.
  void on_header(beast::error_code ec) {
    if (ec)
      return on_read_error(ec);
    auto& req = parser_->get();
    std::string target{req.target()};
    auto path = target.substr(0, target.find('?'));
    if (needs_key(path) && !authorized(req)) {
      keep_alive_ = false; // its body is never read
      discard_rest_ = true;
      disarm();
      return respond(401,
                     http_error{401, "authentication_error", "a missing or wrong API key"}.body());
    }
    if (parser_->is_done())
      return on_read();
    arm(srv_.cfg.body_timeout);
    http::async_read(
      socket_, buffer_, *parser_,
      net::bind_executor(strand_, [self = shared_from_this()](beast::error_code ec, size_t) {
        if (ec)
          return self->on_read_error(ec);
        self->on_read();
      }));
  }

  /// A request that could not be read: what was too large is answered (and the
  /// connection closed, its rest unread); a malformed request gets 400; a client gone, a
  /// deadline passed or any other error closes the connection.
  void on_read_error(beast::error_code ec) {
    disarm();
    keep_alive_ = false;
    discard_rest_ = true; // a close does without it
    if (ec == http::error::body_limit)
      return respond(413, http_error{413, "invalid_request_error",
                                     "the body is larger than " +
                                       std::to_string(srv_.cfg.max_body_bytes) + " bytes"}
                            .body());
    if (ec == http::error::header_limit)
      return respond(431, http_error{431, "invalid_request_error",
                                     "the request line and headers are longer than " +
                                       std::to_string(header_limit) + " bytes"}
                            .body());
    if (ec == http::error::buffer_overflow)
      return respond(400, http_error{400, "invalid_request_error",
                                     "a line of the request (a chunk's size and extensions) "
                                     "is longer than " +
                                       std::to_string(read_buffer_limit) + " bytes"}
                            .body());
    if (ec.category() == http::make_error_code(http::error::end_of_stream).category() &&
        ec != http::error::end_of_stream && ec != http::error::partial_message)
      return respond(
        400, http_error{400, "invalid_request_error", "a malformed HTTP request: " + ec.message()}
               .body());
    close();
  }

  void on_read() {
    disarm();
    auto req = parser_->release();
    keep_alive_ = req.keep_alive() && !srv_.draining;
    http10_ = req.version() == 10;
    try {
      route(req);
    } catch (...) {
      auto [status, body] = error_reply();
      respond(status, body);
    }
  }

  static bool is_admin(const std::string& path) {
    return path == "/sleep" || path == "/wake_up" || path == "/collective_rpc" ||
           path == "/reset_prefix_cache" || path == "/flush_cache" ||
           path == "/update_weights_from_disk" || path == "/init_weights_update_group" ||
           path == "/update_weights_from_distributed" || path == "/destroy_weights_update_group" ||
           path == "/update_weights_from_tensor" || path == "/v1/load_lora_adapter" ||
           path == "/v1/unload_lora_adapter";
  }

  /// Whether `path` is behind the API key (the API and the admin endpoints); /health,
  /// /metrics and /is_sleeping stay open, and unknown paths get 404 either way.
  static bool needs_key(const std::string& path) {
    return is_admin(path) || path.rfind("/v1/", 0) == 0;
  }

  bool authorized(const http::request<http::string_body>& req) const {
    if (srv_.cfg.api_key.empty())
      return true;
    auto given = std::string{req[http::field::authorization]};
    const std::string bearer = "Bearer ";
    return given.rfind(bearer, 0) == 0 && same_key(given.substr(bearer.size()), srv_.cfg.api_key);
  }

  void route(http::request<http::string_body>& req) {
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
    if (!needs_key(path))
      throw http_error{404, "not_found_error", "no endpoint " + path};
    if (is_admin(path)) {
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
      return generate(std::move(req.body()), path == "/v1/chat/completions");
    }
    throw http_error{404, "not_found_error", "no endpoint " + path};
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
                    {"max_model_len", srv_.model.max_model_len()},
                    {"weight_version", srv_.weight_version.load()}});
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
        if (auto recovering = m.executor().recovery(); !recovering.empty())
          throw unhealthy(recovering);
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
    } catch (...) {
      std::tie(status, body) = error_reply();
    }
    net::post(strand_, [self = shared_from_this(), status, body] { self->respond(status, body); });
  }

  /// Answers with `f` run on the helper thread.
  void on_helper(std::function<json(llm&)> f) {
    auto& model = srv_.model;
    srv_.helper->run([self = shared_from_this(), &model, f] { self->answer(f, model); });
  }

  /// Answers with `f` run on the engine's thread, between steps.
  void on_engine(std::function<json(llm&)> f) {
    srv_.engine->post([self = shared_from_this(), f](llm& m) { self->answer(f, m); });
  }

  void admin_call(const std::string& path, const std::string& query, const std::string& text) {
    auto body = text.empty() ? json::object() : parse_json_object(text);
    auto* srv = &srv_;
    if (path == "/sleep") {
      int32_t level = 1;
      auto levels = query_values(query, "level");
      if (!levels.empty()) {
        if (levels[0] != "1" && levels[0] != "2")
          throw http_error{400, "invalid_request_error", "level must be 1 or 2", "level"};
        level = levels[0][0] - '0';
      }
      return on_engine([srv, level](llm& m) -> json {
        if (m.has_unfinished_requests())
          throw http_error{409, "invalid_request_error",
                           "requests are running; sleep when the server is idle"};
        m.sleep(level);
        srv->asleep = true;
        return json::object();
      });
    }
    if (path == "/reset_prefix_cache" || path == "/flush_cache") {
      return on_engine([](llm& m) -> json {
        m.reset_prefix_cache();
        return json::object();
      });
    }
    if (path.find("weights") != std::string::npos)
      return weight_call(path, body);
    if (path == "/wake_up") {
      auto tags = query_values(query, "tags");
      for (auto& tag : tags)
        if (tag != "weights" && tag != "kv_cache")
          throw http_error{400, "invalid_request_error",
                           "unknown memory tag '" + tag + "': weights or kv_cache", "tags"};
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
      if (body.contains("timeout") && !body["timeout"].is_null()) {
        auto& t = body["timeout"];
        if (!t.is_number() || !(t.get<double>() > 0) || t.get<double>() > 3600)
          throw http_error{400, "invalid_request_error",
                           "'timeout' must be a number of seconds in (0, 3600]", "timeout"};
        opts.timeout = std::chrono::milliseconds(static_cast<int64_t>(t.get<double>() * 1000));
      }
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
    if (path == "/v1/load_lora_adapter") {
      if (!body.contains("lora_path") || !body["lora_path"].is_string())
        throw http_error{400, "invalid_request_error", "'lora_path' must be a string", "lora_path"};
      auto lora_path = body["lora_path"].get<std::string>();
      return on_engine([srv, name, lora_path](llm& m) -> json {
        int64_t id = 0;
        {
          std::lock_guard<std::mutex> lk{srv->lora_mtx};
          if (srv->loras.count(name) > 0 || name == srv->cfg.served_model_name)
            throw http_error{400, "invalid_request_error", "the model name '" + name + "' is taken",
                             "lora_name"};
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
      // Its requests end here; the others go on.
      srv->engine->unload_lora(id, "the LoRA adapter '" + name +
                                     "' was unloaded while the request ran");
      m.executor().remove_lora(id);
      return json::object();
    });
  }

  /// SGLang's weight-update endpoints, answered as SGLang answers them (`success`,
  /// `message`) once the update is done; a refused update is a 400 naming the parameter.
  void weight_call(const std::string& path, const json& body) {
    auto* srv = &srv_;
    auto text = [&](const char* key) {
      if (!body.contains(key) || !body[key].is_string())
        throw http_error{400, "invalid_request_error",
                         std::string{"'"} + key + "' must be a string", key};
      return body[key].get<std::string>();
    };
    auto integer = [&](const char* key, int64_t low, int64_t high) {
      if (!body.contains(key) || !body[key].is_number_integer() || body[key].get<int64_t>() < low ||
          body[key].get<int64_t>() > high)
        throw http_error{400, "invalid_request_error",
                         std::string{"'"} + key + "' must be an integer in [" +
                           std::to_string(low) + ", " + std::to_string(high) + "]",
                         key};
      return static_cast<int32_t>(body[key].get<int64_t>());
    };
    auto done = [srv](llm& m, const std::string& message) -> json {
      srv->weight_version = m.weight_version();
      return {{"success", true}, {"message", message}, {"weight_version", m.weight_version()}};
    };
    auto idle = [](llm& m) {
      if (m.has_unfinished_requests())
        throw http_error{409, "invalid_request_error",
                         "requests are running; update the weights when the server is idle"};
    };
    if (path == "/update_weights_from_disk") {
      auto model_path = text("model_path");
      return on_engine([=](llm& m) -> json {
        idle(m);
        m.update_weights_from_disk(model_path);
        return done(m, "weights updated from " + model_path);
      });
    }
    if (path == "/init_weights_update_group") {
      auto address = text("master_address");
      auto port = integer("master_port", 1, 65535);
      auto offset = integer("rank_offset", 1, 4096);
      auto world = integer("world_size", 2, 4096);
      auto backend = body.contains("backend") ? text("backend") : std::string{"gloo"};
      return on_engine([=](llm& m) -> json {
        m.init_weights_update_group(address, port, offset, world, backend);
        return {{"success", true}, {"message", "joined the weight-update group"}};
      });
    }
    if (path == "/destroy_weights_update_group") {
      return on_engine([](llm& m) -> json {
        m.destroy_weights_update_group();
        return {{"success", true}, {"message", "left the weight-update group"}};
      });
    }
    if (path == "/update_weights_from_distributed") {
      for (auto key : {"names", "dtypes", "shapes"})
        if (!body.contains(key) || !body[key].is_array() ||
            body[key].size() != body["names"].size())
          throw http_error{400, "invalid_request_error",
                           std::string{"'"} + key + "' must be an array, one per name", key};
      std::vector<host_tensor> tensors;
      for (size_t i = 0; i < body["names"].size(); ++i) {
        auto& name = body["names"][i];
        auto& dtype = body["dtypes"][i];
        auto& shape = body["shapes"][i];
        if (!name.is_string() || !dtype.is_string() || !shape.is_array())
          throw http_error{400, "invalid_request_error",
                           "tensor " + std::to_string(i) + ": a name, a dtype and a shape",
                           "names"};
        host_tensor t;
        t.name = name.get<std::string>();
        t.dtype = dtype.get<std::string>();
        if (t.dtype.rfind("torch.", 0) == 0)
          t.dtype = t.dtype.substr(6);
        for (auto& d : shape) {
          if (!d.is_number_integer() || d.get<int64_t>() < 0 ||
              d.get<int64_t>() > (int64_t{1} << 40))
            throw http_error{400, "invalid_request_error",
                             "tensor '" + t.name + "': dimensions are non-negative integers",
                             "shapes"};
          t.shape.push_back(d.get<int64_t>());
        }
        tensors.push_back(std::move(t));
      }
      return on_engine([=](llm& m) -> json {
        m.update_weights_from_distributed(tensors);
        return done(m, "weights updated from the group");
      });
    }
    // /update_weights_from_tensor: SGLang's body holds tensors pickled by PyTorch, which
    // only a Python process can read.
    throw http_error{400, "invalid_request_error",
                     "/update_weights_from_tensor takes PyTorch-pickled tensors, which this "
                     "server cannot read: send them with troupe.WeightSender "
                     "(/update_weights_from_distributed), or write a checkpoint "
                     "(/update_weights_from_disk)",
                     "serialized_named_tensors"};
  }

  /// A generation: prepared off the I/O and engine threads, then queued.
  void generate(std::string body, bool chat) {
    if (srv_.draining)
      throw http_error{503, "server_error", "the server is shutting down"};
    if (srv_.asleep)
      throw http_error{503, "server_error", "the model sleeps; POST /wake_up"};
    if (srv_.preparing.fetch_add(1) >= srv_.capacity()) {
      --srv_.preparing;
      throw http_error{429, "rate_limit_error",
                       "too many requests: " + std::to_string(srv_.capacity()) +
                         " are being read; try again later"};
    }
    // Counted until it is in the engine (or refused), so that a drain waits for it.
    srv_.preparers->run([self = shared_from_this(), body = std::move(body), chat] {
      try {
        auto req = std::make_shared<openai_request>(self->prepared(body, chat));
        net::post(self->strand_, [self, req] {
          self->start_generation(std::move(*req));
          --self->srv_.preparing;
        });
      } catch (...) {
        auto [status, text] = error_reply();
        net::post(self->strand_, [self, status = status, text = std::move(text)] {
          --self->srv_.preparing;
          self->respond(status, text);
        });
      }
    });
  }

  /// The request as the engine takes it: parsed, its adapter found, its chat rendered and
  /// its prompt tokenized, its lengths checked (vLLM's rule: the prompt and `max_tokens`
  /// fit the model's length; without `max_tokens` a chat may fill it).
  openai_request prepared(const std::string& body, bool chat) const {
    auto req = parse_openai_request(body, chat);
    auto& g = req.generation;
    if (req.model.empty())
      req.model = srv_.cfg.served_model_name;
    if (req.model != srv_.cfg.served_model_name) {
      std::lock_guard<std::mutex> lk{srv_.lora_mtx};
      auto at = srv_.loras.find(req.model);
      if (at == srv_.loras.end())
        throw http_error{404, "not_found_error", "the model '" + req.model + "' does not exist",
                         "model"};
      g.lora = lora_request{at->first, at->second.first, at->second.second};
    }
    if (req.chat) {
      g.prompt = srv_.model.render_chat(req.conversation);
      g.add_special_tokens = false; // the template holds them
    }
    try {
      validate(g.sampling, srv_.model.vocab_size()); // logit_bias's tokens
    } catch (const error& e) {
      std::string message = e.what();
      throw http_error{400, "invalid_request_error", message, message.substr(0, message.find(' '))};
    }
    if (!g.prompt_token_ids.empty()) {
      auto vocab = srv_.model.vocab_size();
      for (auto id : g.prompt_token_ids)
        if (id >= vocab)
          throw http_error{400, "invalid_request_error",
                           "prompt token id " + std::to_string(id) +
                             " is not in the model's vocabulary (0 to " +
                             std::to_string(vocab - 1) + ")",
                           "prompt"};
    } else {
      if (!req.chat && g.prompt.empty())
        throw http_error{400, "invalid_request_error", "the prompt is empty", "prompt"};
      g.prompt_token_ids = srv_.model.tokenize(g.prompt, g.add_special_tokens);
    }
    auto prompt = static_cast<int64_t>(g.prompt_token_ids.size());
    auto longest = srv_.model.max_model_len();
    if (prompt >= longest)
      throw http_error{400, "invalid_request_error",
                       "the prompt has " + std::to_string(prompt) +
                         " tokens; the model's maximum context length is " +
                         std::to_string(longest) + " tokens, the output included",
                       req.chat ? "messages" : "prompt"};
    if (!req.max_tokens) {
      g.sampling.max_tokens = static_cast<int32_t>(longest - prompt);
    } else if (*req.max_tokens > longest - prompt) {
      throw http_error{400, "invalid_request_error",
                       "the model's maximum context length is " + std::to_string(longest) +
                         " tokens, and " + std::to_string(prompt + *req.max_tokens) +
                         " were asked for (" + std::to_string(prompt) + " in the prompt, " +
                         std::to_string(*req.max_tokens) + " in the completion)",
                       "max_tokens"};
    } else {
      g.sampling.max_tokens = *req.max_tokens;
    }
    return req;
  }

  void start_generation(openai_request req) {
    if (closed_)
      return;
    try {
      auto n = srv_.next_request++;
      req_ = std::make_unique<openai_request>(std::move(req));
      req_->weight_version = srv_.weight_version;
      response_ = std::make_unique<openai_response>(
        *req_, (req_->chat ? "chatcmpl-" : "cmpl-") + std::to_string(n),
        static_cast<int64_t>(std::time(nullptr)), srv_.model);
      outputs_.assign(static_cast<size_t>(req_->generation.sampling.n), {});
      finished_samples_ = 0;
      sink_ = std::make_shared<sink>(weak_from_this(), strand_);
      srv_.engine->submit(req_->generation, sink_); // may throw 429 / 503
    } catch (...) {
      sink_.reset();
      auto [status, body] = error_reply();
      return respond(status, body);
    }
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
    bool done = false;
    if (u.finished) {
      outputs_.at(static_cast<size_t>(u.index)) = *u.output;
      done = ++finished_samples_ == outputs_.size();
    }
    if (req_->stream) {
      auto events = response_->chunk(u);
      if (done)
        events += response_->end(outputs_);
      if (!events.empty())
        write(frame(events));
      if (done) {
        if (!http10_)
          write(chunked(""));
        done_generating();
      }
    } else if (done) {
      auto body = response_->complete(outputs_);
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
      buffer_.prepare(std::min<size_t>(4096, buffer_.max_size() - buffer_.size())),
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
      if (discard_rest_)
        return linger();
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

  /// Ends a connection whose request was not read to its end (refused from its header, or
  /// too large): closed with bytes unread, it would be reset, and the client could lose
  /// the answer. The sending side is shut; what the client still sends is read and
  /// dropped, for two seconds and 16 MiB at most.
  void linger() {
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    arm(std::chrono::seconds(2));
    drop_input(16 << 20);
  }

  void drop_input(size_t budget) {
    // One buffer for every connection: what is read into it is never looked at, and the
    // one I/O thread reads into it one read at a time.
    static char dropped[16 << 10];
    socket_.async_read_some(net::buffer(dropped),
                            net::bind_executor(strand_, [self = shared_from_this(),
                                                         budget](beast::error_code ec, size_t n) {
                              if (ec || n >= budget)
                                return self->close();
                              self->drop_input(budget - n);
                            }));
  }

  /// Writes the oldest queued bytes, as much as the socket takes; a write that makes no
  /// progress for `send_timeout` ends the connection (and its request).
  void write_next() {
    writing_ = true;
    arm(srv_.cfg.send_timeout);
    auto& front = writes_.front();
    socket_.async_write_some(
      net::buffer(front.data() + written_, front.size() - written_),
      net::bind_executor(strand_, [self = shared_from_this()](beast::error_code ec, size_t n) {
        self->written_ += n;
        if (self->written_ == self->writes_.front().size()) {
          self->queued_bytes_ -= self->writes_.front().size();
          self->writes_.pop_front();
          self->written_ = 0;
        }
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
        self->disarm();
        if (self->response_done_)
          self->after_response();
      }));
  }

  void close() {
    if (closed_)
      return;
    closed_ = true;
    disarm();
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  tcp::socket socket_;
  net::strand<net::any_io_executor> strand_;
  net::steady_timer deadline_;
  /// Counts arms, so that a deadline that fired after its wait ended does nothing.
  uint64_t epoch_ = 0;
  server_core& srv_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::deque<std::string> writes_;
  /// Bytes of the oldest queued write already sent.
  size_t written_ = 0;
  bool writing_ = false;
  size_t queued_bytes_ = 0;
  bool watching_ = false;
  bool response_done_ = false;
  bool keep_alive_ = true;
  bool closed_ = false;
  bool streaming_ = false;
  bool http10_ = false;
  /// The request was refused before it was read to its end: the connection lingers.
  bool discard_rest_ = false;
  /// The response ended while a watch read was outstanding: it reads the next request.
  bool read_after_watch_ = false;
  std::unique_ptr<openai_request> req_;
  std::unique_ptr<openai_response> response_;
  /// The request's samples as they finish (by index), and how many have.
  std::vector<generation_output> outputs_;
  size_t finished_samples_ = 0;
  std::shared_ptr<sink> sink_;
};

} // namespace

struct server::impl : server_core {
  using server_core::server_core;
};

void server_core::accept() {
  acceptor.async_accept(net::make_strand(io), [this](beast::error_code ec, tcp::socket socket) {
    if (!acceptor.is_open())
      return; // closed by a drain or a stop
    if (ec) {
      // Out of file descriptors, say: the connection waits in the listen queue, and
      // accepting resumes after a pause that grows while the error lasts.
      accept_backoff = std::min(std::chrono::milliseconds(1000),
                                std::max(std::chrono::milliseconds(10), accept_backoff * 2));
      std::cerr << "troupe serve: accept failed (" << ec.message() << "); retrying in "
                << accept_backoff.count() << " ms" << std::endl;
      accept_retry.expires_after(accept_backoff);
      accept_retry.async_wait([this](beast::error_code waited) {
        if (!waited)
          accept();
      });
      return;
    }
    accept_backoff = std::chrono::milliseconds(0);
    std::make_shared<session>(std::move(socket), *this)->start();
    accept();
  });
}

void server_core::do_drain() {
  net::post(io, [this] {
    beast::error_code ignored;
    acceptor.close(ignored);
    accept_retry.cancel();
  });
  auto deadline = clock_type::now() + cfg.drain_timeout;
  while (in_flight() > 0 && clock_type::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (in_flight() > 0) {
    engine->abort_all();
    auto grace = clock_type::now() + std::chrono::seconds(5);
    while (in_flight() > 0 && clock_type::now() < grace)
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
  d.cfg.validate();
  d.engine = std::make_unique<engine_loop>(model, d.metrics, d.capacity());
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
  d.helper = std::make_unique<job_threads>(1);
  d.preparers = std::make_unique<job_threads>(2);
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
  d.helper.reset();
  d.preparers.reset();
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

void server_config::validate() const {
  auto positive = [](std::chrono::milliseconds t, const char* name) {
    if (t.count() <= 0)
      throw error{errc::invalid_argument, std::string{"serve: "} + name +
                                            " must be positive, got " + std::to_string(t.count()) +
                                            " ms"};
  };
  positive(idle_timeout, "idle_timeout");
  positive(header_timeout, "header_timeout");
  positive(body_timeout, "body_timeout");
  positive(send_timeout, "send_timeout");
  if (max_connections < 1)
    throw error{errc::invalid_argument, "serve: max_connections must be at least 1"};
  if (max_waiting_requests < 0)
    throw error{errc::invalid_argument, "serve: max_waiting_requests must be 0 or more"};
}

} // namespace troupe
