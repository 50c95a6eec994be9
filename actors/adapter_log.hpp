#pragma once

/// @file
/// What a replacement must repeat to hold the adapters the others hold: the adapter calls
/// (add, pin) every worker accepted, in order, less those a removal undid; and, once they
/// are replayed, the reconciliation of a call that was in flight at the death.

#include "actors/gather_table.hpp"
#include "actors/recovery.hpp"
#include "messages/worker_calls.hpp"
#include "troupe/types.hpp"

#include <spdlog/logger.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace troupe {

class adapter_log {
public:
  /// Replays and reconciliations are gathers of `gathers` on `ranks` (all of them), each
  /// bounded by `timeout`.
  adapter_log(gather_table& gathers, std::vector<int32_t> ranks, timeout_type timeout,
              std::shared_ptr<spdlog::logger> log);

  /// Every worker accepted `call`.
  void note(const adapter_request& call);
  void note(const adapter_change& call);

  /// Appends the steps that bring the fresh worker of `rank` to the adapters the others
  /// hold: the log replayed on it, then each kind reconciled on all ranks.
  void catch_up(int32_t rank, std::vector<step_fn>& steps);

private:
  /// An add or a pin, as the replacement is asked it.
  struct entry {
    std::string method;
    ask_fn ask;
    adapter_kind kind;
    int64_t id = 0;
  };

  /// Keeps `method` on adapter `id` (`ask`, once: a later one replaces it).
  void keep(std::string method, ask_fn ask, adapter_kind kind, int64_t id);

  /// An adapter call of `kind` in flight at the death may have reached some ranks and not
  /// others. Its caller was told `worker_replaced` (its work may be lost), so every rank
  /// keeps just the adapters all of them hold, and the log forgets the others.
  void reconcile(adapter_kind kind, std::function<void(caf::error)> next);
  void forget(adapter_kind kind, int64_t id);

  gather_table& gathers_;
  std::vector<int32_t> ranks_;
  timeout_type timeout_;
  std::shared_ptr<spdlog::logger> log_;
  std::vector<entry> entries_;
};

} // namespace troupe
