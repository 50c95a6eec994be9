// Executors with workers on nodes in other processes (tests/node_host.cpp, on loopback):
// the same results as all-local runs, generation across processes, failures noticed
// (kill -9, SIGSTOP) within the heartbeat timeout, and peers without the secret refused.

#include "kernels/log.hpp"
#include "actors/cluster/node_auth.hpp"
#include "actors/cluster/link_client.hpp"
#include "actors/cluster/remoting.hpp"
#include "messages/protocols.hpp"
#include "model/config.hpp"
#include "model/make_model.hpp"
#include "model/safetensors.hpp"
#include "tests/child_process.hpp"
#include "tests/generation.hpp"
#include "tests/skip.hpp"
#include "tests/test_pki.hpp"
#include "tests/test_worker.hpp"
#include "troupe/executor.hpp"
#include "troupe/llm.hpp"
#include "troupe/model_worker.hpp"
#include "troupe/node.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <caf/io/basp_broker.hpp>
#include <caf/io/network/default_multiplexer.hpp>

#include <doctest/doctest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <openssl/ssl.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>

using namespace troupe;
using namespace std::chrono_literals;
using troupe::testing::child_process;
using troupe::testing::code_of;
using troupe::testing::concurrency_probe;
using troupe::testing::one_step;
using troupe::testing::test_factory;
using troupe::testing::test_pki;
using troupe::testing::what_of;
using clock_type = std::chrono::steady_clock;

namespace {

const std::string secret = "correct horse battery staple";

/// A node process with `devices` worker slots.
struct node_process : child_process {
  explicit node_process(int32_t devices = 2, int32_t timeout_ms = 1000,
                        uint64_t max_message_bytes = 64 << 20)
    : child_process(TROUPE_NODE_HOST, {secret, std::to_string(devices), std::to_string(timeout_ms),
                                       std::to_string(max_message_bytes)}) {}
};

/// A node with one worker slot that kills (`how` "kill") or stops ("stop") itself as its
/// worker starts step `at` (tests/node_host.cpp's --fault).
struct faulty_node : child_process {
  faulty_node(const std::string& how, int at) : faulty_node(how, std::to_string(at)) {}
  /// At "update": as its model worker starts writing an update from disk.
  faulty_node(const std::string& how, const std::string& at)
    : child_process(TROUPE_NODE_HOST, {"--fault=" + how + "@" + at, secret, "1", "1000"}) {}
};

/// Resident memory of a process in KiB.
int64_t rss_kib(pid_t pid) {
  std::ifstream status{"/proc/" + std::to_string(pid) + "/status"};
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0)
      return std::stoll(line.substr(6));
  return -1;
}

/// A number of /proc/<pid>/status (e.g. "Threads:").
int64_t proc_status(pid_t pid, const std::string& key) {
  std::ifstream status{"/proc/" + std::to_string(pid) + "/status"};
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(key, 0) == 0)
      return std::stoll(line.substr(key.size()));
  return -1;
}

/// The TCP ports process `pid` listens on (its sockets in LISTEN state, from /proc).
std::set<uint16_t> listening_ports(pid_t pid) {
  std::set<std::string> inodes;
  auto fds = "/proc/" + std::to_string(pid) + "/fd";
  for (auto& entry : std::filesystem::directory_iterator(fds)) {
    std::error_code ec;
    auto target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0)
      inodes.insert(target.substr(8, target.size() - 9));
  }
  std::set<uint16_t> ports;
  for (auto table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in{table};
    std::string line;
    std::getline(in, line); // the column names
    while (std::getline(in, line)) {
      std::istringstream fields{line};
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
        timeout >> inode;
      if (state == "0A" && inodes.count(inode) > 0)
        ports.insert(
          static_cast<uint16_t>(std::stoul(local.substr(local.find(':') + 1), nullptr, 16)));
    }
  }
  return ports;
}

/// A BASP header announcing a payload of 4 GiB - 1.
std::array<unsigned char, 32> huge_frame_header() {
  std::array<unsigned char, 32> header{};
  header[0] = 1; // any operation: the length is read first
  header[4] = header[5] = header[6] = header[7] = 0xff;
  return header;
}

/// An actor system of a peer of the nodes (a test's own client), with troupe's messages and
/// the middleman.
struct client_system {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;

  explicit client_system(bool heartbeats = false) {
    register_messages(cfg);
    if (heartbeats)
      load_middleman(cfg, 1s, 0s); // stays connected while a test waits
    else
      cfg.load<caf::io::middleman>();
    sys = std::make_unique<caf::actor_system>(cfg);
  }
};

/// The node's gate, reached as an executor reaches it: the connection handshake with the
/// secret, then BASP over that connection. Null when the node refuses.
/// The node's gate, once the interface it publishes is `node_gate_actor`'s.
std::optional<node_gate_actor> connect_with_proof(caf::actor_system& sys, caf::scoped_actor& self,
                                                  uint16_t port,
                                                  const std::string& with_secret = secret) {
  auto fd = dial_node("127.0.0.1", port, with_secret, clock_type::now() + 5s);
  auto& mm = sys.middleman();
  auto basp = mm.named_broker<caf::io::basp_broker>(caf::atom("BASP"));
  std::optional<node_gate_actor> gate;
  self->request(basp, 5s, caf::connect_atom::value, mm.backend().new_scribe(fd), port)
    .receive(
      [&](caf::node_id&, caf::strong_actor_ptr& ptr, std::set<std::string>& interface) {
        CHECK(interface == sys.message_types<node_gate_actor>());
        gate = caf::actor_cast<node_gate_actor>(ptr);
      },
      [](caf::error&) {});
  return gate;
}

/// Connects to `port` on loopback; the socket, or -1.
int connect_to(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/// Everything `fd` receives until the peer closes it (or 5 s pass).
std::string read_until_closed(int fd) {
  timeval wait{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  std::string got;
  char buf[512];
  ssize_t n = 0;
  while ((n = recv(fd, buf, sizeof buf, 0)) > 0)
    got.append(buf, static_cast<size_t>(n));
  return got;
}

executor_config mixed_config(int32_t local, const std::vector<node_address>& nodes) {
  executor_config cfg;
  cfg.cluster.nodes = nodes;
  int32_t remote = 0;
  for (auto& n : nodes)
    remote += n.workers;
  cfg.tensor_parallel_size = local + remote;
  cfg.cluster.node_secret = secret;
  cfg.cluster.node_worker_kind = "test";
  cfg.cluster.node_timeout = 1s;
  cfg.rpc_timeout = 20s;
  cfg.startup_timeout = 20s;
  return cfg;
}

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

/// An executor of `cfg`, retried until its nodes have released their previous leases;
/// fails the test after `seconds`.
std::unique_ptr<executor> lease_again_with(const executor_config& cfg, double seconds) {
  auto start = clock_type::now();
  for (;;) {
    try {
      return std::make_unique<executor>(cfg, test_factory());
    } catch (const error& e) {
      REQUIRE_MESSAGE(seconds_since(start) < seconds, std::string{e.what()});
      std::this_thread::sleep_for(50ms);
    }
  }
}

/// An executor with `workers` of the node at `port` (and no local ones), as
/// `lease_again_with`.
std::unique_ptr<executor> lease_again(uint16_t port, int32_t workers, double seconds) {
  return lease_again_with(mixed_config(0, {{"127.0.0.1", port, workers}}), seconds);
}

/// The framework's calls, their results rendered as text (pids and devices left out: they
/// differ by placement).
std::vector<std::string> run_suite(executor& exec) {
  std::vector<std::string> out;
  auto add = [&](const std::string& what, const std::string& result) {
    out.push_back(what + " = " + result);
  };
  auto text = [](const auto& xs) {
    std::ostringstream s;
    for (auto& x : xs)
      s << x << ",";
    return s.str();
  };
  add("rank", text(exec.collective_rpc_as<int32_t>("rank")));
  rpc_call_options opts;
  opts.args = caf::make_message(int32_t{3});
  add("sleep_ms", text(exec.collective_rpc_as<int32_t>("sleep_ms", opts)));
  add("fail_on", what_of([&] {
        rpc_call_options o;
        o.args = caf::make_message(int32_t{2});
        exec.collective_rpc("fail_on", o);
      }));
  // Every rank fails: which one is named depends on who answers first.
  add("unknown", to_string(code_of([&] { exec.collective_rpc("no_such_method"); })));
  auto blocks = exec.determine_num_available_blocks();
  add("blocks",
      std::to_string(blocks.num_device_blocks) + "/" + std::to_string(blocks.num_swap_blocks));
  exec.initialize_cache(blocks);
  execute_model_request req;
  sequence_group_metadata g;
  g.request_id = "r";
  g.seqs.push_back({0, {1, 2, 3}, 3, 0, {0}});
  g.token_chunk_size = 3;
  req.seq_group_metadata_list.push_back(g);
  for (int i = 0; i < 3; ++i)
    add("execute_model",
        std::to_string(exec.execute_model(req)[0].outputs[0].samples[0].output_token));
  exec.stop_remote_worker_execution_loop();
  add("steps", text(exec.collective_rpc_as<int64_t>("steps")));
  exec.add_lora({"a", 3, "/nowhere"});
  exec.add_lora({"b", 5, "/nowhere"});
  exec.remove_lora(3);
  add("loras", text(exec.list_loras()));
  add("checksum before sleep", text(exec.collective_rpc_as<int64_t>("checksum")));
  exec.sleep(1);
  add("sleeping", text(exec.sleep_state().sleeping_tags));
  exec.wake_up();
  add("checksum after wake", text(exec.collective_rpc_as<int64_t>("checksum")));
  exec.check_health();
  return out;
}

} // namespace

TEST_CASE("two nodes and local workers give the results of an all-local executor") {
  std::vector<std::string> local;
  {
    executor_config cfg;
    cfg.tensor_parallel_size = 4;
    executor exec{cfg, test_factory()};
    local = run_suite(exec);
  }
  node_process a;
  node_process b;
  auto exec = std::make_unique<executor>(
    mixed_config(2, {{"127.0.0.1", a.port(), 1}, {"127.0.0.1", b.port(), 1}}), test_factory());
  auto workers = exec->workers();
  REQUIRE(workers.size() == 4);
  CHECK(workers[0].pid == workers[1].pid);
  CHECK(workers[2].pid != workers[0].pid);
  CHECK(workers[3].pid != workers[2].pid);
  auto mixed = run_suite(*exec);
  REQUIRE(mixed.size() == local.size());
  for (size_t i = 0; i < local.size(); ++i)
    CHECK(mixed[i] == local[i]);
  // Callables never cross the network.
  CHECK(code_of([&] {
          exec->collective_rpc(
            [](worker&, const caf::message&, const caf::settings&) { return caf::message{}; });
        }) == errc::remote_callable);
}

TEST_CASE("calls to nodes give the same answers whether network threads linger or sleep") {
  // One node sleeps at once (CAF's own loop), the other lingers; so does the executor's
  // side, or not.
  child_process sleeper{TROUPE_NODE_HOST, {"--network-linger-us=0", secret, "1", "1000"}};
  node_process lingerer{1};
  for (auto linger : {0us, 100us, 2000us}) {
    auto cfg =
      mixed_config(1, {{"127.0.0.1", sleeper.port(), 1}, {"127.0.0.1", lingerer.port(), 1}});
    cfg.cluster.network_linger = linger;
    auto exec = lease_again_with(cfg, 10);
    for (int i = 0; i < 50; ++i) {
      CHECK(exec->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1, 2});
      auto out = exec->execute_model(one_step(i + 1));
      REQUIRE(out.size() == 1);
      CHECK(out[0].outputs[0].samples[0].output_token == 2 * (i + 1));
    }
  }
}

