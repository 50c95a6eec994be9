#pragma once

/// @file
/// Hands a call to the supervisor from the calling thread (`hand_to_supervisor`).

#include "messages/messages.hpp"
#include "messages/protocols.hpp"

#include <caf/actor_system.hpp>

namespace troupe {

/// Hands `call` to the supervisor. When the supervisor is idle, the calling thread runs it
/// (up to a few messages) instead of waking a scheduler thread for it: the caller would
/// only wait meanwhile, and on a small machine each thread wake-up is the largest cost of
/// a call. A supervisor that is busy gets the call in its mailbox, as any message.
void hand_to_supervisor(caf::actor_system& sys, const supervisor_actor& supervisor,
                        async_call call);

} // namespace troupe
