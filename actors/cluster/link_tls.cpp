#include "actors/cluster/link_tls.hpp"

#include "actors/cluster/remoting.hpp"
#include "troupe/errors.hpp"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include <poll.h>
#include <sys/socket.h>

namespace troupe {

namespace {

/// OpenSSL's oldest queued error, as text; empty when none.
std::string queued_error() {
  auto code = ERR_get_error();
  if (code == 0)
    return {};
  char text[256];
  ERR_error_string_n(code, text, sizeof text);
  return text;
}

BIO* as_bio(void* p) {
  return static_cast<BIO*>(p);
}

/// Appends what `bio` holds to `out`.
void drain(BIO* bio, std::vector<char>& out) {
  auto pending = BIO_ctrl_pending(bio);
  if (pending == 0)
    return;
  auto at = out.size();
  out.resize(at + pending);
  auto n = BIO_read(bio, out.data() + at, static_cast<int>(pending));
  out.resize(at + static_cast<size_t>(std::max(n, 0)));
}

} // namespace

std::shared_ptr<ssl_ctx_st> make_tls_context(tls_role role, const std::string& certificate,
                                             const std::string& key, const std::string& ca) {
  ERR_clear_error();
  std::shared_ptr<SSL_CTX> ctx{
    SSL_CTX_new(role == tls_role::client ? TLS_client_method() : TLS_server_method()),
    SSL_CTX_free};
  if (!ctx)
    throw error{errc::worker_error, "TLS: cannot make a context: " + queued_error()};
  auto refuse = [](const std::string& what, const std::string& file) {
    throw error{errc::invalid_argument,
                "TLS: cannot load " + what + " '" + file + "': " + queued_error()};
  };
  SSL_CTX_set_options(ctx.get(), SSL_OP_ALL);
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), certificate.c_str()) != 1)
    refuse("the certificate", certificate);
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), key.c_str(), SSL_FILETYPE_PEM) != 1)
    refuse("the key", key);
  if (SSL_CTX_check_private_key(ctx.get()) != 1)
    throw error{errc::invalid_argument,
                "TLS: the key '" + key + "' is not that of the certificate '" + certificate + "'"};
  if (SSL_CTX_load_verify_locations(ctx.get(), ca.c_str(), nullptr) != 1)
    refuse("the CA", ca);
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  // What caf-openssl's peers offer when certificates are in use.
  if (SSL_CTX_set_cipher_list(ctx.get(), "HIGH:!aNULL:!MD5") != 1)
    throw error{errc::worker_error, "TLS: no usable cipher"};
  return ctx;
}

tls_session::tls_session(const std::shared_ptr<ssl_ctx_st>& context, tls_role role) {
  ERR_clear_error();
  ssl_ = SSL_new(context.get());
  if (!ssl_)
    throw error{errc::worker_error, "TLS: cannot make a session: " + queued_error()};
  auto* in = BIO_new(BIO_s_mem());
  auto* out = BIO_new(BIO_s_mem());
  if (!in || !out) {
    BIO_free(in);
    BIO_free(out);
    SSL_free(ssl_);
    throw error{errc::worker_error, "TLS: cannot make a session's buffers"};
  }
  // Empty buffers mean "more to come", not the end of the stream.
  BIO_set_mem_eof_return(in, -1);
  BIO_set_mem_eof_return(out, -1);
  SSL_set_bio(ssl_, in, out);
  in_ = in;
  out_ = out;
  // Both ends are troupe's: the newest version, and nothing after the handshake that a
  // reader would have to answer (tickets, renegotiation).
  SSL_set_min_proto_version(ssl_, TLS1_3_VERSION);
  SSL_set_num_tickets(ssl_, 0);
  if (role == tls_role::client)
    SSL_set_connect_state(ssl_);
  else
    SSL_set_accept_state(ssl_);
}

tls_session::~tls_session() {
  SSL_free(ssl_);
}

std::string tls_session::explain(int result) {
  auto kind = SSL_get_error(ssl_, result);
  std::string what = queued_error();
  auto verified = SSL_get_verify_result(ssl_);
  if (verified != X509_V_OK)
    what += std::string{what.empty() ? "" : ": "} +
            "the peer's certificate: " + X509_verify_cert_error_string(verified);
  if (what.empty())
    what = kind == SSL_ERROR_SYSCALL ? "the stream ended" : "error " + std::to_string(kind);
  return what;
}

