// Continuous batching through the real executor and model: many requests of different
// lengths give the outputs they give alone, also when a small cache forces preemption by
// swapping or by recomputing.

#include "engine/scheduler.hpp"
#include "troupe/executor.hpp"
#include "troupe/model_worker.hpp"

#include <doctest/doctest.h>

#include <deque>
#include <future>
#include <map>
#include <memory>

using namespace troupe;

namespace {

const std::string model = TROUPE_SOURCE_DIR "/tests/fixtures/llama-gqa";
constexpr int32_t block_size = 4;
// llama-gqa: 2 layers x (k, v) x 4 positions x 2 kv heads x 16 floats.
constexpr int64_t block_bytes = 2 * 2 * block_size * 2 * 16 * 4;

struct outcome {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, std::string> reasons;
  int64_t preemptions = 0;
  int64_t steps_ahead = 0;
};

std::vector<engine_request> requests(int n) {
  std::vector<engine_request> out;
  for (int i = 0; i < n; ++i) {
    engine_request r;
    r.request_id = "req-" + std::to_string(i);
    r.seq_id = i;
    for (int t = 0; t < 3 + (i * 5) % 11; ++t)
      r.prompt.push_back((i * 37 + t * 11) % 256);
    r.sampling.temperature = 0.0f;
    r.sampling.max_tokens = 4 + (i * 3) % 9;
    r.sampling.ignore_eos = true;
    out.push_back(r);
  }
  return out;
}

/// Runs the requests to the end. `ahead`: as the engine does with asynchronous
/// scheduling, the step after the one in flight is sent before waiting for the latter.
outcome run(executor& exec, const std::vector<engine_request>& reqs, int64_t device_blocks,
            int64_t swap_blocks, scheduler_config cfg, bool ahead = false) {
  scheduler sched{cfg, {}, block_size, device_blocks, swap_blocks, {2}};
  for (auto& r : reqs)
    sched.add(r);
  int steps = 0;
  std::deque<std::pair<std::future<std::vector<sampler_output>>, bool>> flying;
  auto send = [&](const execute_model_request& step) {
    REQUIRE_MESSAGE(++steps < 2000, "the scheduler makes no progress");
    flying.emplace_back(exec.execute_model_async(step), !step.seq_group_metadata_list.empty());
  };
  while (sched.has_unfinished() || !flying.empty()) {
    if (flying.empty())
      send(sched.schedule());
    if (ahead && flying.size() == 1)
      if (auto next = sched.schedule_ahead())
        send(*next);
    auto out = flying.front().first.get();
    if (flying.front().second) {
      REQUIRE(out.size() == 1);
      sched.update(out[0]);
    }
    flying.pop_front();
  }
  outcome o;
  for (auto& r : sched.take_finished()) {
    o.tokens[r.request_id] = r.output;
    o.reasons[r.request_id] = to_string(r.finish_reason);
  }
  o.preemptions = sched.preemptions();
  o.steps_ahead = sched.steps_ahead();
  return o;
}

std::unique_ptr<executor> make_executor(int64_t device_blocks, int64_t swap_blocks) {
  executor_config cfg;
  cfg.block_size = block_size;
  model_worker_options opts;
  opts.model_path = model;
  opts.kv_cache_memory_bytes = device_blocks * block_bytes;
  opts.swap_space_bytes = swap_blocks * block_bytes;
  auto exec = std::make_unique<executor>(cfg, model_worker_factory(opts));
  exec->initialize_cache(exec->determine_num_available_blocks());
  return exec;
}

} // namespace

