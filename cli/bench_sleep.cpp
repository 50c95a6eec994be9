// `troupe bench sleep`: how fast a device sleeps (level 1: weights backed up to host memory,
// then released) and wakes (memory mapped again, weights restored), next to a plain copy of
// the same bytes between device and host memory measured in the same run.

#include "cli/commands.hpp"

#include "troupe/device.hpp"
#include "troupe/errors.hpp"

#include "kernels/cuda_module.hpp"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <iostream>
#include <vector>

namespace troupe::cli {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_of(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

/// A host buffer of `bytes` for the plain-copy baseline: pinned on a GPU, as the backups are.
struct host_buffer {
  void* data = nullptr;
  bool pinned = false;
  host_buffer(device& dev, std::size_t bytes) {
    if (is_cuda(dev)) {
      data = cuda().allocate_pinned(bytes);
      if (data == nullptr)
        throw error{errc::memory_error, "bench sleep: no pinned host buffer"};
      pinned = true;
      return;
    }
    data = ::operator new(bytes);
    std::memset(data, 1, bytes); // touched: the baseline copies resident pages
  }
  ~host_buffer() {
    if (pinned)
      cuda().free_pinned(data);
    else
      ::operator delete(data);
  }
};

} // namespace

std::shared_ptr<command> add_bench_sleep(CLI::App& bench) {
  struct options {
    std::string device = "cpu";
    double gib = 1.0;
    int cycles = 3;
    bool json = false;
  };
  auto o = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  cmd->app = bench.add_subcommand("sleep", "Level-1 sleep and wake-up bandwidth of a device");
  cmd->app->add_option("--device", o->device, "cpu or cuda (device 0)")->capture_default_str();
  cmd->app->add_option("--gib", o->gib, "GiB of weights to sleep and wake")
    ->check(CLI::Range(0.01, 1024.0))
    ->capture_default_str();
  cmd->app->add_option("--cycles", o->cycles, "Sleep/wake cycles (the best is reported)")
    ->check(CLI::Range(1, 100))
    ->capture_default_str();
  cmd->app->add_flag("--json", o->json, "Print only JSON");
  cmd->run = [o] {
    auto dev = make_device(parse_device_kind(o->device), 0);
    auto bytes = static_cast<std::size_t>(o->gib * (1 << 30));
    auto weights = dev->allocate(bytes, memory_tag::weights);
    host_buffer host{*dev, bytes};
    dev->copy(weights, host.data, bytes);
    double best_sleep = 1e30, best_wake = 1e30, best_down = 1e30, best_up = 1e30;
    double returned = 0;
    for (int c = 0; c < o->cycles; ++c) {
      auto start = clock_type::now();
      dev->copy(host.data, weights, bytes);
      best_down = std::min(best_down, seconds_of(start));
      start = clock_type::now();
      dev->copy(weights, host.data, bytes);
      best_up = std::min(best_up, seconds_of(start));
      auto awake_free = dev->free_memory();
      start = clock_type::now();
      dev->sleep(sleep_level::offload_weights);
      best_sleep = std::min(best_sleep, seconds_of(start));
      returned = static_cast<double>(dev->free_memory()) - static_cast<double>(awake_free);
      start = clock_type::now();
      dev->wake_up({});
      best_wake = std::min(best_wake, seconds_of(start));
    }
    dev->deallocate(weights);
    auto gbps = [&](double s) { return static_cast<double>(bytes) / s / 1e9; };
    nlohmann::json out = {{"device", dev->name()},
                          {"bytes", bytes},
                          {"sleep_gbps", gbps(best_sleep)},
                          {"wake_gbps", gbps(best_wake)},
                          {"copy_to_host_gbps", gbps(best_down)},
                          {"copy_to_device_gbps", gbps(best_up)},
                          {"host_buffer_pinned", host.pinned},
                          {"returned_fraction", returned / static_cast<double>(bytes)}};
    if (!o->json)
      std::cout << dev->name() << ": sleep(1) " << gbps(best_sleep) << " GB/s, wake "
                << gbps(best_wake) << " GB/s; plain copies " << gbps(best_down) << " GB/s to host, "
                << gbps(best_up) << " GB/s back; " << returned / (1 << 20)
                << " MiB returned while asleep\n";
    std::cout << out.dump() << std::endl;
    return 0;
  };
  return cmd;
}

} // namespace troupe::cli
