#include "server/engine_loop.hpp"

#include <iostream>

namespace troupe {

http_error from_engine(const error& e) {
  switch (e.code()) {
  case errc::invalid_argument:
  case errc::unsupported:
  case errc::unknown_method:
  case errc::bad_arguments:
  case errc::remote_callable:
    return {400, "invalid_request_error", e.what()};
  case errc::sleeping:
    return {503, "server_error", e.what()};
  default:
    return {500, "server_error", e.what()};
  }
}

engine_loop::engine_loop(llm& model, server_metrics& metrics, int64_t capacity)
  : model_(model), metrics_(metrics), capacity_(capacity), thread_([this] { run(); }) {}

engine_loop::~engine_loop() {
  {
    std::lock_guard<std::mutex> lk{mtx_};
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void engine_loop::post(std::function<void(llm&)> f) {
  {
    std::lock_guard<std::mutex> lk{mtx_};
    commands_.push_back(std::move(f));
  }
  cv_.notify_all();
}

void engine_loop::submit(generation_request g, std::shared_ptr<request_sink> sink) {
  if (failed_)
    throw http_error{503, "server_error", "the engine failed: " + failure()};
  if (active_.fetch_add(1) >= capacity_) {
    --active_;
    throw http_error{429, "rate_limit_error",
                     "too many requests: " + std::to_string(capacity_) +
                       " are running or waiting; try again later"};
  }
  sink->lora_id = g.lora ? g.lora->lora_int_id : 0;
  sink->samples_left = g.sampling.n;
  post([this, g = std::move(g), sink](llm& m) {
    if (sink->cancelled) {
      --active_;
      return;
    }
    if (failed_) { // the engine failed after the request came
      --active_;
      sink->fail({503, "server_error", "the engine failed: " + failure()});
      return;
    }
    if (unloaded_loras_.count(sink->lora_id) > 0) {
      --active_;
      sink->fail({404, "not_found_error", "the request's LoRA adapter was unloaded", "model"});
      return;
    }
    try {
      sink->id = m.add_request(g);
      sinks_[sink->id] = sink;
    } catch (const error& e) {
      --active_;
      sink->fail(from_engine(e));
    } catch (const std::exception& e) {
      --active_;
      sink->fail({500, "server_error", e.what()});
    }
  });
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

void engine_loop::unload_lora(int64_t lora_id, const http_error& why) {
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
  for (;;) {
    std::deque<std::function<void(llm&)>> todo;
    {
      std::unique_lock<std::mutex> lk{mtx_};
      cv_.wait(lk, [&] {
        return stop_ || !commands_.empty() || (!failed_ && model_.has_unfinished_requests());
      });
      if (stop_)
        break;
      todo.swap(commands_);
    }
    for (auto& c : todo) {
      try {
        c(model_);
      } catch (const std::exception& e) {
        // Commands answer their own errors; this is a bug's last stop, not the thread's.
        std::cerr << "troupe serve: a command failed: " << e.what() << std::endl;
      }
    }
    if (!failed_ && model_.has_unfinished_requests()) {
      try {
        for (auto& u : model_.step())
          dispatch(u);
      } catch (const error& e) {
        if (e.code() == errc::worker_died || e.code() == errc::shut_down)
          fail_all(e);
        else
          fail_requests(from_engine(e));
      } catch (const std::exception& e) {
        fail_requests({500, "server_error", e.what()});
      }
    }
    metrics_.engine(model_.stats());
  }
  for (auto& [id, sink] : sinks_)
    sink->fail({503, "server_error", "the server stopped"});
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
    metrics_.finished(u.output->finish_reason, std::max(0.0, sink->first_token), sink->gaps,
                      std::chrono::duration<double>(now - sink->arrived).count());
    sinks_.erase(at);
    --active_;
  }
}

void engine_loop::drop(std::map<int64_t, std::shared_ptr<request_sink>>::iterator at,
                       const http_error& why) {
  // The engine hands out the aborted request at its next step; its sink is gone by then.
  model_.abort_request(at->first);
  at->second->fail(why);
  sinks_.erase(at);
  --active_;
}

void engine_loop::fail_requests(const http_error& why) {
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
    drop(sinks_.begin(), {503, "server_error", std::string{"the engine failed: "} + e.what()});
}

} // namespace troupe
