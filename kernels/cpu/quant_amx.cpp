// The packed BF16 GEMM on AMX (built with AMX-TILE and AMX-BF16 enabled; called only where
// the CPU has them and the kernel lets this process use them). A tile multiply takes 16
// activation rows × 32 elements against 32 elements of 16 weight rows: in the packed layout
// (one 64-byte vector per pair of elements of a group's 16 rows) 16 such vectors are
// exactly the weight tile, read in place. Eight tiles: 2 × 2 blocks of sums (16 activation
// rows × 16 weight rows each, two groups against two row blocks), the two activation tiles
// and the two weight tiles they share. The activations come in tiles already
// (`bf16_layout::tiles`, written by `to_tiles` as they are rounded): rows of k lie 2k bytes
// apart, which for k = 2048 puts all 16 rows of a tile in one L1 set.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace troupe::cpu::amx {

namespace {

/// The tile configuration (`ldtilecfg`): palette 1, each tile's rows and bytes a row.
struct alignas(64) tile_config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(tile_config) == 64, "ldtilecfg reads 64 bytes");

/// Tiles 0-3 hold the sums of row block b against group g as tile 2b + g, 4 and 5 the
/// activation row blocks, 6 and 7 the groups. `first` and `second`: the activation rows of
/// the two blocks (0: no second block; its tiles get the first's shape, unused).
void configure(int first, int second) {
  tile_config c;
  auto shape = [&](int tile, int rows) {
    c.rows[tile] = static_cast<uint8_t>(rows);
    c.bytes[tile] = 64;
  };
  const int other = second > 0 ? second : first;
  shape(0, first);
  shape(1, first);
  shape(2, other);
  shape(3, other);
  shape(4, first);
  shape(5, other);
  shape(6, 16);
  shape(7, 16);
  _tile_loadconfig(&c);
}

/// Tile `step` (32 elements of k) of activation rows [16 · half, 16 · half + 16) of a block
/// of 32 rows in `bf16_layout::tiles`, for k of `steps` steps.
inline uint16_t* a_tile(uint16_t* packed, int64_t steps, int half, int64_t step) {
  return packed + (half * steps + step) * 16 * 32;
}

/// The sums of one pair of groups against one block of activation rows over k-steps
/// [from, to): tiles 0-3 start from `sums` (4 tiles of 16 × 16, no gap) or zero, and go
/// back there.
template <bool two_groups, bool two_blocks>
void span(const unsigned char* g0, uint16_t* a, int64_t k, int64_t from, int64_t to, float* sums,
          bool zero) {
  const unsigned char* g1 = g0 + 32 * k;
  const int64_t steps = k / 32;
  if (zero) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, sums, 64);
    _tile_loadd(1, sums + 256, 64);
    _tile_loadd(2, sums + 512, 64);
    _tile_loadd(3, sums + 768, 64);
  }
  // Element k0 of a group's rows is in its vector k0 / 2: at byte 32 · k0.
  for (int64_t s = from; s < to; ++s) {
    _tile_loadd(4, a_tile(a, steps, 0, s), 64);
    _tile_loadd(6, g0 + 1024 * s, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_groups) {
      _tile_loadd(7, g1 + 1024 * s, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (two_blocks) {
      _tile_loadd(5, a_tile(a, steps, 1, s), 64);
      _tile_dpbf16ps(2, 5, 6);
      if (two_groups)
        _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + 256, 64);
  _tile_stored(2, sums + 512, 64);
  _tile_stored(3, sums + 768, 64);
}

} // namespace

bool available() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0)
      return false;
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    // Linux hands out the tile state (8 KiB a thread) only when asked, once a process:
    // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA.
    return tile && bf16 && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

void to_tiles(const float* x, int64_t m, int64_t k, uint16_t* out) {
  const int64_t steps = k / 32;
  for (int64_t r = 0; r < m; ++r) {
    uint16_t* block = out + r / 32 * 32 * k;
    const int half = static_cast<int>(r % 32 / 16);
    for (int64_t s = 0; s < steps; ++s) {
      const float* from = x + r * k + 32 * s;
      __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(from + 16), _mm512_loadu_ps(from));
      _mm512_storeu_si512(a_tile(block, steps, half, s) + r % 16 * 32,
                          reinterpret_cast<__m512i>(pair));
    }
  }
}

void dot_packed_bf16(const unsigned char* w, const uint16_t* x, int64_t m, int64_t k, float* y,
                     int64_t ldy, int64_t begin, int64_t end, bool accumulate) {
  const int64_t group_bytes = 32 * k;
  const int64_t steps = k / 32;
  // A tile multiply takes 16 cycles and a tile load (1 KiB) of each operand, so both must
  // come from L1 or L2. The weights go in chunks of pairs of groups that stay in L2 (1 MiB)
  // while every block of 32 activation rows passes over them; a block's span of 8 steps
  // (16 KiB) stays in L1 while the chunk's pairs pass over it, their sums waiting between
  // spans in `sums` (without y's stride, which puts a tile's rows in one L1 set). The
  // weights are read from memory once.
  constexpr int64_t span_steps = 8;
  const int64_t chunk_pairs = std::max<int64_t>(1, (int64_t{1} << 20) / (64 * k));
  thread_local std::vector<float> sums;
  sums.resize(static_cast<size_t>(chunk_pairs * 1024));
  int shape_first = -1, shape_second = -1;
  for (int64_t chunk = begin; chunk < end; chunk += 32 * chunk_pairs) {
    const int64_t chunk_end = std::min(end, chunk + 32 * chunk_pairs);
    for (int64_t r = 0; r < m; r += 32) {
      const int rows0 = static_cast<int>(std::min<int64_t>(16, m - r));
      const int rows1 = static_cast<int>(std::clamp<int64_t>(m - r - 16, 0, 16));
      if (rows0 != shape_first || rows1 != shape_second) {
        configure(rows0, rows1);
        shape_first = rows0;
        shape_second = rows1;
      }
      auto a = const_cast<uint16_t*>(x) + r * k;
      for (int64_t from = 0; from < steps; from += span_steps) {
        const int64_t to = std::min(steps, from + span_steps);
        for (int64_t first = chunk; first < chunk_end; first += 32) {
          const bool two_groups = first + 16 < chunk_end;
          const unsigned char* g = w + first / 16 * group_bytes;
          float* s = sums.data() + (first - chunk) / 32 * 1024;
          if (two_groups && rows1 > 0)
            span<true, true>(g, a, k, from, to, s, from == 0);
          else if (two_groups)
            span<true, false>(g, a, k, from, to, s, from == 0);
          else if (rows1 > 0)
            span<false, true>(g, a, k, from, to, s, from == 0);
          else
            span<false, false>(g, a, k, from, to, s, from == 0);
        }
      }
      // The chunk's sums into y: tile 2b + g holds rows of block b, 16 columns of group g.
      for (int64_t first = chunk; first < chunk_end; first += 32) {
        const float* s = sums.data() + (first - chunk) / 32 * 1024;
        const int groups = first + 16 < chunk_end ? 2 : 1;
        for (int row = 0; row < rows0 + rows1; ++row)
          for (int g = 0; g < groups; ++g) {
            const float* from_tile = s + (2 * (row / 16) + g) * 256 + (row % 16) * 16;
            float* dst = y + (r + row) * ldy + first + 16 * g;
            __m512 v = _mm512_loadu_ps(from_tile);
            if (accumulate)
              v = _mm512_add_ps(v, _mm512_loadu_ps(dst));
            _mm512_storeu_ps(dst, v);
          }
      }
    }
  }
  _tile_release();
}

} // namespace troupe::cpu::amx
