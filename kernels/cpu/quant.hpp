#pragma once

/// @file
/// Products of float32 activations with weights kept as stored: GGUF's block formats (Q8_0,
/// Q4_0, Q4_1, Q5_0, Q5_1 widened to floats in registers and scaled once a block; the
/// k-quants Q4_K, Q5_K, Q6_K dequantized a super-block at a time into a buffer the row
/// tile reuses), and float16/bfloat16 widened the same way. The activations stay float32, so the
/// result is float32's on the dequantized weights up to the order of the sums (integer products on
/// activations rounded to 8 bits, as llama.cpp computes them, shift greedy choices that are
/// near a tie). Each kernel has a portable version and x86 versions (AVX2 with FMA and F16C,
/// AVX-512), chosen once from the CPU's features.

#include "kernels/dtype.hpp"

#include <cstdint>

namespace troupe::cpu {

/// The instruction sets the kernels come in.
enum class isa { portable, avx2, avx512 };

/// The best the CPU offers and the OS enables; `TROUPE_CPU_ISA=portable|avx2|avx512` asks
/// for a lesser one.
isa best_isa();

/// `"portable"`, `"avx2"`, `"avx512"`.
const char* isa_name(isa i);

/// sums[r · (k/32) + b] = the sum of block b of row r of x[rows × k] (k a multiple of 32):
/// what Q4_0's and Q5_0's centres and Q4_1's and Q5_1's minimums multiply.
void block_sums(const float* x, int64_t rows, int64_t k, float* sums);

/// y[r·ldy + i] (+)= row i of `w` · row r of x[m × k], for the weight rows i in
/// [begin, end) and every r. `w` holds rows of k elements of the block format `w_type` (k
/// a multiple of its `block_elements`); `xsums` are x's `block_sums`.
void dot_rows_quantized(isa i, dtype w_type, const void* w, const float* x, const float* xsums,
                        int64_t m, int64_t k, float* y, int64_t ldy, int64_t begin, int64_t end,
                        bool accumulate);

/// The same for float16 or bfloat16 weights (any k).
void dot_rows_half(isa i, dtype w_type, const void* w, const float* x, int64_t m, int64_t k,
                   float* y, int64_t ldy, int64_t begin, int64_t end, bool accumulate);

/// Attention of `heads` query rows (head_dim floats each, one after another) that share
/// their keys and values (a GQA group) over `len` cached positions: the key and value of
/// position p start at keys + offsets[p] and values + offsets[p], and each is read once for
/// all the heads. Head g's scores (scaled, then softmax weights) go to scores + g · len (room
/// for heads · len); its weighted sum of the values to out + g · head_dim; scores soft-capped
/// at `softcap` where it is positive. Each head's outputs are those it would have alone.
/// The portable version (one head) is `cpu::attend` (ops.hpp).
void attend(isa i, const float* query, int64_t head_dim, int64_t heads, int64_t len, float scale,
            const float* keys, const float* values, const int64_t* offsets, float* scores,
            float* out, float softcap = 0);

/// Attention of consecutive tokens of one sequence (a prefill's, or a decode step's one) that share
/// their cached positions: token t's `heads` query rows (a GQA group, head_dim floats each, one
/// after another) start at query + t · stride and attend to positions [first[t], end[t]) of
/// the `len` positions whose keys and values start at keys + offsets[p] and values +
/// offsets[p]; `first` and `end` do not decrease with t. Outputs go to out + t · stride
/// likewise. Each key and value is read once for the whole tile and the scores are computed
/// as tiles of rows × positions (the keys transposed once), so that the work per score is
/// a few multiply-adds; each token's outputs equal those `attend` gives it alone, to the
/// bit. A single token attending to more than 2,048 positions, and heads of a size that is
/// not a whole number of vectors, go to `attend`.
void attend_tokens(isa i, const float* query, int64_t stride, int64_t head_dim, int64_t heads,
                   int64_t tokens, const int64_t* first, const int64_t* end, int64_t len,
                   float scale, const float* keys, const float* values, const int64_t* offsets,
                   float* out, float softcap = 0);

/// log Σ exp(logits[i]) over n logits, as `troupe::log_partition` (model/sampler.hpp, the
/// portable version) computes it up to float rounding of each term.
float log_partition(isa i, const float* logits, int64_t n);

/// out[i] = silu(gate[i]) · up[i] (the portable version is `cpu::silu_mul`, ops.hpp).
void silu_mul(isa i, const float* gate, const float* up, float* out, int64_t n);

} // namespace troupe::cpu
