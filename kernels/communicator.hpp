#pragma once

/// @file
/// What a tensor-parallel rank needs of its group once it is connected: one sum.

#include <cstddef>
#include <string>

namespace troupe {

/// A connected rank of a tensor-parallel group: in-process memory, Gloo over TCP, or NCCL.
/// Bootstrapping differs by kind (see each implementation); summing does not.
class communicator {
public:
  virtual ~communicator();

  /// Sums `count` floats over the group, in place; every rank gets the same values. Throws
  /// `troupe::error` when a rank does not take part (gone, or past the group's timeout).
  virtual void all_reduce(float* data, std::size_t count) = 0;

  /// Makes the rank's wait in a reduction, now or later, fail at once with
  /// `worker_died` naming `why`: a peer is known to be gone, and the group is done. Any
  /// thread may call it while another reduces; the group must be formed anew afterwards.
  virtual void abort(const std::string& why) noexcept = 0;
};

} // namespace troupe
