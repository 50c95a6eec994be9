#include "actors/node_auth.hpp"

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
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &size)
      == nullptr)
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

} // namespace troupe
