#pragma once

/// @file
/// The actor system of an executor and the actors it starts, from start-up, in order, to
/// shutdown: the workers of this process, those leased from nodes and those published on
/// their own, and the supervisor over them. The facade (actors/executor.cpp) makes its
/// calls through the supervisor.

#include "actors/supervisor.hpp"
#include "messages/protocols.hpp"
#include "troupe/config.hpp"

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>

#include <spdlog/logger.h>

#include <memory>
#include <vector>

namespace troupe {

class link_set;

/// Creating a scoped_actor leaves a reference to the system's logger in a thread-local of
/// the calling thread, and ~actor_system waits until every such reference is gone. Declared
/// before the scoped_actor, this drops the reference once the scoped_actor is destroyed, so
/// that host threads never keep the system from shutting down.
struct logger_release {
  logger_release() = default;
  logger_release(const logger_release&) = delete;
  logger_release& operator=(const logger_release&) = delete;
  ~logger_release() {
    caf::logger::set_current_actor_system(nullptr);
  }
};

class executor_system {
public:
  executor_system();
  ~executor_system();

  /// Starts, in order: the actor system; the workers of this process (made by `factory`),
  /// those leased from `cfg.cluster.nodes`, the published ones; the supervisor over them,
  /// which has yet to bring them up (`init_atom`). Throws what failed, with everything
  /// started so far stopped.
  void start(const executor_config& cfg, worker_factory factory);

  /// Stops every actor (the supervisor stops the workers; the nodes release theirs once
  /// the lease holder goes), waits up to `executor::shutdown_grace` for them, and destroys
  /// the system: an actor still busy then is abandoned, and so is a system that takes
  /// longer to stop. Does nothing before `start` or after a `stop`.
  void stop();

  caf::actor_system& system() {
    return *sys_;
  }

  /// Empty before `start` and after `stop`.
  const supervisor_actor& supervisor() const {
    return supervisor_;
  }

  /// The call links to the nodes, which a blocking caller reads while it waits.
  const std::shared_ptr<link_set>& links() const {
    return links_;
  }

  /// How long a blocking caller stays awake for its reply: `linger`, or `network_linger`
  /// when some workers are across a network, whose replies take longer.
  timeout_type caller_linger() const {
    return caller_linger_;
  }

private:
  void start_system(const executor_config& cfg);
  void lease_from_nodes(const executor_config& cfg, std::vector<worker_actor>& workers,
                        std::vector<worker_place>& places);
  void connect_remote_workers(const executor_config& cfg, std::vector<worker_actor>& workers,
                              std::vector<worker_place>& places);

  timeout_type caller_linger_{0};
  // On the heap: a system abandoned by shutdown keeps using its config.
  std::unique_ptr<caf::actor_system_config> sys_cfg_;
  std::unique_ptr<caf::actor_system> sys_;
  supervisor_actor supervisor_;
  /// Watched by the nodes that leased workers to this executor.
  caf::actor lease_holder_;
  std::vector<worker_actor> local_workers_;
  /// Workers leased from nodes, which release them when the lease holder goes.
  std::vector<worker_actor> leased_workers_;
  /// Workers the supervisor spawned or leased to replace dead ones.
  std::shared_ptr<replacement_list> replacements_;
  std::shared_ptr<link_set> links_;
  std::shared_ptr<spdlog::logger> log_;
};

} // namespace troupe
