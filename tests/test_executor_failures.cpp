// Deadlines, dead workers, workers in another process, and shutdown that never hangs.

#include "troupe/executor.hpp"

#include "tests/child_process.hpp"
#include "tests/test_worker.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <csignal>
#include <numeric>
#include <thread>
#include <unistd.h>

using namespace troupe;
using namespace std::chrono_literals;
using troupe::testing::code_of;
using troupe::testing::test_factory;
using troupe::testing::what_of;
using clock_type = std::chrono::steady_clock;

namespace {

executor_config config(int32_t workers) {
  executor_config cfg;
  cfg.tensor_parallel_size = workers;
  cfg.rpc_timeout = 20s;
  return cfg;
}

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

rpc_call_options sleep_ms(int32_t ms) {
  rpc_call_options opts;
  opts.args = caf::make_message(ms);
  return opts;
}

/// A test worker published by another process (tests/worker_host.cpp).
struct worker_process : testing::child_process {
  worker_process() : child_process(TROUPE_WORKER_HOST) {}
};

} // namespace

TEST_CASE("a timeout fires near its deadline and names the late rank") {
  executor exec{config(2), test_factory()};
  auto opts = sleep_ms(3000);
  opts.timeout = 200ms;
  auto start = clock_type::now();
  try {
    exec.collective_rpc("sleep_ms", opts);
    FAIL("the call must time out");
  } catch (const error& e) {
    CHECK(e.code() == errc::timeout);
    CHECK(std::string{e.what()}.find("rank") != std::string::npos);
  }
  auto took = seconds_since(start);
  MESSAGE("timed out after " << took << " s");
  CHECK(took >= 0.2);
  CHECK(took < 2.5); // well before the workers finish
}

TEST_CASE("a reply that comes after its call timed out is dropped, not taken for the next call's") {
  executor exec{config(2), test_factory()};
  auto late = sleep_ms(1000);
  late.timeout = 100ms;
  try {
    exec.collective_rpc("sleep_ms", late);
    FAIL("the call must time out");
  } catch (const error& e) {
    CHECK(e.code() == errc::timeout);
  }
  // Queued behind the sleeping call on each worker: the sleep's replies come first.
  rpc_call_options opts;
  opts.kwargs["name"] = std::string{"next"};
  CHECK(exec.collective_rpc_as<std::string>("kwarg", opts) ==
        std::vector<std::string>{"next", "next"});
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
}

TEST_CASE("the default deadline comes from the config and waiting forever must be asked for") {
  auto cfg = config(1);
  cfg.rpc_timeout = 150ms;
  executor exec{cfg, test_factory()};
  CHECK(code_of([&] { exec.collective_rpc("sleep_ms", sleep_ms(1500)); }) == errc::timeout);
  auto opts = sleep_ms(400);
  opts.timeout = wait_forever;
  CHECK(exec.collective_rpc_as<int32_t>("sleep_ms", opts) == std::vector<int32_t>{0});
}

TEST_CASE("a callable is refused for a worker in another process and named methods work there") {
  worker_process remote;
  auto cfg = config(2);
  cfg.cluster.remote_workers = {{"127.0.0.1", remote.port()}};
  executor exec{cfg, test_factory()};
  CHECK(exec.workers()[1].pid != exec.workers()[0].pid);
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  auto callable = [](worker& w, const caf::message&, const caf::settings&) {
    return caf::make_message(w.rank());
  };
  try {
    exec.collective_rpc(callable);
    FAIL("a callable must not go to another process");
  } catch (const error& e) {
    CHECK(e.code() == errc::remote_callable);
    CHECK(std::string{e.what()}.find("rank(s) 1") != std::string::npos);
  }
  CHECK(code_of([&] { exec.apply_model([](model&) { return caf::message{}; }); }) ==
        errc::remote_callable);
  // Sleep, wake and the execution loop work across the process boundary too.
  exec.sleep(1);
  exec.wake_up();
  execute_model_request req;
  req.seq_group_metadata_list.push_back({"r", true, {{0, {1, 2}, 2, 0, {0}}}, {}, 2, true, 0, 0});
  CHECK(exec.execute_model(req)[0].outputs[0].samples[0].output_token == 3);
  exec.stop_remote_worker_execution_loop();
  CHECK(exec.collective_rpc_as<int64_t>("steps") == std::vector<int64_t>{1, 1});
}

