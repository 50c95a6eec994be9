#include "actors/remoting.hpp"

#include <caf/timespan.hpp>

namespace troupe {

void configure_heartbeats(caf::actor_system_config& cfg, timeout_type timeout) {
  auto span = std::chrono::duration_cast<caf::timespan>(timeout);
  cfg.set("middleman.heartbeat-interval", span / 4);
  cfg.set("middleman.connection-timeout", span);
}

} // namespace troupe
