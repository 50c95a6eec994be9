#pragma once

// A worker for the framework's tests: real memory in the device's tagged pool, a tiny
// deterministic "model" step, adapter bookkeeping, and extra named methods that let tests
// provoke delays, failures and concurrency.

#include "tests/rss.hpp"
#include "troupe/errors.hpp"
#include "troupe/worker.hpp"

#include <caf/make_message.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <set>
#include <stdexcept>
#include <thread>

namespace troupe::testing {

class test_model : public troupe::model {
public:
  explicit test_model(int64_t params) : params_(params) {}
  std::string architecture() const override {
    return "TestModel";
  }
  int64_t num_parameters() const override {
    return params_;
  }

private:
  int64_t params_;
};

/// Bookkeeping shared by the workers of one process, for concurrency tests.
struct concurrency_probe {
  static std::atomic<int>& current() {
    static std::atomic<int> value{0};
    return value;
  }
  static std::atomic<int>& peak() {
    static std::atomic<int> value{0};
    return value;
  }
  /// Opened by a test to let a "hold_on" call finish.
  static std::atomic<bool>& released() {
    static std::atomic<bool> value{false};
    return value;
  }
  /// "served" calls, by rank.
  static std::array<std::atomic<int>, 8>& served() {
    static std::array<std::atomic<int>, 8> counts{};
    return counts;
  }
};

inline uint64_t fnv1a(const unsigned char* data, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= data[i];
    h *= 1099511628211ull;
  }
  return h;
}

class test_worker : public troupe::worker {
public:
  explicit test_worker(size_t weights_bytes = 1 << 20, size_t block_bytes = 4096)
    : weights_bytes_(weights_bytes), block_bytes_(block_bytes) {
    register_extra_methods();
  }

  void load_model() override {
    weights_ = device_buffer(device(), weights_bytes_, memory_tag::weights);
    fill_weights();
    model_ = std::make_unique<test_model>(static_cast<int64_t>(weights_bytes_ / 4));
  }

  troupe::model* get_model() override {
    return model_.get();
  }

  cache_blocks determine_num_available_blocks() override {
    return {1000 - 100 * rank(), 64 + rank()};
  }

  void initialize_cache(const cache_blocks& blocks) override {
    fault_point("initialize_cache");
    kv_ = device_buffer(device(), static_cast<size_t>(blocks.num_device_blocks) * block_bytes_,
                        memory_tag::kv_cache);
  }

  std::vector<sampler_output> execute_model(const execute_model_request& req) override {
    if (fail_next_step_) {
      fail_next_step_ = false;
      throw std::runtime_error("step failed on purpose");
    }
    if (step_delay_ms_ > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(step_delay_ms_));
    ++steps_;
    sampler_output out;
    last_tokens_.clear();
    for (auto& group : req.seq_group_metadata_list) {
      sequence_group_output g;
      g.request_id = group.request_id;
      for (auto& seq : group.seqs) {
        int64_t sum = 0;
        for (auto t : seq.token_ids)
          sum += t;
        last_tokens_.insert(last_tokens_.end(), seq.token_ids.begin(), seq.token_ids.end());
        g.samples.push_back({seq.seq_id, static_cast<int32_t>(sum % 32000), -0.5f, {}});
      }
      out.outputs.push_back(std::move(g));
    }
    return {out};
  }

  bool add_lora(const lora_request& req) override {
    fault_point("add_lora");
    loras_.insert(req.lora_int_id);
    return true;
  }
  bool remove_lora(int64_t id) override {
    return loras_.erase(id) > 0;
  }
  bool pin_lora(int64_t id) override {
    return loras_.count(id) > 0;
  }
  std::vector<int64_t> list_loras() override {
    return {loras_.begin(), loras_.end()};
  }
  bool add_prompt_adapter(const prompt_adapter_request& req) override {
    adapters_.insert(req.prompt_adapter_id);
    return true;
  }
  bool remove_prompt_adapter(int64_t id) override {
    return adapters_.erase(id) > 0;
  }
  bool pin_prompt_adapter(int64_t id) override {
    return adapters_.count(id) > 0;
  }
  std::vector<int64_t> list_prompt_adapters() override {
    return {adapters_.begin(), adapters_.end()};
  }

