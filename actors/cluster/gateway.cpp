#include "actors/cluster/gateway.hpp"

#include "actors/linger.hpp"
#include "actors/cluster/link_tls.hpp"
#include "actors/cluster/node_auth.hpp"
#include "troupe/errors.hpp"

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>

#include <openssl/ssl.h>

#include <arpa/inet.h>
#include <endian.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <array>
#include <cerrno>
#include <cstddef>
#include <fcntl.h>
#include <cstring>
#include <list>
#include <thread>
#include <vector>

namespace troupe {

namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using local_socket = asio::local::stream_protocol::socket;
using tls_stream = asio::ssl::stream<tcp::socket>;

/// Size of a BASP header: operation, 2 padding bytes, flags, payload length (u32), operation
/// data (u64), source and destination actor ids (u64 each), integers in network order.
constexpr size_t basp_header_size = 32;
constexpr size_t payload_length_offset = 4;
constexpr size_t dest_actor_offset = 24;

/// BASP's operations (CAF 0.17, `caf::io::basp::message_type`).
enum class basp_op : uint8_t {
  server_handshake = 0,
  client_handshake = 1,
  direct_message = 2,
  routed_message = 3,
  monitor_message = 4,
  down_message = 5,
  heartbeat = 6,
};

/// The header flag of a message to an actor by registered name (CAF's "SpawnServ" …).
constexpr uint8_t named_receiver_flag = 0x01;

/// Room for a serialized node id (a host hash and a process id, in CAF 0.17).
constexpr uint64_t max_node_bytes = 256;

/// How long accepting pauses when the process is out of file descriptors.
constexpr auto accept_backoff = std::chrono::milliseconds(100);

/// What every relay of a gateway needs.
struct relay_settings {
  gateway_options options;
  frame_gateway::connect_fn connect;
  frame_gateway::link_fn link;
  std::shared_ptr<spdlog::logger> log;
  /// Under TLS: the node's context, for the sessions of call links.
  std::shared_ptr<ssl_ctx_st> tls;
};

struct relay_base {
  virtual ~relay_base() = default;
  virtual void start() = 0;
  virtual void close() = 0;
  /// Whether the peer proved itself (and the connection goes on to the middleman).
  bool proved = false;
};

/// One peer's connection and its private connection to the middleman. Upstream (peer to
/// middleman) goes frame by frame, each payload streamed through a fixed buffer once its
/// header passed the bound; downstream goes as it comes. Any error or close on either side
/// closes both.
template <class Stream>
class relay : public relay_base, public std::enable_shared_from_this<relay<Stream>> {
public:
  relay(Stream client, std::string peer, std::shared_ptr<const relay_settings> settings)
    : client_(std::move(client)), server_(client_.get_executor()),
      deadline_(client_.get_executor()), peer_(std::move(peer)), settings_(std::move(settings)) {}

  /// Starts the connection: the TLS handshake or the connection handshake, within the
  /// deadline, then the relay.
  void start() override {
    auto self = this->shared_from_this();
    deadline_.expires_after(settings_->options.handshake_timeout);
    deadline_.async_wait([self](const boost::system::error_code& ec) {
      if (!ec) {
        self->settings_->log->warn("closed {}: it did not prove itself within {} ms", self->peer_,
                                   self->settings_->options.handshake_timeout.count() / 1000);
        self->close();
      }
    });
    if constexpr (is_tls) {
      // A TLS connection's first byte starts a handshake record; a call link's, its preamble.
      raw().async_wait(tcp::socket::wait_read, [self](const boost::system::error_code& ec) {
        if (self->closed_)
          return;
        unsigned char first = 0;
        auto n = ec ? -1 : ::recv(self->raw().native_handle(), &first, 1, MSG_PEEK);
        if (n <= 0)
          return self->close();
        if (first == tls_handshake_record)
          self->handshake_for_basp();
        else
          self->handshake_for_link();
      });
    } else if (is_local && settings_->tls) {
      handshake_for_link();
    } else {
      greet();
    }
  }

