#pragma once

/// @file
/// What a worker does for each of the library's calls (`messages/worker_calls.hpp`): the
/// worker actor runs these for the typed requests, and the worker's named built-ins
/// (`collective_rpc("sleep", ...)`) for the same methods by name.

#include "messages/worker_calls.hpp"
#include "troupe/worker.hpp"

#include <string>
#include <vector>

namespace troupe {

cache_blocks run_call(worker& w, const blocks_query&);
void run_call(worker& w, const cache_init& call);
worker_health run_call(worker& w, const health_query&);
std::vector<std::string> run_call(worker& w, const collective_prepare&);
void run_call(worker& w, const collective_connect& call);
/// A level from the wire is checked like a number from anywhere else.
void run_call(worker& w, const sleep_request& call);
void run_call(worker& w, const wake_request& call);
void run_call(worker& w, const staged_save& call);
/// A rank that staged nothing has nothing to do.
void run_call(worker& w, const staged_finish& call);
bool run_call(worker& w, const adapter_request& call);
bool run_call(worker& w, const adapter_change& call);
std::vector<int64_t> run_call(worker& w, const adapter_list& call);
int32_t run_call(worker& w, const adapter_tokens& call);

} // namespace troupe
