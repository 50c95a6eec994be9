#include "actors/remoting.hpp"

#include "troupe/errors.hpp"

#include <caf/openssl/manager.hpp>
#include <caf/timespan.hpp>

#include <filesystem>

namespace troupe {

void configure_heartbeats(caf::actor_system_config& cfg, timeout_type timeout) {
  auto span = std::chrono::duration_cast<caf::timespan>(timeout);
  cfg.set("middleman.heartbeat-interval", span / 4);
  cfg.set("middleman.connection-timeout", span);
}

bool wants_tls(const std::string& certificate, const std::string& key, const std::string& ca) {
  auto given = !certificate.empty() + !key.empty() + !ca.empty();
  if (given == 0)
    return false;
  if (given != 3)
    throw error{errc::invalid_argument, "TLS needs a certificate, a key and a CA file"};
  for (auto& file : {certificate, key, ca})
    if (!std::filesystem::is_regular_file(file))
      throw error{errc::invalid_argument, "TLS: no file '" + file + "'"};
  return true;
}

void configure_tls(caf::actor_system_config& cfg, const std::string& certificate,
                   const std::string& key, const std::string& ca) {
  cfg.openssl_certificate = certificate;
  cfg.openssl_key = key;
  cfg.openssl_cafile = ca;
  cfg.load<caf::openssl::manager>();
}

} // namespace troupe
