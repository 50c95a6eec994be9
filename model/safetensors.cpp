// The safetensors format: 8 bytes little-endian header length N, N bytes of JSON mapping
// tensor names to {dtype, shape, data_offsets: [begin, end]} (offsets relative to the data
// that follows the header), an optional "__metadata__" object of strings, then the data.

#include "model/safetensors.hpp"

#include "troupe/errors.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace troupe {

namespace {

/// Headers above this are refused before anything is allocated for them.
constexpr uint64_t max_header_bytes = 100u << 20;

[[noreturn]] void bad_file(const std::string& path, const std::string& what) {
  throw error{errc::invalid_argument, "safetensors file '" + path + "': " + what};
}

[[noreturn]] void bad_tensor(const std::string& path, const std::string& tensor,
                             const std::string& what) {
  bad_file(path, "tensor '" + tensor + "': " + what);
}

} // namespace

int64_t tensor_view::numel() const {
  int64_t n = 1;
  for (auto d : shape)
    n *= d;
  return n;
}

tensor_view tensor_view::rows(int64_t first, int64_t count) const {
  const auto row_bytes = bytes / static_cast<std::size_t>(shape[0]);
  tensor_view part = *this;
  part.shape[0] = count;
  part.data = data + static_cast<std::size_t>(first) * row_bytes;
  part.bytes = static_cast<std::size_t>(count) * row_bytes;
  return part;
}

safetensors_file::safetensors_file(const std::string& path)
  : path_(path), file_(path, "safetensors file", 8) {
  {
    auto base = file_.data();
    auto size = file_.size();
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i)
      header_len = (header_len << 8) | static_cast<uint8_t>(base[i]);
    if (header_len > max_header_bytes || header_len > size - 8)
      bad_file(path, "header length " + std::to_string(header_len) + " does not fit a file of " +
                       std::to_string(size) + " bytes (truncated or not safetensors)");
    auto text = reinterpret_cast<const char*>(base + 8);
    auto header = nlohmann::json::parse(text, text + header_len, nullptr, false);
    if (header.is_discarded() || !header.is_object())
      bad_file(path, "header is not a JSON object");
    auto data = base + 8 + header_len;
    auto data_size = size - 8 - header_len;
    for (auto& [name, desc] : header.items()) {
      if (name == "__metadata__") {
        if (!desc.is_object())
          bad_file(path, "__metadata__ is not an object");
        for (auto& [key, value] : desc.items())
          if (value.is_string())
            metadata_[key] = value.get<std::string>();
        continue;
      }
      if (!desc.is_object() || !desc.contains("dtype") || !desc.contains("shape") ||
          !desc.contains("data_offsets"))
        bad_tensor(path, name, "needs dtype, shape and data_offsets");
      auto& dt = desc["dtype"];
      if (!dt.is_string())
        bad_tensor(path, name, "dtype is not a string");
      auto type = parse_safetensors_dtype(dt.get<std::string>());
      if (!type)
        bad_tensor(path, name,
                   "unsupported dtype " + dt.get<std::string>() +
                     " (troupe loads F32, F16 and BF16)");
      tensor_view view;
      view.name = name;
      view.type = *type;
      uint64_t numel = 1;
      if (!desc["shape"].is_array())
        bad_tensor(path, name, "shape is not a list");
      for (auto& d : desc["shape"]) {
        // Bounded so that no size computed from the shape overflows.
        if (!d.is_number_integer() || d.get<int64_t>() < 0 ||
            __builtin_mul_overflow(numel, d.get<uint64_t>(), &numel) || numel > (uint64_t{1} << 40))
          bad_tensor(path, name, "shape has a bad or impossible dimension");
        view.shape.push_back(d.get<int64_t>());
      }
      auto& offsets = desc["data_offsets"];
      if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
          !offsets[1].is_number_unsigned())
        bad_tensor(path, name, "data_offsets must be two non-negative integers");
      auto begin = offsets[0].get<uint64_t>();
      auto end = offsets[1].get<uint64_t>();
      if (begin > end || end > data_size)
        bad_tensor(path, name,
                   "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                     "] lie outside the " + std::to_string(data_size) +
                     " bytes of data (truncated file?)");
      auto expected = storage_bytes(*type, numel);
      if (end - begin != expected)
        bad_tensor(path, name,
                   std::to_string(end - begin) + " bytes of data, but its shape of " +
                     dt.get<std::string>() + " needs " + std::to_string(expected));
      view.data = data + begin;
      view.bytes = end - begin;
      tensors_.push_back(std::move(view));
    }
  }
  std::sort(tensors_.begin(), tensors_.end(),
            [](const tensor_view& a, const tensor_view& b) { return a.data < b.data; });
  for (std::size_t i = 0; i < tensors_.size(); ++i)
    index_[tensors_[i].name] = i;
}