TEST_CASE("linger out of range is refused by a node and by an executor's network side") {
  node_config cfg;
  cfg.secret = secret;
  cfg.kinds["test"] = [](int32_t rank, const caf::settings&) { return test_factory()(rank); };
  for (auto linger : {-1us, 1000001us}) {
    cfg.network_linger = linger;
    CHECK(what_of([&] { node n{cfg}; }).find("network_linger") != std::string::npos);
    auto bad = mixed_config(1, {{"127.0.0.1", 1, 1}});
    bad.cluster.network_linger = linger;
    CHECK(what_of([&] { executor exec(bad, test_factory()); }).find("network_linger") !=
          std::string::npos);
  }
}

TEST_CASE("a model split across processes generates transformers' greedy tokens") {
  node_process n;
  auto cfg = mixed_config(1, {{"127.0.0.1", n.port(), 1}});
  cfg.cluster.node_worker_kind = "model";
  cfg.block_size = 4;
  model_worker_options opts;
  opts.model_path = TROUPE_SOURCE_DIR "/tests/fixtures/llama-gqa";
  opts.kv_cache_memory_bytes = 1 << 20;
  cfg.cluster.node_worker_options = to_settings(opts);
  executor exec{cfg, model_worker_factory(opts)};
  exec.initialize_cache(exec.determine_num_available_blocks());
  auto ref = testing::read_json(opts.model_path + "/reference.json");
  for (auto& p : ref["prompts"]) {
    auto tokens = testing::greedy_tokens(exec, p["token_ids"].get<std::vector<int32_t>>(), 32);
    CHECK(tokens == p["greedy"].get<std::vector<int32_t>>());
  }
  exec.stop_remote_worker_execution_loop();
}

TEST_CASE("a node killed mid-step fails the call with worker_died and nothing hangs") {
  node_process n;
  executor exec{mixed_config(1, {{"127.0.0.1", n.port(), 1}}), test_factory()};
  rpc_call_options slow;
  slow.args = caf::make_message(int32_t{10000});
  exec.collective_rpc("slow_steps", slow);
  execute_model_request req;
  sequence_group_metadata g;
  g.request_id = "r";
  g.seqs.push_back({0, {1, 2}, 2, 0, {0}});
  g.token_chunk_size = 2;
  req.seq_group_metadata_list.push_back(g);
  auto step = exec.execute_model_async(req);
  std::this_thread::sleep_for(300ms);
  auto start = clock_type::now();
  n.kill_now();
  try {
    step.get();
    FAIL("the step succeeded");
  } catch (const error& e) {
    CHECK(e.code() == errc::worker_died);
    auto where = "rank 1 on node 127.0.0.1:" + std::to_string(n.port());
    CHECK_MESSAGE(std::string{e.what()}.find(where) != std::string::npos, std::string{e.what()});
    // Killed: its port refuses, or (while the kernel closes its sockets) closes at once.
    CHECK_MESSAGE((std::string{e.what()}.find("its process has exited") != std::string::npos ||
                   std::string{e.what()}.find("its process is exiting") != std::string::npos),
                  std::string{e.what()});
  }
  auto took = seconds_since(start);
  MESSAGE("kill -9 noticed after " << took << " s");
  CHECK(took < 1.0); // the closed connection, not a heartbeat timeout
  CHECK(code_of([&] { exec.collective_rpc("rank"); }) == errc::worker_died);
}

TEST_CASE("a stopped node (SIGSTOP) is noticed by heartbeat within the timeout") {
  node_process n{1, 1000};
  executor exec{mixed_config(1, {{"127.0.0.1", n.port(), 1}}), test_factory()};
  rpc_call_options opts;
  opts.args = caf::make_message(int32_t{1});
  exec.collective_rpc("sleep_ms", opts); // warm
  n.signal(SIGSTOP);
  auto start = clock_type::now();
  opts.args = caf::make_message(int32_t{10});
  CHECK(code_of([&] { exec.collective_rpc("sleep_ms", opts); }) == errc::worker_died);
  auto took = seconds_since(start);
  auto what = what_of([&] { exec.collective_rpc("sleep_ms", opts); }); // the same failure
  CHECK_MESSAGE(
    what.find("rank 1 on node 127.0.0.1:" + std::to_string(n.port())) != std::string::npos, what);
  CHECK_MESSAGE(what.find("no heartbeat within the timeout") != std::string::npos, what);
  MESSAGE("SIGSTOP noticed after " << took << " s (node_timeout 1 s)");
  CHECK(took < 2.0); // node_timeout 1 s and the heartbeat's tick; the call's deadline is 20 s
  n.signal(SIGCONT);
}

