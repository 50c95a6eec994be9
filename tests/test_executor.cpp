// The executor facade and supervisor with real worker actors: collective_rpc, the
// ExecutorBase methods, the distributed execution loop, sleep/wake and the async API.

#include "troupe/executor.hpp"

#include "tests/generation.hpp"
#include "tests/rss.hpp"
#include "tests/skip.hpp"
#include "tests/test_worker.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <thread>

using namespace troupe;
using namespace std::chrono_literals;
using troupe::testing::code_of;
using troupe::testing::kill_rank;
using troupe::testing::one_step;
using troupe::testing::test_factory;
using troupe::testing::what_of;

namespace {

executor_config config(int32_t workers) {
  executor_config cfg;
  cfg.tensor_parallel_size = workers;
  cfg.rpc_timeout = 20s;
  cfg.block_size = 16;
  cfg.max_model_len = 256;
  return cfg;
}

std::vector<int64_t> steps_per_rank(executor& exec) {
  return exec.collective_rpc_as<int64_t>("steps");
}

} // namespace

TEST_CASE("workers start with their ranks and devices") {
  executor exec{config(3), test_factory()};
  CHECK(exec.world_size() == 3);
  REQUIRE(exec.workers().size() == 3);
  for (int32_t rank = 0; rank < 3; ++rank) {
    CHECK(exec.workers()[rank].rank == rank);
    CHECK(exec.workers()[rank].world_size == 3);
    CHECK(exec.workers()[rank].device == "cpu:" + std::to_string(rank));
  }
}

TEST_CASE("collective_rpc returns results in rank order when workers answer out of order") {
  executor exec{config(4), test_factory()};
  rpc_call_options opts;
  opts.args = caf::make_message(int32_t{40});
  auto ranks = exec.collective_rpc_as<int32_t>("delayed_rank", opts);
  CHECK(ranks == std::vector<int32_t>{0, 1, 2, 3});
}

TEST_CASE("collective_rpc passes args and kwargs") {
  executor exec{config(2), test_factory()};
  rpc_call_options opts;
  opts.kwargs["name"] = std::string{"troupe"};
  CHECK(exec.collective_rpc_as<std::string>("kwarg", opts) ==
        std::vector<std::string>{"troupe", "troupe"});
  CHECK(exec.collective_rpc_as<std::string>("kwarg") ==
        std::vector<std::string>{"missing", "missing"});
}

TEST_CASE("the failing rank is named and unknown methods are reported as such") {
  executor exec{config(3), test_factory()};
  rpc_call_options opts;
  opts.args = caf::make_message(int32_t{2});
  auto what = what_of([&] { exec.collective_rpc("fail_on", opts); });
  CHECK(what.find("rank 2") != std::string::npos);
  CHECK(what.find("failed on purpose") != std::string::npos);
  CHECK(code_of([&] { exec.collective_rpc("fail_on", opts); }) == errc::worker_error);
  CHECK(code_of([&] { exec.collective_rpc("no_such_method"); }) == errc::unknown_method);
  CHECK(what_of([&] { exec.collective_rpc("no_such_method"); }).find("no_such_method") !=
        std::string::npos);
  // A failed call leaves the executor usable.
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1, 2});
}

TEST_CASE("arguments of the wrong type are an error naming the method not a crash") {
  executor exec{config(1), test_factory()};
  rpc_call_options opts;
  opts.args = caf::make_message(std::string{"not a request"});
  CHECK(code_of([&] { exec.collective_rpc("execute_model", opts); }) == errc::bad_arguments);
  CHECK(code_of([&] { exec.collective_rpc_as<std::string>("rank"); }) == errc::bad_arguments);
}

TEST_CASE("a callable runs in-process on every worker object") {
  executor exec{config(3), test_factory()};
  auto results = exec.collective_rpc(
    [](worker& w, const caf::message& args, const caf::settings&) {
      return caf::make_message(w.rank() * args.get_as<int32_t>(0));
    },
    {caf::make_message(int32_t{10}), {}, {}, {}});
  REQUIRE(results.size() == 3);
  CHECK(results[2].get_as<int32_t>(0) == 20);
  auto models = exec.apply_model([](model& m) { return caf::make_message(m.architecture()); });
  CHECK(models[1].get_as<std::string>(0) == "TestModel");
}

TEST_CASE("a callable that misses its deadline is named in the error") {
  executor exec{config(2), test_factory()};
  rpc_call_options hurried;
  hurried.timeout = 100ms;
  auto what = what_of([&] {
    exec.collective_rpc(
      [](worker&, const caf::message&, const caf::settings&) {
        std::this_thread::sleep_for(300ms);
        return caf::message{};
      },
      hurried);
  });
  CHECK(what.find("collective_rpc callable 'callable': rank") != std::string::npos);
  CHECK(what.find("did not answer within 100 ms") != std::string::npos);
}

TEST_CASE("max_concurrent_workers bounds how many workers are asked at once") {
  executor exec{config(4), test_factory()};
  auto& peak = troupe::testing::concurrency_probe::peak();
  peak = 0;
  exec.collective_rpc("track");
  CHECK(peak.load() == 4);
  peak = 0;
  rpc_call_options opts;
  opts.max_concurrent_workers = 2;
  auto ranks = exec.collective_rpc_as<int32_t>("track", opts);
  CHECK(peak.load() <= 2);
  CHECK(ranks == std::vector<int32_t>{0, 1, 2, 3});
}

