#include "kernels/cpu/quant_int8.hpp"

#include "troupe/errors.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace troupe::cpu {

#if TROUPE_X86_KERNELS
namespace vnni {
void dot_rows(dtype w_type, const unsigned char* w, const int8_rows& x, float* y, int64_t ldy,
              int64_t begin, int64_t end, bool accumulate);
void dot_packed(dtype w_type, const unsigned char* w, const int8_rows& x, float* y, int64_t ldy,
                int64_t begin, int64_t end, bool accumulate);
void to_bf16(const float* x, int64_t count, uint16_t* out);
void quantize(const float* x, int64_t blocks, int64_t block, int8_t* q, float* scale,
              int16_t* sums);
void dot_packed_bf16(const unsigned char* w, const uint16_t* x, int64_t m, int64_t k, float* y,
                     int64_t ldy, int64_t begin, int64_t end, bool accumulate);
void dot_packed_f16(const unsigned char* w, const float* x, int64_t m, int64_t k, float* y,
                    int64_t ldy, int64_t begin, int64_t end, bool accumulate);
} // namespace vnni
namespace amx {
bool available();
void to_tiles(const float* x, int64_t m, int64_t k, uint16_t* out);
void dot_packed_bf16(const unsigned char* w, const uint16_t* x, int64_t m, int64_t k, float* y,
                     int64_t ldy, int64_t begin, int64_t end, bool accumulate);
} // namespace amx
#endif

namespace {

/// The fewest activation rows the BF16 GEMM takes to AMX.
constexpr int64_t amx_min_rows = 4;

bool cpu_has_vnni() {
#if TROUPE_X86_KERNELS
  static const bool has = [] {
    __builtin_cpu_init();
    return best_isa() == isa::avx512 && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return has;
#else
  return false;
#endif
}

} // namespace

void int8_rows::quantize(const float* x, int64_t rows, int64_t cols, int64_t block_size) {
  m = rows;
  k = cols;
  block = block_size;
  const int64_t blocks = rows * cols / block;
  q.resize(static_cast<size_t>(rows * cols));
  scale.resize(static_cast<size_t>(blocks));
  sums.resize(static_cast<size_t>(rows * cols / 16));
#if TROUPE_X86_KERNELS
  if (cpu_has_vnni()) {
    vnni::quantize(x, blocks, block, q.data(), scale.data(), sums.data());
    return;
  }
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + block * b;
    // The value of largest magnitude becomes −128 (as llama.cpp's 8-bit k-quant
    // activations): one more step than ±127, and its opposite saturates at 127.
    float hi = 0.0f, lo = 0.0f;
    for (int64_t i = 0; i < block; ++i) {
      hi = std::max(hi, xb[i]);
      lo = std::min(lo, xb[i]);
    }
    const float most = std::fabs(lo) >= hi ? lo : hi;
    float inverse = most != 0.0f ? -128.0f / most : 0.0f;
    scale[b] = most / -128.0f;
    int8_t* qb = q.data() + block * b;
    for (int64_t i = 0; i < block; ++i)
      qb[i] = static_cast<int8_t>(std::min(127.0f, std::nearbyint(xb[i] * inverse)));
  }
  for (size_t h = 0; h < sums.size(); ++h) {
    int sum = 0;
    for (size_t i = 16 * h; i < 16 * h + 16; ++i)
      sum += q[i];
    sums[h] = static_cast<int16_t>(sum);
  }
}

int64_t int8_block(dtype w_type) {
  return is_k_quant(w_type) ? 256 : 32;
}

