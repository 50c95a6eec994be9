#include "kernels/log.hpp"

#include <spdlog/cfg/env.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <mutex>

namespace troupe {

std::shared_ptr<spdlog::logger> get_logger(const std::string& name) {
  static std::mutex mtx;
  std::lock_guard<std::mutex> guard{mtx};
  if (auto existing = spdlog::get(name))
    return existing;
  auto result = spdlog::stderr_color_mt(name);
  // Re-reading the environment applies its levels to the logger just registered.
  spdlog::cfg::load_env_levels();
  return result;
}

} // namespace troupe
