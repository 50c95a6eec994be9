#pragma once

/// @file
/// The host's memory pages, for the code that maps or advises memory: the CPU device, mapped
/// checkpoint files, the weight cache.

#include <cstddef>

#include <unistd.h>

namespace troupe {

/// Bytes of a host memory page, asked of the system once.
inline std::size_t host_page_size() {
  static const auto size = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

/// `bytes` rounded up to whole host pages.
inline std::size_t round_to_host_pages(std::size_t bytes) {
  auto page = host_page_size();
  return (bytes + page - 1) / page * page;
}

} // namespace troupe