  void save_sharded_state(const sharded_state_request& req) override {
    fault_point("save_sharded_state");
    auto dir = save_dir_.empty() ? req.path : save_dir_;
    auto path = dir + "/test-rank-" + std::to_string(rank()) + ".bin";
    std::ofstream out{path, std::ios::binary};
    if (!out)
      throw error{errc::invalid_argument, "cannot write '" + path + "'"};
    out.write(weights_.as<char>(), static_cast<std::streamsize>(weights_.size()));
  }

  void sleep(sleep_level level) override {
    if (fail_next_sleep_) {
      fail_next_sleep_ = false;
      throw std::runtime_error("sleep failed on purpose");
    }
    fault_point("sleep");
    worker::sleep(level);
  }

  void wake_up(const std::vector<memory_tag>& tags) override {
    fault_point("wake_up");
    worker::wake_up(tags);
  }

  /// Where `die_in_on` and `signal_in_on` strike: in `call`.
  void fault_point(const std::string& call) {
    if (signal_in_ == call) {
      signal_in_.clear();
      raise(signal_);
    }
    if (die_in_ == call)
      throw worker_fault{"died during " + call + " on purpose"};
  }

  /// Records that call `i` ran here, for tests of the order in which calls arrive.
  void note(int32_t i) {
    notes_.push_back(i);
  }

  uint64_t checksum() const {
    return fnv1a(weights_.as<unsigned char>(), weights_.size());
  }

private:
  void fill_weights() {
    auto p = weights_.as<unsigned char>();
    for (size_t i = 0; i < weights_.size(); ++i)
      p[i] = static_cast<unsigned char>((i * 131 + static_cast<size_t>(rank()) * 7) & 0xff);
  }

  static int32_t int_arg(const caf::message& args, size_t i, int32_t fallback) {
    if (i < args.size() && args.match_element<int32_t>(i))
      return args.get_as<int32_t>(i);
    return fallback;
  }

