#pragma once

#include <spdlog/logger.h>

#include <memory>
#include <string>

namespace troupe {

/// The named spdlog logger (`troupe.executor`, `troupe.worker`, ...), writing to stderr.
/// Created on first use; levels come from the `SPDLOG_LEVEL` environment variable
/// (e.g. `SPDLOG_LEVEL=info,troupe.worker=debug`), `info` by default.
std::shared_ptr<spdlog::logger> get_logger(const std::string& name);

} // namespace troupe
