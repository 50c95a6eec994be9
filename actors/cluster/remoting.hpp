#pragma once

#include "troupe/config.hpp"

#include <caf/actor_system_config.hpp>

#include <chrono>
#include <string>

namespace troupe {

/// The scheduler of an actor system whose workers compute on their own threads: `threads`
/// threads (0: CAF's default, one per core) that poll `poll_attempts` times (0: CAF's 100)
/// when idle, then wait on their condition variable until the next message. CAF's own
/// default puts a phase between the two, 500 polls 50 µs apart: on a small machine those
/// wake-ups (tens of thousands a second) take cores from the kernels of CPU workers and
/// stall their collectives (SmolLM2 decode 76 -> 132 tok/s on 2 cores without it).
void configure_scheduler(caf::actor_system_config& cfg, size_t threads, size_t poll_attempts);

/// Loads the middleman: BASP heartbeats every quarter of `timeout`, connections silent
/// for `timeout` dropped (so that a peer that is cut off or stopped is noticed), messages
/// from the network delivered by the middleman's own thread, and that thread polling its
/// sockets for `linger` after each event before it sleeps in `epoll_wait`
/// (`cluster_config::network_linger`, `node_config::network_linger`; 0: it sleeps at once, as
/// CAF's does).
void load_middleman(caf::actor_system_config& cfg, timeout_type timeout, timeout_type linger);

/// Whether TLS is asked for: false when all three files are empty, true when all three are
/// given; throws `invalid_argument` for part of them.
bool wants_tls(const std::string& certificate, const std::string& key, const std::string& ca);

/// Why the connection to a peer at `host`:`port` (a node or a worker host) was lost, found
/// by connecting to it again for at most about half a second: its process has exited
/// (the port refuses), it is stopped or hung (it accepts but says nothing: the heartbeat
/// timeout), it is up and closed the connection itself, or it cannot be reached at all.
/// `tls`: the peer speaks TLS, so it never speaks first and the last two look alike.
std::string why_connection_lost(const std::string& host, uint16_t port, bool tls);

/// Waits for `events` on `fd` until `deadline`; false when it passed.
bool poll_until(int fd, short events, std::chrono::steady_clock::time_point deadline);

/// Sends all `size` bytes of `data` on `fd` (non-blocking) before `deadline`. Throws
/// `worker_died`: the node at `where` takes nothing in time, or the connection broke
/// `during` (what was under way, for the message).
void send_before(int fd, const char* data, size_t size, const std::string& where,
                 const std::string& during, std::chrono::steady_clock::time_point deadline);

/// Connects to `host`:`port` before `deadline`: a non-blocking TCP socket, with no delay
/// on small writes, that has proved nothing yet. Throws `worker_died` naming the node when
/// it cannot.
int connect_node(const std::string& host, uint16_t port,
                 std::chrono::steady_clock::time_point deadline);

/// Connects to `address` ("@name", a name in the abstract Unix namespace) before
/// `deadline`, as `connect_node`; `invalid_argument` when it is no such name.
int connect_local(const std::string& address, std::chrono::steady_clock::time_point deadline);

/// Connects to the node at `host`:`port` and goes through its connection handshake
/// (`actors/cluster/node_auth.hpp`), both sides proving `secret`, before `deadline`. Returns the
/// connected socket, ready for BASP. Throws `troupe::error`: `worker_died` when the node
/// cannot be reached or does not answer in time, `invalid_argument` naming what failed
/// when it refuses the proof (wrong secret), does not prove the secret itself, or does not
/// speak the handshake (not a node, or one that wants TLS). `link`: the connection is a
/// call link (`actors/cluster/link_socket.hpp`) rather than one for BASP.
int dial_node(const std::string& host, uint16_t port, const std::string& secret,
              std::chrono::steady_clock::time_point deadline, bool link = false);

/// Connects to a node's call-link socket on this host, `address` ("@name", a name in the
/// abstract Unix namespace that the node gave with its lease), and goes through the same
/// handshake as `dial_node` with `link`. Throws as `dial_node`; `worker_died` when nothing
/// listens at `address` (the node is on another host, or in another network namespace).
int dial_local_link(const std::string& address, const std::string& secret,
                    std::chrono::steady_clock::time_point deadline);

/// Loads caf-openssl with the certificate, key and CA (the middleman must be loaded).
void configure_tls(caf::actor_system_config& cfg, const std::string& certificate,
                   const std::string& key, const std::string& ca);

} // namespace troupe