namespace {

bool int8_format(dtype t) {
  return t == dtype::q8_0 || t == dtype::q4_0 || t == dtype::q4_k || t == dtype::q6_k;
}

[[noreturn]] void no_kernel(dtype t) {
  throw error{errc::unsupported, std::string{"no 8-bit integer kernel for "} + dtype_name(t)};
}

/// Row `row` of the rounded activations against one row of weights, block by block: the
/// products are summed as integers, then scaled (per block of 32: by the weight block's
/// and the activation block's scales; per k-quant sub-block: by its integer scale, then
/// per super-block by the float ones).
float reference_dot(dtype t, const unsigned char* w, const int8_rows& x, int64_t row) {
  const int8_t* xq = x.q.data() + row * x.k;
  const float* scale = x.scale.data() + row * (x.k / x.block);
  const int16_t* sums = x.sums.data() + row * (x.k / 16);
  float total = 0.0f;
  if (t == dtype::q8_0 || t == dtype::q4_0 || t == dtype::q4_1) {
    const int64_t bytes = static_cast<int64_t>(block_bytes(t));
    const int64_t quants = t == dtype::q4_1 ? 4 : 2; // after d (and Q4_1's m)
    for (int64_t b = 0; b < x.k / 32; ++b) {
      const unsigned char* block = w + b * bytes;
      const unsigned char* q = block + quants;
      int32_t dot = 0;
      for (int i = 0; i < 32; ++i) {
        int wi =
          t == dtype::q8_0 ? static_cast<int8_t>(q[i]) : (i < 16 ? q[i] & 0x0f : q[i - 16] >> 4);
        dot += wi * xq[32 * b + i];
      }
      const int32_t sum = sums[2 * b] + sums[2 * b + 1];
      if (t == dtype::q4_0) // the centre: -8 for every element
        dot -= 8 * sum;
      if (t == dtype::q4_1) // m added to every element
        total += load_half(block + 2) * scale[b] * static_cast<float>(sum);
      total += load_half(block) * scale[b] * static_cast<float>(dot);
    }
    return total;
  }
  for (int64_t s = 0; s < x.k / 256; ++s) {
    const int8_t* xs = xq + 256 * s;
    const int16_t* sum16 = sums + 16 * s;
    int32_t dot = 0;
    if (t == dtype::q4_k) {
      const unsigned char* block = w + s * 144;
      int32_t minimums = 0;
      for (int j = 0; j < 8; ++j) {
        int sc = 0, mn = 0;
        k_scale_min(block + 4, j, &sc, &mn);
        const unsigned char* qs = block + 16 + 32 * (j / 2);
        int32_t part = 0;
        for (int l = 0; l < 32; ++l)
          part += (j % 2 == 0 ? qs[l] & 0x0f : qs[l] >> 4) * xs[32 * j + l];
        dot += sc * part;
        minimums += mn * (sum16[2 * j] + sum16[2 * j + 1]);
      }
      total += scale[s] * (load_half(block) * static_cast<float>(dot) -
                           load_half(block + 2) * static_cast<float>(minimums));
    } else { // Q6_K
      const unsigned char* block = w + s * 210;
      auto scales = reinterpret_cast<const int8_t*>(block + 192);
      for (int sub = 0; sub < 16; ++sub) {
        int h = sub / 8, k = (sub % 8) / 2, first = 16 * (sub % 2);
        int32_t part = 0;
        for (int l = first; l < first + 16; ++l) {
          unsigned char low = block[64 * h + l + 32 * (k % 2)];
          int q =
            (k < 2 ? low & 0x0f : low >> 4) | (((block[128 + 32 * h + l] >> (2 * k)) & 3) << 4);
          part += q * xs[128 * h + 32 * k + l];
        }
        dot += scales[sub] * (part - 32 * sum16[sub]);
      }
      total += scale[s] * load_half(block + 208) * static_cast<float>(dot);
    }
  }
  return total;
}

} // namespace

bool has_int8_kernel(dtype w_type) {
  return int8_format(w_type) && cpu_has_vnni();
}

void dot_rows_int8(dtype w_type, const void* w, const int8_rows& x, float* y, int64_t ldy,
                   int64_t begin, int64_t end, bool accumulate) {
  if (!has_int8_kernel(w_type))
    no_kernel(w_type);
#if TROUPE_X86_KERNELS
  vnni::dot_rows(w_type, static_cast<const unsigned char*>(w), x, y, ldy, begin, end, accumulate);
#else
  (void)w;
  (void)x;
  (void)y;
  (void)ldy;
  (void)begin;
  (void)end;
  (void)accumulate;
#endif
}

