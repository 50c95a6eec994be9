#include "actors/cluster/node_auth.hpp"

#include "troupe/errors.hpp"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

namespace troupe {

namespace {

std::string hex(const unsigned char* data, size_t size) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < size; ++i) {
    out.push_back(digits[data[i] >> 4]);
    out.push_back(digits[data[i] & 15]);
  }
  return out;
}

} // namespace

void check_secret(const std::string& secret, const std::string& what) {
  if (secret.size() < min_secret_bytes)
    throw error{errc::invalid_argument,
                what + " has " + std::to_string(secret.size()) + " bytes; it needs at least " +
                  std::to_string(min_secret_bytes) +
                  " (a shorter one can be found by trying "
                  "candidates against one overheard handshake): e.g. head -c 32 /dev/urandom | "
                  "od -An -tx1 | tr -d ' \\n'"};
}

std::string random_challenge() {
  unsigned char bytes[32];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1)
    throw error{errc::worker_error, "RAND_bytes failed: no randomness for a challenge"};
  return hex(bytes, sizeof(bytes));
}

std::string secret_proof(const std::string& secret, const std::string& challenge,
                         const std::string& peer) {
  auto message = challenge + "|" + peer;
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac,
           &size) == nullptr)
    throw error{errc::worker_error, "HMAC-SHA256 failed"};
  return hex(mac, size);
}

bool same_proof(const std::string& a, const std::string& b) {
  if (a.size() != b.size())
    return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i)
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

namespace {

const std::string greeting_prefix{"trp1\0\0\0\0", 8};

} // namespace

std::string connection_greeting(const std::string& challenge) {
  return greeting_prefix + challenge + "\n";
}

std::string challenge_of_greeting(const std::string& greeting) {
  const auto& prefix = greeting_prefix;
  if (greeting.size() != greeting_size || greeting.compare(0, prefix.size(), prefix) != 0 ||
      greeting.back() != '\n')
    return {};
  return greeting.substr(prefix.size(), 64);
}

std::string peer_proof(const std::string& secret, const std::string& node_challenge,
                       const std::string& peer_challenge) {
  return secret_proof(secret, node_challenge, "peer:" + peer_challenge);
}

std::string link_proof(const std::string& secret, const std::string& node_challenge,
                       const std::string& peer_challenge) {
  return secret_proof(secret, node_challenge, "link:" + peer_challenge);
}

std::string node_proof(const std::string& secret, const std::string& node_challenge,
                       const std::string& peer_challenge) {
  return secret_proof(secret, peer_challenge, "node:" + node_challenge);
}

} // namespace troupe
