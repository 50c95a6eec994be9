// Test helper: a process that publishes one test worker on 127.0.0.1 (ephemeral port),
// prints the port on stdout and runs until killed or until stdin closes.

#include "actors/worker_actor.hpp"
#include "messages/messages.hpp"
#include "tests/test_worker.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <iostream>

int main() {
  caf::actor_system_config cfg;
  troupe::register_messages(cfg);
  cfg.load<caf::io::middleman>();
  caf::actor_system sys{cfg};
  auto worker = troupe::spawn_worker(sys, troupe::testing::test_factory());
  auto port = sys.middleman().publish(worker, 0, "127.0.0.1");
  if (!port) {
    std::cerr << "worker_host: publish failed: " << troupe::render(port.error()) << "\n";
    return 1;
  }
  std::cout << *port << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    // Runs until the parent closes stdin or kills the process.
  }
  caf::anon_send_exit(worker, caf::exit_reason::user_shutdown);
  return 0;
}
