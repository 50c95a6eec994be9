#include "kernels/dtype.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace troupe {

float unpack_block(dtype t, const void* block, float* q, float* shift) {
  auto bytes = static_cast<const unsigned char*>(block);
  float d = load_half(bytes);
  if (t == dtype::q8_0) {
    auto v = reinterpret_cast<const int8_t*>(bytes + 2);
    for (int i = 0; i < 32; ++i)
      q[i] = static_cast<float>(v[i]);
    *shift = 0.0f;
    return d;
  }
  bool with_min = t == dtype::q4_1 || t == dtype::q5_1;
  bool five = t == dtype::q5_0 || t == dtype::q5_1;
  const unsigned char* after = bytes + (with_min ? 4 : 2);
  uint32_t high = 0;
  if (five) {
    std::memcpy(&high, after, sizeof high);
    after += sizeof high;
  }
  for (int i = 0; i < 16; ++i) {
    q[i] = static_cast<float>((after[i] & 0x0f) | (((high >> i) & 1) << 4));
    q[i + 16] = static_cast<float>((after[i] >> 4) | (((high >> (i + 16)) & 1) << 4));
  }
  *shift = with_min ? load_half(bytes + 2) : (five ? -16.0f : -8.0f) * d;
  return d;
}

std::size_t block_bytes(dtype t) {
  switch (t) {
  case dtype::f32:
    return 4;
  case dtype::f16:
  case dtype::bf16:
    return 2;
  case dtype::q8_0:
    return 34;
  case dtype::q4_0:
    return 18;
  case dtype::q4_1:
    return 20;
  case dtype::q5_0:
    return 22;
  case dtype::q5_1:
    return 24;
  case dtype::q4_k:
    return 144; // d, dmin, 12 bytes of scales and minimums, 128 of nibbles
  case dtype::q5_k:
    return 176; // as Q4_K, and 32 bytes of fifth bits
  case dtype::q6_k:
    return 210; // 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d
  }
  return 0;
}

namespace {

void put_half(unsigned char* p, float f) {
  auto h = float_to_half(f);
  std::memcpy(p, &h, sizeof h);
}

/// Dequantizes one block of 32 elements.
void dequantize_block(dtype t, const unsigned char* block, float* out) {
  float shift = 0.0f;
  float d = unpack_block(t, block, out, &shift);
  // Q4_0 and Q5_0 centre their values: d · (q - 8), d · (q - 16), as llama.cpp computes it.
  float centre = t == dtype::q4_0 ? 8.0f : t == dtype::q5_0 ? 16.0f : 0.0f;
  float m = t == dtype::q4_1 || t == dtype::q5_1 ? shift : 0.0f;
  for (int i = 0; i < 32; ++i)
    out[i] = d * (out[i] - centre) + m;
}

/// Quantizes one block of 32 elements from its own range.
void quantize_block(dtype t, const float* x, unsigned char* block) {
  if (t == dtype::q8_0) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i)
      amax = std::max(amax, std::fabs(x[i]));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_half(block, d);
    auto q = reinterpret_cast<int8_t*>(block + 2);
    for (int i = 0; i < 32; ++i)
      q[i] = static_cast<int8_t>(std::nearbyint(x[i] * id));
    return;
  }
  const bool with_min = t == dtype::q4_1 || t == dtype::q5_1;
  const bool five = t == dtype::q5_0 || t == dtype::q5_1;
  const int levels = five ? 32 : 16;
  float d;
  float lowest = 0.0f;
  if (!with_min) {
    // The element of largest magnitude maps to the lowest level, so that its sign gets the
    // extra one.
    float extreme = 0.0f;
    for (int i = 0; i < 32; ++i)
      if (std::fabs(x[i]) > std::fabs(extreme))
        extreme = x[i];
    d = extreme / static_cast<float>(-levels / 2);
    put_half(block, d);
  } else {
    lowest = *std::min_element(x, x + 32);
    float highest = *std::max_element(x, x + 32);
    d = (highest - lowest) / static_cast<float>(levels - 1);
    put_half(block, d);
    put_half(block + 2, lowest);
  }
  unsigned char* qs = block + (with_min ? 4 : 2) + (five ? 4 : 0);
  float id = d != 0.0f ? 1.0f / d : 0.0f;
  float offset = with_min ? 0.5f : static_cast<float>(levels / 2) + 0.5f;
  auto level = [&](float v) {
    return std::clamp(static_cast<int>((v - lowest) * id + offset), 0, levels - 1);
  };
  uint32_t high = 0;
  for (int i = 0; i < 16; ++i) {
    int a = level(x[i]);
    int b = level(x[i + 16]);
    qs[i] = static_cast<unsigned char>((a & 0x0f) | ((b & 0x0f) << 4));
    high |= static_cast<uint32_t>(a >> 4) << i;
    high |= static_cast<uint32_t>(b >> 4) << (i + 16);
  }
  if (five)
    std::memcpy(block + (with_min ? 4 : 2), &high, sizeof high);
}

