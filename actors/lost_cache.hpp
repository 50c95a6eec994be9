#pragma once

/// @file
/// What the replacement of a worker takes from the steps: its KV cache, and the block
/// tables the ranks kept. The engine learns of the first from a step that fails with
/// `worker_replaced` (the one in flight, else the next), and computes its requests again;
/// steps made before the replacement, which send only the blocks added since, are refused
/// until one sends every table whole.

#include "messages/messages.hpp"

#include <caf/error.hpp>

#include <string>

namespace troupe {

class lost_cache {
public:
  /// A worker was replaced; `told`: a step in flight fails with it and tells the engine.
  void replaced(bool told) {
    untold_ = !told;
    tables_lost_ = true;
  }

  /// A step that fails for the replacement tells the engine.
  void told() {
    untold_ = false;
  }

  /// Why `req` may not run after a replacement (`cause` names it); none: it may.
  caf::error refusal(const execute_model_request& req, const std::string& cause);

private:
  bool untold_ = false;
  bool tables_lost_ = false;
};

} // namespace troupe
