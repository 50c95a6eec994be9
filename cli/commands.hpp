#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <memory>

namespace troupe::cli {

/// A parsed subcommand: `*this` is true when it was given on the command line.
struct command {
  CLI::App* app = nullptr;
  std::function<int()> run;
  explicit operator bool() const {
    return app != nullptr && app->parsed();
  }
};

/// `troupe bench rpc`: collective_rpc latency of a no-op method.
std::shared_ptr<command> add_bench_rpc(CLI::App& bench);

/// `troupe bench step`: prefill and decode throughput of a model.
std::shared_ptr<command> add_bench_step(CLI::App& bench);

/// `troupe bench generate`: offline request throughput and time per output token.
std::shared_ptr<command> add_bench_generate(CLI::App& bench);

/// `troupe generate`: text from a model.
std::shared_ptr<command> add_generate(CLI::App& app);

/// `troupe make-model`: a random-weight model in Hugging Face format.
std::shared_ptr<command> add_make_model(CLI::App& app);

} // namespace troupe::cli
