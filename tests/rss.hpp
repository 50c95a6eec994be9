#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/mman.h>
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

/// Bytes of [data, data + size) that the kernel holds in RAM (mincore): what really is
/// resident, whatever the pool's own accounting says.
inline int64_t resident_bytes(const void* data, size_t size) {
  if (!data || size == 0)
    return 0;
  auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  auto begin = reinterpret_cast<uintptr_t>(data) & ~(page - 1);
  auto end = reinterpret_cast<uintptr_t>(data) + size;
  std::vector<unsigned char> pages((end - begin + page - 1) / page);
  if (mincore(reinterpret_cast<void*>(begin), end - begin, pages.data()) != 0)
    throw std::runtime_error(std::string{"mincore: "} + std::strerror(errno));
  auto held = std::count_if(pages.begin(), pages.end(), [](unsigned char p) { return p & 1; });
  return static_cast<int64_t>(held) * static_cast<int64_t>(page);
}

} // namespace troupe::testing