TEST_CASE(
  "determine_num_available_blocks is the minimum over workers and initialize_cache allocates") {
  executor exec{config(3), test_factory()};
  auto blocks = exec.determine_num_available_blocks();
  CHECK(blocks.num_device_blocks == 800); // rank 2: 1000 - 200
  CHECK(blocks.num_swap_blocks == 64);    // rank 0: 64 + 0
  exec.initialize_cache(blocks);
  for (auto& h : exec.worker_healths())
    for (auto& m : h.memory)
      if (m.tag == memory_tag::kv_cache)
        CHECK(m.allocated_bytes == 800 * 4096);
  CHECK(code_of([&] { exec.initialize_cache({0, 0}); }) == errc::invalid_argument);
  CHECK(code_of([&] { exec.initialize_cache({10, -1}); }) == errc::invalid_argument);
}

TEST_CASE("the execution loop: first step starts it steps reach every rank through the driver") {
  executor exec{config(3), test_factory()};
  auto out = exec.execute_model(one_step(5));
  REQUIRE(out.size() == 1);
  REQUIRE(out[0].outputs.size() == 1);
  CHECK(out[0].outputs[0].samples[0].output_token == 10);
  exec.execute_model(one_step(6));
  exec.execute_model(one_step(7));
  // Peers got every step from the driver; their order behind it is guaranteed because the
  // driver sent them before answering.
  exec.stop_remote_worker_execution_loop();
  CHECK(steps_per_rank(exec) == std::vector<int64_t>{3, 3, 3});
  // Stopping again is a no-op; a new step starts a new loop.
  exec.stop_remote_worker_execution_loop();
  exec.execute_model(one_step(1));
  exec.stop_remote_worker_execution_loop();
  CHECK(steps_per_rank(exec) == std::vector<int64_t>{4, 4, 4});
}

TEST_CASE("a pending token is the driver's last sample, on every rank") {
  executor exec{config(2), test_factory()};
  auto ahead = [](std::vector<int32_t> tokens, int64_t seq_id) {
    execute_model_request req;
    sequence_group_metadata g;
    g.request_id = "r";
    g.seqs.push_back({seq_id, tokens, 2, static_cast<int32_t>(tokens.size() - 1), {0}});
    g.token_chunk_size = 1;
    req.seq_group_metadata_list.push_back(g);
    return req;
  };
  // Nothing sampled yet for the sequence: refused, naming it, before any rank runs it.
  auto what = what_of([&] { exec.execute_model(ahead({5, 5, pending_token}, 0)); });
  CHECK(what.find("sequence 0 of 'r'") != std::string::npos);
  CHECK(steps_per_rank(exec) == std::vector<int64_t>{0, 0});
  // Sent together, as an engine does: the second step takes the first one's token (10).
  auto first = exec.execute_model_async(one_step(5));
  auto second = exec.execute_model_async(ahead({5, 5, pending_token}, 0));
  CHECK(first.get()[0].outputs[0].samples[0].output_token == 10);
  CHECK(second.get()[0].outputs[0].samples[0].output_token == 20);
  exec.stop_remote_worker_execution_loop();
  for (auto& tokens : exec.collective_rpc_as<std::vector<int32_t>>("last_tokens"))
    CHECK(tokens == std::vector<int32_t>{5, 5, 10});
  // Only a sequence the last step sampled may have its last token pending.
  exec.execute_model(one_step(5));
  CHECK(what_of([&] {
          exec.execute_model(ahead({5, pending_token}, 9));
        }).find("sequence 9") != std::string::npos);
  exec.stop_remote_worker_execution_loop();
}

TEST_CASE("a peer that fails inside the loop is reported by the next step naming its rank") {
  executor exec{config(2), test_factory()};
  exec.execute_model(one_step(1));
  exec.collective_rpc("fail_next_step_on", {caf::make_message(int32_t{1}), {}, {}, {}});
  // Only the peer fails this step: the driver's answer is fine.
  exec.execute_model(one_step(2));
  // The peer got that step before anything sent later, and reported its loop's end before
  // answering this call: after it, the supervisor knows.
  exec.collective_rpc("rank");
  // The peer's loop ended with its error; the next step reports it with the rank.
  auto what = what_of([&] { exec.execute_model(one_step(3)); });
  CHECK(what.find("rank 1") != std::string::npos);
  // After that the loop starts afresh.
  exec.execute_model(one_step(4));
  exec.stop_remote_worker_execution_loop();
}

TEST_CASE("a step that fails on every rank is reported once and the next one runs") {
  executor exec{config(2), test_factory()};
  exec.execute_model(one_step(1));
  exec.collective_rpc("fail_next_step", {caf::message{}, {}, {}, {}});
  // Both ranks fail this step: the driver's error comes back at once.
  CHECK(code_of([&] { exec.execute_model(one_step(2)); }) == errc::worker_error);
  exec.collective_rpc("rank");
  // The peer's failure of that step is the same news: the next step runs, in a new loop.
  exec.execute_model(one_step(3));
  exec.stop_remote_worker_execution_loop();
  CHECK(steps_per_rank(exec) == std::vector<int64_t>{2, 2});
}

TEST_CASE("single-worker executors run steps without a loop") {
  executor exec{config(1), test_factory()};
  exec.execute_model(one_step(1));
  exec.stop_remote_worker_execution_loop();
  CHECK(steps_per_rank(exec) == std::vector<int64_t>{1});
}