  void close() override {
    if (closed_)
      return;
    closed_ = true;
    settings_->log->info("connection from {} closed", peer_);
    boost::system::error_code ec;
    deadline_.cancel();
    client_.lowest_layer().close(ec);
    server_.close(ec);
  }

private:
  static constexpr bool is_tls = std::is_same_v<Stream, tls_stream>;

  /// The socket itself, below TLS.
  auto& raw() {
    if constexpr (is_tls)
      return client_.next_layer();
    else
      return client_;
  }

  void handshake_for_basp() {
    if constexpr (is_tls) {
      auto self = this->shared_from_this();
      client_.async_handshake(asio::ssl::stream_base::server,
                              [self](const boost::system::error_code& ec) {
                                if (self->closed_)
                                  return;
                                if (ec) {
                                  self->settings_->log->warn("refused {}: TLS handshake failed: {}",
                                                             self->peer_, ec.message());
                                  self->close();
                                  return;
                                }
                                // The certificates were the proof.
                                self->proven();
                              });
    }
  }

  /// A call link under TLS: its preamble, then the TLS handshake through a session of the
  /// link's own, which goes on with the link.
  void handshake_for_link() {
    auto self = this->shared_from_this();
    line_.assign(tls_link_preamble_size, '\0');
    asio::async_read(
      raw(), asio::buffer(line_), [self](const boost::system::error_code& ec, size_t) {
        if (ec)
          return self->close();
        if (self->line_ != std::string{tls_link_preamble} || !self->settings_->link) {
          self->settings_->log->warn("refused {}: {}", self->peer_,
                                     self->settings_->link ? "neither TLS nor a call link"
                                                           : "a call link, and links are off");
          return self->close();
        }
        self->session_ = std::make_unique<tls_session>(self->settings_->tls, tls_role::server);
        self->up_.resize(16 << 10);
        self->link_handshake_step();
      });
  }

  void link_handshake_step() {
    auto self = this->shared_from_this();
    down_.clear();
    auto step = session_->handshake(down_);
    if (step == tls_session::progress::failed)
      settings_->log->warn("refused {}: TLS handshake failed: {}", peer_, session_->why());
    auto next = [self, step] {
      if (step == tls_session::progress::done)
        self->hand_over();
      else if (step == tls_session::progress::failed)
        self->close();
      else
        self->raw().async_read_some(asio::buffer(self->up_),
                                    [self](const boost::system::error_code& ec, size_t n) {
                                      if (ec)
                                        return self->close();
                                      self->session_->give(self->up_.data(), n);
                                      self->link_handshake_step();
                                    });
    };
    if (down_.empty())
      return next();
    // The flight (or the alert that says why not) goes out first.
    asio::async_write(raw(), asio::buffer(down_),
                      [self, next](const boost::system::error_code& ec, size_t) {
                        if (ec)
                          return self->close();
                        next();
                      });
  }

  /// The connection handshake (`actors/cluster/node_auth.hpp`): greeting, the peer's answer, the
  /// verdict.
  void greet() {
    auto self = this->shared_from_this();
    challenge_ = random_challenge();
    line_ = connection_greeting(challenge_);
    asio::async_write(client_, asio::buffer(line_),
                      [self](const boost::system::error_code& ec, size_t) {
                        if (ec)
                          return self->close();
                        self->line_.assign(answer_size, '\0');
                        asio::async_read(self->client_, asio::buffer(self->line_),
                                         [self](const boost::system::error_code& ec, size_t) {
                                           if (ec)
                                             return self->close();
                                           self->judge();
                                         });
                      });
  }

  static constexpr bool is_local = std::is_same_v<Stream, local_socket>;

