// Prefill chunks on a CPU with AVX2 and FMA but no AVX-512 (a Zen 3): blocks of query rows
// against tiles of 16 keys, in float32 whatever the cache's dtype.
//
// The per-key passes (attend_per_key) take one query row at a time: for each key, G dot products
// summed across their eight lanes, then a second pass for the values. A prefill chunk reads its
// context once per row that way, and each key's horizontal sums cost as much as its arithmetic.
// Here a block of R rows of one sequence and KV head (R x G <= 6 query heads) goes through the
// keys together, the way the float32 GEMM's 6 x 16 tile goes through its panel (csrc/cpu_fp32_gemm.cpp):
//
// - the keys are packed once per sequence and KV head, a tile's 16 keys side by side in the lanes
//   ([tile][head_dim][16]), so one FMA gives a query head eight scores with no sum across lanes,
//   and each pair of key loads serves the block's six heads (twelve accumulators);
// - the values are packed to float32 ([key][head_dim]) and weighted sixteen lanes of head_dim at
//   a time for the six heads, each value vector loaded once for all of them;
// - the softmax is online: a tile's maximum per head, the running sums rescaled only when a
//   maximum rose, the masks only in the tiles that reach past the block's first row's context.
//
// A query head's arithmetic depends on its own query and context alone (a block pads with copies
// of its last row, computed and not stored; a key past a row's context weighs exactly 0), so a
// row gives the same bits in any chunk that takes blocks.
//
// Measured on a 2-core Zen 3 (SmolLM2: 9 heads, 3 KV heads, head_dim 64), against the per-key
// passes: the whole float32 forward on two threads, a 128-token prompt 1.10x faster and a
// 1024-token one 1.12x (benchmarks/results/cpu_forward_fp32_prefill_blocks_zen3.json); figures
// for the kernel alone in docs/benchmarks.md ("Back on a Zen 3").

#pragma once

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_PREFILL_BLOCKS_AVX2 1

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "vec_math.h"

namespace pagedserve::avx2 {

constexpr int64_t kBlockHeads = 6;  // query heads a block computes: 2 x 6 accumulators of 16 registers
constexpr int64_t kKeyTile = 16;    // two vectors of eight keys

// Query rows a block takes for G query heads per KV head (G <= kBlockHeads).
constexpr int64_t block_rows(int64_t group) { return std::max<int64_t>(1, kBlockHeads / group); }

// A packed head holds `context` keys rounded up to whole tiles: first the keys, transposed tile by
// tile, then the values, all in float32.
inline int64_t packed_keys(int64_t context) { return (context + kKeyTile - 1) / kKeyTile * kKeyTile; }
inline int64_t packed_floats(int64_t context, int64_t head_dim) { return packed_keys(context) * head_dim * 2; }

// Packs one KV head's first `context` keys and values from the paged cache into `packed`; the
// last tile is padded with zeros (finite: a masked key's probability is 0, and 0 x 0 is 0).
template <typename T>
void pack_head(const T* key_head, const T* value_head, const int32_t* block_table, int64_t context, int64_t block_size,
               int64_t head_dim, float* packed) {
  const int64_t keys = packed_keys(context);
  float* values = packed + keys * head_dim;
  for (int64_t t = 0; t < keys; ++t) {
    float* kt = packed + (t / kKeyTile) * head_dim * kKeyTile + t % kKeyTile;
    float* v = values + t * head_dim;
    if (t >= context) {
      for (int64_t d = 0; d < head_dim; ++d) kt[d * kKeyTile] = 0.f;
      std::fill(v, v + head_dim, 0.f);
      continue;
    }
    const int64_t row = static_cast<int64_t>(block_table[t / block_size]) * block_size * head_dim + (t % block_size) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) kt[d * kKeyTile] = to_float(key_head[row + d]);
    for (int64_t d = 0; d < head_dim; d += 8) store8(v + d, load8(value_head + row + d));
  }
}

// Lanes [0, 8) of a tile half whose keys start `first` keys into the tile: -inf past `limit` keys.
inline __m256 mask_past(__m256 scores, int64_t first, int64_t limit) {
  const __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(first)));
  const __m256 past = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(limit)), lane));
  return _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), scores, past);
}

