#pragma once

#include "model/config.hpp"
#include "model/safetensors.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace troupe {

class gguf_file;

/// Hugging Face's row of row `s` of a q or k whose heads (of `head_dim` rows) hold their
/// rotated entries in neighbouring pairs, as a GGUF llama file stores them: row 2i + p of a
/// head is its row p·head_dim/2 + i. A bias's entries likewise.
int64_t halves_row(int64_t s, int64_t head_dim);

/// The weights of a Hugging Face model directory: `model.safetensors`, or the shards listed
/// by `model.safetensors.index.json`, all memory-mapped. Throws `troupe::error`
/// (`invalid_argument`) naming the file for a missing or broken file. Fused projections
/// (Phi-3's `qkv_proj` and `gate_up_proj`) are seen as their parts (`q_proj`, `k_proj`,
/// `v_proj`, `gate_proj`, `up_proj`): views of their rows, not copies.
class checkpoint {
public:
  explicit checkpoint(const std::string& directory);

  /// The given safetensors files of `directory` (e.g. one rank's sharded state).
  checkpoint(const std::string& directory, const std::vector<std::string>& files);

  /// The weights of a GGUF file, in the types the file stores them in, under their Hugging
  /// Face names; the q and k rows of a llama file are read in Hugging Face's order
  /// (`tensor_view::row_order`), not llama.cpp's interleaved rotary layout. `config` is
  /// `gguf_config(path)`.
  static checkpoint from_gguf(const std::string& path, const model_config& config);

  /// Tensors in memory (a weight update's) under their Hugging Face names; `label` names
  /// them in errors. Fused projections are seen as their parts, sized by `config`, as in a
  /// directory. Throws `invalid_argument` for a name given twice, or a size that does not
  /// match its shape. The tensors' bytes must outlive the checkpoint.
  static checkpoint from_tensors(std::string label, std::vector<tensor_view> tensors,
                                 const model_config& config);

  /// The model shape a GGUF file describes.
  static model_config gguf_config(const std::string& path);

  /// Whether `path` names a GGUF file (by its extension).
  static bool is_gguf(const std::string& path);

  /// The model shape of `path`: a GGUF file's metadata, or a directory's `config.json`.
  static model_config config_of(const std::string& path);

  /// Whether q's and k's rows are stored with each head's rotated entries in neighbouring
  /// pairs (llama.cpp's order, a GGUF llama file's); their views read them in Hugging Face's
  /// order all the same (`tensor_view::row_order`).
  bool neighbour_pairs() const {
    return neighbour_pairs_;
  }

  /// Whether any file holds `name`.
  bool contains(const std::string& name) const;

  /// The tensor called `name`; throws `invalid_argument` naming the directory when absent.
  const tensor_view& at(const std::string& name) const;

  /// Gives back the resident pages of `t` (a tensor of this checkpoint) where it points into
  /// a mapped file; it stays readable (from the file). See `mapped_file::release`.
  void release(const tensor_view& t) const;

  /// Where the bytes at `p` lie in one of this checkpoint's files: its descriptor (open as
  /// long as the checkpoint is) and the offset of `p` in it.
  struct file_place {
    int fd;
    std::size_t offset;
  };
  /// The file place of `p` (a tensor's data); none for tensors in memory.
  std::optional<file_place> place_of(const std::byte* p) const;
  /// Every tensor name, sorted.
  std::vector<std::string> names() const;

  /// What identifies a model (16 hex digits): a hash of `config_text` and, with `tensors`,
  /// of every tensor's name, type and shape, and of `content` (`content_hash` of the
  /// tensors' bytes, 0 for none). Two ranks that opened different files at the same path
  /// (another version of the model on one host) differ.
  std::string fingerprint(const std::string& config_text, bool tensors = true,
                          uint64_t content = 0) const;

  /// A hash of every byte of `t`, as stored (file order).
  static uint64_t tensor_hash(const tensor_view& t);

  /// `tensor_hash`es of every tensor combined in name order: those in `known` (by name)
  /// taken as they are, the others computed (and their pages given back).
  uint64_t content_hash(std::map<std::string, uint64_t> known) const;

  /// The files this checkpoint reads as they were opened (`mapped_file::identity`), one
  /// line each.
  std::string identity() const;

  const std::string& directory() const {
    return directory_;
  }

private:
  void open(const std::vector<std::string>& paths);
  /// The mapped file that holds `p`; nullptr for memory that is no file's.
  const mapped_file* file_of(const void* p) const;
  /// Adds a GGUF file's merged expert tensor (`blk.N.ffn_gate_exps.weight` …, `merged`
  /// under its GGUF name) as a view of each expert's matrix under its Hugging Face name;
  /// false when `merged` is none.
  bool add_experts(const tensor_view& merged, const model_config& config);
  /// Replaces each fused projection by views of its parts, sized by `config`.
  void split_fused(const model_config& config);

  std::string directory_;
  checkpoint() = default;

  std::vector<std::unique_ptr<safetensors_file>> files_;
  /// The GGUF file the views point into, when it is one.
  std::shared_ptr<const gguf_file> gguf_;
  /// `index_` points into `views_`.
  std::vector<std::unique_ptr<tensor_view>> views_;
  std::map<std::string, const tensor_view*> index_;
  bool neighbour_pairs_ = false;
};

} // namespace troupe