  void judge() {
    auto& secret = settings_->options.secret;
    // " ": a connection for BASP; "+": a call link, with a proof of its own. The local
    // socket takes links only.
    bool link = line_[64] == '+' && settings_->link;
    bool basp_here = line_[64] == ' ' && is_local;
    bool well_formed = (line_[64] == ' ' || link) && line_.back() == '\n';
    auto peer_challenge = line_.substr(0, 64);
    auto proof = line_.substr(65, 64);
    auto expected = link ? link_proof(secret, challenge_, peer_challenge)
                         : peer_proof(secret, challenge_, peer_challenge);
    auto self = this->shared_from_this();
    if (basp_here || !well_formed || !same_proof(proof, expected)) {
      settings_->log->warn("refused {}: {}", peer_,
                           basp_here     ? "BASP on the socket for call links"
                           : well_formed ? "wrong secret"
                                         : "not a troupe handshake");
      line_ = basp_here ? "no only call links here: BASP goes to the node's TCP port\n"
                        : "no wrong secret\n";
      asio::async_write(client_, asio::buffer(line_),
                        [self](const boost::system::error_code&, size_t) { self->close(); });
      return;
    }
    line_ = "ok " + node_proof(secret, challenge_, peer_challenge) + "\n";
    asio::async_write(client_, asio::buffer(line_),
                      [self, link](const boost::system::error_code& ec, size_t) {
                        if (ec)
                          return self->close();
                        if (link)
                          self->hand_over();
                        else
                          self->proven();
                      });
  }