TEST_CASE(
  "a worker killed mid-call fails the call with worker_died at once and later calls fail fast") {
  worker_process remote;
  auto cfg = config(2);
  cfg.cluster.remote_workers = {{"127.0.0.1", remote.port()}};
  executor exec{cfg, test_factory()};
  auto pending = exec.collective_rpc_async("sleep_ms", sleep_ms(10000));
  std::this_thread::sleep_for(300ms);
  auto start = clock_type::now();
  remote.kill_now();
  try {
    pending.get();
    FAIL("the call must fail");
  } catch (const error& e) {
    CHECK(e.code() == errc::worker_died);
    auto where = "rank 1 on worker host 127.0.0.1:" + std::to_string(remote.port());
    CHECK_MESSAGE(std::string{e.what()}.find(where) != std::string::npos, std::string{e.what()});
    // Killed: its port refuses, or (while the kernel closes its sockets) closes at once.
    CHECK_MESSAGE((std::string{e.what()}.find("its process has exited") != std::string::npos ||
                   std::string{e.what()}.find("its process is exiting") != std::string::npos),
                  std::string{e.what()});
  }
  auto took = seconds_since(start);
  MESSAGE("failed " << took << " s after the kill");
  // The death is noticed, not the 10 s call waited out (a bound well under 10 s: on a
  // loaded machine the notice itself has taken over a second).
  CHECK(took < 5.0);
  start = clock_type::now();
  CHECK(code_of([&] { exec.collective_rpc("rank"); }) == errc::worker_died);
  CHECK(code_of([&] { exec.execute_model({}); }) == errc::worker_died);
  CHECK(code_of([&] { exec.check_health(); }) == errc::worker_died);
  CHECK(seconds_since(start) < 5.0); // at once, not after a call's deadline
}

TEST_CASE("under a restart policy a dead worker published on its own is replaced by one of "
          "this process") {
  worker_process remote;
  auto cfg = config(2);
  cfg.cluster.remote_workers = {{"127.0.0.1", remote.port()}};
  cfg.restart.max_restarts = 1;
  executor exec{cfg, test_factory()};
  exec.initialize_cache({10, 1});
  REQUIRE(exec.workers()[1].pid != getpid());
  auto pending = exec.collective_rpc_async("sleep_ms", sleep_ms(10000));
  std::this_thread::sleep_for(300ms);
  remote.kill_now();
  CHECK(code_of([&] { pending.get(); }) == errc::worker_replaced);
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  // Both workers live here now: a callable, which never crosses a process, reaches both.
  auto pids = exec.collective_rpc([](worker&, const caf::message&, const caf::settings&) {
    return caf::make_message(static_cast<int64_t>(getpid()));
  });
  REQUIRE(pids.size() == 2);
  CHECK(pids[1].get_as<int64_t>(0) == getpid());
  CHECK(exec.worker_healths()[1].restarts == 1);
  CHECK(exec.collective_rpc_as<int64_t>("kv_bytes")[1] ==
        exec.collective_rpc_as<int64_t>("kv_bytes")[0]);
}

TEST_CASE("shutdown is idempotent and later calls fail with shut_down") {
  executor exec{config(2), test_factory()};
  exec.shutdown();
  exec.shutdown();
  CHECK(code_of([&] { exec.collective_rpc("rank"); }) == errc::shut_down);
  CHECK_THROWS_AS(exec.collective_rpc_async("rank").get(), error);
}

TEST_CASE("destruction without shutdown returns promptly even with a worker stuck in a call") {
  auto start = clock_type::now();
  {
    executor exec{config(2), test_factory()};
    exec.collective_rpc("rank");
  }
  CHECK(seconds_since(start) < 5.0);
  start = clock_type::now();
  {
    executor exec{config(2), test_factory()};
    auto stuck = exec.collective_rpc_async("sleep_ms", sleep_ms(60000));
    std::this_thread::sleep_for(100ms);
  }
  auto took = seconds_since(start);
  MESSAGE("destroyed with a stuck worker in " << took << " s");
  CHECK(took < executor::shutdown_grace.count() + 3.0);
}

TEST_CASE("a callable whose caller gave up is skipped and never touches the caller's stack") {
  executor exec{config(1), test_factory()};
  auto busy = exec.collective_rpc_async("sleep_ms", sleep_ms(500));
  std::this_thread::sleep_for(50ms); // the worker is inside the busy call
  {
    std::vector<int> on_stack(1000, 7);
    rpc_call_options opts;
    opts.timeout = 100ms;
    auto sum = [&](worker&, const caf::message&, const caf::settings&) {
      return caf::make_message(std::accumulate(on_stack.begin(), on_stack.end(), 0));
    };
    CHECK(code_of([&] { exec.collective_rpc(sum, opts); }) == errc::timeout);
  }
  busy.get();
  // The worker skipped the abandoned callable and goes on serving.
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0});
}

TEST_CASE("shutdown while other threads are calling ends their calls with shut_down") {
  executor exec{config(2), test_factory()};
  std::atomic<int> shut_down_errors{0};
  std::atomic<int> other_errors{0};
  std::vector<std::thread> callers;
  for (int i = 0; i < 3; ++i)
    callers.emplace_back([&] {
      for (;;) {
        try {
          exec.collective_rpc("sleep_ms", sleep_ms(5));
        } catch (const error& e) {
          (e.code() == errc::shut_down ? shut_down_errors : other_errors)++;
          return;
        }
      }
    });
  std::this_thread::sleep_for(100ms);
  exec.shutdown();
  for (auto& t : callers)
    t.join();
  CHECK(shut_down_errors.load() == 3);
  CHECK(other_errors.load() == 0);
}
