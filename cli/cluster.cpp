// `troupe node` and the --nodes / --secret-file options of the commands that run an
// executor.

#include "cli/commands.hpp"

#include "actors/cluster/node_auth.hpp"
#include "troupe/errors.hpp"
#include "troupe/model_worker.hpp"
#include "troupe/node.hpp"

#include <fstream>
#include <iostream>
#include <sstream>

namespace troupe::cli {

namespace {

/// "HOST:PORT" (the port after the last colon).
std::pair<std::string, uint16_t> host_and_port(const std::string& flag, const std::string& text) {
  auto colon = text.rfind(':');
  long port = -1;
  if (colon != std::string::npos && colon > 0) {
    try {
      size_t used = 0;
      port = std::stol(text.substr(colon + 1), &used);
      if (used != text.size() - colon - 1)
        port = -1;
    } catch (const std::exception&) {
      port = -1;
    }
  }
  if (port < 0 || port > 65535)
    throw error{errc::invalid_argument, flag + ": '" + text + "' is not HOST:PORT"};
  return {text.substr(0, colon), static_cast<uint16_t>(port)};
}

} // namespace

void add_node_options(CLI::App& app, node_options& o) {
  app
    .add_option("--nodes", o.nodes,
                "Worker nodes (troupe node) as HOST:PORT or HOST:PORT/WORKERS, comma-separated; "
                "their workers take the last ranks")
    ->delimiter(',');
  app
    .add_option("--spare-nodes", o.spare_nodes,
                "Nodes held in reserve (HOST:PORT, comma-separated): a worker lost on a node "
                "is replaced from one of these when its own node does not take it back "
                "(with --max-restarts)")
    ->delimiter(',');
  app.add_option("--secret-file", o.secret_file, "File holding the nodes' shared secret");
  app.add_option("--tls-cert", o.tls_certificate,
                 "Mutual TLS with the nodes: this side's certificate (PEM)");
  app.add_option("--tls-key", o.tls_key, "Mutual TLS: this side's private key (PEM)");
  app.add_option("--tls-ca", o.tls_ca, "Mutual TLS: the CA the nodes' certificates come from");
  app
    .add_option("--node-timeout-ms", o.timeout_ms,
                "A node silent this long counts as lost (BASP heartbeats every quarter)")
    ->check(CLI::Range(100, 3600000))
    ->capture_default_str();
  app
    .add_option("--network-linger-us", o.network_linger_us,
                "How long the thread that talks to the nodes polls for the next message "
                "before it sleeps, and a blocking caller for its reply (0: at once)")
    ->check(CLI::Range(int64_t{0}, max_linger.count()))
    ->capture_default_str();
  app
    .add_option("--node-links", o.node_links,
                "Whether collective_rpc and execute_model reach the nodes' workers over "
                "connections of their own (call links) rather than over BASP")
    ->capture_default_str();
  app
    .add_option("--node-local-links", o.node_local_links,
                "Whether the call link to a node on this host goes over its local (Unix) "
                "socket rather than TCP")
    ->capture_default_str();
  app
    .add_option("--node-shared-memory", o.node_shared_memory,
                "Whether a call link over a node's local socket moves its frames to memory "
                "shared with the node")
    ->capture_default_str();
}

std::string read_text_file(const std::string& flag, const std::string& path) {
  std::ifstream in{path};
  if (!in)
    throw error{errc::invalid_argument, flag + ": cannot read '" + path + "'"};
  std::stringstream text;
  text << in.rdbuf();
  auto contents = text.str();
  while (!contents.empty() && (contents.back() == '\n' || contents.back() == '\r'))
    contents.pop_back();
  if (contents.empty())
    throw error{errc::invalid_argument, flag + ": '" + path + "' is empty"};
  return contents;
}

std::string read_secret(const std::string& path) {
  auto secret = read_text_file("--secret-file", path);
  check_secret(secret, "--secret-file '" + path + "'");
  return secret;
}

void apply_node_options(const node_options& o, executor_config& cfg) {
  for (auto& spec : o.spare_nodes) {
    auto [host, port] = host_and_port("--spare-nodes", spec);
    cfg.cluster.spare_nodes.push_back({host, port, 1});
  }
  for (auto& spec : o.nodes) {
    node_address n;
    auto slash = spec.find('/');
    auto [host, port] = host_and_port("--nodes", spec.substr(0, slash));
    n.host = host;
    n.port = port;
    if (slash != std::string::npos) {
      auto count = spec.substr(slash + 1);
      size_t used = 0;
      try {
        n.workers = std::stoi(count, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != count.size())
        throw error{errc::invalid_argument,
                    "--nodes: in '" + spec + "', '" + count + "' is not a number of workers"};
      if (n.workers < 1)
        throw error{errc::invalid_argument, "--nodes: '" + spec + "' asks for no workers"};
    }
    cfg.cluster.nodes.push_back(n);
  }
  cfg.cluster.tls_certificate = o.tls_certificate;
  cfg.cluster.tls_key = o.tls_key;
  cfg.cluster.tls_ca = o.tls_ca;
  if (!cfg.cluster.nodes.empty() || !cfg.cluster.spare_nodes.empty()) {
    if (o.secret_file.empty() && o.tls_certificate.empty())
      throw error{errc::invalid_argument,
                  std::string{cfg.cluster.nodes.empty() ? "--spare-nodes" : "--nodes"} +
                    " needs --secret-file or --tls-cert/--tls-key/--tls-ca"};
    if (!o.secret_file.empty())
      cfg.cluster.node_secret = read_secret(o.secret_file);
  }
  cfg.cluster.node_timeout = std::chrono::milliseconds(o.timeout_ms);
  cfg.cluster.network_linger = std::chrono::microseconds(o.network_linger_us);
  cfg.cluster.node_links = o.node_links;
  cfg.cluster.node_local_links = o.node_local_links;
  cfg.cluster.node_shared_memory = o.node_shared_memory;
}

std::shared_ptr<command> add_node(CLI::App& app) {
  struct options {
    std::string listen = "127.0.0.1:7420";
    std::string devices = "cpu:1";
    std::string secret_file;
    std::string tls_certificate;
    std::string tls_key;
    std::string tls_ca;
    std::string collective_host;
    int timeout_ms = 3000;
    uint64_t max_message_bytes = uint64_t{64} << 20;
    int64_t network_linger_us = node_config{}.network_linger.count();
  };
  auto o = std::make_shared<options>();
  auto cmd = std::make_shared<command>();
  auto* sub = app.add_subcommand(
    "node", "Host workers for an executor in another process or on another machine");
  cmd->app = sub;
  sub
    ->add_option("--listen", o->listen,
                 "HOST:PORT to listen on (loopback unless an address is given; port 0 picks one)")
    ->capture_default_str();
  sub
    ->add_option("--devices", o->devices,
                 "Devices to host workers on, one worker each: cpu:N or cuda:I[,J...]")
    ->capture_default_str();
  sub->add_option("--secret-file", o->secret_file,
                  "File holding the shared secret executors must prove");
  sub->add_option("--tls-cert", o->tls_certificate, "Mutual TLS: this node's certificate (PEM)");
  sub->add_option("--tls-key", o->tls_key, "Mutual TLS: this node's private key (PEM)");
  sub->add_option("--tls-ca", o->tls_ca,
                  "Mutual TLS: the CA executors' certificates must come from (PEM)");
  sub->add_option("--collective-host", o->collective_host,
                  "Address the workers' tensor-parallel collective listens on (default: the "
                  "--listen host)");
  sub
    ->add_option("--connection-timeout-ms", o->timeout_ms,
                 "An executor silent this long counts as gone and its workers are released")
    ->check(CLI::Range(100, 3600000))
    ->capture_default_str();
  sub
    ->add_option("--max-message-bytes", o->max_message_bytes,
                 "The largest message a peer may send; a larger one closes its connection")
    ->check(CLI::Range(uint64_t{1} << 10, uint64_t{1} << 32))
    ->capture_default_str();
  sub
    ->add_option("--network-linger-us", o->network_linger_us,
                 "How long the node's network threads poll for the next message before "
                 "they sleep (0: at once)")
    ->check(CLI::Range(int64_t{0}, max_linger.count()))
    ->capture_default_str();
  cmd->run = [o] {
    node_config cfg;
    cfg.network_linger = std::chrono::microseconds(o->network_linger_us);
    cfg.max_message_bytes = o->max_message_bytes;
    auto [host, port] = host_and_port("--listen", o->listen);
    cfg.host = host;
    cfg.port = port;
    // cpu:N, or cuda:I[,J...]
    auto colon = o->devices.find(':');
    auto kind = o->devices.substr(0, colon);
    auto rest = colon == std::string::npos ? std::string{} : o->devices.substr(colon + 1);
    auto bad = [&] {
      return error{errc::invalid_argument,
                   "--devices: '" + o->devices + "' is not cpu:N or cuda:I[,J...]"};
    };
    std::vector<int> numbers;
    std::stringstream parts{rest};
    for (std::string part; std::getline(parts, part, ',');) {
      try {
        size_t used = 0;
        numbers.push_back(std::stoi(part, &used));
        if (used != part.size() || numbers.back() < 0)
          throw bad();
      } catch (const std::exception&) {
        throw bad();
      }
    }
    if (kind == "cpu" && numbers.size() == 1 && numbers[0] > 0)
      cfg.devices = numbers[0];
    else if (kind == "cuda" && !numbers.empty())
      cfg.device_indices.assign(numbers.begin(), numbers.end());
    else
      throw bad();
    cfg.device_type = parse_device_kind(kind);
    if (!o->secret_file.empty())
      cfg.secret = read_secret(o->secret_file);
    cfg.tls_certificate = o->tls_certificate;
    cfg.tls_key = o->tls_key;
    cfg.tls_ca = o->tls_ca;
    cfg.collective_host = o->collective_host;
    cfg.connection_timeout = std::chrono::milliseconds(o->timeout_ms);
    cfg.kinds["model"] = model_worker_kind();
    cfg.kinds["bench"] = [](int32_t, const caf::settings&) { return make_bench_worker(); };
    node n{cfg};
    n.stop_on_signals();
    std::cout << "troupe node listening on " << cfg.host << ":" << n.port() << " with "
              << o->devices << std::endl;
    n.wait();
    if (auto failure = n.failure(); !failure.empty()) {
      std::cerr << "troupe node: " << failure << std::endl;
      return 1;
    }
    return 0;
  };
  return cmd;
}

} // namespace troupe::cli
