#include "model/dtype.hpp"

#include <cmath>
#include <cstring>

namespace troupe {

std::size_t element_size(dtype t) {
  return t == dtype::f32 ? 4 : 2;
}

const char* safetensors_name(dtype t) {
  switch (t) {
    case dtype::f32:
      return "F32";
    case dtype::f16:
      return "F16";
    case dtype::bf16:
      return "BF16";
  }
  return "?";
}

std::optional<dtype> parse_safetensors_dtype(std::string_view name) {
  if (name == "F32")
    return dtype::f32;
  if (name == "F16")
    return dtype::f16;
  if (name == "BF16")
    return dtype::bf16;
  return std::nullopt;
}

float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {
      // Subnormal: normalise it.
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t abs = x & 0x7fffffff;
  if (abs >= 0x7f800000) // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0));
  if (abs >= 0x477ff000) // rounds to >= 65520: overflow to inf
    return static_cast<uint16_t>(sign | 0x7c00);
  if (abs < 0x38800000) { // below the smallest normal half: subnormal or zero
    // A subnormal half is m * 2^-24; nearbyint rounds to nearest even.
    auto value = static_cast<uint32_t>(std::nearbyint(std::fabs(f) * 16777216.0f));
    return static_cast<uint16_t>(sign | value);
  }
  // Normal: rebias the exponent and round the mantissa to nearest even.
  uint32_t rounded = abs + 0xfff + ((abs >> 13) & 1);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000) >> 13));
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffff) > 0x7f800000) // nan stays nan
    return static_cast<uint16_t>((x >> 16) | 0x40);
  x += 0x7fff + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

void to_float(dtype from, const void* src, float* dst, std::size_t count) {
  switch (from) {
    case dtype::f32:
      if (count > 0) // memcpy's pointers must be valid even for 0 bytes
        std::memcpy(dst, src, count * sizeof(float));
      return;
    case dtype::f16: {
      auto p = static_cast<const uint16_t*>(src);
      for (std::size_t i = 0; i < count; ++i)
        dst[i] = half_to_float(p[i]);
      return;
    }
    case dtype::bf16: {
      auto p = static_cast<const uint16_t*>(src);
      for (std::size_t i = 0; i < count; ++i)
        dst[i] = bf16_to_float(p[i]);
      return;
    }
  }
}

void from_float(dtype to, const float* src, void* dst, std::size_t count) {
  switch (to) {
    case dtype::f32:
      if (count > 0)
        std::memcpy(dst, src, count * sizeof(float));
      return;
    case dtype::f16: {
      auto p = static_cast<uint16_t*>(dst);
      for (std::size_t i = 0; i < count; ++i)
        p[i] = float_to_half(src[i]);
      return;
    }
    case dtype::bf16: {
      auto p = static_cast<uint16_t*>(dst);
      for (std::size_t i = 0; i < count; ++i)
        p[i] = float_to_bf16(src[i]);
      return;
    }
  }
}

std::optional<dtype> parse_dtype_name(std::string_view name) {
  for (auto t : {dtype::f32, dtype::f16, dtype::bf16})
    if (name == dtype_name(t))
      return t;
  return std::nullopt;
}

const char* dtype_name(dtype t) {
  switch (t) {
    case dtype::f32:
      return "float32";
    case dtype::f16:
      return "float16";
    case dtype::bf16:
      return "bfloat16";
  }
  return "unknown";
}

} // namespace troupe