// The k-quants' layouts (llama.cpp's block_q4_K, block_q5_K, block_q6_K).

void put_k_scale_min(unsigned char* scales, const int* sc, const int* m) {
  for (int j = 0; j < 4; ++j) {
    scales[j] = static_cast<unsigned char>(sc[j] | ((sc[j + 4] >> 4) << 6));
    scales[j + 4] = static_cast<unsigned char>(m[j] | ((m[j + 4] >> 4) << 6));
    scales[j + 8] = static_cast<unsigned char>((sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4));
  }
}

/// The value of element i (0..255) of a Q4_K or Q5_K super-block, 0..15 or 0..31: in
/// chunks of 64, the low nibbles of 32 bytes are the first sub-block, the high nibbles the
/// second; Q5_K's fifth bit of chunk c is bit 2c (first) or 2c + 1 (second) of qh[i % 32].
int k_value(dtype t, const unsigned char* block, int i) {
  int chunk = i / 64, second = (i / 32) % 2, l = i % 32;
  const unsigned char* qs = block + (t == dtype::q5_k ? 48 : 16);
  int q = (qs[chunk * 32 + l] >> (4 * second)) & 0x0f;
  if (t == dtype::q5_k)
    q |= ((block[16 + l] >> (2 * chunk + second)) & 1) << 4;
  return q;
}

/// Q6_K's element i (0..255), -32..31, and its sub-block (of 16) index: in halves of 128,
/// element l + 32·k (l < 32) takes nibble k / 2 of ql[l + 32·(k % 2)] and bits 2k, 2k + 1
/// of qh[l].
int q6_value(const unsigned char* block, int i) {
  int half = i / 128, k = (i % 128) / 32, l = i % 32;
  const unsigned char* ql = block + 64 * half;
  const unsigned char* qh = block + 128 + 32 * half;
  int low = (ql[l + 32 * (k % 2)] >> (4 * (k / 2))) & 0x0f;
  int high = (qh[l] >> (2 * k)) & 3;
  return (low | (high << 4)) - 32;
}

void dequantize_k(dtype t, const unsigned char* block, float* out) {
  if (t == dtype::q6_k) {
    float d = load_half(block + 208);
    auto scales = reinterpret_cast<const int8_t*>(block + 192);
    for (int i = 0; i < 256; ++i)
      out[i] = d * static_cast<float>(scales[i / 16]) * static_cast<float>(q6_value(block, i));
    return;
  }
  float d = load_half(block);
  float dmin = load_half(block + 2);
  for (int j = 0; j < 8; ++j) {
    int sc = 0, m = 0;
    k_scale_min(block + 4, j, &sc, &m);
    float scale = d * static_cast<float>(sc);
    float shift = dmin * static_cast<float>(m);
    for (int i = 32 * j; i < 32 * j + 32; ++i)
      out[i] = scale * static_cast<float>(k_value(t, block, i)) - shift;
  }
}