TEST_CASE("peers without the secret are refused and the legitimate executor is unaffected") {
  node_process n{2};
  auto legit =
    std::make_unique<executor>(mixed_config(1, {{"127.0.0.1", n.port(), 1}}), test_factory());
  CHECK(legit->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});

  auto wrong = mixed_config(0, {{"127.0.0.1", n.port(), 1}});
  wrong.cluster.node_secret = "a guess long enough to be tried";
  CHECK_THROWS_WITH_AS(executor(wrong, test_factory()), doctest::Contains("wrong secret"), error);
  // A secret too short to hold up against a guess offline is refused before any connection.
  wrong.cluster.node_secret = "guess";
  CHECK_THROWS_WITH_AS(executor(wrong, test_factory()), doctest::Contains("at least 16"), error);

  // Right secret, but the node's workers are leased: refused, nothing spawned.
  CHECK_THROWS_WITH_AS(executor(mixed_config(0, {{"127.0.0.1", n.port(), 1}}), test_factory()),
                       doctest::Contains("another executor holds the workers"), error);

  // A peer that proved the secret to the gateway but does not hold the lease gets no
  // handshake from the gate while the lease is held.
  {
    client_system client{true};
    auto& sys = *client.sys;
    caf::scoped_actor self{sys};
    auto gate = connect_with_proof(sys, self, n.port());
    REQUIRE(gate);
    caf::error err;
    self->request(*gate, 5s, hello_atom::value)
      .receive([](std::string&) {}, [&](caf::error& e) { err = e; });
    CHECK_MESSAGE(render(err).find("a hello while another executor holds the workers") !=
                    std::string::npos,
                  render(err));
    err = caf::error{};
    self->request(*gate, 5s, auth_atom::value, std::string(64, '0'))
      .receive([](caf::ok_atom) {}, [&](caf::error& e) { err = e; });
    CHECK(render(err).find("a proof while another executor holds the workers") !=
          std::string::npos);
  }
  // The legitimate executor keeps working.
  CHECK(legit->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  legit.reset();

  // Behind the connection's proof, the gate checks the secret again (as it does for TLS
  // peers): a peer that skips the gate's own handshake gets nothing there either.
  {
    client_system client{true};
    auto& sys = *client.sys;
    caf::scoped_actor self{sys};
    auto gate = connect_with_proof(sys, self, n.port());
    REQUIRE(gate);
    caf::error err;
    auto holder = sys.spawn([]() -> caf::behavior { return {[](caf::ok_atom) {}}; });
    self
      ->request(*gate, 5s, lease_atom::value, std::string{"test"}, caf::settings{}, int32_t{1},
                holder)
      .receive([](worker_handles&, std::string&, std::string&) {}, [&](caf::error& e) { err = e; });
    CHECK(render(err).find("a lease before authentication") != std::string::npos);
    err = caf::error{};
    self->request(*gate, 5s, auth_atom::value, std::string(64, '0'))
      .receive([](caf::ok_atom) {}, [&](caf::error& e) { err = e; });
    CHECK(render(err).find("a proof without a challenge") != std::string::npos);
    std::string challenge;
    self->request(*gate, 5s, hello_atom::value)
      .receive([&](std::string& c) { challenge = c; }, [&](caf::error& e) { err = e; });
    // A proof made for another node id (overheard) does not pass.
    auto stolen = secret_proof(secret, challenge, "someone-else");
    err = caf::error{};
    self->request(*gate, 5s, auth_atom::value, stolen)
      .receive([](caf::ok_atom) {}, [&](caf::error& e) { err = e; });
    CHECK(render(err).find("wrong secret") != std::string::npos);
    // The right proof, but after the node's connection timeout (1 s): the challenge is gone.
    self->request(*gate, 5s, hello_atom::value)
      .receive([&](std::string& c) { challenge = c; }, [&](caf::error& e) { err = e; });
    std::this_thread::sleep_for(1200ms);
    err = caf::error{};
    self
      ->request(*gate, 5s, auth_atom::value, secret_proof(secret, challenge, to_string(sys.node())))
      .receive([](caf::ok_atom) {}, [&](caf::error& e) { err = e; });
    CHECK_MESSAGE(render(err).find("after the connection timeout") != std::string::npos,
                  render(err));
    anon_send_exit(holder, caf::exit_reason::user_shutdown);
  }

  // The node serves the next executor.
  auto next = lease_again(n.port(), 2, 5.0);
  CHECK(next->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  // The node gives each of its workers a device of its own.
  CHECK(next->workers()[0].device == "cpu:0");
  CHECK(next->workers()[1].device == "cpu:1");
}

namespace {

/// A node in this process with two CPU devices and the test workers.
node_config in_process_node() {
  node_config ncfg;
  ncfg.secret = secret;
  ncfg.devices = 2;
  ncfg.connection_timeout = 1s;
  ncfg.kinds["test"] = [](int32_t rank, const caf::settings&) { return test_factory()(rank); };
  return ncfg;
}

/// The descriptors of this process's sockets whose inodes are `inodes`, in order.
std::vector<int> descriptors_of(const std::set<std::string>& inodes) {
  std::vector<int> fds;
  for (auto& entry : std::filesystem::directory_iterator{"/proc/self/fd"}) {
    std::error_code ec;
    auto target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0 &&
        inodes.count(target.substr(8, target.size() - 9)) > 0)
      fds.push_back(std::stoi(entry.path().filename().string()));
  }
  std::sort(fds.begin(), fds.end());
  return fds;
}

/// The descriptors of this process's TCP connections to `port` on loopback, oldest first
/// (by descriptor): read from /proc.
std::vector<int> connections_to(uint16_t port) {
  std::set<std::string> inodes;
  std::ifstream tcp{"/proc/net/tcp"};
  std::string line;
  std::getline(tcp, line); // the header
  char remote[16];
  std::snprintf(remote, sizeof remote, "0100007F:%04X", port);
  while (std::getline(tcp, line)) {
    std::istringstream fields{line};
    std::string slot, local, peer, state, queues, timer, retransmits, uid, timeout, inode;
    fields >> slot >> local >> peer >> state >> queues >> timer >> retransmits >> uid >> timeout >>
      inode;
    if (peer == remote && state == "01")
      inodes.insert(inode);
  }
  return descriptors_of(inodes);
}

/// The descriptors of this process's connected Unix sockets at `address` ("@name"), the
/// ends that its listener accepted, oldest first (by descriptor): read from /proc.
std::vector<int> accepted_at(const std::string& address) {
  std::set<std::string> inodes;
  std::ifstream unix_sockets{"/proc/net/unix"};
  std::string line;
  std::getline(unix_sockets, line); // the header
  while (std::getline(unix_sockets, line)) {
    std::istringstream fields{line};
    std::string slot, refs, protocol, flags, type, state, inode, path;
    fields >> slot >> refs >> protocol >> flags >> type >> state >> inode >> path;
    if (path == address && state == "03") // connected; the listener is "01"
      inodes.insert(inode);
  }
  return descriptors_of(inodes);
}

/// Mappings of call links' shared rings in this process (a node's and an executor's in
/// the tests that run both), read from /proc.
std::vector<std::pair<uintptr_t, uintptr_t>> shared_ring_mappings() {
  std::vector<std::pair<uintptr_t, uintptr_t>> found;
  std::ifstream maps{"/proc/self/maps"};
  std::string line;
  while (std::getline(maps, line))
    if (line.find("memfd:troupe-link") != std::string::npos) {
      auto dash = line.find('-');
      found.emplace_back(std::stoull(line.substr(0, dash), nullptr, 16),
                         std::stoull(line.substr(dash + 1), nullptr, 16));
    }
  return found;
}

/// How a call link to a node on this host goes.
enum class link_via { tcp, unix_socket, shared_memory };

const char* to_string(link_via via) {
  switch (via) {
  case link_via::tcp:
    return "tcp";
  case link_via::unix_socket:
    return "unix socket";
  default:
    return "shared memory";
  }
}

/// `call` fails as a call whose link to `n` broke under it does, naming the link; the
/// node's two workers live, and what follows reaches them over BASP.
template <class Call>
void link_broke_under(node& n, executor& exec, Call call) {
  try {
    call();
    FAIL("the call survived its link");
  } catch (const error& e) {
    CHECK(e.code() == errc::worker_died);
    CHECK_MESSAGE(std::string{e.what()}.find(
                    "its call link to node 127.0.0.1:" + std::to_string(n.port()) + " closed") !=
                    std::string::npos,
                  e.what());
  }
  auto linked = n.linked_requests();
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  CHECK(n.linked_requests() == linked);
  CHECK(n.leased_workers() == 2);
}

/// Whether `holds()` becomes true within 5 s.
template <class Holds>
bool eventually(Holds holds) {
  for (auto until = clock_type::now() + 5s; !holds() && clock_type::now() < until;)
    std::this_thread::sleep_for(1ms);
  return holds();
}

/// An executor that leased `n`'s two workers, once its call link to `n`, made as `via`
/// says, is open.
std::unique_ptr<executor> linked_executor(node& n, link_via via) {
  auto cfg = mixed_config(0, {{"127.0.0.1", n.port(), 2}});
  cfg.cluster.node_local_links = via != link_via::tcp;
  cfg.cluster.node_shared_memory = via == link_via::shared_memory;
  auto exec = lease_again_with(cfg, 10);
  REQUIRE(eventually([&] { return n.call_links() == 1; }));
  return exec;
}

} // namespace

TEST_CASE("calls go to a node's workers over a call link, and give the answers they give "
          "over BASP") {
  node n{in_process_node()};
  std::map<bool, std::vector<std::string>> answers;
  for (bool links : {true, false}) {
    CAPTURE(links);
    auto cfg = mixed_config(1, {{"127.0.0.1", n.port(), 2}});
    cfg.cluster.node_links = links;
    auto exec = lease_again_with(cfg, 10);
    CHECK(eventually([&] { return n.call_links() == (links ? 1 : 0); }));
    auto before = n.linked_requests();
    answers[links] = run_suite(*exec);
    // The suite's seven named collective_rpc reach both of the node's workers (its steps
    // go to the local driver, which passes them on to its peers).
    if (links)
      CHECK(n.linked_requests() >= before + 14);
    else
      CHECK(n.linked_requests() == before);
    exec.reset();
    // The link ends with its executor.
    CHECK(eventually([&] { return n.call_links() == 0; }));
  }
  REQUIRE(answers[true].size() == answers[false].size());
  for (size_t i = 0; i < answers[true].size(); ++i)
    CHECK(answers[true][i] == answers[false][i]);
}

