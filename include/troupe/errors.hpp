#pragma once

/// @file
/// Error codes of troupe and the exception the blocking facade throws.

#include <caf/error.hpp>
#include <caf/actor_system_config.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace troupe {

/// What went wrong. Inside the actor system these travel as `caf::error` values with the
/// category `"troupe"`; the facade turns them into `troupe::error` exceptions.
enum class errc : uint8_t {
  /// No error (never raised; keeps the zero value free as CAF requires).
  none = 0,
  /// A call did not complete before its deadline.
  timeout,
  /// The named method is not registered on the worker.
  unknown_method,
  /// The worker raised an error while running a method; the context names the rank.
  worker_error,
  /// A worker actor went down; the context names the rank and the reason. The executor
  /// refuses every later call with this error.
  worker_died,
  /// `execute_model` was called while a memory tag sleeps.
  sleeping,
  /// An argument was out of range or malformed (lora id <= 0, unknown sleep level, ...).
  invalid_argument,
  /// A callable was aimed at a worker in another process; callables never cross the network.
  remote_callable,
  /// Workers returned different answers where they must agree (LoRA sets, adapters).
  inconsistent_workers,
  /// The executor was shut down.
  shut_down,
  /// The worker does not implement the requested capability.
  unsupported,
  /// Arguments had the wrong types for the method.
  bad_arguments,
  /// A memory operation of the device (reserve, release, restore) failed.
  memory_error,
  /// A worker died during the call and the executor is replacing it
  /// (`executor_config::restart`): the call's work is lost (a step's tokens and KV cache),
  /// and calls made after it wait for the replacement.
  worker_replaced,
};

/// Name of an error code, e.g. `"timeout"`.
const char* to_string(errc code);

/// Renders a `caf::error` of any category as one readable line.
std::string render(const caf::error& err);

/// Registers the `"troupe"` error category with an actor system config so that the system
/// renders troupe errors by name. Every process that renders errors calls this.
void register_error_category(caf::actor_system_config& cfg);

/// The exception thrown by the blocking facade. `code()` says what went wrong; `what()`
/// carries the full context (rank, method, reason).
class error : public std::runtime_error {
public:
  /// Builds an exception from a code and a message.
  error(errc code, const std::string& what);

  /// Builds an exception from an error value of the actor system. Errors of other
  /// categories (CAF's own) map to the closest troupe code.
  static error from(const caf::error& err);

  /// The error code.
  errc code() const noexcept {
    return code_;
  }

private:
  errc code_;
};

/// Thrown by a worker that cannot go on (its device is lost, its state is corrupt): its
/// actor stops with this error instead of answering, so the executor treats it as the
/// worker's death (fails the executor, or replaces the worker under a restart policy).
class worker_fault : public error {
public:
  explicit worker_fault(const std::string& what) : error(errc::worker_died, what) {}
};

/// Converts a CAF error of any category to the closest troupe code (`request_timeout` →
/// `timeout`, `request_receiver_down` → `worker_died`, ...).
errc to_errc(const caf::error& err);

} // namespace troupe

CAF_ERROR_CODE_ENUM(troupe::errc, "troupe")
