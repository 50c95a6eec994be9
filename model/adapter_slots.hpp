#pragma once

#include "troupe/errors.hpp"

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace troupe {

/// A worker's adapters of one kind (LoRA or prompt adapters), after vLLM's LRU adapter
/// manager: `capacity` slots of loaded weights; adding to a full set evicts the least
/// recently used adapter that is not pinned, and fails when every slot is pinned. An
/// evicted adapter stays known (its request is kept), so a step that names it loads it
/// again; `remove` forgets it.
template <class Request, class Loaded>
class adapter_slots {
public:
  using loader = std::function<Loaded(const Request&)>;

  /// `kind` names the adapters in errors ("LoRA", "prompt adapter").
  adapter_slots(std::string kind, size_t capacity) : kind_(std::move(kind)), capacity_(capacity) {}

  /// Loads `request` under `id` unless it is loaded already (then only marks it used).
  /// The adapter is loaded before anything is evicted, so a bad one costs no slot.
  void add(int64_t id, const Request& request, const loader& load) {
    auto i = known_.find(id);
    if (i != known_.end() && i->second.loaded) {
      i->second.last_used = ++clock_;
      return;
    }
    bring_in(id, load(request), {}).request = request;
  }

  /// Unloads and forgets `id`; false when it was not known.
  bool remove(int64_t id) {
    return known_.erase(id) > 0;
  }

  /// Exempts an adapter from eviction, loading it again first when it was evicted. Throws
  /// `invalid_argument` when it was never added (or was removed).
  void pin(int64_t id, const loader& load) {
    auto i = known_.find(id);
    if (i == known_.end())
      throw error{errc::invalid_argument,
                  kind_ + " " + std::to_string(id) + " is not loaded; add it before pinning"};
    if (!i->second.loaded)
      bring_in(id, load(i->second.request), {});
    i->second.pinned = true;
  }

  /// Loaded adapter ids, ascending.
  std::vector<int64_t> list() const {
    std::vector<int64_t> ids;
    for (auto& [id, e] : known_)
      if (e.loaded)
        ids.push_back(id);
    return ids;
  }

  /// The loaded adapters of the ids one step uses (id 0: none, null), loading known ones
  /// that were evicted without evicting another of the step. Throws `invalid_argument` for
  /// an id never added (or removed), or more distinct ids than slots.
  std::map<int64_t, const Loaded*> use(const std::set<int64_t>& ids, const loader& load) {
    std::set<int64_t> needed;
    for (auto id : ids)
      if (id != 0)
        needed.insert(id);
    if (needed.size() > capacity_)
      throw error{errc::invalid_argument, "a step uses " + std::to_string(needed.size()) + " " +
                                            kind_ + "s; there are " + std::to_string(capacity_) +
                                            " slots"};
    for (auto id : needed)
      if (known_.count(id) == 0)
        throw error{errc::invalid_argument,
                    kind_ + " " + std::to_string(id) + " was not added (or was removed)"};
    std::map<int64_t, const Loaded*> out{{0, nullptr}};
    for (auto id : needed) {
      auto& e = known_.at(id);
      if (e.loaded)
        e.last_used = ++clock_;
      else
        bring_in(id, load(e.request), needed);
      out[id] = &*e.loaded;
    }
    return out;
  }

  /// Loads every loaded adapter again from its request (their memory was discarded). One
  /// that fails is unloaded (a later step loads it again or says why not), the others are
  /// still reloaded; returns the first failure (null when none).
  std::exception_ptr reload(const loader& load) {
    std::exception_ptr first;
    for (auto& [id, e] : known_) {
      if (!e.loaded)
        continue;
      try {
        e.loaded = load(e.request);
      } catch (...) {
        e.loaded.reset();
        if (!first)
          first = std::current_exception();
      }
    }
    return first;
  }

private:
  struct entry {
    Request request;
    std::optional<Loaded> loaded;
    bool pinned = false;
    uint64_t last_used = 0;
  };

  /// Puts a freshly loaded adapter into a slot under `id`, making room first (the adapters
  /// in `keep` stay; when that fails nothing changes), and marks it used.
  entry& bring_in(int64_t id, Loaded loaded, const std::set<int64_t>& keep) {
    make_room(keep);
    auto& e = known_[id];
    e.loaded = std::move(loaded);
    e.last_used = ++clock_;
    return e;
  }

  /// Frees a slot when all are taken, evicting the least recently used adapter that is
  /// neither pinned nor in `keep`.
  void make_room(const std::set<int64_t>& keep) {
    size_t used = 0;
    entry* victim = nullptr;
    for (auto& [id, e] : known_) {
      if (!e.loaded)
        continue;
      ++used;
      if (!e.pinned && keep.count(id) == 0 && (!victim || e.last_used < victim->last_used))
        victim = &e;
    }
    if (used < capacity_)
      return;
    if (!victim)
      throw error{errc::invalid_argument, "every one of the " + std::to_string(capacity_) + " " +
                                            kind_ + " slots holds a pinned adapter" +
                                            (keep.empty() ? "" : " or one this step uses") +
                                            "; remove one first"};
    victim->loaded.reset();
  }

  std::string kind_;
  size_t capacity_;
  std::map<int64_t, entry> known_;
  uint64_t clock_ = 0;
};

} // namespace troupe