  /// Gives a proven link's socket (and its TLS session) to the node: it carries no BASP,
  /// so nothing is relayed.
  void hand_over() {
    deadline_.cancel();
    proved = true;
    int fd = ::fcntl(raw().native_handle(), F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
      settings_->log->error("link from {}: cannot take its socket: {}", peer_,
                            std::strerror(errno));
    close();
    if (fd >= 0)
      settings_->link(fd, std::move(session_), peer_);
  }

  void proven() {
    deadline_.cancel();
    proved = true;
    relay_to_middleman();
  }

  void relay_to_middleman() {
    int fd = settings_->connect();
    if (fd < 0) {
      settings_->log->error("connection from {}: cannot reach the middleman", peer_);
      close();
      return;
    }
    boost::system::error_code ec;
    server_.assign(asio::local::stream_protocol{}, fd, ec);
    if (ec) {
      ::close(fd);
      close();
      return;
    }
    up_.resize(64 << 10);
    down_.resize(64 << 10);
    read_header();
    read_downstream();
  }

  void read_header() {
    auto self = this->shared_from_this();
    asio::async_read(client_, asio::buffer(header_),
                     [self](const boost::system::error_code& ec, size_t) {
                       if (ec)
                         return self->close();
                       self->on_header();
                     });
  }

  void on_header() {
    uint32_t net_length = 0;
    std::memcpy(&net_length, header_.data() + payload_length_offset, sizeof net_length);
    uint64_t length = ntohl(net_length);
    if (length > settings_->options.max_frame_bytes) {
      settings_->log->warn("refused {}: a message of {} bytes, above the bound of {}", peer_,
                           length, settings_->options.max_frame_bytes);
      return close();
    }
    remaining_ = length;
    auto op = static_cast<basp_op>(header_[0]);
    if (!settings_->options.policy || op == basp_op::heartbeat)
      return pass();
    switch (op) {
    case basp_op::client_handshake:
      // Its whole payload is the peer's node id.
      if (length > max_node_bytes) {
        settings_->log->warn("refused {}: a handshake of {} bytes", peer_, length);
        return close();
      }
      return read_prefix(length);
    case basp_op::direct_message:
      return judge_frame();
    case basp_op::routed_message:
    case basp_op::monitor_message:
    case basp_op::down_message:
      return read_prefix(std::min<uint64_t>(length, 2 * max_node_bytes));
    default:
      // A server's handshake, or no BASP operation: not what a node's client sends.
      settings_->log->warn("refused {}: BASP operation {} from a client", peer_,
                           static_cast<int>(header_[0]));
      return close();
    }
  }

  /// Reads the first `size` bytes of the payload, for `judge_frame`.
  void read_prefix(uint64_t size) {
    prefix_.resize(static_cast<size_t>(size));
    auto self = this->shared_from_this();
    asio::async_read(client_, asio::buffer(prefix_),
                     [self](const boost::system::error_code& ec, size_t n) {
                       if (ec)
                         return self->close();
                       self->remaining_ -= n;
                       self->judge_frame();
                     });
  }

  /// Whether the frame's payload (its `prefix_`) starts with the serialized node `id`.
  bool prefix_names(const std::string& id) const {
    return !id.empty() && prefix_.size() >= id.size() &&
           std::memcmp(prefix_.data(), id.data(), id.size()) == 0;
  }

  /// Passes, drops or refuses the frame whose header (and prefix) has been read, by the
  /// gateway's policy.
  void judge_frame() {
    auto& policy = *settings_->options.policy;
    auto op = static_cast<basp_op>(header_[0]);
    if (op == basp_op::client_handshake) {
      if (prefix_names(policy.this_node)) {
        settings_->log->warn("refused {}: it claims to be this node", peer_);
        return close();
      }
      peer_node_.assign(prefix_.begin(), prefix_.end());
      return pass();
    }
    // The source node of a routed, monitor or down message comes first in its payload.
    bool sourced = op != basp_op::direct_message;
    if (sourced && prefix_names(policy.this_node)) {
      settings_->log->warn("refused {}: a message forged as from this node", peer_);
      return close();
    }
    if (!peer_node_.empty() && policy.holds(peer_node_))
      return pass();
    // Anyone else speaks for itself, to the gate.
    uint64_t dest = 0;
    std::memcpy(&dest, header_.data() + dest_actor_offset, sizeof dest);
    dest = be64toh(dest);
    bool own = !sourced || prefix_names(peer_node_);
    bool named = (static_cast<uint8_t>(header_[3]) & named_receiver_flag) != 0;
    bool to_gate = !named && dest == policy.gate;
    if (own && (to_gate || op == basp_op::down_message))
      return pass();
    // CAF itself asks a new peer's named actors for their settings: that is no attack.
    if (!named && dropped_++ == 0)
      settings_->log->warn("dropped a message from {}, which does not hold the lease, to "
                           "actor {} (peers reach only the gate until they lease)",
                           peer_, dest);
    discard();
  }

  /// Relays the frame: its header, the prefix read, and the rest of its payload.
  void pass() {
    std::array<asio::const_buffer, 2> parts{asio::buffer(header_), asio::buffer(prefix_)};
    auto self = this->shared_from_this();
    asio::async_write(server_, parts, [self](const boost::system::error_code& ec, size_t) {
      if (ec)
        return self->close();
      self->prefix_.clear();
      self->read_payload(false);
    });
  }

  /// Reads the rest of the frame's payload and throws it away.
  void discard() {
    prefix_.clear();
    read_payload(true);
  }

  /// The rest of the frame's payload, streamed through `up_` to the middleman, or dropped.
  void read_payload(bool drop) {
    if (remaining_ == 0)
      return read_header();
    auto self = this->shared_from_this();
    auto chunk = static_cast<size_t>(std::min<uint64_t>(remaining_, up_.size()));
    client_.async_read_some(
      asio::buffer(up_.data(), chunk), [self, drop](const boost::system::error_code& ec, size_t n) {
        if (ec)
          return self->close();
        self->remaining_ -= n;
        if (drop)
          return self->read_payload(true);
        asio::async_write(self->server_, asio::buffer(self->up_.data(), n),
                          [self](const boost::system::error_code& ec, size_t) {
                            if (ec)
                              return self->close();
                            self->read_payload(false);
                          });
      });
  }

  void read_downstream() {
    auto self = this->shared_from_this();
    server_.async_read_some(
      asio::buffer(down_), [self](const boost::system::error_code& ec, size_t n) {
        if (ec)
          return self->close();
        asio::async_write(self->client_, asio::buffer(self->down_.data(), n),
                          [self](const boost::system::error_code& ec, size_t) {
                            if (ec)
                              return self->close();
                            self->read_downstream();
                          });
      });
  }

  Stream client_;
  local_socket server_;
  asio::steady_timer deadline_;
  std::string peer_;
  std::shared_ptr<const relay_settings> settings_;
  std::array<char, basp_header_size> header_{};
  /// The start of the frame's payload, read to judge it.
  std::vector<char> prefix_;
  /// The peer's node id from its handshake, as CAF serializes it.
  std::string peer_node_;
  /// Frames dropped by the policy (the first is logged).
  uint64_t dropped_ = 0;
  uint64_t remaining_ = 0;
  bool closed_ = false;
  std::string challenge_;
  /// The handshake's line in flight.
  std::string line_;
  /// A call link's TLS session while it goes through its handshake.
  std::unique_ptr<tls_session> session_;
  /// The relay's buffers, made once the peer proved itself.
  std::vector<char> up_;
  std::vector<char> down_;
};

bool out_of_descriptors(const boost::system::error_code& ec) {
  return ec == asio::error::no_descriptors || ec.value() == ENFILE ||
         ec == asio::error::no_buffer_space || ec == asio::error::no_memory;
}

} // namespace

struct frame_gateway::impl {
  asio::io_context io;
  tcp::acceptor acceptor{io};
  /// Call links from this host (`frame_gateway::local_address`); closed when there is none.
  asio::local::stream_protocol::acceptor local_acceptor{io};
  std::string local_address;
  std::unique_ptr<asio::ssl::context> tls;
  std::shared_ptr<const relay_settings> settings;
  /// The relays alive, oldest first, to close at stop and to find the oldest still proving
  /// itself; expired ones are dropped as new ones come.
  std::list<std::weak_ptr<relay_base>> relays;
  std::thread thread;
  bool stopped = false;
  timeout_type linger{0};

