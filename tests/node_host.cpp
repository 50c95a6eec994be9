// Test helper: a worker node (troupe::node) on 127.0.0.1 with the test and model worker
// kinds. Usage: node_host [--fault=kill@N|stop@N|kill@update|stop@update]
// [--network-linger-us=N] SECRET DEVICES [TIMEOUT_MS [MAX_MESSAGE_BYTES [CERT KEY CA]]]
// (SECRET "-" for none). Prints its port, then runs until stdin closes or SIGTERM/SIGINT
// arrives. With --fault the process kills (SIGKILL) or stops (SIGSTOP) itself as its model
// workers start their N-th step, or start writing an update from disk: a node lost in the
// middle, at a point the test chooses.

#include "tests/test_worker.hpp"
#include "troupe/model_worker.hpp"
#include "troupe/node.hpp"

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

/// The signal a --fault sends and the step it comes at (0: none), or at an update.
int fault_signal = 0;
int fault_step = 0;
bool fault_in_update = false;
std::atomic<int> steps{0};

/// A model worker that brings its node down at the chosen step or update.
class faulty_node_worker : public troupe::model_worker {
public:
  explicit faulty_node_worker(troupe::model_worker_options options)
    : model_worker(std::move(options)) {
    if (!fault_in_update)
      return;
    register_method("update_weights_from_disk", [](troupe::worker& w, const caf::message& args,
                                                   const caf::settings& kwargs) {
      auto options = troupe::weight_update_options_of(kwargs);
      if (!options.check_only)
        raise(fault_signal); // the first round checked: the node goes as the writes begin
      static_cast<model_worker&>(w).update_weights_from_disk(args.get_as<std::string>(0), options);
      return caf::message{};
    });
  }

  std::vector<troupe::sampler_output>
  execute_model(const troupe::execute_model_request& request) override {
    if (fault_step > 0 && ++steps == fault_step)
      raise(fault_signal);
    return model_worker::execute_model(request);
  }
};

} // namespace

int main(int argc, char** argv) {
  troupe::node_config cfg;
  for (; argc > 1 && std::string{argv[1]}.rfind("--", 0) == 0; --argc, ++argv) {
    std::string flag = argv[1];
    if (flag.rfind("--network-linger-us=", 0) == 0) {
      cfg.network_linger = std::chrono::microseconds(std::atoll(flag.c_str() + 20));
      continue;
    }
    auto at = flag.find('@');
    auto what = flag.rfind("--fault=", 0) == 0
                  ? flag.substr(8, at == std::string::npos ? std::string::npos : at - 8)
                  : std::string{};
    fault_signal = what == "kill" ? SIGKILL : what == "stop" ? SIGSTOP : 0;
    fault_in_update = at != std::string::npos && flag.substr(at + 1) == "update";
    fault_step = at == std::string::npos || fault_in_update ? 0 : std::atoi(flag.c_str() + at + 1);
    if (fault_signal == 0 || (fault_step < 1 && !fault_in_update)) {
      std::cerr << "node_host: --fault=kill@N, --fault=stop@N (N >= 1), --fault=kill@update, "
                   "--fault=stop@update or --network-linger-us=N, not "
                << flag << "\n";
      return 2;
    }
  }
  if (argc < 3) {
    std::cerr << "usage: node_host [--fault=kill@N|stop@N|kill@update|stop@update] "
                 "[--network-linger-us=N] SECRET "
                 "DEVICES [TIMEOUT_MS [MAX_MESSAGE_BYTES [CERT KEY CA]]]\n";
    return 2;
  }
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
  cfg.kinds["model"] = [](int32_t,
                          const caf::settings& settings) -> std::unique_ptr<troupe::worker> {
    return std::make_unique<faulty_node_worker>(troupe::model_worker_options_from(settings));
  };
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
  if (auto failure = n.failure(); !failure.empty()) {
    std::cerr << "node_host: " << failure << std::endl;
    std::_Exit(1);
  }
  std::_Exit(0); // the stdin thread may still be reading
}
