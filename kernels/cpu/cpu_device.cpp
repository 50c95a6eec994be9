#include "kernels/cpu/cpu_device.hpp"

#include "troupe/errors.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

namespace troupe {

namespace {

std::size_t page_size() {
  static const auto size = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

std::size_t round_to_pages(std::size_t bytes) {
  auto page = page_size();
  return ((bytes + page - 1) / page) * page;
}

[[noreturn]] void fail(const char* call, std::size_t bytes) {
  throw error{errc::memory_error, std::string{"cpu device: "} + call + " of " +
                                    std::to_string(bytes) + " bytes failed: " +
                                    std::strerror(errno)};
}

/// `huge`: the range is used whole (weights), so huge pages cost nothing extra and a 2 MiB
/// page faults in once where 512 small ones fault one by one. A sparsely used range (the KV
/// cache, the step's workspace) keeps small pages: a huge one would make each touch cost
/// 2 MiB. Advice only: where the kernel refuses it, nothing changes.
void* reserve(std::size_t bytes, bool huge) {
  auto ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (ptr == MAP_FAILED)
    fail("mmap", bytes);
  if (huge)
    madvise(ptr, bytes, MADV_HUGEPAGE);
  return ptr;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 // Linux 5.14
#endif

/// Backs a range with (zeroed) pages before it is written, in one call rather than a fault
/// per page. False where an older kernel refuses the advice: the pages then fault in as the
/// range is written.
bool populate(void* ptr, std::size_t bytes) {
  return madvise(ptr, bytes, MADV_POPULATE_WRITE) == 0;
}

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4 // Linux 5.7
#endif

/// Moves the pages of [ptr, ptr + bytes) to a new range and returns it; the old range stays
/// mapped, with no pages. Nothing is copied or zeroed: only page tables change.
void* move_pages(void* ptr, std::size_t bytes) {
  // The new address is passed (as no hint) although the kernel takes it only with
  // MREMAP_FIXED: glibc reads it for MREMAP_DONTUNMAP too, and would pass whatever the
  // register held.
  auto moved = mremap(ptr, bytes, bytes, MREMAP_MAYMOVE | MREMAP_DONTUNMAP, nullptr);
  if (moved == MAP_FAILED)
    fail("mremap(MREMAP_DONTUNMAP, Linux 5.7 or later)", bytes);
  return moved;
}

/// Moves the pages of `from` back over `to`, replacing what is mapped there; `from` goes.
void move_back(void* from, void* to, std::size_t bytes) {
  if (mremap(from, bytes, bytes, MREMAP_MAYMOVE | MREMAP_FIXED, to) == MAP_FAILED)
    fail("mremap", bytes);
}

// Returns the pages to the OS; the range stays reserved and reads back as zeros.
void release_pages(void* ptr, std::size_t bytes) {
  if (madvise(ptr, bytes, MADV_DONTNEED) != 0)
    fail("madvise(MADV_DONTNEED)", bytes);
}

void protect(void* ptr, std::size_t bytes, int prot) {
  if (mprotect(ptr, bytes, prot) != 0)
    fail("mprotect", bytes);
}

void check_tag(memory_tag tag) {
  if (static_cast<size_t>(tag) >= std::size(all_memory_tags))
    throw error{errc::invalid_argument,
                "unknown memory tag " + std::to_string(static_cast<int>(tag))};
}

} // namespace

cpu_device::cpu_device(int32_t index) : index_(index) {
  // nop
}

cpu_device::~cpu_device() {
  for (auto& [ptr, alloc] : allocations_) {
    munmap(ptr, alloc.mapped);
    if (alloc.backup != nullptr)
      munmap(alloc.backup, alloc.mapped);
  }
}

std::string cpu_device::name() const {
  return "cpu:" + std::to_string(index_);
}

void* cpu_device::allocate(std::size_t bytes, memory_tag tag) {
  check_tag(tag);
  if (tags_[index_of(tag)].asleep)
    throw error{errc::sleeping, std::string{"cpu device: cannot allocate under tag '"} +
                                  to_string(tag) + "' while it sleeps"};
  auto mapped = round_to_pages(bytes == 0 ? 1 : bytes);
  auto ptr = reserve(mapped, tag == memory_tag::weights);
  allocations_.emplace(ptr, allocation{bytes, mapped, tag, nullptr});
  return ptr;
}

void cpu_device::deallocate(void* ptr) noexcept {
  auto i = allocations_.find(ptr);
  if (i == allocations_.end())
    return;
  munmap(ptr, i->second.mapped);
  if (i->second.backup != nullptr)
    munmap(i->second.backup, i->second.mapped);
  allocations_.erase(i);
}

void cpu_device::sleep(int32_t level) {
  if (level != 1 && level != 2)
    throw error{errc::invalid_argument,
                "sleep level must be 1 or 2, got " + std::to_string(level)};
  // First every backup (the step that can fail for want of memory), then the releases, so
  // that a failure leaves all memory as it was. The host backup of memory that is host
  // memory already is the weights' own pages, moved out of the device's range: a copy
  // would fill fresh pages with the same bytes.
  std::vector<std::pair<void*, allocation*>> moved;
  try {
    for (auto& [ptr, alloc] : allocations_) {
      if (tags_[index_of(alloc.tag)].asleep)
        continue;
      if (level != 1 || alloc.tag != memory_tag::weights)
        continue;
      alloc.backup = move_pages(ptr, alloc.mapped);
      moved.emplace_back(ptr, &alloc);
    }
  } catch (...) {
    for (auto& [ptr, alloc] : moved) {
      move_back(alloc->backup, ptr, alloc->mapped);
      alloc->backup = nullptr;
    }
    throw;
  }
  for (auto& [ptr, alloc] : allocations_) {
    if (tags_[index_of(alloc.tag)].asleep)
      continue;
    release_pages(ptr, alloc.mapped);
    protect(ptr, alloc.mapped, PROT_NONE);
  }
  for (auto& state : tags_) {
    if (!state.asleep) {
      state.asleep = true;
      state.level = level;
    }
  }
}

void cpu_device::wake_up(const std::vector<memory_tag>& tags) {
  for (auto tag : tags)
    check_tag(tag);
  auto wanted = tags.empty() ? sleeping_tags() : tags;
  for (auto tag : wanted) {
    auto& state = tags_[index_of(tag)];
    if (!state.asleep)
      continue;
    for (auto& [ptr, alloc] : allocations_) {
      if (alloc.tag != tag)
        continue;
      protect(ptr, alloc.mapped, PROT_READ | PROT_WRITE);
      if (alloc.backup != nullptr) {
        move_back(alloc.backup, ptr, alloc.mapped);
        alloc.backup = nullptr;
      } else {
        // Backing every page again gives the promised zeros (populated pages are zeroed;
        // where the kernel cannot populate, writing them does it).
        if (!populate(ptr, alloc.mapped))
          std::memset(ptr, 0, alloc.mapped);
      }
    }
    state.asleep = false;
    state.level = 0;
  }
}

std::vector<memory_tag> cpu_device::sleeping_tags() const {
  std::vector<memory_tag> result;
  for (auto tag : all_memory_tags)
    if (tags_[index_of(tag)].asleep)
      result.push_back(tag);
  return result;
}

std::vector<memory_usage> cpu_device::usage() const {
  std::vector<memory_usage> result;
  for (auto tag : all_memory_tags) {
    memory_usage u;
    u.tag = tag;
    for (auto& [ptr, alloc] : allocations_) {
      if (alloc.tag != tag)
        continue;
      u.allocated_bytes += static_cast<int64_t>(alloc.requested);
      if (!tags_[index_of(tag)].asleep)
        u.resident_bytes += static_cast<int64_t>(alloc.requested);
      if (alloc.backup != nullptr)
        u.backup_bytes += static_cast<int64_t>(alloc.requested);
    }
    result.push_back(u);
  }
  return result;
}

void cpu_device::copy(void* dst, const void* src, std::size_t bytes) {
  std::memmove(dst, src, bytes);
}

namespace {

/// A `/proc/meminfo` entry in bytes (0 when missing).
std::size_t meminfo_bytes(const std::string& wanted) {
  std::ifstream meminfo{"/proc/meminfo"};
  std::string key;
  std::size_t value = 0;
  std::string unit;
  while (meminfo >> key >> value >> unit)
    if (key == wanted)
      return value * 1024;
  return 0;
}

} // namespace

std::size_t cpu_device::free_memory() const {
  return meminfo_bytes("MemAvailable:");
}

std::size_t cpu_device::total_memory() const {
  return meminfo_bytes("MemTotal:");
}

} // namespace troupe
