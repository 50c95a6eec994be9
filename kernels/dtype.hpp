#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace troupe {

/// Element types of checkpoint tensors: floats, and GGUF's block formats, which store
/// blocks along a row. Blocks of 32 elements with a float16 scale: Q8_0 (32 int8), Q4_0
/// (32 nibbles centred on 8), Q4_1 (32 nibbles and a float16 minimum), Q5_0 and Q5_1 (as
/// Q4_0 and Q4_1 with a fifth bit per element, Q5_0 centred on 16). Super-blocks of
/// 256 (llama.cpp's k-quants), with a float16 scale and 6- or 8-bit scales of their
/// sub-blocks: Q4_K and Q5_K (8 sub-blocks of 32 with a scale and a minimum; 4- or 5-bit
/// values), Q6_K (16 sub-blocks of 16 with a signed scale; 6-bit values centred on 32).
enum class dtype : uint8_t { f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k };

/// Whether `t` is a k-quant (super-blocks of 256).
inline bool is_k_quant(dtype t) {
  return t == dtype::q4_k || t == dtype::q5_k || t == dtype::q6_k;
}

/// Whether `t` is one of the block formats.
inline bool is_quantized(dtype t) {
  return t == dtype::q8_0 || t == dtype::q4_0 || t == dtype::q4_1 || t == dtype::q5_0 ||
         t == dtype::q5_1 || is_k_quant(t);
}

/// Elements per block: 32 or 256 for the block formats, 1 for the others.
inline int64_t block_elements(dtype t) {
  return is_k_quant(t) ? 256 : is_quantized(t) ? 32 : 1;
}

/// Bytes of one block (of one element for the float types).
std::size_t block_bytes(dtype t);

/// Bytes that `count` elements of type `t` take; for a block format `count` must be a
/// multiple of `block_elements(t)`.
inline std::size_t storage_bytes(dtype t, std::size_t count) {
  return count / static_cast<std::size_t>(block_elements(t)) * block_bytes(t);
}

/// The safetensors name: `"F32"`, `"F16"`, `"BF16"` (the block formats have none: `"?"`).
const char* safetensors_name(dtype t);

/// Parses a safetensors dtype name; `std::nullopt` for a type troupe does not load.
std::optional<dtype> parse_safetensors_dtype(std::string_view name);

/// IEEE half to float.
float half_to_float(uint16_t h);

/// The IEEE half at `p` (any alignment) as a float.
inline float load_half(const void* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}

/// bfloat16 to float.
inline float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

/// float to IEEE half, rounding to nearest even.
uint16_t float_to_half(float f);

/// float to bfloat16, rounding to nearest even.
uint16_t float_to_bf16(float f);

/// The 32 integers of a block of Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 as floats, unscaled (Q8_0:
/// -128..127; Q4: the nibbles 0..15, uncentred, low nibbles elements 0..15 and high ones
/// 16..31; Q5: those nibbles plus 16 where bit i of the block's 32-bit word is set), and its
/// scale d. Element i is d · q[i] + `shift`: 0 for Q8_0, -8·d for Q4_0, -16·d for Q5_0,
/// the minimum for Q4_1 and Q5_1.
float unpack_block(dtype t, const void* block, float* q, float* shift);

/// The 6-bit scale and minimum of sub-block j (0..7) of a Q4_K or Q5_K super-block, from
/// its 12 bytes of them: the first four in the low six bits of bytes j and j + 4, the last
/// four in the nibbles of bytes j + 4..11 with their top two bits above the first four's.
inline void k_scale_min(const unsigned char* scales, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = scales[j] & 63;
    *m = scales[j + 4] & 63;
  } else {
    *sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
    *m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}

/// Converts `count` elements of type `from` at `src` to floats at `dst` (for a block
/// format: whole blocks).
void to_float(dtype from, const void* src, float* dst, std::size_t count);

/// Converts `count` floats at `src` to elements of type `to` at `dst`: float types round to
/// nearest even, block formats quantize each block from its own range (the blocks of 32 as
/// llama.cpp's reference quantizers do; the k-quants with each sub-block's own range, no
/// search for a better one).
void from_float(dtype to, const float* src, void* dst, std::size_t count);

/// The dtype named `"float32"`, `"float16"` or `"bfloat16"` (as Hugging Face's
/// `torch_dtype` and vLLM's `dtype` spell them); `std::nullopt` otherwise.
std::optional<dtype> parse_dtype_name(std::string_view name);

/// The first of `count` elements of type `t` at `data` (whole blocks) that is not finite,
/// found without converting them: a block format's values are finite when its float16
/// scales are (its integers always are), so those alone are read. For an element of a
/// block, the index of the block's first element.
std::optional<std::size_t> first_non_finite(dtype t, const void* data, std::size_t count);

/// `"float32"`, `"float16"`, `"bfloat16"`, or GGUF's names of the block formats (`"Q8_0"`,
/// `"Q4_0"`, `"Q4_1"`, `"Q5_0"`, `"Q5_1"`, `"Q4_K"`, `"Q5_K"`, `"Q6_K"`).
const char* dtype_name(dtype t);

} // namespace troupe