TEST_CASE("LoRA and prompt-adapter management with ids checked before anything is sent") {
  executor exec{config(2), test_factory()};
  CHECK(exec.add_lora({"a", 1, "/a"}));
  CHECK(exec.add_lora({"b", 2, "/b"}));
  CHECK(exec.list_loras() == std::vector<int64_t>{1, 2});
  CHECK(exec.pin_lora(1));
  CHECK(exec.remove_lora(2));
  CHECK(!exec.remove_lora(2));
  CHECK(exec.list_loras() == std::vector<int64_t>{1});
  for (int64_t bad : {0, -3}) {
    CHECK(code_of([&] { exec.add_lora({"x", bad, "/x"}); }) == errc::invalid_argument);
    CHECK(code_of([&] { exec.remove_lora(bad); }) == errc::invalid_argument);
    CHECK(code_of([&] { exec.pin_lora(bad); }) == errc::invalid_argument);
    CHECK(code_of([&] { exec.add_prompt_adapter({"p", bad, "/p", 4}); }) == errc::invalid_argument);
    CHECK(code_of([&] { exec.remove_prompt_adapter(bad); }) == errc::invalid_argument);
    CHECK(code_of([&] { exec.pin_prompt_adapter(bad); }) == errc::invalid_argument);
  }
  CHECK(what_of([&] {
          exec.add_lora({"x", 0, "/x"});
        }).find("lora_id must be greater than 0") != std::string::npos);
  CHECK(exec.add_prompt_adapter({"p", 5, "/p", 4}));
  CHECK(exec.list_prompt_adapters() == std::vector<int64_t>{5});
  CHECK(exec.pin_prompt_adapter(5));
  CHECK(exec.remove_prompt_adapter(5));
  CHECK(exec.list_prompt_adapters().empty());
}

TEST_CASE("workers that disagree on the LoRA set are an error naming the ranks") {
  executor exec{config(3), test_factory()};
  exec.collective_rpc("add_lora_on", {caf::make_message(int32_t{2}), {}, {}, {}});
  CHECK(code_of([&] { exec.list_loras(); }) == errc::inconsistent_workers);
  CHECK(what_of([&] { exec.list_loras(); }).find("rank(s) 2") != std::string::npos);
}

TEST_CASE("sleep and wake: weights bit-identical memory released while asleep") {
  const size_t weights = 48u << 20;
  const int64_t blocks = 8000; // x 4 KiB of KV cache per worker
  executor exec{config(2), test_factory(weights)};
  exec.initialize_cache({blocks, 0});
  exec.collective_rpc("fill_kv");
  auto sums = exec.collective_rpc_as<int64_t>("checksum");
  auto held = static_cast<int64_t>(weights) + blocks * 4096;
  CHECK(exec.collective_rpc_as<int64_t>("resident_bytes") == std::vector<int64_t>{held, held});
  auto before = troupe::testing::rss_bytes();
  exec.sleep(1);
  auto asleep = troupe::testing::rss_bytes();
  auto status = exec.sleep_state();
  CHECK(status.is_sleeping);
  CHECK(status.sleeping_tags == std::vector<std::string>{"weights", "kv_cache"});
  // Every page of the weights and the KV cache left the device memory (the kernel's view)...
  CHECK(exec.collective_rpc_as<int64_t>("resident_bytes") == std::vector<int64_t>{0, 0});
  // ... and the process: the weights came back once, as their host backup; the KV cache
  // did not. So RSS falls by the KV bytes of both workers (90 %: the rest of the process
  // moves a little).
  double must_leave = 2.0 * blocks * 4096;
  MESSAGE("RSS " << (before >> 20) << " MiB awake, " << (asleep >> 20) << " MiB asleep; "
                 << must_leave / (1 << 20) << " MiB must leave");
  CHECK(static_cast<double>(before - asleep) >= 0.9 * must_leave);
  CHECK(code_of([&] { exec.execute_model(one_step(1)); }) == errc::sleeping);
  exec.wake_up();
  CHECK(!exec.is_sleeping());
  CHECK(exec.collective_rpc_as<int64_t>("checksum") == sums);
  CHECK(exec.collective_rpc_as<int64_t>("kv_nonzero") == std::vector<int64_t>{0, 0});
  exec.execute_model(one_step(1));
  exec.stop_remote_worker_execution_loop();
}

TEST_CASE("level-2 sleep returns all the memory and reload brings the weights back") {
  const size_t weights = 48u << 20;
  executor exec{config(2), test_factory(weights)};
  auto sums = exec.collective_rpc_as<int64_t>("checksum");
  auto before = troupe::testing::rss_bytes();
  exec.sleep(2);
  auto asleep = troupe::testing::rss_bytes();
  MESSAGE("RSS " << (before >> 20) << " MiB awake, " << (asleep >> 20) << " MiB asleep");
  CHECK(static_cast<double>(before - asleep) >= 0.9 * 2.0 * weights);
  exec.wake_up({"weights"});
  auto status = exec.sleep_state();
  CHECK(status.sleeping_tags == std::vector<std::string>{"kv_cache"});
  // Partly awake is still asleep for execute_model.
  CHECK(code_of([&] { exec.execute_model(one_step(1)); }) == errc::sleeping);
  exec.wake_up({"kv_cache"});
  CHECK(exec.collective_rpc_as<int64_t>("checksum") != sums);
  exec.collective_rpc("reload_weights");
  CHECK(exec.collective_rpc_as<int64_t>("checksum") == sums);
}

