// The worker base class: built-in methods, the named-method registry and the profiler.

#include "troupe/worker.hpp"

#include "actors/worker_calls.hpp"
#include "troupe/errors.hpp"

#include <caf/config_value.hpp>
#include <caf/make_message.hpp>
#include <caf/settings.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include <unistd.h>

namespace troupe {

namespace {

/// The positional argument `i` of `method` as a `T`, or a `bad_arguments` error that says
/// what was expected and what came.
template <class T>
const T& arg(const caf::message& args, size_t i, const std::string& method, const char* expected) {
  if (i >= args.size() || !args.match_element<T>(i))
    throw error{errc::bad_arguments, "method '" + method + "' expects argument " +
                                       std::to_string(i) + " of type " + expected + ", got (" +
                                       to_string(args) + ")"};
  return args.get_as<T>(i);
}

/// An id argument given as int64 or int32.
int64_t id_arg(const caf::message& args, const std::string& method) {
  if (args.size() == 1 && args.match_element<int32_t>(0))
    return args.get_as<int32_t>(0);
  return arg<int64_t>(args, 0, method, "int64");
}

std::string hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0)
    return "unknown";
  return buf;
}

[[noreturn]] void unsupported(const char* what) {
  throw error{errc::unsupported, std::string{"this worker does not implement "} + what};
}

} // namespace

model::~model() = default;

worker::worker() {
  register_builtins();
}

worker::~worker() = default;

// -- lifecycle ----------------------------------------------------------------

void worker::init_device(const worker_context& ctx) {
  bind_device(ctx, make_device(ctx.device_type, ctx.device_index));
}

void worker::bind_device(const worker_context& ctx, std::unique_ptr<troupe::device> dev) {
  context_ = ctx;
  device_ = std::move(dev);
}

void worker::load_model() {
  // The base worker has no model.
}

troupe::model* worker::get_model() {
  return nullptr;
}

troupe::device& worker::device() {
  if (!device_)
    throw error{errc::unsupported, "worker has no device: init_device has not run"};
  return *device_;
}

// -- capabilities a subclass provides -------------------------------------------

std::vector<std::string> worker::prepare_collective() {
  return {};
}

void worker::connect_collective(const std::vector<std::vector<std::string>>&) {
  // Nothing to connect for a worker without a collective.
}

void worker::abort_collective(const std::string&) noexcept {
  // No collective to abort.
}

cache_blocks worker::determine_num_available_blocks() {
  unsupported("determine_num_available_blocks");
}

void worker::initialize_cache(const cache_blocks&) {
  unsupported("initialize_cache");
}

std::vector<sampler_output> worker::execute_model(const execute_model_request&) {
  unsupported("execute_model");
}

std::vector<sampler_output> worker::run_step(const execute_model_request& request) {
  auto sleeping = device().sleeping_tags();
  if (!sleeping.empty()) {
    std::string tags;
    for (auto tag : sleeping)
      tags += std::string{tags.empty() ? "" : ", "} + to_string(tag);
    throw error{errc::sleeping, "execute_model while tags {" + tags + "} sleep on this worker"};
  }
  return execute_model(request);
}

bool worker::add_lora(const lora_request&) {
  unsupported("add_lora");
}

bool worker::remove_lora(int64_t) {
  unsupported("remove_lora");
}

bool worker::pin_lora(int64_t) {
  unsupported("pin_lora");
}

std::vector<int64_t> worker::list_loras() {
  unsupported("list_loras");
}

bool worker::add_prompt_adapter(const prompt_adapter_request&) {
  unsupported("add_prompt_adapter");
}

bool worker::remove_prompt_adapter(int64_t) {
  unsupported("remove_prompt_adapter");
}

bool worker::pin_prompt_adapter(int64_t) {
  unsupported("pin_prompt_adapter");
}

std::vector<int64_t> worker::list_prompt_adapters() {
  unsupported("list_prompt_adapters");
}

int32_t worker::prompt_adapter_virtual_tokens(int64_t) {
  unsupported("prompt_adapter_virtual_tokens");
}

void worker::save_sharded_state(const sharded_state_request&) {
  unsupported("save_sharded_state");
}

// -- memory -------------------------------------------------------------------

void worker::sleep(sleep_level level) {
  device().sleep(level);
}

void worker::wake_up(const std::vector<memory_tag>& tags) {
  device().wake_up(tags);
}

// -- observability ------------------------------------------------------------

void worker::start_profile() {
  if (profiling_)
    throw error{errc::invalid_argument, "profiler is already running"};
  profile_events_.clear();
  profiling_ = true;
}

