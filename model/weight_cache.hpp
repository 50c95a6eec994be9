#pragma once

/// @file
/// Weights kept in files in the form a device computes on (the CPU's packed layout), so that
/// a later start maps them from the page cache instead of reading the checkpoint, packing it
/// and writing fresh memory. One file per model, rank and layout, named after them
/// (`<directory>/<hash>.weights`): a header that names the model's files as they were and
/// the layout, then the weights.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace troupe {

/// What a cache file holds.
struct weight_cache_key {
  /// The model (its path), whose file a later one replaces when `layout` is the same.
  std::string model;
  /// The model's files as they are now (`checkpoint::identity`): a file changed since makes
  /// a cache file stale.
  std::string files;
  /// Where each weight lies in the buffer, and in which form.
  std::string layout;
};

/// One file of a weight cache, open.
class weight_cache_file {
public:
  /// The file for `key` in `directory` when its header holds exactly `key` and `bytes` of
  /// weights follow; nullopt otherwise (none yet, a model file changed since, a short file).
  static std::optional<weight_cache_file> find(const std::string& directory,
                                               const weight_cache_key& key, std::size_t bytes);

  /// A new file in `directory` (made if missing) with its header written and room for
  /// `bytes` of weights, unnamed until `commit`: it vanishes with the process until then.
  /// nullopt, with a warning in the log, where the directory cannot be written or the disk
  /// lacks the room.
  static std::optional<weight_cache_file> create(const std::string& directory,
                                                 const weight_cache_key& key, std::size_t bytes);

  weight_cache_file(weight_cache_file&& other) noexcept;
  weight_cache_file& operator=(weight_cache_file&& other) noexcept;
  weight_cache_file(const weight_cache_file&) = delete;
  weight_cache_file& operator=(const weight_cache_file&) = delete;
  ~weight_cache_file();

  /// Names a created file, replacing the one it was found in place of, with the
  /// checkpoint's `content_hash` kept in it. False, with a warning, where that fails (the
  /// weights stay usable, the next start packs again).
  bool commit(uint64_t content_hash);

  /// The `checkpoint::content_hash` of the files the weights were made from, as `commit`
  /// kept it (0: not computed then).
  uint64_t content_hash() const {
    return content_hash_;
  }

  int fd() const {
    return fd_;
  }

  /// Where the weights start in the file (a multiple of the page size).
  std::size_t data_offset() const {
    return data_offset_;
  }

  /// The file's name in its directory.
  const std::string& path() const {
    return path_;
  }

private:
  weight_cache_file(int fd, std::string path, std::size_t data_offset);

  int fd_ = -1;
  std::string path_;
  std::size_t data_offset_ = 0;
  /// Where `commit` writes the content hash.
  std::size_t hash_at_ = 0;
  uint64_t content_hash_ = 0;
};

/// The default directory of the weight cache: `$TROUPE_WEIGHT_CACHE` when set (empty or
/// `off`: none), else `$XDG_CACHE_HOME/troupe/weights`, else `~/.cache/troupe/weights`.
std::string default_weight_cache();

} // namespace troupe
