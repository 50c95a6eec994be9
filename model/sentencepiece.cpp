#include "model/sentencepiece.hpp"

#include "model/mapped_file.hpp"
#include "troupe/errors.hpp"

#include <cstring>
#include <string_view>

namespace troupe {

namespace {

/// The fields of one protobuf message, read from the wire format in turn.
class wire_reader {
public:
  wire_reader(std::string_view data, const std::string& origin) : data_(data), origin_(origin) {}

  /// Moves to the next field; false at the end of the message.
  bool next() {
    if (at_ >= data_.size())
      return false;
    auto key = varint();
    field_ = key >> 3;
    wire_ = static_cast<int>(key & 7);
    return true;
  }
  uint64_t field() const {
    return field_;
  }

  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      auto b = static_cast<unsigned char>(byte());
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0)
        return v;
    }
    fail("a varint is longer than 10 bytes");
  }
  /// A varint field that holds an int32 (negative ones take ten bytes).
  int32_t int32() {
    expect(0);
    return static_cast<int32_t>(static_cast<int64_t>(varint()));
  }
  bool boolean() {
    expect(0);
    return varint() != 0;
  }
  std::string_view bytes() {
    expect(2);
    auto n = varint();
    if (n > data_.size() - at_)
      fail("a field runs past the end");
    auto s = data_.substr(at_, n);
    at_ += n;
    return s;
  }
  float fixed32() {
    expect(5);
    if (data_.size() - at_ < 4)
      fail("a field runs past the end");
    float f = 0;
    std::memcpy(&f, data_.data() + at_, 4); // little-endian, as x86 and ARM are
    at_ += 4;
    return f;
  }
  void skip() {
    switch (wire_) {
    case 0:
      varint();
      break;
    case 1:
      advance(8);
      break;
    case 2:
      bytes();
      break;
    case 5:
      advance(4);
      break;
    default:
      fail("wire type " + std::to_string(wire_) + " is not protobuf's");
    }
  }

private:
  char byte() {
    if (at_ >= data_.size())
      fail("it ends inside a field");
    return data_[at_++];
  }
  void advance(size_t n) {
    if (data_.size() - at_ < n)
      fail("a field runs past the end");
    at_ += n;
  }
  void expect(int wire) {
    if (wire_ != wire)
      fail("field " + std::to_string(field_) + " has wire type " + std::to_string(wire_) +
           ", not " + std::to_string(wire));
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw error{errc::invalid_argument,
                "SentencePiece model '" + origin_ + "' is not well-formed: " + what};
  }

  std::string_view data_;
  const std::string& origin_;
  size_t at_ = 0;
  uint64_t field_ = 0;
  int wire_ = 0;
};

} // namespace

sentencepiece_model read_sentencepiece_model(const std::string& path) {
  auto data = read_small_file(path, "SentencePiece model", 1 << 30);
  sentencepiece_model m;
  // Field numbers of sentencepiece_model.proto.
  wire_reader model{data, path};
  while (model.next()) {
    if (model.field() == 1) { // pieces
      wire_reader piece{model.bytes(), path};
      std::string text;
      float score = 0;
      int type = sentencepiece_model::normal;
      while (piece.next()) {
        if (piece.field() == 1)
          text = std::string{piece.bytes()};
        else if (piece.field() == 2)
          score = piece.fixed32();
        else if (piece.field() == 3)
          type = piece.int32();
        else
          piece.skip();
      }
      m.pieces.push_back(std::move(text));
      m.scores.push_back(score);
      m.types.push_back(type);
    } else if (model.field() == 2) { // trainer_spec
      wire_reader spec{model.bytes(), path};
      while (spec.next()) {
        switch (spec.field()) {
        case 3:
          m.model_type = spec.int32();
          break;
        case 24:
          m.treat_whitespace_as_suffix = spec.boolean();
          break;
        case 35:
          m.byte_fallback = spec.boolean();
          break;
        case 40:
          m.unk_id = spec.int32();
          break;
        case 41:
          m.bos_id = spec.int32();
          break;
        case 42:
          m.eos_id = spec.int32();
          break;
        default:
          spec.skip();
        }
      }
    } else if (model.field() == 3) { // normalizer_spec
      wire_reader spec{model.bytes(), path};
      while (spec.next()) {
        switch (spec.field()) {
        case 1:
          m.normalizer_name = std::string{spec.bytes()};
          break;
        case 2:
          m.has_charsmap = !spec.bytes().empty();
          break;
        case 3:
          m.add_dummy_prefix = spec.boolean();
          break;
        case 4:
          m.remove_extra_whitespaces = spec.boolean();
          break;
        case 5:
          m.escape_whitespaces = spec.boolean();
          break;
        default:
          spec.skip();
        }
      }
    } else {
      model.skip();
    }
  }
  if (m.pieces.empty())
    throw error{errc::invalid_argument, "SentencePiece model '" + path + "' has no pieces"};
  auto in_range = [&](int32_t id) {
    return id >= -1 && id < static_cast<int32_t>(m.pieces.size());
  };
  if (!in_range(m.unk_id) || !in_range(m.bos_id) || !in_range(m.eos_id))
    throw error{errc::invalid_argument, "SentencePiece model '" + path +
                                          "' names a special piece outside its " +
                                          std::to_string(m.pieces.size()) + " pieces"};
  return m;
}

} // namespace troupe