TEST_CASE("concurrent requests give the outputs they give one at a time") {
  auto reqs = requests(12);
  auto exec = make_executor(128, 0);
  outcome alone;
  for (auto& r : reqs) {
    auto one = run(*exec, {r}, 128, 0, {});
    alone.tokens.insert(one.tokens.begin(), one.tokens.end());
  }
  auto together = run(*exec, reqs, 128, 0, {});
  CHECK(together.tokens == alone.tokens);
  for (auto& r : reqs) {
    CHECK(together.tokens[r.request_id].size() == static_cast<size_t>(r.sampling.max_tokens));
    CHECK(together.reasons[r.request_id] == "length");
  }
  CHECK(together.preemptions == 0);
  CHECK(together.steps_ahead == 0);
  auto pipelined = run(*exec, reqs, 128, 0, {}, true);
  CHECK(pipelined.steps_ahead > 0);
  CHECK(pipelined.tokens == alone.tokens);
  CHECK(pipelined.reasons == together.reasons);
  exec->stop_remote_worker_execution_loop();

  SUBCASE("a cache too small for the batch preempts by swapping, outputs unchanged") {
    auto small = make_executor(16, 32);
    auto swapped = run(*small, reqs, 16, 32, {});
    CHECK(swapped.preemptions > 0);
    CHECK(swapped.tokens == alone.tokens);
    auto pipelined = run(*small, reqs, 16, 32, {}, true);
    CHECK(pipelined.preemptions > 0);
    CHECK(pipelined.steps_ahead > 0);
    CHECK(pipelined.tokens == alone.tokens);
  }
  SUBCASE("and by recomputing when there is no swap space") {
    auto small = make_executor(16, 0);
    auto recomputed = run(*small, reqs, 16, 0, {});
    CHECK(recomputed.preemptions > 0);
    CHECK(recomputed.tokens == alone.tokens);
    auto pipelined = run(*small, reqs, 16, 0, {}, true);
    CHECK(pipelined.steps_ahead > 0);
    CHECK(pipelined.tokens == alone.tokens);
  }
  SUBCASE("prompts longer than the token budget are prefilled in chunks, outputs unchanged") {
    scheduler_config chunks;
    chunks.max_num_batched_tokens = 5; // the prompts have 3 to 13 tokens
    auto chunked = run(*exec, reqs, 128, 0, chunks);
    CHECK(chunked.tokens == alone.tokens);
    CHECK(chunked.reasons == together.reasons);
    CHECK(run(*exec, reqs, 128, 0, chunks, true).tokens == alone.tokens);
    // Recomputed requests (prompt and tokens so far) go in chunks too.
    auto small = make_executor(8, 0);
    auto recomputed = run(*small, reqs, 8, 0, chunks);
    CHECK(recomputed.preemptions > 0);
    CHECK(recomputed.tokens == alone.tokens);
    CHECK(run(*small, reqs, 8, 0, chunks, true).tokens == alone.tokens);
  }
  SUBCASE("a small token budget and sequence limit spread the work over more steps") {
    scheduler_config tight;
    tight.max_num_batched_tokens = 24;
    tight.max_num_seqs = 3;
    auto limited = run(*exec, reqs, 128, 0, tight);
    CHECK(limited.tokens == alone.tokens);
    CHECK(run(*exec, reqs, 128, 0, tight, true).tokens == alone.tokens);
  }
}

TEST_CASE("stop tokens, end of sequence and impossible prompts finish requests") {
  auto exec = make_executor(32, 0);
  auto reqs = requests(3);
  auto plain = run(*exec, {reqs[0]}, 32, 0, {});
  auto first = plain.tokens["req-0"];
  REQUIRE(first.size() > 2);
  auto stopping = reqs[0];
  stopping.sampling.stop_token_ids = {first[1]};
  auto stopped = run(*exec, {stopping}, 32, 0, {});
  CHECK(stopped.tokens["req-0"].size() == 2);
  CHECK(stopped.reasons["req-0"] == "stop");
  // Stopped while the step after was in flight: that step's token is dropped.
  auto stopped_ahead = run(*exec, {stopping}, 32, 0, {}, true);
  CHECK(stopped_ahead.steps_ahead > 0);
  CHECK(stopped_ahead.tokens["req-0"] == stopped.tokens["req-0"]);
  CHECK(stopped_ahead.reasons["req-0"] == "stop");
  auto huge = reqs[1];
  huge.prompt.assign(500, 7); // more blocks than the cache has
  auto aborted = run(*exec, {huge}, 32, 0, {});
  CHECK(aborted.reasons["req-1"] == "abort");
  scheduler sched{{}, {}, block_size, 32, 0, {2}};
  engine_request empty;
  CHECK_THROWS_AS(sched.add(empty), error);
}

TEST_CASE(
  "a step holds at most max_loras distinct adapters and passed-over requests keep their turn") {
  scheduler_limits limits;
  limits.max_loras = 2;
  scheduler sched{{}, limits, block_size, 64, 0, {2}};
  auto reqs = requests(5);
  int64_t adapter_of[] = {1, 2, 3, 0, 1}; // request 2 must wait for a slot; 3 and 4 need none
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].lora_int_id = adapter_of[i];
    reqs[i].sampling.max_tokens = i == 0 ? 1 : 3;
    sched.add(reqs[i]);
  }
  auto adapters_of = [](const execute_model_request& step) {
    std::vector<std::string> ids;
    for (auto& g : step.seq_group_metadata_list)
      ids.push_back(g.request_id + ":" + std::to_string(g.lora_int_id));
    return ids;
  };
  auto sample_all = [&](const execute_model_request& step) {
    sampler_output out;
    for (auto& g : step.seq_group_metadata_list) {
      sequence_output sample;
      sample.output_token = 7;
      out.outputs.push_back({g.request_id, {sample}});
    }
    sched.update(out);
  };
  auto first = sched.schedule();
  CHECK(adapters_of(first) == std::vector<std::string>{"req-0:1", "req-1:2", "req-3:0", "req-4:1"});
  sample_all(first); // req-0 is done: adapter 1 is still used by req-4
  auto second = sched.schedule();
  CHECK(adapters_of(second) == std::vector<std::string>{"req-1:2", "req-3:0", "req-4:1"});
  sample_all(second);
  sample_all(sched.schedule()); // req-1 and req-4 finish; adapter 3 gets a slot
  auto fourth = sched.schedule();
  CHECK(adapters_of(fourth) == std::vector<std::string>{"req-2:3"});
}

