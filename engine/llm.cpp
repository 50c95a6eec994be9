#include "troupe/llm.hpp"

#include "engine/scheduler.hpp"
#include "engine/structured_output.hpp"
#include "model/chat_template.hpp"
#include "model/checkpoint.hpp"
#include "model/tokenizer.hpp"
#include "troupe/model_worker.hpp"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <deque>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <optional>

namespace troupe {

namespace {

/// Seconds of CPU this thread has used.
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

/// One round of an update: checking, or writing what the checking round looked at (its
/// values are not looked at again).
weight_update_options update_round(bool check_only, weight_update_options options) {
  options.check_only = check_only;
  options.values_checked = !check_only;
  return options;
}

/// The weights the workers were updated to, for a replacement: the last checkpoint read
/// (`update_weights_from_disk`), then a copy of each tensor written since (from tensors or
/// the trainer's group). Kept only under a restart policy, as it costs a host copy of what
/// the updates wrote. An update is recorded once every rank has accepted it and before any
/// writes, so a worker that dies while the others write is replaced with it too (writing
/// the same values twice changes nothing).
struct weight_history {
  std::mutex mtx;
  std::string path;
  struct tensor {
    host_tensor meta;
    std::string bytes;
  };
  std::map<std::string, tensor> tensors;
  /// Whether an update wrote float tensors into weights kept in a block format.
  bool quantized = false;

  void record(const std::string& from, bool quantize_on_update) {
    std::lock_guard<std::mutex> lk{mtx};
    path = from;
    tensors.clear();
    quantized = quantize_on_update;
  }

  void record(const std::vector<host_tensor>& written, bool quantize_on_update) {
    std::lock_guard<std::mutex> lk{mtx};
    for (auto& t : written) {
      auto& kept = tensors[t.name];
      kept.meta = t;
      kept.meta.data = nullptr;
      kept.bytes.assign(static_cast<const char*>(t.data), byte_size(t));
    }
    quantized = quantized || quantize_on_update;
  }

  /// The named calls that bring a replacement, its checkpoint just loaded, to these weights.
  std::vector<replay_call> calls() {
    std::lock_guard<std::mutex> lk{mtx};
    std::vector<replay_call> out;
    weight_update_options options;
    options.quantize_on_update = quantized;
    if (!path.empty())
      out.push_back({"update_weights_from_disk", caf::make_message(path), to_kwargs(options)});
    // In calls of up to `part` bytes: a node's link carries a frame of under 4 GiB.
    constexpr size_t part = size_t{256} << 20;
    tensor_descriptions described;
    std::vector<std::string> bytes;
    size_t held = 0;
    auto flush = [&] {
      if (bytes.empty())
        return;
      out.push_back(
        {"update_weights_from_bytes",
         caf::make_message(std::move(described.names), std::move(described.dtypes),
                           std::move(described.dims), std::move(described.ndims), std::move(bytes)),
         to_kwargs(options)});
      described = {};
      bytes = {};
      held = 0;
    };
    for (auto& [name, t] : tensors) {
      if (held > 0 && held + t.bytes.size() > part)
        flush();
      described.add(t.meta);
      bytes.push_back(t.bytes);
      held += t.bytes.size();
    }
    flush();
    return out;
  }
};

} // namespace

struct llm::impl {
  llm_config cfg;
  model_config model;
  std::optional<tokenizer> tok;
  /// The vocabulary's automata for structured output, made with the first request that
  /// asks for it.
  std::unique_ptr<structured_output> structured;
  /// Why the model's tokenizer could not be loaded (empty when it was, or there is none):
  /// only text prompts need it, so it is reported when one comes.
  std::string tokenizer_problem;
  /// The chat template (the config's, else the model's), or why there is none.
  std::optional<chat_template> chat;
  std::string chat_problem;
  std::unique_ptr<troupe::executor> exec;
  cache_blocks blocks;
  /// `exec->sleep_count()` when the prefix cache was last known to be valid.
  int64_t sleeps_seen = 0;
  int64_t next_seq = 0;
  /// The adapter directory of every id used so far: an id keeps its adapter.
  std::map<int64_t, std::string> lora_paths;
  std::map<int64_t, std::string> prompt_adapter_paths;
  /// The virtual tokens of each prompt adapter id, as the workers read them.
  std::map<int64_t, int64_t> virtual_tokens;
  double tokens_per_second = 0;
  int64_t weight_version = 0;
  /// The updates since the checkpoint, for replacements; under a restart policy only.
  std::shared_ptr<weight_history> history;

  /// Runs `update` (a collective call with `check_only` as given) on every rank: first
  /// checking, then `record`ing the update in `history` (if kept), then writing. Wakes
  /// sleeping weights first.
  void update_weights(const std::function<void(bool check_only)>& update,
                      const std::function<void(weight_history&)>& record);

  /// Throws `invalid_argument` while requests are unfinished: an update then would mix two
  /// models in one output.
  void require_idle_for_update() const;

