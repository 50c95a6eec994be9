#include "troupe/errors.hpp"

#include <caf/atom.hpp>
#include <caf/message.hpp>
#include <caf/sec.hpp>

namespace troupe {

namespace {

constexpr caf::atom_value troupe_category = caf::atom("troupe");

// The context of troupe errors is a single string; CAF's own errors carry other things.
std::string context_of(const caf::message& ctx) {
  if (ctx.empty())
    return {};
  if (ctx.size() == 1 && ctx.match_element<std::string>(0))
    return ctx.get_as<std::string>(0);
  return to_string(ctx);
}

} // namespace

const char* to_string(errc code) {
  switch (code) {
  case errc::none:
    return "none";
  case errc::timeout:
    return "timeout";
  case errc::unknown_method:
    return "unknown_method";
  case errc::worker_error:
    return "worker_error";
  case errc::worker_died:
    return "worker_died";
  case errc::sleeping:
    return "sleeping";
  case errc::invalid_argument:
    return "invalid_argument";
  case errc::remote_callable:
    return "remote_callable";
  case errc::inconsistent_workers:
    return "inconsistent_workers";
  case errc::shut_down:
    return "shut_down";
  case errc::unsupported:
    return "unsupported";
  case errc::bad_arguments:
    return "bad_arguments";
  case errc::memory_error:
    return "memory_error";
  case errc::worker_replaced:
    return "worker_replaced";
  }
  return "unknown";
}

std::string render(const caf::error& err) {
  if (!err)
    return "no error";
  std::string result;
  if (err.category() == troupe_category)
    result = to_string(static_cast<errc>(err.code()));
  else if (err.category() == caf::atom("system"))
    result = "caf: " + to_string(static_cast<caf::sec>(err.code()));
  else if (err.category() == caf::atom("exit"))
    result = "exit: " + to_string(static_cast<caf::exit_reason>(err.code()));
  else
    result = to_string(err.category()) + ": " + std::to_string(err.code());
  auto ctx = context_of(err.context());
  if (!ctx.empty())
    result += ": " + ctx;
  return result;
}

void register_error_category(caf::actor_system_config& cfg) {
  cfg.add_error_category(troupe_category,
                         [](uint8_t code, caf::atom_value, const caf::message& ctx) {
                           std::string result = "troupe: ";
                           result += to_string(static_cast<errc>(code));
                           auto text = context_of(ctx);
                           if (!text.empty())
                             result += ": " + text;
                           return result;
                         });
}

errc to_errc(const caf::error& err) {
  if (!err)
    return errc::none;
  if (err.category() == troupe_category)
    return static_cast<errc>(err.code());
  if (err.category() == caf::atom("system")) {
    switch (static_cast<caf::sec>(err.code())) {
    case caf::sec::request_timeout:
      return errc::timeout;
    case caf::sec::request_receiver_down:
    case caf::sec::remote_linking_failed:
    case caf::sec::no_route_to_receiving_node:
      return errc::worker_died;
    case caf::sec::unexpected_message:
      return errc::bad_arguments;
    default:
      break;
    }
  }
  return errc::worker_error;
}

error::error(errc code, const std::string& what) : std::runtime_error(what), code_(code) {
  // nop
}

error error::from(const caf::error& err) {
  return error{to_errc(err), render(err)};
}

} // namespace troupe