TEST_CASE("a step ahead decodes the running requests with their last token pending") {
  scheduler sched{{}, {}, block_size, 8, 0, {2}};
  auto reqs = requests(3);
  reqs[0].sampling.max_tokens = 1; // ends with the first step's token: not in the next
  reqs[1].sampling.max_tokens = 5;
  reqs[1].prompt = {5, 6, 7, 8}; // a full block: the step ahead needs a new one
  sched.add(reqs[0]);
  sched.add(reqs[1]);
  CHECK_FALSE(sched.schedule_ahead()); // nothing in flight
  auto first = sched.schedule();
  REQUIRE(first.seq_group_metadata_list.size() == 2);
  CHECK(sched.in_flight() == 1);
  CHECK_THROWS_AS(sched.schedule(), error);
  auto ahead = sched.schedule_ahead();
  REQUIRE(ahead);
  REQUIRE(ahead->seq_group_metadata_list.size() == 1);
  auto& g = ahead->seq_group_metadata_list[0];
  CHECK(g.request_id == "req-1");
  CHECK_FALSE(g.is_prompt);
  CHECK(g.token_chunk_size == 1);
  // Only the token it computes goes out: the pending one, at position 4.
  CHECK(g.seqs[0].token_ids == std::vector<int32_t>{pending_token});
  CHECK(g.seqs[0].first_token == 4);
  CHECK(g.seqs[0].length() == 5);
  CHECK(g.seqs[0].num_computed_tokens == 4);
  // Only its new block goes out: the ranks keep the one the first step sent.
  CHECK(ahead->keep_block_tables);
  CHECK(g.seqs[0].first_block == 1);
  CHECK(g.seqs[0].block_table.size() == 1);
  CHECK_FALSE(sched.schedule_ahead()); // one step ahead at most
  auto sample = [](const execute_model_request& step, std::vector<int32_t> tokens) {
    sampler_output out;
    for (size_t i = 0; i < step.seq_group_metadata_list.size(); ++i) {
      sequence_output s;
      s.output_token = tokens[i];
      out.outputs.push_back({step.seq_group_metadata_list[i].request_id, {s}});
    }
    return out;
  };
  sched.update(sample(first, {40, 41}));
  auto done = sched.take_finished();
  REQUIRE(done.size() == 1);
  CHECK(done[0].output == std::vector<int32_t>{40});
  // The next step ahead computes the token still pending, after the one now known.
  auto third = sched.schedule_ahead();
  REQUIRE(third);
  auto& next = third->seq_group_metadata_list[0].seqs[0];
  CHECK(next.token_ids == std::vector<int32_t>{pending_token});
  CHECK(next.first_token == 5);
  CHECK(next.num_computed_tokens == 5);
  // The ranks drop what they keep of req-0 (its block table) at the step after its end.
  CHECK(ahead->finished_requests_ids.empty());
  CHECK(third->finished_requests_ids == std::vector<std::string>{"req-0"});
  // A request that ends while steps after it are in flight: their tokens are dropped.
  sched.finish(1, finish_reason::stop);
  sched.update(sample(*ahead, {42}));
  sched.update(sample(*third, {43}));
  done = sched.take_finished();
  REQUIRE(done.size() == 1);
  CHECK(done[0].output == std::vector<int32_t>{41});
  CHECK_FALSE(sched.has_unfinished());
  CHECK_THROWS_AS(sched.update(sample(first, {1, 2})), error); // nothing in flight

  // Waiting requests need the host's view of the blocks: no step ahead.
  scheduler_config one_seq;
  one_seq.max_num_seqs = 1;
  scheduler narrow{one_seq, {}, block_size, 8, 0, {2}};
  narrow.add(reqs[1]);
  narrow.add(reqs[2]);
  narrow.schedule();
  CHECK_FALSE(narrow.schedule_ahead());
}

