#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <string>

namespace troupe {

/// One rank of an NCCL communicator on GPUs: tensor parallelism's sums, and the broadcasts
/// of a weight-update group. The unique id is made by rank 0 (`make_id`) and handed to
/// every rank (through collective_rpc, or the weight-update group's meeting), so all ranks
/// initialise concurrently. The communicator is non-blocking: initialisation and every
/// collective are polled against a deadline, and a peer that never joins or died mid-call
/// makes this rank abort the communicator and throw `errc::worker_died` instead of hanging.
class nccl_communicator {
public:
  /// A fresh unique id, as hex text.
  static std::string make_id();

  /// Joins the communicator of `world` ranks named by `id` as `rank`, on the current
  /// device. Throws `worker_died` when the others have not joined within `timeout`,
  /// `invalid_argument` for a malformed id.
  nccl_communicator(int rank, int world, const std::string& id, std::chrono::milliseconds timeout);
  ~nccl_communicator();

  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;

  /// Sums `count` floats over the ranks, in place, on `stream`, and waits for it. Throws
  /// `worker_died` (after aborting) when it does not finish within the timeout.
  void all_reduce(float* data, std::size_t count, cudaStream_t stream);

  /// Copies `bytes` of GPU memory at `data` on rank `root` to `data` on every other rank,
  /// on `stream`, and waits for it; fails as `all_reduce` does.
  void broadcast(void* data, std::size_t bytes, int root, cudaStream_t stream);

  int rank() const {
    return rank_;
  }

  /// Aborts the communicator: pending and later calls fail.
  void abort() noexcept;

  /// From any thread: the all-reduce this rank waits for, or its next one, aborts the
  /// communicator and throws `worker_died` naming `why`.
  void request_abort(const std::string& why) noexcept;

private:
  /// Polls until the communicator's pending work is done, `done()` holds, or the deadline.
  template <class Done>
  void wait(const char* what, Done done);

  /// Waits for the collective `what` that was queued on `stream` (`queued`: NCCL's answer).
  void finish(const char* what, ncclResult_t queued, cudaStream_t stream);

  ncclComm_t comm_ = nullptr;
  int rank_;
  int world_;
  std::chrono::milliseconds timeout_;
  std::atomic<bool> abort_requested_{false};
  std::mutex why_mtx_;
  std::string why_;
};

} // namespace troupe
