#include "model/checkpoint.hpp"

#include "troupe/errors.hpp"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <set>

namespace troupe {

namespace fs = std::filesystem;

checkpoint::checkpoint(const std::string& directory) : directory_(directory) {
  if (!fs::is_directory(directory))
    throw error{errc::invalid_argument, "model directory '" + directory + "' does not exist"};
  std::vector<std::string> paths;
  auto index_path = fs::path{directory} / "model.safetensors.index.json";
  auto single_path = fs::path{directory} / "model.safetensors";
  if (fs::exists(index_path)) {
    std::ifstream in{index_path};
    auto index = nlohmann::json::parse(in, nullptr, false);
    if (index.is_discarded() || !index.contains("weight_map") || !index["weight_map"].is_object())
      throw error{errc::invalid_argument,
                  "'" + index_path.string() + "' has no weight_map object"};
    std::set<std::string> shards;
    for (auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string())
        throw error{errc::invalid_argument, "'" + index_path.string() + "': tensor '" + name +
                                              "' maps to no file name"};
      shards.insert(file.get<std::string>());
    }
    for (auto& shard : shards)
      paths.push_back((fs::path{directory} / shard).string());
  } else if (fs::exists(single_path)) {
    paths.push_back(single_path.string());
  } else {
    throw error{errc::invalid_argument, "model directory '" + directory +
                                          "' has neither model.safetensors nor "
                                          "model.safetensors.index.json"};
  }
  open(paths);
}

checkpoint::checkpoint(const std::string& directory, const std::vector<std::string>& files)
  : directory_(directory) {
  if (files.empty())
    throw error{errc::invalid_argument, "no weight files given in '" + directory + "'"};
  open(files);
}

void checkpoint::open(const std::vector<std::string>& paths) {
  for (auto& path : paths) {
    files_.push_back(std::make_unique<safetensors_file>(path));
    for (auto& t : files_.back()->tensors()) {
      if (index_.count(t.name) > 0)
        throw error{errc::invalid_argument,
                    "tensor '" + t.name + "' appears twice in '" + directory_ + "' (again in '" +
                      path + "')"};
      index_[t.name] = &t;
    }
  }
}

bool checkpoint::contains(const std::string& name) const {
  return index_.count(name) > 0;
}

const tensor_view& checkpoint::at(const std::string& name) const {
  auto i = index_.find(name);
  if (i == index_.end())
    throw error{errc::invalid_argument,
                "model '" + directory_ + "' has no tensor '" + name + "'"};
  return *i->second;
}

std::vector<std::string> checkpoint::names() const {
  std::vector<std::string> result;
  for (auto& kvp : index_)
    result.push_back(kvp.first);
  return result;
}

} // namespace troupe
