#pragma once

/// @file
/// Memory the engine's next host phase reads, noted while it is in the caches and asked
/// for all at once when that phase begins. Between two steps the workers' attention
/// streams the KV cache through every cache level: at long lengths the engine then found
/// each request's state in memory, one miss after another, and its time per step grew
/// with the length of the sequences though its work did not. Prefetches never fault, so a
/// span freed meanwhile costs a wasted fetch at worst.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace troupe {

class hot_set {
public:
  void clear() {
    spans_.clear();
  }

  /// `bytes` from `at`.
  void add(const void* at, size_t bytes) {
    spans_.push_back({static_cast<const char*>(at), bytes});
  }

  /// The whole of `x`.
  template <class T>
  void add(const T& x) {
    add(&x, sizeof(T));
  }

  /// The whole of `x`, an element of a node-based container, with the node's links that
  /// precede it (a tree node's: colour, parent and children).
  template <class T>
  void add_node(const T& x) {
    constexpr size_t links = 4 * sizeof(void*);
    add(reinterpret_cast<const char*>(&x) - links, sizeof(T) + links);
  }

  /// The last element of `v` and the one a `push_back` writes next.
  template <class T>
  void add_end(const std::vector<T>& v) {
    if (v.capacity() > 0)
      add(v.data() + (v.empty() ? 0 : v.size() - 1), 2 * sizeof(T));
  }

  /// Asks for every line of every span (to be written, as most are).
  void prefetch() const {
    constexpr size_t line = 64;
    for (auto& s : spans_) {
      auto first = reinterpret_cast<uintptr_t>(s.at) & ~uintptr_t{line - 1};
      auto end = reinterpret_cast<uintptr_t>(s.at) + s.bytes;
      for (auto p = first; p < end; p += line)
        __builtin_prefetch(reinterpret_cast<const void*>(p), 1);
    }
  }

private:
  struct span {
    const char* at;
    size_t bytes;
  };
  std::vector<span> spans_;
};

} // namespace troupe
