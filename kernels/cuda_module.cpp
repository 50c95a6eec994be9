#include "kernels/cuda_module.hpp"

#include "troupe/errors.hpp"

#include <dlfcn.h>

#include <filesystem>
#include <mutex>

namespace troupe {

communicator::~communicator() = default;
gpu_broadcaster::~gpu_broadcaster() = default;

namespace {

/// The module next to this library (a build tree, an install prefix), else by name.
const cuda_module* load(std::string& why) {
#ifndef TROUPE_CUDA_MODULE
  why = "CUDA is not built in";
  return nullptr;
#else
  std::string path = TROUPE_CUDA_MODULE;
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&cuda), &self) != 0 && self.dli_fname != nullptr) {
    auto beside = std::filesystem::path(self.dli_fname).parent_path() / TROUPE_CUDA_MODULE;
    if (std::filesystem::exists(beside))
      path = beside.string();
  }
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* e = dlerror();
    why = "cannot load " + path + ": " + (e ? e : "unknown error");
    return nullptr;
  }
  using entry = const cuda_module* (*)();
  auto get = reinterpret_cast<entry>(dlsym(handle, "troupe_cuda_module"));
  if (get == nullptr) {
    why = path + " has no troupe_cuda_module entry point";
    return nullptr;
  }
  // Kept loaded for the life of the process: devices and backends it made may outlive
  // any owner that could unload it.
  return get();
#endif
}

} // namespace

const cuda_module& cuda() {
  static std::once_flag once;
  static const cuda_module* module = nullptr;
  static std::string why;
  std::call_once(once, [] { module = load(why); });
  if (module == nullptr)
    throw error{errc::unsupported, "the CUDA device is not available: " + why};
  return *module;
}

bool is_cuda(const device& dev) {
  return dev.name().rfind("cuda:", 0) == 0;
}

} // namespace troupe
