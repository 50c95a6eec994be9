#pragma once

#include <string>

namespace troupe {

/// A fresh random challenge (64 hex digits).
std::string random_challenge();

/// What proves knowledge of `secret` for `challenge` issued to `peer`: hex HMAC-SHA256 of
/// "challenge|peer" keyed with the secret. Binding the peer's node id means a proof
/// overheard on the wire is worth nothing to another node.
std::string secret_proof(const std::string& secret, const std::string& challenge,
                         const std::string& peer);

/// Compares two proofs in time independent of where they differ.
bool same_proof(const std::string& a, const std::string& b);

} // namespace troupe
