#include "kernels/tagged_pool.hpp"

#include "troupe/errors.hpp"

#include <utility>

namespace troupe {

namespace {

void check_tag(memory_tag tag) {
  if (static_cast<std::size_t>(tag) >= std::size(all_memory_tags))
    throw error{errc::invalid_argument,
                "unknown memory tag " + std::to_string(static_cast<int>(tag))};
}

} // namespace

void tagged_pool::check_awake(memory_tag tag) const {
  check_tag(tag);
  if (asleep(tag))
    throw error{errc::sleeping,
                name() + ": cannot allocate under tag '" + to_string(tag) + "' while it sleeps"};
}

void* tagged_pool::allocate(std::size_t bytes, memory_tag tag) {
  check_awake(tag);
  region r;
  r.requested = bytes;
  r.tag = tag;
  auto ptr = map_new(r);
  regions_.emplace(ptr, r);
  return ptr;
}

void* tagged_pool::map_file(int fd, std::size_t offset, std::size_t bytes, memory_tag tag,
                            bool shared) {
  check_awake(tag);
  region r;
  r.requested = bytes;
  r.tag = tag;
  auto ptr = map_file_region(r, fd, offset, shared);
  if (ptr != nullptr)
    regions_.emplace(ptr, r);
  return ptr;
}

void tagged_pool::deallocate(void* ptr) noexcept {
  auto i = regions_.find(ptr);
  if (i == regions_.end())
    return;
  free_region(ptr, i->second);
  regions_.erase(i);
}

void tagged_pool::free_all() noexcept {
  for (auto& [ptr, r] : regions_)
    free_region(ptr, r);
  regions_.clear();
}

void tagged_pool::sleep(sleep_level level) {
  settle(); // kernels may still use the memory
  // Backups first (they can fail for want of memory), then the releases, so that a failure
  // leaves the device as it was.
  std::vector<std::pair<void*, region*>> saved;
  try {
    for (auto& [ptr, r] : regions_) {
      if (asleep(r.tag) || level != sleep_level::offload_weights || r.tag != memory_tag::weights)
        continue;
      back_up(ptr, r);
      saved.emplace_back(ptr, &r);
    }
    settle();
  } catch (...) {
    for (auto& [ptr, r] : saved)
      undo_backup(ptr, *r);
    throw;
  }
  for (auto& [ptr, r] : regions_)
    if (!asleep(r.tag))
      release(ptr, r);
  asleep_.fill(true);
}

void tagged_pool::wake_up(const std::vector<memory_tag>& tags) {
  for (auto tag : tags)
    check_tag(tag);
  for (auto tag : tags.empty() ? sleeping_tags() : tags) {
    if (!asleep(tag))
      continue;
    for (auto& [ptr, r] : regions_)
      if (r.tag == tag)
        restore(ptr, r);
    settle();
    asleep_[static_cast<std::size_t>(tag)] = false;
  }
}

std::vector<memory_tag> tagged_pool::sleeping_tags() const {
  std::vector<memory_tag> out;
  for (auto tag : all_memory_tags)
    if (asleep(tag))
      out.push_back(tag);
  return out;
}

std::vector<memory_usage> tagged_pool::usage() const {
  std::vector<memory_usage> out;
  for (auto tag : all_memory_tags) {
    memory_usage u;
    u.tag = tag;
    for (auto& [ptr, r] : regions_) {
      if (r.tag != tag)
        continue;
      u.allocated_bytes += static_cast<int64_t>(r.requested);
      if (!asleep(tag))
        u.resident_bytes += static_cast<int64_t>(r.requested);
      if (r.backed_up)
        u.backup_bytes += static_cast<int64_t>(r.requested);
    }
    out.push_back(u);
  }
  return out;
}

} // namespace troupe
