// troupe._core: the engine (troupe::llm) for Python, over the public headers only. The
// Python layer (python/troupe/*.py) gives it vLLM's names and shapes; this module converts
// values, releases the GIL while the engine works, checks for Ctrl-C between steps and
// turns troupe::error into troupe.TroupeError (with its errc).

#include "troupe/errors.hpp"
#include "troupe/llm.hpp"
#include "troupe/model_worker.hpp"
#include "troupe/weight_group.hpp"

#include <caf/message_builder.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using namespace troupe;

/// troupe.TroupeError and troupe.WorkerFault, made at import.
PyObject* troupe_error_type = nullptr;
PyObject* worker_fault_type = nullptr;

/// The arguments of a named method, as the workers take them: booleans, integers (int64),
/// floats (double), strings, and lists of one of those.
caf::message to_message(const nb::tuple& args) {
  caf::message_builder mb;
  for (size_t i = 0; i < args.size(); ++i) {
    nb::handle a = args[i];
    if (nb::isinstance<nb::bool_>(a)) {
      mb.append(nb::cast<bool>(a));
    } else if (nb::isinstance<nb::int_>(a)) {
      mb.append(nb::cast<int64_t>(a));
    } else if (nb::isinstance<nb::float_>(a)) {
      mb.append(nb::cast<double>(a));
    } else if (nb::isinstance<nb::str>(a)) {
      mb.append(nb::cast<std::string>(a));
    } else if (nb::isinstance<nb::list>(a) || nb::isinstance<nb::tuple>(a)) {
      auto seq = nb::borrow<nb::sequence>(a);
      size_t n = nb::len(seq);
      auto all = [&](auto is) {
        for (auto item : seq)
          if (!is(item))
            return false;
        return n > 0;
      };
      if (all([](nb::handle x) {
            return nb::isinstance<nb::int_>(x) && !nb::isinstance<nb::bool_>(x);
          }))
        mb.append(nb::cast<std::vector<int64_t>>(a));
      else if (all([](nb::handle x) {
                 return nb::isinstance<nb::float_>(x) || nb::isinstance<nb::int_>(x);
               }))
        mb.append(nb::cast<std::vector<double>>(a));
      else if (all([](nb::handle x) { return nb::isinstance<nb::str>(x); }))
        mb.append(nb::cast<std::vector<std::string>>(a));
      else
        throw error{errc::bad_arguments,
                    "collective_rpc: argument " + std::to_string(i) +
                      " is a list that is not all integers, all numbers or all strings"};
    } else {
      throw error{errc::bad_arguments,
                  "collective_rpc: argument " + std::to_string(i) + " is a " +
                    nb::cast<std::string>(nb::str(a.type().attr("__name__"))) +
                    " (a named method takes booleans, integers, floats, strings and lists of "
                    "them)"};
    }
  }
  return mb.to_message();
}

caf::config_value to_config_value(nb::handle v, const std::string& key) {
  if (nb::isinstance<nb::bool_>(v))
    return caf::config_value{nb::cast<bool>(v)};
  if (nb::isinstance<nb::int_>(v))
    return caf::config_value{nb::cast<int64_t>(v)};
  if (nb::isinstance<nb::float_>(v))
    return caf::config_value{nb::cast<double>(v)};
  if (nb::isinstance<nb::str>(v))
    return caf::config_value{nb::cast<std::string>(v)};
  if (nb::isinstance<nb::list>(v) || nb::isinstance<nb::tuple>(v)) {
    caf::config_value::list items;
    for (auto item : nb::borrow<nb::sequence>(v))
      items.push_back(to_config_value(item, key));
    return caf::config_value{std::move(items)};
  }
  if (nb::isinstance<nb::dict>(v)) {
    caf::config_value::dictionary d;
    for (auto [k, item] : nb::borrow<nb::dict>(v))
      d[nb::cast<std::string>(nb::str(k))] = to_config_value(item, key);
    return caf::config_value{std::move(d)};
  }
  throw error{errc::bad_arguments, "collective_rpc: keyword argument '" + key + "' is a " +
                                     nb::cast<std::string>(nb::str(v.type().attr("__name__")))};
}

caf::settings to_settings(const nb::dict& kwargs) {
  caf::settings out;
  for (auto [k, v] : kwargs) {
    auto key = nb::cast<std::string>(nb::str(k));
    out[key] = to_config_value(v, key);
  }
  return out;
}