TEST_CASE("invalid sleep and wake requests warn or fail and change nothing") {
  executor exec{config(2), test_factory()};
  CHECK(code_of([&] { exec.sleep(0); }) == errc::invalid_argument);
  CHECK(code_of([&] { exec.sleep(3); }) == errc::invalid_argument);
  // A level that arrives as a message (from a peer that does not check it) is checked too.
  CHECK(code_of([&] {
          exec.collective_rpc(
            "sleep", {caf::make_message(sleep_request{static_cast<sleep_level>(3)}), {}, {}, {}});
        }) == errc::invalid_argument);
  CHECK(!exec.is_sleeping());
  exec.wake_up(); // awake: a warning, nothing else
  CHECK(!exec.is_sleeping());
  exec.sleep(1);
  exec.sleep(2);                 // already sleeping: a warning; still level-1 asleep
  exec.wake_up({"activations"}); // unknown tag: a warning, nothing woken
  CHECK(exec.sleep_state().sleeping_tags.size() == 2);
  exec.wake_up({"kv_cache"});
  exec.wake_up({"kv_cache"}); // not asleep any more: a warning
  CHECK(exec.sleep_state().sleeping_tags == std::vector<std::string>{"weights"});
  exec.wake_up();
  CHECK(!exec.is_sleeping());
  for (auto& h : exec.worker_healths())
    CHECK(h.sleeping_tags.empty());
}

