#pragma once

/// @file
/// What a model worker needs of a kind of device beyond its memory and its kernels: the
/// weight type `--dtype auto` means, how a step's memory is known, how workers of one
/// process share it, and how the ranks of a tensor-parallel group connect. The worker asks
/// the device's platform, so it never branches on the kind itself.

#include "kernels/communicator.hpp"
#include "kernels/dtype.hpp"
#include "troupe/device.hpp"

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace troupe {

/// One rank of a tensor-parallel group finding the others: `prepare` gives this rank's
/// entry of the table, the executor gathers every rank's entry and hands the table to all
/// of them, and `connect` joins the group (every rank at once).
class collective_bootstrap {
public:
  virtual ~collective_bootstrap();

  virtual std::vector<std::string> prepare() = 0;
  /// `table[j]`: rank j's entry. Throws `troupe::error` naming what is wrong with it, or
  /// `worker_died` when the others do not join in time.
  virtual std::unique_ptr<communicator>
  connect(const std::vector<std::vector<std::string>>& table) = 0;
};

class platform {
public:
  virtual ~platform();

  /// The weight type `--dtype auto` computes with for a checkpoint saved as `torch_dtype`;
  /// nullopt: the types the checkpoint stores (block formats, 16-bit floats).
  virtual std::optional<dtype> auto_weight_type(const std::string& torch_dtype) const = 0;

  /// Whether a step's memory is measured by running the widest step, and the KV cache
  /// takes `gpu_memory_utilization` of the device less what is in use (a GPU: libraries and
  /// allocators keep what they take); else the step's memory is its workspace, computed.
  virtual bool measures_memory() const = 0;

  /// Shares the device among the `workers` workers of one process.
  virtual void share(int workers) const = 0;

  /// How rank `rank` of `world` ranks on `dev` connects to its group: peers listen on
  /// `host`; joining waits at most `timeout`.
  virtual std::unique_ptr<collective_bootstrap>
  collective(device& dev, int rank, int world, const std::string& host,
             std::chrono::milliseconds timeout) const = 0;
};

/// The platform of `dev`'s kind.
const platform& platform_of(const device& dev);

} // namespace troupe
