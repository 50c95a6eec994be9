#pragma once

/// @file
/// The CUDA device as a library of its own, `libtroupe_cuda.so`, loaded when a CUDA device
/// is first asked for: a process that computes on the CPU never maps cuBLAS and the CUDA
/// runtime (about 150 MB resident).

#include "kernels/backend.hpp"
#include "kernels/communicator.hpp"
#include "kernels/gpu_broadcaster.hpp"
#include "troupe/device.hpp"

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

namespace troupe {

/// The entry points of the CUDA module.
struct cuda_module {
  /// GPU `index` (see `cuda_device`).
  std::unique_ptr<device> (*make_device)(int32_t index);
  /// The CUDA backend of a device that `make_device` made.
  std::unique_ptr<backend> (*make_backend)(device& dev);
  /// A fresh NCCL unique id (as text), made by rank 0 and handed to every rank.
  std::string (*make_collective_id)();
  /// Joins the NCCL group `id` of `world` ranks as `rank`, on `dev`'s stream; every rank
  /// joins at once. Throws `worker_died` when the others do not join within `timeout`.
  std::unique_ptr<communicator> (*join_collective)(device& dev, int rank, int world,
                                                   const std::string& id,
                                                   std::chrono::milliseconds timeout);
  /// A weight-update group's member on GPU `gpu`, to `join` next; `timeout` bounds the
  /// join and each broadcast. Throws `invalid_argument` for a GPU that does not exist.
  std::unique_ptr<gpu_broadcaster> (*make_broadcaster)(int32_t gpu,
                                                       std::chrono::milliseconds timeout);
  /// Pinned host memory of `bytes` (as the sleep backups use); nullptr when none is left.
  void* (*allocate_pinned)(std::size_t bytes);
  /// Frees memory from `allocate_pinned`.
  void (*free_pinned)(void* ptr);
};

/// The CUDA module, loaded on the first call (from the directory of the troupe library,
/// else from the loader's search path). Throws `troupe::error` (`unsupported`) saying why
/// when this build has no CUDA device or the module cannot be loaded.
const cuda_module& cuda();

/// Whether `dev` is a GPU made by the CUDA module.
bool is_cuda(const device& dev);

} // namespace troupe