safetensors_file::~safetensors_file() = default;

const tensor_view& safetensors_file::at(const std::string& name) const {
  auto i = index_.find(name);
  if (i == index_.end())
    bad_file(path_, "no tensor '" + name + "'");
  return tensors_[i->second];
}

bool safetensors_file::contains(const std::string& name) const {
  return index_.count(name) > 0;
}

void safetensors_writer::add(const std::string& name, dtype type, std::vector<int64_t> shape,
                             const void* data, std::size_t bytes) {
  for (auto& e : entries_)
    if (e.name == name)
      throw error{errc::invalid_argument, "safetensors writer: tensor '" + name + "' added twice"};
  uint64_t numel = 1;
  for (auto d : shape) {
    if (d < 0)
      throw error{errc::invalid_argument,
                  "safetensors writer: tensor '" + name + "' has a negative dimension"};
    numel *= static_cast<uint64_t>(d);
  }
  if (storage_bytes(type, numel) != bytes)
    throw error{errc::invalid_argument, "safetensors writer: tensor '" + name + "' has " +
                                          std::to_string(bytes) + " bytes, its shape needs " +
                                          std::to_string(storage_bytes(type, numel))};
  entries_.push_back({name, type, std::move(shape), data, bytes});
}

void safetensors_writer::add_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

std::string safetensors_writer::header() const {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata_.empty())
    header["__metadata__"] = metadata_;
  uint64_t offset = 0;
  for (auto& e : entries_) {
    header[e.name] = {{"dtype", safetensors_name(e.type)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + e.bytes}}};
    offset += e.bytes;
  }
  auto text = header.dump();
  // Pad with spaces so that the data starts 8-byte aligned, as other writers do.
  while ((text.size() + 8) % 8 != 0)
    text.push_back(' ');
  return text;
}

std::size_t safetensors_writer::file_size() const {
  std::size_t total = 8 + header().size();
  for (auto& e : entries_)
    total += e.bytes;
  return total;
}

void safetensors_writer::write(const std::string& path) const {
  auto tmp = path + ".partial";
  {
    std::ofstream out{tmp, std::ios::binary | std::ios::trunc};
    if (!out)
      throw error{errc::invalid_argument,
                  "cannot write safetensors file '" + path + "': " + std::strerror(errno)};
    auto text = header();
    uint64_t len = text.size();
    char len_bytes[8];
    for (int i = 0; i < 8; ++i)
      len_bytes[i] = static_cast<char>((len >> (8 * i)) & 0xff);
    out.write(len_bytes, 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (auto& e : entries_)
      out.write(static_cast<const char*>(e.data), static_cast<std::streamsize>(e.bytes));
    out.flush();
    if (!out) {
      out.close();
      std::remove(tmp.c_str());
      throw error{errc::invalid_argument, "writing safetensors file '" + path + "' failed"};
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw error{errc::invalid_argument,
                "cannot move '" + tmp + "' to '" + path + "': " + std::strerror(errno)};
  }
}

} // namespace troupe
