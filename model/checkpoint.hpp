#pragma once

#include "model/safetensors.hpp"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace troupe {

/// The weights of a Hugging Face model directory: `model.safetensors`, or the shards listed
/// by `model.safetensors.index.json`, all memory-mapped. Throws `troupe::error`
/// (`invalid_argument`) naming the file for a missing or broken file.
class checkpoint {
public:
  explicit checkpoint(const std::string& directory);

  /// The given safetensors files of `directory` (e.g. one rank's sharded state).
  checkpoint(const std::string& directory, const std::vector<std::string>& files);

  /// Whether any file holds `name`.
  bool contains(const std::string& name) const;

  /// The tensor called `name`; throws `invalid_argument` naming the directory when absent.
  const tensor_view& at(const std::string& name) const;

  /// Every tensor name, sorted.
  std::vector<std::string> names() const;

  const std::string& directory() const {
    return directory_;
  }

private:
  void open(const std::vector<std::string>& paths);

  std::string directory_;
  std::vector<std::unique_ptr<safetensors_file>> files_;
  std::map<std::string, const tensor_view*> index_;
};

} // namespace troupe