TEST_CASE("profiling writes one trace per worker and stopping without starting is an error") {
  auto dir =
    std::filesystem::temp_directory_path() / ("troupe-profile-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto cfg = config(2);
  cfg.profile_dir = dir.string();
  executor exec{cfg, test_factory()};
  CHECK(code_of([&] { exec.stop_profile(); }) == errc::invalid_argument);
  exec.start_profile();
  CHECK(code_of([&] { exec.start_profile(); }) == errc::invalid_argument);
  exec.collective_rpc("rank");
  // A future that can be waited on with a deadline (not a deferred one, whose wait_for
  // returns at once without waiting).
  auto stopped = exec.stop_profile_async();
  REQUIRE(stopped.wait_for(20s) == std::future_status::ready);
  stopped.get();
  size_t traces = 0;
  for (auto& entry : std::filesystem::directory_iterator(dir))
    traces += entry.path().string().find(".trace.json") != std::string::npos;
  CHECK(traces == 2);
  std::filesystem::remove_all(dir);
}

TEST_CASE("save_sharded_state reaches every worker and bad arguments are errors") {
  auto dir = std::filesystem::temp_directory_path() / ("troupe-shards-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  executor exec{config(2), test_factory()};
  exec.save_sharded_state(dir.string());
  CHECK(std::filesystem::exists(dir / "test-rank-0.bin"));
  CHECK(std::filesystem::exists(dir / "test-rank-1.bin"));
  CHECK(code_of([&] { exec.save_sharded_state(""); }) == errc::invalid_argument);
  CHECK(code_of([&] { exec.save_sharded_state(dir.string(), "", -1); }) == errc::invalid_argument);
  CHECK(code_of([&] { exec.save_sharded_state("/nonexistent/dir"); }) == errc::invalid_argument);
  std::filesystem::remove_all(dir);
}

TEST_CASE(
  "save_sharded_state is all or nothing: when one rank cannot write, no rank's files stay") {
  namespace fs = std::filesystem;
  auto dir = fs::temp_directory_path() / ("troupe-all-or-none-" + std::to_string(getpid()));
  fs::create_directories(dir);
  executor exec{config(3), test_factory()};
  exec.collective_rpc("save_into_on",
                      {caf::make_message(int32_t{1}, std::string{"/nonexistent"}), {}, {}, {}});
  CHECK_THROWS_WITH_AS(exec.save_sharded_state(dir.string()),
                       doctest::Contains("cannot write '/nonexistent/test-rank-1.bin'"), error);
  CHECK_THROWS_AS(exec.save_sharded_state_async(dir.string()).get(), error);
  // Ranks 0 and 2 wrote their files, and they are gone with their staging folders.
  CHECK(fs::is_empty(dir));
  // Once rank 1 can write again, the save lands whole.
  exec.collective_rpc("save_into_on", {caf::make_message(int32_t{1}, std::string{}), {}, {}, {}});
  exec.save_sharded_state(dir.string());
  std::set<std::string> names;
  for (auto& entry : fs::directory_iterator(dir))
    names.insert(entry.path().filename().string());
  CHECK(names == std::set<std::string>{"test-rank-0.bin", "test-rank-1.bin", "test-rank-2.bin"});
  fs::remove_all(dir);
}

TEST_CASE("check_health reports every worker") {
  executor exec{config(2), test_factory()};
  exec.check_health();
  auto reports = exec.worker_healths();
  REQUIRE(reports.size() == 2);
  CHECK(reports[1].rank == 1);
  CHECK(reports[1].healthy);
}

TEST_CASE("the async API returns futures for every call") {
  executor exec{config(2), test_factory()};
  auto rpc = exec.collective_rpc_async("rank");
  auto blocks = exec.determine_num_available_blocks_async();
  CHECK(rpc.get().size() == 2);
  CHECK(blocks.get().num_device_blocks == 900);
  exec.initialize_cache_async({10, 1}).get();
  CHECK(exec.execute_model_async(one_step(3)).get()[0].outputs[0].samples[0].output_token == 6);
  exec.stop_remote_worker_execution_loop_async().get();
  CHECK(exec.add_lora_async({"a", 4, "/a"}).get());
  CHECK(exec.pin_lora_async(4).get());
  CHECK(exec.list_loras_async().get() == std::vector<int64_t>{4});
  CHECK(exec.remove_lora_async(4).get());
  CHECK(exec.add_prompt_adapter_async({"p", 2, "/p", 1}).get());
  CHECK(exec.pin_prompt_adapter_async(2).get());
  CHECK(exec.list_prompt_adapters_async().get() == std::vector<int64_t>{2});
  CHECK(exec.remove_prompt_adapter_async(2).get());
  exec.start_profile_async().get();
  exec.stop_profile_async().get();
  exec.check_health_async().get();
  exec.sleep_async(1).get();
  exec.wake_up_async({}).get();
  CHECK_THROWS_AS(exec.add_lora_async({"a", 0, "/a"}).get(), error);
  CHECK_THROWS_AS(exec.collective_rpc_async("no_such_method").get(), error);
  auto dir = std::filesystem::temp_directory_path() / ("troupe-async-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  exec.save_sharded_state_async(dir.string()).get();
  std::filesystem::remove_all(dir);
  auto callable =
    exec.collective_rpc_async([](worker& w, const caf::message&, const caf::settings&) {
      return caf::make_message(w.rank());
    });
  CHECK(callable.get()[1].get_as<int32_t>(0) == 1);
}

TEST_CASE("async calls reach the workers in the order they were made") {
  // The engine queues step N+1 behind step N this way; a call overtaking another would
  // run a step before the one whose tokens it takes.
  executor exec{config(2), test_factory()};
  auto order = std::make_shared<std::vector<int>>();
  std::vector<std::future<std::vector<caf::message>>> calls;
  for (int i = 0; i < 300; ++i)
    calls.push_back(
      exec.collective_rpc_async([i, order](worker& w, const caf::message&, const caf::settings&) {
        if (w.rank() == 0)
          order->push_back(i);
        return caf::message{};
      }));
  for (auto& f : calls)
    f.get();
  std::vector<int> expected(300);
  std::iota(expected.begin(), expected.end(), 0);
  CHECK(*order == expected);
}

TEST_CASE("callers on many threads each get their own replies") {
  // Replies go from the workers straight to the waiting caller; one crossed with another
  // caller's, or lost, shows here.
  executor exec{config(3), test_factory()};
  std::atomic<int> wrong{0};
  std::atomic<int> done{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 6; ++t)
    callers.emplace_back([&, t] {
      for (int i = 0; i < 300; ++i) {
        auto name = std::to_string(t) + "/" + std::to_string(i);
        rpc_call_options opts;
        opts.kwargs["name"] = name;
        std::vector<std::string> got;
        if (i % 3 == 0) {
          auto f = exec.collective_rpc_async("kwarg_at", opts);
          if (f.wait_for(20s) != std::future_status::ready) {
            ++wrong; // a reply lost: fail, don't hang
            continue;
          }
          for (auto& m : f.get())
            got.push_back(m.get_as<std::string>(0));
        } else {
          got = exec.collective_rpc_as<std::string>("kwarg_at", opts);
        }
        if (got != std::vector<std::string>{name + "@0", name + "@1", name + "@2"})
          ++wrong;
        if (i % 50 == 0) {
          auto out = exec.execute_model(one_step(t + 1));
          if (out.size() != 1 || out[0].outputs[0].samples[0].output_token != 2 * (t + 1))
            ++wrong;
        }
        ++done;
      }
    });
  for (auto& c : callers)
    c.join();
  CHECK(done == 6 * 300);
  CHECK(wrong == 0);
}

TEST_CASE("calls made directly and through the supervisor keep their order") {
  // Named methods go from the caller to the workers; callables, adapter calls, sleep and
  // wake first make a request to the supervisor itself. A direct call must not overtake an
  // earlier one of the other kind. Replies to the callables keep the supervisor busy, so
  // that calls find a backlog in its mailbox.
  executor exec{config(2), test_factory()};
  std::vector<std::future<std::vector<caf::message>>> calls;
  for (int32_t i = 0; i < 400; ++i) {
    if (i % 2 == 0) {
      calls.push_back(
        exec.collective_rpc_async([i](worker& w, const caf::message&, const caf::settings&) {
          static_cast<troupe::testing::test_worker&>(w).note(i);
          return caf::message{};
        }));
    } else {
      rpc_call_options opts;
      opts.args = caf::make_message(i);
      calls.push_back(exec.collective_rpc_async("note", opts));
    }
  }
  for (auto& f : calls)
    REQUIRE(f.wait_for(20s) == std::future_status::ready);
  std::vector<int32_t> expected(400);
  std::iota(expected.begin(), expected.end(), 0);
  for (auto& notes : exec.collective_rpc_as<std::vector<int32_t>>("notes"))
    CHECK(notes == expected);
}

TEST_CASE("a long run of calls leaves memory flat: nothing per call outlives the call") {
#if defined(__SANITIZE_ADDRESS__)
  return testing::skip("AddressSanitizer holds freed memory in quarantine, so resident "
                       "memory cannot show a leak here (its leak checker runs at exit)");
#endif
  executor exec{config(2), test_factory()};
  auto calls = [&](int n) {
    for (int i = 0; i < n; ++i)
      exec.collective_rpc("rank");
    // A few async calls in flight at a time: a burst of thousands would measure the burst.
    std::vector<std::future<std::vector<caf::message>>> async;
    for (int i = 0; i < n / 2; ++i) {
      async.push_back(exec.collective_rpc_async("rank"));
      if (async.size() == 8 || i + 1 == n / 2) {
        for (auto& f : async)
          f.get();
        async.clear();
      }
    }
  };
  calls(2000); // warm-up: the allocator's arenas and CAF's caches reach their size
  auto before = troupe::testing::rss_bytes();
  const int n = 10000;
  calls(n);
  auto grown = troupe::testing::rss_bytes() - before;
  INFO("RSS grew by " << grown << " bytes over " << n + n / 2 << " calls");
  // Under 64 bytes a call: not even one small allocation per call may stay behind.
  CHECK(grown < 64 * (n + n / 2));
}

TEST_CASE("bad configurations are refused with the reason") {
  auto cfg = config(0);
  CHECK(code_of([&] { executor exec(cfg, test_factory()); }) == errc::invalid_argument);
  CHECK(code_of([&] { executor exec(config(1), nullptr); }) == errc::invalid_argument);
  auto failing = [](int32_t) -> std::unique_ptr<worker> {
    throw std::runtime_error("no device today");
  };
  auto what = what_of([&] { executor exec(config(2), failing); });
  CHECK(what.find("no device today") != std::string::npos);
  for (auto linger : {-1us, 1000001us}) {
    auto bad = config(1);
    bad.linger = linger;
    CHECK(what_of([&] { executor exec(bad, test_factory()); }).find("linger") != std::string::npos);
  }
}

TEST_CASE("calls give the same answers whether threads linger or sleep at once") {
  for (auto linger : {0us, 30us, 2000us}) {
    auto cfg = config(3);
    cfg.linger = linger;
    executor exec{cfg, test_factory()};
    for (int i = 0; i < 50; ++i) {
      CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1, 2});
      auto out = exec.execute_model(one_step(i + 1));
      REQUIRE(out.size() == 1);
      CHECK(out[0].outputs[0].samples[0].output_token == 2 * (i + 1));
    }
  }
}

TEST_CASE("a peer failing a step with three workers leaves the next loop clean") {
  executor exec{config(3), test_factory()};
  exec.execute_model(one_step(1));
  exec.collective_rpc("fail_next_step_on", {caf::make_message(int32_t{2}), {}, {}, {}});
  exec.execute_model(one_step(2)); // the driver is fine; rank 2 fails behind it
  exec.collective_rpc("rank");     // after this the supervisor knows
  auto what = what_of([&] { exec.execute_model(one_step(3)); });
  CHECK(what.find("rank 2") != std::string::npos);
  // Every later step and the stop work: rank 1 was told to leave the failed loop.
  for (int32_t t = 4; t < 8; ++t)
    CHECK(exec.execute_model(one_step(t)).size() == 1);
  exec.stop_remote_worker_execution_loop();
  auto steps = steps_per_rank(exec);
  CHECK(steps[0] == 6);
  CHECK(steps[1] == 6);
  CHECK(steps[2] == 5); // it failed one
}

TEST_CASE("a sleep that fails on one rank still counts as asleep until wake_up") {
  executor exec{config(2), test_factory()};
  exec.collective_rpc("fail_next_sleep_on", {caf::make_message(int32_t{1}), {}, {}, {}});
  CHECK(code_of([&] { exec.sleep(1); }) == errc::worker_error);
  CHECK(exec.is_sleeping());
  CHECK(code_of([&] { exec.execute_model(one_step(1)); }) == errc::sleeping);
  exec.wake_up();
  CHECK(!exec.is_sleeping());
  CHECK(exec.execute_model(one_step(1)).size() == 1);
  exec.stop_remote_worker_execution_loop();
}

TEST_CASE("a step during a sleep or on a sleeping worker is refused instead of crashing") {
  executor exec{config(2), test_factory()};
  auto busy = exec.collective_rpc_async("sleep_ms", {caf::make_message(int32_t{200}), {}, {}, {}});
  std::this_thread::sleep_for(50ms); // the workers are inside the busy call
  auto slept = exec.sleep_async(1);
  std::this_thread::sleep_for(20ms); // the sleep is under way, queued behind the busy call
  auto step = exec.execute_model_async(one_step(1));
  CHECK(code_of([&] { step.get(); }) == errc::sleeping);
  slept.get();
  busy.get();
  // A raw collective_rpc("sleep") bypasses the executor's state: the worker still refuses.
  exec.wake_up();
  exec.collective_rpc("sleep",
                      {caf::make_message(sleep_request{sleep_level::discard}), {}, {}, {}});
  CHECK(code_of([&] {
          exec.collective_rpc("execute_model", {caf::make_message(one_step(1)), {}, {}, {}});
        }) == errc::sleeping);
  exec.collective_rpc("wake_up", {caf::make_message(wake_request{}), {}, {}, {}});
}

TEST_CASE("malformed sleep and wake arguments are errors") {
  executor exec{config(1), test_factory()};
  rpc_call_options bad_tag;
  bad_tag.args = caf::make_message(wake_request{{static_cast<memory_tag>(200)}});
  CHECK(code_of([&] { exec.collective_rpc("wake_up", bad_tag); }) == errc::invalid_argument);
  rpc_call_options bad_level;
  bad_level.kwargs["level"] = int64_t{(int64_t{1} << 32) + 1};
  CHECK(code_of([&] { exec.collective_rpc("sleep", bad_level); }) == errc::invalid_argument);
  rpc_call_options zero;
  zero.timeout = timeout_type{0};
  CHECK(code_of([&] { exec.collective_rpc("rank", zero); }) == errc::invalid_argument);
  rpc_call_options none_at_once;
  none_at_once.max_concurrent_workers = 0;
  CHECK(code_of([&] { exec.collective_rpc("rank", none_at_once); }) == errc::invalid_argument);
}

TEST_CASE("without a restart policy a dead worker fails the executor for good") {
  executor exec{config(2), test_factory()};
  CHECK(code_of([&] { kill_rank(exec, 1); }) == errc::worker_died);
  auto what = what_of([&] { exec.collective_rpc("rank"); });
  CHECK(what.find("rank 1 went down") != std::string::npos);
  CHECK(what.find("injected fault") != std::string::npos);
}

TEST_CASE("under a restart policy a dead worker is replaced and brought to the others' state") {
  auto cfg = config(3);
  cfg.restart.max_restarts = 2;
  executor exec{cfg, test_factory()};
  exec.initialize_cache({10, 1});
  CHECK(exec.add_lora({"a", 4, "/a"}));
  CHECK(exec.add_lora({"b", 5, "/b"}));
  CHECK(exec.pin_lora(4));
  CHECK(exec.remove_lora(5));
  exec.execute_model(one_step(3));
  for (int32_t rank : {2, 0}) {
    CAPTURE(rank);
    // The call during which the worker died reports it; its work is lost.
    auto what = what_of([&] { kill_rank(exec, rank); });
    CHECK(what.find("worker_replaced") != std::string::npos);
    CHECK(what.find("rank " + std::to_string(rank) + " went down") != std::string::npos);
    // Later calls reach the replacement, which holds what the others hold.
    auto ranks = exec.collective_rpc_as<int32_t>("rank");
    CHECK(ranks == std::vector<int32_t>{0, 1, 2});
    CHECK(exec.list_loras() == std::vector<int64_t>{4});
    // No step was in flight: the next one says that the KV cache went with the worker.
    CHECK(code_of([&] { exec.execute_model(one_step(5)); }) == errc::worker_replaced);
    // A step made before the replacement, counting on kept block tables, is refused too;
    // the first that sends every table whole is taken, and those after it.
    auto kept = one_step(5);
    kept.keep_block_tables = true;
    auto delta = kept;
    delta.seq_group_metadata_list[0].seqs[0].first_block = 1;
    CHECK(code_of([&] { exec.execute_model(delta); }) == errc::worker_replaced);
    CHECK(exec.execute_model(kept)[0].outputs[0].samples[0].output_token == 10);
    CHECK(code_of([&] { exec.execute_model(delta); }) == errc::none);
    CHECK(exec.execute_model(one_step(5))[0].outputs[0].samples[0].output_token == 10);
    exec.stop_remote_worker_execution_loop();
  }
  exec.check_health();
  auto health = exec.worker_healths();
  REQUIRE(health.size() == 3);
  CHECK(health[0].restarts == 1);
  CHECK(health[1].restarts == 0);
  CHECK(health[2].restarts == 1);
  // A third death within the window is one too many: the executor fails for good.
  auto what = what_of([&] { kill_rank(exec, 1); });
  CHECK(what.find("worker_died") != std::string::npos);
  CHECK(what.find("2 replacement(s) within the last") != std::string::npos);
  CHECK(code_of([&] { exec.collective_rpc("rank"); }) == errc::worker_died);
}

TEST_CASE("an adapter call in flight at a death leaves every rank with the same adapters") {
  auto cfg = config(3);
  cfg.restart.max_restarts = 1;
  executor exec{cfg, test_factory()};
  CHECK(exec.add_lora({"kept", 4, "/kept"}));
  // Rank 1 dies a moment after the call, with add_lora already in its mailbox: ranks 0
  // and 2 add the adapter, rank 1 never does.
  auto dying = exec.collective_rpc_async([](worker& w, const caf::message&, const caf::settings&) {
    if (w.rank() == 1) {
      std::this_thread::sleep_for(200ms);
      throw worker_fault{"injected fault"};
    }
    return caf::message{};
  });
  auto adding = exec.add_lora_async({"partial", 9, "/partial"});
  CHECK(code_of([&] { dying.get(); }) == errc::worker_replaced);
  CHECK(code_of([&] { adding.get(); }) == errc::worker_replaced);
  // Not "ranks disagree": the adapter only some ranks held is gone from all.
  CHECK(exec.list_loras() == std::vector<int64_t>{4});
  CHECK(exec.add_lora({"partial", 9, "/partial"}));
  CHECK(exec.list_loras() == std::vector<int64_t>{4, 9});
}

TEST_CASE("a worker replaced while the others sleep falls asleep as they are") {
  auto cfg = config(2);
  cfg.restart.max_restarts = 1;
  executor exec{cfg, test_factory()};
  exec.initialize_cache({10, 1});
  auto before = exec.collective_rpc_as<int64_t>("checksum");
  exec.sleep(1);
  CHECK(code_of([&] { kill_rank(exec, 1); }) == errc::worker_replaced);
  CHECK(exec.is_sleeping());
  auto health = exec.worker_healths();
  REQUIRE(health.size() == 2);
  CHECK(health[1].restarts == 1);
  CHECK(health[1].sleeping_tags == health[0].sleeping_tags);
  CHECK(health[1].sleeping_tags.size() == 2);
  // Its memory is released as the others' is.
  auto resident = exec.collective_rpc_as<int64_t>("resident_bytes");
  CHECK(resident[1] == resident[0]);
  exec.wake_up();
  CHECK(exec.collective_rpc_as<int64_t>("checksum") == before);
  CHECK(code_of([&] { exec.execute_model(one_step(5)); }) == errc::worker_replaced);
  CHECK(exec.execute_model(one_step(5))[0].outputs[0].samples[0].output_token == 10);
  exec.stop_remote_worker_execution_loop();
}

TEST_CASE("calls made while a worker is replaced wait for it, within their deadline") {
  auto cfg = config(2);
  cfg.restart.max_restarts = 2;
  auto made = std::make_shared<std::atomic<int>>(0);
  auto base = test_factory();
  // The replacement (the third worker made) takes two seconds to start.
  executor exec{cfg, [=](int32_t rank) {
                  if (++*made > 2)
                    std::this_thread::sleep_for(2s);
                  return base(rank);
                }};
  CHECK(code_of([&] { kill_rank(exec, 1); }) == errc::worker_replaced);
  // Said at once while it goes on, with the cause.
  auto recovering = exec.recovery();
  CHECK(recovering.find("recovering rank 1") != std::string::npos);
  CHECK(recovering.find("injected fault") != std::string::npos);
  rpc_call_options hurried;
  hurried.timeout = 100ms;
  auto patient = exec.collective_rpc_async("rank");
  auto what = what_of([&] { exec.collective_rpc("rank", hurried); });
  CHECK(what.find("timeout") != std::string::npos);
  CHECK(what.find("for the replacement of rank 1") != std::string::npos);
  REQUIRE(patient.get().size() == 2);
  CHECK(exec.recovery().empty());
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});

  // A call that waited keeps its deadline, not a fresh one: made about a second into the
  // next two-second replacement with 1.5 s to run, it has about half a second left for a
  // method that takes 0.8 s.
  CHECK(code_of([&] { kill_rank(exec, 1); }) == errc::worker_replaced);
  std::this_thread::sleep_for(1s);
  rpc_call_options slow;
  slow.timeout = 1500ms;
  slow.args = caf::make_message(int32_t{800});
  auto late = exec.collective_rpc_async("sleep_ms", slow);
  CHECK(code_of([&] { late.get(); }) == errc::timeout);
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
}