  // The online engine: one scheduler for the life of the model.
  std::unique_ptr<scheduler> sched;
  /// An unfinished request as its caller sees it: what it has been sent so far.
  struct live_request {
    /// The request it is a sample of (its id), and which.
    int64_t request = 0;
    int32_t index = 0;
    /// What the caller gets at the end; the tokens, logprobs and top logprobs are taken
    /// from the scheduler's request then (kept once: a step touches as few lines of memory
    /// as it can, since the attention between steps evicts them at long lengths).
    generation_output out;
    /// Output tokens sent in updates so far.
    size_t reported = 0;
    std::vector<std::string> stop;
    /// Stop strings count from here in the text: after the output's first min_tokens
    /// tokens (less a stop string's length, for one that ends past them); unknown (-1)
    /// until the output has them.
    int64_t stop_from = 0;
    int32_t min_tokens = 0;
    std::chrono::steady_clock::time_point arrived;
    /// Incremental detokenization, as vLLM's: the text of the output's tokens up to
    /// `read_offset`, grown each step by decoding only the tokens from `prefix_offset` on
    /// (the few before the new ones settle merges and leading spaces) and waiting while
    /// they end in a cut-off character.
    std::string text;
    size_t prefix_offset = 0;
    size_t read_offset = 0;
    /// Bytes of `text` sent in updates, and searched for stop strings (all but the tail
    /// a stop string could still end in).
    size_t sent = 0;
    size_t searched = 0;
    /// Structured output: where the output is in its grammar.
    std::shared_ptr<output_guide> guide;
  };
  std::map<int64_t, live_request> live;
  /// What the next step's `apply` reads of `live` (see `hot_set`).
  hot_set hot;
  /// A request of more than one sample: its samples' sequences are its id and the ones
  /// after it. With best_of above n, the finished ones wait in `drawn` for the rest.
  struct sample_group {
    int32_t samples = 1;
    int32_t n = 1;
    int32_t left = 1;
    std::vector<generation_output> drawn;
  };
  std::map<int64_t, sample_group> groups;
  struct in_flight {
    std::future<std::vector<sampler_output>> result;
    bool samples = false;
  };
  /// Steps sent and not yet applied (asynchronous scheduling keeps up to two).
  std::deque<in_flight> steps;
  engine_stats counts;

