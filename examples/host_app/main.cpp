// A plain C++ program that embeds troupe: it defines its own worker (the extension point),
// starts an executor with two workers, calls them with collective_rpc, and puts them through
// a sleep/wake cycle that really releases their memory.

#include <troupe/executor.hpp>

#include <caf/make_message.hpp>

#include <cstring>
#include <iostream>
#include <numeric>

namespace {

/// A worker that keeps a table of numbers in device memory tagged as weights.
class table_worker : public troupe::worker {
public:
  table_worker() {
    register_method("sum", [](troupe::worker& w, const caf::message&, const caf::settings&) {
      auto& self = static_cast<table_worker&>(w);
      auto values = self.table_.as<int64_t>();
      auto n = self.table_.size() / sizeof(int64_t);
      return caf::make_message(std::accumulate(values, values + n, int64_t{0}));
    });
  }

  void load_model() override {
    table_ = troupe::device_buffer(device(), 1 << 20, troupe::memory_tag::weights);
    auto values = table_.as<int64_t>();
    auto n = table_.size() / sizeof(int64_t);
    for (size_t i = 0; i < n; ++i)
      values[i] = static_cast<int64_t>(i) * (rank() + 1);
  }

private:
  troupe::device_buffer table_;
};

} // namespace

int main() {
  troupe::executor_config cfg;
  cfg.tensor_parallel_size = 2;
  try {
    troupe::executor exec{cfg, [](int32_t) { return std::make_unique<table_worker>(); }};
    for (auto& w : exec.workers())
      std::cout << "rank " << w.rank << " on " << w.device << " (pid " << w.pid << ")\n";

    auto before = exec.collective_rpc_as<int64_t>("sum");
    std::cout << "sums: " << before[0] << " " << before[1] << "\n";

    exec.sleep(1);
    auto state = exec.sleep_state();
    std::cout << "asleep: " << state.is_sleeping << ", tags:";
    for (auto& tag : state.sleeping_tags)
      std::cout << " " << tag;
    std::cout << "\n";
    exec.wake_up();

    auto after = exec.collective_rpc_as<int64_t>("sum");
    std::cout << "sums after wake-up: " << after[0] << " " << after[1] << "\n";
    if (after != before) {
      std::cerr << "host_app: the weights changed across sleep and wake-up\n";
      return 1;
    }
    exec.shutdown();
    std::cout << "ok\n";
  } catch (const troupe::error& e) {
    std::cerr << "host_app: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