TEST_CASE("a worker that dies during sleep or wake_up is replaced and every rank ends alike") {
  auto cfg = config(2);
  cfg.restart.max_restarts = 4;
  executor exec{cfg, test_factory()};
  exec.initialize_cache({10, 1});
  auto before = exec.collective_rpc_as<int64_t>("checksum");
  auto alike = [&] {
    auto health = exec.worker_healths();
    REQUIRE(health.size() == 2);
    CHECK(health[0].sleeping_tags == health[1].sleeping_tags);
    CHECK(exec.is_sleeping() == !health[0].sleeping_tags.empty());
  };
  for (std::string call : {"sleep", "wake_up"}) {
    for (int32_t rank : {1, 0}) {
      CAPTURE(call);
      CAPTURE(rank);
      exec.collective_rpc("die_in_on", {caf::make_message(rank, call), {}, {}, {}});
      auto code = call == "sleep" ? code_of([&] { exec.sleep(1); })
                                  : (exec.sleep(1), code_of([&] { exec.wake_up(); }));
      // The call completes or says that a worker was replaced; either way every rank is in
      // the state the executor reports, and a retry finishes the job.
      CHECK((code == errc::none || code == errc::worker_replaced));
      alike();
      // The call's own effect holds, on the replacement too.
      CHECK(exec.is_sleeping() == (call == "sleep"));
      if (exec.is_sleeping())
        exec.wake_up();
      alike();
      CHECK(!exec.is_sleeping());
      CHECK(exec.collective_rpc_as<int64_t>("checksum") == before);
    }
  }
  CHECK(exec.worker_healths()[0].restarts == 2);
  CHECK(exec.worker_healths()[1].restarts == 2);
}

