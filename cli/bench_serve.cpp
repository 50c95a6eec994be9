// `troupe bench serve`: the server under load, as vLLM's `bench serve` measures it. An
// in-process `troupe serve` on loopback gets random token prompts from `--concurrency`
// clients at a time (each a connection streaming its completion); prints request
// throughput, output tokens per second, and time to first token and per output token
// (p50, p99) at each concurrency, next to the same engine's offline `generate` of a batch
// of that size (the anchor: what the server adds).

#include "cli/commands.hpp"

#include "troupe/errors.hpp"
#include "troupe/server.hpp"

#include <boost/asio.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

namespace troupe::cli {

namespace {

using clock_type = std::chrono::steady_clock;
namespace net = boost::asio;
using tcp = net::ip::tcp;

/// What one streamed request saw, in seconds from its start.
struct stream_times {
  double first_token = -1;
  double last_token = 0;
  int64_t tokens = 0;
  bool ok = false;
};

/// Posts `body` to /v1/completions on loopback `port` and reads the server-sent events.
stream_times stream_completion(uint16_t port, const std::string& body) {
  stream_times t;
  net::io_context io;
  tcp::socket socket{io};
  boost::system::error_code ec;
  socket.connect({net::ip::address_v4::loopback(), port}, ec);
  if (ec)
    return t;
  auto start = clock_type::now();
  std::string request = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        "Content-Type: application/json\r\nConnection: close\r\n"
                        "Content-Length: " +
                        std::to_string(body.size()) + "\r\n\r\n" + body;
  net::write(socket, net::buffer(request), ec);
  std::string pending;
  char data[8192];
  for (;;) {
    auto n = socket.read_some(net::buffer(data), ec);
    if (ec)
      break;
    pending.append(data, n);
    size_t nl = 0;
    while ((nl = pending.find('\n')) != std::string::npos) {
      auto line = pending.substr(0, nl);
      pending.erase(0, nl + 1);
      if (line.rfind("data: ", 0) != 0)
        continue;
      if (line.compare(6, 6, "[DONE]") == 0) {
        t.ok = true;
        continue;
      }
      auto event = nlohmann::json::parse(line.substr(6), nullptr, false);
      if (event.is_discarded() || !event.contains("choices") || event["choices"].empty())
        continue;
      auto count = static_cast<int64_t>(event["choices"][0]["token_ids"].size());
      if (count == 0)
        continue;
      double at = std::chrono::duration<double>(clock_type::now() - start).count();
      if (t.first_token < 0)
        t.first_token = at;
      t.last_token = at;
      t.tokens += count;
    }
  }
  return t;
}

} // namespace

std::shared_ptr<command> add_bench_serve(CLI::App& bench) {
  struct options {
    engine_options engine;
    workload_options work{0, 64, 64};
    std::vector<int> concurrency{1, 8, 32};
    bool json = false;
  };
  auto o = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  auto* sub = bench.add_subcommand(
    "serve", "Load an in-process troupe serve with concurrent streaming clients");
  cmd->app = sub;
  sub
    ->add_option("--concurrency", o->concurrency,
                 "Clients at once, comma-separated levels (each a run)")
    ->delimiter(',')
    ->check(CLI::Range(1, 4096))
    ->capture_default_str();
  add_workload_options(*sub, o->work);
  sub->add_flag("--json", o->json, "Print only the JSON results, one line per level");
  add_engine_options(*sub, o->engine);
  cmd->run = [o] {
    auto& levels = o->concurrency;
    auto cfg = engine_config(o->engine, 0);
    int max_level = *std::max_element(levels.begin(), levels.end());
    cfg.scheduler.max_num_seqs = std::max(cfg.scheduler.max_num_seqs, max_level);
    llm model{cfg};
    auto workload = [&](int level) {
      auto work = o->work;
      if (work.num_prompts <= 0)
        work.num_prompts = std::max(8, 4 * level);
      return work;
    };
    // The anchor, before the server owns the model: the same engine offline, a batch of
    // `level` requests at once.
    std::map<int, double> anchors;
    for (int level : levels) {
      // Prompts of their own (another seed): only the shared prefix is cached for the
      // served run.
      auto reqs =
        make_workload(workload(level), o->engine.model, 1000 + static_cast<uint32_t>(level));
      reqs.resize(std::min<size_t>(static_cast<size_t>(level), reqs.size()));
      auto offline_start = clock_type::now();
      auto outs = model.generate(reqs);
      std::chrono::duration<double> offline = clock_type::now() - offline_start;
      int64_t offline_tokens = 0;
      for (auto& out : outs)
        offline_tokens += static_cast<int64_t>(out.token_ids.size());
      anchors[level] = static_cast<double>(offline_tokens) / offline.count();
    }
    model.reset_prefix_cache();
    server_config sc;
    sc.port = 0;
    sc.served_model_name = "bench";
    server srv{model, sc};
    for (int level : levels) {
      auto work = workload(level);
      auto reqs = make_workload(work, o->engine.model, static_cast<uint32_t>(level));
      std::vector<std::string> bodies;
      for (auto& r : reqs)
        bodies.push_back(nlohmann::json{
          {"model", "bench"},
          {"prompt", r.prompt_token_ids},
          {"max_tokens", r.sampling.max_tokens},
          {"temperature", 0},
          {"ignore_eos", true},
          {"stream", true}}.dump());
      std::vector<stream_times> times(bodies.size());
      std::atomic<size_t> next{0};
      auto start = clock_type::now();
      std::vector<std::thread> clients;
      for (int c = 0; c < level; ++c)
        clients.emplace_back([&] {
          for (size_t i = next++; i < bodies.size(); i = next++)
            times[i] = stream_completion(srv.port(), bodies[i]);
        });
      for (auto& t : clients)
        t.join();
      std::chrono::duration<double> took = clock_type::now() - start;
      std::vector<double> ttft_ms, tpot_ms;
      int64_t tokens = 0, failed = 0;
      for (auto& t : times) {
        if (!t.ok || t.first_token < 0) {
          ++failed;
          continue;
        }
        tokens += t.tokens;
        ttft_ms.push_back(t.first_token * 1e3);
        if (t.tokens > 1)
          tpot_ms.push_back((t.last_token - t.first_token) * 1e3 /
                            static_cast<double>(t.tokens - 1));
      }
      double served = static_cast<double>(tokens) / took.count();
      double anchor = anchors[level];
      nlohmann::json result = {
        {"model", o->engine.model},
        {"concurrency", level},
        {"num_prompts", work.num_prompts},
        {"input_len", work.input_len},
        {"output_len", work.output_len},
        {"shared_prefix_len", work.shared_prefix_len},
        {"prefix_caching", cfg.scheduler.enable_prefix_caching},
        {"failed", failed},
        {"elapsed_s", took.count()},
        {"requests_per_s", static_cast<double>(times.size() - failed) / took.count()},
        {"output_tokens_per_s", served},
        {"ttft_p50_ms", quantile(ttft_ms, 0.5)},
        {"ttft_p99_ms", quantile(ttft_ms, 0.99)},
        {"tpot_p50_ms", quantile(tpot_ms, 0.5)},
        {"tpot_p99_ms", quantile(tpot_ms, 0.99)},
        {"offline_batch_tokens_per_s", anchor},
        {"served_over_offline", anchor > 0 ? served / anchor : 0.0},
      };
      if (!o->json)
        std::cout << "concurrency " << level << ": " << work.num_prompts << " requests in "
                  << took.count() << " s, " << served << " output tokens/s ("
                  << (anchor > 0 ? served / anchor : 0.0) << "x the offline batch), TTFT p50 "
                  << quantile(ttft_ms, 0.5) << " ms p99 " << quantile(ttft_ms, 0.99)
                  << " ms, TPOT p50 " << quantile(tpot_ms, 0.5) << " ms p99 "
                  << quantile(tpot_ms, 0.99) << " ms\n";
      std::cout << result.dump() << std::endl;
      if (failed > 0)
        return 1;
    }
    return 0;
  };
  return cmd;
}

} // namespace troupe::cli