tls_session::progress tls_session::handshake(std::vector<char>& out) {
  std::lock_guard<std::mutex> lk{mtx_};
  ERR_clear_error();
  auto r = SSL_do_handshake(ssl_);
  std::string why = r == 1 ? "" : explain(r);
  auto kind = r == 1 ? SSL_ERROR_NONE : SSL_get_error(ssl_, r);
  drain(as_bio(out_), out);
  if (r == 1)
    return progress::done;
  if (kind == SSL_ERROR_WANT_READ)
    return progress::more;
  why_ = std::move(why);
  return progress::failed;
}

void tls_session::give(const char* data, size_t size) {
  std::lock_guard<std::mutex> lk{mtx_};
  if (size > 0) {
    BIO_write(as_bio(in_), data, static_cast<int>(size));
    starved_ = false;
  }
}

bool tls_session::seal(const char* data, size_t size, std::vector<char>& out) {
  std::lock_guard<std::mutex> lk{mtx_};
  if (broken_)
    return false;
  ERR_clear_error();
  size_t done = 0;
  while (done < size) {
    auto part = static_cast<int>(std::min<size_t>(size - done, INT_MAX / 2));
    auto n = SSL_write(ssl_, data + done, part);
    if (n <= 0) {
      why_ = explain(n);
      broken_ = true;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  // Records a read made (none are expected after the handshake) go out first.
  drain(as_bio(out_), out);
  return true;
}

ssize_t tls_session::open(char* data, size_t size) {
  std::lock_guard<std::mutex> lk{mtx_};
  if (broken_) {
    errno = EPROTO;
    return -1;
  }
  ERR_clear_error();
  auto n = SSL_read(ssl_, data, static_cast<int>(std::min<size_t>(size, INT_MAX)));
  if (n > 0)
    return n;
  auto kind = SSL_get_error(ssl_, n);
  if (kind == SSL_ERROR_WANT_READ) {
    starved_ = true;
    errno = EAGAIN;
    return -1;
  }
  if (kind == SSL_ERROR_ZERO_RETURN)
    return 0;
  why_ = explain(n);
  broken_ = true;
  errno = EPROTO;
  return -1;
}

bool tls_session::ready() const {
  std::lock_guard<std::mutex> lk{mtx_};
  // Ciphertext that a read found short of a record is not ready until more comes; a broken
  // stream is, for the next read to say so.
  return broken_ || SSL_pending(ssl_) > 0 || (!starved_ && BIO_ctrl_pending(as_bio(in_)) > 0);
}

size_t tls_session::held() const {
  std::lock_guard<std::mutex> lk{mtx_};
  return BIO_ctrl_pending(as_bio(in_)) + static_cast<size_t>(std::max(SSL_pending(ssl_), 0));
}

std::string tls_session::why() const {
  std::lock_guard<std::mutex> lk{mtx_};
  return why_;
}

std::unique_ptr<tls_session> tls_connect(int fd, const std::shared_ptr<ssl_ctx_st>& context,
                                         const std::string& where,
                                         std::chrono::steady_clock::time_point deadline) {
  auto late = [&] {
    return error{errc::worker_died,
                 "cannot reach " + where + ": the TLS handshake did not end in time"};
  };
  auto send_all = [&](const char* data, size_t size) {
    send_before(fd, data, size, where, "the TLS handshake", deadline);
  };
  send_all(tls_link_preamble, tls_link_preamble_size);
  auto session = std::make_unique<tls_session>(context, tls_role::client);
  std::vector<char> out;
  char in[16 << 10];
  for (;;) {
    out.clear();
    auto step = session->handshake(out);
    send_all(out.data(), out.size());
    if (step == tls_session::progress::done)
      return session;
    if (step == tls_session::progress::failed)
      throw error{errc::invalid_argument,
                  where + ": the TLS handshake failed (" + session->why() + ")"};
    if (!poll_until(fd, POLLIN, deadline))
      throw late();
    auto n = recv(fd, in, sizeof in, 0);
    if (n > 0)
      session->give(in, static_cast<size_t>(n));
    else if (n == 0)
      throw error{errc::invalid_argument,
                  where + " closed the connection during the TLS handshake (it refused it, or "
                          "it does not speak TLS: give the node's secret instead)"};
    else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      throw error{errc::worker_died,
                  where + ": connection lost during the TLS handshake: " + std::strerror(errno)};
  }
}

} // namespace troupe
