// Weights updated in place (an RL trainer's new policy): from a checkpoint on disk and from
// tensors in memory, at TP 1 and 2, checked against transformers' greedy tokens on the new
// weights; an update refused half-way leaves every rank on the old weights; updates while
// asleep; quantized weights only requantized when asked.

#include "model/config.hpp"
#include "model/make_model.hpp"
#include "model/safetensors.hpp"
#include "tests/generation.hpp"
#include "tests/weight_updates.hpp"
#include "troupe/llm.hpp"
#include "troupe/model_worker.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <unistd.h>

using namespace troupe;
using troupe::testing::gives_reference;
using troupe::testing::greedy;
using troupe::testing::host_tensors;
using troupe::testing::other_model;
using troupe::testing::prompts;
using troupe::testing::read_json;
using troupe::testing::scratch;
using troupe::testing::tokens_of;

namespace {

const std::string fixtures = TROUPE_SOURCE_DIR "/tests/fixtures";

/// The GGUF fixture's reference for one file type, in the form of the others.
nlohmann::json gguf_reference(const std::string& type) {
  return {{"prompts", read_json(fixtures + "/llama-gqa-gguf/reference.json")[type]}};
}

llm_config tiny(const std::string& model_path, int32_t tp = 1) {
  llm_config cfg;
  cfg.worker.model_path = model_path;
  cfg.worker.kv_cache_memory_bytes = 2 << 20;
  cfg.executor.block_size = 4;
  cfg.executor.tensor_parallel_size = tp;
  return cfg;
}

} // namespace

TEST_CASE("an update from disk or from tensors gives transformers' tokens on the new weights, "
          "at TP 1 and 2") {
  // Llama with grouped heads; Phi-3's fused projections (seen as their parts); Gemma 2's
  // norms stored as w and used as 1 + w.
  for (std::string fixture : {"llama-gqa", "phi3-fused", "gemma2-standard"}) {
    CAPTURE(fixture);
    auto ref = read_json(fixtures + "/" + fixture + "/reference.json");
    scratch dir{fixture};
    auto other = other_model(fixtures, fixture, dir, 7);
    for (int32_t tp : {1, 2}) {
      CAPTURE(tp);
      llm model{tiny(other, tp)};
      CHECK(!gives_reference(model, ref));
      CHECK(model.weight_version() == 0);
      model.update_weights_from_disk(fixtures + "/" + fixture);
      CHECK(model.weight_version() == 1);
      CHECK(gives_reference(model, ref));
      // Back to the random weights from their file, then the fixture's from memory.
      model.update_weights_from_disk(other);
      CHECK(!gives_reference(model, ref));
      safetensors_file file{fixtures + "/" + fixture + "/model.safetensors"};
      model.update_weights_from_tensors(host_tensors(file));
      CHECK(model.weight_version() == 3);
      CHECK(gives_reference(model, ref));
    }
  }
}

TEST_CASE("a refused update names the parameter and leaves every rank on the old weights") {
  auto ref = read_json(fixtures + "/llama-gqa/reference.json");
  scratch dir{"refused"};
  auto other = other_model(fixtures, "llama-gqa", dir, 11);
  llm model{tiny(other, 2)};
  auto before = tokens_of(model, ref);
  safetensors_file file{fixtures + "/llama-gqa/model.safetensors"};
  auto good = host_tensors(file);
  auto refused = [&](std::vector<host_tensor> tensors, const std::string& named) {
    CAPTURE(named);
    try {
      model.update_weights_from_tensors(tensors);
      FAIL("the update was taken");
    } catch (const error& e) {
      CHECK(e.code() == errc::invalid_argument);
      CHECK(std::string{e.what()}.find(named) != std::string::npos);
    }
    CHECK(tokens_of(model, ref) == before);
    CHECK(model.weight_version() == 0);
  };
  // A name the model does not have, in the middle of good tensors (the update's checks go
  // by name, so some good ones come before it and some after).
  auto bad_name = good;
  bad_name.insert(bad_name.begin() + static_cast<long>(bad_name.size() / 2),
                  {"model.layers.0.self_attn.r_proj.weight", "float32", {64, 64}, good[0].data});
  refused(bad_name, "model.layers.0.self_attn.r_proj.weight");
  // A shape that does not fit.
  auto bad_shape = good;
  for (auto& t : bad_shape)
    if (t.name == "model.layers.1.mlp.down_proj.weight")
      t.shape = {160, 64};
  refused(bad_shape, "model.layers.1.mlp.down_proj.weight");
  // A NaN in the last layer's weights.
  std::vector<float> nan_values(64 * 64, 0.01f);
  nan_values[100] = std::numeric_limits<float>::quiet_NaN();
  auto with_nan = good;
  for (auto& t : with_nan)
    if (t.name == "model.layers.1.self_attn.o_proj.weight")
      t.data = nan_values.data();
  refused(with_nan, "model.layers.1.self_attn.o_proj.weight");
  // A dtype troupe does not read, and the same name twice.
  auto bad_type = good;
  bad_type[3].dtype = "int8";
  refused(bad_type, bad_type[3].name);
  auto twice = good;
  twice.push_back(good[2]);
  refused(twice, good[2].name);
  // Another model's shape on disk.
  try {
    model.update_weights_from_disk(fixtures + "/qwen2-bias");
    FAIL("the update was taken");
  } catch (const error& e) {
    CHECK(std::string{e.what()}.find("differs") != std::string::npos);
  }
  CHECK(tokens_of(model, ref) == before);
  // A partial update is fine: the embeddings alone change the tokens.
  std::vector<host_tensor> embeddings;
  for (auto& t : good)
    if (t.name == "model.embed_tokens.weight")
      embeddings.push_back(t);
  model.update_weights_from_tensors(embeddings);
  CHECK(tokens_of(model, ref) != before);
  CHECK(model.weight_version() == 1);
}

