// The `troupe` command line.

#include "cli/commands.hpp"

#include <CLI/CLI.hpp>

#include <iostream>

int main(int argc, char** argv) {
  CLI::App app{"troupe: an actor-model executor for LLM inference"};
  app.require_subcommand(1);
  auto bench = app.add_subcommand("bench", "Measure troupe");
  bench->require_subcommand(1);
  auto run_rpc = troupe::cli::add_bench_rpc(*bench);
  auto run_step = troupe::cli::add_bench_step(*bench);
  auto run_generate = troupe::cli::add_bench_generate(*bench);
  auto run_sleep = troupe::cli::add_bench_sleep(*bench);
  auto run_recovery = troupe::cli::add_bench_recovery(*bench);
  auto run_serve = troupe::cli::add_bench_serve(*bench);
  auto run_kernels = troupe::cli::add_bench_kernels(*bench);
  auto make_model = troupe::cli::add_make_model(app);
  auto generate = troupe::cli::add_generate(app);
  auto node = troupe::cli::add_node(app);
  auto serve = troupe::cli::add_serve(app);
  auto perplexity = troupe::cli::add_perplexity(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& cmd : {generate, serve, node, run_rpc, run_step, run_generate, run_sleep,
                      run_recovery, run_serve, run_kernels, make_model, perplexity})
      if (*cmd)
        return cmd->run();
  } catch (const std::exception& e) {
    std::cerr << "troupe: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
