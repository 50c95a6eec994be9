// Generation with one local worker and the rest on worker nodes: the calling code is the
// same as for an all-local run; only the placement in llm_config differs.
//
//   cluster_driver MODEL SECRET_FILE HOST:PORT [HOST:PORT ...]

#include <troupe/llm.hpp>

#include <fstream>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: cluster_driver MODEL SECRET_FILE HOST:PORT [HOST:PORT ...]\n";
    return 2;
  }
  troupe::llm_config cfg;
  cfg.worker.model_path = argv[1];
  std::ifstream secret{argv[2]};
  std::getline(secret, cfg.executor.cluster.node_secret);
  for (int i = 3; i < argc; ++i) {
    std::string spec = argv[i];
    auto colon = spec.rfind(':');
    if (colon == std::string::npos) {
      std::cerr << "cluster_driver: '" << spec << "' is not HOST:PORT\n";
      return 2;
    }
    cfg.executor.cluster.nodes.push_back(
      {spec.substr(0, colon), static_cast<uint16_t>(std::stoi(spec.substr(colon + 1))), 1});
  }
  // Rank 0 here, one rank on each node.
  cfg.executor.tensor_parallel_size = 1 + static_cast<int32_t>(cfg.executor.cluster.nodes.size());
  try {
    troupe::llm model{cfg};
    troupe::sampling_params greedy;
    greedy.temperature = 0.0f;
    greedy.max_tokens = 32;
    auto outputs = model.generate({model.chat_prompt("What is the capital of France?"),
                                   model.chat_prompt("Name three primary colours.")},
                                  greedy);
    for (auto& out : outputs)
      std::cout << out.text << "\n";
    auto workers = model.executor().workers();
    std::cout << workers.size() << " workers, pids:";
    for (auto& w : workers)
      std::cout << " " << w.pid;
    std::cout << std::endl;
  } catch (const troupe::error& e) {
    std::cerr << "cluster_driver: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