/// A 6-bit (Q6_K: 8-bit signed) quantization of `values` scaled by their largest.
int round_scale(float value, float d, int most) {
  return d > 0.0f ? std::clamp(static_cast<int>(std::nearbyint(value / d)), 0, most) : 0;
}

void quantize_k(dtype t, const float* x, unsigned char* block) {
  std::memset(block, 0, block_bytes(t));
  if (t == dtype::q6_k) {
    // Each sub-block of 16 maps its element of largest magnitude to -32 (the extra level
    // on that side), as Q4_0 does.
    float sub[16];
    float amax = 0.0f;
    for (int g = 0; g < 16; ++g) {
      float extreme = 0.0f;
      for (int i = 16 * g; i < 16 * g + 16; ++i)
        if (std::fabs(x[i]) > std::fabs(extreme))
          extreme = x[i];
      sub[g] = extreme / -32.0f;
      amax = std::max(amax, std::fabs(sub[g]));
    }
    float d = amax / 127.0f;
    put_half(block + 208, d);
    d = load_half(block + 208);
    auto scales = reinterpret_cast<int8_t*>(block + 192);
    for (int g = 0; g < 16; ++g) {
      int sc = d > 0.0f ? std::clamp(static_cast<int>(std::nearbyint(sub[g] / d)), -127, 127) : 0;
      scales[g] = static_cast<int8_t>(sc);
      float step = d * static_cast<float>(sc);
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        int q =
          step != 0.0f ? std::clamp(static_cast<int>(std::nearbyint(x[i] / step)), -32, 31) : 0;
        q += 32;
        int half = i / 128, k = (i % 128) / 32, l = i % 32;
        block[64 * half + l + 32 * (k % 2)] |=
          static_cast<unsigned char>((q & 0x0f) << (4 * (k / 2)));
        block[128 + 32 * half + l] |= static_cast<unsigned char>((q >> 4) << (2 * k));
      }
    }
    return;
  }
  // Q4_K, Q5_K: each sub-block of 32 spans [min(0, lowest), highest] in `levels` steps;
  // the super-block's d and dmin scale the 6-bit steps and minimums.
  const int levels = t == dtype::q5_k ? 31 : 15;
  float step[8], low[8];
  float most_step = 0.0f, most_low = 0.0f;
  for (int j = 0; j < 8; ++j) {
    float lo = std::min(0.0f, *std::min_element(x + 32 * j, x + 32 * j + 32));
    float hi = *std::max_element(x + 32 * j, x + 32 * j + 32);
    step[j] = (hi - lo) / static_cast<float>(levels);
    low[j] = -lo;
    most_step = std::max(most_step, step[j]);
    most_low = std::max(most_low, low[j]);
  }
  put_half(block, most_step / 63.0f);
  put_half(block + 2, most_low / 63.0f);
  float d = load_half(block);
  float dmin = load_half(block + 2);
  int sc[8], m[8];
  for (int j = 0; j < 8; ++j) {
    // Rounding up keeps the sub-block's range inside the levels.
    sc[j] = d > 0.0f ? std::clamp(static_cast<int>(std::ceil(step[j] / d)), 0, 63) : 0;
    m[j] = round_scale(low[j], dmin, 63);
  }
  put_k_scale_min(block + 4, sc, m);
  unsigned char* qs = block + (t == dtype::q5_k ? 48 : 16);
  for (int i = 0; i < 256; ++i) {
    int j = i / 32;
    float scale = d * static_cast<float>(sc[j]);
    float shift = dmin * static_cast<float>(m[j]);
    int q = scale > 0.0f
              ? std::clamp(static_cast<int>(std::nearbyint((x[i] + shift) / scale)), 0, levels)
              : 0;
    int chunk = i / 64, second = j % 2, l = i % 32;
    qs[chunk * 32 + l] |= static_cast<unsigned char>((q & 0x0f) << (4 * second));
    if (t == dtype::q5_k)
      block[16 + l] |= static_cast<unsigned char>((q >> 4) << (2 * chunk + second));
  }
}

} // namespace

