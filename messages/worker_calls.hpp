#pragma once

/// @file
/// The library's own requests to a worker, as values. Each is sent as `(call_atom, request)`
/// and answered `(ok_atom)` or `(ok_atom, reply)`, as `call_traits` says, so that a
/// request and the handling of its reply are checked where they are written. A user's
/// `collective_rpc` goes by method name (`call_atom, name, args, kwargs`); the workers'
/// named built-ins read their arguments and run the same code as these.

#include "troupe/types.hpp"

#include <caf/meta/type_name.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace troupe {

/// determine_num_available_blocks.
struct blocks_query {};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, blocks_query&) {
  return f(caf::meta::type_name("blocks_query"));
}

/// initialize_cache.
struct cache_init {
  cache_blocks blocks;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, cache_init& x) {
  return f(caf::meta::type_name("cache_init"), x.blocks);
}

/// check_health.
struct health_query {};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, health_query&) {
  return f(caf::meta::type_name("health_query"));
}

/// prepare_collective: the addresses the worker listens on for its group.
struct collective_prepare {};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, collective_prepare&) {
  return f(caf::meta::type_name("collective_prepare"));
}

/// connect_collective: every rank's addresses, in rank order.
struct collective_connect {
  std::vector<std::vector<std::string>> table;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, collective_connect& x) {
  return f(caf::meta::type_name("collective_connect"), x.table);
}

/// The first half of the executor's all-or-nothing save_sharded_state: the rank's shards
/// written into a hidden folder of `request.path` named after `staging`.
struct staged_save {
  sharded_state_request request;
  std::string staging;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, staged_save& x) {
  return f(caf::meta::type_name("staged_save"), x.request, x.staging);
}

/// The second half: the staged shards moved into `path` (`commit`) or removed.
struct staged_finish {
  std::string path;
  std::string staging;
  bool commit = false;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, staged_finish& x) {
  return f(caf::meta::type_name("staged_finish"), x.path, x.staging, x.commit);
}

/// An adapter to add, of either kind: a LoRA adapter (`lora_request`) or a prompt
/// adapter (`prompt_adapter_request`, with its virtual tokens).
struct adapter_request {
  adapter_kind kind = adapter_kind::lora;
  int64_t id = 0;
  std::string name;
  std::string path;
  /// A prompt adapter's; 0 for a LoRA adapter.
  int32_t num_virtual_tokens = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, adapter_request& x) {
  return f(caf::meta::type_name("adapter_request"), x.kind, x.id, x.name, x.path,
           x.num_virtual_tokens);
}

adapter_request to_adapter_request(const lora_request& r);
adapter_request to_adapter_request(const prompt_adapter_request& r);
lora_request to_lora_request(const adapter_request& r);
prompt_adapter_request to_prompt_adapter_request(const adapter_request& r);

/// What may be done to an adapter a worker holds.
enum class adapter_action : uint8_t {
  remove = 0,
  pin = 1,
};

/// remove_lora, pin_lora, remove_prompt_adapter, pin_prompt_adapter.
struct adapter_change {
  adapter_kind kind = adapter_kind::lora;
  adapter_action action = adapter_action::remove;
  int64_t id = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, adapter_change& x) {
  return f(caf::meta::type_name("adapter_change"), x.kind, x.action, x.id);
}

/// list_loras, list_prompt_adapters.
struct adapter_list {
  adapter_kind kind = adapter_kind::lora;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, adapter_list& x) {
  return f(caf::meta::type_name("adapter_list"), x.kind);
}

/// prompt_adapter_virtual_tokens.
struct adapter_tokens {
  int64_t id = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, adapter_tokens& x) {
  return f(caf::meta::type_name("adapter_tokens"), x.id);
}

/// The method a call stands for (profiles and errors name it), and the type of its
/// reply (`void`: `ok_atom` alone).
template <class Call>
struct call_traits;

#define TROUPE_WORKER_CALL(type, reply_type, name)                                                 \
  template <>                                                                                      \
  struct call_traits<type> {                                                                       \
    using reply = reply_type;                                                                      \
    static constexpr const char* method = name;                                                    \
  };

TROUPE_WORKER_CALL(blocks_query, cache_blocks, "determine_num_available_blocks")
TROUPE_WORKER_CALL(cache_init, void, "initialize_cache")
TROUPE_WORKER_CALL(health_query, worker_health, "check_health")
TROUPE_WORKER_CALL(collective_prepare, std::vector<std::string>, "prepare_collective")
TROUPE_WORKER_CALL(collective_connect, void, "connect_collective")
TROUPE_WORKER_CALL(sleep_request, void, "sleep")
TROUPE_WORKER_CALL(wake_request, void, "wake_up")
TROUPE_WORKER_CALL(staged_save, void, "save_sharded_state")
TROUPE_WORKER_CALL(staged_finish, void, "save_sharded_state")
// The adapter calls name their method by kind (`method_name` below).
TROUPE_WORKER_CALL(adapter_request, bool, "add_lora or add_prompt_adapter")
TROUPE_WORKER_CALL(adapter_change, bool, "remove_ or pin_ of a kind")
TROUPE_WORKER_CALL(adapter_list, std::vector<int64_t>, "list_loras or list_prompt_adapters")
TROUPE_WORKER_CALL(adapter_tokens, int32_t, "prompt_adapter_virtual_tokens")

#undef TROUPE_WORKER_CALL

/// The worker method `call` stands for.
template <class Call>
std::string method_name(const Call&) {
  return call_traits<Call>::method;
}

/// An adapter call's method in vLLM's names: `add_lora`, `remove_prompt_adapter`,
/// `list_loras`.
std::string method_name(const adapter_request& call);
std::string method_name(const adapter_change& call);
std::string method_name(const adapter_list& call);

} // namespace troupe
