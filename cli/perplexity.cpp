// `troupe perplexity`: a model's perplexity over a text, and how far its next-token
// distributions are from a base's, in llama.cpp's log-probability file (as
// `llama-perplexity --kl-divergence-base … [--kl-divergence]`).

#include "cli/commands.hpp"

#include "kernels/platform.hpp"
#include "model/checkpoint.hpp"
#include "model/kv_cache.hpp"
#include "model/llama.hpp"
#include "model/perplexity.hpp"
#include "model/tokenizer.hpp"
#include "troupe/device.hpp"
#include "troupe/errors.hpp"
#include "troupe/model_worker.hpp"

#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <optional>

namespace troupe::cli {

namespace {

/// Whether `tok` starts what it encodes with its BOS token: each chunk then starts with it,
/// as llama.cpp starts them.
bool adds_bos(const tokenizer& tok) {
  if (tok.bos_id() < 0)
    return false;
  auto ids = tok.encode("a", false, true);
  return !ids.empty() && ids.front() == tok.bos_id();
}

} // namespace

std::shared_ptr<command> add_perplexity(CLI::App& app) {
  struct options {
    std::string model;
    std::string text_file;
    int ctx = 512;
    int chunks = 0;
    std::string base;
    std::string save;
    bool json = false;
    device_options device;
  };
  auto o = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  auto* sub = app.add_subcommand(
    "perplexity", "Perplexity over a text, and the KL divergence from a base's log-probabilities");
  cmd->app = sub;
  sub->add_option("--model", o->model, "Hugging Face model directory or GGUF file")->required();
  auto* file = sub->add_option("--file", o->text_file, "Text to score");
  sub->add_option("--ctx", o->ctx, "Tokens per chunk; the second half of each is scored")
    ->check(CLI::Range(4, 1 << 20))
    ->capture_default_str();
  sub->add_option("--chunks", o->chunks, "Chunks scored (0: all the text holds)")
    ->check(CLI::Range(0, 1 << 20))
    ->capture_default_str();
  auto* base = sub->add_option("--kl-divergence-base", o->base,
                               "Log-probabilities of a base model (llama.cpp's file): score its "
                               "tokens and compare");
  sub->add_option("--save-logits", o->save,
                  "Write this model's log-probabilities there, in llama.cpp's file");
  sub->add_flag("--json", o->json, "Print only the JSON result");
  base->excludes(file);
  add_device_options(*sub, o->device);
  cmd->run = [o] {
    if (o->text_file.empty() && o->base.empty())
      throw error{errc::invalid_argument, "perplexity: give --file or --kl-divergence-base"};
    auto cfg = checkpoint::config_of(o->model);
    auto tok = tokenizer::of_model(o->model);
    int32_t bos = tok && adds_bos(*tok) ? tok->bos_id() : -1;
    logprob_file chunks;
    std::ifstream base_in;
    if (!o->base.empty()) {
      base_in.open(o->base, std::ios::binary);
      if (!base_in)
        throw error{errc::invalid_argument, "--kl-divergence-base: cannot open '" + o->base + "'"};
      chunks = logprob_file::read_header(base_in, o->base);
      if (o->chunks > 0)
        chunks.chunks = std::min(chunks.chunks, o->chunks);
    } else {
      if (!tok)
        throw error{errc::invalid_argument, "perplexity: '" + o->model + "' has no tokenizer"};
      auto ids = tok->encode(read_text_file("--file", o->text_file), false, false);
      auto available = static_cast<int64_t>(ids.size()) / o->ctx;
      if (available < 1)
        throw error{errc::invalid_argument, "--file: " + std::to_string(ids.size()) +
                                              " tokens, fewer than one chunk of " +
                                              std::to_string(o->ctx)};
      chunks.ctx = static_cast<uint32_t>(o->ctx);
      chunks.vocab = static_cast<int32_t>(cfg.vocab_size);
      chunks.chunks =
        static_cast<int32_t>(o->chunks > 0 ? std::min<int64_t>(o->chunks, available) : available);
      ids.resize(static_cast<size_t>(chunks.ctx) * static_cast<size_t>(chunks.chunks));
      chunks.tokens = std::move(ids);
      // Written as they are computed, so that every reader of a saved file scores the same
      // tokens.
      if (bos >= 0)
        for (int32_t c = 0; c < chunks.chunks; ++c)
          chunks.tokens[static_cast<size_t>(c) * chunks.ctx] = bos;
    }
    if (chunks.ctx > static_cast<uint32_t>(cfg.max_sequence_length()))
      throw error{errc::invalid_argument, "perplexity: chunks of " + std::to_string(chunks.ctx) +
                                            " tokens are longer than the model's " +
                                            std::to_string(cfg.max_sequence_length()) +
                                            " positions"};

    model_worker_options checked;
    checked.dtype = o->device.dtype;
    checked.cpu_precision = parse_cpu_precision(o->device.cpu_precision);
    checked.validate();
    auto dev = make_device(parse_device_kind(o->device.device), 0);
    auto format = weight_format_for(*dev, o->device.dtype, cfg.torch_dtype);
    platform_of(*dev).share(1);
    llama_model model{
      cfg, *dev, 0, 1, format.type, format.stored_types, o->device.cpu_precision == "fast"};
    model.use_weight_cache(o->device.weight_cache_directory());
    model.load(checkpoint::is_gguf(o->model) ? checkpoint::from_gguf(o->model, cfg)
                                             : checkpoint{o->model});
    const int64_t block = 16;
    kv_cache cache{*dev,
                   cfg.num_hidden_layers,
                   model.local_kv_heads(),
                   cfg.head_dim,
                   block,
                   (static_cast<int64_t>(chunks.ctx) + block - 1) / block,
                   0};

    std::ofstream save;
    if (!o->save.empty()) {
      save.open(o->save, std::ios::binary | std::ios::trunc);
      if (!save)
        throw error{errc::invalid_argument, "--save-logits: cannot write '" + o->save + "'"};
      auto header = chunks;
      header.tokens.resize(static_cast<size_t>(chunks.ctx) * static_cast<size_t>(chunks.chunks));
      header.write_header(save);
    }
    auto r = perplexity(model, cache, chunks, bos, o->base.empty() ? nullptr : &base_in,
                        o->save.empty() ? nullptr : &save);
    if (save && !save.flush())
      throw error{errc::invalid_argument, "--save-logits: writing '" + o->save + "' failed"};

    nlohmann::json out = {{"model", o->model},        {"cpu_precision", o->device.cpu_precision},
                          {"ctx", chunks.ctx},        {"chunks", chunks.chunks},
                          {"positions", r.positions}, {"ppl", r.ppl}};
    if (r.compared) {
      auto& k = r.kld;
      out.update({{"ppl_base", k.ppl_base},
                  {"mean_kld", k.mean_kld},
                  {"kld_uncertainty", k.kld_uncertainty},
                  {"median_kld", k.median_kld},
                  {"kld_99", k.kld_99},
                  {"max_kld", k.max_kld},
                  {"same_top", k.same_top},
                  {"rms_dp", k.rms_dp}});
    }
    if (!o->json) {
      std::cout << "perplexity " << r.ppl << " over " << r.positions << " positions ("
                << chunks.chunks << " chunks of " << chunks.ctx << ")\n";
      if (r.compared)
        std::cout << "KL divergence from the base: " << r.kld.mean_kld << " ± "
                  << r.kld.kld_uncertainty << " nats (99%: " << r.kld.kld_99 << "), same top token "
                  << 100 * r.kld.same_top << " %\n";
    }
    std::cout << out.dump() << "\n";
    return 0;
  };
  return cmd;
}

} // namespace troupe::cli
