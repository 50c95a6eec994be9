#include "kernels/cpu/cpu_device.hpp"

#include "troupe/errors.hpp"
#include "kernels/host_pages.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

namespace troupe {

namespace {

[[noreturn]] void fail(const char* call, std::size_t bytes) {
  throw error{errc::memory_error, std::string{"cpu device: "} + call + " of " +
                                    std::to_string(bytes) +
                                    " bytes failed: " + std::strerror(errno)};
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

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 // Linux 5.14
#endif

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

} // namespace

cpu_device::cpu_device(int32_t index) : index_(index) {}

cpu_device::~cpu_device() {
  free_all();
}

std::string cpu_device::name() const {
  return "cpu:" + std::to_string(index_);
}

void* cpu_device::map_new(region& r) {
  r.mapped = round_to_host_pages(r.requested == 0 ? 1 : r.requested);
  return reserve(r.mapped, r.tag == memory_tag::weights);
}

void* cpu_device::map_file_region(region& r, int fd, std::size_t offset, bool shared) {
  r.mapped = round_to_host_pages(r.requested == 0 ? 1 : r.requested);
  // A private mapping is mapped whole right away (its pages are the page cache's: one call
  // beats a fault per page), read-only while it is: populating a writable private mapping
  // copies every page, as if written. A shared one is about to be written.
  // At an address that is the file offset modulo 2 MiB, so that the page cache's huge
  // folios map whole (one TLB entry where 512 small pages would take 512: decode reads
  // every weight each step).
  constexpr std::size_t huge = std::size_t{2} << 20;
  auto room =
    mmap(nullptr, r.mapped + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (room == MAP_FAILED)
    fail("mmap", r.mapped + huge);
  auto start = reinterpret_cast<uintptr_t>(room);
  auto at = start + ((offset % huge) + huge - start % huge) % huge;
  if (at > start)
    munmap(room, at - start);
  if (auto tail = start + r.mapped + huge - (at + r.mapped); tail > 0)
    munmap(reinterpret_cast<void*>(at + r.mapped), tail);
  auto ptr =
    mmap(reinterpret_cast<void*>(at), r.mapped, shared ? PROT_READ | PROT_WRITE : PROT_READ,
         MAP_FIXED | (shared ? MAP_SHARED : MAP_PRIVATE), fd, static_cast<off_t>(offset));
  if (ptr == MAP_FAILED) {
    auto err = errno;
    munmap(reinterpret_cast<void*>(at), r.mapped);
    errno = err;
    fail("mmap of a file", r.mapped);
  }
  // Pages the file has yet to get in the page cache come as huge folios (advice only).
  madvise(ptr, r.mapped, MADV_HUGEPAGE);
  if (!shared)
    madvise(ptr, r.mapped, MADV_POPULATE_READ);
  if (!shared && mprotect(ptr, r.mapped, PROT_READ | PROT_WRITE) != 0) {
    auto err = errno;
    munmap(ptr, r.mapped);
    errno = err;
    fail("mprotect of a file's mapping", r.mapped);
  }
  r.file = true;
  return ptr;
}

void cpu_device::free_region(void* ptr, region& r) noexcept {
  munmap(ptr, r.mapped);
  if (r.backup != nullptr)
    munmap(r.backup, r.mapped);
}

// The host backup of memory that is host memory already is the weights' own pages, moved
// out of the device's range: a copy would fill fresh pages with the same bytes.
void cpu_device::back_up(void* ptr, region& r) {
  r.backup = move_pages(ptr, r.mapped);
  r.backed_up = true;
}

void cpu_device::undo_backup(void* ptr, region& r) {
  move_back(r.backup, ptr, r.mapped);
  r.backup = nullptr;
  r.backed_up = false;
}

void cpu_device::release(void* ptr, region& r) {
  if (r.file && !r.backed_up) {
    // A file's pages would come back with the file's contents, not the zeros a wake-up
    // without a backup promises: the range becomes anonymous memory, with no pages.
    if (mmap(ptr, r.mapped, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1,
             0) == MAP_FAILED)
      fail("mmap over a file's range", r.mapped);
    if (r.tag == memory_tag::weights)
      madvise(ptr, r.mapped, MADV_HUGEPAGE);
    r.file = false;
    return;
  }
  // A backed-up file's range (left mapped by the move) goes the same way: the backup holds
  // its pages, and the wake-up moves them back over it.
  release_pages(ptr, r.mapped);
  protect(ptr, r.mapped, PROT_NONE);
}

void cpu_device::restore(void* ptr, region& r) {
  protect(ptr, r.mapped, PROT_READ | PROT_WRITE);
  if (r.backed_up) {
    undo_backup(ptr, r);
  } else if (!populate(ptr, r.mapped)) {
    // Backing every page again gives the promised zeros (populated pages are zeroed; where
    // the kernel cannot populate, writing them does it).
    std::memset(ptr, 0, r.mapped);
  }
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