/// A worker's health report as a dict.
nb::dict health_dict(const worker_health& h) {
  nb::dict d;
  d["rank"] = h.rank;
  d["healthy"] = h.healthy;
  d["detail"] = h.detail;
  nb::dict memory;
  for (auto& u : h.memory) {
    nb::dict usage;
    usage["allocated_bytes"] = u.allocated_bytes;
    usage["resident_bytes"] = u.resident_bytes;
    usage["backup_bytes"] = u.backup_bytes;
    memory[to_string(u.tag)] = usage;
  }
  d["memory"] = memory;
  nb::list sleeping;
  for (auto tag : h.sleeping_tags)
    sleeping.append(to_string(tag));
  d["sleeping_tags"] = sleeping;
  d["restarts"] = h.restarts;
  return d;
}

/// One element of a method's result as a Python value; what has no Python form (a
/// troupe message type) as its text.
nb::object element(const caf::message& m, size_t i) {
  if (m.match_element<bool>(i))
    return nb::bool_(m.get_as<bool>(i));
  if (m.match_element<int32_t>(i))
    return nb::int_(m.get_as<int32_t>(i));
  if (m.match_element<int64_t>(i))
    return nb::int_(m.get_as<int64_t>(i));
  if (m.match_element<uint64_t>(i))
    return nb::int_(m.get_as<uint64_t>(i));
  if (m.match_element<float>(i))
    return nb::float_(m.get_as<float>(i));
  if (m.match_element<double>(i))
    return nb::float_(m.get_as<double>(i));
  if (m.match_element<std::string>(i))
    return nb::str(m.get_as<std::string>(i).c_str());
  if (m.match_element<std::vector<int32_t>>(i))
    return nb::cast(m.get_as<std::vector<int32_t>>(i));
  if (m.match_element<std::vector<int64_t>>(i))
    return nb::cast(m.get_as<std::vector<int64_t>>(i));
  if (m.match_element<std::vector<float>>(i))
    return nb::cast(m.get_as<std::vector<float>>(i));
  if (m.match_element<std::vector<double>>(i))
    return nb::cast(m.get_as<std::vector<double>>(i));
  if (m.match_element<std::vector<std::string>>(i))
    return nb::cast(m.get_as<std::vector<std::string>>(i));
  if (m.match_element<cache_blocks>(i)) {
    auto& b = m.get_as<cache_blocks>(i);
    nb::dict d;
    d["num_device_blocks"] = b.num_device_blocks;
    d["num_swap_blocks"] = b.num_swap_blocks;
    return std::move(d);
  }
  if (m.match_element<worker_health>(i))
    return health_dict(m.get_as<worker_health>(i));
  return nb::str(m.cvals()->stringify(i).c_str());
}

/// A method's result: None for nothing, the value for one, a tuple for more.
nb::object from_message(const caf::message& m) {
  if (m.empty())
    return nb::none();
  if (m.size() == 1)
    return element(m, 0);
  nb::list items;
  for (size_t i = 0; i < m.size(); ++i)
    items.append(element(m, i));
  return nb::tuple(items);
}

std::optional<timeout_type> to_timeout(std::optional<double> seconds) {
  if (!seconds)
    return std::nullopt;
  if (!std::isfinite(*seconds) || *seconds <= 0 || *seconds > 1e9)
    throw error{errc::invalid_argument, "collective_rpc: timeout must be a positive number of "
                                        "seconds, not " +
                                          std::to_string(*seconds)};
  return std::chrono::duration_cast<timeout_type>(std::chrono::duration<double>(*seconds));
}

/// A float array in host memory, as NumPy and PyTorch (DLPack) hand it over.
using host_array = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

/// `array` as a weight update takes it (no copy).
host_tensor to_host_tensor(const std::string& name, const host_array& array) {
  host_tensor t;
  t.name = name;
  auto dt = array.dtype();
  auto flt = static_cast<uint8_t>(nb::dlpack::dtype_code::Float);
  if (dt.lanes == 1 && dt.code == flt && dt.bits == 32)
    t.dtype = "float32";
  else if (dt.lanes == 1 && dt.code == flt && dt.bits == 16)
    t.dtype = "float16";
  else if (dt.lanes == 1 && dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) &&
           dt.bits == 16)
    t.dtype = "bfloat16";
  else
    throw error{errc::invalid_argument,
                "tensor '" + name + "' is not float32, float16 or bfloat16 (DLPack code " +
                  std::to_string(dt.code) + ", " + std::to_string(dt.bits) + " bits)"};
  for (size_t d = 0; d < array.ndim(); ++d)
    t.shape.push_back(static_cast<int64_t>(array.shape(d)));
  t.data = array.data();
  return t;
}

