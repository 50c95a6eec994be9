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
    add(reinterpret_cast<uintptr_t>(at), bytes);
  }

  /// The whole of `x`.
  template <class T>
  void add(const T& x) {
    add(&x, sizeof(T));
  }

  /// The whole of `x`, an element of a `std::map` or `std::set` (a `value_type`), with the
  /// tree node's links that precede it (colour, parent and children).
  template <class T>
  void add_tree_node(const T& x) {
    constexpr size_t links = 4 * sizeof(void*);
    add(reinterpret_cast<uintptr_t>(&x) - links, sizeof(T) + links);
  }

  /// The whole of `x`, an element of a `std::unordered_map` (a `value_type`), with the
  /// node's link that precedes it.
  template <class T>
  void add_hash_node(const T& x) {
    add(reinterpret_cast<uintptr_t>(&x) - sizeof(void*), sizeof(T) + sizeof(void*));
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
      auto first = s.at & ~uintptr_t{line - 1};
      auto end = s.at + s.bytes;
      for (auto p = first; p < end; p += line)
        __builtin_prefetch(reinterpret_cast<const void*>(p), 1);
    }
  }

private:
  // Addresses as integers: a node's links lie before the element handed in, and pointer
  // arithmetic may not step outside an object.
  void add(uintptr_t at, size_t bytes) {
    spans_.push_back({at, bytes});
  }

  struct span {
    uintptr_t at;
    size_t bytes;
  };
  std::vector<span> spans_;
};

} // namespace troupe