namespace {

bool packed_format(dtype t) {
  return t == dtype::bf16 || t == dtype::f16 || t == dtype::q4_1 || int8_format(t);
}

/// Elements of a row that move together: a block, or a 16-bit format's pair.
int64_t pack_block(dtype t) {
  return t == dtype::bf16 || t == dtype::f16 ? 2 : block_elements(t);
}

/// Rows [begin, end) of a packed 16-bit product: whole groups, and columns in pairs.
void check_pairs(dtype t, int64_t begin, int64_t end, int64_t k) {
  if (begin % packed_rows != 0 || end % packed_rows != 0 || k % 2 != 0)
    throw error{errc::invalid_argument, std::string{"packed "} + dtype_name(t) +
                                          " rows go in groups of 16 and columns in pairs, not [" +
                                          std::to_string(begin) + ", " + std::to_string(end) +
                                          ") x " + std::to_string(k)};
}

void check_packable(dtype t, int64_t rows, int64_t cols) {
  if (!packed_format(t))
    throw error{errc::unsupported, std::string{"no packed layout for "} + dtype_name(t)};
  if (rows % packed_rows != 0 || cols % pack_block(t) != 0)
    throw error{errc::invalid_argument, std::string{"a packed "} + dtype_name(t) +
                                          " matrix has rows in groups of 16 and "
                                          "columns in whole blocks of " +
                                          std::to_string(pack_block(t)) + ", not " +
                                          std::to_string(rows) + " x " + std::to_string(cols)};
}

/// `bytes` (2 or 4) bytes at `stored` in a row's block go to `packed` + bytes · row in its
/// group's packed block; `flip`: with their top bits flipped (Q8_0's signed quants made
/// unsigned).
struct unit {
  size_t stored;
  size_t packed;
  size_t bytes;
  bool flip = false;
};

/// A format's block as units (quant_int8.hpp gives the layouts): its float16 scale(s) 2
/// bytes a row, the rest 4.
std::vector<unit> units_of(dtype t) {
  std::vector<unit> u;
  auto words = [&](size_t stored, size_t packed, size_t count, bool flip = false) {
    for (size_t w = 0; w < count; ++w)
      u.push_back({stored + 4 * w, packed + 64 * w, 4, flip});
  };
  switch (t) {
  case dtype::bf16:
  case dtype::f16:
    u.push_back({0, 0, 4});
    break;
  case dtype::q8_0:
    u.push_back({0, 0, 2});
    words(2, 32, 8, true);
    break;
  case dtype::q4_0:
    u.push_back({0, 0, 2});
    words(2, 32, 4);
    break;
  case dtype::q4_1:
    u.push_back({0, 0, 2});
    u.push_back({2, 32, 2});
    words(4, 64, 4);
    break;
  case dtype::q4_k:
    u.push_back({0, 0, 2});
    u.push_back({2, 32, 2});
    words(4, 64, 3);
    words(16, 256, 32);
    break;
  default:                            // Q6_K: ql, qh in triples as the kernel reads them, scales, d
    for (size_t w = 0; w < 32; ++w) { // ql word 16h + 8c + g: triple 8h + g, slot c
      size_t h = w / 16, c = w / 8 % 2, g = w % 8;
      u.push_back({4 * w, 288 + 192 * (8 * h + g) + 64 * c, 4});
    }
    for (size_t w = 0; w < 16; ++w) // qh word 8h + g: triple 8h + g, slot 2
      u.push_back({128 + 4 * w, 288 + 192 * w + 128, 4});
    words(192, 32, 4);
    u.push_back({208, 0, 2});
    break;
  }
  return u;
}

/// Moves row i of a group of 16 rows (`group`) between the stored (`row`, its bytes as
/// stored) and the packed layouts.
void move_row(const std::vector<unit>& units, size_t block, size_t blocks, size_t i,
              unsigned char* group, unsigned char* row, bool to_packed) {
  for (size_t b = 0; b < blocks; ++b) {
    unsigned char* stored = row + b * block;
    unsigned char* packed = group + b * packed_rows * block;
    for (auto& u : units) {
      unsigned char* to = to_packed ? packed + u.packed + u.bytes * i : stored + u.stored;
      const unsigned char* from = to_packed ? stored + u.stored : packed + u.packed + u.bytes * i;
      // Sizes known here: a move, not a call.
      if (u.bytes == 4) {
        uint32_t v;
        std::memcpy(&v, from, 4);
        if (u.flip)
          v ^= 0x80808080u;
        std::memcpy(to, &v, 4);
      } else {
        std::memcpy(to, from, 2);
      }
    }
  }
}

/// Moves the bytes of each group of 16 rows between the stored and the packed layouts.
void regroup(dtype t, const void* src, void* dst, int64_t rows, int64_t cols, bool to_packed) {
  const auto units = units_of(t);
  const size_t block = storage_bytes(t, static_cast<size_t>(pack_block(t)));
  const size_t blocks = static_cast<size_t>(cols / pack_block(t));
  const size_t stride = blocks * block;
  const size_t group = packed_rows * stride;
  // The source is only read: const_cast lets one function move both ways.
  auto from = const_cast<unsigned char*>(static_cast<const unsigned char*>(src));
  auto to = static_cast<unsigned char*>(dst);
  for (size_t g = 0; g < static_cast<size_t>(rows / packed_rows); ++g)
    for (size_t i = 0; i < packed_rows; ++i) {
      auto rows_at = (to_packed ? from : to) + g * group + i * stride;
      move_row(units, block, blocks, i, (to_packed ? to : from) + g * group, rows_at, to_packed);
    }
}

} // namespace

