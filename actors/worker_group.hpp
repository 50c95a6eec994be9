#pragma once

/// @file
/// The workers as one tensor-parallel group: each rank's init context, the init of every
/// worker (device, model, rank, the driver's peers), the check that all loaded the same
/// model, and the collective formed among them; a replacement is started and the
/// collective formed again the same way.

#include "actors/gather_table.hpp"
#include "messages/messages.hpp"
#include "troupe/config.hpp"

#include <caf/actor.hpp>
#include <caf/expected.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace troupe {

/// What the group needs to know of the supervisor.
class group_host {
public:
  virtual ~group_host() = default;

  /// The members' handles in rank order (the workers themselves, which peers resolve).
  virtual worker_handles members() const = 0;

  /// The driver's peers (ranks 1..) as its steps reach them.
  virtual worker_handles driver_peers() const = 0;

  /// Whether `rank`'s worker is of this process.
  virtual bool in_process(size_t rank) const = 0;

  /// Where the worker that answered `info` runs, for messages.
  virtual std::string where(const worker_info& info) const = 0;
};

class worker_group {
public:
  /// The group of `ranks` (all of them, in order); its calls are gathers of `gathers`
  /// bounded by `cfg.startup_timeout`.
  worker_group(gather_table& gathers, group_host& host, const executor_config& cfg,
               std::vector<int32_t> ranks);

  /// Makes each rank's init context, starts every worker, checks that they loaded one
  /// model, then forms the collective; `done` gets the workers' descriptions in rank order.
  void start(std::function<void(caf::expected<std::vector<worker_info>>)> done);

  /// Whether `start` made the contexts (a worker that died before cannot be replaced).
  bool started() const {
    return contexts_.size() == ranks_.size();
  }

  /// The init request of `rank` (the driver's with its peers).
  ask_fn init_request(int32_t rank) const;

  /// Forms the tensor-parallel group: each rank learns the members (whose deaths abort its
  /// collective) and prepares its side, then every rank connects with the table of all
  /// (skipped when no rank needs one, and for a single worker).
  void form(std::function<void(caf::error)> then);

private:
  void connect(std::function<void(caf::error)> then);
  /// An `inconsistent_workers` error when two ranks loaded different models (one host has
  /// another version of the files at the same path): they would compute garbage together.
  caf::error different_models(const std::vector<worker_info>& infos) const;

  gather_table& gathers_;
  group_host& host_;
  const executor_config& cfg_;
  std::vector<int32_t> ranks_;
  std::vector<worker_context> contexts_;
};

} // namespace troupe