TEST_CASE("after lost steps, every block table is sent whole and every finished request told") {
  scheduler sched{{}, {}, block_size, 8, 0, {2}};
  auto reqs = requests(2);
  reqs[0].sampling.max_tokens = 1;
  sched.add(reqs[0]);
  sched.add(reqs[1]);
  auto first = sched.schedule();
  sampler_output out;
  for (auto& g : first.seq_group_metadata_list) {
    sequence_output s;
    s.output_token = 7;
    out.outputs.push_back({g.request_id, {s}});
  }
  sched.update(out); // req-0 ends
  auto second = sched.schedule();
  CHECK(second.finished_requests_ids == std::vector<std::string>{"req-0"});
  REQUIRE(second.seq_group_metadata_list.size() == 1);
  CHECK(second.seq_group_metadata_list[0].seqs[0].first_block > 0);
  sched.recompute_all(); // the second step was lost
  auto again = sched.schedule();
  CHECK(again.finished_requests_ids == std::vector<std::string>{"req-0"});
  REQUIRE(again.seq_group_metadata_list.size() == 1);
  auto& seq = again.seq_group_metadata_list[0].seqs[0];
  CHECK(seq.first_block == 0);
  CHECK(static_cast<int64_t>(seq.block_table.size()) * block_size >= seq.length());
}

TEST_CASE("a sequence that grows past restart_at is computed again from its first token") {
  // LongRoPE's switch to the long factors at position 6: the decode that would compute
  // position 6 becomes a prompt of all 7 known tokens, once; no step ahead crosses it.
  // (The engine turns prefix caching off there: the cached keys rotate as a shorter
  // sequence's.)
  scheduler_limits limits;
  limits.restart_at = 6;
  scheduler_config no_cache;
  no_cache.enable_prefix_caching = false;
  scheduler sched{no_cache, limits, block_size, 8, 0, {2}};
  auto r = requests(1)[0];
  r.prompt = {5, 6, 7, 8};
  r.sampling.max_tokens = 6;
  sched.add(r);
  auto step_of = [&](const execute_model_request& step, int32_t token) {
    sampler_output out;
    sequence_output s;
    s.output_token = token;
    out.outputs.push_back({step.seq_group_metadata_list[0].request_id, {s}});
    sched.update(out);
  };
  std::vector<std::pair<int32_t, int32_t>> shapes; // (computed before, chunk)
  for (int32_t token = 40; sched.has_unfinished(); ++token) {
    if (sched.in_flight() == 0) {
      auto step = sched.schedule();
      REQUIRE(step.seq_group_metadata_list.size() == 1);
      auto& g = step.seq_group_metadata_list[0];
      shapes.emplace_back(g.seqs[0].num_computed_tokens, g.token_chunk_size);
      if (g.token_chunk_size > 1) {
        CHECK(g.is_prompt);
        CHECK(g.seqs[0].first_token == 0);
      }
      auto ahead = sched.schedule_ahead();
      step_of(step, token);
      if (ahead) {
        auto& a = ahead->seq_group_metadata_list[0];
        CHECK(a.seqs[0].num_computed_tokens != limits.restart_at);
        shapes.emplace_back(a.seqs[0].num_computed_tokens, a.token_chunk_size);
        step_of(*ahead, ++token);
      }
    }
  }
  CHECK(shapes ==
        std::vector<std::pair<int32_t, int32_t>>{{0, 4}, {4, 1}, {5, 1}, {0, 7}, {7, 1}, {8, 1}});
  auto done = sched.take_finished();
  REQUIRE(done.size() == 1);
  CHECK(done[0].output.size() == 6);
}

TEST_CASE("a request with prompt logprobs computes at most 512 prompt tokens a step") {
  scheduler_config cfg;
  cfg.max_num_batched_tokens = 2048;
  scheduler sched{cfg, {}, block_size, 256, 0, {2}};
  auto r = requests(1)[0];
  r.prompt.assign(600, 5);
  r.sampling.prompt_logprobs = 0;
  sched.add(r);
  auto first = sched.schedule();
  REQUIRE(first.seq_group_metadata_list.size() == 1);
  CHECK(first.seq_group_metadata_list[0].token_chunk_size == scheduler::max_prompt_logprob_rows);
  CHECK_FALSE(first.seq_group_metadata_list[0].do_sample);
  sampler_output none;
  none.outputs.push_back({first.seq_group_metadata_list[0].request_id, {}});
  sched.update(none);
  auto second = sched.schedule();
  REQUIRE(second.seq_group_metadata_list.size() == 1);
  CHECK(second.seq_group_metadata_list[0].token_chunk_size == 600 - 512);
  CHECK(second.seq_group_metadata_list[0].do_sample);
}
