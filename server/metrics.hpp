#pragma once

/// @file
/// The server's Prometheus metrics, under vLLM's names where vLLM has them.

#include "troupe/engine_loop.hpp"
#include "troupe/llm.hpp"

#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace troupe {

/// Counts requests and their latencies (from the engine's thread) and renders them, with
/// the engine's last counts, in Prometheus' text format (from any thread).
class server_metrics : public engine_loop_observer {
public:
  explicit server_metrics(std::string model_name);

  /// A request ended: why, and its times in seconds (to the first token, between tokens,
  /// in all).
  void finished(const std::string& reason, double first_token, const std::vector<double>& gaps,
                double total) override;

  /// The engine's counts after a step.
  void stepped(const engine_stats& stats) override;

  /// The exposition: `# HELP`, `# TYPE` and the samples of every metric.
  std::string render() const;

private:
  struct histogram {
    std::vector<double> bounds;
    std::vector<int64_t> counts; // per bucket, not cumulative; one more for +Inf
    double sum = 0;
    int64_t count = 0;
    void observe(double v);
  };

  std::string label_;
  mutable std::mutex mtx_;
  engine_stats stats_;
  std::map<std::string, int64_t> finished_;
  histogram first_token_, between_tokens_, total_;
};

} // namespace troupe
