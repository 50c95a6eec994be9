// `troupe serve`: the OpenAI-compatible HTTP server (troupe/server.hpp) over a model.

#include "cli/commands.hpp"

#include "troupe/errors.hpp"
#include "troupe/server.hpp"

#include <iostream>

namespace troupe::cli {

std::shared_ptr<command> add_serve(CLI::App& app) {
  struct options {
    engine_options engine;
    std::string host = "127.0.0.1";
    int port = 8000;
    std::string api_key;
    std::string api_key_file;
    std::string served_model_name;
    std::vector<std::string> loras;
    bool enable_admin_api = false;
    int max_waiting = 256;
    double drain_timeout_s = 30;
    size_t max_connections = server_config{}.max_connections;
    double idle_timeout_s = 30;
    double header_timeout_s = 10;
    double body_timeout_s = 60;
    double send_timeout_s = 60;
  };
  auto o = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  auto* sub = app.add_subcommand(
    "serve", "Serve a model over HTTP with OpenAI's API (completions, chat, streaming)");
  cmd->app = sub;
  sub->add_option("--host", o->host, "Address to listen on")->capture_default_str();
  sub->add_option("--port", o->port, "Port to listen on (0 picks one)")
    ->check(CLI::Range(0, 65535))
    ->capture_default_str();
  auto* key =
    sub->add_option("--api-key", o->api_key, "Requests must carry 'Authorization: Bearer KEY'");
  sub->add_option("--api-key-file", o->api_key_file, "A file holding the API key")->excludes(key);
  sub->add_option("--served-model-name", o->served_model_name,
                  "The model's name in requests (default: --model)");
  sub->add_option("--lora", o->loras,
                  "A PEFT LoRA adapter served as model NAME, as NAME=PATH (repeatable)");
  sub->add_flag("--enable-admin-api", o->enable_admin_api,
                "Serve /sleep, /wake_up, /v1/load_lora_adapter, /v1/unload_lora_adapter and "
                "/collective_rpc");
  sub
    ->add_option("--max-waiting-requests", o->max_waiting,
                 "Requests that may wait beyond --max-num-seqs; more get 429")
    ->check(CLI::Range(0, 1 << 20))
    ->capture_default_str();
  sub
    ->add_option("--drain-timeout", o->drain_timeout_s,
                 "Seconds SIGINT/SIGTERM let running requests finish before aborting them")
    ->check(CLI::Range(0.0, 1e6))
    ->capture_default_str();
  sub
    ->add_option("--max-connections", o->max_connections,
                 "Connections open at once; more are answered 503 (keep it below the file "
                 "descriptor limit)")
    ->check(CLI::Range(size_t{1}, size_t{1} << 24))
    ->capture_default_str();
  auto seconds = [&](const char* name, double& value, const char* what) {
    sub->add_option(name, value, what)->check(CLI::Range(0.001, 1e6))->capture_default_str();
  };
  seconds("--idle-timeout", o->idle_timeout_s,
          "Seconds a connection may wait to begin a request before it is closed");
  seconds("--header-timeout", o->header_timeout_s,
          "Seconds a request's line and headers may take from their first byte");
  seconds("--body-timeout", o->body_timeout_s, "Seconds a request's body may take");
  seconds("--send-timeout", o->send_timeout_s,
          "Seconds a write to a client may make no progress before the connection ends");
  add_engine_options(*sub, o->engine);
  cmd->run = [o] {
    server_config sc;
    sc.host = o->host;
    sc.port = static_cast<uint16_t>(o->port);
    sc.api_key = o->api_key;
    if (!o->api_key_file.empty())
      sc.api_key = read_text_file("--api-key-file", o->api_key_file);
    sc.served_model_name = o->served_model_name.empty() ? o->engine.model : o->served_model_name;
    for (auto& spec : o->loras) {
      auto [name, path] = name_and_path("--lora", spec);
      if (!sc.loras.emplace(name, path).second)
        throw error{errc::invalid_argument, "--lora: '" + name + "' is given twice"};
    }
    sc.enable_admin_api = o->enable_admin_api;
    sc.max_waiting_requests = o->max_waiting;
    auto ms = [](double s) { return std::chrono::milliseconds(static_cast<int64_t>(s * 1000)); };
    sc.drain_timeout = ms(o->drain_timeout_s);
    sc.max_connections = o->max_connections;
    sc.idle_timeout = ms(o->idle_timeout_s);
    sc.header_timeout = ms(o->header_timeout_s);
    sc.body_timeout = ms(o->body_timeout_s);
    sc.send_timeout = ms(o->send_timeout_s);
    llm model{engine_config(o->engine, sc.loras.size())};
    server s{model, sc};
    s.drain_on_signals();
    std::cout << "troupe serve: " << sc.served_model_name << " on http://" << sc.host << ":"
              << s.port() << std::endl;
    s.wait();
    std::cerr << "troupe serve: drained and stopped" << std::endl;
    return 0;
  };
  return cmd;
}

} // namespace troupe::cli
