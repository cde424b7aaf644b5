// Prefill chunks in bf16 with AVX-512 BF16: blocks of query rows against tiles of 16 keys.
//
// The per-row path (attend_tiles) reads each key once per query row and sums every dot product
// across its 16 lanes in a tree of shuffles: on a 1024-token prompt that was a third of the
// prefill (119 GFLOP/s against the linears' 400). Here a block of R rows of one sequence and KV
// head (R x G query heads, 24 in all) goes through the keys together, as a GEMM does:
//
// - the keys are packed once per sequence and KV head, a tile's keys side by side in the lanes
//   ([tile][head_dim / 2][16] bf16 pairs), so one dot-product instruction gives a query head
//   its 16 scores with no sum across lanes, and each loaded pair serves the 24 heads;
// - the values are packed to float32 ([key][head_dim]) and weighted in float32, each value
//   vector loaded once for the 24 heads. The probabilities are not rounded to bf16, so the
//   output is the float32 attention rounded once, as on the per-row path;
// - the online softmax goes the heads side by side: a tile's maxima of all 24 heads in one tree
//   of shuffles (max_lanes16, vec_math.h), their running maxima and rescale factors one vector per sixteen
//   heads, where one head after another waited on its own horizontal max and scalar exp; the
//   masks only in the tiles that reach past a row's context, the rescale only when a maximum rose.
//
// A query head's arithmetic depends on its own query and context alone: a block pads with
// copies of its last row, which are computed and not stored.

#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PAGEDSERVE_PREFILL_BLOCKS 1

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec_math.h"

namespace pagedserve {

constexpr int64_t kBlockHeads = 24;  // query heads a block computes: 24 score registers + a key's
constexpr int64_t kKeyTile = 16;

// Query rows a block takes for G query heads per KV head.
constexpr int64_t block_rows(int64_t group) { return kBlockHeads / group; }

// A packed head holds `context` keys rounded up to whole tiles: first the keys' bf16 pairs as
// 32-bit words, then the values in float32.
inline int64_t packed_keys(int64_t context) { return (context + kKeyTile - 1) / kKeyTile * kKeyTile; }
inline int64_t packed_floats(int64_t context, int64_t head_dim) { return packed_keys(context) * head_dim * 3 / 2; }

// Packs one KV head's first `context` keys and values from the paged cache into `packed`; the
// last tile is padded with zeros (finite: a masked key's probability is 0, and 0 x 0 is 0).
inline void pack_head(const c10::BFloat16* key_head, const c10::BFloat16* value_head, const int32_t* block_table,
                      int64_t context, int64_t block_size, int64_t head_dim, float* packed) {
  const int64_t keys = packed_keys(context), pairs = head_dim / 2;
  uint32_t* key_pairs = reinterpret_cast<uint32_t*>(packed);
  float* values = packed + keys * pairs;
  for (int64_t t = 0; t < keys; ++t) {
    uint32_t* kt = key_pairs + (t / kKeyTile) * pairs * kKeyTile + t % kKeyTile;
    float* v = values + t * head_dim;
    if (t >= context) {
      for (int64_t p = 0; p < pairs; ++p) kt[p * kKeyTile] = 0;
      std::memset(v, 0, head_dim * sizeof(float));
      continue;
    }
    const int64_t row = static_cast<int64_t>(block_table[t / block_size]) * block_size * head_dim + (t % block_size) * head_dim;
    uint32_t k32[64];  // head_dim <= 128 on this path: at most 64 bf16 pairs (memcpy: no aliasing)
    std::memcpy(k32, key_head + row, head_dim * sizeof(c10::BFloat16));
    for (int64_t p = 0; p < pairs; ++p) kt[p * kKeyTile] = k32[p];
    for (int64_t d = 0; d < head_dim; d += 16) _mm512_storeu_ps(v + d, load16(value_head + row + d));
  }
}

// One block: `rows` (<= R) query rows from `query`, each `row_stride` elements after the last,
// whose first row sees `first_context` keys and each next row one more (causal). G query heads
// per KV head, C chunks of 16 in head_dim; `packed` is pack_head's for `packed_context` keys.
template <int64_t G, int64_t C>
void attend_block(const c10::BFloat16* query, c10::BFloat16* out, int64_t row_stride, int64_t rows, int64_t first_context,
                  const float* packed, int64_t packed_context, float scale) {
  constexpr int64_t D = C * 16, P = D / 2, R = block_rows(G), N = R * G;
  const int64_t last_context = first_context + rows - 1;
  const uint32_t* key_pairs = reinterpret_cast<const uint32_t*>(packed);
  const float* values = packed + packed_keys(packed_context) * P;
  constexpr int64_t H = (N + 15) / 16;  // vectors of one lane per head
  alignas(64) uint32_t q[N][P];
  alignas(64) float acc[N][D], probs[N][kKeyTile], lane_sums[N][kKeyTile];
  alignas(64) float maxes[H * 16], shrink[H * 16];
  int64_t context[N];
  for (int64_t i = 0; i < N; ++i) {
    const int64_t row = std::min(i / G, rows - 1);  // padding: the last row again
    std::memcpy(q[i], query + row * row_stride + (i % G) * D, D * sizeof(c10::BFloat16));
    std::fill(acc[i], acc[i] + D, 0.f);
    std::fill(lane_sums[i], lane_sums[i] + kKeyTile, 0.f);
    context[i] = first_context + row;
  }
  std::fill(maxes, maxes + H * 16, -std::numeric_limits<float>::infinity());
  for (int64_t t0 = 0; t0 < last_context; t0 += kKeyTile) {
    const uint32_t* kt = key_pairs + t0 * P;
    __m512 s[H * 16];
#pragma GCC unroll 24
    for (int64_t i = 0; i < N; ++i) s[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; ++p) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + p * kKeyTile);
#pragma GCC unroll 24
      for (int64_t i = 0; i < N; ++i) s[i] = _mm512_dpbf16_ps(s[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[i][p])), k);
    }
    // The online softmax, the heads side by side: each head's keys past its context masked (only
    // in the tiles that reach past the block's first row's context), the tile's maxima of all
    // heads in one tree of shuffles, the running maxima and their rescale factors one vector per
    // sixteen heads, then each head's 16 probabilities from one vector exponential.
    __mmask16 valid[N];
    const bool diagonal = t0 + kKeyTile > first_context;
