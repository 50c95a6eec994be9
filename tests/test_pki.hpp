#pragma once

// Certificates for the tests of mutual TLS.

#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

#include <unistd.h>

namespace troupe::testing {

/// A CA and certificates it signed ("node", "executor"), made with the openssl command in a
/// scratch directory; and "stranger", signed by a second CA that the first does not vouch
/// for.
struct test_pki {
  std::string dir = "/tmp/troupe-pki-" + std::to_string(getpid());

  test_pki() {
    auto script = "set -e; mkdir -p " + dir + "; cd " + dir + R"(;
      make_ca() { openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=$1" \
                    -keyout $1.key -out $1.pem 2>/dev/null; }
      make_cert() { openssl req -newkey rsa:2048 -nodes -subj "/CN=$1" -keyout $1.key \
                      -out $1.csr 2>/dev/null;
                    openssl x509 -req -in $1.csr -CA $2.pem -CAkey $2.key -CAcreateserial \
                      -days 2 -out $1.pem 2>/dev/null; }
      make_ca ca; make_ca other-ca
      make_cert node ca; make_cert executor ca; make_cert stranger other-ca)";
    REQUIRE(std::system(("bash -c '" + script + "'").c_str()) == 0);
  }
  ~test_pki() {
    std::system(("rm -rf " + dir).c_str());
  }
  test_pki(const test_pki&) = delete;
  test_pki& operator=(const test_pki&) = delete;

  std::string pem(const std::string& name) const {
    return dir + "/" + name + ".pem";
  }
  std::string key(const std::string& name) const {
    return dir + "/" + name + ".key";
  }
};

} // namespace troupe::testing
