#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace troupe {

/// Element types of checkpoint tensors.
enum class dtype : uint8_t { f32, f16, bf16 };

/// Bytes per element.
std::size_t element_size(dtype t);

/// The safetensors name: `"F32"`, `"F16"`, `"BF16"`.
const char* safetensors_name(dtype t);

/// Parses a safetensors dtype name; `std::nullopt` for a type troupe does not load.
std::optional<dtype> parse_safetensors_dtype(std::string_view name);

/// IEEE half to float.
float half_to_float(uint16_t h);

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

/// Converts `count` elements of type `from` at `src` to floats at `dst`.
void to_float(dtype from, const void* src, float* dst, std::size_t count);

/// Converts `count` floats at `src` to elements of type `to` at `dst` (rounding to nearest
/// even).
void from_float(dtype to, const float* src, void* dst, std::size_t count);

/// The dtype named `"float32"`, `"float16"` or `"bfloat16"` (as Hugging Face's
/// `torch_dtype` and vLLM's `dtype` spell them); `std::nullopt` otherwise.
std::optional<dtype> parse_dtype_name(std::string_view name);

/// `"float32"`, `"float16"` or `"bfloat16"`.
const char* dtype_name(dtype t);

} // namespace troupe