  // `io.run()`, except that after each event the thread polls for the next for `linger`:
  // a call relayed to a node crosses this thread twice, and waking it costs more than a
  // poll.
  void run() {
    for (;;) {
      if (linger > timeout_type::zero() && linger_for(linger, [&] { return io.poll() > 0; }))
        continue;
      if (io.run_one() == 0)
        return; // stopped
    }
  }

  /// Accepts on `from` (the TCP or the local acceptor) for good, handing each connection to
  /// `start_relay`.
  template <class Acceptor>
  void accept(Acceptor& from) {
    from.async_accept([this, &from](const boost::system::error_code& ec,
                                    typename Acceptor::protocol_type::socket socket) {
      if (!from.is_open())
        return;
      if (ec) {
        if (out_of_descriptors(ec)) {
          // Retrying at once would spin: the error stays until a descriptor is freed.
          settings->log->warn("cannot accept a connection: {}; pausing {} ms", ec.message(),
                              accept_backoff.count());
          auto timer = std::make_shared<asio::steady_timer>(io, accept_backoff);
          timer->async_wait([this, &from, timer](const boost::system::error_code& e) {
            if (!e && from.is_open())
              accept(from);
          });
          return;
        }
        return accept(from);
      }
      start_relay(std::move(socket));
      accept(from);
    });
  }

  /// A call link from this host: only links, through the secret's handshake or TLS.
  void start_relay(local_socket socket) {
    ucred cred{};
    socklen_t size = sizeof cred;
    auto peer = getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &size) == 0
                  ? "process " + std::to_string(cred.pid) + " on this host"
                  : std::string{"a process on this host"};
    settings->log->info("connection from {}", peer);
    start(std::make_shared<relay<local_socket>>(std::move(socket), std::move(peer), settings));
  }

  void start(std::shared_ptr<relay_base> r) {
    relays.remove_if([](const std::weak_ptr<relay_base>& w) { return w.expired(); });
    make_room();
    r->start();
    relays.push_back(std::move(r));
  }

  void start_relay(tcp::socket socket) {
    boost::system::error_code ec;
    auto from = socket.remote_endpoint(ec);
    auto peer =
      ec ? std::string{"?"} : from.address().to_string() + ":" + std::to_string(from.port());
    socket.set_option(tcp::no_delay(true), ec);
    settings->log->info("connection from {}", peer);
    if (tls)
      start(std::make_shared<relay<tls_stream>>(tls_stream{std::move(socket), *tls},
                                                std::move(peer), settings));
    else
      start(std::make_shared<relay<tcp::socket>>(std::move(socket), std::move(peer), settings));
  }

