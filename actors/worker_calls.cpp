#include "actors/worker_calls.hpp"

#include "troupe/errors.hpp"

#include <filesystem>

namespace troupe {

namespace {

/// Where a rank's part of a staged save is written before the executor commits it: a
/// hidden folder next to the final files, so that the commit is a rename.
std::filesystem::path staging_dir(const std::string& path, const std::string& token, int32_t rank) {
  return std::filesystem::path{path} /
         (".troupe-staging-" + token + "-rank-" + std::to_string(rank));
}

} // namespace

cache_blocks run_call(worker& w, const blocks_query&) {
  return w.determine_num_available_blocks();
}

void run_call(worker& w, const cache_init& call) {
  w.initialize_cache(call.blocks);
}

worker_health run_call(worker& w, const health_query&) {
  return w.check_health();
}

std::vector<std::string> run_call(worker& w, const collective_prepare&) {
  return w.prepare_collective();
}

void run_call(worker& w, const collective_connect& call) {
  w.connect_collective(call.table);
}

void run_call(worker& w, const sleep_request& call) {
  w.sleep(to_sleep_level(static_cast<int64_t>(call.level)));
}

void run_call(worker& w, const wake_request& call) {
  w.wake_up(call.tags);
}

void run_call(worker& w, const staged_save& call) {
  namespace fs = std::filesystem;
  auto req = call.request;
  if (req.path.empty())
    throw error{errc::invalid_argument, "save_sharded_state needs a path"};
  if (!fs::is_directory(req.path))
    throw error{errc::invalid_argument,
                "save_sharded_state: '" + req.path + "' is not a directory"};
  auto staging = staging_dir(req.path, call.staging, w.rank());
  std::error_code ec;
  fs::create_directory(staging, ec);
  if (ec)
    throw error{errc::invalid_argument,
                "save_sharded_state: cannot write into '" + req.path + "': " + ec.message()};
  req.path = staging.string();
  try {
    w.save_sharded_state(req);
  } catch (...) {
    fs::remove_all(staging, ec);
    throw;
  }
}

void run_call(worker& w, const staged_finish& call) {
  namespace fs = std::filesystem;
  auto staging = staging_dir(call.path, call.staging, w.rank());
  std::error_code ec;
  if (!fs::is_directory(staging, ec))
    return;
  if (call.commit) {
    for (auto& entry : fs::directory_iterator(staging)) {
      fs::rename(entry.path(), fs::path{call.path} / entry.path().filename(), ec);
      if (ec)
        throw error{errc::invalid_argument, "save_sharded_state: cannot move " +
                                              entry.path().filename().string() + " into '" +
                                              call.path + "': " + ec.message()};
    }
  }
  fs::remove_all(staging, ec);
}

bool run_call(worker& w, const adapter_request& call) {
  if (call.kind == adapter_kind::prompt_adapter)
    return w.add_prompt_adapter(to_prompt_adapter_request(call));
  return w.add_lora(to_lora_request(call));
}

bool run_call(worker& w, const adapter_change& call) {
  bool prompt = call.kind == adapter_kind::prompt_adapter;
  if (call.action == adapter_action::pin)
    return prompt ? w.pin_prompt_adapter(call.id) : w.pin_lora(call.id);
  return prompt ? w.remove_prompt_adapter(call.id) : w.remove_lora(call.id);
}

std::vector<int64_t> run_call(worker& w, const adapter_list& call) {
  return call.kind == adapter_kind::prompt_adapter ? w.list_prompt_adapters() : w.list_loras();
}

int32_t run_call(worker& w, const adapter_tokens& call) {
  return w.prompt_adapter_virtual_tokens(call.id);
}

} // namespace troupe
