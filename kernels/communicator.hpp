#pragma once

/// @file
/// What a tensor-parallel rank needs of its group once it is connected: one sum.

#include <cstddef>

namespace troupe {

/// A connected rank of a tensor-parallel group: in-process memory, Gloo over TCP, or NCCL.
/// Bootstrapping differs by kind (see each implementation); summing does not.
class communicator {
public:
  virtual ~communicator();

  /// Sums `count` floats over the group, in place; every rank gets the same values. Throws
  /// `troupe::error` when a rank does not take part (gone, or past the group's timeout).
  virtual void all_reduce(float* data, std::size_t count) = 0;
};

} // namespace troupe
