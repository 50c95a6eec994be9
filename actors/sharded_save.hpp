#pragma once

/// @file
/// save_sharded_state, all or nothing: every rank writes its files aside (staged under a
/// token of this save); they are moved into place only once every rank has succeeded,
/// and removed otherwise.

#include "actors/gather_table.hpp"
#include "actors/recovery.hpp"
#include "messages/messages.hpp"

#include <spdlog/logger.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace troupe {

/// Saves `req` on `ranks`, each of the save's gathers bounded by `timeout`, staging under
/// `token` (random: executors that share a folder never mix their parts); `done` gets the
/// first error or none. A failed save is cleaned up rank by rank and answered once every
/// rank has removed its part: a rank that died fails its cleanup at once and must not cut
/// the others' short. The part of a rank whose cleanup failed is removed by its next
/// replacement (`recov`: same rank, same folder); the save waits for the replacement
/// under way, and does not for one that may never come (a rank not known to be dead, or
/// not yet).
void save_sharded(gather_table& gathers, recovery& recov, std::vector<int32_t> ranks,
                  timeout_type timeout, std::shared_ptr<spdlog::logger> log,
                  sharded_state_request req, std::string token,
                  std::function<void(caf::error)> done);

} // namespace troupe
