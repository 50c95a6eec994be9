#include "actors/teardown.hpp"

#include <future>
#include <thread>

namespace troupe {

bool destroy_within(std::unique_ptr<caf::actor_system>& sys,
                    std::unique_ptr<caf::actor_system_config>& cfg,
                    std::chrono::milliseconds wait) {
  auto done = std::make_shared<std::promise<void>>();
  auto finished = done->get_future();
  std::thread reaper{[done, sys = std::move(sys), cfg = std::move(cfg)]() mutable {
    sys.reset();
    cfg.reset();
    done->set_value();
  }};
  if (finished.wait_for(wait) == std::future_status::ready) {
    reaper.join();
    return true;
  }
  reaper.detach();
  return false;
}

} // namespace troupe
