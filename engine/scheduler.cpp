#include "engine/scheduler.hpp"

#include "troupe/errors.hpp"

#include <algorithm>
#include <set>

namespace troupe {

void scheduler_config::validate() const {
  if (max_num_batched_tokens < 1 || max_num_seqs < 1)
    throw error{errc::invalid_argument,
                "max_num_batched_tokens and max_num_seqs must be at least 1, got " +
                  std::to_string(max_num_batched_tokens) + " and " + std::to_string(max_num_seqs)};
}

scheduler::scheduler(scheduler_config config, scheduler_limits limits, int32_t block_size,
                     int64_t device_blocks, int64_t swap_blocks, std::vector<int32_t> eos_token_ids)
  : config_(config), limits_(limits),
    blocks_(block_size, device_blocks, swap_blocks, 0.01, config.enable_prefix_caching),
    eos_(std::move(eos_token_ids)) {
  config_.validate();
  if (limits_.max_model_len <= 0)
    throw error{errc::invalid_argument, "max_model_len must be positive"};
}

void scheduler::add(engine_request request) {
  if (request.prompt.empty())
    throw error{errc::invalid_argument, "request '" + request.request_id + "' has an empty prompt"};
  if (requests_.count(request.seq_id) > 0)
    throw error{errc::invalid_argument,
                "sequence id " + std::to_string(request.seq_id) + " is already in use"};
  auto seq = request.seq_id;
  requests_.emplace(seq, std::move(request));
  waiting_.push_back(seq);
}

block_manager::tokens_view scheduler::tokens_of(const engine_request& r) {
  // Blocks computed under different adapters hold different keys and values.
  auto salt = static_cast<uint64_t>(r.lora_int_id) * 0x9e3779b97f4a7c15ULL +
              static_cast<uint64_t>(r.prompt_adapter_id) * 0xc2b2ae3d27d4eb4fULL;
  return {r.prompt, r.output, salt};
}

bool scheduler::has_unfinished() const {
  return !requests_.empty();
}

void scheduler::append_group(engine_request& r, int64_t chunk, bool is_prompt,
                             execute_model_request& step) {
  sequence_group_metadata g;
  g.request_id = r.request_id;
  g.is_prompt = is_prompt;
  sequence_data seq;
  seq.seq_id = r.seq_id;
  seq.num_prompt_tokens = static_cast<int32_t>(r.prompt.size());
  seq.num_computed_tokens = static_cast<int32_t>(r.pending > 0 ? r.length() : r.num_computed);
  // Only the tokens this step computes, unless the sampling reads them all: a step's request
  // does not grow with the outputs.
  seq.first_token = reads_history(r.sampling) ? 0 : seq.num_computed_tokens;
  auto known = r.length();
  seq.token_ids.reserve(static_cast<size_t>(known - seq.first_token + 1));
  for (int64_t p = seq.first_token; p < known; ++p)
    seq.token_ids.push_back(p < static_cast<int64_t>(r.prompt.size())
                              ? r.prompt[static_cast<size_t>(p)]
                              : r.output[static_cast<size_t>(p) - r.prompt.size()]);
  // A step ahead: the step in flight computes the last known token and samples the one this
  // step computes.
  if (r.pending > 0)
    seq.token_ids.push_back(pending_token);
  g.do_sample = !is_prompt || r.num_computed + chunk >= r.length();
  if (is_prompt)
    prefill_tokens_ += chunk;
  if (g.do_sample)
    ++r.pending;
  else
    r.chunk = chunk;
  blocks_.blocks_to_send(r.seq_id, seq.first_block, seq.block_table);
  // The blocks this step fills are known to the requests scheduled after it, in this step
  // too: each layer writes the whole step's keys and values before any token attends.
  blocks_.cache_computed(r.seq_id, tokens_of(r), seq.num_computed_tokens + chunk);
  g.seqs.push_back(std::move(seq));
  g.sampling = r.sampling;
  // What only the engine reads stays here: the workers get structured output's mask.
  g.sampling.guided_json.clear();
  g.sampling.guided_choice.clear();
  g.sampling.guided_regex.clear();
  g.token_chunk_size = static_cast<int32_t>(chunk);
  g.lora_int_id = r.lora_int_id;
  g.prompt_adapter_id = r.prompt_adapter_id;
  step.seq_group_metadata_list.push_back(std::move(g));
  scheduled_.push_back(r.seq_id);
}

void scheduler::preempt(int64_t seq) {
  ++preemptions_;
  running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
  // A chunked prefill under way starts over rather than come back as a decode.
  if (config_.preempt_by_swap && !prefilling(requests_.at(seq)) && blocks_.can_swap_out({seq})) {
    // schedule() asks the block manager for the moves and puts them in the step.
    swapped_.push_back(seq);
    return;
  }
  // Recompute: drop the cache and start over from the prompt and the tokens so far.
  restart(seq);
}

bool scheduler::restarts_at(int64_t position) const {
  return limits_.restart_at > 0 && position == limits_.restart_at;
}

void scheduler::restart(int64_t seq) {
  running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
  blocks_.free(seq);
  requests_.at(seq).num_computed = 0;
  requests_.at(seq).chunk = 0;
  waiting_.push_front(seq);
}

bool scheduler::at_length_limit(const engine_request& r) const {
  return static_cast<int64_t>(r.output.size()) + r.pending >= r.sampling.max_tokens ||
         r.length() + r.pending >= limits_.max_model_len;
}

execute_model_request scheduler::schedule() {
  if (!in_flight_.empty())
    throw error{errc::invalid_argument,
                "scheduler: schedule() while a step is in flight; update() it first"};
  execute_model_request step;
  step.seq_group_metadata_list.reserve(running_.size() + swapped_.size() + waiting_.size());
  scheduled_.clear();
  int64_t budget = config_.max_num_batched_tokens;
  // Prompt logprobs come from a row of logits per prompt token (a vocabulary of floats to the
  // host each): a step computes at most this many such tokens.
  int64_t logprob_rows = max_prompt_logprob_rows;
  auto rows_of = [&](const engine_request& r, int64_t chunk) {
    return r.sampling.prompt_logprobs >= 0 ? std::min(chunk, logprob_rows) : chunk;
  };
  auto spend_rows = [&](const engine_request& r, int64_t chunk) {
    if (r.sampling.prompt_logprobs >= 0)
      logprob_rows -= chunk;
  };
  bool preempted = false;
  std::vector<int64_t> to_swap_out;

  // 1. Running requests decode one token each; when one cannot grow, the most recently
  //    admitted gives way until it can.
  auto running = running_;
  for (auto seq : running) {
    if (std::find(running_.begin(), running_.end(), seq) == running_.end())
      continue; // preempted for an earlier one
    auto& r = requests_.at(seq);
    auto fits = [&] {
      auto have = static_cast<int64_t>(blocks_.block_table(seq).size()) * blocks_.block_size();
      return have >= r.length() || blocks_.free_device_blocks() > 0;
    };
    while (!fits()) {
      auto victim = running_.back();
      auto swapped_before = swapped_.size();
      preempt(victim);
      if (swapped_.size() > swapped_before) {
        for (auto& m : blocks_.swap_out({victim}))
          step.blocks_to_swap_out.push_back(m);
      }
      preempted = true;
      if (victim == seq)
        break;
    }
    if (std::find(running_.begin(), running_.end(), seq) == running_.end())
      continue;
    if (budget < 1 || static_cast<int64_t>(scheduled_.size()) >= config_.max_num_seqs)
      continue;
    if (restarts_at(r.num_computed) && !prefilling(r)) {
      // Its keys so far rotate with the factors of a shorter sequence: it goes back to the
      // waiting requests' front, and is computed whole (in this step if there is room).
      restart(seq);
      continue;
    }
    if (prefilling(r)) { // its blocks were allocated whole; the next chunk
      auto chunk = rows_of(r, std::min(budget, r.length() - r.num_computed));
      if (chunk < 1)
        continue;
      spend_rows(r, chunk);
      append_group(r, chunk, true, step);
      budget -= chunk;
      continue;
    }
    blocks_.append_slot(seq, r.length(), step.blocks_to_copy);
    append_group(r, 1, false, step);
    budget -= 1;
  }

  // 2. Swapped requests come back first, but not in a step that swapped something out
  //    (its blocks would be overwritten before they are copied).
  while (!preempted && !swapped_.empty() && budget >= 1 &&
         static_cast<int64_t>(scheduled_.size()) < config_.max_num_seqs &&
         blocks_.can_swap_in({swapped_.front()})) {
    auto seq = swapped_.front();
    swapped_.pop_front();
    if (restarts_at(requests_.at(seq).num_computed)) {
      restart(seq); // its keys rotate as a shorter sequence's: computed again instead
      continue;
    }
    for (auto& m : blocks_.swap_in({seq}))
      step.blocks_to_swap_in.push_back(m);
    auto& r = requests_.at(seq);
    blocks_.append_slot(seq, r.length(), step.blocks_to_copy);
    append_group(r, 1, false, step);
    running_.push_back(seq);
    budget -= 1;
  }

  // 3. Waiting prompts (recomputed ones first), whole, while everything allows. One whose
  //    LoRA or prompt adapter would exceed max_loras or max_prompt_adapters is passed over
  //    and keeps its place.
  struct adapter_limit {
    int64_t engine_request::*id;
    int64_t max;
    std::set<int64_t> in_use;
    bool allows(const engine_request& r) const {
      auto a = r.*id;
      return max <= 0 || a == 0 || in_use.count(a) > 0 || static_cast<int64_t>(in_use.size()) < max;
    }
    void take(const engine_request& r) {
      if (r.*id != 0)
        in_use.insert(r.*id);
    }
  };
  adapter_limit limits[] = {{&engine_request::lora_int_id, limits_.max_loras, {}},
                            {&engine_request::prompt_adapter_id, limits_.max_prompt_adapters, {}}};
  for (auto& ids : {std::vector<int64_t>(running_.begin(), running_.end()),
                    std::vector<int64_t>(swapped_.begin(), swapped_.end())})
    for (auto seq : ids)
      for (auto& l : limits)
        l.take(requests_.at(seq));
  for (size_t i = 0; i < waiting_.size() && swapped_.empty() &&
                     static_cast<int64_t>(scheduled_.size()) < config_.max_num_seqs;) {
    auto seq = waiting_[i];
    auto& r = requests_.at(seq);
    auto tokens = r.length();
    if (tokens > limits_.max_model_len ||
        blocks_.can_allocate(tokens) == block_manager::allocation::never) {
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
      r.finished = true;
      r.finish_reason = finish_reason::abort;
      untold_finished_.push_back(r.request_id); // sent before, if it was recomputed
      finished_.push_back(std::move(r));
      requests_.erase(seq);
      continue;
    }
    if (!limits[0].allows(r) || !limits[1].allows(r)) {
      ++i;
      continue;
    }
    // One that fits a step waits for a step with room for all of it; a longer one starts
    // its chunks with what this step has left. Tokens found in the prefix cache are not
    // computed.
    // A request with prompt logprobs computes all of its prompt: none is taken from the cache.
    const bool whole = r.sampling.prompt_logprobs >= 0;
    auto hit = whole ? block_manager::prefix_hit{} : blocks_.find_prefix(tokens_of(r));
    auto todo = tokens - hit.blocks * blocks_.block_size();
    bool chunked =
      todo > config_.max_num_batched_tokens || (whole && todo > max_prompt_logprob_rows);
    auto chunk = rows_of(r, std::min(todo, budget));
    if ((!chunked && todo > budget) || chunk < 1 ||
        blocks_.can_allocate(tokens, hit) != block_manager::allocation::ok)
      break;
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
    spend_rows(r, chunk);
    if (whole) {
      blocks_.allocate(seq, tokens);
      r.num_computed = 0;
    } else {
      r.num_computed = blocks_.allocate(seq, tokens_of(r));
    }
    append_group(r, chunk, true, step);
    running_.push_back(seq);
    for (auto& l : limits)
      l.take(r);
    budget -= chunk;
  }
  seal(step);
  return step;
}

void scheduler::seal(execute_model_request& step) {
  step.keep_block_tables = true;
  // What the update of this step and the next schedule read, while it is in the caches.
  hot_.clear();
  hot_.add(running_.data(), running_.size() * sizeof(int64_t));
  for (auto seq : scheduled_) {
    auto at = requests_.find(seq);
    if (at == requests_.end())
      continue;
    hot_.add_tree_node(*at);
    hot_.add_end(at->second.output);
    hot_.add_end(at->second.logprobs);
    hot_.add_end(at->second.ranks);
    hot_.add_end(at->second.top_logprobs);
    blocks_.note_hot(seq, hot_);
  }
  if (!scheduled_.empty()) {
    step.finished_requests_ids = untold_finished_;
    in_flight_.push_back({std::move(scheduled_), std::move(untold_finished_)});
    untold_finished_.clear();
  }
  scheduled_.clear();
}

std::optional<execute_model_request> scheduler::schedule_ahead() {
  if (in_flight_.size() != 1 || !waiting_.empty() || !swapped_.empty())
    return std::nullopt;
  auto& flying = in_flight_.front().seqs;
  std::vector<int64_t> seqs;
  int64_t new_blocks = 0;
  for (auto seq : running_) {
    if (std::find(flying.begin(), flying.end(), seq) == flying.end())
      return std::nullopt; // left out of the step in flight: the host decides
    auto& r = requests_.at(seq);
    if (r.chunk > 0)
      return std::nullopt; // a prefill chunk in flight: its next chunk is the host's to make
    if (at_length_limit(r))
      continue;
    if (guided(r.sampling))
      return std::nullopt; // its next mask needs the token in flight
    if (restarts_at(r.length() + r.pending - 1))
      return std::nullopt; // it starts over: the host's to schedule
    seqs.push_back(seq);
    auto have = static_cast<int64_t>(blocks_.block_table(seq).size()) * blocks_.block_size();
    if (have < r.length() + r.pending)
      ++new_blocks;
  }
  if (seqs.empty() || static_cast<int64_t>(seqs.size()) > config_.max_num_seqs ||
      static_cast<int64_t>(seqs.size()) > config_.max_num_batched_tokens ||
      new_blocks > blocks_.free_device_blocks())
    return std::nullopt;
  execute_model_request step;
  step.seq_group_metadata_list.reserve(seqs.size());
  scheduled_.clear();
  for (auto seq : seqs) {
    auto& r = requests_.at(seq);
    blocks_.append_slot(seq, r.length() + r.pending, step.blocks_to_copy);
    append_group(r, 1, false, step);
  }
  ++steps_ahead_;
  seal(step);
  return step;
}

void scheduler::update(const sampler_output& output) {
  if (in_flight_.empty())
    throw error{errc::invalid_argument, "scheduler: an output, but no step is in flight"};
  auto seqs = std::move(in_flight_.front().seqs);
  in_flight_.pop_front();
  if (output.outputs.size() != seqs.size())
    throw error{errc::invalid_argument, "scheduler: " + std::to_string(output.outputs.size()) +
                                          " outputs for " + std::to_string(seqs.size()) +
                                          " scheduled sequences"};
  // The memory read here was asked for as the result came (`prefetch`).
  for (size_t i = 0; i < seqs.size(); ++i) {
    auto seq = seqs[i];
    auto found = requests_.find(seq);
    if (found == requests_.end())
      continue; // finished after this step was sent
    auto& r = found->second;
    // Prompt logprobs come in position order; a recomputation's again.
    for (auto& p : output.outputs[i].prompt_logprobs)
      if (p.position == static_cast<int32_t>(r.prompt_logprobs.size()) + 1)
        r.prompt_logprobs.push_back(p);
    if (r.chunk > 0) { // a prefill chunk that samples nothing
      r.num_computed += r.chunk;
      r.chunk = 0;
      continue;
    }
    if (output.outputs[i].samples.empty())
      throw error{errc::invalid_argument, "scheduler: no sample for '" + r.request_id + "'"};
    auto& sample = output.outputs[i].samples[0];
    --r.pending;
    r.num_computed = r.length();
    r.output.push_back(sample.output_token);
    r.logprobs.push_back(sample.logprob);
    r.ranks.push_back(sample.rank);
    r.top_logprobs.push_back(sample.top_logprobs);
    auto& sp = r.sampling;
    auto among = [&](const std::vector<int32_t>& ids) {
      return std::find(ids.begin(), ids.end(), sample.output_token) != ids.end();
    };
    bool stop = (!sp.ignore_eos && among(eos_)) || among(sp.stop_token_ids);
    bool length =
      static_cast<int64_t>(r.output.size()) >= sp.max_tokens || r.length() >= limits_.max_model_len;
    if (stop || length) {
      r.finished = true;
      r.finish_reason = stop ? finish_reason::stop : finish_reason::length;
      r.pending = 0;
      blocks_.free(seq);
      running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
      untold_finished_.push_back(r.request_id);
      finished_.push_back(std::move(r));
      requests_.erase(seq);
    }
  }
}

size_t scheduler::recompute_all() {
  // The lost steps may not have told the ranks of the requests that finished.
  for (auto& f : in_flight_)
    untold_finished_.insert(untold_finished_.end(), f.finished_ids.begin(), f.finished_ids.end());
  in_flight_.clear();
  scheduled_.clear();
  std::vector<int64_t> again(running_.begin(), running_.end());
  again.insert(again.end(), swapped_.begin(), swapped_.end());
  running_.clear();
  swapped_.clear();
  for (auto seq : again) {
    if (blocks_.contains(seq))
      blocks_.free(seq);
    auto& r = requests_.at(seq);
    r.num_computed = 0;
    r.pending = 0;
    r.chunk = 0;
  }
  // What the workers held is gone.
  blocks_.reset_cache();
  // Waiting requests hold no cache and no step in flight already.
  waiting_.insert(waiting_.begin(), again.begin(), again.end());
  return again.size();
}

void scheduler::finish(int64_t seq, troupe::finish_reason reason) {
  auto i = requests_.find(seq);
  if (i == requests_.end())
    throw error{errc::invalid_argument,
                "scheduler: sequence " + std::to_string(seq) + " is not unfinished"};
  auto& r = i->second;
  if (blocks_.contains(seq))
    blocks_.free(seq);
  running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), seq), waiting_.end());
  swapped_.erase(std::remove(swapped_.begin(), swapped_.end(), seq), swapped_.end());
  r.finished = true;
  r.finish_reason = reason;
  r.pending = 0;
  untold_finished_.push_back(r.request_id);
  finished_.push_back(std::move(r));
  requests_.erase(i);
}

std::vector<engine_request> scheduler::take_finished() {
  auto out = std::move(finished_);
  finished_.clear();
  return out;
}

} // namespace troupe