  void apply(const std::vector<sampler_output>& result, bool samples,
             std::vector<generation_update>& updates);
  /// Gives each group of `step` that samples under structured output its mask.
  void constrain(execute_model_request& step) {
    if (!structured)
      return;
    for (auto& g : step.seq_group_metadata_list) {
      if (!g.do_sample)
        continue;
      auto l = live.find(g.seqs.front().seq_id);
      if (l != live.end() && l->second.guide)
        g.allowed_tokens = l->second.guide->allowed();
    }
  }
  /// Adds the text of `r`'s new tokens to `l.text` (at the end, `finished`, a cut-off
  /// character too). A token the tokenizer does not know (a model whose vocabulary is
  /// larger) leaves the text as it is.
  void detokenize(live_request& l, const engine_request& r, bool finished);
  /// `detokenize`'s texts of the window before the new tokens and with them, kept for
  /// their memory.
  std::string window_before, window;
  /// Where `l`'s stop strings begin in `l.text` (npos for none), looking only where a new
  /// one can be (from `l.searched`, and from `l.stop_from` on, which is set once the
  /// output holds min_tokens tokens).
  size_t find_stop(live_request& l, const engine_request& r) const;
  /// The update of `r` (its text in `live[seq].text`).
  void report(int64_t seq, const engine_request& r, bool finished,
              std::vector<generation_update>& updates);
  /// The last updates of a best_of request: its `n` best samples of `drawn`.
  static void choose_best(int64_t request, int32_t n, std::vector<generation_output> drawn,
                          std::vector<generation_update>& updates);
};

namespace {

/// The length of `text` without its trailing U+FFFD: what the tokenizer decodes the bytes
/// of a character that have come so far to (one for each, with byte fallback).
size_t without_incomplete(const std::string& text) {
  auto keep = text.size();
  while (keep >= 3 && text.compare(keep - 3, 3, "\xEF\xBF\xBD") == 0)
    keep -= 3;
  return keep;
}

} // namespace

void llm::impl::detokenize(live_request& l, const engine_request& r, bool finished) {
  const auto& ids = r.output;
  if (!tok || l.read_offset >= ids.size())
    return;
  try {
    auto begin = ids.data() + l.prefix_offset;
    tok->decode_into(begin, l.read_offset - l.prefix_offset, true, window_before);
    tok->decode_into(begin, ids.size() - l.prefix_offset, true, window);
    const auto& prefix = window_before;
    const auto& whole = window;
    if (whole.size() <= prefix.size())
      return; // nothing new to show (special tokens skipped)
    if (!finished && without_incomplete(whole) < whole.size())
      return; // the new tokens end in a cut-off character: wait for the rest
    // What the window adds past its earlier text, from a character's start. Text already
    // held is never rewritten, even where byte fallback decodes the window otherwise now
    // (as vLLM's detokenizer).
    auto from = prefix.size();
    while (from < whole.size() && (static_cast<unsigned char>(whole[from]) & 0xC0) == 0x80)
      ++from;
    l.text.append(whole, from, std::string::npos);
    l.prefix_offset = l.read_offset;
    l.read_offset = ids.size();
  } catch (const std::exception&) {
  }
}

size_t llm::impl::find_stop(live_request& l, const engine_request& r) const {
  if (l.stop.empty())
    return std::string::npos;
  size_t longest = 0;
  for (auto& stop : l.stop)
    longest = std::max(longest, stop.size());
  if (l.stop_from < 0) {
    if (static_cast<int64_t>(r.output.size()) < l.min_tokens)
      return std::string::npos;
    std::vector<int32_t> first(r.output.begin(), r.output.begin() + l.min_tokens);
    size_t before = 0;
    try {
      before = tok ? tok->decode(first, true).size() : 0;
    } catch (const std::exception&) {
    }
    l.stop_from = static_cast<int64_t>(before > longest - 1 ? before - (longest - 1) : 0);
  }
  auto from = std::min(l.text.size(), std::max(l.searched, static_cast<size_t>(l.stop_from)));
  size_t first = std::string::npos;
  for (auto& stop : l.stop) {
    auto at = stop.empty() ? std::string::npos : l.text.find(stop, from);
    first = std::min(first, at);
  }
  // A stop string found later starts in the last longest - 1 bytes at the earliest.
  if (first == std::string::npos && l.text.size() >= longest)
    l.searched = std::max(l.searched, l.text.size() - (longest - 1));
  return first;
}

void llm::impl::report(int64_t seq, const engine_request& r, bool finished,
                       std::vector<generation_update>& updates) {
  auto& l = live.at(seq);
  auto& out = l.out;
  auto since = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - l.arrived).count();
  };
  auto group = groups.find(l.request);
  // The samples of best_of are told only once all are drawn and the best chosen.
  bool held = group != groups.end() && group->second.samples > group->second.n;
  generation_update u;
  u.request_id = l.request;
  u.index = l.index;
  if (l.reported == 0 && !r.output.empty() && !r.prompt_logprobs.empty()) {
    // The prompt is computed: its logprobs, past a prompt adapter's virtual tokens.
    auto virtual_tokens = static_cast<int32_t>(r.prompt.size() - out.prompt_token_ids.size());
    for (auto p : r.prompt_logprobs)
      if (p.position > virtual_tokens) {
        p.position -= virtual_tokens;
        out.prompt_logprobs.push_back(std::move(p));
      }
    u.prompt_logprobs = out.prompt_logprobs;
  }
  auto from = static_cast<std::ptrdiff_t>(l.reported);
  u.token_ids.assign(r.output.begin() + from, r.output.end());
  u.logprobs.assign(r.logprobs.begin() + from, r.logprobs.end());
  u.ranks.assign(r.ranks.begin() + from, r.ranks.end());
  u.top_logprobs.assign(r.top_logprobs.begin() + from, r.top_logprobs.end());
  l.reported = r.output.size();
  counts.generation_tokens += static_cast<int64_t>(u.token_ids.size());
  if (out.first_token_seconds == 0 && l.reported > 0)
    out.first_token_seconds = since();
  size_t keep = l.text.size();
  if (finished) {
    // A stop string ends the text and is cut off it.
    auto at = find_stop(l, r);
    if (at != std::string::npos)
      l.text.resize(at);
    keep = l.text.size();
  } else {
    // Held back: an incomplete character, and what may be the start of a stop string.
    size_t longest = 0;
    for (auto& stop : l.stop)
      longest = std::max(longest, stop.size());
    keep = without_incomplete(l.text);
    size_t hold = longest > 0 ? longest - 1 : 0;
    keep = keep > hold ? keep - hold : 0;
    // Whole characters only.
    while (keep > 0 && keep < l.text.size() &&
           (static_cast<unsigned char>(l.text[keep]) & 0xC0) == 0x80)
      --keep;
  }
  if (keep > l.sent) {
    u.text = l.text.substr(l.sent, keep - l.sent);
    l.sent = keep;
  }
  if (finished) {
    out.token_ids = r.output;
    out.logprobs = r.logprobs;
    out.ranks = r.ranks;
    out.top_logprobs = r.top_logprobs;
    out.text = std::move(l.text);
    out.index = l.index;
    out.finish_reason = r.finish_reason;
    out.finished_seconds = since();
    if (out.first_token_seconds == 0)
      out.first_token_seconds = out.finished_seconds;
    u.finished = true;
    u.output = std::move(out);
    live.erase(seq);
    if (group != groups.end()) {
      auto& g = group->second;
      --g.left;
      if (held) {
        g.drawn.push_back(std::move(*u.output));
        if (g.left == 0)
          choose_best(group->first, g.n, std::move(g.drawn), updates);
      }
      if (g.left == 0)
        groups.erase(group);
    }
  }
  if (!held)
    updates.push_back(std::move(u));
}

void llm::impl::choose_best(int64_t request, int32_t n, std::vector<generation_output> drawn,
                            std::vector<generation_update>& updates) {
  // vLLM's best_of: the highest sums of logprobs (the earlier sample on a tie).
  auto score = [](const generation_output& o) {
    double sum = 0;
    for (auto lp : o.logprobs)
      sum += lp;
    return sum;
  };
  std::sort(drawn.begin(), drawn.end(),
            [&](const generation_output& a, const generation_output& b) {
              auto x = score(a), y = score(b);
              return x != y ? x > y : a.index < b.index;
            });
  drawn.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    auto& out = drawn[static_cast<size_t>(i)];
    out.index = i;
    generation_update u;
    u.request_id = request;
    u.index = i;
    u.token_ids = out.token_ids;
    u.logprobs = out.logprobs;
    u.ranks = out.ranks;
    u.top_logprobs = out.top_logprobs;
    u.prompt_logprobs = out.prompt_logprobs;
    u.text = out.text;
    u.finished = true;
    u.output = std::move(out);
    updates.push_back(std::move(u));
  }
}