bool has_packed_layout(dtype w_type) {
  if (w_type == dtype::bf16) {
#if TROUPE_X86_KERNELS
    static const bool has = cpu_has_vnni() && __builtin_cpu_supports("avx512bf16");
    return has;
#else
    return false;
#endif
  }
  return packed_format(w_type) && cpu_has_vnni();
}

void unpack_row(dtype w_type, const void* w, int64_t row, int64_t cols, void* dst) {
  check_packable(w_type, packed_rows, cols);
  const size_t block = storage_bytes(w_type, static_cast<size_t>(pack_block(w_type)));
  const size_t blocks = static_cast<size_t>(cols / pack_block(w_type));
  auto group = const_cast<unsigned char*>(static_cast<const unsigned char*>(w)) +
               static_cast<size_t>(row / packed_rows) * packed_rows * blocks * block;
  move_row(units_of(w_type), block, blocks, static_cast<size_t>(row % packed_rows), group,
           static_cast<unsigned char*>(dst), false);
}

bool packs(dtype w_type, int64_t rows, int64_t cols) {
  return has_packed_layout(w_type) && rows % packed_rows == 0 && cols % pack_block(w_type) == 0;
}

void pack_rows(dtype w_type, const void* src, void* dst, int64_t rows, int64_t cols) {
  check_packable(w_type, rows, cols);
  regroup(w_type, src, dst, rows, cols, true);
}

void unpack_rows(dtype w_type, const void* src, void* dst, int64_t rows, int64_t cols) {
  check_packable(w_type, rows, cols);
  regroup(w_type, src, dst, rows, cols, false);
}

void dot_packed_int8(dtype w_type, const void* w, const int8_rows& x, float* y, int64_t ldy,
                     int64_t begin, int64_t end, bool accumulate) {
  if (!has_packed_layout(w_type))
    throw error{errc::unsupported, std::string{"no packed kernel for "} + dtype_name(w_type)};
  if (begin % packed_rows != 0 || end % packed_rows != 0)
    throw error{errc::invalid_argument, "packed rows go in groups of 16, not [" +
                                          std::to_string(begin) + ", " + std::to_string(end) + ")"};
#if TROUPE_X86_KERNELS
  vnni::dot_packed(w_type, static_cast<const unsigned char*>(w), x, y, ldy, begin, end, accumulate);
#else
  (void)w;
  (void)x;
  (void)y;
  (void)ldy;
  (void)accumulate;
#endif
}

