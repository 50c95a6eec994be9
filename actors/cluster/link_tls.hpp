#pragma once

/// @file
/// TLS for call links (`actors/cluster/link_socket.hpp`) under mutual TLS: OpenSSL driven through
/// memory buffers, so that the link's own code moves the bytes and keeps its waits, its
/// bounds and its threads. Both ends prove a certificate of the CA, as the node's BASP
/// connections do, and the link then presents the lease's token as it does after the
/// secret's handshake.
///
/// A link under TLS starts with `tls_link_preamble`, in the clear, before its ClientHello:
/// that is how the node's gateway tells it from a BASP connection, whose first byte is a
/// TLS record's (0x16).

#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <sys/types.h>

struct ssl_ctx_st;
struct ssl_st;

namespace troupe {

/// The first bytes of a call link under TLS, in the clear.
inline constexpr char tls_link_preamble[] = "troupe-link/tls\n";
inline constexpr size_t tls_link_preamble_size = sizeof tls_link_preamble - 1;

/// The first byte of a TLS connection (a handshake record).
inline constexpr unsigned char tls_handshake_record = 0x16;

/// Which end of the handshake.
enum class tls_role { client, server };

/// An OpenSSL context with this side's certificate chain and key that requires the peer's
/// certificate and verifies it against `ca` (TLS 1.2 at least, the ciphers caf-openssl's
/// peers offer). Throws `troupe::error` (`invalid_argument`) naming the file that could not
/// be loaded.
std::shared_ptr<ssl_ctx_st> make_tls_context(tls_role role, const std::string& certificate,
                                             const std::string& key, const std::string& ca);

/// One TLS session over buffers: ciphertext goes in with `give` and plaintext comes out of
/// `open`; plaintext goes in with `seal` and comes out as records. One thread may read while
/// others write: the calls take turns on the session. Sessions of call links speak TLS 1.3
/// only (both ends are troupe's), with no session tickets.
class tls_session {
public:
  tls_session(const std::shared_ptr<ssl_ctx_st>& context, tls_role role);
  ~tls_session();

  tls_session(const tls_session&) = delete;
  tls_session& operator=(const tls_session&) = delete;

  enum class progress { done, more, failed };

  /// Advances the handshake with what was given; appends what it has to send to `out`
  /// (send it also when the answer is `done` or `failed`: the last flight, or an alert).
  /// `more`: give it the peer's next bytes. `failed`: `why` says why.
  progress handshake(std::vector<char>& out);

  /// The peer's ciphertext.
  void give(const char* data, size_t size);

  /// Encrypts `size` bytes of `data` and appends the records to `out`; false when the
  /// session is broken.
  bool seal(const char* data, size_t size, std::vector<char>& out);

  /// Decrypts into `data`, at most `size` bytes: how many came; 0 when the peer ended the
  /// session; -1 with `errno` EAGAIN when it needs more ciphertext, EPROTO when the stream
  /// is broken (`why` says how; every later call says the same).
  ssize_t open(char* data, size_t size);

  /// Whether plaintext can be had without more ciphertext: decrypted and not yet taken, or
  /// a whole record given.
  bool ready() const;

  /// Ciphertext given and not yet decrypted, and plaintext not yet taken, in bytes.
  size_t held() const;

  /// Why the handshake or the stream failed.
  std::string why() const;

private:
  /// Under `mtx_`: what OpenSSL said of its last call `result`.
  std::string explain(int result);

  mutable std::mutex mtx_;
  ssl_st* ssl_ = nullptr;
  /// Owned by `ssl_`.
  void* in_ = nullptr;
  void* out_ = nullptr;
  /// The last `open` found the ciphertext short of a record, and none came since.
  bool starved_ = false;
  /// A read or write failed: every later one fails the same way.
  bool broken_ = false;
  std::string why_;
};

/// The client's side of the handshake on `fd` (connected, non-blocking) before `deadline`,
/// after the preamble. Throws `troupe::error`: `worker_died` when the peer does not answer
/// in time or closes, `invalid_argument` when a certificate is refused (the message names
/// `where` and says which).
std::unique_ptr<tls_session> tls_connect(int fd, const std::shared_ptr<ssl_ctx_st>& context,
                                         const std::string& where,
                                         std::chrono::steady_clock::time_point deadline);

} // namespace troupe
