#include "troupe/engine_loop.hpp"

#include <iostream>

namespace troupe {

engine_loop::engine_loop(llm& model, engine_loop_observer& observer, int64_t capacity)
  : model_(model), observer_(observer), capacity_(capacity), thread_([this] { run(); }) {}

engine_loop::~engine_loop() {
  stop();
  thread_.join();
}

void engine_loop::stop() {
  {
    std::lock_guard<std::mutex> lk{mtx_};
    stop_ = true;
  }
  cv_.notify_all();
}

void engine_loop::post(std::function<void(llm&)> f) {
  enqueue(std::move(f), false);
}

bool engine_loop::enqueue(std::function<void(llm&)> f, bool at_stop) {
  {
    std::lock_guard<std::mutex> lk{mtx_};
    if (ended_)
      return false;
    commands_.push_back({std::move(f), at_stop});
  }
  cv_.notify_all();
  return true;
}

void engine_loop::submit(generation_request g, std::shared_ptr<request_sink> sink) {
  if (stop_)
    throw stopped();
  if (failed_)
    throw engine_failed();
  if (active_.fetch_add(1) >= capacity_) {
    --active_;
    throw request_failure{request_failure_kind::overloaded,
                          "too many requests: " + std::to_string(capacity_) +
                            " are running or waiting; try again later"};
  }
  sink->lora_id = g.lora ? g.lora->lora_int_id : 0;
  sink->samples_left = g.sampling.n;
  auto queued = enqueue(
    [this, g = std::move(g), sink](llm& m) {
      if (sink->cancelled) {
        --active_;
        return;
      }
      if (stop_) { // queued when the loop stopped
        --active_;
        sink->fail(stopped());
        return;
      }
      if (failed_) { // the engine failed after the request came
        --active_;
        sink->fail(engine_failed());
        return;
      }
      if (unloaded_loras_.count(sink->lora_id) > 0) {
        --active_;
        sink->fail(
          {request_failure_kind::adapter_missing, "the request's LoRA adapter was unloaded"});
        return;
      }
      try {
        sink->id = m.add_request(g);
        sinks_[sink->id] = sink;
      } catch (const error& e) {
        --active_;
        sink->fail({request_failure_kind::engine_error, e.what(), e.code()});
      } catch (const std::exception& e) {
        --active_;
        sink->fail({request_failure_kind::internal, e.what()});
      }
    },
    true);
  if (!queued) { // the loop took its last commands already
    --active_;
    throw stopped();
  }
}

void engine_loop::abort(std::shared_ptr<request_sink> sink) {
  sink->cancelled = true;
  post([sink](llm& m) {
    if (sink->id >= 0)
      m.abort_request(sink->id);
  });
}

void engine_loop::abort_all() {
  post([this](llm& m) {
    for (auto& [id, sink] : sinks_)
      m.abort_request(id);
  });
}

void engine_loop::unload_lora(int64_t lora_id, const std::string& message) {
  request_failure why{request_failure_kind::adapter_unloaded, message};
  unloaded_loras_.insert(lora_id); // ids are never given again
  for (auto at = sinks_.begin(); at != sinks_.end();) {
    auto next = std::next(at);
    if (at->second->lora_id == lora_id)
      drop(at, why);
    at = next;
  }
}

std::string engine_loop::failure() const {
  std::lock_guard<std::mutex> lk{mtx_};
  return failure_;
}

void engine_loop::run() {
  for (bool last = false; !last;) {
    std::deque<command> todo;
    {
      std::unique_lock<std::mutex> lk{mtx_};
      cv_.wait(lk, [&] {
        return stop_ || !commands_.empty() || (!failed_ && model_.has_unfinished_requests());
      });
      last = stop_;
      ended_ = last;
      todo.swap(commands_);
    }
    // When the loop stops, the generations queued still come to their sinks (as stopped),
    // so that none waits forever; other commands (admin calls) are dropped.
    for (auto& c : todo) {
      if (last && !c.at_stop)
        continue;
      try {
        c.run(model_);
      } catch (const std::exception& e) {
        // Commands answer their own errors; this is a bug's last stop, not the thread's.
        std::cerr << "troupe: a command on the engine's thread failed: " << e.what() << std::endl;
      }
    }
    if (!last && !failed_ && model_.has_unfinished_requests()) {
      try {
        for (auto& u : model_.step())
          dispatch(u);
      } catch (const error& e) {
        if (e.code() == errc::worker_died || e.code() == errc::shut_down)
          fail_all(e);
        else
          fail_requests({request_failure_kind::engine_error, e.what(), e.code()});
      } catch (const std::exception& e) {
        fail_requests({request_failure_kind::internal, e.what()});
      }
    }
    observer_.stepped(model_.stats());
  }
  // Aborted in the engine too: the model outlives the loop.
  while (!sinks_.empty())
    drop(sinks_.begin(), stopped());
}

void engine_loop::dispatch(const generation_update& u) {
  auto at = sinks_.find(u.request_id);
  if (at == sinks_.end())
    return;
  auto sink = at->second;
  auto now = std::chrono::steady_clock::now();
  // The time to the first token of any sample; the gaps between the first sample's tokens
  // (the others' come in the same steps).
  if (!u.token_ids.empty() && (sink->first_token < 0 || u.index == 0)) {
    if (sink->first_token < 0)
      sink->first_token = std::chrono::duration<double>(now - sink->arrived).count();
    else
      sink->gaps.push_back(std::chrono::duration<double>(now - sink->last_token).count());
    sink->last_token = now;
  }
  sink->update(u);
  if (u.finished && --sink->samples_left == 0) {
    observer_.finished(to_string(u.output->finish_reason), std::max(0.0, sink->first_token),
                       sink->gaps, std::chrono::duration<double>(now - sink->arrived).count());
    sinks_.erase(at);
    --active_;
  }
}

void engine_loop::drop(sink_map::iterator at, const request_failure& why) {
  // The engine hands out the aborted request at its next step; its sink is gone by then.
  model_.abort_request(at->first);
  at->second->fail(why);
  sinks_.erase(at);
  --active_;
}

void engine_loop::fail_requests(const request_failure& why) {
  while (!sinks_.empty())
    drop(sinks_.begin(), why);
  try {
    model_.step(); // hands out the aborted requests, computing nothing
  } catch (const std::exception&) {
  }
}

void engine_loop::fail_all(const error& e) {
  {
    std::lock_guard<std::mutex> lk{mtx_};
    failure_ = e.what();
  }
  failed_ = true;
  // Aborted in the engine too, so that its counts (and /metrics) no longer show them
  // running or waiting.
  while (!sinks_.empty())
    drop(sinks_.begin(), engine_failed());
}

request_failure engine_loop::stopped() {
  return {request_failure_kind::stopped, "the engine's loop stopped"};
}

request_failure engine_loop::engine_failed() const {
  return {request_failure_kind::engine_failed, "the engine failed: " + failure()};
}

} // namespace troupe
