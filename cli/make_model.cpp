// `troupe make-model`: writes a random-weight model in Hugging Face format, for tests and
// benchmarks.

#include "cli/commands.hpp"

#include "model/config.hpp"
#include "model/make_model.hpp"

#include <algorithm>
#include <iostream>
#include <map>

namespace troupe::cli {

namespace {

/// What Gemma's published configs set beyond the sizes: GeGLU, tied embeddings, the scalar
/// of head_dim, Gemma 2's caps (50, 30) and window of 4096 every other layer, Gemma 3's
/// q/k norms and window of 512 in five layers of six with a local base of 10000.
void gemma_defaults(model_config& c, bool gemma3) {
  c.hidden_act = "gelu_pytorch_tanh";
  c.tie_word_embeddings = true;
  c.query_pre_attn_scalar = static_cast<double>(c.head_dim);
  c.qk_norm = gemma3;
  c.sliding_window = std::min<int64_t>(gemma3 ? 512 : 4096, c.max_position_embeddings);
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
    c.sliding_layers.push_back(gemma3 ? (layer + 1) % 6 != 0 : layer % 2 == 0);
  if (gemma3) {
    c.local_rope_theta = 10000.0;
  } else {
    c.attn_logit_softcapping = 50.0;
    c.final_logit_softcapping = 30.0;
  }
}

} // namespace

std::shared_ptr<command> add_make_model(CLI::App& app) {
  struct options {
    std::string out;
    std::string arch = "llama";
    std::string preset;
    int64_t layers = 2;
    int64_t hidden = 64;
    int64_t heads = 4;
    int64_t kv_heads = 0;
    int64_t head_dim = 0;
    int64_t intermediate = 0;
    int64_t experts = 8;
    int64_t experts_per_token = 2;
    int64_t expert_intermediate = 0;
    int64_t vocab = 256;
    int64_t max_position = 2048;
    double rope_theta = 10000.0;
    bool tie = false;
    std::string dtype = "f32";
    uint64_t seed = 0;
    int64_t shard_mib = 2048;
  };
  auto o = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  auto* sub =
    app.add_subcommand("make-model", "Write a random-weight model in Hugging Face format");
  cmd->app = sub;
  sub->add_option("--out", o->out, "Directory to write (created)")->required();
  sub
    ->add_option("--arch", o->arch,
                 "llama, mistral, qwen2 (q/k/v bias), qwen3 (q/k norms), phi3 (fused "
                 "projections), gemma2 or gemma3 (Gemma's layers, tied embeddings), mixtral "
                 "or qwen3-moe (mixtures of experts)")
    ->check(CLI::IsMember(
      {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3-moe"}))
    ->capture_default_str();
  sub
    ->add_option("--preset", o->preset,
                 "A known shape instead of the size flags: smollm2-135m (SmolLM2-135M)")
    ->check(CLI::IsMember({"smollm2-135m"}));
  sub->add_option("--layers", o->layers, "Decoder layers")->capture_default_str();
  sub->add_option("--hidden", o->hidden, "Hidden size")->capture_default_str();
  sub->add_option("--heads", o->heads, "Attention heads")->capture_default_str();
  sub->add_option("--kv-heads", o->kv_heads, "Key/value heads (default: --heads)");
  sub->add_option("--head-dim", o->head_dim, "Head size (default: hidden / heads)");
  sub->add_option("--intermediate", o->intermediate, "MLP size (default: 4 x hidden)");
  sub->add_option("--experts", o->experts, "Experts of each layer (mixtral, qwen3-moe)")
    ->check(CLI::Range(1, 4096))
    ->capture_default_str();
  sub->add_option("--experts-per-token", o->experts_per_token, "Experts each token goes to")
    ->check(CLI::Range(1, 4096))
    ->capture_default_str();
  sub->add_option("--expert-intermediate", o->expert_intermediate,
                  "Each qwen3-moe expert's MLP size (default: a quarter of --intermediate; "
                  "mixtral's experts are --intermediate wide)");
  sub->add_option("--vocab", o->vocab, "Vocabulary size")->capture_default_str();
  sub->add_option("--max-position", o->max_position, "max_position_embeddings")
    ->capture_default_str();
  sub->add_option("--rope-theta", o->rope_theta, "Rotary base")->capture_default_str();
  sub->add_flag("--tie", o->tie, "Tie the output head to the embeddings");
  sub->add_option("--dtype", o->dtype, "f32, f16 or bf16")
    ->check(CLI::IsMember({"f32", "f16", "bf16"}))
    ->capture_default_str();
  sub->add_option("--seed", o->seed, "Random seed")->capture_default_str();
  sub
    ->add_option("--shard-size-mib", o->shard_mib,
                 "Largest safetensors file; above it the weights are sharded with an index")
    ->capture_default_str();
  cmd->run = [o] {
    auto type = o->dtype == "f16" ? dtype::f16 : (o->dtype == "bf16" ? dtype::bf16 : dtype::f32);
    auto write = [&](const model_config& c) {
      write_random_model(c, o->out, type, o->seed, o->shard_mib << 20);
      std::cout << "wrote " << c.architecture << " with " << c.num_parameters() << " parameters to "
                << o->out << "\n";
      return 0;
    };
    if (o->preset == "smollm2-135m")
      return write(smollm2_135m_config());
    model_config c;
    std::map<std::string, std::string> archs = {
      {"llama", "LlamaForCausalLM"},       {"mistral", "MistralForCausalLM"},
      {"qwen2", "Qwen2ForCausalLM"},       {"qwen3", "Qwen3ForCausalLM"},
      {"phi3", "Phi3ForCausalLM"},         {"gemma2", "Gemma2ForCausalLM"},
      {"gemma3", "Gemma3ForCausalLM"},     {"mixtral", "MixtralForCausalLM"},
      {"qwen3-moe", "Qwen3MoeForCausalLM"}};
    c.architecture = archs.at(o->arch);
    c.num_hidden_layers = o->layers;
    c.hidden_size = o->hidden;
    c.num_attention_heads = o->heads;
    c.num_key_value_heads = o->kv_heads > 0 ? o->kv_heads : o->heads;
    c.head_dim = o->head_dim > 0 ? o->head_dim : (o->heads > 0 ? o->hidden / o->heads : 0);
    c.intermediate_size = o->intermediate > 0 ? o->intermediate : 4 * o->hidden;
    c.vocab_size = o->vocab;
    c.max_position_embeddings = o->max_position;
    c.rope_theta = o->rope_theta;
    c.tie_word_embeddings = o->tie;
    c.attention_bias = o->arch == "qwen2";
    c.qk_norm = o->arch == "qwen3" || o->arch == "qwen3-moe";
    if (o->arch == "mixtral" || o->arch == "qwen3-moe") {
      c.num_experts = o->experts;
      c.num_experts_per_tok = o->experts_per_token;
      c.moe_intermediate_size = o->arch == "mixtral" ? c.intermediate_size
                                : o->expert_intermediate > 0
                                  ? o->expert_intermediate
                                  : std::max<int64_t>(1, c.intermediate_size / 4);
    }
    c.rms_norm_eps = 1e-5;
    if (o->arch == "gemma2" || o->arch == "gemma3")
      gemma_defaults(c, o->arch == "gemma3");
    return write(c);
  };
  return cmd;
}

} // namespace troupe::cli
