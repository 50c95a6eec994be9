#pragma once

#include "model/config.hpp"
#include "model/mapped_file.hpp"
#include "model/safetensors.hpp"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace troupe {

/// A GGUF file (llama.cpp's format, version 2 or 3), memory-mapped. Tensors of type F32,
/// F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K can be read as stored or
/// as float32. Every problem
/// (bad magic, truncated file, unknown tensor type, data outside the file) throws
/// `troupe::error` (`invalid_argument`) naming the file and, where there is one, the tensor.
class gguf_file {
public:
  /// Where a metadata array lies in the file. Arrays are decoded only when asked for
  /// (`strings`, `numbers`): a vocabulary's 100k+ strings cost more than the rest of a parse.
  struct array {
    uint32_t element_type = 0;
    uint64_t count = 0;
    /// Byte offset of the first element in the file.
    std::size_t offset = 0;
  };

  /// A metadata value: integers widen to int64, floats to double; arrays stay in the file.
  using value = std::variant<int64_t, double, bool, std::string, array>;

  struct tensor_info {
    std::string name;
    /// Hugging Face order: outermost dimension first (GGUF stores the reverse).
    std::vector<int64_t> shape;
    uint32_t type = 0;
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };

  explicit gguf_file(const std::string& path);
  ~gguf_file();

  gguf_file(const gguf_file&) = delete;
  gguf_file& operator=(const gguf_file&) = delete;

  const std::string& path() const {
    return path_;
  }
  const std::map<std::string, value>& metadata() const {
    return metadata_;
  }

  /// The metadata value of `key` when it is a `T`; nullptr when absent or of another type.
  template <class T>
  const T* find(const std::string& key) const {
    auto i = metadata_.find(key);
    return i == metadata_.end() ? nullptr : std::get_if<T>(&i->second);
  }
  /// The array of strings at `key`; nothing when absent or not an array of strings.
  std::optional<std::vector<std::string>> strings(const std::string& key) const;
  /// The array of numbers (or booleans, as 0 and 1) at `key`, as doubles; nothing when
  /// absent or not such an array.
  std::optional<std::vector<double>> numbers(const std::string& key) const;

  const std::vector<tensor_info>& tensors() const {
    return tensors_;
  }

  /// The tensor's values as float32.
  std::vector<float> read(const tensor_info& t) const;

  /// The type the file stores the tensor in.
  dtype stored_type(const tensor_info& t) const;

  /// The tensor's bytes as stored, inside the mapping (valid while this object lives).
  const std::byte* data(const tensor_info& t) const;

  /// The mapping the tensors point into.
  const mapped_file& file() const {
    return file_;
  }

  /// The model shape from the metadata (architectures llama, qwen2, qwen3, phi3, gemma2 and
  /// gemma3).
  model_config config() const;

private:
  /// What a gemma2 or gemma3 file adds to `c`: Gemma's norms, activation, scaling and
  /// capping, and its sliding layers.
  void gemma_config(model_config& c, bool gemma3, double window, double attn_cap, double final_cap,
                    double local_base) const;
  /// What a phi3 file adds to `c`: its window, and LongRoPE from its factor tensors.
  void phi3_config(model_config& c, double rotary_dims, double window, double original_length,
                   double attention_factor) const;

  std::string path_;
  mapped_file file_;
  std::size_t data_start_ = 0;
  std::map<std::string, value> metadata_;
  std::vector<tensor_info> tensors_;
};

/// Hugging Face name of a GGUF tensor name in a model of `architecture` (Hugging Face's
/// name; Gemma's and Phi-3's blocks name some tensors their own way): `blk.3.attn_q.weight`
/// → `model.layers.3.self_attn.q_proj.weight`; empty for a name troupe does not use.
/// (`rope_freqs.weight`, llama.cpp's form of the llama3 rope scaling, keeps its name.)
std::string hf_tensor_name(const std::string& gguf_name,
                           const std::string& architecture = "LlamaForCausalLM");

} // namespace troupe
