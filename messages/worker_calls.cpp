#include "messages/worker_calls.hpp"

namespace troupe {

adapter_request to_adapter_request(const lora_request& r) {
  return {adapter_kind::lora, r.lora_int_id, r.lora_name, r.lora_path, 0};
}

adapter_request to_adapter_request(const prompt_adapter_request& r) {
  return {adapter_kind::prompt_adapter, r.prompt_adapter_id, r.prompt_adapter_name,
          r.prompt_adapter_local_path, r.prompt_adapter_num_virtual_tokens};
}

lora_request to_lora_request(const adapter_request& r) {
  return {r.name, r.id, r.path};
}

prompt_adapter_request to_prompt_adapter_request(const adapter_request& r) {
  return {r.name, r.id, r.path, r.num_virtual_tokens};
}

std::string method_name(const adapter_request& call) {
  return std::string{"add_"} + to_string(call.kind);
}

std::string method_name(const adapter_change& call) {
  return std::string{call.action == adapter_action::pin ? "pin_" : "remove_"} +
         to_string(call.kind);
}

std::string method_name(const adapter_list& call) {
  return std::string{"list_"} + to_string(call.kind) + "s";
}

} // namespace troupe