const char* safetensors_name(dtype t) {
  switch (t) {
  case dtype::f32:
    return "F32";
  case dtype::f16:
    return "F16";
  case dtype::bf16:
    return "BF16";
  default:
    return "?";
  }
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
  default: { // the block formats, a block at a time
    auto p = static_cast<const unsigned char*>(src);
    const auto n = static_cast<std::size_t>(block_elements(from));
    for (std::size_t b = 0; b < count / n; ++b)
      (is_k_quant(from) ? dequantize_k : dequantize_block)(from, p + b * block_bytes(from),
                                                           dst + b * n);
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
  default: { // the block formats, a block at a time
    auto p = static_cast<unsigned char*>(dst);
    const auto n = static_cast<std::size_t>(block_elements(to));
    for (std::size_t b = 0; b < count / n; ++b)
      (is_k_quant(to) ? quantize_k : quantize_block)(to, src + b * n, p + b * block_bytes(to));
    return;
  }
  }
}

std::optional<std::size_t> first_non_finite(dtype t, const void* data, std::size_t count) {
  auto bytes = static_cast<const unsigned char*>(data);
  auto half_finite = [](const unsigned char* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return (h & 0x7c00) != 0x7c00; // exponent all ones: an infinity or a NaN
  };
  // A chunk at a time without an early exit, so that the test of the exponent bits
  // vectorizes (an update reads every value once before writing any); the element is
  // looked for only in a chunk that has one.
  auto scan = [&](auto word, auto exponent) -> std::optional<std::size_t> {
    using W = decltype(word);
    constexpr std::size_t chunk = 4096;
    for (std::size_t at = 0; at < count; at += chunk) {
      auto n = std::min(chunk, count - at);
      auto word_at = [&](std::size_t i) {
        W w;
        std::memcpy(&w, bytes + (at + i) * sizeof(W), sizeof w);
        return w;
      };
      W any = 0; // of the words' own width, which vectorizes where an unsigned does not
      for (std::size_t i = 0; i < n; ++i)
        any |= W((word_at(i) & exponent) == exponent);
      if (any != 0)
        for (std::size_t i = 0; i < n; ++i)
          if ((word_at(i) & exponent) == exponent)
            return at + i;
    }
    return std::nullopt;
  };
  if (t == dtype::f32)
    return scan(uint32_t{0}, uint32_t{0x7f800000});
  if (t == dtype::f16)
    return scan(uint16_t{0}, uint16_t{0x7c00});
  if (t == dtype::bf16)
    return scan(uint16_t{0}, uint16_t{0x7f80});
  // Where each block keeps its float16 scales: d (and the minimum's scale or the minimum).
  std::size_t first = t == dtype::q6_k ? 208 : 0;
  bool second = t == dtype::q4_1 || t == dtype::q5_1 || t == dtype::q4_k || t == dtype::q5_k;
  const auto size = block_bytes(t);
  const auto elements = static_cast<std::size_t>(block_elements(t));
  for (std::size_t b = 0; b < count / elements; ++b) {
    const unsigned char* block = bytes + b * size;
    if (!half_finite(block + first) || (second && !half_finite(block + 2)))
      return b * elements;
  }
  return std::nullopt;
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
  case dtype::q8_0:
    return "Q8_0";
  case dtype::q4_0:
    return "Q4_0";
  case dtype::q4_1:
    return "Q4_1";
  case dtype::q5_0:
    return "Q5_0";
  case dtype::q5_1:
    return "Q5_1";
  case dtype::q4_k:
    return "Q4_K";
  case dtype::q5_k:
    return "Q5_K";
  case dtype::q6_k:
    return "Q6_K";
  }
  return "unknown";
}

} // namespace troupe
