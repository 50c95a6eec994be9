#pragma once

// The ranks of a tensor-parallel group in one test process, each on a thread of its own
// with its shard of a model and a Gloo communicator, as the model workers run them.

#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cpu/gloo_communicator.hpp"
#include "tests/model_runner.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace troupe::testing {

/// Runs `each(runner, rank)` on every rank of a group of `world` over `ckpt` (whole
/// experts a rank when `expert_parallel`); a rank's exception fails the test, naming it.
template <class Each>
void on_ranks(const model_config& cfg, const checkpoint& ckpt, int32_t world, bool expert_parallel,
              Each each) {
  std::vector<std::unique_ptr<gloo_communicator>> comms;
  std::vector<std::vector<std::string>> table;
  for (int32_t rank = 0; rank < world; ++rank) {
    comms.push_back(
      std::make_unique<gloo_communicator>(rank, world, "127.0.0.1", std::chrono::seconds(30)));
    table.push_back(comms.back()->prepare());
  }
  std::vector<std::string> failures(static_cast<size_t>(world));
  std::vector<std::thread> ranks;
  for (int32_t rank = 0; rank < world; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        auto& comm = *comms[static_cast<size_t>(rank)];
        comm.connect(table);
        cpu_device dev{rank};
        model_runner run{dev,
                         cfg,
                         ckpt,
                         dtype::f32,
                         4,
                         rank,
                         world,
                         [&comm](float* data, size_t count) { comm.all_reduce(data, count); },
                         expert_parallel};
        each(run, rank);
      } catch (const std::exception& e) {
        failures[static_cast<size_t>(rank)] = e.what();
      }
    });
  for (auto& t : ranks)
    t.join();
  for (int32_t rank = 0; rank < world; ++rank)
    REQUIRE_MESSAGE(failures[static_cast<size_t>(rank)].empty(),
                    "rank " << rank << ": " << failures[static_cast<size_t>(rank)]);
}

} // namespace troupe::testing
