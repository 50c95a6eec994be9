#include "server/metrics.hpp"

#include <sstream>

namespace troupe {

namespace {

// vLLM's buckets for these histograms.
const std::vector<double> first_token_bounds{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                             0.25,  0.5,   0.75, 1.0,  2.5,  5.0,  7.5,  10.0};
const std::vector<double> between_token_bounds{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                                               0.4,  0.5,   0.75, 1.0,   2.5, 5.0,  7.5, 10.0};
const std::vector<double> total_bounds{0.3,  0.5,  0.8,  1.0,  1.5,  2.0,  2.5, 5.0,
                                       10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0};

/// A label value with Prometheus' escapes.
std::string escaped(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"')
      out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

} // namespace

void server_metrics::histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds.size() && v > bounds[i])
    ++i;
  ++counts[i];
  sum += v;
  ++count;
}

server_metrics::server_metrics(std::string model_name)
  : label_("model_name=\"" + escaped(model_name) + "\""),
    first_token_{first_token_bounds, std::vector<int64_t>(first_token_bounds.size() + 1)},
    between_tokens_{between_token_bounds, std::vector<int64_t>(between_token_bounds.size() + 1)},
    total_{total_bounds, std::vector<int64_t>(total_bounds.size() + 1)} {}

void server_metrics::finished(const std::string& reason, double first_token,
                              const std::vector<double>& gaps, double total) {
  std::lock_guard<std::mutex> lk{mtx_};
  ++finished_[reason];
  first_token_.observe(first_token);
  for (auto g : gaps)
    between_tokens_.observe(g);
  total_.observe(total);
}

void server_metrics::stepped(const engine_stats& stats) {
  std::lock_guard<std::mutex> lk{mtx_};
  stats_ = stats;
}

std::string server_metrics::render() const {
  std::lock_guard<std::mutex> lk{mtx_};
  std::ostringstream out;
  auto head = [&](const char* name, const char* type, const char* help) {
    out << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
  };
  auto gauge = [&](const char* name, const char* help, double v) {
    head(name, "gauge", help);
    out << name << '{' << label_ << "} " << v << '\n';
  };
  // A counter's family is named with its _total (as prometheus_client writes it).
  auto counter = [&](const std::string& name, const char* help, int64_t v) {
    head((name + "_total").c_str(), "counter", help);
    out << name << "_total{" << label_ << "} " << v << '\n';
  };
  auto hist = [&](const char* name, const char* help, const histogram& h) {
    head(name, "histogram", help);
    int64_t running = 0;
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      running += h.counts[i];
      out << name << "_bucket{" << label_ << ",le=\"" << h.bounds[i] << "\"} " << running << '\n';
    }
    out << name << "_bucket{" << label_ << ",le=\"+Inf\"} " << h.count << '\n';
    out << name << "_sum{" << label_ << "} " << h.sum << '\n';
    out << name << "_count{" << label_ << "} " << h.count << '\n';
  };
  gauge("vllm:num_requests_running", "Requests in the running batch.",
        static_cast<double>(stats_.running));
  gauge("vllm:num_requests_waiting", "Requests waiting for their first step or a recomputation.",
        static_cast<double>(stats_.waiting));
  gauge("vllm:num_requests_swapped", "Requests swapped out to host memory.",
        static_cast<double>(stats_.swapped));
  gauge("vllm:kv_cache_usage_perc", "Fraction of the KV-cache blocks in use (1 = all).",
        stats_.kv_cache_usage);
  counter("vllm:prompt_tokens", "Prompt tokens taken.", stats_.prompt_tokens);
  counter("vllm:generation_tokens", "Tokens generated.", stats_.generation_tokens);
  counter("vllm:num_preemptions", "Requests preempted.", stats_.preemptions);
  counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
          stats_.prefix_cache_queries);
  counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
          stats_.prefix_cache_hits);
  head("vllm:request_success_total", "counter", "Requests finished, by why.");
  for (auto& [reason, n] : finished_)
    out << "vllm:request_success_total{" << label_ << ",finished_reason=\"" << escaped(reason)
        << "\"} " << n << '\n';
  counter("troupe:engine_steps", "Engine steps run.", stats_.steps);
  counter("troupe:recoveries", "Workers replaced under the restart policy while the engine ran.",
          stats_.recoveries);
  counter("troupe:recomputed_sequences",
          "Sequences computed again from their prompts and tokens after a replacement.",
          stats_.recomputed_sequences);
  gauge("troupe:step_requests", "Requests in the last step.",
        static_cast<double>(stats_.last_step_requests));
  gauge("troupe:step_requests_max", "The most requests in one step so far.",
        static_cast<double>(stats_.max_step_requests));
  hist("vllm:time_to_first_token_seconds", "Time from arrival to the first token.", first_token_);
  hist("vllm:inter_token_latency_seconds", "Time between a request's tokens.", between_tokens_);
  hist("vllm:e2e_request_latency_seconds", "Time from arrival to the end.", total_);
  return out.str();
}

} // namespace troupe
