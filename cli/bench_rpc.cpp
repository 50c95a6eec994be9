// `troupe bench rpc`: latency of collective_rpc on a no-op method from the blocking facade,
// with idle workers and with workers kept busy by a second caller; plus the floors set by
// bare thread wake-ups on this machine, the scatter-gather one measured in turns with the
// executor's calls.

#include "cli/commands.hpp"

#include "troupe/errors.hpp"
#include "troupe/executor.hpp"

#include <caf/make_message.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>
#include <tuple>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

namespace troupe::cli {

namespace {

using clock_type = std::chrono::steady_clock;

/// Busy for `us` microseconds: a thread that is running, not sleeping.
void spin_for(int us) {
  auto until = clock_type::now() + std::chrono::microseconds(us);
  while (clock_type::now() < until) {
  }
}

/// The worker of the benchmark: a no-op, a busy loop, and a model step that computes
/// nothing (one empty output), so that `execute_model` measures the executor's path alone.
class bench_worker : public worker {
public:
  std::vector<sampler_output> execute_model(const execute_model_request&) override {
    return {sampler_output{}};
  }

  bench_worker() {
    register_method(
      "noop", [](worker&, const caf::message&, const caf::settings&) { return caf::message{}; });
    register_method("spin", [](worker&, const caf::message& args, const caf::settings&) {
      spin_for(args.match_elements<int32_t>() ? args.get_as<int32_t>(0) : 50);
      return caf::message{};
    });
  }
};

struct stats {
  double p50_us = 0;
  double p99_us = 0;
  double mean_us = 0;
  double calls_per_s = 0;
  /// Resident set size of the process when the mode ended: flat over a long run, or a leak.
  int64_t rss_bytes = 0;
  /// Busy mode: the share of the time the workers spent in the second caller's calls. Near
  /// 1 when they were kept busy; near 0 when the measured calls starved that caller, so
  /// that they met idle workers.
  double load_share = -1;
};

stats summarize(std::vector<double> us, double wall_s) {
  stats s;
  if (us.empty())
    return s;
  std::sort(us.begin(), us.end());
  auto at = [&](double q) {
    return us[std::min(us.size() - 1, static_cast<size_t>(q * us.size()))];
  };
  s.p50_us = at(0.50);
  s.p99_us = at(0.99);
  s.mean_us = std::accumulate(us.begin(), us.end(), 0.0) / us.size();
  s.calls_per_s = us.size() / wall_s;
  return s;
}

/// Makes `n` calls, adding each one's time in µs to `samples`; returns the time of all.
std::chrono::duration<double> time_calls(const std::function<void()>& call, int n,
                                         std::vector<double>& samples) {
  auto wall_start = clock_type::now();
  for (int i = 0; i < n; ++i) {
    auto start = clock_type::now();
    call();
    samples.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - start).count());
  }
  return clock_type::now() - wall_start;
}

stats measure(const std::function<void()>& call, int iterations) {
  std::vector<double> samples;
  samples.reserve(iterations);
  // Warm-up: first calls pay for thread start-up and allocation.
  for (int i = 0; i < std::min(iterations, 100); ++i)
    call();
  auto wall = time_calls(call, iterations, samples);
  auto s = summarize(std::move(samples), wall.count());
  s.rss_bytes = resident_bytes();
  return s;
}

/// `n` threads, each waiting on its own mutex and condition variable (a mailbox of calls,
/// answered in order) and replying through the caller's: `call` is a scatter-gather to all
/// of them. Callers on several threads may call at once, as the executor's may.
class gather_group {
public:
  explicit gather_group(int n) : boxes_(static_cast<size_t>(n)) {
    for (auto& box : boxes_)
      threads_.emplace_back([&box] {
        for (;;) {
          std::unique_lock<std::mutex> lk{box.mtx};
          box.cv.wait(lk, [&] { return box.stop || !box.calls.empty(); });
          if (box.stop)
            return;
          auto job = box.calls.front();
          box.calls.pop_front();
          lk.unlock();
          spin_for(job.spin_us);
          // Under the lock: the caller's state lives on its stack until it saw the reply.
          std::lock_guard<std::mutex> reply{job.from->mtx};
          if (--job.from->left == 0)
            job.from->cv.notify_one();
        }
      });
  }

