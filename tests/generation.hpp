#pragma once

// Helpers of the tests that generate with real models.

#include "model/safetensors.hpp"
#include "tests/skip.hpp"
#include "troupe/errors.hpp"
#include "troupe/executor.hpp"
#include "troupe/worker.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace troupe::testing {

/// A JSON fixture.
inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in{path};
  return nlohmann::json::parse(in);
}

/// max |a - b| / max |b| over b's elements.
inline double relative_error(const float* a, const std::vector<float>& b) {
  double diff = 0;
  double scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::fabs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(b[i])));
  }
  return diff / scale;
}

/// Greedy sampling of `max_tokens` tokens that runs past EOS.
inline sampling_params greedy(int32_t max_tokens) {
  sampling_params sp;
  sp.temperature = 0.0f;
  sp.max_tokens = max_tokens;
  sp.ignore_eos = true;
  return sp;
}

/// Where the demo keeps SmolLM2-135M-Instruct: $TROUPE_MODEL_CACHE or ~/.cache/troupe/models.
inline std::filesystem::path cached_smollm2() {
  std::filesystem::path cache;
  if (auto env = std::getenv("TROUPE_MODEL_CACHE"))
    cache = env;
  else if (auto home = std::getenv("HOME"))
    cache = std::filesystem::path{home} / ".cache" / "troupe" / "models";
  return cache / "SmolLM2-135M-Instruct.Q4_1.gguf";
}

/// SmolLM2-135M-Instruct from the model cache; when it is not there the test case is
/// skipped, with the reason, and the path returned is empty.
inline std::filesystem::path smollm2_or_skip() {
  auto path = cached_smollm2();
  if (std::filesystem::exists(path))
    return path;
  skip(path.string() + " is not in the model cache (scripts/fetch-smollm2.sh fetches it)");
  return {};
}

/// Copies the model in directory `from` (config.json + model.safetensors, float32) to
/// `to`, with `change` applied to the values of tensor `name`: another version of the same
/// model, or a broken one.
inline void copy_model_changing(const std::string& from, const std::filesystem::path& to,
                                const std::string& name,
                                const std::function<void(float*)>& change) {
  std::filesystem::create_directories(to);
  std::filesystem::copy_file(from + "/config.json", to / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  safetensors_file source{from + "/model.safetensors"};
  std::vector<std::vector<char>> copies;
  safetensors_writer out;
  for (auto& t : source.tensors()) {
    copies.emplace_back(reinterpret_cast<const char*>(t.data),
                        reinterpret_cast<const char*>(t.data) + t.bytes);
    if (t.name == name)
      change(reinterpret_cast<float*>(copies.back().data()));
    out.add(t.name, t.type, t.shape, copies.back().data(), copies.back().size());
  }
  out.write((to / "model.safetensors").string());
}

/// `steps` greedy tokens after `prompt`, one sequence stepping through the executor with
/// device blocks 0..`blocks`-1.
inline std::vector<int32_t> greedy_tokens(executor& exec, const std::vector<int32_t>& prompt,
                                          size_t steps, int32_t blocks = 16) {
  sequence_group_metadata g;
  g.request_id = "r";
  g.is_prompt = true;
  g.seqs.push_back({0, prompt, static_cast<int32_t>(prompt.size()), 0, {}});
  for (int32_t b = 0; b < blocks; ++b)
    g.seqs[0].block_table.push_back(b);
  g.token_chunk_size = static_cast<int32_t>(prompt.size());
  g.sampling.temperature = 0.0f;
  std::vector<int32_t> generated;
  for (size_t step = 0; step < steps; ++step) {
    execute_model_request req;
    req.seq_group_metadata_list.push_back(g);
    auto token = exec.execute_model(req)[0].outputs[0].samples[0].output_token;
    generated.push_back(token);
    g.seqs[0].num_computed_tokens += g.token_chunk_size;
    g.seqs[0].token_ids.push_back(token);
    g.token_chunk_size = 1;
    g.is_prompt = false;
  }
  return generated;
}

/// Makes the worker of `rank` die as a broken device would: it throws `worker_fault`.
inline std::vector<caf::message> kill_rank(executor& exec, int32_t rank) {
  return exec.collective_rpc([rank](worker& w, const caf::message&, const caf::settings&) {
    if (w.rank() == rank)
      throw worker_fault{"injected fault"};
    return caf::message{};
  });
}

} // namespace troupe::testing