void to_bf16_rows(const float* x, int64_t count, uint16_t* out) {
  if (!has_packed_layout(dtype::bf16))
    throw error{errc::unsupported, "no BF16 instructions on this CPU"};
#if TROUPE_X86_KERNELS
  vnni::to_bf16(x, count, out);
#else
  (void)x;
  (void)count;
  (void)out;
#endif
}

bf16_layout bf16_layout_for(int64_t m, int64_t k) {
#if TROUPE_X86_KERNELS
  if (m >= amx_min_rows && k % 32 == 0 && has_packed_layout(dtype::bf16) && amx::available())
    return bf16_layout::tiles;
#else
  (void)m;
  (void)k;
#endif
  return bf16_layout::rows;
}

size_t bf16_elements(bf16_layout layout, int64_t m, int64_t k) {
  auto rows = layout == bf16_layout::tiles ? (m + 31) / 32 * 32 : m;
  return static_cast<size_t>(rows * k);
}

void to_bf16(const float* x, int64_t m, int64_t k, bf16_layout layout, uint16_t* out) {
  if (layout == bf16_layout::rows)
    return to_bf16_rows(x, m * k, out);
  if (bf16_layout_for(m, k) != bf16_layout::tiles)
    throw error{errc::unsupported, "no AMX-BF16 for " + std::to_string(m) + " x " +
                                     std::to_string(k) + " bfloat16 tiles"};
#if TROUPE_X86_KERNELS
  amx::to_tiles(x, m, k, out);
#endif
}

void dot_packed_bf16(const void* w, const uint16_t* x, bf16_layout layout, int64_t m, int64_t k,
                     float* y, int64_t ldy, int64_t begin, int64_t end, bool accumulate) {
  if (!has_packed_layout(dtype::bf16))
    throw error{errc::unsupported, "no BF16 instructions on this CPU"};
  check_pairs(dtype::bf16, begin, end, k);
  if (layout == bf16_layout::tiles && bf16_layout_for(m, k) != bf16_layout::tiles)
    throw error{errc::unsupported, "no AMX-BF16 for " + std::to_string(m) + " x " +
                                     std::to_string(k) + " bfloat16 tiles"};
#if TROUPE_X86_KERNELS
  auto bytes = static_cast<const unsigned char*>(w);
  if (layout == bf16_layout::tiles)
    amx::dot_packed_bf16(bytes, x, m, k, y, ldy, begin, end, accumulate);
  else
    vnni::dot_packed_bf16(bytes, x, m, k, y, ldy, begin, end, accumulate);
#else
  (void)w;
  (void)x;
  (void)m;
  (void)y;
  (void)ldy;
  (void)accumulate;
#endif
}

void dot_packed_f16(const void* w, const float* x, int64_t m, int64_t k, float* y, int64_t ldy,
                    int64_t begin, int64_t end, bool accumulate) {
  if (!has_packed_layout(dtype::f16))
    throw error{errc::unsupported, "no AVX-512 VNNI on this CPU: no packed F16 kernel"};
  check_pairs(dtype::f16, begin, end, k);
#if TROUPE_X86_KERNELS
  vnni::dot_packed_f16(static_cast<const unsigned char*>(w), x, m, k, y, ldy, begin, end,
                       accumulate);
#else
  (void)w;
  (void)x;
  (void)m;
  (void)y;
  (void)ldy;
  (void)accumulate;
#endif
}

void dot_rows_int8_reference(dtype w_type, const void* w, const int8_rows& x, float* y, int64_t ldy,
                             int64_t begin, int64_t end, bool accumulate) {
  if (!int8_format(w_type) && w_type != dtype::q4_1)
    no_kernel(w_type);
  const auto stride = static_cast<int64_t>(storage_bytes(w_type, static_cast<size_t>(x.k)));
  auto bytes = static_cast<const unsigned char*>(w);
  for (int64_t i = begin; i < end; ++i)
    for (int64_t r = 0; r < x.m; ++r) {
      float v = reference_dot(w_type, bytes + i * stride, x, r);
      float& dst = y[r * ldy + i];
      dst = accumulate ? dst + v : v;
    }
}

} // namespace troupe::cpu
