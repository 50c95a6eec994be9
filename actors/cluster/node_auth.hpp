#pragma once

#include <string>

namespace troupe {

/// The fewest bytes a shared secret may have.
constexpr size_t min_secret_bytes = 16;

/// Throws `invalid_argument` naming `what` unless `secret` has at least `min_secret_bytes`:
/// anyone who overhears one handshake can try candidate secrets against it offline, so a
/// short one would soon be found.
void check_secret(const std::string& secret, const std::string& what);

/// A fresh random challenge (64 hex digits).
std::string random_challenge();

/// What proves knowledge of `secret` for `challenge` issued to `peer`: hex HMAC-SHA256 of
/// "challenge|peer" keyed with the secret. Binding the peer's node id means a proof
/// overheard on the wire is worth nothing to another node.
std::string secret_proof(const std::string& secret, const std::string& challenge,
                         const std::string& peer);

/// Compares two proofs in time independent of where they differ.
bool same_proof(const std::string& a, const std::string& b);

// -- the connection handshake -----------------------------------------------------------
//
// A node with a secret (and no TLS) proves nothing to CAF until a connection has proved the
// secret to it: its gateway speaks first, before any BASP byte, and relays the connection
// to the middleman only when the peer's proof is right. The peer checks the node's proof
// too, so both sides know the other holds the secret.
//
//   node -> peer: greeting  "trp1" + 4 zero bytes + node challenge (64 hex) + "\n"
//   peer -> node: answer    peer challenge (64 hex) + " " + peer proof (64 hex) + "\n"
//                           (a call link, `actors/cluster/link_socket.hpp`: "+" and the link proof)
//   node -> peer: verdict   "ok " + node proof (64 hex) + "\n", or "no " + reason + "\n"

/// Bytes of the greeting and of the answer. A BASP client that reads the greeting as a
/// frame header finds an unknown operation and a payload length of 0, so it allocates
/// nothing and drops the connection.
constexpr size_t greeting_size = 8 + 64 + 1;
constexpr size_t answer_size = 64 + 1 + 64 + 1;
/// The longest verdict a peer reads.
constexpr size_t max_verdict_size = 256;

/// The greeting carrying `challenge`.
std::string connection_greeting(const std::string& challenge);

/// The node's challenge in `greeting`, or empty when it is not a greeting.
std::string challenge_of_greeting(const std::string& greeting);

/// What proves the secret for a connection: the peer's proof binds both challenges, and so
/// does the node's, with the roles apart so neither can be replayed as the other.
std::string peer_proof(const std::string& secret, const std::string& node_challenge,
                       const std::string& peer_challenge);
/// The peer's proof for a call link: bound to the kind, so that a BASP connection's proof
/// does not open a link, nor a link's a BASP connection.
std::string link_proof(const std::string& secret, const std::string& node_challenge,
                       const std::string& peer_challenge);
std::string node_proof(const std::string& secret, const std::string& node_challenge,
                       const std::string& peer_challenge);

} // namespace troupe