  ~gather_group() {
    for (auto& box : boxes_) {
      std::lock_guard<std::mutex> lk{box.mtx};
      box.stop = true;
      box.cv.notify_one();
    }
    for (auto& t : threads_)
      t.join();
  }

  /// Asks every thread to spin for `spin_us` (0: to answer at once) and waits for all.
  void call(int spin_us = 0) {
    caller me;
    me.left = static_cast<int>(boxes_.size());
    for (auto& box : boxes_) {
      std::lock_guard<std::mutex> lk{box.mtx};
      box.calls.push_back({&me, spin_us});
      box.cv.notify_one();
    }
    std::unique_lock<std::mutex> lk{me.mtx};
    me.cv.wait(lk, [&] { return me.left == 0; });
  }

private:
  struct caller {
    std::mutex mtx;
    std::condition_variable cv;
    int left = 0;
  };
  struct job {
    caller* from;
    int spin_us;
  };
  struct mailbox {
    std::mutex mtx;
    std::condition_variable cv;
    std::deque<job> calls;
    bool stop = false;
  };
  std::vector<mailbox> boxes_;
  std::vector<std::thread> threads_;
};

/// `call` measured while a second caller keeps the same workers busy with calls of
/// `spin_us` back to back (`load` makes one such call); `load_share` as in `stats`.
stats measure_busy(const std::function<void()>& call, const std::function<void()>& load,
                   int spin_us, int iterations) {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> loads{0};
  std::thread loader([&] {
    while (!stop) {
      load();
      ++loads;
    }
  });
  auto start = clock_type::now();
  auto before = loads.load();
  auto s = measure(call, iterations);
  std::chrono::duration<double, std::micro> wall = clock_type::now() - start;
  s.load_share = static_cast<double>(loads - before) * spin_us / wall.count();
  stop = true;
  loader.join();
  return s;
}

/// `a` and `b` measured in turns, `chunk` calls of each at a time: on a machine whose
/// speed drifts (a shared VM), both meet the same conditions, so their ratio holds where
/// two measurements one after the other would not. The first call of each chunk is not
/// counted: it meets threads that slept through the other's turn, which back-to-back calls
/// never do.
std::pair<stats, stats> measure_in_turns(const std::function<void()>& a,
                                         const std::function<void()>& b, int iterations,
                                         int chunk = 50) {
  for (int i = 0; i < std::min(iterations, 100); ++i) { // warm-up
    a();
    b();
  }
  std::vector<double> samples[2];
  std::chrono::duration<double> wall[2]{};
  const std::function<void()>* calls[2] = {&a, &b};
  for (int done = 0; done < iterations; done += chunk)
    for (int k = 0; k < 2; ++k) {
      (*calls[k])();
      wall[k] += time_calls(*calls[k], std::min(chunk, iterations - done), samples[k]);
    }
  return {summarize(std::move(samples[0]), wall[0].count()),
          summarize(std::move(samples[1]), wall[1].count())};
}

/// The same scatter-gather made by a middle thread on behalf of this one, which hands it
/// the call and waits for its answer: the floor of any design with a supervisor thread
/// between the caller and the workers (two hand-offs more than `scatter_gather_floor`).
stats relayed_gather_floor(int n, int iterations) {
  gather_group group{n};
  std::mutex mtx;
  std::condition_variable cv;
  int turn = 0; // 0: the caller's, 1: the middle's, -1: stop
  std::thread middle([&] {
    std::unique_lock<std::mutex> lk{mtx};
    for (;;) {
      cv.wait(lk, [&] { return turn != 0; });
      if (turn < 0)
        return;
      lk.unlock();
      group.call();
      lk.lock();
      turn = 0;
      cv.notify_all();
    }
  });
  auto s = measure(
    [&] {
      std::unique_lock<std::mutex> lk{mtx};
      turn = 1;
      cv.notify_all();
      cv.wait(lk, [&] { return turn == 0; });
    },
    iterations);
  {
    std::lock_guard<std::mutex> lk{mtx};
    turn = -1;
  }
  cv.notify_all();
  middle.join();
  s.rss_bytes = 0;
  return s;
}