std::string worker::stop_profile() {
  if (!profiling_)
    throw error{errc::invalid_argument, "profiler is not running: call start_profile first"};
  profiling_ = false;
  // Per-method totals for the summary line.
  std::map<std::string, std::pair<size_t, std::chrono::nanoseconds>> totals;
  for (auto& ev : profile_events_) {
    auto& t = totals[ev.name];
    t.first += 1;
    t.second += ev.duration;
  }
  std::ostringstream summary;
  summary << "rank " << rank() << ": " << profile_events_.size() << " calls";
  for (auto& [name, t] : totals)
    summary << "; " << name << " x" << t.first << " "
            << std::chrono::duration_cast<std::chrono::microseconds>(t.second).count() << " us";
  if (!context_.profile_dir.empty()) {
    auto path = context_.profile_dir + "/troupe-rank" + std::to_string(rank()) + "-pid" +
                std::to_string(getpid()) + ".trace.json";
    std::ofstream out{path};
    if (!out)
      throw error{errc::invalid_argument, "cannot write profile trace to '" + path + "'"};
    auto origin = profile_events_.empty() ? std::chrono::steady_clock::time_point{}
                                          : profile_events_.front().start;
    out << "{\"traceEvents\":[";
    for (size_t i = 0; i < profile_events_.size(); ++i) {
      auto& ev = profile_events_[i];
      using std::chrono::duration_cast;
      using us = std::chrono::duration<double, std::micro>;
      out << (i == 0 ? "" : ",") << "{\"name\":\"" << ev.name
          << "\",\"ph\":\"X\",\"ts\":" << duration_cast<us>(ev.start - origin).count()
          << ",\"dur\":" << duration_cast<us>(ev.duration).count() << ",\"pid\":" << getpid()
          << ",\"tid\":" << rank() << "}";
    }
    out << "]}\n";
    summary << "; trace " << path;
  }
  profile_events_.clear();
  return summary.str();
}

worker_health worker::check_health() {
  worker_health health;
  health.rank = rank();
  if (!device_) {
    health.healthy = false;
    health.detail = "no device bound";
    return health;
  }
  health.memory = device_->usage();
  health.sleeping_tags = device_->sleeping_tags();
  return health;
}

worker_info worker::info() const {
  worker_info result;
  result.rank = context_.rank;
  result.world_size = context_.world_size;
  result.device = device_ ? device_->name() : std::string{"unbound"};
  result.hostname = hostname();
  result.pid = getpid();
  describe_model(result);
  return result;
}

void worker::describe_model(worker_info&) const {}

// -- the method registry --------------------------------------------------------

void worker::register_method(const std::string& name, worker_method fn) {
  if (name.empty())
    throw error{errc::invalid_argument, "a worker method needs a name"};
  if (!fn)
    throw error{errc::invalid_argument, "worker method '" + name + "' has no function"};
  methods_[name] = std::move(fn);
}

bool worker::has_method(const std::string& name) const {
  return methods_.count(name) > 0;
}

std::vector<std::string> worker::method_names() const {
  std::vector<std::string> names;
  for (auto& kvp : methods_)
    names.push_back(kvp.first);
  std::sort(names.begin(), names.end());
  return names;
}

template <class F>
caf::message worker::timed(const std::string& name, F&& f) {
  if (!profiling_)
    return f();
  auto start = std::chrono::steady_clock::now();
  auto result = f();
  profile_events_.push_back({name, start, std::chrono::steady_clock::now() - start});
  return result;
}

caf::message worker::call(const std::string& name, const caf::message& args,
                          const caf::settings& kwargs) {
  auto i = methods_.find(name);
  if (i == methods_.end())
    throw error{errc::unknown_method, "worker has no method '" + name + "'"};
  auto& fn = i->second;
  return timed(name, [&] { return fn(*this, args, kwargs); });
}

caf::message worker::call_local(const std::string& label,
                                const std::function<caf::message(worker&)>& fn) {
  return timed(label, [&] { return fn(*this); });
}