  /// Listens for call links from this host on a fresh name in the abstract Unix namespace
  /// (nothing on disk to clean up; a process in another network namespace cannot reach it).
  /// Without it, links from this host come over TCP as others do.
  void listen_locally() {
    auto name = "troupe-node-" + random_challenge().substr(0, 24);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path + 1, name.data(), name.size()); // sun_path[0] == 0: abstract
    auto size = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    auto give_up = [this](int fd, const std::string& why) {
      settings->log->warn("no local socket for call links ({}): links from this host come "
                          "over TCP",
                          why);
      if (fd >= 0)
        ::close(fd);
    };
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), size) != 0 ||
        ::listen(fd, SOMAXCONN) != 0)
      return give_up(fd, std::strerror(errno));
    boost::system::error_code ec;
    local_acceptor.assign(asio::local::stream_protocol{}, fd, ec);
    if (ec)
      return give_up(fd, ec.message());
    local_address = "@" + name;
  }

  /// Keeps fewer than max_pending connections proving themselves: a flood of peers that
  /// never finish only pushes each other out, while one that does finish goes on.
  void make_room() {
    size_t pending = 0;
    for (auto& weak : relays)
      if (auto r = weak.lock(); r && !r->proved)
        ++pending;
    for (auto i = relays.begin(); pending >= settings->options.max_pending && i != relays.end();
         ++i)
      if (auto r = i->lock(); r && !r->proved) {
        settings->log->warn("{} connections are proving themselves: closing the oldest", pending);
        r->close();
        --pending;
      }
  }
};

frame_gateway::frame_gateway(gateway_options options, connect_fn connect, link_fn link,
                             std::shared_ptr<spdlog::logger> log)
  : impl_(std::make_unique<impl>()) {
  auto& d = *impl_;
  auto host = options.host;
  auto port = options.port;
  auto tls = options.tls;
  d.linger = options.linger;
  if (!tls && options.secret.empty())
    throw error{errc::invalid_argument, "node: a gateway needs a secret or TLS"};
  std::shared_ptr<ssl_ctx_st> tls_context;
  if (tls) {
    try {
      tls_context = make_tls_context(tls_role::server, tls->certificate, tls->key, tls->ca);
    } catch (const error& e) {
      throw error{errc::worker_error, "node: " + std::string{e.what()}};
    }
    // BASP's connections go through Asio's streams, which take a reference of their own.
    SSL_CTX_up_ref(tls_context.get());
    d.tls = std::make_unique<asio::ssl::context>(tls_context.get());
  }
  d.settings = std::make_shared<const relay_settings>(relay_settings{
    std::move(options), std::move(connect), std::move(link), std::move(log), tls_context});
  auto where = host + ":" + std::to_string(port);
  try {
    tcp::resolver resolver{d.io};
    auto found = resolver.resolve(host, std::to_string(port), tcp::resolver::passive);
    std::string why = "no address";
    for (auto& entry : found) {
      boost::system::error_code ec;
      d.acceptor.open(entry.endpoint().protocol(), ec);
      if (!ec)
        d.acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
      if (!ec)
        d.acceptor.bind(entry.endpoint(), ec);
      if (!ec)
        d.acceptor.listen(asio::socket_base::max_listen_connections, ec);
      if (!ec)
        break;
      why = ec.message();
      boost::system::error_code ignored;
      d.acceptor.close(ignored);
    }
    if (!d.acceptor.is_open())
      throw error{errc::worker_error, "node: cannot listen on " + where + ": " + why};
  } catch (const boost::system::system_error& e) {
    throw error{errc::worker_error, "node: cannot resolve '" + host + "': " + e.what()};
  }
  if (d.settings->link)
    d.listen_locally();
  d.accept(d.acceptor);
  if (d.local_acceptor.is_open())
    d.accept(d.local_acceptor);
  d.thread = std::thread{[&d] { d.run(); }};
}

frame_gateway::~frame_gateway() {
  stop();
}

const std::string& frame_gateway::local_address() const {
  return impl_->local_address;
}

uint16_t frame_gateway::port() const {
  boost::system::error_code ec;
  return impl_->acceptor.local_endpoint(ec).port();
}

void frame_gateway::stop() {
  auto& d = *impl_;
  if (d.stopped)
    return;
  d.stopped = true;
  asio::post(d.io, [&d] {
    boost::system::error_code ec;
    d.acceptor.close(ec);
    d.local_acceptor.close(ec);
    for (auto& weak : d.relays)
      if (auto r = weak.lock())
        r->close();
    d.io.stop();
  });
  if (d.thread.joinable())
    d.thread.join();
}

} // namespace troupe
