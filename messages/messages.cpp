#include "messages/protocols.hpp"

#include "troupe/errors.hpp"

#include <caf/actor_system_config.hpp>

namespace troupe {

void register_messages(caf::actor_system_config& cfg) {
  cfg.add_message_types<caf::id_block::troupe>();
  register_error_category(cfg);
}

} // namespace troupe
