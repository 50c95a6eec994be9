#pragma once

/// @file
/// An OpenAI-compatible HTTP server over a `troupe::llm` (`troupe serve`).

#include "troupe/llm.hpp"

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace troupe {

/// What the server serves and how.
struct server_config {
  /// Address to listen on (loopback unless another is given); port 0 picks one.
  std::string host = "127.0.0.1";
  uint16_t port = 8000;
  /// Requests to /v1 and the admin endpoints must carry `Authorization: Bearer KEY`;
  /// empty for none. /health, /metrics and /is_sleeping stay open.
  std::string api_key;
  /// The model's name in requests and in /v1/models.
  std::string served_model_name = "model";
  /// LoRA adapters served as models of their own: name -> PEFT directory.
  std::map<std::string, std::string> loras;
  /// The admin endpoints: /sleep, /wake_up, /v1/load_lora_adapter,
  /// /v1/unload_lora_adapter and /collective_rpc.
  bool enable_admin_api = false;
  /// Requests that may wait beyond those running; more get 429.
  int32_t max_waiting_requests = 256;
  /// How long `drain` lets requests in flight finish before it aborts them.
  std::chrono::milliseconds drain_timeout{30000};
  /// Largest request body accepted.
  size_t max_body_bytes = 8 << 20;
  /// Connections open at once; one more is answered 503 and closed. Keep it below the
  /// process's file-descriptor limit (the server also outlives running out of them: it
  /// pauses accepting and tries again).
  size_t max_connections = 1000;
  /// How long a connection may wait to begin a request (a new one, or between keep-alive
  /// requests) before it is closed.
  std::chrono::milliseconds idle_timeout{30000};
  /// How long a request's line and headers may take from their first byte (a client that
  /// sends a byte now and then is cut off here).
  std::chrono::milliseconds header_timeout{10000};
  /// How long a request's body may take after its header.
  std::chrono::milliseconds body_timeout{60000};
  /// How long a write to a client may make no progress (a client that stops reading); the
  /// connection and its request end then.
  std::chrono::milliseconds send_timeout{60000};

  /// Throws `troupe::error` (`invalid_argument`) naming a timeout that is not positive, no
  /// connection allowed, or a negative waiting bound.
  void validate() const;
};

/// Serves `model` over HTTP/1.1 with keep-alive: `POST /v1/completions` and
/// `/v1/chat/completions` (OpenAI's shapes, streaming as server-sent events),
/// `GET /v1/models`, `/health`, `/metrics` (Prometheus text, vLLM's names) and the admin
/// endpoints. Requests of every client join the engine's one continuous batch: a thread of
/// its own runs the engine's steps and hands each update to its connection by message, so
/// neither side blocks the other. A client that disconnects aborts its request. Every
/// wait on a client has a deadline, every size a bound, and the API key is checked from the
/// header before the body is read.
class server {
public:
  /// Starts listening and the engine's thread. Throws `troupe::error` (`invalid_argument`)
  /// when `config` is out of range or the address cannot be bound. The model must outlive the
  /// server, and nothing else may use it meanwhile.
  server(llm& model, server_config config);
  /// Stops at once (see `drain` for a graceful end).
  ~server();

  server(const server&) = delete;
  server& operator=(const server&) = delete;

  /// The port it listens on.
  uint16_t port() const;

  /// Stops accepting, lets the requests in flight finish within `drain_timeout`, aborts the
  /// rest, and stops; `wait` then returns. Idempotent; any thread.
  void drain();

  /// Blocks until the server has stopped.
  void wait();

  /// Makes SIGINT and SIGTERM call `drain` (handlers installed for the process).
  void drain_on_signals();

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace troupe
