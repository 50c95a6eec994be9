#pragma once

/// @file
/// The fast path of the CPU device: products of weights kept as stored (Q8_0, Q4_0, Q4_K,
/// Q6_K) with activations rounded to 8-bit integers, summed as integers (AVX-512 VNNI) and
/// scaled once per block. Rounding the activations moves the logits slightly, so it is a
/// choice (`model_worker_options::cpu_precision`); the float kernels of quant.hpp stay the
/// exact path. The activations are rounded as llama.cpp rounds them for the same weights:
/// per block of 32 for Q8_0 and Q4_0 (each block's product is scaled by both blocks'
/// scales), per super-block of 256 for the k-quants (their sub-block scales then apply to
/// integer sums: `vpmaddubsw` and `vpdpwssd`, two instructions for 64 products).

#include "kernels/cpu/quant.hpp"

#include <cstdint>
#include <vector>

namespace troupe::cpu {

/// Activations x[m × k] as 8-bit integers: q = min(127, round(x / scale)) per block of
/// `block` (32 or 256) elements, scale = −v / 128 for the block's value v of largest
/// magnitude (the negative one of a tie; 0 for a block of zeros); `sums[h]` = Σ q over
/// the 16 elements of h: what a format's offset (Q4_0's 8, Q4_K's minimum, Q6_K's 32)
/// multiplies.
struct int8_rows {
  int64_t m = 0;
  int64_t k = 0;
  int64_t block = 32;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int16_t> sums;