void llm::impl::apply(const std::vector<sampler_output>& result, bool samples,
                      std::vector<generation_update>& updates) {
  // The state this phase reads, asked for at once (see `hot_set`).
  sched->prefetch();
  hot.prefetch();
  if (samples) {
    if (result.empty())
      throw error{errc::worker_error, "execute_model returned no output for a step"};
    sched->update(result[0]);
  }
  // Each request with new tokens is decoded once: a request whose text now holds a stop
  // string ends here, the others report what they add.
  std::vector<int64_t> stopped;
  for (auto& [seq, r] : sched->unfinished()) {
    auto& l = live.at(seq);
    if (r.output.size() == l.reported)
      continue; // nothing new (waiting, swapped, a prefill chunk)
    if (l.guide)
      for (auto i = l.reported; i < r.output.size(); ++i)
        l.guide->accept(r.output[i]);
    detokenize(l, r, false);
    if (find_stop(l, r) != std::string::npos)
      stopped.push_back(seq);
    else
      report(seq, r, false, updates);
  }
  for (auto seq : stopped)
    sched->finish(seq, finish_reason::stop);
  for (auto& r : sched->take_finished()) {
    detokenize(live.at(r.seq_id), r, true);
    report(r.seq_id, r, true, updates);
  }
  hot.clear();
  for (auto& entry : live) {
    hot.add_tree_node(entry);
    if (!entry.second.text.empty())
      hot.add(&entry.second.text.back(), 1);
  }
}

llm_config::llm_config() {
  executor.max_model_len = 0;
  executor.rpc_timeout = std::chrono::minutes(10);
  worker.swap_space_bytes = 256 << 20;
}

void llm_config::validate() const {
  worker.validate();
  scheduler.validate();
  auto ec = executor;
  if (ec.max_model_len == 0)
    ec.max_model_len = 1; // the model's, known once it is read
  ec.validate();
}

llm::llm(llm_config config) : llm(std::move(config), nullptr) {}

llm::llm(llm_config config, worker_factory factory) : impl_(std::make_unique<impl>()) {
  auto& d = *impl_;
  // The workers profile the largest step the scheduler sends.
  config.worker.max_num_batched_tokens = config.scheduler.max_num_batched_tokens;
  config.worker.max_num_seqs = config.scheduler.max_num_seqs;
  config.validate();
  d.cfg = std::move(config);
  auto& path = d.cfg.worker.model_path;
  d.model = checkpoint::config_of(path);
  try {
    d.tok = tokenizer::of_model(path);
  } catch (const error& e) {
    d.tokenizer_problem = e.what();
  }
  try {
    d.chat = chat_template::of_model(path, d.tok ? &*d.tok : nullptr, d.cfg.chat_template);
  } catch (const error& e) {
    d.chat_problem = e.what();
  }
  auto ec = d.cfg.executor;
  auto longest = d.model.max_sequence_length();
  ec.max_model_len = static_cast<int32_t>(
    ec.max_model_len > 0 ? std::min<int64_t>(ec.max_model_len, longest) : longest);
  ec.cluster.node_worker_kind = "model";
  ec.cluster.node_worker_options = to_settings(d.cfg.worker);
  if (ec.restart.max_restarts > 0) {
    // A replacement loads the checkpoint, then the updates its predecessor had.
    d.history = std::make_shared<weight_history>();
    ec.replacement_calls = [history = d.history] { return history->calls(); };
  }
  if (!factory)
    factory = model_worker_factory(d.cfg.worker);
  d.exec = std::make_unique<troupe::executor>(ec, std::move(factory));
  d.blocks = d.exec->determine_num_available_blocks();
  d.exec->initialize_cache(d.blocks);
  scheduler_limits limits;
  limits.max_model_len = d.exec->config().max_model_len;
  limits.max_loras = d.cfg.worker.max_loras;
  limits.max_prompt_adapters = d.cfg.worker.max_prompt_adapters;
  auto scheduling = d.cfg.scheduler;
  // Where the rope changes with the sequence's length (dynamic NTK past
  // max_position_embeddings, LongRoPE's long factors past the original length), a block's
  // keys depend on more than the tokens before it: no block can be shared.
  using rope = rope_scaling_config::kind;
  const auto& rs = d.model.rope_scaling;
  if ((rs.type == rope::dynamic && limits.max_model_len > d.model.max_position_embeddings) ||
      (rs.type == rope::longrope && limits.max_model_len > rs.original_max_position_embeddings))
    scheduling.enable_prefix_caching = false;
  // A sequence that grows past LongRoPE's original length is computed again with the long
  // factors, as transformers does.
  if (rs.type == rope::longrope && limits.max_model_len > rs.original_max_position_embeddings)
    limits.restart_at = rs.original_max_position_embeddings;
  d.sched = std::make_unique<scheduler>(scheduling, limits, d.exec->config().block_size,
                                        d.blocks.num_device_blocks, d.blocks.num_swap_blocks,
                                        d.model.eos_token_ids);
}

llm::~llm() = default;

bool llm::has_tokenizer() const {
  return impl_->tok.has_value();
}

std::vector<int32_t> llm::tokenize(const std::string& text, bool add_special_tokens) const {
  auto& d = *impl_;
  if (!d.tok)
    throw error{errc::invalid_argument,
                (d.tokenizer_problem.empty()
                   ? std::string{"the model has no tokenizer"}
                   : "the model's tokenizer cannot be used (" + d.tokenizer_problem + ")") +
                  ": give prompt token ids instead of text"};
  return d.tok->encode(text, true, add_special_tokens);
}

int64_t llm::vocab_size() const {
  return impl_->model.vocab_size;
}

std::string llm::decode(const std::vector<int32_t>& token_ids) const {
  return impl_->tok ? impl_->tok->decode(token_ids, true) : std::string{};
}

int64_t llm::max_model_len() const {
  return impl_->exec->config().max_model_len;
}

double llm::last_tokens_per_second() const {
  return impl_->tokens_per_second;
}