  void register_extra_methods() {
    register_method("rank", [](worker& w, const caf::message&, const caf::settings&) {
      return caf::make_message(w.rank());
    });
    // Answers in reverse rank order: rank r waits (world_size - 1 - r) * step ms.
    register_method("delayed_rank", [](worker& w, const caf::message& args, const caf::settings&) {
      auto step = int_arg(args, 0, 40);
      auto wait = (w.context().world_size - 1 - w.rank()) * step;
      std::this_thread::sleep_for(std::chrono::milliseconds(wait));
      return caf::make_message(w.rank());
    });
    register_method("sleep_ms", [](worker& w, const caf::message& args, const caf::settings&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(int_arg(args, 0, 10)));
      return caf::make_message(w.rank());
    });
    register_method("fail_on", [](worker& w, const caf::message& args, const caf::settings&) {
      if (w.rank() == int_arg(args, 0, 0))
        throw std::runtime_error("failed on purpose");
      return caf::make_message(w.rank());
    });
    register_method("die_on", [](worker& w, const caf::message& args, const caf::settings&) {
      if (w.rank() == int_arg(args, 0, 0))
        throw worker_fault{"died on purpose"};
      return caf::make_message(w.rank());
    });
    register_method("checksum", [](worker& w, const caf::message&, const caf::settings&) {
      return caf::make_message(static_cast<int64_t>(static_cast<test_worker&>(w).checksum()));
    });
    register_method("fill_kv", [](worker& w, const caf::message&, const caf::settings&) {
      auto& self = static_cast<test_worker&>(w);
      std::memset(self.kv_.data(), 0xab, self.kv_.size());
      return caf::message{};
    });
    register_method("kv_bytes", [](worker& w, const caf::message&, const caf::settings&) {
      return caf::make_message(static_cast<int64_t>(static_cast<test_worker&>(w).kv_.size()));
    });
    register_method("kv_nonzero", [](worker& w, const caf::message&, const caf::settings&) {
      auto& self = static_cast<test_worker&>(w);
      auto p = self.kv_.as<unsigned char>();
      int64_t n = std::count_if(p, p + self.kv_.size(), [](unsigned char c) { return c != 0; });
      return caf::make_message(n);
    });
    register_method("resident_bytes", [](worker& w, const caf::message&, const caf::settings&) {
      auto& self = static_cast<test_worker&>(w);
      return caf::make_message(resident_bytes(self.weights_.data(), self.weights_.size()) +
                               resident_bytes(self.kv_.data(), self.kv_.size()));
    });
    register_method("reload_weights", [](worker& w, const caf::message&, const caf::settings&) {
      static_cast<test_worker&>(w).fill_weights();
      return caf::message{};
    });
    register_method("steps", [](worker& w, const caf::message&, const caf::settings&) {
      return caf::make_message(static_cast<test_worker&>(w).steps_);
    });
    register_method("last_tokens", [](worker& w, const caf::message&, const caf::settings&) {
      return caf::make_message(static_cast<test_worker&>(w).last_tokens_);
    });
    register_method("slow_steps", [](worker& w, const caf::message& args, const caf::settings&) {
      static_cast<test_worker&>(w).step_delay_ms_ = int_arg(args, 0, 0);
      return caf::message{};
    });
    register_method("fail_next_step", [](worker& w, const caf::message&, const caf::settings&) {
      static_cast<test_worker&>(w).fail_next_step_ = true;
      return caf::message{};
    });
    // (rank, call): that rank dies (worker_fault) in its next `call` ("sleep", "wake_up",
    // "initialize_cache", "save_sharded_state", "add_lora").
    register_method("die_in_on", [](worker& w, const caf::message& args, const caf::settings&) {
      if (w.rank() == int_arg(args, 0, 0) && args.size() > 1 && args.match_element<std::string>(1))
        static_cast<test_worker&>(w).die_in_ = args.get_as<std::string>(1);
      return caf::message{};
    });
    // (rank, call, signal): that rank's process gets `signal` (SIGKILL, SIGSTOP) as the rank
    // starts its next `call`: for workers on a node, the node lost during the call.
    register_method("signal_in_on", [](worker& w, const caf::message& args, const caf::settings&) {
      if (w.rank() == int_arg(args, 0, 0) && args.size() > 2 &&
          args.match_element<std::string>(1)) {
        static_cast<test_worker&>(w).signal_in_ = args.get_as<std::string>(1);
        static_cast<test_worker&>(w).signal_ = int_arg(args, 2, 0);
      }
      return caf::message{};
    });
    register_method("fail_next_sleep_on",
                    [](worker& w, const caf::message& args, const caf::settings&) {
                      if (w.rank() == int_arg(args, 0, 0))
                        static_cast<test_worker&>(w).fail_next_sleep_ = true;
                      return caf::message{};
                    });
    // (rank, dir): that rank writes its sharded state into `dir` instead, as a rank whose
    // machine has another file system would.
    register_method("save_into_on", [](worker& w, const caf::message& args, const caf::settings&) {
      if (w.rank() == int_arg(args, 0, 0))
        static_cast<test_worker&>(w).save_dir_ = args.get_as<std::string>(1);
      return caf::message{};
    });
    register_method("fail_next_step_on",
                    [](worker& w, const caf::message& args, const caf::settings&) {
                      if (w.rank() == int_arg(args, 0, 0))
                        static_cast<test_worker&>(w).fail_next_step_ = true;
                      return caf::message{};
                    });
    register_method("add_lora_on", [](worker& w, const caf::message& args, const caf::settings&) {
      if (w.rank() == int_arg(args, 0, 0))
        static_cast<test_worker&>(w).loras_.insert(99);
      return caf::message{};
    });
    register_method("kwarg", [](worker&, const caf::message&, const caf::settings& kwargs) {
      return caf::make_message(caf::get_or(kwargs, "name", std::string{"missing"}));
    });
    // The kwarg "name", then '@' and the rank.
    register_method("kwarg_at", [](worker& w, const caf::message&, const caf::settings& kwargs) {
      return caf::make_message(caf::get_or(kwargs, "name", std::string{"missing"}) + "@" +
                               std::to_string(w.rank()));
    });
    // Notes its argument (see `note`); "notes" returns what was noted, in order.
    register_method("note", [](worker& w, const caf::message& args, const caf::settings&) {
      static_cast<test_worker&>(w).note(int_arg(args, 0, -1));
      return caf::message{};
    });
    register_method("notes", [](worker& w, const caf::message&, const caf::settings&) {
      return caf::make_message(static_cast<test_worker&>(w).notes_);
    });
    // The rank of the argument waits until the test releases it (20 s at most).
    register_method("hold_on", [](worker& w, const caf::message& args, const caf::settings&) {
      auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (w.rank() == int_arg(args, 0, 0) && !concurrency_probe::released() &&
             std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return caf::make_message(w.rank());
    });
    register_method("served", [](worker& w, const caf::message&, const caf::settings&) {
      ++concurrency_probe::served().at(static_cast<size_t>(w.rank()));
      return caf::make_message(w.rank());
    });
    // Holds the call for 50 ms and records how many calls overlap across workers.
    register_method("track", [](worker& w, const caf::message&, const caf::settings&) {
      auto now = ++concurrency_probe::current();
      auto peak = concurrency_probe::peak().load();
      while (now > peak && !concurrency_probe::peak().compare_exchange_weak(peak, now)) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      --concurrency_probe::current();
      return caf::make_message(w.rank());
    });
  }