void worker::register_builtins() {
  using caf::make_message;
  // Each reads its arguments and runs what the library's typed call of the same method
  // runs (actors/worker_calls.hpp).
  auto& m = methods_;
  m["load_model"] = [](worker& w, const caf::message&, const caf::settings&) {
    w.load_model();
    return caf::message{};
  };
  m["prepare_collective"] = [](worker& w, const caf::message&, const caf::settings&) {
    return make_message(run_call(w, collective_prepare{}));
  };
  m["connect_collective"] = [](worker& w, const caf::message& args, const caf::settings&) {
    run_call(w, collective_connect{arg<std::vector<std::vector<std::string>>>(
                  args, 0, "connect_collective", "list of address lists")});
    return caf::message{};
  };
  m["determine_num_available_blocks"] = [](worker& w, const caf::message&, const caf::settings&) {
    return make_message(run_call(w, blocks_query{}));
  };
  m["initialize_cache"] = [](worker& w, const caf::message& args, const caf::settings&) {
    cache_init call;
    if (args.size() == 2 && args.match_elements<int64_t, int64_t>())
      call.blocks = cache_blocks{args.get_as<int64_t>(0), args.get_as<int64_t>(1)};
    else
      call.blocks = arg<cache_blocks>(args, 0, "initialize_cache", "cache_blocks");
    run_call(w, call);
    return caf::message{};
  };
  m["execute_model"] = [](worker& w, const caf::message& args, const caf::settings&) {
    return make_message(
      w.run_step(arg<execute_model_request>(args, 0, "execute_model", "execute_model_request")));
  };
  for (auto kind : {adapter_kind::lora, adapter_kind::prompt_adapter}) {
    auto add = method_name(adapter_request{kind});
    m[add] = [kind, add](worker& w, const caf::message& args, const caf::settings&) {
      adapter_request call;
      if (kind == adapter_kind::lora)
        call = to_adapter_request(arg<lora_request>(args, 0, add, "lora_request"));
      else
        call =
          to_adapter_request(arg<prompt_adapter_request>(args, 0, add, "prompt_adapter_request"));
      return make_message(run_call(w, call));
    };
    for (auto action : {adapter_action::remove, adapter_action::pin}) {
      auto name = method_name(adapter_change{kind, action});
      m[name] = [kind, action, name](worker& w, const caf::message& args, const caf::settings&) {
        return make_message(run_call(w, adapter_change{kind, action, id_arg(args, name)}));
      };
    }
    m[method_name(adapter_list{kind})] = [kind](worker& w, const caf::message&,
                                                const caf::settings&) {
      return make_message(run_call(w, adapter_list{kind}));
    };
  }
  m["prompt_adapter_virtual_tokens"] = [](worker& w, const caf::message& args,
                                          const caf::settings&) {
    return make_message(run_call(w, adapter_tokens{id_arg(args, "prompt_adapter_virtual_tokens")}));
  };
  m["sleep"] = [](worker& w, const caf::message& args, const caf::settings& kwargs) {
    // vLLM passes the level as a keyword; typed callers pass a sleep_request.
    sleep_request call;
    if (auto level = caf::get_if<int64_t>(&kwargs, "level"))
      call.level = to_sleep_level(*level);
    else
      call = arg<sleep_request>(args, 0, "sleep", "sleep_request");
    run_call(w, call);
    return caf::message{};
  };
  m["wake_up"] = [](worker& w, const caf::message& args, const caf::settings& kwargs) {
    wake_request call;
    if (auto names = caf::get_if<caf::config_value::list>(&kwargs, "tags")) {
      for (auto& name : *names) {
        auto str = caf::get_if<std::string>(&name);
        auto tag = str ? parse_memory_tag(*str) : std::nullopt;
        if (!tag)
          throw error{errc::invalid_argument, "unknown memory tag " + to_string(name)};
        call.tags.push_back(*tag);
      }
    } else if (!args.empty()) {
      call = arg<wake_request>(args, 0, "wake_up", "wake_request");
    }
    run_call(w, call);
    return caf::message{};
  };
  m["save_sharded_state"] = [](worker& w, const caf::message& args, const caf::settings& kwargs) {
    sharded_state_request req;
    if (!args.empty()) {
      req = arg<sharded_state_request>(args, 0, "save_sharded_state", "sharded_state_request");
    } else {
      req.path = caf::get_or(kwargs, "path", std::string{});
      req.pattern = caf::get_or(kwargs, "pattern", std::string{});
      req.max_size = caf::get_or(kwargs, "max_size", int64_t{0});
    }
    if (req.path.empty())
      throw error{errc::invalid_argument, "save_sharded_state needs a path"};
    w.save_sharded_state(req);
    return caf::message{};
  };
  m["start_profile"] = [](worker& w, const caf::message&, const caf::settings&) {
    w.start_profile();
    return caf::message{};
  };
  m["stop_profile"] = [](worker& w, const caf::message&, const caf::settings&) {
    return make_message(w.stop_profile());
  };
  m["check_health"] = [](worker& w, const caf::message&, const caf::settings&) {
    return make_message(run_call(w, health_query{}));
  };
  m["info"] = [](worker& w, const caf::message&, const caf::settings&) {
    return make_message(w.info());
  };
  m["method_names"] = [](worker& w, const caf::message&, const caf::settings&) {
    return make_message(w.method_names());
  };
}

} // namespace troupe