troupe::executor& llm::executor() {
  return *impl_->exec;
}

const llm_config& llm::config() const {
  return impl_->cfg;
}

std::string llm::chat_prompt(const std::string& user_message) const {
  return chat_prompt(std::vector<chat_message>{{"user", user_message}});
}

std::string llm::chat_prompt(const std::vector<chat_message>& messages) const {
  nlohmann::ordered_json array = nlohmann::ordered_json::array();
  for (auto& m : messages)
    array.push_back({{"role", m.role}, {"content", m.content}});
  chat_request request;
  request.messages_json = array.dump();
  return render_chat(request);
}

std::string llm::render_chat(const chat_request& request) const {
  auto& d = *impl_;
  if (!d.chat)
    throw error{
      errc::unsupported,
      d.chat_problem.empty()
        ? std::string{"the model has no chat template (give one in llm_config::chat_template)"}
        : "the model's chat template cannot be read (" + d.chat_problem + ")"};
  auto parse = [](const std::string& text, const char* what, nlohmann::ordered_json empty) {
    if (text.empty())
      return empty;
    try {
      return nlohmann::ordered_json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw error{errc::invalid_argument, std::string{what} + " is not JSON: " + e.what()};
    }
  };
  return d.chat->render(parse(request.messages_json, "the chat's messages", nullptr),
                        parse(request.tools_json, "the chat's tools", nullptr),
                        parse(request.variables_json, "the chat template's variables",
                              nlohmann::ordered_json::object()),
                        request.add_generation_prompt);
}

std::vector<generation_output> llm::generate(const std::vector<std::string>& prompts,
                                             const sampling_params& sampling) {
  std::vector<generation_request> reqs;
  for (auto& p : prompts) {
    generation_request r;
    r.prompt = p;
    r.sampling = sampling;
    reqs.push_back(std::move(r));
  }
  return generate(reqs);
}

namespace {

/// Records that `id` means the adapter at `path`; refuses an id that meant another one.
void bind_adapter_id(std::map<int64_t, std::string>& paths, const char* kind, int64_t id,
                     const std::string& path) {
  auto [at, fresh] = paths.emplace(id, path);
  if (!fresh && at->second != path)
    throw error{errc::invalid_argument, std::string{kind} + " id " + std::to_string(id) +
                                          " names '" + at->second + "', not '" + path +
                                          "'; remove it first or use another id"};
}

} // namespace

std::map<int64_t, int64_t> llm::load_adapters(const std::vector<generation_request>& requests) {
  auto& d = *impl_;
  auto& exec = *d.exec;
  std::map<int64_t, lora_request> loras;
  std::map<int64_t, prompt_adapter_request> prompt_adapters;
  std::map<int64_t, int64_t> virtual_tokens;
  for (auto& req : requests) {
    if (req.lora) {
      bind_adapter_id(d.lora_paths, "LoRA", req.lora->lora_int_id, req.lora->lora_path);
      loras.emplace(req.lora->lora_int_id, *req.lora);
    }
    if (req.prompt_adapter) {
      auto& pa = *req.prompt_adapter;
      bind_adapter_id(d.prompt_adapter_paths, "prompt adapter", pa.prompt_adapter_id,
                      pa.prompt_adapter_local_path);
      prompt_adapters.emplace(pa.prompt_adapter_id, pa);
    }
  }
  // Adapters the workers have not loaded are added; evicted ones come back when a step
  // names them.
  if (!loras.empty()) {
    auto loaded = exec.list_loras();
    for (auto& [id, req] : loras)
      if (std::find(loaded.begin(), loaded.end(), id) == loaded.end())
        exec.add_lora(req);
  }
  if (!prompt_adapters.empty()) {
    auto loaded = exec.list_prompt_adapters();
    for (auto& [id, req] : prompt_adapters) {
      // The workers read the adapter: as many placeholders as they found virtual tokens,
      // asked again whenever it is added (another program may have put another adapter
      // under the id meanwhile, through the executor).
      auto known = d.virtual_tokens.find(id);
      if (std::find(loaded.begin(), loaded.end(), id) == loaded.end()) {
        exec.add_prompt_adapter(req);
        known = d.virtual_tokens.end();
      }
      if (known == d.virtual_tokens.end())
        known = d.virtual_tokens.insert_or_assign(id, exec.prompt_adapter_virtual_tokens(id)).first;
      virtual_tokens[id] = known->second;
    }
  }
  return virtual_tokens;
}

int64_t llm::add_request(const generation_request& req) {
  return queue(req, load_adapters({req}));
}