#pragma GCC unroll 24
    for (int64_t i = 0; i < N; ++i) {
      valid[i] = diagonal ? static_cast<__mmask16>((1u << std::clamp<int64_t>(context[i] - t0, 0, kKeyTile)) - 1) : 0xFFFF;
      s[i] = _mm512_mask_blend_ps(valid[i], _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _mm512_mul_ps(s[i], _mm512_set1_ps(scale)));
    }
    for (int64_t i = N; i < H * 16; ++i) s[i] = s[N - 1];  // lanes past the last head: ignored
    bool rescale = false;
    for (int64_t h = 0; h < H; ++h) {
      const __m512 old_max = _mm512_load_ps(maxes + h * 16);
      const __m512 new_max = _mm512_max_ps(old_max, max_lanes16(s + h * 16));
      // exp(old - new): 1 where the maximum held; 0 from -inf (the first tile, nothing to rescale).
      const __mmask16 rose = _mm512_cmp_ps_mask(new_max, old_max, _CMP_GT_OQ);
      const __mmask16 had_any = _mm512_cmp_ps_mask(old_max, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
      const __m512 factor = _mm512_maskz_mov_ps(had_any, exp16(_mm512_sub_ps(old_max, new_max)));
      _mm512_store_ps(shrink + h * 16, _mm512_mask_blend_ps(rose, _mm512_set1_ps(1.f), factor));
      _mm512_store_ps(maxes + h * 16, new_max);
      rescale |= rose != 0;
    }
#pragma GCC unroll 24
    for (int64_t i = 0; i < N; ++i) {
      const __m512 p = _mm512_maskz_mov_ps(valid[i], exp16(_mm512_sub_ps(s[i], _mm512_set1_ps(maxes[i]))));
      _mm512_store_ps(lane_sums[i], _mm512_fmadd_ps(_mm512_load_ps(lane_sums[i]), _mm512_set1_ps(shrink[i]), p));
      _mm512_store_ps(probs[i], p);
    }
    const float* vt = values + t0 * D;
    const int64_t n = std::min(kKeyTile, last_context - t0);
    for (int64_t c = 0; c < C; ++c) {  // the weighted values, 16 of head_dim at a time for all N heads
      __m512 a[N];
#pragma GCC unroll 24
      for (int64_t i = 0; i < N; ++i) {
        a[i] = _mm512_load_ps(acc[i] + c * 16);
        if (rescale) a[i] = _mm512_mul_ps(a[i], _mm512_set1_ps(shrink[i]));
      }
      for (int64_t k = 0; k < n; ++k) {
        const __m512 v = _mm512_loadu_ps(vt + k * D + c * 16);
#pragma GCC unroll 24
        for (int64_t i = 0; i < N; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(probs[i][k]), v, a[i]);
      }
#pragma GCC unroll 24
      for (int64_t i = 0; i < N; ++i) _mm512_store_ps(acc[i] + c * 16, a[i]);
    }
  }
  for (int64_t i = 0; i < rows * G; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(lane_sums[i])));
    c10::BFloat16* o = out + (i / G) * row_stride + (i % G) * D;
    for (int64_t c = 0; c < C; ++c) store16(o + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[i] + c * 16), inv));
  }
}

using BlockKernel = void (*)(const c10::BFloat16*, c10::BFloat16*, int64_t, int64_t, int64_t, const float*, int64_t, float);

// The block kernel for a shape, or nullptr (other shapes keep the per-row path).
inline BlockKernel block_kernel(int64_t group, int64_t head_dim) {
#define PAGEDSERVE_BLOCK_CASE(G) \
  if (group == G) return head_dim == 64 ? &attend_block<G, 4> : head_dim == 128 ? &attend_block<G, 8> : nullptr;
  PAGEDSERVE_BLOCK_CASE(1) PAGEDSERVE_BLOCK_CASE(2) PAGEDSERVE_BLOCK_CASE(3) PAGEDSERVE_BLOCK_CASE(4)
  PAGEDSERVE_BLOCK_CASE(5) PAGEDSERVE_BLOCK_CASE(6) PAGEDSERVE_BLOCK_CASE(7) PAGEDSERVE_BLOCK_CASE(8)
#undef PAGEDSERVE_BLOCK_CASE
  return nullptr;
}

}  // namespace pagedserve

#endif  // __AVX512F__ && __AVX512BF16__
