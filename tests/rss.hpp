#pragma once

#include <cstdint>
#include <fstream>

#include <unistd.h>

namespace troupe::testing {

/// Resident set size of this process in bytes.
inline int64_t rss_bytes() {
  std::ifstream statm{"/proc/self/statm"};
  int64_t size = 0;
  int64_t resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

} // namespace troupe::testing