/// CPU seconds this process used (user and system), from /proc/self/stat.
double cpu_seconds() {
  std::ifstream stat{"/proc/self/stat"};
  std::string text{std::istreambuf_iterator<char>(stat), std::istreambuf_iterator<char>()};
  // Fields after the command name (which may hold spaces) start after its ')'.
  std::istringstream rest{text.substr(text.rfind(')') + 2)};
  std::string field;
  double utime = 0;
  double stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14)
      utime = std::stod(field);
    if (i == 15)
      stime = std::stod(field);
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::string to_json(const stats& s, int workers, const std::string& mode) {
  std::ostringstream out;
  out.precision(1);
  out << std::fixed << "{\"workers\":" << workers << ",\"mode\":\"" << mode
      << "\",\"p50_us\":" << s.p50_us << ",\"p99_us\":" << s.p99_us << ",\"mean_us\":" << s.mean_us
      << ",\"calls_per_s\":" << s.calls_per_s;
  if (s.rss_bytes > 0)
    out << ",\"rss_bytes\":" << s.rss_bytes;
  if (s.load_share >= 0)
    out << ",\"load_share\":" << std::setprecision(2) << s.load_share;
  out << "}";
  return out.str();
}

/// Round trip of one byte between two threads over a connected pair of sockets, `client`
/// and `peer`, each thread blocking in its read; closes both.
stats round_trip_floor(int client, int peer, int iterations) {
  std::thread echo([peer] {
    char byte;
    while (read(peer, &byte, 1) == 1 && write(peer, &byte, 1) == 1) {
    }
    close(peer);
  });
  std::vector<double> samples;
  auto wall_start = clock_type::now();
  char byte = 1;
  for (int i = 0; i < iterations; ++i) {
    auto start = clock_type::now();
    if (write(client, &byte, 1) != 1 || read(client, &byte, 1) != 1)
      break;
    samples.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - start).count());
  }
  close(client);
  echo.join();
  std::chrono::duration<double> wall = clock_type::now() - wall_start;
  return summarize(std::move(samples), wall.count());
}

/// The round trip over a loopback TCP connection (Nagle off): the least a call to a worker
/// in another process can cost here over TCP.
stats tcp_round_trip_floor(int iterations) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (listener >= 0)
      close(listener);
    throw error{errc::worker_error, "bench rpc: cannot open a loopback socket"};
  }
  int client = socket(AF_INET, SOCK_STREAM, 0);
  int peer = client >= 0 && connect(client, reinterpret_cast<sockaddr*>(&addr), len) == 0
               ? accept(listener, nullptr, nullptr)
               : -1;
  close(listener);
  if (peer < 0) {
    close(client);
    throw error{errc::worker_error, "bench rpc: cannot connect over loopback"};
  }
  int one = 1;
  setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(peer, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return round_trip_floor(client, peer, iterations);
}

/// The round trip over a Unix socket: the least a call to a node on this host can cost
/// over the node's local socket (`cluster_config::node_local_links`).
stats unix_round_trip_floor(int iterations) {
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, pair) != 0)
    throw error{errc::worker_error, "bench rpc: cannot open a Unix socket pair"};
  return round_trip_floor(pair[0], pair[1], iterations);
}

} // namespace