  /// Rounds x in blocks of `block_size` (a divisor of cols); the buffers keep their memory
  /// from call to call.
  void quantize(const float* x, int64_t rows, int64_t cols, int64_t block_size);
};

/// The block `int8_rows` must be rounded in for `w_type`: 256 for the k-quants, else 32.
int64_t int8_block(dtype w_type);

/// Whether `w_type` has an integer kernel, and the CPU the instructions it needs (AVX-512
/// with VNNI and BW; `TROUPE_CPU_ISA` below avx512 says no). Elsewhere the fast path is
/// the exact one.
bool has_int8_kernel(dtype w_type);

/// y[r·ldy + i] (+)= row i of `w` · row r of `x`, for the weight rows i in [begin, end):
/// as `dot_rows_quantized`, on the rounded activations. Throws `unsupported` where
/// `has_int8_kernel` says no.
void dot_rows_int8(dtype w_type, const void* w, const int8_rows& x, float* y, int64_t ldy,
                   int64_t begin, int64_t end, bool accumulate);

/// The same, one block at a time in plain C++: the definition the vector kernels are
/// tested against (equal up to the order of float sums). Any CPU; Q4_1 too (its packed
/// kernel's definition).
void dot_rows_int8_reference(dtype w_type, const void* w, const int8_rows& x, float* y, int64_t ldy,
                             int64_t begin, int64_t end, bool accumulate);

/// The packed layout: weights rearranged in groups of `packed_rows` rows so that one vector
/// load holds 4 bytes of each of the 16 rows and every product of a `vpdpbusd` adds into
/// that row's own lane: no horizontal sums, each row's scales unpacked 16 at a time, and a
/// tile of activation rows shares every weight vector (the prefill GEMM). A group takes
/// the bytes its 16 rows take as stored, block by block (block b of the group holds block
/// b of each row), so a band of whole groups starts where it did. In a group's block, the
/// 16 rows' float16 scales come first (2 bytes a row), then vectors of 64 bytes, row i's 4
/// bytes at 4·i, each vector w holding bytes 4w ... 4w + 3 of a part of the rows' blocks:
/// - Q8_0: d at 0; the 32 quants from 32 (8 vectors), each byte + 128 (unsigned);
/// - Q4_0: d at 0; the 16 bytes of nibbles from 32 (4 vectors);
/// - Q4_1: d at 0, m at 32; the 16 bytes of nibbles from 64 (4 vectors);
/// - Q4_K: d at 0, dmin at 32; the 12 bytes of 6-bit scales and minimums from 64 (3
///   vectors), the 128 bytes of nibbles from 256 (32 vectors);
/// - Q6_K: d at 0; the 16 scales from 32 (4 vectors); from 288, 16 triples of vectors in
///   the order the kernel reads them: triple 8h + g holds `ql` words 16h + g and
///   16h + 8 + g and `qh` word 8h + g (h the half of the super-block);
/// - BF16 and F16: blocks of two elements, one vector each (`vdpbf16ps` takes them in
///   pairs; F16's widen to float32 pairs).
constexpr int64_t packed_rows = 16;

/// Whether `w_type` has a packed layout and this CPU the kernel that reads it: the formats
/// and CPUs of `has_int8_kernel`, Q4_1 and F16, and BF16 where the CPU also has AVX-512
/// BF16.
bool has_packed_layout(dtype w_type);

/// Whether `has_packed_layout(w_type)` and `rows` × `cols` fit it: whole groups of rows,
/// whole blocks (BF16: pairs) of columns.
bool packs(dtype w_type, int64_t rows, int64_t cols);

/// Writes `rows` (a multiple of `packed_rows`) rows of `cols` elements of `w_type`, as
/// stored at `src`, to `dst` in the packed layout (`src` and `dst` do not overlap).
void pack_rows(dtype w_type, const void* src, void* dst, int64_t rows, int64_t cols);

/// The inverse of `pack_rows`: packed rows at `src` to `dst` as stored.
void unpack_rows(dtype w_type, const void* src, void* dst, int64_t rows, int64_t cols);

/// x[count] rounded to bfloat16 (to nearest even), the activations of `dot_packed_bf16`.
/// Throws `unsupported` where `has_packed_layout(dtype::bf16)` says no.
void to_bf16_rows(const float* x, int64_t count, uint16_t* out);

/// How the activations of `dot_packed_bf16` are laid out: `rows` (m rows of k, AVX-512
/// BF16), or `tiles` for AMX: blocks of 32 rows (the last one short), each holding for its
/// two halves of 16 rows the tiles of 16 rows × 32 elements in k's order, with no gap.
enum class bf16_layout { rows, tiles };

/// The layout `dot_packed_bf16` computes an m × k product fastest from: `tiles` where the CPU
/// has AMX-BF16 (and Linux lets this process use it), k is whole tiles of 32 and there are
/// 4 rows or more (a decode step reads its weights as fast without).
bf16_layout bf16_layout_for(int64_t m, int64_t k);

/// Elements of x[m × k] in bfloat16 in `layout`.
size_t bf16_elements(bf16_layout layout, int64_t m, int64_t k);

/// x[m × k] rounded to bfloat16 (to nearest even) in `layout`.
void to_bf16(const float* x, int64_t m, int64_t k, bf16_layout layout, uint16_t* out);

/// y[r·ldy + i] (+)= row i of BF16 weights `w`, packed, · row r of the bfloat16 x[m × k] (in
/// `layout`), for the rows i in [begin, end) (multiples of `packed_rows`), summed in
/// float32 (AVX-512 BF16 or AMX). The fast path for BF16 weights: llama.cpp rounds the
/// activations the same way.
void dot_packed_bf16(const void* w, const uint16_t* x, bf16_layout layout, int64_t m, int64_t k,
                     float* y, int64_t ldy, int64_t begin, int64_t end, bool accumulate);

/// y[r·ldy + i] (+)= row i of F16 weights `w`, packed, · row r of the float32 x[m × k], for
/// the rows i in [begin, end) (multiples of `packed_rows`): the weights widened to float32,
/// the products summed in float32, so the row kernel's result up to the order of the sums
/// (the even and the odd columns of a row sum apart). The fast path for F16 weights.
void dot_packed_f16(const void* w, const float* x, int64_t m, int64_t k, float* y, int64_t ldy,
                    int64_t begin, int64_t end, bool accumulate);

/// Row `row` of packed rows of `cols` elements at `w`, written to `dst` as stored.
void unpack_row(dtype w_type, const void* w, int64_t row, int64_t cols, void* dst);

/// `dot_rows_int8` for weights in the packed layout; `begin` and `end` are multiples of
/// `packed_rows`. Throws `unsupported` where `has_packed_layout`
/// says no.
void dot_packed_int8(dtype w_type, const void* w, const int8_rows& x, float* y, int64_t ldy,
                     int64_t begin, int64_t end, bool accumulate);

} // namespace troupe::cpu