TEST_CASE("an update while asleep wakes the weights, and the KV cache after it") {
  auto ref = read_json(fixtures + "/llama-gqa/reference.json");
  scratch dir{"asleep"};
  auto other = other_model(fixtures, "llama-gqa", dir, 13);
  llm model{tiny(other, 2)};
  safetensors_file file{fixtures + "/llama-gqa/model.safetensors"};
  for (int32_t level : {1, 2}) {
    CAPTURE(level);
    model.update_weights_from_disk(other);
    model.sleep(level);
    model.update_weights_from_tensors(host_tensors(file));
    auto state = model.executor().sleep_state();
    CHECK(state.sleeping_tags == std::vector<std::string>{"kv_cache"});
    model.executor().wake_up();
    CHECK(gives_reference(model, ref));
  }
  // Unfinished requests refuse it.
  model.add_request(prompts(ref)[0]);
  CHECK_THROWS_AS(model.update_weights_from_disk(other), error);
  while (model.has_unfinished_requests())
    model.step();
}

TEST_CASE("quantized weights take float tensors only when asked to quantize them again") {
  // Q8_0's dequantized values quantize back to the same blocks: the same tokens.
  auto gguf = fixtures + "/llama-gqa-gguf/llama-gqa-q8_0.gguf";
  auto ref = gguf_reference("Q8_0");
  llm model{tiny(gguf)};
  auto before = tokens_of(model, ref);
  CHECK(gives_reference(model, ref));
  // The float32 file holds the unquantized weights.
  safetensors_file file{fixtures + "/llama-gqa/model.safetensors"};
  try {
    model.update_weights_from_tensors(host_tensors(file));
    FAIL("the update was taken");
  } catch (const error& e) {
    CHECK(std::string{e.what()}.find("quantize_on_update") != std::string::npos);
  }
  CHECK(tokens_of(model, ref) == before);
  // A Q8_0 file's own weights, dequantized by another engine as float32 and requantized:
  // the dequantized float32 GGUF holds the reference's weights (the F32 row), whose Q8_0
  // blocks are the Q8_0 file's.
  weight_update_options requantize;
  requantize.quantize_on_update = true;
  model.update_weights_from_disk(fixtures + "/llama-gqa-gguf/llama-gqa-f32.gguf", requantize);
  CHECK(tokens_of(model, ref) == before);
  // The CPU's fast path keeps the blocks packed for its GEMMs: an update packs them again.
  auto fast_cfg = tiny(gguf);
  fast_cfg.worker.cpu_precision = cpu_precision_kind::fast;
  llm fast{fast_cfg};
  auto fast_before = tokens_of(fast, ref);
  fast.update_weights_from_disk(fixtures + "/llama-gqa-gguf/llama-gqa-f32.gguf", requantize);
  CHECK(tokens_of(fast, ref) == fast_before);
  // A model loaded with float weights takes them as they are.
  auto as_float = tiny(gguf);
  as_float.worker.dtype = "float32";
  llm exact{as_float};
  exact.update_weights_from_disk(fixtures + "/llama-gqa-gguf/llama-gqa-f32.gguf");
  CHECK(gives_reference(exact, gguf_reference("F32")));
}

TEST_CASE("a worker replaced after updates holds the updated weights, not the checkpoint's") {
  auto ref = read_json(fixtures + "/llama-gqa/reference.json");
  scratch dir{"replaced"};
  auto other = other_model(fixtures, "llama-gqa", dir, 17);
  auto cfg = tiny(other, 2);
  cfg.executor.restart.max_restarts = 4;
  llm model{cfg};
  auto kill = [&](int32_t rank) {
    CHECK_THROWS_AS(troupe::testing::kill_rank(model.executor(), rank), error);
  };
  // From tensors: the replaced rank 1 gets them back.
  safetensors_file file{fixtures + "/llama-gqa/model.safetensors"};
  model.update_weights_from_tensors(host_tensors(file));
  kill(1);
  CHECK(gives_reference(model, ref));
  // From disk (back to the random weights), then rank 0, which keeps the record, dies.
  model.update_weights_from_disk(other);
  auto random = tokens_of(model, ref);
  kill(0);
  CHECK(tokens_of(model, ref) == random);
  // A partial update after a checkpoint: both are replayed, in order.
  std::vector<host_tensor> embeddings;
  for (auto& t : host_tensors(file))
    if (t.name == "model.embed_tokens.weight")
      embeddings.push_back(t);
  model.update_weights_from_tensors(embeddings);
  auto mixed = tokens_of(model, ref);
  CHECK(mixed != random);
  kill(1);
  CHECK(tokens_of(model, ref) == mixed);
  CHECK(model.executor().worker_healths()[1].restarts == 2);
}