TEST_CASE("the call link to a node on this host goes over its local socket, and over TCP "
          "when that is off or out of reach") {
  node n{in_process_node()};
  REQUIRE(n.local_address().rfind("@troupe-node-", 0) == 0);
  for (auto via : {link_via::shared_memory, link_via::unix_socket, link_via::tcp}) {
    CAPTURE(to_string(via));
    bool local = via != link_via::tcp;
    auto exec = linked_executor(n, via);
    // BASP's connection, and the link's either beside it on TCP or on the local socket.
    CHECK(connections_to(n.port()).size() == (local ? 1u : 2u));
    CHECK(accepted_at(n.local_address()).size() == (local ? 1u : 0u));
    // With shared memory both ends map the rings: the node's and the executor's mapping.
    CHECK(eventually(
      [&] { return shared_ring_mappings().size() == (via == link_via::shared_memory ? 2u : 0u); }));
    auto linked = n.linked_requests();
    CHECK(exec->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
    CHECK(n.linked_requests() == linked + 2);
    exec.reset();
    CHECK(eventually([&] { return n.call_links() == 0; }));
  }
  // The rings go with their link.
  CHECK(eventually([&] { return shared_ring_mappings().empty(); }));
  // A local address that nothing answers (a node on another host, or in another network
  // namespace): the link is dialled over TCP, where the node refuses this one's token.
  // (Nothing else logs meanwhile: the sinks are no place for two threads.)
  REQUIRE(eventually([&] { return n.call_links() == 0 && n.leased_workers() == 0; }));
  std::ostringstream logged;
  auto log = troupe::get_logger("troupe.node");
  log->sinks().push_back(std::make_shared<spdlog::sinks::ostream_sink_mt>(logged));
  CHECK(code_of([&] {
          link_client::open("127.0.0.1", n.port(), "@troupe-node-nobody-here", true,
                            {secret, nullptr}, std::string(64, '0'), 0us, 5s,
                            clock_type::now() + 5s);
        }) == errc::invalid_argument);
  log->sinks().pop_back();
  INFO(logged.str());
  CHECK(logged.str().find("refused a link from 127.0.0.1:") != std::string::npos);
}

TEST_CASE("a node's workers read their requests from the call link while they linger") {
  node n{in_process_node()};
  // The executor's linger travels to the node's workers: one that lingers reads the link.
  // Calls back to back find both lingering, except the first (and any after a stall of
  // the test's thread longer than the linger): the link's thread, which sleeps while every
  // worker reads, reads those.
  for (auto linger : {timeout_type{0}, timeout_type{100ms}}) {
    CAPTURE(linger.count());
    auto cfg = mixed_config(0, {{"127.0.0.1", n.port(), 2}});
    cfg.linger = linger;
    auto exec = lease_again_with(cfg, 10);
    auto before = n.requests_read_by_workers();
    auto linked = n.linked_requests();
    for (int i = 0; i < 100; ++i)
      REQUIRE(exec->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
    auto requests = n.linked_requests() - linked;
    auto by_workers = n.requests_read_by_workers() - before;
    CHECK(requests >= 200);
    if (linger.count() == 0)
      CHECK(by_workers == 0);
    else
      CHECK(by_workers * 10 >= requests * 9);
    // Frames larger than what a read takes at once (16 KiB), and than a socket's buffer.
    for (size_t size : {size_t{64} << 10, size_t{4} << 20}) {
      CAPTURE(size);
      rpc_call_options opts;
      opts.kwargs["name"] = std::string(size, 'x');
      auto names = exec->collective_rpc_as<std::string>("kwarg", opts);
      REQUIRE(names.size() == 2);
      for (auto& name : names)
        CHECK(name == std::string(size, 'x'));
    }
  }
}

TEST_CASE("a call link that breaks under a call fails it naming the link, and later calls go "
          "over BASP") {
  node n{in_process_node()};
  for (auto via : {link_via::tcp, link_via::unix_socket, link_via::shared_memory}) {
    CAPTURE(to_string(via));
    bool local = via != link_via::tcp;
    auto exec = linked_executor(n, via);
    // Over TCP, the executor's end: its connections to the node are BASP's, then the
    // link's, opened after the lease. On the local socket, the node's end (with shared
    // memory the socket still tells the executor that the node's end closed).
    auto fds = local ? accepted_at(n.local_address()) : connections_to(n.port());
    REQUIRE(fds.size() == (local ? 1u : 2u));
    rpc_call_options slow;
    slow.args = caf::make_message(int32_t{500});
    auto call = exec->collective_rpc_async("sleep_ms", slow);
    std::this_thread::sleep_for(100ms);
    ::shutdown(fds.back(), SHUT_RDWR);
    REQUIRE(call.wait_for(10s) == std::future_status::ready);
    link_broke_under(n, *exec, [&] { call.get(); });
  }
}

TEST_CASE("shared rings that the executor's side breaks end that link and nothing else: the "
          "call fails naming it, later calls go over BASP, the node serves the next link") {
  node n{in_process_node()};
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    auto exec = linked_executor(n, link_via::shared_memory);
    CHECK(exec->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
    REQUIRE(eventually([&] { return shared_ring_mappings().size() == 2u; }));
    auto mappings = shared_ring_mappings();
    if (round == 1)
      break; // the node, after the broken link, still gives shared memory
    // The position up to which the executor read the node's ring, set beyond anything the
    // node wrote (through either mapping: both are this process's): the node's next reply
    // finds it impossible.
    auto* tail = reinterpret_cast<std::atomic<uint64_t>*>(mappings.front().first + 64);
    tail->store(uint64_t{1} << 60);
    link_broke_under(n, *exec, [&] { exec->collective_rpc("rank"); });
    CHECK(eventually([&] { return n.call_links() == 0; }));
  }
}

TEST_CASE("a request for a node's worker is read while another, which read the link, is "
          "busy") {
  // Rank 0 reads the link as it lingers and then holds a call; meanwhile rank 1 gets its
  // requests, first while it lingers (it reads them itself), then once its linger ran out
  // and it sleeps (the link's thread must read them: rank 0 reads nothing while it holds).
  node n{in_process_node()};
  auto cfg = mixed_config(0, {{"127.0.0.1", n.port(), 2}});
  cfg.linger = 200ms;
  auto exec = lease_again_with(cfg, 10);
  concurrency_probe::released() = false;
  for (auto& count : concurrency_probe::served())
    count = 0;
  auto& served = concurrency_probe::served();
  REQUIRE(exec->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  rpc_call_options hold;
  hold.args = caf::make_message(int32_t{0});
  auto held = exec->collective_rpc_async("hold_on", hold);
  auto lingering = exec->collective_rpc_async("served");
  CHECK(eventually([&] { return served[1] >= 1; }));
  std::this_thread::sleep_for(400ms); // rank 1's linger runs out
  auto asleep = exec->collective_rpc_async("served");
  CHECK(eventually([&] { return served[1] >= 2; }));
  CHECK(served[0] == 0); // still holding
  concurrency_probe::released() = true;
  for (auto* f : {&held, &lingering, &asleep})
    REQUIRE(f->wait_for(20s) == std::future_status::ready);
  CHECK(served[0] == 2);
  CHECK(exec->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
}

TEST_CASE("calls to a node's workers keep their order, over its call link or over BASP") {
  // Named calls go over the link as the sink's requests; those with max_concurrent_workers
  // (here as many as there are workers, so that all go at once) as the supervisor's own.
  // Made without waiting, each must reach every worker in the order made.
  node_process n{2};
  auto exec = lease_again_with(mixed_config(1, {{"127.0.0.1", n.port(), 2}}), 10);
  std::vector<std::future<std::vector<caf::message>>> calls;
  for (int32_t i = 0; i < 300; ++i) {
    rpc_call_options opts;
    opts.args = caf::make_message(i);
    if (i % 3 == 0)
      opts.max_concurrent_workers = 3;
    calls.push_back(exec->collective_rpc_async("note", opts));
  }
  for (auto& f : calls)
    REQUIRE(f.wait_for(20s) == std::future_status::ready);
  std::vector<int32_t> expected(300);
  std::iota(expected.begin(), expected.end(), 0);
  for (auto& notes : exec->collective_rpc_as<std::vector<int32_t>>("notes"))
    CHECK(notes == expected);
}

TEST_CASE("a call link without the secret or the lease's token reaches no worker") {
  node_process n{2, 1000, 1 << 20};
  auto legit = lease_again(n.port(), 2, 10);
  auto steps = [&] { return legit->collective_rpc_as<int64_t>("steps"); };
  CHECK(steps() == std::vector<int64_t>{0, 0});

  // Without the secret the handshake refuses the link; a BASP connection's proof does not
  // open a link either (the gateway expects the link's proof for a link).
  CHECK(code_of([&] {
          close(dial_node("127.0.0.1", n.port(), "a guess long enough to be tried",
                          clock_type::now() + 5s, true));
        }) == errc::invalid_argument);

  // With the secret but not the lease's token, the node closes the link at its hello: a
  // step sent behind it, for any actor of the node, reaches none.
  client_system client;
  auto step = caf::make_message(execute_atom::value, one_step(1));
  std::string why;
  auto payload = serialize_message(*client.sys, step, why);
  REQUIRE(why.empty());
  for (uint64_t actor = 1; actor <= 16; ++actor) {
    int fd = dial_node("127.0.0.1", n.port(), secret, clock_type::now() + 5s, true);
    link_socket link{fd, 0us, 1 << 20, 5s};
    std::string token(64, 'f');
    REQUIRE(link.write(link_socket::hello, 0, 0, std::vector<char>(token.begin(), token.end())));
    link.write(link_socket::request, actor, actor, payload);
    link_socket::frame f;
    CHECK_FALSE(link.read(f, why));
  }
  CHECK(code_of([&] {
          link_client::open("127.0.0.1", n.port(), "", true, {secret, nullptr},
                            std::string(64, '0'), 0us, 5s, clock_type::now() + 5s);
        }) == errc::invalid_argument);
  CHECK(steps() == std::vector<int64_t>{0, 0});

  // Frames that are not frames, and one announcing 4 GiB, close the link; the node
  // allocates nothing for them.
  auto before = rss_kib(n.pid());
  for (bool huge : {false, true}) {
    int fd = dial_node("127.0.0.1", n.port(), secret, clock_type::now() + 5s, true);
    std::string bytes = huge ? std::string("\xff\xff\xff\xff\x01\0\0\0", 8) + std::string(16, '\0')
                             : std::string(24, '\x7f');
    REQUIRE(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(bytes.size()));
    CHECK(read_until_closed(fd).empty());
    close(fd);
  }
  CHECK(rss_kib(n.pid()) < before + 64 * 1024);

  // The legitimate executor's calls still go over its own link.
  CHECK(legit->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  legit->execute_model(one_step(1));
  CHECK(steps() == std::vector<int64_t>{1, 1});
}

TEST_CASE("a node's local socket takes only call links that prove the secret and present "
          "the lease's token") {
  node n{in_process_node()};
  auto legit = lease_again(n.port(), 2, 10);
  REQUIRE(eventually([&] { return n.call_links() == 1; }));
  CHECK(accepted_at(n.local_address()).size() == 1); // the executor's own link
  // A wrong secret is refused at the handshake.
  CHECK(code_of([&] {
          close(dial_local_link(n.local_address(), "a guess long enough to be tried",
                                clock_type::now() + 5s));
        }) == errc::invalid_argument);
  // A BASP connection's proof, even with the secret, is refused: that socket takes links
  // only, and BASP goes through the TCP port.
  {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    auto name = n.local_address().substr(1);
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&addr),
                    static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())) ==
            0);
    std::string greeting(greeting_size, '\0');
    REQUIRE(recv(fd, greeting.data(), greeting.size(), MSG_WAITALL) ==
            static_cast<ssize_t>(greeting.size()));
    auto challenge = random_challenge();
    auto answer =
      challenge + " " + peer_proof(secret, challenge_of_greeting(greeting), challenge) + "\n";
    REQUIRE(send(fd, answer.data(), answer.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(answer.size()));
    CHECK(read_until_closed(fd).rfind("no ", 0) == 0);
    close(fd);
  }
  // The secret without the lease's token: the node closes the link at its hello.
  auto linked = n.linked_requests();
  CHECK(code_of([&] {
          link_client::open("127.0.0.1", n.port(), n.local_address(), true, {secret, nullptr},
                            std::string(64, '0'), 0us, 5s, clock_type::now() + 5s);
        }) == errc::invalid_argument);
  // The executor's own link, on the same socket, still carries its calls.
  CHECK(legit->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  CHECK(n.linked_requests() == linked + 2);
}

TEST_CASE("a start refused by a node stops at once, its local workers included") {
  node_process n{1};
  auto cfg = mixed_config(1, {{"127.0.0.1", n.port(), 1}});
  cfg.cluster.node_secret = "a guess long enough to be tried";
  std::ostringstream logged;
  auto log = troupe::get_logger("troupe.executor");
  log->sinks().push_back(std::make_shared<spdlog::sinks::ostream_sink_mt>(logged));
  CHECK_THROWS_WITH_AS(executor(cfg, test_factory()), doctest::Contains("wrong secret"), error);
  log->sinks().pop_back();
  // Nothing was left running for the shutdown to wait on and then abandon.
  INFO(logged.str());
  CHECK(logged.str().find("did not stop") == std::string::npos);
  CHECK(logged.str().find("still busy") == std::string::npos);
}

TEST_CASE("nothing from a peer without the secret reaches an actor, during a lease too") {
  node_process n{1, 1000};
  auto legit =
    std::make_unique<executor>(mixed_config(1, {{"127.0.0.1", n.port(), 1}}), test_factory());
  // A plain CAF client (no proof): the node's first bytes are no BASP handshake, so it never
  // gets a handle on the gate, let alone a way to send it an exit message.
  {
    client_system client;
    auto gate = client.sys->middleman().remote_actor("127.0.0.1", n.port());
    CHECK(!gate);
  }
  // Raw peers: BASP bytes instead of the answer (a spoofed message would start so), and a
  // proof made with another secret. Each is refused and closed; nothing is relayed.
  {
    int fd = connect_to(n.port());
    REQUIRE(fd >= 0);
    std::string basp(answer_size, '\0');
    basp[0] = 3; // a routed message's header, with whatever follows
    REQUIRE(send(fd, basp.data(), basp.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(basp.size()));
    auto got = read_until_closed(fd);
    close(fd);
    CHECK(got.size() == greeting_size + std::string{"no wrong secret\n"}.size());
    CHECK(got.substr(greeting_size) == "no wrong secret\n");
  }
  {
    int fd = connect_to(n.port());
    REQUIRE(fd >= 0);
    std::string greeting(greeting_size, '\0');
    REQUIRE(recv(fd, greeting.data(), greeting.size(), MSG_WAITALL) ==
            static_cast<ssize_t>(greeting_size));
    auto challenge = random_challenge();
    auto answer =
      challenge + " " + peer_proof("guess", challenge_of_greeting(greeting), challenge) + "\n";
    REQUIRE(send(fd, answer.data(), answer.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(answer.size()));
    CHECK(read_until_closed(fd) == "no wrong secret\n");
    close(fd);
  }
  // The lease and the node are untouched: the executor works, and after it the next one.
  CHECK(legit->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  legit.reset();
  auto next = lease_again(n.port(), 1, 2.0);
  CHECK(next->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0});
}

TEST_CASE("1000 idle connections cost no thread and little memory, and an executor gets through") {
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  if (files.rlim_max < 1100)
    return testing::skip("1000 connections need 1100 file descriptors; the hard limit is " +
                         std::to_string(files.rlim_max));
  files.rlim_cur = std::max<rlim_t>(files.rlim_cur, 1100);
  setrlimit(RLIMIT_NOFILE, &files);
  node_process n{1, 1000};
  auto threads = [&] { return proc_status(n.pid(), "Threads:"); };
  auto threads_before = threads();
  auto rss_before = rss_kib(n.pid());
  std::vector<int> idle;
  for (int i = 0; i < 1000; ++i) {
    int fd = connect_to(n.port());
    REQUIRE(fd >= 0);
    idle.push_back(fd);
  }
  std::this_thread::sleep_for(200ms); // let the node accept them all
  auto threads_after = threads();
  auto rss_after = rss_kib(n.pid());
  MESSAGE("node with 1000 idle connections: " << threads_before << " -> " << threads_after
                                              << " threads, RSS " << rss_before << " -> "
                                              << rss_after << " KiB");
  // No thread per connection (the node's runtime may start one or two of its own lazily).
  CHECK(threads_after <= threads_before + 2);
  CHECK(rss_after < rss_before + 16 * 1024);
  // While they are open, an executor leases in its normal time.
  auto start = clock_type::now();
  executor exec{mixed_config(0, {{"127.0.0.1", n.port(), 1}}), test_factory()};
  auto took = seconds_since(start);
  MESSAGE("an executor leased past them in " << took << " s");
  CHECK(took < 1.0);
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0});
  for (auto fd : idle)
    close(fd);
}

TEST_CASE("an oversized message is refused without the node allocating it") {
  node_process n{2, 1000, 1 << 20};
  auto legit =
    std::make_unique<executor>(mixed_config(1, {{"127.0.0.1", n.port(), 1}}), test_factory());
  // A message under the bound passes.
  rpc_call_options small;
  small.kwargs["pad"] = std::string(512 << 10, 'x');
  CHECK(legit->collective_rpc_as<int32_t>("rank", small) == std::vector<int32_t>{0, 1});

  // The gateway is the node's only listening socket: the middleman listens nowhere.
  auto ports = listening_ports(n.pid());
  CHECK(ports == std::set<uint16_t>{n.port()});
  // On every port the node listens on, a raw peer announcing a 4 GiB frame is cut off and
  // nothing is allocated.
  for (auto port : ports) {
    auto before = rss_kib(n.pid());
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(port);
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    auto header = huge_frame_header();
    REQUIRE(send(fd, header.data(), header.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(header.size()));
    char byte;
    ssize_t got = 0;
    do {
      got = recv(fd, &byte, 1, 0);
    } while (got > 0); // the node's own handshake may come first; then the close
    CHECK(got == 0);
    close(fd);
    auto after = rss_kib(n.pid());
    MESSAGE("port " << port << ": node RSS " << before << " KiB before, " << after
                    << " KiB after the 4 GiB frame");
    CHECK(after < before + 64 * 1024);
  }

  // The legitimate executor is unaffected; its own oversized message costs it the node.
  CHECK(legit->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  rpc_call_options big;
  big.kwargs["pad"] = std::string(2 << 20, 'x');
  CHECK(code_of([&] { legit->collective_rpc("rank", big); }) == errc::worker_died);
}

TEST_CASE("a node whose executor is killed or stopped releases its workers for the next one") {
  node_process n{1, 1000};
  // Leases the node's only worker, or fails while it is still held.
  auto lease_now = [&] {
    return std::make_unique<executor>(mixed_config(0, {{"127.0.0.1", n.port(), 1}}),
                                      test_factory());
  };
  auto lease_within = [&](double seconds) {
    auto start = clock_type::now();
    for (;;) {
      try {
        auto exec = lease_now();
        return seconds_since(start);
      } catch (const error& e) {
        REQUIRE_MESSAGE(seconds_since(start) < seconds, e.what());
        std::this_thread::sleep_for(100ms);
      }
    }
  };
  {
    child_process killed{TROUPE_EXECUTOR_HOST, {std::to_string(n.port()), secret}};
    CHECK_THROWS_WITH_AS(lease_now(), doctest::Contains("another executor"), error);
    killed.kill_now();
    // The closed connection tells the node at once.
    MESSAGE("after kill -9 of its executor the node leased again in " << lease_within(1.0) << " s");
  }
  {
    child_process stopped{TROUPE_EXECUTOR_HOST, {std::to_string(n.port()), secret}};
    stopped.signal(SIGSTOP);
    // The node's heartbeat timeout (1 s) tells it.
    MESSAGE("after SIGSTOP of its executor the node leased again in " << lease_within(2.0) << " s");
  }
}

namespace {

/// An in-process node under mutual TLS alone (no secret), as `in_process_node`.
node_config tls_node(const test_pki& pki) {
  auto ncfg = in_process_node();
  ncfg.secret.clear();
  ncfg.tls_certificate = pki.pem("node");
  ncfg.tls_key = pki.key("node");
  ncfg.tls_ca = pki.pem("ca");
  return ncfg;
}

/// `cfg` with `who`'s certificate of `pki` and no secret.
executor_config under_tls(executor_config cfg, const test_pki& pki,
                          const std::string& who = "executor") {
  cfg.cluster.node_secret.clear();
  cfg.cluster.tls_certificate = pki.pem(who);
  cfg.cluster.tls_key = pki.key(who);
  cfg.cluster.tls_ca = pki.pem("ca");
  return cfg;
}

} // namespace

TEST_CASE("under mutual TLS calls go over the call link, over TCP, the local socket and shared "
          "memory, and give the answers they give over BASP") {
  test_pki pki;
  node n{tls_node(pki)};
  REQUIRE(n.local_address().rfind("@troupe-node-", 0) == 0);
  auto cfg = under_tls(mixed_config(1, {{"127.0.0.1", n.port(), 2}}), pki);
  cfg.cluster.node_links = false;
  std::vector<std::string> over_basp;
  {
    auto exec = lease_again_with(cfg, 10);
    CHECK(n.call_links() == 0);
    auto linked = n.linked_requests();
    over_basp = run_suite(*exec);
    CHECK(n.linked_requests() == linked);
  }
  cfg.cluster.node_links = true;
  for (auto via : {link_via::shared_memory, link_via::unix_socket, link_via::tcp}) {
    CAPTURE(to_string(via));
    bool local = via != link_via::tcp;
    cfg.cluster.node_local_links = local;
    cfg.cluster.node_shared_memory = via == link_via::shared_memory;
    REQUIRE(eventually([&] { return n.call_links() == 0 && n.leased_workers() == 0; }));
    auto exec = lease_again_with(cfg, 10);
    REQUIRE(eventually([&] { return n.call_links() == 1; }));
    CHECK(connections_to(n.port()).size() == (local ? 1u : 2u));
    CHECK(accepted_at(n.local_address()).size() == (local ? 1u : 0u));
    CHECK(eventually(
      [&] { return shared_ring_mappings().size() == (via == link_via::shared_memory ? 2u : 0u); }));
    auto linked = n.linked_requests();
    CHECK(run_suite(*exec) == over_basp);
    // The suite's seven named collective_rpc reach both of the node's workers.
    CHECK(n.linked_requests() >= linked + 14);
    exec.reset();
    CHECK(eventually([&] { return n.call_links() == 0; }));
  }
}

TEST_CASE("under mutual TLS a call link needs a certificate of the node's CA and the lease's "
          "token") {
  test_pki pki;
  node n{tls_node(pki)};
  auto legit = lease_again_with(under_tls(mixed_config(0, {{"127.0.0.1", n.port(), 2}}), pki), 10);
  REQUIRE(eventually([&] { return n.call_links() == 1; }));
  auto credentials_of = [&](const std::string& who) {
    return link_credentials{
      "", make_tls_context(tls_role::client, pki.pem(who), pki.key(who), pki.pem("ca"))};
  };
  for (auto local : {std::string{}, n.local_address()}) {
    CAPTURE(local);
    // A certificate of another CA: refused at the handshake, no worker reached.
    CHECK(code_of([&] {
            link_client::open("127.0.0.1", n.port(), local, true, credentials_of("stranger"),
                              std::string(64, '0'), 0us, 5s, clock_type::now() + 5s);
          }) == errc::invalid_argument);
    // The CA's certificate but not the lease's token: the node closes the link at its hello.
    CHECK(code_of([&] {
            link_client::open("127.0.0.1", n.port(), local, true, credentials_of("executor"),
                              std::string(64, '0'), 0us, 5s, clock_type::now() + 5s);
          }) == errc::invalid_argument);
  }
  // A link that proves a secret instead finds no handshake of that kind there.
  CHECK(code_of([&] {
          close(dial_node("127.0.0.1", n.port(), secret, clock_type::now() + 5s, true));
        }) == errc::invalid_argument);
  // Neither TLS nor a link's preamble: closed.
  {
    int fd = connect_node("127.0.0.1", n.port(), clock_type::now() + 5s);
    std::string bytes(64, 'x');
    REQUIRE(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(bytes.size()));
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    CHECK(read_until_closed(fd).empty());
    close(fd);
  }
  // The legitimate executor's calls still go over its own link.
  auto linked = n.linked_requests();
  CHECK(legit->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  CHECK(n.linked_requests() == linked + 2);
  CHECK(n.call_links() == 1);
}

TEST_CASE("mutual TLS: only executors with a certificate of the node's CA get workers") {
  test_pki pki;
  child_process n{TROUPE_NODE_HOST,
                  {"-", "1", "1000", "1048576", pki.pem("node"), pki.key("node"), pki.pem("ca")}};
  auto config_with = [&](const std::string& who, const std::string& ca) {
    auto cfg = mixed_config(1, {{"127.0.0.1", n.port(), 1}});
    cfg.cluster.node_secret.clear();
    cfg.cluster.tls_certificate = pki.pem(who);
    cfg.cluster.tls_key = pki.key(who);
    cfg.cluster.tls_ca = pki.pem(ca);
    cfg.startup_timeout = 5s;
    return cfg;
  };
  // A certificate of another CA, and no TLS at all: no connection.
  CHECK(code_of([&] { executor(config_with("stranger", "ca"), test_factory()); }) ==
        errc::worker_died);
  auto plain = mixed_config(1, {{"127.0.0.1", n.port(), 1}});
  plain.startup_timeout = 5s;
  CHECK_THROWS_WITH_AS(executor(plain, test_factory()), doctest::Contains("wants TLS"), error);
  // The node's own CA: workers, and calls across the TLS connection.
  executor exec{config_with("executor", "ca"), test_factory()};
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  CHECK(exec.workers()[1].pid == n.pid());
}

TEST_CASE("under TLS the size bound holds after decryption, before anything is allocated") {
  test_pki pki;
  child_process n{TROUPE_NODE_HOST,
                  {"-", "1", "1000", "1048576", pki.pem("node"), pki.key("node"), pki.pem("ca")}};
  CHECK(listening_ports(n.pid()) == std::set<uint16_t>{n.port()});
  // A peer with a certificate of the node's CA completes the handshake, then announces a
  // 4 GiB frame inside the encrypted stream.
  auto ctx = SSL_CTX_new(TLS_client_method());
  REQUIRE(ctx);
  REQUIRE(SSL_CTX_use_certificate_chain_file(ctx, pki.pem("executor").c_str()) == 1);
  REQUIRE(SSL_CTX_use_PrivateKey_file(ctx, pki.key("executor").c_str(), SSL_FILETYPE_PEM) == 1);
  REQUIRE(SSL_CTX_load_verify_locations(ctx, pki.pem("ca").c_str(), nullptr) == 1);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(n.port());
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  auto ssl = SSL_new(ctx);
  SSL_set_fd(ssl, fd);
  REQUIRE(SSL_connect(ssl) == 1);
  auto before = rss_kib(n.pid());
  auto header = huge_frame_header();
  REQUIRE(SSL_write(ssl, header.data(), static_cast<int>(header.size())) ==
          static_cast<int>(header.size()));
  char byte;
  int got = 0;
  do {
    got = SSL_read(ssl, &byte, 1);
  } while (got > 0); // the node's own handshake comes first; then the close
  auto after = rss_kib(n.pid());
  SSL_free(ssl);
  close(fd);
  SSL_CTX_free(ctx);
  MESSAGE("TLS: node RSS " << before << " KiB before, " << after << " KiB after the 4 GiB frame");
  CHECK(after < before + 64 * 1024);
  // A peer that never starts its TLS handshake is closed after the connection timeout (1 s).
  int idle = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(connect(idle, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  auto start = clock_type::now();
  timeval wait{5, 0};
  setsockopt(idle, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  CHECK(recv(idle, &byte, 1, 0) == 0);
  auto took = seconds_since(start);
  close(idle);
  MESSAGE("a peer silent before TLS was closed after " << took << " s");
  CHECK(took >= 0.9);
  CHECK(took < 2.0);
  // The node still serves an executor with a certificate of its CA.
  auto cfg = mixed_config(1, {{"127.0.0.1", n.port(), 1}});
  cfg.cluster.node_secret.clear();
  cfg.cluster.tls_certificate = pki.pem("executor");
  cfg.cluster.tls_key = pki.key("executor");
  cfg.cluster.tls_ca = pki.pem("ca");
  executor exec{cfg, test_factory()};
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
}

TEST_CASE("SIGTERM stops a node cleanly, with or without a lease") {
  {
    node_process n;
    n.signal(SIGTERM);
    CHECK(n.wait_exit() == 0);
  }
  node_process n;
  executor exec{mixed_config(1, {{"127.0.0.1", n.port(), 1}}), test_factory()};
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  n.signal(SIGTERM); // the gate goes with a lease: its workers are released, nothing crashes
  CHECK(n.wait_exit() == 0);
  CHECK(code_of([&] { exec.collective_rpc("rank"); }) == errc::worker_died);
}

namespace {

/// A peer that proved the secret and then speaks BASP by hand: the frames a modified CAF
/// peer could send, each built with CAF's own serializer.
struct raw_basp_peer {
  caf::actor_system& sys;
  int fd = -1;

  /// Connects to `port` and answers the node's handshake as node `as`.
  raw_basp_peer(caf::actor_system& sys, uint16_t port, const caf::node_id& as) : sys(sys) {
    fd = dial_node("127.0.0.1", port, secret, clock_type::now() + 5s);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    std::array<char, 32> header{};
    REQUIRE(recv(fd, header.data(), header.size(), MSG_WAITALL) == 32);
    uint32_t length = 0;
    std::memcpy(&length, header.data() + 4, sizeof length);
    std::string payload(ntohl(length), '\0');
    REQUIRE(recv(fd, payload.data(), payload.size(), MSG_WAITALL) ==
            static_cast<ssize_t>(payload.size()));
    send_frame(caf::io::basp::message_type::client_handshake, 0, bytes(as));
  }

  ~raw_basp_peer() {
    close(fd);
  }

  template <class... Ts>
  std::string bytes(Ts... xs) {
    std::vector<char> buf;
    caf::binary_serializer sink{sys, buf};
    REQUIRE(!sink(xs...));
    return {buf.begin(), buf.end()};
  }

  void send_frame(caf::io::basp::message_type op, uint64_t dest, const std::string& payload) {
    caf::io::basp::header hdr{op, 0, static_cast<uint32_t>(payload.size()), 0, 0, dest};
    auto frame = bytes(hdr) + payload;
    REQUIRE(send(fd, frame.data(), frame.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(frame.size()));
  }

  /// Whether the node closed the connection within 5 s.
  bool closed() {
    return read_until_closed(fd).empty();
  }
};

} // namespace

TEST_CASE("a peer with the secret but not the lease reaches only the gate and cannot speak as "
          "the node, and a node whose gate is killed stops and says so") {
  node_process n{1, 1000};
  auto legit =
    std::make_unique<executor>(mixed_config(1, {{"127.0.0.1", n.port(), 1}}), test_factory());
  client_system client;
  auto& sys = *client.sys;
  caf::scoped_actor self{sys};
  auto gate = connect_with_proof(sys, self, n.port());
  REQUIRE(gate);
  auto node = gate->node();
  // An exit message "from the gate" (its address as the source) to every actor id near the
  // gate's, the leased worker's among them, sent directly...
  auto kill_from_gate = caf::make_message(caf::exit_msg{gate->address(), caf::exit_reason::kill});
  std::vector<caf::strong_actor_ptr> stack;
  {
    raw_basp_peer peer{sys, n.port(), sys.node()};
    for (uint64_t id = 1; id < gate->id() + 64; ++id)
      if (id != gate->id())
        peer.send_frame(caf::io::basp::message_type::direct_message, id,
                        peer.bytes(stack, kill_from_gate));
    // ... and as a message routed from the node itself (how a CAF peer passes on a
    // message whose sender is the gate's proxy): the connection is closed at once.
    peer.send_frame(caf::io::basp::message_type::routed_message, gate->id() + 1,
                    peer.bytes(node, node, stack, kill_from_gate));
    CHECK(peer.closed());
  }
  // A peer claiming the node's own id is closed at its handshake.
  {
    raw_basp_peer peer{sys, n.port(), node};
    CHECK(peer.closed());
  }
  // Nothing reached the worker: the lease and the executor are untouched.
  CHECK(legit->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  CHECK_NOTHROW(legit->check_health());
  // The gate itself can be killed by a peer holding the secret (CAF never lets a kill be
  // trapped): the node then stops with an error instead of running on without a gate.
  self->send_exit(*gate, caf::exit_reason::kill);
  auto status = n.exit_within(10s);
  REQUIRE(status.has_value());
  CHECK(*status == 1);
}

TEST_CASE("the gate ignores exit messages, even from a peer that proved the secret") {
  node_process n{1, 1000};
  auto legit =
    std::make_unique<executor>(mixed_config(1, {{"127.0.0.1", n.port(), 1}}), test_factory());
  {
    client_system client;
    auto& sys = *client.sys;
    caf::scoped_actor self{sys};
    auto gate = connect_with_proof(sys, self, n.port());
    REQUIRE(gate);
    caf::anon_send_exit(*gate, caf::exit_reason::user_shutdown);
    self->send_exit(*gate, caf::exit_reason::unhandled_exception);
    caf::error err;
    self->request(*gate, 5s, hello_atom::value)
      .receive([](std::string&) {}, [&](caf::error& e) { err = e; });
    // Still answering (refusing a peer that does not hold the lease).
    CHECK(render(err).find("another executor holds the workers") != std::string::npos);
  }
  CHECK(legit->collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
}

TEST_CASE("a node that does not answer fails the start within the startup deadline") {
  // A listener that never accepts: the kernel completes TCP's handshake, BASP's never comes.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(fd, 4) == 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  auto port = ntohs(addr.sin_port);
  auto cfg = mixed_config(0, {{"127.0.0.1", port, 1}});
  cfg.startup_timeout = 1s;
  cfg.cluster.node_timeout = 30s; // the deadline, not a lost connection, ends the wait
  auto start = clock_type::now();
  auto where = "cannot reach node 127.0.0.1:" + std::to_string(port);
  CHECK_THROWS_WITH_AS(executor(cfg, test_factory()), doctest::Contains(where.c_str()), error);
  auto took = seconds_since(start);
  MESSAGE("a silent node was given up after " << took << " s (deadline 1 s)");
  CHECK(took >= 1.0);
  CHECK(took < 1.25); // the deadline, not the deadline plus a grace period
  ::close(fd);
}

// -- recovery: a worker lost on a node is replaced from a spare node ---------------------

namespace {

/// An llm of the llama-gqa fixture over 3 ranks: 0 and 1 here, 2 leased from the node on
/// `port`, with the nodes on `spares` in reserve and up to `max_restarts` replacements.
llm_config recovering_llm(uint16_t port, const std::vector<uint16_t>& spares,
                          int32_t max_restarts) {
  llm_config cfg;
  cfg.worker.model_path = TROUPE_SOURCE_DIR "/tests/fixtures/llama-gqa";
  cfg.worker.kv_cache_memory_bytes = 2 << 20;
  cfg.executor.block_size = 4;
  cfg.executor.tensor_parallel_size = 3;
  cfg.executor.cluster.nodes = {{"127.0.0.1", port, 1}};
  for (auto spare : spares)
    cfg.executor.cluster.spare_nodes.push_back({"127.0.0.1", spare, 1});
  cfg.executor.cluster.node_secret = secret;
  cfg.executor.cluster.node_timeout = 1s;
  cfg.executor.startup_timeout = 30s;
  cfg.executor.restart.max_restarts = max_restarts;
  return cfg;
}

/// The fixture's prompts, each for 32 greedy tokens, and transformers' tokens for them.
std::pair<std::vector<generation_request>, std::vector<std::vector<int32_t>>> fixture_prompts() {
  auto ref = testing::read_json(TROUPE_SOURCE_DIR "/tests/fixtures/llama-gqa/reference.json");
  std::vector<generation_request> reqs;
  std::vector<std::vector<int32_t>> want;
  for (auto& p : ref["prompts"]) {
    reqs.push_back({"", p["token_ids"].get<std::vector<int32_t>>(), testing::greedy(32), {}});
    want.push_back(p["greedy"].get<std::vector<int32_t>>());
  }
  return {reqs, want};
}

/// Captures what the executor and the workers of this process log, while it lives.
struct captured_log {
  captured_log() {
    for (auto name : {"troupe.executor", "troupe.worker"})
      get_logger(name)->sinks().push_back(sink);
  }
  ~captured_log() {
    for (auto name : {"troupe.executor", "troupe.worker"}) {
      auto& sinks = get_logger(name)->sinks();
      sinks.erase(std::remove(sinks.begin(), sinks.end(), sink), sinks.end());
    }
  }
  std::string text() const {
    return out.str();
  }
  /// How often `what` occurs.
  size_t count(const std::string& what) const {
    auto all = text();
    size_t n = 0;
    for (auto at = all.find(what); at != std::string::npos; at = all.find(what, at + 1))
      ++n;
    return n;
  }

  std::ostringstream out;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink =
    std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
};

} // namespace

TEST_CASE("a node killed mid-generation is replaced from a spare and the tokens stay "
          "transformers'") {
  faulty_node dying{"kill", 6};
  node_process spare{1};
  auto [reqs, want] = fixture_prompts();
  captured_log log;
  llm model{recovering_llm(dying.port(), {spare.port()}, 1)};
  auto outs = model.generate(reqs);
  REQUIRE(outs.size() == want.size());
  for (size_t i = 0; i < outs.size(); ++i)
    CHECK(outs[i].token_ids == want[i]);
  INFO(log.text());
  auto healths = model.executor().worker_healths();
  CHECK(healths[2].restarts == 1);
  // One recovery, onto the spare, after the first node's death.
  CHECK(log.count("rank 2 replaced in") == 1);
  CHECK(log.count("on node 127.0.0.1:" + std::to_string(spare.port()) + " (replacement 1") == 1);
  CHECK(log.count("rank 2 on node 127.0.0.1:" + std::to_string(dying.port()) + " went down") >= 1);
  CHECK(model.executor().workers().size() == 3);
}

namespace {

/// A model of the llama-gqa fixture's shape with random weights, in a folder removed with
/// the object, and the tokens it gives for the fixture's prompts.
struct updated_model {
  std::filesystem::path dir;
  std::vector<std::vector<int32_t>> tokens;

  updated_model() {
    namespace fs = std::filesystem;
    const std::string fixture = TROUPE_SOURCE_DIR "/tests/fixtures/llama-gqa";
    dir = fs::temp_directory_path() / ("troupe-node-update-" + std::to_string(getpid()));
    fs::remove_all(dir);
    write_random_model(load_model_config(fixture), dir.string(), dtype::f32, 29);
    fs::copy_file(fixture + "/config.json", dir / "config.json",
                  fs::copy_options::overwrite_existing);
    llm_config cfg;
    cfg.worker.model_path = dir.string();
    cfg.worker.kv_cache_memory_bytes = 2 << 20;
    cfg.executor.block_size = 4;
    cfg.executor.tensor_parallel_size = 3;
    llm fresh{cfg};
    for (auto& out : fresh.generate(fixture_prompts().first))
      tokens.push_back(out.token_ids);
  }
  ~updated_model() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

std::vector<std::vector<int32_t>> tokens_of(llm& model) {
  std::vector<std::vector<int32_t>> out;
  for (auto& o : model.generate(fixture_prompts().first))
    out.push_back(o.token_ids);
  return out;
}

} // namespace

TEST_CASE("a node lost after a weight update is replaced with the update: the tokens stay the "
          "updated model's") {
  updated_model other;
  REQUIRE(other.tokens != fixture_prompts().second);
  faulty_node dying{"kill", 6};
  node_process spare{1};
  captured_log log;
  llm model{recovering_llm(dying.port(), {spare.port()}, 1)};
  model.update_weights_from_disk(other.dir.string());
  CHECK(tokens_of(model) == other.tokens);
  INFO(log.text());
  CHECK(model.executor().worker_healths()[2].restarts == 1);
  CHECK(log.count("on node 127.0.0.1:" + std::to_string(spare.port()) + " (replacement 1") == 1);
}

TEST_CASE("update_weights_from_bytes reaches a node's worker with the tensors in the message") {
  updated_model other;
  node_process n{1};
  llm model{recovering_llm(n.port(), {}, 0)};
  safetensors_file file{(other.dir / "model.safetensors").string()};
  tensor_descriptions described;
  std::vector<std::string> bytes;
  for (auto& t : file.tensors()) {
    described.add({t.name, dtype_name(t.type), t.shape, t.data});
    bytes.emplace_back(reinterpret_cast<const char*>(t.data), t.bytes);
  }
  rpc_call_options call;
  call.args =
    caf::make_message(described.names, described.dtypes, described.dims, described.ndims, bytes);
  model.executor().collective_rpc("update_weights_from_bytes", call);
  model.reset_prefix_cache();
  CHECK(tokens_of(model) == other.tokens);
}

TEST_CASE("a node killed or stopped as it writes a weight update is replaced with the update") {
  updated_model other;
  auto want = fixture_prompts().second;
  for (std::string how : {"kill", "stop"}) {
    CAPTURE(how);
    faulty_node dying{how, "update"};
    node_process spare{1};
    captured_log log;
    llm model{recovering_llm(dying.port(), {spare.port()}, 1)};
    // The call says that a worker was replaced; every rank holds the update regardless.
    errc code = errc::none;
    try {
      model.update_weights_from_disk(other.dir.string());
    } catch (const error& e) {
      code = e.code();
    }
    CHECK(code == errc::worker_replaced);
    CHECK(tokens_of(model) == other.tokens);
    // A retry is safe, and so is going back.
    model.update_weights_from_disk(other.dir.string());
    CHECK(tokens_of(model) == other.tokens);
    model.update_weights_from_disk(TROUPE_SOURCE_DIR "/tests/fixtures/llama-gqa");
    CHECK(tokens_of(model) == want);
    INFO(log.text());
    CHECK(model.executor().worker_healths()[2].restarts == 1);
  }
}

TEST_CASE("a node stopped mid-step (SIGSTOP) is noticed by heartbeat, the survivors' step is "
          "aborted, and a spare takes its place") {
  faulty_node stopped{"stop", 6};
  node_process spare{1};
  auto [reqs, want] = fixture_prompts();
  captured_log log;
  llm model{recovering_llm(stopped.port(), {spare.port()}, 1)};
  auto outs = model.generate(reqs);
  REQUIRE(outs.size() == want.size());
  for (size_t i = 0; i < outs.size(); ++i)
    CHECK(outs[i].token_ids == want[i]);
  INFO(log.text());
  CHECK(model.executor().worker_healths()[2].restarts == 1);
  CHECK(log.count("no heartbeat within the timeout") >= 1);
  // Ranks 0 and 1 waited in a reduction for rank 2; its death ended the wait (instead of
  // the collective's 60 s timeout).
  CHECK(log.count("all_reduce aborted: rank 2 went down") >= 1);
  CHECK(log.count("on node 127.0.0.1:" + std::to_string(spare.port()) + " (replacement 1") == 1);
  stopped.signal(SIGCONT);
}

TEST_CASE("a node worker that dies while its node lives is leased again from that node") {
  node_process n{1};
  auto cfg = mixed_config(1, {{"127.0.0.1", n.port(), 1}});
  cfg.restart.max_restarts = 1;
  captured_log log;
  executor exec{cfg, test_factory()};
  rpc_call_options on_rank_1;
  on_rank_1.args = caf::make_message(int32_t{1});
  CHECK(code_of([&] { exec.collective_rpc("die_on", on_rank_1); }) == errc::worker_replaced);
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  INFO(log.text());
  CHECK(exec.worker_healths()[1].restarts == 1);
  // The node's one device was freed by the death and leased to the same executor again.
  CHECK(log.count("rank 1 replaced in") == 1);
  CHECK(log.count("on node 127.0.0.1:" + std::to_string(n.port()) + " (replacement 1") == 1);
}

TEST_CASE("a node worker that dies during sleep, wake_up, initialize_cache or "
          "save_sharded_state is leased again and every rank ends alike") {
  namespace fs = std::filesystem;
  node_process n{1};
  auto cfg = mixed_config(1, {{"127.0.0.1", n.port(), 1}});
  cfg.restart.max_restarts = 8;
  executor exec{cfg, test_factory()};
  exec.initialize_cache({10, 1});
  auto kv = exec.collective_rpc_as<int64_t>("kv_bytes");
  auto dir = fs::temp_directory_path() / ("troupe-node-death-" + std::to_string(getpid()));
  fs::create_directories(dir);
  auto dies_in = [&](const std::string& call) {
    exec.collective_rpc("die_in_on", {caf::make_message(int32_t{1}, call), {}, {}, {}});
  };
  auto alike = [&] {
    auto health = exec.worker_healths();
    REQUIRE(health.size() == 2);
    CHECK(health[0].sleeping_tags == health[1].sleeping_tags);
    auto bytes = exec.collective_rpc_as<int64_t>("kv_bytes");
    CHECK(bytes[0] == bytes[1]);
  };
  dies_in("sleep");
  auto code = code_of([&] { exec.sleep(1); });
  CHECK((code == errc::none || code == errc::worker_replaced));
  CHECK(exec.is_sleeping());
  alike();
  dies_in("wake_up");
  code = code_of([&] { exec.wake_up(); });
  CHECK((code == errc::none || code == errc::worker_replaced));
  CHECK(!exec.is_sleeping());
  alike();
  dies_in("initialize_cache");
  code = code_of([&] { exec.initialize_cache({20, 1}); });
  CHECK((code == errc::none || code == errc::worker_replaced));
  alike();
  CHECK(exec.collective_rpc_as<int64_t>("kv_bytes")[1] == 2 * kv[1]);
  dies_in("save_sharded_state");
  CHECK(code_of([&] { exec.save_sharded_state(dir.string()); }) == errc::worker_replaced);
  CHECK(fs::is_empty(dir));
  exec.save_sharded_state(dir.string());
  CHECK(fs::exists(dir / "test-rank-0.bin"));
  CHECK(fs::exists(dir / "test-rank-1.bin"));
  CHECK(exec.worker_healths()[1].restarts == 4);
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  fs::remove_all(dir);
}

namespace {

/// What `dir` holds, every path below it, space-separated; empty when it holds nothing.
std::string files_in(const std::filesystem::path& dir) {
  std::string found;
  for (auto& e : std::filesystem::recursive_directory_iterator(dir))
    found += e.path().string() + " ";
  return found;
}

} // namespace

TEST_CASE("a node killed (SIGKILL) or stopped (SIGSTOP) during sleep, wake_up, "
          "initialize_cache, save_sharded_state or add_lora is replaced from a spare and every "
          "rank ends alike") {
  namespace fs = std::filesystem;
  const std::vector<std::string> calls{"sleep", "wake_up", "initialize_cache", "save_sharded_state",
                                       "add_lora"};
  // Rank 1's node, and a spare for each loss.
  std::vector<std::unique_ptr<node_process>> nodes;
  for (size_t i = 0; i <= 2 * calls.size(); ++i)
    nodes.push_back(std::make_unique<node_process>(1));
  auto cfg = mixed_config(1, {{"127.0.0.1", nodes[0]->port(), 1}});
  for (size_t i = 1; i < nodes.size(); ++i)
    cfg.cluster.spare_nodes.push_back({"127.0.0.1", nodes[i]->port(), 1});
  cfg.restart.max_restarts = static_cast<int32_t>(2 * calls.size());
  captured_log log;
  executor exec{cfg, test_factory()};
  exec.initialize_cache({10, 1});
  auto kv = exec.collective_rpc_as<int64_t>("kv_bytes");
  auto dir = fs::temp_directory_path() / ("troupe-node-loss-" + std::to_string(getpid()));
  fs::create_directories(dir);
  auto alike = [&] {
    auto health = exec.worker_healths();
    REQUIRE(health.size() == 2);
    CHECK(health[0].sleeping_tags == health[1].sleeping_tags);
    CHECK(exec.is_sleeping() == !health[0].sleeping_tags.empty());
    auto bytes = exec.collective_rpc_as<int64_t>("kv_bytes");
    CHECK(bytes[0] == bytes[1]);
    auto loras = exec.collective_rpc_as<std::vector<int64_t>>("list_loras");
    CHECK(loras[0] == loras[1]);
  };
  int64_t lora = 0;
  for (int sig : {SIGKILL, SIGSTOP})
    for (auto& call : calls) {
      CAPTURE(sig);
      CAPTURE(call);
      exec.collective_rpc("signal_in_on",
                          {caf::make_message(int32_t{1}, call, int32_t{sig}), {}, {}, {}});
      if (call == "wake_up")
        exec.sleep(1);
      errc code = errc::none;
      if (call == "sleep")
        code = code_of([&] { exec.sleep(1); });
      else if (call == "wake_up")
        code = code_of([&] { exec.wake_up(); });
      else if (call == "initialize_cache")
        code = code_of([&] { exec.initialize_cache({20, 1}); });
      else if (call == "add_lora")
        code = code_of([&] { exec.add_lora({"adapter", ++lora, "/nonexistent"}); });
      if (call == "save_sharded_state") {
        // A save the loss cut short leaves no file; its retry lands whole.
        CHECK(code_of([&] { exec.save_sharded_state(dir.string()); }) == errc::worker_replaced);
        CHECK(files_in(dir) == "");
        exec.save_sharded_state(dir.string());
        CHECK(fs::exists(dir / "test-rank-1.bin"));
        fs::remove_all(dir);
        fs::create_directories(dir);
      } else {
        // Done, or `worker_replaced` with every rank in the state the executor reports.
        CHECK((code == errc::none || code == errc::worker_replaced));
      }
      alike();
      // The call's own effect holds, on the replacement too, or a retry gives it.
      if (call == "sleep")
        CHECK(exec.is_sleeping());
      if (exec.is_sleeping())
        exec.wake_up();
      if (call == "initialize_cache")
        CHECK(exec.collective_rpc_as<int64_t>("kv_bytes")[1] == 2 * kv[1]);
      if (call == "add_lora") {
        exec.add_lora({"adapter", lora, "/nonexistent"});
        auto loras = exec.collective_rpc_as<std::vector<int64_t>>("list_loras");
        CHECK(std::count(loras[1].begin(), loras[1].end(), lora) == 1);
      }
      alike();
      exec.initialize_cache({10, 1});
    }
  INFO(log.text());
  CHECK(exec.worker_healths()[1].restarts == static_cast<int32_t>(2 * calls.size()));
  CHECK(exec.collective_rpc_as<int32_t>("rank") == std::vector<int32_t>{0, 1});
  fs::remove_all(dir);
}

TEST_CASE("a rank stopped during a save and found dead only after the save failed has its "
          "staged part removed by its replacement") {
  namespace fs = std::filesystem;
  node_process first{1};
  node_process spare{1};
  auto cfg = mixed_config(1, {{"127.0.0.1", first.port(), 1}});
  cfg.cluster.spare_nodes.push_back({"127.0.0.1", spare.port(), 1});
  cfg.restart.max_restarts = 1;
  // The save, and its cleanup, time out long before the stopped node is found dead.
  cfg.rpc_timeout = 1s;
  cfg.cluster.node_timeout = 4s;
  executor exec{cfg, test_factory()};
  auto dir = fs::temp_directory_path() / ("troupe-late-death-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  exec.collective_rpc(
    "signal_in_on",
    {caf::make_message(int32_t{1}, std::string{"save_sharded_state"}, int32_t{SIGSTOP}),
     {},
     {},
     {}});
  CHECK(code_of([&] { exec.save_sharded_state(dir.string()); }) == errc::timeout);
  CHECK_FALSE(fs::is_empty(dir)); // rank 1's staging folder: its cleanup timed out too
  auto replaced = [&] {
    for (auto until = clock_type::now() + 20s; clock_type::now() < until;
         std::this_thread::sleep_for(50ms))
      try {
        if (exec.worker_healths()[1].restarts == 1 && exec.recovery().empty())
          return true;
      } catch (const error&) {
        // the stopped rank does not answer until it is replaced
      }
    return false;
  };
  REQUIRE(replaced());
  CHECK(files_in(dir) == "");
  exec.save_sharded_state(dir.string());
  CHECK(fs::exists(dir / "test-rank-1.bin"));
  fs::remove_all(dir);
}

TEST_CASE("a second death beyond max_restarts fails the generation with worker_died naming "
          "the node, and nothing hangs") {
  faulty_node first{"kill", 6};
  faulty_node second{"kill", 8}; // the spare dies too, after the first recovery
  auto [reqs, want] = fixture_prompts();
  captured_log log;
  llm model{recovering_llm(first.port(), {second.port()}, 1)};
  try {
    model.generate(reqs);
    FAIL("the generation survived two deaths with max_restarts 1");
  } catch (const error& e) {
    CHECK(e.code() == errc::worker_died);
    std::string what = e.what();
    INFO(what);
    CHECK(what.find("rank 2 on node 127.0.0.1:" + std::to_string(second.port())) !=
          std::string::npos);
    CHECK(what.find("not replaced: 1 replacement(s) within the last") != std::string::npos);
  }
  CHECK(log.count("rank 2 replaced in") == 1);
  CHECK(code_of([&] { model.executor().check_health(); }) == errc::worker_died);
}
