// Test helper: a worker node (troupe::node) on 127.0.0.1 with the test and model worker
// kinds. Usage: node_host SECRET DEVICES [TIMEOUT_MS [MAX_MESSAGE_BYTES [CERT KEY CA]]]
// (SECRET "-" for none). Prints its port, then runs until
// stdin closes or SIGTERM/SIGINT arrives.

#include "tests/test_worker.hpp"
#include "troupe/model_worker.hpp"
#include "troupe/node.hpp"

#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: node_host SECRET DEVICES [TIMEOUT_MS [MAX_MESSAGE_BYTES]]\n";
    return 2;
  }
  troupe::node_config cfg;
  if (std::string{argv[1]} != "-")
    cfg.secret = argv[1];
  cfg.devices = std::stoi(argv[2]);
  if (argc > 3)
    cfg.connection_timeout = std::chrono::milliseconds(std::stoi(argv[3]));
  if (argc > 4)
    cfg.max_message_bytes = std::stoull(argv[4]);
  if (argc > 7) {
    cfg.tls_certificate = argv[5];
    cfg.tls_key = argv[6];
    cfg.tls_ca = argv[7];
  }
  cfg.kinds["test"] = [](int32_t rank, const caf::settings&) {
    return troupe::testing::test_factory()(rank);
  };
  cfg.kinds["model"] = troupe::model_worker_kind();
  troupe::node n{cfg};
  n.stop_on_signals();
  std::cout << n.port() << std::endl;
  std::thread{[&n] {
    std::string line;
    while (std::getline(std::cin, line)) {
    }
    n.stop();
  }}.detach();
  n.wait();
  std::_Exit(0); // the stdin thread may still be reading

}