TEST_CASE("a worker that dies during initialize_cache or save_sharded_state is replaced and "
          "every rank ends alike") {
  namespace fs = std::filesystem;
  auto cfg = config(2);
  cfg.restart.max_restarts = 4;
  executor exec{cfg, test_factory()};
  exec.initialize_cache({10, 1});
  auto ten = exec.collective_rpc_as<int64_t>("kv_bytes");
  REQUIRE(ten[0] > 0);
  auto dir = fs::temp_directory_path() / ("troupe-death-save-" + std::to_string(getpid()));
  fs::create_directories(dir);
  for (int32_t rank : {1, 0}) {
    CAPTURE(rank);
    // The blocks asked for hold on every rank, the replacement's too, whatever the call
    // says; the retry changes nothing.
    exec.collective_rpc("die_in_on",
                        {caf::make_message(rank, std::string{"initialize_cache"}), {}, {}, {}});
    auto code = code_of([&] { exec.initialize_cache({20, 1}); });
    CHECK((code == errc::none || code == errc::worker_replaced));
    auto twenty = exec.collective_rpc_as<int64_t>("kv_bytes");
    CHECK(twenty[0] == 2 * ten[0]);
    CHECK(twenty[1] == twenty[0]);
    exec.initialize_cache({20, 1});
    CHECK(exec.collective_rpc_as<int64_t>("kv_bytes") == twenty);
    exec.initialize_cache({10, 1});
    // A save during which a rank dies leaves no file, and its retry lands whole.
    exec.collective_rpc("die_in_on",
                        {caf::make_message(rank, std::string{"save_sharded_state"}), {}, {}, {}});
    CHECK(code_of([&] { exec.save_sharded_state(dir.string()); }) == errc::worker_replaced);
    CHECK(fs::is_empty(dir));
    exec.save_sharded_state(dir.string());
    std::set<std::string> names;
    for (auto& entry : fs::directory_iterator(dir))
      names.insert(entry.path().filename().string());
    CHECK(names == std::set<std::string>{"test-rank-0.bin", "test-rank-1.bin"});
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  CHECK(exec.worker_healths()[0].restarts == 2);
  CHECK(exec.worker_healths()[1].restarts == 2);
  fs::remove_all(dir);
}