int64_t resident_bytes() {
  std::ifstream statm{"/proc/self/statm"};
  int64_t size = 0;
  int64_t resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

std::unique_ptr<worker> make_bench_worker() {
  return std::make_unique<bench_worker>();
}

std::shared_ptr<command> add_bench_rpc(CLI::App& bench) {
  struct options {
    int workers = 4;
    int iterations = 2000;
    int busy_spin_us = 50;
    int idle_seconds = 10;
    std::string method = "noop";
    size_t scheduler_threads = 0;
    size_t poll_attempts = 0;
    int64_t linger_us = executor_config{}.linger.count();
    bool json = false;
    node_options nodes;
  };
  auto opts = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  cmd->app = bench.add_subcommand("rpc", "collective_rpc latency of a no-op method");
  cmd->app->add_option("--workers", opts->workers, "Worker actors (tensor parallel size)")
    ->check(CLI::Range(1, 256))
    ->capture_default_str();
  cmd->app->add_option("--iterations", opts->iterations, "Measured calls per mode")
    ->check(CLI::Range(1, 10000000))
    ->capture_default_str();
  cmd->app
    ->add_option("--busy-spin-us", opts->busy_spin_us,
                 "Length of each call of the second caller that keeps workers busy")
    ->check(CLI::Range(1, 1000000))
    ->capture_default_str();
  cmd->app
    ->add_option("--scheduler-threads", opts->scheduler_threads,
                 "Threads of CAF's scheduler (0: one per core)")
    ->capture_default_str();
  cmd->app
    ->add_option("--scheduler-poll-attempts", opts->poll_attempts,
                 "Polls of an idle scheduler thread before it sleeps (0: CAF's default)")
    ->capture_default_str();
  cmd->app
    ->add_option("--linger-us", opts->linger_us,
                 "How long workers and the caller stay awake around a call before they sleep "
                 "(0: at once)")
    ->check(CLI::Range(int64_t{0}, max_linger.count()))
    ->capture_default_str();
  cmd->app
    ->add_option("--idle-seconds", opts->idle_seconds,
                 "How long the idle executor's CPU use is measured")
    ->check(CLI::Range(1, 3600))
    ->capture_default_str();
  cmd->app
    ->add_option("--method", opts->method,
                 "noop: collective_rpc of a no-op; execute_model: a step through the driver "
                 "and the execution loop, with workers that compute nothing")
    ->check(CLI::IsMember({"noop", "execute_model"}))
    ->capture_default_str();
  cmd->app->add_flag("--json", opts->json, "Print only JSON (the last line is the result array)");
  add_node_options(*cmd->app, opts->nodes);
  cmd->run = [opts] {
    executor_config cfg;
    cfg.tensor_parallel_size = opts->workers;
    apply_node_options(opts->nodes, cfg);
    cfg.cluster.node_worker_kind = "bench";
    cfg.scheduler_threads = opts->scheduler_threads;
    cfg.scheduler_poll_attempts = opts->poll_attempts;
    cfg.linger = std::chrono::microseconds(opts->linger_us);
    executor exec{cfg, [](int32_t) { return make_bench_worker(); }};
    int32_t remote = 0;
    for (auto& n : cfg.cluster.nodes)
      remote += n.workers;

    // A hand-off to a middle thread that has no workers to ask: one thread wake-up round
    // trip, the least a cross-thread request and reply can cost here.
    auto floor = relayed_gather_floor(0, opts->iterations);
    auto relayed_floor = relayed_gather_floor(opts->workers, opts->iterations);
    auto tcp_floor = tcp_round_trip_floor(opts->iterations);
    auto unix_floor = unix_round_trip_floor(opts->iterations);
    // One sequence of one token: the smallest step there is.
    execute_model_request step;
    {
      sequence_group_metadata g;
      g.request_id = "bench";
      g.token_chunk_size = 1;
      sequence_data s;
      s.token_ids = {1};
      s.block_table = {0};
      g.seqs.push_back(s);
      step.seq_group_metadata_list.push_back(g);
    }
    std::function<void()> call = [&] { exec.collective_rpc("noop"); };
    if (opts->method == "execute_model")
      call = [&] { exec.execute_model(step); };
    // The floor of the same scatter-gather, measured in turns with the executor's calls.
    stats idle;
    stats gather_floor;
    {
      gather_group group{opts->workers};
      std::tie(idle, gather_floor) = measure_in_turns(
        call, [&] { group.call(); }, opts->iterations);
    }
    idle.rss_bytes = resident_bytes();

    // Busy: a second caller keeps every worker running short calls back to back; then the
    // same for the floor's threads.
    rpc_call_options spin;
    spin.args = caf::make_message(static_cast<int32_t>(opts->busy_spin_us));
    auto busy = measure_busy(
      call, [&] { exec.collective_rpc("spin", spin); }, opts->busy_spin_us, opts->iterations);
    stats busy_floor;
    {
      gather_group group{opts->workers};
      busy_floor = measure_busy([&] { group.call(); }, [&] { group.call(opts->busy_spin_us); },
                                opts->busy_spin_us, opts->iterations);
      busy_floor.rss_bytes = 0;
    }
    if (opts->method == "execute_model")
      exec.stop_remote_worker_execution_loop();
    // An idle executor should cost nothing: the CPU it uses while nobody calls.
    exec.collective_rpc("noop");
    auto cpu_before = cpu_seconds();
    auto idle_start = clock_type::now();
    std::this_thread::sleep_for(std::chrono::seconds(opts->idle_seconds));
    std::chrono::duration<double> idle_wall = clock_type::now() - idle_start;
    auto idle_cpu_share = (cpu_seconds() - cpu_before) / idle_wall.count();
    exec.shutdown();

    if (!opts->json) {
      std::cout << (opts->method == "noop" ? "collective_rpc(\"noop\")" : "execute_model")
                << " over " << opts->workers << " worker(s), " << opts->iterations
                << " calls per mode\n"
                << "  idle: p50 " << idle.p50_us << " us, p99 " << idle.p99_us << " us\n"
                << "  busy: p50 " << busy.p50_us << " us, p99 " << busy.p99_us
                << " us (workers busy " << busy.load_share * 100
                << " % of the time); busy p50 / idle p50 " << busy.p50_us / idle.p50_us << "\n"
                << "  resident memory: " << idle.rss_bytes / (1 << 20) << " MiB after idle, "
                << busy.rss_bytes / (1 << 20) << " MiB after busy\n"
                << "  floor (thread wake-up round trip): p50 " << floor.p50_us << " us\n"
                << "  floor (scatter-gather to " << opts->workers << " threads): p50 "
                << gather_floor.p50_us << " us; idle p50 / floor "
                << idle.p50_us / gather_floor.p50_us << "\n"
                << "  floor busy (the same threads kept busy the same way): p50 "
                << busy_floor.p50_us << " us (busy " << busy_floor.load_share * 100
                << " % of the time); busy p50 / floor busy p50 " << busy.p50_us / busy_floor.p50_us
                << "\n"
                << "  floor (the same through a middle thread): p50 " << relayed_floor.p50_us
                << " us; idle p50 / floor " << idle.p50_us / relayed_floor.p50_us << "\n"
                << "  idle executor: " << idle_cpu_share * 100 << " % of a core over "
                << opts->idle_seconds << " s\n"
                << "  floor (loopback TCP round trip): p50 " << tcp_floor.p50_us << " us\n"
                << "  floor (Unix socket round trip): p50 " << unix_floor.p50_us << " us\n";
      if (remote > 0)
        std::cout << "  " << remote << " of the workers on " << cfg.cluster.nodes.size()
                  << " node(s); idle p50 / TCP floor " << idle.p50_us / tcp_floor.p50_us
                  << ", / Unix floor " << idle.p50_us / unix_floor.p50_us << "\n";
    }
    std::cout << "{\"floor\":" << to_json(floor, 0, "thread_wakeup_round_trip")
              << ",\"gather_floor\":"
              << to_json(gather_floor, opts->workers, "thread_scatter_gather")
              << ",\"busy_gather_floor\":"
              << to_json(busy_floor, opts->workers, "thread_scatter_gather_busy")
              << ",\"relayed_gather_floor\":"
              << to_json(relayed_floor, opts->workers, "thread_relayed_scatter_gather")
              << ",\"tcp_floor\":" << to_json(tcp_floor, 0, "loopback_tcp_round_trip")
              << ",\"unix_floor\":" << to_json(unix_floor, 0, "unix_socket_round_trip")
              << ",\"idle_cpu_share\":" << idle_cpu_share << "}\n";
    auto mode = [&](const char* m) {
      auto name = opts->method == "noop" ? std::string{m} : opts->method + "_" + m;
      return remote > 0 ? name + "_nodes" : name;
    };
    std::cout << "[" << to_json(idle, opts->workers, mode("idle")) << ","
              << to_json(busy, opts->workers, mode("busy")) << "]" << std::endl;
    return 0;
  };
  return cmd;
}

} // namespace troupe::cli