// One block: `rows` (<= R) query rows from `query`, each `row_stride` elements after the last,
// whose first row sees `first_context` keys and each next row one more (causal). G query heads
// per KV head, C vectors of 8 in head_dim; `packed` is pack_head's for `packed_context` keys.
template <typename T, int64_t G, int64_t C>
void attend_block(const T* query, T* out, int64_t row_stride, int64_t rows, int64_t first_context, const float* packed,
                  int64_t packed_context, float scale) {
  constexpr int64_t D = C * 8, R = block_rows(G), N = R * G;
  static_assert(N <= kBlockHeads && C % 2 == 0);
  const int64_t last_context = first_context + rows - 1;
  const float* values = packed + packed_keys(packed_context) * D;
  alignas(32) float q[N][D], acc[N][D], probs[N][kKeyTile], lane_sums[N][8];
  float maxes[N];
  int64_t context[N];
  for (int64_t i = 0; i < N; ++i) {
    const int64_t row = std::min(i / G, rows - 1);  // padding: the last row again
    for (int64_t d = 0; d < D; d += 8)
      _mm256_store_ps(q[i] + d, _mm256_mul_ps(load8(query + row * row_stride + (i % G) * D + d), _mm256_set1_ps(scale)));
    std::fill(acc[i], acc[i] + D, 0.f);
    std::fill(lane_sums[i], lane_sums[i] + 8, 0.f);
    maxes[i] = -std::numeric_limits<float>::infinity();
    context[i] = first_context + row;
  }
  for (int64_t t0 = 0; t0 < last_context; t0 += kKeyTile) {
    const float* kt = packed + t0 * D;  // tile t0 / 16: [D][16] (new[] aligns it to 16 bytes only: loadu)
    __m256 lo[N], hi[N];                // scores of keys t0..t0+7 and t0+8..t0+15
#pragma GCC unroll 6
    for (int64_t i = 0; i < N; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_loadu_ps(kt + d * kKeyTile), k1 = _mm256_loadu_ps(kt + d * kKeyTile + 8);
#pragma GCC unroll 6
      for (int64_t i = 0; i < N; ++i) {
        const __m256 qd = _mm256_broadcast_ss(q[i] + d);
        lo[i] = _mm256_fmadd_ps(qd, k0, lo[i]);
        hi[i] = _mm256_fmadd_ps(qd, k1, hi[i]);
      }
    }
    const bool diagonal = t0 + kKeyTile > first_context;
    bool rescale = false;
    float shrink[N];
#pragma GCC unroll 6
    for (int64_t i = 0; i < N; ++i) {
      if (diagonal) {
        lo[i] = mask_past(lo[i], 0, context[i] - t0);
        hi[i] = mask_past(hi[i], 8, context[i] - t0);
      }
      const float tile_max = max8(_mm256_max_ps(lo[i], hi[i]));
      shrink[i] = 1.f;
      if (tile_max > maxes[i]) {  // exp(-inf) is 0 on the first tile: nothing summed yet
        shrink[i] = std::exp(maxes[i] - tile_max);
        maxes[i] = tile_max;
        rescale = true;
      }
      const __m256 m = _mm256_set1_ps(maxes[i]), none = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      // exp8 clamps -inf to exp(-87): masked keys weigh exactly 0 by the compare, not by the exp.
      const __m256 p0 = _mm256_and_ps(exp8(_mm256_sub_ps(lo[i], m)), _mm256_cmp_ps(lo[i], none, _CMP_NEQ_OQ));
      const __m256 p1 = _mm256_and_ps(exp8(_mm256_sub_ps(hi[i], m)), _mm256_cmp_ps(hi[i], none, _CMP_NEQ_OQ));
      const __m256 sums = _mm256_mul_ps(_mm256_load_ps(lane_sums[i]), _mm256_set1_ps(shrink[i]));
      _mm256_store_ps(lane_sums[i], _mm256_add_ps(sums, _mm256_add_ps(p0, p1)));
      _mm256_store_ps(probs[i], p0);
      _mm256_store_ps(probs[i] + 8, p1);
    }
    const float* vt = values + t0 * D;
    const int64_t n = std::min(kKeyTile, last_context - t0);
    for (int64_t c = 0; c < D; c += 16) {  // the weighted values, 16 of head_dim at a time for all N heads
      __m256 a0[N], a1[N];
#pragma GCC unroll 6
      for (int64_t i = 0; i < N; ++i) {
        a0[i] = _mm256_load_ps(acc[i] + c);
        a1[i] = _mm256_load_ps(acc[i] + c + 8);
        if (rescale) {
          a0[i] = _mm256_mul_ps(a0[i], _mm256_set1_ps(shrink[i]));
          a1[i] = _mm256_mul_ps(a1[i], _mm256_set1_ps(shrink[i]));
        }
      }
      for (int64_t k = 0; k < n; ++k) {
        const __m256 v0 = _mm256_loadu_ps(vt + k * D + c), v1 = _mm256_loadu_ps(vt + k * D + c + 8);
#pragma GCC unroll 6
        for (int64_t i = 0; i < N; ++i) {
          const __m256 p = _mm256_broadcast_ss(probs[i] + k);
          a0[i] = _mm256_fmadd_ps(p, v0, a0[i]);
          a1[i] = _mm256_fmadd_ps(p, v1, a1[i]);
        }
      }
#pragma GCC unroll 6
      for (int64_t i = 0; i < N; ++i) {
        _mm256_store_ps(acc[i] + c, a0[i]);
        _mm256_store_ps(acc[i] + c + 8, a1[i]);
      }
    }
  }
  for (int64_t i = 0; i < rows * G; ++i) {
    const __m256 inv = _mm256_set1_ps(1.f / sum8(_mm256_load_ps(lane_sums[i])));
    T* o = out + (i / G) * row_stride + (i % G) * D;
    for (int64_t d = 0; d < D; d += 8) store8(o + d, _mm256_mul_ps(_mm256_load_ps(acc[i] + d), inv));
  }
}

template <typename T>
using BlockKernel = void (*)(const T*, T*, int64_t, int64_t, int64_t, const float*, int64_t, float);

// The block kernel for a shape, or nullptr (more than six query heads per KV head, other head
// sizes: the per-key passes).
template <typename T>
BlockKernel<T> block_kernel(int64_t group, int64_t head_dim) {
#define PAGEDSERVE_BLOCK_CASE(G) \
  if (group == G) return head_dim == 64 ? &attend_block<T, G, 8> : head_dim == 128 ? &attend_block<T, G, 16> : nullptr;
  PAGEDSERVE_BLOCK_CASE(1) PAGEDSERVE_BLOCK_CASE(2) PAGEDSERVE_BLOCK_CASE(3)
  PAGEDSERVE_BLOCK_CASE(4) PAGEDSERVE_BLOCK_CASE(5) PAGEDSERVE_BLOCK_CASE(6)
#undef PAGEDSERVE_BLOCK_CASE
  return nullptr;
}

}  // namespace pagedserve::avx2

#endif  // AVX2 without AVX-512
