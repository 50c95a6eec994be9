#pragma once

// What the weight-update suites share (test_weight_update on the CPU, test_gpu_model on a
// GPU): another model of a fixture's shape, the fixture's prompts, and whether a model
// gives transformers' greedy tokens for them.

#include "model/config.hpp"
#include "model/make_model.hpp"
#include "model/safetensors.hpp"
#include "tests/generation.hpp"
#include "troupe/llm.hpp"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

namespace troupe::testing {

/// A scratch directory, removed with the object.
struct scratch {
  std::filesystem::path path;
  explicit scratch(const std::string& name)
    : path(std::filesystem::temp_directory_path() /
           ("troupe-update-" + name + "-" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
  }
  ~scratch() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// Another model of `fixture`'s shape: random weights from `seed`, the fixture's config.
inline std::string other_model(const std::string& fixtures, const std::string& fixture,
                               const scratch& dir, uint64_t seed) {
  write_random_model(load_model_config(fixtures + "/" + fixture), dir.path.string(), dtype::f32,
                     seed);
  std::filesystem::copy_file(fixtures + "/" + fixture + "/config.json", dir.path / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  return dir.path.string();
}

/// The fixture's prompts with greedy sampling of its reference's length.
inline std::vector<generation_request> prompts(const nlohmann::json& ref) {
  std::vector<generation_request> reqs;
  for (auto& p : ref["prompts"])
    reqs.push_back({"",
                    p["token_ids"].get<std::vector<int32_t>>(),
                    greedy(static_cast<int32_t>(p["greedy"].size())),
                    {}});
  return reqs;
}

/// Whether the model generates transformers' greedy tokens for every prompt of `ref`.
inline bool gives_reference(llm& model, const nlohmann::json& ref) {
  auto outs = model.generate(prompts(ref));
  bool same = outs.size() == ref["prompts"].size();
  for (size_t i = 0; same && i < outs.size(); ++i)
    same = outs[i].token_ids == ref["prompts"][i]["greedy"].get<std::vector<int32_t>>();
  return same;
}

inline std::vector<std::vector<int32_t>> tokens_of(llm& model, const nlohmann::json& ref) {
  std::vector<std::vector<int32_t>> out;
  for (auto& o : model.generate(prompts(ref)))
    out.push_back(o.token_ids);
  return out;
}

/// Every tensor of a safetensors file, as an update takes them (views of the mapping).
inline std::vector<host_tensor> host_tensors(const safetensors_file& file) {
  std::vector<host_tensor> out;
  for (auto& t : file.tensors())
    out.push_back({t.name, dtype_name(t.type), t.shape, t.data});
  return out;
}

} // namespace troupe::testing
