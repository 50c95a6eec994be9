#include "kernels/platform.hpp"

#include "kernels/cpu/gloo_communicator.hpp"
#include "kernels/cpu/local_communicator.hpp"
#include "kernels/cpu/ops.hpp"
#include "kernels/cuda_module.hpp"
#include "troupe/errors.hpp"

#include <algorithm>
#include <thread>

namespace troupe {

collective_bootstrap::~collective_bootstrap() = default;

platform::~platform() = default;

namespace {

/// Gloo over TCP; memory instead when every rank lives in this process.
class cpu_bootstrap final : public collective_bootstrap {
public:
  cpu_bootstrap(int rank, int world, const std::string& host, std::chrono::milliseconds timeout)
    : rank_(rank), world_(world), timeout_(timeout),
      gloo_(std::make_unique<gloo_communicator>(rank, world, host, timeout)) {}

  std::vector<std::string> prepare() override {
    auto addresses = gloo_->prepare();
    // The entry for itself, which Gloo leaves empty, names this process.
    addresses[static_cast<size_t>(rank_)] = process_token();
    return addresses;
  }

  std::unique_ptr<communicator>
  connect(const std::vector<std::vector<std::string>>& table) override {
    if (!gloo_)
      throw error{errc::invalid_argument, "connect_collective: this rank is connected already"};
    bool one_process = true;
    for (size_t j = 0; j < table.size(); ++j)
      one_process = one_process && j < table[j].size() && table[j][j] == process_token();
    if (one_process && table.size() > 1 && table[0].size() > 1) {
      // Rank 0's address for its pair with rank 1 is fresh for each group: the meeting
      // point of its ranks.
      gloo_.reset();
      return std::make_unique<local_communicator>(rank_, world_, table[0][1], timeout_);
    }
    gloo_->connect(table);
    return std::move(gloo_);
  }

private:
  int rank_;
  int world_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<gloo_communicator> gloo_;
};

class cpu_platform final : public platform {
public:
  std::optional<dtype> auto_weight_type(const std::string&) const override {
    return std::nullopt; // the CPU kernels compute on every stored format
  }
  bool measures_memory() const override {
    return false;
  }
  void share(int workers) const override {
    // Each GEMM gets its share of the cores.
    cpu::set_gemm_threads(static_cast<int>(std::thread::hardware_concurrency()) /
                          std::max(1, workers));
  }
  std::unique_ptr<collective_bootstrap>
  collective(device&, int rank, int world, const std::string& host,
             std::chrono::milliseconds timeout) const override {
    return std::make_unique<cpu_bootstrap>(rank, world, host, timeout);
  }
};

/// NCCL: rank 0 makes the group's unique id, every rank joins with it.
class cuda_bootstrap final : public collective_bootstrap {
public:
  cuda_bootstrap(device& dev, int rank, int world, std::chrono::milliseconds timeout)
    : dev_(dev), rank_(rank), world_(world), timeout_(timeout) {}

  std::vector<std::string> prepare() override {
    if (rank_ == 0)
      return {cuda().make_collective_id()};
    return {};
  }

  std::unique_ptr<communicator>
  connect(const std::vector<std::vector<std::string>>& table) override {
    if (table.empty() || table[0].size() != 1)
      throw error{errc::invalid_argument,
                  "connect_collective: rank 0's entry must hold the NCCL unique id"};
    // NCCL's init returns only when every rank has joined.
    return cuda().join_collective(dev_, rank_, world_, table[0][0], timeout_);
  }

private:
  device& dev_;
  int rank_;
  int world_;
  std::chrono::milliseconds timeout_;
};

class cuda_platform final : public platform {
public:
  std::optional<dtype> auto_weight_type(const std::string& torch_dtype) const override {
    return torch_dtype == "bfloat16" ? dtype::bf16 : dtype::f16;
  }
  bool measures_memory() const override {
    return true;
  }
  void share(int) const override {} // one GPU per worker
  std::unique_ptr<collective_bootstrap>
  collective(device& dev, int rank, int world, const std::string&,
             std::chrono::milliseconds timeout) const override {
    return std::make_unique<cuda_bootstrap>(dev, rank, world, timeout);
  }
};

} // namespace

const platform& platform_of(const device& dev) {
  static const cpu_platform cpu;
  static const cuda_platform gpu;
  if (is_cuda(dev))
    return gpu;
  return cpu;
}

} // namespace troupe