TEST_CASE("update_weights_from_bytes writes the tensors its message carries, on every rank") {
  auto ref = read_json(fixtures + "/llama-gqa/reference.json");
  scratch dir{"bytes"};
  llm model{tiny(other_model(fixtures, "llama-gqa", dir, 19), 2)};
  CHECK(!gives_reference(model, ref));
  safetensors_file file{fixtures + "/llama-gqa/model.safetensors"};
  auto tensors = host_tensors(file);
  auto message = [](const std::vector<host_tensor>& ts, int64_t trim) {
    tensor_descriptions described{ts};
    std::vector<std::string> bytes;
    for (auto& t : ts)
      bytes.emplace_back(static_cast<const char*>(t.data), byte_size(t) - trim);
    rpc_call_options call;
    call.args =
      caf::make_message(described.names, described.dtypes, described.dims, described.ndims, bytes);
    return call;
  };
  auto code = [&](const rpc_call_options& call) {
    try {
      model.executor().collective_rpc("update_weights_from_bytes", call);
    } catch (const error& e) {
      return std::make_pair(e.code(), std::string{e.what()});
    }
    return std::make_pair(errc::none, std::string{});
  };
  // A short tensor is refused naming it; arguments of another form, naming the form.
  auto short_one = code(message({tensors[0]}, 4));
  CHECK(short_one.first == errc::invalid_argument);
  CHECK(short_one.second.find(tensors[0].name) != std::string::npos);
  rpc_call_options bare;
  bare.args = caf::make_message(std::vector<std::string>{tensors[0].name});
  CHECK(code(bare).first == errc::bad_arguments);
  CHECK(!gives_reference(model, ref));
  CHECK(code(message(tensors, 0)).first == errc::none);
  model.reset_prefix_cache();
  CHECK(gives_reference(model, ref));
}

namespace {

/// A model worker whose rank `dying` dies (worker_fault) as it begins to write an update
/// from disk, the others writing theirs meanwhile; once, the first time it is armed.
class dies_writing : public model_worker {
public:
  dies_writing(model_worker_options options, std::shared_ptr<std::atomic<int>> dying)
    : model_worker(std::move(options)), dying_(std::move(dying)) {
    register_method("update_weights_from_disk",
                    [this](worker&, const caf::message& args, const caf::settings& kwargs) {
                      auto options = weight_update_options_of(kwargs);
                      if (!options.check_only && dying_->load() == rank()) {
                        dying_->store(-1);
                        throw worker_fault{"died writing an update"};
                      }
                      update_weights_from_disk(args.get_as<std::string>(0), options);
                      return caf::message{};
                    });
  }

private:
  std::shared_ptr<std::atomic<int>> dying_;
};

} // namespace

TEST_CASE("a rank that dies while the others write an update is replaced with the update") {
  auto ref = read_json(fixtures + "/llama-gqa/reference.json");
  scratch dir{"dies-writing"};
  auto other = other_model(fixtures, "llama-gqa", dir, 23);
  auto cfg = tiny(fixtures + "/llama-gqa", 2);
  cfg.executor.restart.max_restarts = 4;
  auto dying = std::make_shared<std::atomic<int>>(-1);
  llm model{cfg, [&](int32_t) { return std::make_unique<dies_writing>(cfg.worker, dying); }};
  REQUIRE(gives_reference(model, ref));
  // What the random weights give, from a model started on them.
  auto random = [&] {
    llm fresh{tiny(other, 2)};
    return tokens_of(fresh, ref);
  }();
  for (int rank : {0, 1}) {
    CAPTURE(rank);
    dying->store(rank);
    // The call says that a worker was replaced; every rank holds the update regardless.
    auto code = errc::none;
    try {
      model.update_weights_from_disk(other);
    } catch (const error& e) {
      code = e.code();
    }
    CHECK(code == errc::worker_replaced);
    CHECK(tokens_of(model, ref) == random);
    // A retry is safe, and so is going back.
    model.update_weights_from_disk(other);
    CHECK(tokens_of(model, ref) == random);
    model.update_weights_from_disk(fixtures + "/llama-gqa");
    CHECK(gives_reference(model, ref));
  }
  CHECK(model.executor().worker_healths()[0].restarts == 1);
  CHECK(model.executor().worker_healths()[1].restarts == 1);
}
