// Test helper: an executor in its own process that leases one test worker from the node
// at 127.0.0.1:PORT and keeps calling it. Usage: executor_host PORT SECRET. Prints its
// pid once the worker is leased, then runs until stdin closes or it is killed.

#include "tests/test_worker.hpp"
#include "troupe/executor.hpp"

#include <iostream>
#include <thread>

#include <unistd.h>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: executor_host PORT SECRET\n";
    return 2;
  }
  troupe::executor_config cfg;
  cfg.tensor_parallel_size = 1;
  cfg.cluster.nodes = {{"127.0.0.1", static_cast<uint16_t>(std::stoi(argv[1])), 1}};
  cfg.cluster.node_secret = argv[2];
  cfg.cluster.node_worker_kind = "test";
  cfg.cluster.node_timeout = std::chrono::seconds(1);
  troupe::executor exec{cfg, troupe::testing::test_factory()};
  std::cout << getpid() << std::endl;
  std::atomic<bool> done{false};
  std::thread watch{[&] {
    std::string line;
    while (std::getline(std::cin, line)) {
    }
    done = true;
  }};
  while (!done) {
    exec.collective_rpc("rank");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  watch.join();
  return 0;
}