/// The worker a Python callable gets, valid only during the call (`collective_rpc`).
struct worker_handle {
  worker* w = nullptr;
  worker& get() const {
    if (w == nullptr)
      throw error{errc::invalid_argument, "this worker object was only valid during its call"};
    return *w;
  }
};

/// The model `troupe.LLM` runs: troupe::llm, one caller at a time.
class engine {
public:
  explicit engine(llm_config cfg) {
    nb::gil_scoped_release release;
    llm_ = std::make_unique<llm>(std::move(cfg));
  }

  std::vector<generation_output> generate(const std::vector<generation_request>& requests) {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock{mutex_};
    return get().generate(requests, [] {
      nb::gil_scoped_acquire acquire;
      if (PyErr_CheckSignals() != 0)
        throw nb::python_error();
    });
  }

  template <class F>
  auto call(F&& f) {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock{mutex_};
    return f(get());
  }

  nb::list collective_rpc(const std::string& method, const nb::tuple& args, const nb::dict& kwargs,
                          std::optional<double> timeout) {
    rpc_call_options opts;
    opts.args = to_message(args);
    opts.kwargs = to_settings(kwargs);
    opts.timeout = to_timeout(timeout);
    auto results = call([&](llm& m) { return m.executor().collective_rpc(method, opts); });
    nb::list out;
    for (auto& r : results)
      out.append(from_message(r));
    return out;
  }

  /// Runs `fn(worker, *args, **kwargs)` on every rank, in each worker's thread (with the
  /// GIL). A rank's Python exception is raised again here as it was.
  nb::list collective_rpc_callable(nb::callable fn, nb::tuple args, nb::dict kwargs,
                                   std::optional<double> timeout) {
    rpc_call_options opts;
    opts.timeout = to_timeout(timeout);
    size_t world = 0;
    {
      nb::gil_scoped_release release;
      world = static_cast<size_t>(get().executor().world_size());
    }
    std::vector<nb::object> results(world);
    std::vector<std::optional<nb::python_error>> raised(world);
    std::mutex slots;
    auto run = [&](worker& w, const caf::message&, const caf::settings&) {
      nb::gil_scoped_acquire acquire;
      auto rank = static_cast<size_t>(w.rank());
      auto handle = nb::cast(worker_handle{&w});
      try {
        auto r = fn(handle, *args, **kwargs);
        nb::inst_ptr<worker_handle>(handle)->w = nullptr;
        std::lock_guard<std::mutex> lock{slots};
        if (rank < world)
          results[rank] = std::move(r);
      } catch (nb::python_error& e) {
        nb::inst_ptr<worker_handle>(handle)->w = nullptr;
        std::string what = e.what();
        // The callable says its worker cannot go on: the worker dies (and is replaced
        // under a restart policy), as with a lost device.
        if (e.matches(worker_fault_type))
          throw worker_fault{nb::cast<std::string>(nb::str(e.value()))};
        {
          std::lock_guard<std::mutex> lock{slots};
          if (rank < world)
            raised[rank].emplace(std::move(e));
        }
        throw error{errc::worker_error, what};
      }
      return caf::message{};
    };
    try {
      call([&](llm& m) { return m.executor().collective_rpc(run, opts); });
    } catch (const error&) {
      for (auto& e : raised)
        if (e) {
          e->restore();
          throw nb::python_error();
        }
      throw;
    }
    nb::list out;
    for (auto& r : results)
      out.append(r.is_valid() ? r : nb::none());
    return out;
  }

  void update_weights_from_tensors(const std::vector<std::pair<std::string, host_array>>& named,
                                   bool quantize_on_update) {
    std::vector<host_tensor> tensors;
    for (auto& [name, array] : named)
      tensors.push_back(to_host_tensor(name, array));
    weight_update_options o;
    o.quantize_on_update = quantize_on_update;
    call([&](llm& m) {
      m.update_weights_from_tensors(tensors, o);
      return 0;
    });
  }

  /// Ends the engine now (its workers and memory); later calls raise shut_down.
  void close() {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock{mutex_};
    llm_.reset();
  }