  size_t weights_bytes_;
  size_t block_bytes_;
  device_buffer weights_;
  device_buffer kv_;
  std::unique_ptr<test_model> model_;
  std::set<int64_t> loras_;
  std::set<int64_t> adapters_;
  int64_t steps_ = 0;
  /// The tokens of the last step's sequences, one after another.
  std::vector<int32_t> last_tokens_;
  bool fail_next_step_ = false;
  int32_t step_delay_ms_ = 0;
  bool fail_next_sleep_ = false;
  /// A call this worker dies in ("sleep", "wake_up"), or none.
  std::string die_in_;
  std::string signal_in_;
  int signal_ = 0;
  std::string save_dir_;
  std::vector<int32_t> notes_;
};

/// The code of the troupe::error that `f` throws; errc::none when it throws nothing.
template <class F>
errc code_of(F&& f) {
  try {
    f();
  } catch (const error& e) {
    return e.code();
  }
  return errc::none;
}

/// The message of the troupe::error that `f` throws; empty when it throws nothing.
template <class F>
std::string what_of(F&& f) {
  try {
    f();
  } catch (const error& e) {
    return e.what();
  }
  return {};
}

/// A step of one sequence whose prompt is `token` twice: the test worker samples 2 × token.
inline execute_model_request one_step(int32_t token) {
  execute_model_request req;
  sequence_group_metadata g;
  g.request_id = "r";
  g.seqs.push_back({0, {token, token}, 2, 0, {0}});
  g.token_chunk_size = 2;
  req.seq_group_metadata_list.push_back(g);
  return req;
}

inline worker_factory test_factory(size_t weights_bytes = 1 << 20) {
  return [weights_bytes](int32_t) { return std::make_unique<test_worker>(weights_bytes); };
}

} // namespace troupe::testing