int64_t llm::queue(const generation_request& req,
                   const std::map<int64_t, int64_t>& virtual_tokens) {
  auto& d = *impl_;
  auto max_model_len = d.exec->config().max_model_len;
  impl::live_request l;
  l.arrived = std::chrono::steady_clock::now();
  validate(req.sampling, vocab_size());
  l.stop = req.stop;
  l.min_tokens = req.sampling.min_tokens;
  l.stop_from = l.min_tokens > 0 ? -1 : 0;
  auto& out = l.out;
  out.prompt = req.prompt;
  if (!req.prompt_token_ids.empty()) {
    out.prompt_token_ids = req.prompt_token_ids;
    auto vocab = vocab_size();
    for (auto id : out.prompt_token_ids)
      if (id < 0 || id >= vocab)
        throw error{errc::invalid_argument, "prompt token id " + std::to_string(id) +
                                              " is not in the model's vocabulary (0 to " +
                                              std::to_string(vocab - 1) + ")"};
  } else {
    out.prompt_token_ids = tokenize(req.prompt, req.add_special_tokens);
  }
  engine_request r;
  if (req.prompt_adapter) {
    // Placeholders for the adapter's virtual tokens; the workers embed them.
    r.prompt.assign(static_cast<size_t>(virtual_tokens.at(req.prompt_adapter->prompt_adapter_id)),
                    0);
    r.prompt_adapter_id = req.prompt_adapter->prompt_adapter_id;
  }
  r.prompt.insert(r.prompt.end(), out.prompt_token_ids.begin(), out.prompt_token_ids.end());
  if (static_cast<int64_t>(r.prompt.size()) >= max_model_len)
    throw error{errc::invalid_argument,
                "the prompt has " + std::to_string(r.prompt.size()) + " tokens" +
                  (req.prompt_adapter ? " with its virtual tokens" : "") + "; the model allows " +
                  std::to_string(max_model_len) + " with the output"};
  if (req.sampling.max_tokens < 1)
    throw error{errc::invalid_argument,
                "max_tokens must be at least 1, got " + std::to_string(req.sampling.max_tokens)};
  r.lora_int_id = req.lora ? req.lora->lora_int_id : 0;
  r.sampling = req.sampling;
  r.sampling.n = 1;
  r.sampling.best_of = 0;
  if (!r.sampling.bad_words.empty()) {
    // As vLLM: the words become token sequences once, with the model's tokenizer.
    if (!d.tok)
      throw error{errc::invalid_argument,
                  "bad_words needs the model's tokenizer, which this model has none of; give "
                  "bad_words_token_ids"};
    for (auto& ids : bad_words_token_ids(*d.tok, r.sampling.bad_words))
      r.sampling.bad_words_token_ids.push_back(std::move(ids));
    r.sampling.bad_words.clear();
    validate(r.sampling, vocab_size());
  }
  if (r.prompt.empty())
    throw error{errc::invalid_argument, "the prompt is empty"};
  d.counts.prompt_tokens += static_cast<int64_t>(r.prompt.size());
  // Each sample is a sequence of its own after the same prompt (vLLM V1's parallel
  // sampling); the prefix cache shares the prompt's blocks.
  auto samples = req.sampling.best_of > 0 ? req.sampling.best_of : req.sampling.n;
  // Structured output: a guide for each sample (the schema is checked before any is queued).
  std::vector<std::shared_ptr<output_guide>> guides;
  if (guided(req.sampling)) {
    if (!d.tok)
      throw error{errc::invalid_argument, "structured output (guided_json, response_format, "
                                          "guided_choice, guided_regex) needs the model's "
                                          "tokenizer, which this model has none of"};
    if (!d.structured) {
      auto ends = d.model.eos_token_ids;
      if (d.tok->eos_id() >= 0 &&
          std::find(ends.begin(), ends.end(), d.tok->eos_id()) == ends.end())
        ends.push_back(d.tok->eos_id());
      d.structured = std::make_unique<structured_output>(*d.tok, vocab_size(), ends);
    }
    for (int32_t i = 0; i < samples; ++i)
      guides.push_back(d.structured->guide(req.sampling));
  }
  auto id = d.next_seq;
  for (int32_t i = 0; i < samples; ++i) {
    auto sample = r;
    sample.seq_id = d.next_seq++;
    sample.request_id = "req-" + std::to_string(id) + (samples > 1 ? "-" + std::to_string(i) : "");
    if (sample.sampling.seed >= 0) // as vLLM: sample i draws as a request seeded seed + i
      sample.sampling.seed = static_cast<int64_t>(
        (static_cast<uint64_t>(sample.sampling.seed) + static_cast<uint64_t>(i)) &
        static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
    auto each = l;
    each.request = id;
    each.index = i;
    if (!guides.empty())
      each.guide = guides[static_cast<size_t>(i)];
    auto seq = sample.seq_id;
    d.sched->add(std::move(sample));
    d.live.emplace(seq, std::move(each));
  }
  if (samples > 1)
    d.groups[id] = {samples, req.sampling.n, samples, {}};
  return id;
}

void llm::abort_request(int64_t id) {
  auto& d = *impl_;
  int32_t samples = 1;
  if (auto group = d.groups.find(id); group != d.groups.end()) {
    samples = group->second.samples;
  } else {
    auto one = d.live.find(id);
    if (one == d.live.end() || one->second.request != id)
      return; // unknown, finished, or a sample's sequence rather than a request
  }
  for (auto seq = id; seq < id + samples; ++seq)
    if (d.live.count(seq) > 0 && d.sched->unfinished().count(seq) > 0)
      d.sched->finish(seq, finish_reason::abort);
}

bool llm::has_unfinished_requests() const {
  return !impl_->live.empty() || !impl_->steps.empty();
}

std::vector<generation_update> llm::step() {
  auto& d = *impl_;
  auto& sched = *d.sched;
  std::vector<generation_update> updates;
  updates.reserve(d.live.size());
  auto send = [&](execute_model_request& step) {
    bool samples = !step.seq_group_metadata_list.empty();
    d.steps.push_back({d.exec->execute_model_async(std::move(step)), samples});
  };
  auto count = [&](const execute_model_request& step) {
    ++d.counts.steps;
    d.counts.last_step_requests = static_cast<int64_t>(step.seq_group_metadata_list.size());
    d.counts.max_step_requests = std::max(d.counts.max_step_requests, d.counts.last_step_requests);
  };
  // The engine's own time: all of the step but the waits for the workers, on the wall
  // clock and on this thread's CPU clock.
  using clock = std::chrono::steady_clock;
  auto host_start = clock::now();
  auto cpu_start = thread_cpu_seconds();
  clock::duration waited{};
  double waited_cpu = 0;
  auto wait = [&](auto&& f) {
    auto t = clock::now();
    auto c = thread_cpu_seconds();
    auto result = f();
    waited += clock::now() - t;
    waited_cpu += thread_cpu_seconds() - c;
    return result;
  };
  struct host_time {
    engine_stats& counts;
    clock::time_point start;
    clock::duration& waited;
    double cpu_start;
    double& waited_cpu;
    ~host_time() {
      counts.last_step_host_seconds =
        std::chrono::duration<double>(clock::now() - start - waited).count();
      counts.last_step_host_cpu_seconds = thread_cpu_seconds() - cpu_start - waited_cpu;
    }
  } timing{d.counts, host_start, waited, cpu_start, waited_cpu};
  try {
    if (d.steps.empty()) {
      auto sleeps = d.exec->sleep_count();
      if (sleeps != d.sleeps_seen) {
        // The workers slept: their KV caches are gone, the prefix cache with them, and
        // unfinished requests are computed again.
        sched.recompute_all();
        d.sleeps_seen = sleeps;
      }
      if (!sched.has_unfinished()) {
        d.apply({}, false, updates); // requests aborted since the last step
        return updates;
      }
      auto step = sched.schedule();
      d.constrain(step);
      bool samples = !step.seq_group_metadata_list.empty();
      if (!samples && step.blocks_to_swap_in.empty() && step.blocks_to_swap_out.empty() &&
          step.blocks_to_copy.empty()) {
        if (sched.has_unfinished())
          throw error{errc::worker_error, "the scheduler can make no progress"};
        d.apply({}, false, updates); // it finished what could never run ("abort")
        return updates;
      }
      count(step);
      // With asynchronous scheduling, the step after this one is sent before the engine
      // waits, so the workers run it right after. A step with nothing to overlap takes the
      // blocking call, which costs fewer hops.
      auto ahead = d.cfg.scheduler.async_scheduling ? sched.schedule_ahead() : std::nullopt;
      if (!ahead) {
        d.apply(wait([&] { return d.exec->execute_model(std::move(step)); }), samples, updates);
        return updates;
      }
      send(step);
      count(*ahead);
      send(*ahead);
    } else if (auto ahead = sched.schedule_ahead()) {
      count(*ahead);
      send(*ahead);
    }
    auto done = std::move(d.steps.front());
    d.steps.pop_front();
    d.apply(wait([&] { return done.result.get(); }), done.samples, updates);
  } catch (const error& e) {
    // The steps in flight are lost either way, and with them what the caches hold: each
    // request is computed again from its prompt and the tokens it has, which gives the
    // same tokens under greedy or seeded sampling.
    d.steps.clear();
    auto again = static_cast<int64_t>(sched.recompute_all());
    // A worker died and the executor replaced it: the engine goes on. Other errors (the
    // workers sleep, the executor failed) are the caller's; the requests stay queued.
    if (e.code() != errc::worker_replaced)
      throw;
    ++d.counts.recoveries;
    d.counts.recomputed_sequences += again;
  }
  return updates;
}

engine_stats llm::stats() const {
  auto& d = *impl_;
  auto s = d.counts;
  s.running = static_cast<int64_t>(d.sched->num_running());
  s.waiting = static_cast<int64_t>(d.sched->num_waiting());
  s.swapped = static_cast<int64_t>(d.sched->num_swapped());
  auto all = d.sched->device_blocks();
  s.kv_cache_usage =
    all > 0 ? static_cast<double>(d.sched->used_device_blocks()) / static_cast<double>(all) : 0.0;
  s.preemptions = d.sched->preemptions();
  s.prefix_cache_queries = d.sched->prefix_cache_queries();
  s.prefix_cache_hits = d.sched->prefix_cache_hits();
  s.prefill_tokens = d.sched->prefill_tokens();
  s.structured_output_seconds = d.structured ? d.structured->mask_seconds() : 0;
  return s;
}

void llm::reset_prefix_cache() {
  impl_->sched->reset_prefix_cache();
}

void llm::impl::require_idle_for_update() const {
  if (!live.empty() || !steps.empty())
    throw error{errc::invalid_argument,
                "a weight update while requests are unfinished: they would mix two models"};
}

void llm::impl::update_weights(const std::function<void(bool check_only)>& update,
                               const std::function<void(weight_history&)>& record) {
  require_idle_for_update();
  auto state = exec->sleep_state();
  if (std::count(state.sleeping_tags.begin(), state.sleeping_tags.end(), "weights") > 0)
    exec->wake_up({"weights"});
  // Every rank checks before any writes: a refused update leaves all on the old weights
  // (the second round writes what the first looked at).
  update(true);
  if (history)
    record(*history);
  update(false);
  sched->reset_prefix_cache();
  ++weight_version;
}

void llm::update_weights_from_tensors(const std::vector<host_tensor>& tensors,
                                      const weight_update_options& options) {
  impl_->update_weights(
    [&](bool check_only) {
      auto o = update_round(check_only, options);
      impl_->exec->collective_rpc([&](worker& w, const caf::message&, const caf::settings&) {
        auto* mw = dynamic_cast<model_worker*>(&w);
        if (mw == nullptr)
          throw error{errc::unsupported, "update_weights_from_tensors: rank " +
                                           std::to_string(w.rank()) + " is not a model worker"};
        mw->update_weights(tensors, o);
        return caf::message{};
      });
    },
    [&](weight_history& h) { h.record(tensors, options.quantize_on_update); });
}

void llm::update_weights_from_disk(const std::string& path, const weight_update_options& options) {
  impl_->update_weights(
    [&](bool check_only) {
      rpc_call_options call;
      call.args = caf::make_message(path);
      call.kwargs = to_kwargs(update_round(check_only, options));
      impl_->exec->collective_rpc("update_weights_from_disk", call);
    },
    [&](weight_history& h) { h.record(path, options.quantize_on_update); });
}

void llm::init_weights_update_group(const std::string& master_address, int32_t master_port,
                                    int32_t rank_offset, int32_t world_size,
                                    const std::string& backend, timeout_type timeout) {
  rpc_call_options call;
  call.args = caf::make_message(master_address, int64_t{master_port}, int64_t{rank_offset},
                                int64_t{world_size}, backend);
  call.kwargs["timeout"] = std::chrono::duration<double>(timeout).count();
  // The call's own deadline leaves the group's to speak first.
  call.timeout = timeout + std::chrono::seconds(30);
  impl_->exec->collective_rpc("init_weights_update_group", call);
}

void llm::destroy_weights_update_group() {
  impl_->exec->collective_rpc("destroy_weights_update_group");
}

void llm::update_weights_from_distributed(const std::vector<host_tensor>& tensors,
                                          const weight_update_options& options) {
  auto& d = *impl_;
  tensor_descriptions described{tensors};
  // Whatever refuses the update is found before the group hears of it, and the trainer is
  // told "no" rather than left waiting to send.
  std::exception_ptr refused;
  try {
    d.require_idle_for_update();
    rpc_call_options check;
    check.args =
      caf::make_message(described.names, described.dtypes, described.dims, described.ndims);
    check.kwargs = to_kwargs(options);
    d.exec->collective_rpc("check_weight_metadata", check);
  } catch (const error&) {
    refused = std::current_exception();
  }
  rpc_call_options receive;
  receive.args =
    caf::make_message(!refused, described.names, described.dtypes, described.dims, described.ndims);
  try {
    d.exec->collective_rpc("receive_weights", receive);
  } catch (const error&) {
    if (refused)
      std::rethrow_exception(refused); // the first reason, not its echo
    throw;
  }
  if (refused)
    std::rethrow_exception(refused);
  d.update_weights(
    [&](bool check_only) {
      rpc_call_options apply;
      apply.kwargs = to_kwargs(update_round(check_only, options));
      d.exec->collective_rpc("apply_received_weights", apply);
    },
    [&](weight_history& h) {
      // Rank 0 received every tensor whole.
      d.exec->collective_rpc([&h, &options](worker& w, const caf::message&, const caf::settings&) {
        if (auto* mw = dynamic_cast<model_worker*>(&w); mw != nullptr && w.rank() == 0)
          h.record(mw->received_weights(), options.quantize_on_update);
        return caf::message{};
      });
    });
}

int64_t llm::weight_version() const {
  return impl_->weight_version;
}

void llm::sleep(int32_t level) {
  if (has_unfinished_requests())
    throw error{errc::invalid_argument,
                "sleep while requests are unfinished: their KV caches would be lost"};
  // The next step forgets the prefix cache: sleeping discards the KV caches.
  impl_->exec->sleep(level);
}

std::vector<generation_output> llm::generate(const std::vector<generation_request>& requests) {
  return generate(requests, {});
}

std::vector<generation_output> llm::generate(const std::vector<generation_request>& requests,
                                             const std::function<void()>& between_steps) {
  auto& d = *impl_;
  if (has_unfinished_requests())
    throw error{errc::invalid_argument,
                "generate while requests added with add_request are unfinished"};
  // Every request's adapters are checked and loaded before any is queued.
  auto virtual_tokens = load_adapters(requests);
  std::map<int64_t, size_t> index;
  for (size_t i = 0; i < requests.size(); ++i) {
    try {
      index[queue(requests[i], virtual_tokens)] = i;
    } catch (const error& e) {
      for (auto& queued : index)
        abort_request(queued.first);
      while (has_unfinished_requests())
        step();
      throw error{e.code(), "prompt " + std::to_string(i) + ": " + e.what()};
    }
  }
  auto start = std::chrono::steady_clock::now();
  std::vector<std::vector<generation_output>> samples(requests.size());
  for (size_t i = 0; i < requests.size(); ++i)
    samples[i].resize(static_cast<size_t>(requests[i].sampling.n));
  size_t generated = 0;
  while (has_unfinished_requests()) {
    for (auto& u : step())
      if (u.finished) {
        generated += u.output->token_ids.size();
        samples[index.at(u.request_id)][static_cast<size_t>(u.index)] = std::move(*u.output);
      }
    if (!between_steps || !has_unfinished_requests())
      continue;
    try {
      between_steps();
    } catch (...) {
      // The caller gave up: nothing of this call stays queued.
      for (auto& queued : index)
        abort_request(queued.first);
      while (has_unfinished_requests())
        step();
      throw;
    }
  }
  std::vector<generation_output> outputs;
  for (auto& each : samples)
    for (auto& out : each)
      outputs.push_back(std::move(out));
  try {
    d.exec->stop_remote_worker_execution_loop();
  } catch (const error& e) {
    if (e.code() != errc::worker_replaced)
      throw; // a replaced worker ended the loop already
  }
  std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  d.tokens_per_second = took.count() > 0 ? static_cast<double>(generated) / took.count() : 0;
  return outputs;
}

} // namespace troupe
