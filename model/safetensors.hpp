#pragma once

#include "kernels/dtype.hpp"
#include "model/mapped_file.hpp"

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace troupe {

/// One tensor inside a mapped safetensors file.
struct tensor_view {
  std::string name;
  troupe::dtype type = dtype::f32;
  std::vector<int64_t> shape;
  /// Points into the mapping; valid while the file object lives.
  const std::byte* data = nullptr;
  std::size_t bytes = 0;
  /// The stored row of each row of a 2-D tensor whose rows are stored in another order
  /// (GGUF's q and k of a llama model); empty when they are in order.
  std::vector<int64_t> row_order;

  /// Number of elements.
  int64_t numel() const;

  /// Rows [first, first + count) of a 2-D tensor stored in order, as a view of the same
  /// bytes (a row of a block format is whole blocks): a part of a fused projection.
  tensor_view rows(int64_t first, int64_t count) const;

  /// Row `r` of a 2-D tensor whose rows are `row_bytes` long.
  const std::byte* row(int64_t r, std::size_t row_bytes) const {
    auto stored = row_order.empty() ? r : row_order[static_cast<std::size_t>(r)];
    return data + static_cast<std::size_t>(stored) * row_bytes;
  }
};

/// A safetensors file, memory-mapped read-only. The header is checked completely when the
/// file opens: every problem (truncated file, malformed header, unsupported dtype, offsets
/// outside the data, a size that does not match the shape) throws `troupe::error`
/// (`invalid_argument`) naming the file and, where there is one, the tensor.
class safetensors_file {
public:
  explicit safetensors_file(const std::string& path);
  ~safetensors_file();

  safetensors_file(const safetensors_file&) = delete;
  safetensors_file& operator=(const safetensors_file&) = delete;

  const std::string& path() const {
    return path_;
  }

  /// Tensors in file order (by data offset).
  const std::vector<tensor_view>& tensors() const {
    return tensors_;
  }

  /// The tensor called `name`; throws `invalid_argument` naming the file when absent.
  const tensor_view& at(const std::string& name) const;

  /// Whether the file holds a tensor called `name`.
  bool contains(const std::string& name) const;

  /// The mapping the tensors point into.
  const mapped_file& file() const {
    return file_;
  }

  /// The `__metadata__` entries of the header.
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }

private:
  std::string path_;
  mapped_file file_;
  std::vector<tensor_view> tensors_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

/// Collects tensors and writes them as one safetensors file. `write` goes through a
/// temporary file that is renamed into place, so a failure leaves no partial file.
class safetensors_writer {
public:
  /// Adds a tensor; `data` must hold `bytes` = numel × element size and stay valid until
  /// `write`. Throws `invalid_argument` for a duplicate name or a size mismatch.
  void add(const std::string& name, dtype type, std::vector<int64_t> shape, const void* data,
           std::size_t bytes);

  /// Adds a `__metadata__` entry.
  void add_metadata(const std::string& key, const std::string& value);

  /// Bytes the file will have.
  std::size_t file_size() const;

  /// Tensors added so far.
  std::size_t size() const {
    return entries_.size();
  }

  /// Writes the file; throws `invalid_argument` naming the path when it cannot.
  void write(const std::string& path) const;

private:
  struct entry {
    std::string name;
    dtype type;
    std::vector<int64_t> shape;
    const void* data;
    std::size_t bytes;
  };

  std::string header() const;

  std::vector<entry> entries_;
  std::map<std::string, std::string> metadata_;
};

} // namespace troupe