  llm& get() {
    if (!llm_)
      throw error{errc::shut_down, "the engine was closed"};
    return *llm_;
  }

private:
  std::mutex mutex_;
  std::unique_ptr<llm> llm_;
};

} // namespace

NB_MODULE(_core, m) {
  m.doc() = "troupe's engine; use the troupe package (troupe.LLM), not this module";

  troupe_error_type = PyErr_NewExceptionWithDoc(
    "troupe.TroupeError",
    "An error of troupe's engine: `errc` names its kind (invalid_argument, timeout, "
    "worker_died, sleeping, ...), the message says what was wrong.",
    PyExc_RuntimeError, nullptr);
  m.attr("TroupeError") = nb::handle(troupe_error_type);
  worker_fault_type = PyErr_NewExceptionWithDoc(
    "troupe.WorkerFault",
    "Raised by a callable given to collective_rpc when its worker cannot go on: the worker "
    "dies as with a lost device, and is replaced when the engine has a restart policy "
    "(max_restarts).",
    troupe_error_type, nullptr);
  m.attr("WorkerFault") = nb::handle(worker_fault_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const troupe::error& e) {
      nb::object exc = nb::borrow(troupe_error_type)(nb::str(e.what()));
      exc.attr("errc") = nb::str(troupe::to_string(e.code()));
      PyErr_SetObject(troupe_error_type, exc.ptr());
    }
  });

  nb::class_<sampling_params>(m, "SamplingParamsCore")
    .def(nb::init<>())
    .def_rw("temperature", &sampling_params::temperature)
    .def_rw("top_p", &sampling_params::top_p)
    .def_rw("top_k", &sampling_params::top_k)
    .def_rw("seed", &sampling_params::seed)
    .def_rw("max_tokens", &sampling_params::max_tokens)
    .def_rw("logprobs", &sampling_params::logprobs)
    .def_rw("stop_token_ids", &sampling_params::stop_token_ids)
    .def_rw("ignore_eos", &sampling_params::ignore_eos)
    .def_rw("repetition_penalty", &sampling_params::repetition_penalty)
    .def_rw("presence_penalty", &sampling_params::presence_penalty)
    .def_rw("frequency_penalty", &sampling_params::frequency_penalty)
    .def_rw("min_p", &sampling_params::min_p)
    .def_rw("logit_bias_ids", &sampling_params::logit_bias_ids)
    .def_rw("logit_bias_values", &sampling_params::logit_bias_values)
    .def_rw("min_tokens", &sampling_params::min_tokens)
    .def_rw("n", &sampling_params::n)
    .def_rw("best_of", &sampling_params::best_of)
    .def_rw("bad_words", &sampling_params::bad_words)
    .def_rw("prompt_logprobs", &sampling_params::prompt_logprobs)
    .def_rw("guided_json", &sampling_params::guided_json)
    .def_rw("guided_json_object", &sampling_params::guided_json_object)
    .def_rw("guided_choice", &sampling_params::guided_choice)
    .def_rw("guided_regex", &sampling_params::guided_regex);

  nb::class_<lora_request>(m, "LoRARequestCore")
    .def(nb::init<>())
    .def_rw("lora_name", &lora_request::lora_name)
    .def_rw("lora_int_id", &lora_request::lora_int_id)
    .def_rw("lora_path", &lora_request::lora_path);

  nb::class_<generation_request>(m, "Request")
    .def(nb::init<>())
    .def_rw("prompt", &generation_request::prompt)
    .def_rw("prompt_token_ids", &generation_request::prompt_token_ids)
    .def_rw("sampling", &generation_request::sampling)
    .def_rw("stop", &generation_request::stop)
    .def_rw("lora", &generation_request::lora)
    .def_rw("add_special_tokens", &generation_request::add_special_tokens);

  nb::class_<token_logprob>(m, "TokenLogprob")
    .def_ro("token", &token_logprob::token)
    .def_ro("logprob", &token_logprob::logprob);

  nb::class_<prompt_logprob>(m, "PromptLogprob")
    .def_ro("position", &prompt_logprob::position)
    .def_ro("token", &prompt_logprob::token)
    .def_ro("logprob", &prompt_logprob::logprob)
    .def_ro("rank", &prompt_logprob::rank)
    .def_ro("top_logprobs", &prompt_logprob::top_logprobs);

  nb::class_<generation_output>(m, "Output")
    .def_ro("index", &generation_output::index)
    .def_ro("prompt", &generation_output::prompt)
    .def_ro("prompt_token_ids", &generation_output::prompt_token_ids)
    .def_ro("text", &generation_output::text)
    .def_ro("token_ids", &generation_output::token_ids)
    .def_ro("logprobs", &generation_output::logprobs)
    .def_ro("ranks", &generation_output::ranks)
    .def_ro("top_logprobs", &generation_output::top_logprobs)
    .def_ro("prompt_logprobs", &generation_output::prompt_logprobs)
    .def_prop_ro("finish_reason",
                 [](const generation_output& o) { return std::string{to_string(o.finish_reason)}; })
    .def_ro("first_token_seconds", &generation_output::first_token_seconds)
    .def_ro("finished_seconds", &generation_output::finished_seconds);

  nb::class_<llm_config> config(m, "Config");
  config.def(nb::init<>())
    .def_rw("chat_template", &llm_config::chat_template)
    .def("validate", &llm_config::validate);
  // The engine's arguments under flat names (the Python layer gives them vLLM's).
  auto field = [&](const char* name, auto part, auto member) {
    using T = std::decay_t<decltype(llm_config{}.*part.*member)>;
    config.def_prop_rw(
      name, [part, member](llm_config& c) { return (c.*part).*member; },
      [part, member](llm_config& c, const T& v) { (c.*part).*member = v; });
  };
  using W = model_worker_options;
  using E = executor_config;
  using S = scheduler_config;
  auto worker = &llm_config::worker;
  auto executor = &llm_config::executor;
  auto scheduling = &llm_config::scheduler;
  field("model", worker, &W::model_path);
  field("dtype", worker, &W::dtype);
  field("enforce_eager", worker, &W::enforce_eager);
  field("enable_expert_parallel", worker, &W::enable_expert_parallel);
  field("weight_cache", worker, &W::weight_cache);
  field("kv_cache_memory_bytes", worker, &W::kv_cache_memory_bytes);
  field("gpu_memory_utilization", worker, &W::gpu_memory_utilization);
  field("swap_space_bytes", worker, &W::swap_space_bytes);
  field("max_loras", worker, &W::max_loras);
  field("max_lora_rank", worker, &W::max_lora_rank);
  field("tensor_parallel_size", executor, &E::tensor_parallel_size);
  field("max_model_len", executor, &E::max_model_len);
  field("block_size", executor, &E::block_size);
  field("max_num_seqs", scheduling, &S::max_num_seqs);
  field("max_num_batched_tokens", scheduling, &S::max_num_batched_tokens);
  field("enable_prefix_caching", scheduling, &S::enable_prefix_caching);
  field("async_scheduling", scheduling, &S::async_scheduling);
  // Closed sets by their names, each name checked once here.
  config
    .def_prop_rw(
      "load_format", [](llm_config& c) { return std::string{to_string(c.worker.load_format)}; },
      [](llm_config& c, const std::string& v) { c.worker.load_format = parse_load_format(v); })
    .def_prop_rw(
      "cpu_precision", [](llm_config& c) { return std::string{to_string(c.worker.cpu_precision)}; },
      [](llm_config& c, const std::string& v) { c.worker.cpu_precision = parse_cpu_precision(v); })
    .def_prop_rw(
      "device", [](llm_config& c) { return std::string{to_string(c.executor.device_type)}; },
      [](llm_config& c, const std::string& v) { c.executor.device_type = parse_device_kind(v); })
    .def_prop_rw(
      "max_restarts", [](llm_config& c) { return c.executor.restart.max_restarts; },
      [](llm_config& c, int32_t v) { c.executor.restart.max_restarts = v; })
    .def_prop_rw(
      "rpc_timeout_seconds",
      [](llm_config& c) { return std::chrono::duration<double>(c.executor.rpc_timeout).count(); },
      [](llm_config& c, double v) { c.executor.rpc_timeout = to_timeout(v).value(); });

  nb::class_<worker_handle>(m, "Worker",
                            "A worker as a callable given to collective_rpc sees it, during "
                            "that call only.")
    .def_prop_ro("rank", [](const worker_handle& h) { return h.get().rank(); })
    .def_prop_ro("world_size", [](const worker_handle& h) { return h.get().context().world_size; })
    .def_prop_ro("device",
                 [](const worker_handle& h) {
                   auto& c = h.get().context();
                   return to_string(c.device_type) + (":" + std::to_string(c.device_index));
                 })
    .def("method_names", [](const worker_handle& h) { return h.get().method_names(); })
    .def(
      "call",
      [](const worker_handle& h, const std::string& method, nb::args args, nb::kwargs kwargs) {
        auto msg = to_message(nb::tuple(args));
        auto settings = to_settings(kwargs);
        caf::message r;
        {
          nb::gil_scoped_release release;
          r = h.get().call(method, msg, settings);
        }
        return from_message(r);
      },
      "method"_a, "args"_a, "kwargs"_a, "Runs a named method of this worker, in its thread.")
    .def_prop_ro("model_architecture",
                 [](const worker_handle& h) {
                   auto* model = h.get().get_model();
                   return model ? model->architecture() : std::string{};
                 })
    .def_prop_ro("num_parameters", [](const worker_handle& h) {
      auto* model = h.get().get_model();
      return model ? model->num_parameters() : int64_t{0};
    });

  nb::class_<weight_update_group>(m, "WeightGroup",
                                  "A member of a weight-update group (the trainer is rank 0).")
    .def(
      "__init__",
      [](weight_update_group* g, const std::string& address, int32_t port, int32_t rank,
         int32_t world_size, double timeout, const std::string& backend, int32_t gpu) {
        auto t = to_timeout(timeout).value();
        nb::gil_scoped_release release;
        new (g) weight_update_group(address, port, rank, world_size, t, backend, gpu);
      },
      "master_address"_a, "master_port"_a, "rank"_a, "world_size"_a, "timeout"_a,
      "backend"_a = "gloo", "gpu"_a = 0)
    .def(
      "broadcast",
      [](weight_update_group& g, const std::string& name, const host_array& array, int32_t root) {
        // Only the root's bytes travel; they are read, never written.
        auto t = to_host_tensor(name, array);
        nb::gil_scoped_release release;
        g.broadcast(const_cast<void*>(t.data), array.nbytes(), root);
      },
      "name"_a, "array"_a, "root"_a)
    .def(
      "broadcast_gpu",
      [](weight_update_group& g, uintptr_t data, size_t bytes, int32_t root) {
        // Memory on the group's GPU (nccl) by its address, as PyTorch's data_ptr() gives it:
        // read on the root, written on the others.
        nb::gil_scoped_release release;
        g.broadcast_gpu(reinterpret_cast<void*>(data), bytes, root);
      },
      "data_ptr"_a, "nbytes"_a, "root"_a)
    .def(
      "broadcast_flag",
      [](weight_update_group& g, bool value, int32_t root) {
        uint8_t flag = value ? 1 : 0;
        nb::gil_scoped_release release;
        g.broadcast(&flag, 1, root);
        return flag != 0;
      },
      "value"_a, "root"_a)
    .def_prop_ro("rank", &weight_update_group::rank)
    .def_prop_ro("world_size", &weight_update_group::world_size)
    .def_prop_ro("backend", &weight_update_group::backend);

  nb::class_<engine>(m, "Engine")
    .def(nb::init<llm_config>(), "config"_a)
    .def("generate", &engine::generate, "requests"_a)
    .def(
      "render_chat",
      [](engine& e, const std::string& messages, const std::string& tools,
         const std::string& variables, bool add_generation_prompt) {
        chat_request r{messages, tools, variables, add_generation_prompt};
        return e.call([&](llm& m) { return m.render_chat(r); });
      },
      "messages_json"_a, "tools_json"_a, "variables_json"_a, "add_generation_prompt"_a)
    .def(
      "tokenize",
      [](engine& e, const std::string& text, bool add_special_tokens) {
        return e.call([&](llm& m) { return m.tokenize(text, add_special_tokens); });
      },
      "text"_a, "add_special_tokens"_a = true)
    .def(
      "decode",
      [](engine& e, const std::vector<int32_t>& ids) {
        return e.call([&](llm& m) { return m.decode(ids); });
      },
      "token_ids"_a)
    .def("has_tokenizer",
         [](engine& e) { return e.call([](llm& m) { return m.has_tokenizer(); }); })
    .def("vocab_size", [](engine& e) { return e.call([](llm& m) { return m.vocab_size(); }); })
    .def("max_model_len",
         [](engine& e) { return e.call([](llm& m) { return m.max_model_len(); }); })
    .def("world_size",
         [](engine& e) { return e.call([](llm& m) { return m.executor().world_size(); }); })
    .def("last_tokens_per_second",
         [](engine& e) { return e.call([](llm& m) { return m.last_tokens_per_second(); }); })
    .def(
      "sleep",
      [](engine& e, int32_t level) {
        e.call([&](llm& m) {
          m.sleep(level);
          return 0;
        });
      },
      "level"_a)
    .def(
      "wake_up",
      [](engine& e, const std::vector<std::string>& tags) {
        e.call([&](llm& m) {
          m.executor().wake_up(tags);
          return 0;
        });
      },
      "tags"_a)
    .def("sleeping_tags",
         [](engine& e) {
           return e.call([](llm& m) { return m.executor().sleep_state().sleeping_tags; });
         })
    .def("reset_prefix_cache",
         [](engine& e) {
           e.call([](llm& m) {
             m.reset_prefix_cache();
             return 0;
           });
         })
    .def("collective_rpc", &engine::collective_rpc, "method"_a, "args"_a, "kwargs"_a,
         "timeout"_a.none())
    .def("collective_rpc_callable", &engine::collective_rpc_callable, "fn"_a, "args"_a, "kwargs"_a,
         "timeout"_a.none())
    .def(
      "add_lora",
      [](engine& e, const lora_request& r) {
        return e.call([&](llm& m) { return m.executor().add_lora(r); });
      },
      "request"_a)
    .def(
      "remove_lora",
      [](engine& e, int64_t id) {
        return e.call([&](llm& m) { return m.executor().remove_lora(id); });
      },
      "lora_id"_a)
    .def(
      "pin_lora",
      [](engine& e, int64_t id) {
        return e.call([&](llm& m) { return m.executor().pin_lora(id); });
      },
      "lora_id"_a)
    .def("list_loras",
         [](engine& e) { return e.call([](llm& m) { return m.executor().list_loras(); }); })
    .def("update_weights_from_tensors", &engine::update_weights_from_tensors, "named_tensors"_a,
         "quantize_on_update"_a)
    .def(
      "update_weights_from_disk",
      [](engine& e, const std::string& path, bool quantize_on_update) {
        weight_update_options o;
        o.quantize_on_update = quantize_on_update;
        e.call([&](llm& m) {
          m.update_weights_from_disk(path, o);
          return 0;
        });
      },
      "path"_a, "quantize_on_update"_a)
    .def(
      "init_weights_update_group",
      [](engine& e, const std::string& address, int32_t port, int32_t rank_offset,
         int32_t world_size, const std::string& backend, double timeout) {
        e.call([&](llm& m) {
          m.init_weights_update_group(address, port, rank_offset, world_size, backend,
                                      to_timeout(timeout).value());
          return 0;
        });
      },
      "master_address"_a, "master_port"_a, "rank_offset"_a, "world_size"_a, "backend"_a,
      "timeout"_a)
    .def("destroy_weights_update_group",
         [](engine& e) {
           e.call([](llm& m) {
             m.destroy_weights_update_group();
             return 0;
           });
         })
    .def(
      "update_weights_from_distributed",
      [](engine& e, const std::vector<std::string>& names, const std::vector<std::string>& dtypes,
         const std::vector<std::vector<int64_t>>& shapes, bool quantize_on_update) {
        if (dtypes.size() != names.size() || shapes.size() != names.size())
          throw error{errc::invalid_argument,
                      "update_weights_from_distributed: names, dtypes and shapes differ "
                      "in length"};
        std::vector<host_tensor> tensors;
        for (size_t i = 0; i < names.size(); ++i)
          tensors.push_back({names[i], dtypes[i], shapes[i], nullptr});
        weight_update_options o;
        o.quantize_on_update = quantize_on_update;
        e.call([&](llm& m) {
          m.update_weights_from_distributed(tensors, o);
          return 0;
        });
      },
      "names"_a, "dtypes"_a, "shapes"_a, "quantize_on_update"_a)
    .def("weight_version",
         [](engine& e) { return e.call([](llm& m) { return m.weight_version(); }); })
    .def("worker_healths",
         [](engine& e) {
           auto healths = e.call([](llm& m) { return m.executor().worker_healths(); });
           nb::list out;
           for (auto& h : healths)
             out.append(health_dict(h));
           return out;
         })
    .def("check_health",
         [](engine& e) {
           e.call([](llm& m) {
             m.executor().check_health();
             return 0;
           });
         })
    .def("close", &engine::close);
}
