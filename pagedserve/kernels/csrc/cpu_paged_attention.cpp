// Paged attention on the CPU straight from the KV cache: no gathered copy of K/V, no padding.
//
// The cache layout is reference.py's: one tensor per layer, [2, kv_heads, num_blocks, block_size,
// head_dim] (keys, then values). Every query token of sequences [first_seq, end_seq) is one row;
// its context is the sequence's first `seq_len - query_len + j + 1` tokens (causal). One task is a
// (query token, KV head) pair: the `group` query heads that share the KV head read each cached
// key and value once, in the cache's own dtype, and accumulate in float32. bfloat16 goes tile by
// tile with an online softmax (attend_tiles); float32 and float16 in two passes, scores then the
// softmax-weighted sum of values (attend_per_key). Threads split the tasks by keys to read. On a
// CPU without AVX-512 (Zen 3) every dtype takes the two passes, eight lanes wide (AVX2); a CPU
// with neither, and shapes the paths are not built for, take the portable loop (attend_one).
// bf16 prefill chunks of at least a block's rows, on a CPU with AVX-512 BF16, go in blocks of
// rows against packed tiles of keys instead (cpu_prefill_attention.h): a 1024-token prompt's
// attention 2.1x faster on a Zen 4.
// On a CPU with AVX2 and no AVX-512, prefill chunks of every dtype go in blocks in float32
// (cpu_prefill_attention_avx2.h).
//
// Measured on SmolLM2's shapes (9 heads, 3 KV heads, head_dim 64) on one thread of a Zen 5, the
// least of 60 calls, against the two-pass kernel that came before for every dtype: 128 bf16
// decode rows of 150-250 tokens 1.25x faster, 14 prompts of 146 tokens 1.18x, two of 1024 level;
// float32 level. On two threads the split by work adds 1.1-1.2x for decode rows.
//
// Built and loaded by native_build.py (g++ -O3 -march=native -fopenmp against torch's headers
// and its own libgomp, so at::parallel_for runs on torch's thread pool).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"
#include "cpu_prefill_attention.h"
#include "cpu_prefill_attention_avx2.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_VECTOR_ATTENTION 1
using VectorLanes = pagedserve::Lanes16;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDSERVE_VECTOR_ATTENTION 1
using VectorLanes = pagedserve::Lanes8;  // CPUs without AVX-512 (Zen 3): the per-key passes, 8 lanes wide
#endif

namespace {

using pagedserve::to_float;

// How many (query token, KV head) tasks each path has run since the library loaded: the tests
// assert that a model of a served shape really took the vector path (AVX-512, or AVX2 where the
// CPU has no AVX-512), which no output can show.
std::atomic<int64_t> tasks_on_vector_path{0};
std::atomic<int64_t> tasks_on_portable_loop{0};
std::atomic<int64_t> tasks_in_prefill_blocks{0};  // of the vector path's: those computed in blocks of rows

// The instruction sets this build compiled paths for (-march=native decides): 1 the AVX-512
// attention, 2 its AVX-512 BF16 dot products, 4 the AVX2 attention (built only without AVX-512),
// 8 its prefill chunks in blocks of rows (cpu_prefill_attention_avx2.h).
// A CPU whose flags promise more was built wrong.
int64_t attention_isa() {
  int64_t isa = 0;
#if defined(__AVX512F__)
  isa |= 1;
#elif defined(PAGEDSERVE_VECTOR_ATTENTION)
  isa |= 4;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  isa |= 2;
#endif
#if defined(PAGEDSERVE_PREFILL_BLOCKS_AVX2)
  isa |= 8;
#endif
  return isa;
}

std::vector<int64_t> attention_path_counts() {
  return {tasks_on_vector_path.load(), tasks_on_portable_loop.load(), tasks_in_prefill_blocks.load()};
}

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

// The blocks of a sequence lie anywhere in the cache: without a prefetch, each new block's first
// rows stall on memory (measured: the prefetch made a 128-row bf16 decode 1.2x faster).
// Into L2, not L1: most likely a prefetch into L1 holds one of L1's few miss buffers until its
// line arrives, and a tile's 64 lines (16 keys and values) overflowed them, so the loads waited.
// With every layer's cache in memory, as a forward reads them (Zen 4, SmolLM2's shapes, one
// thread, `native_from_memory_ms` of benchmarks/cpu_kernels.py): into L2 and spread over the
// tile loop, 256 bf16 decode rows of 128-192 tokens 1.45x faster, 64 rows of 1024-1152 tokens
// 1.88x; float32 (the per-key passes, row by row: row_of) 1.63x and 2.07x.
template <typename T>
inline void prefetch_block(const T* block, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(block);
  for (int64_t offset = 0; offset < elements * static_cast<int64_t>(sizeof(T)); offset += 64) __builtin_prefetch(bytes + offset, 0, 2);
}

// Token t's row of a head's context, and a prefetch of the row two blocks after it: one row per
// key, spread over the pass, where fetching the whole next block at its start (a float32 block
// is 64 lines) left the pass waiting. float32 decode, 30 layers' caches in turn (Zen 4, two threads,
// scratch): 200 rows of 128-168 tokens 1.19x faster, 64 rows of about 1100 tokens 1.32x.
template <typename T>
inline const T* row_of(const T* head, const int32_t* block_table, int64_t t, int64_t context, int64_t block_size, int64_t head_dim) {
  const int shift = std::countr_zero(static_cast<uint64_t>(block_size));  // a power of two: no division per key
  const int64_t ahead = t + 2 * block_size, mask = block_size - 1, elements = block_size * head_dim;
  if (ahead < context)
    prefetch_block(head + static_cast<int64_t>(block_table[ahead >> shift]) * elements + (ahead & mask) * head_dim, head_dim);
  return head + static_cast<int64_t>(block_table[t >> shift]) * elements + (t & mask) * head_dim;
}

struct Shape {
  int64_t num_heads, num_kv_heads, num_blocks, block_size, head_dim, max_blocks;
};

// Each key's row as an element offset from its head's start (the cache is paged). They depend on
// the sequence's block table alone, so a row's other KV heads, and a prefill chunk's later rows,
// extend what the task before computed instead of computing it again.
struct KeyOffsets {
  const int32_t* table = nullptr;
  std::vector<int64_t> of;

  const int64_t* up_to(const int32_t* block_table, int64_t context, int64_t block_size, int64_t head_dim) {
    if (block_table != table) {
      table = block_table;
      of.clear();
    }
    const int64_t block_elements = block_size * head_dim, shift = std::countr_zero(static_cast<uint64_t>(block_size));
    for (int64_t t = static_cast<int64_t>(of.size()); t < context; ++t)  // powers of two: no division per key
      of.push_back(static_cast<int64_t>(block_table[t >> shift]) * block_elements + (t & (block_size - 1)) * head_dim);
    return of.data();
  }
};

struct Scratch {  // one per thread and call, reused by its tasks
  std::vector<float> floats;
  KeyOffsets offsets;
};

// At most this much of the next task's K and V, plus a block: its first two tiles in bf16 (the
// tile loop fetches the rest two tiles ahead). All of a decode row's context at once (up to 64
// KB) was slower: more lines in flight than the core keeps, and the running task's loads queued.
constexpr int64_t kPrefetchBytes = 4 * 1024;
constexpr int64_t kTaskCost = 16;              // a task's fixed cost, in keys, for the split among threads

template <typename T>
void prefetch_context(const T* key_head, const T* value_head, const int32_t* block_table, int64_t context, const Shape& s) {
  const int64_t block_elements = s.block_size * s.head_dim;
  const int64_t blocks = std::min((context + s.block_size - 1) / s.block_size,
                                  kPrefetchBytes / (2 * block_elements * static_cast<int64_t>(sizeof(T))) + 1);
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_block(key_head + static_cast<int64_t>(block_table[b]) * block_elements, block_elements);
    prefetch_block(value_head + static_cast<int64_t>(block_table[b]) * block_elements, block_elements);
  }
}

// Attention of one query token's `group` heads over one KV head's first `context` tokens.
template <typename T>
void attend_one(const T* query, T* out, const T* key_head, const T* value_head, const int32_t* block_table,
                int64_t context, int64_t group, const Shape& s, float scale, std::vector<float>& scratch) {
  const int64_t D = s.head_dim, BS = s.block_size;
  scratch.resize(group * D * 3 + group * context);
  float* q = scratch.data();          // [group, D], scaled
  float* acc = q + group * D;         // [group, D]
  float* row = acc + group * D;       // one K or V row in float32
  float* scores = row + D;            // [group, context]
  for (int64_t j = 0; j < group; ++j) {
    row_to_float(query + j * D, q + j * D, D);
    for (int64_t d = 0; d < D; ++d) q[j * D + d] *= scale;
  }
  std::vector<float> maxes(group, -std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < context; ++t) {
    const T* k = row_of(key_head, block_table, t, context, BS, D);
    row_to_float(k, row, D);
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * D;
      const float dot = pagedserve::fixed_order_sum(D, [&](int64_t d) { return qj[d] * row[d]; });
      scores[j * context + t] = dot;
      maxes[j] = std::max(maxes[j], dot);
    }
  }
  std::vector<float> sums(group, 0.f);
  for (int64_t j = 0; j < group; ++j) {
    float* sj = scores + j * context;
    float sum = 0.f;
    for (int64_t t = 0; t < context; ++t) {
      sj[t] = std::exp(sj[t] - maxes[j]);
      sum += sj[t];
    }
    sums[j] = sum;
  }
  std::fill(acc, acc + group * D, 0.f);
  for (int64_t t = 0; t < context; ++t) {
    const T* v = row_of(value_head, block_table, t, context, BS, D);
    row_to_float(v, row, D);
    for (int64_t j = 0; j < group; ++j) {
      const float p = scores[j * context + t];
      float* aj = acc + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) aj[d] += p * row[d];
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    const float inv = 1.f / sums[j];
    for (int64_t d = 0; d < D; ++d) out[j * D + d] = static_cast<T>(acc[j * D + d] * inv);
  }
}


#if defined(__AVX512F__)
// The AVX-512 path works on tiles of 16 keys with an online softmax (one pass over K and V,
// block by block, the running max rescaling what came before). A tile's 16 dot products are
// summed across their lanes together, in a tree of shuffles (sum_lanes16, vec_math.h), instead of one
// horizontal sum per key; its 16 probabilities come from one vector exponential per head. A task's
// arithmetic depends on its own inputs alone, never on the batch around it.

constexpr int64_t kTile = 16;

template <typename T, int64_t C>
constexpr bool kBf16Dots =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16> && C % 2 == 0;
#else
    false;
#endif

// dots[j][k]: the 16 float32 lanes whose sum is query head j's score for key k of a tile of n
// keys (a short tile repeats its last key). bf16 takes pair dot products of the query's own
// values, one head at a time; the other dtypes load each key once for every head (the scaled
// query `q` from L1), which keeps the loads down where a key is four vectors wide.
template <typename T, int64_t G, int64_t C>
inline void tile_dots(const T* query, const float (*q)[C * 16], const T* key_head, const int64_t* offsets, int64_t n,
                      __m512 (*dots)[kTile]) {
  constexpr int64_t D = C * 16;
#if defined(__AVX512BF16__)
  if constexpr (kBf16Dots<T, C>) {
    for (int64_t j = 0; j < G; ++j) {
      __m512bh q_pairs[C / 2];
      for (int64_t c = 0; c < C / 2; ++c) q_pairs[c] = (__m512bh)_mm512_loadu_si512(query + j * D + c * 32);
#pragma GCC unroll 16
      for (int64_t k = 0; k < kTile; ++k) {
        const T* key = key_head + offsets[std::min(k, n - 1)];
        __m512 dot = _mm512_setzero_ps();
        for (int64_t c = 0; c < C / 2; ++c) dot = _mm512_dpbf16_ps(dot, q_pairs[c], (__m512bh)_mm512_loadu_si512(key + c * 32));
        dots[j][k] = dot;
      }
    }
    return;
  }
#endif
  for (int64_t k = 0; k < kTile; ++k) {
    const T* key = key_head + offsets[std::min(k, n - 1)];
    __m512 kc[C];
    for (int64_t c = 0; c < C; ++c) kc[c] = pagedserve::load16(key + c * 16);
    for (int64_t j = 0; j < G; ++j) {
      __m512 dot = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; ++c) dot = _mm512_fmadd_ps(_mm512_load_ps(q[j] + c * 16), kc[c], dot);
      dots[j][k] = dot;
    }
  }
}

// bf16 with AVX-512 BF16: G query heads per KV head and C chunks of 16 in head_dim, as constants,
// so a tile's dot products and the value accumulators live in registers.
template <typename T, int64_t G, int64_t C>
bool attend_tiles(const T* query, T* out, const T* key_head, const T* value_head, const int32_t* block_table,
                  int64_t context, bool cold, const Shape& s, float scale, KeyOffsets& key_offsets) {
  constexpr int64_t D = C * 16;
  constexpr bool bf16_dots = kBf16Dots<T, C>;
  // A context that outgrows L1 streams from L2 even when an earlier row of its sequence read it.
  const bool prefetch = cold || context * D * static_cast<int64_t>(sizeof(T)) * 2 > 32 * 1024;
  const int64_t* offsets = key_offsets.up_to(block_table, context, s.block_size, D);
  // The tile's 16 dot products need 16 registers: the query and the running sums wait in memory
  // (one load or store per tile) rather than spill in the key loop.
  alignas(64) float q[G][D], acc[G][D], lane_sums[G][kTile], probs[G][kTile];
  __m512 dots[G][kTile];
  float maxes[G];
  for (int64_t j = 0; j < G; ++j) {
    for (int64_t c = 0; c < C; ++c) {  // scaled, unless the bf16 dot products take the query's own values
      _mm512_store_ps(q[j] + c * 16, _mm512_mul_ps(pagedserve::load16(query + j * D + c * 16), _mm512_set1_ps(scale)));
      _mm512_store_ps(acc[j] + c * 16, _mm512_setzero_ps());
    }
    _mm512_store_ps(lane_sums[j], _mm512_setzero_ps());
    maxes[j] = -std::numeric_limits<float>::infinity();
  }
  for (int64_t t0 = 0; t0 < context; t0 += kTile) {
    const int64_t n = std::min(kTile, context - t0);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    tile_dots<T, G, C>(query, q, key_head, offsets + t0, n, dots);
    for (int64_t j = 0; j < G; ++j) {
      __m512 scores = pagedserve::sum_lanes16(dots[j]);
      if constexpr (bf16_dots) scores = _mm512_mul_ps(scores, _mm512_set1_ps(scale));
      scores = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), scores);
      const float tile_max = _mm512_reduce_max_ps(scores);
      __m512 sums = _mm512_load_ps(lane_sums[j]);
      if (tile_max > maxes[j]) {  // rescale what the earlier tiles summed to the new max
        const __m512 shrink = _mm512_set1_ps(std::exp(maxes[j] - tile_max));
        for (int64_t c = 0; c < C; ++c) _mm512_store_ps(acc[j] + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[j] + c * 16), shrink));
        sums = _mm512_mul_ps(sums, shrink);
        maxes[j] = tile_max;
      }
      const __m512 p = _mm512_maskz_mov_ps(valid, pagedserve::exp16(_mm512_sub_ps(scores, _mm512_set1_ps(maxes[j]))));
      _mm512_store_ps(lane_sums[j], _mm512_add_ps(sums, p));
      _mm512_store_ps(probs[j], p);
    }
    __m512 a[G][C];
    for (int64_t j = 0; j < G; ++j)
      for (int64_t c = 0; c < C; ++c) a[j][c] = _mm512_load_ps(acc[j] + c * 16);
    for (int64_t k = 0; k < n; ++k) {
      // A key and a value two tiles ahead, one of each per key here: spread over the loop, not
      // all at the tile's start. Against one tile ahead (two threads, scratch): 1.06x at 148
      // tokens of context, 1.4x at 1100; three ahead, or a burst at the tile's start, slower.
      if (prefetch && t0 + 2 * kTile + k < context) {
        prefetch_block(key_head + offsets[t0 + 2 * kTile + k], D);
        prefetch_block(value_head + offsets[t0 + 2 * kTile + k], D);
      }
      const T* v = value_head + offsets[t0 + k];
      for (int64_t c = 0; c < C; ++c) {
        const __m512 vc = pagedserve::load16(v + c * 16);
        for (int64_t j = 0; j < G; ++j) a[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[j][k]), vc, a[j][c]);
      }
    }
    for (int64_t j = 0; j < G; ++j)
      for (int64_t c = 0; c < C; ++c) _mm512_store_ps(acc[j] + c * 16, a[j][c]);
  }
  for (int64_t j = 0; j < G; ++j) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(lane_sums[j])));
    for (int64_t c = 0; c < C; ++c) pagedserve::store16(out + j * D + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[j] + c * 16), inv));
  }
  return true;
}

#endif  // __AVX512F__

#if defined(PAGEDSERVE_VECTOR_ATTENTION)
// float32 and float16 (and bf16 without AVX-512 BF16): one key at a time, two passes (scores,
// then the weighted values), each key loaded once for all G heads. Measured against the tiles
// above, this stays ahead where no bf16 pair products apply: 1.15x on float32 prefill, where a
// key is four vectors wide. G and C (head_dim in vectors of L's width: 16 lanes with AVX-512, 8
// with AVX2) are constants so the accumulators live in registers, or spill to L1 on AVX2's 16.
template <typename L, typename T, int64_t G, int64_t C>
bool attend_per_key(const T* query, T* out, const T* key_head, const T* value_head, const int32_t* block_table,
                    int64_t context, const Shape& s, float scale, std::vector<float>& scratch) {
  using V = typename L::V;
  constexpr int64_t W = L::kWidth, D = C * W;
  const int64_t BS = s.block_size;
  const int64_t padded = (context + W - 1) / W * W;
  scratch.resize(G * padded);
  float* scores = scratch.data();  // [G, padded]
  V q[G][C];
  for (int64_t j = 0; j < G; ++j)
    for (int64_t c = 0; c < C; ++c) q[j][c] = L::mul(L::load(query + j * D + c * W), L::set1(scale));
  for (int64_t t = 0; t < context; ++t) {
    const T* k = row_of(key_head, block_table, t, context, BS, D);
    V acc[G];
    for (int64_t j = 0; j < G; ++j) acc[j] = L::zero();
    for (int64_t c = 0; c < C; ++c) {
      const V kc = L::load(k + c * W);
      for (int64_t j = 0; j < G; ++j) acc[j] = L::fmadd(q[j][c], kc, acc[j]);
    }
    for (int64_t j = 0; j < G; ++j) scores[j * padded + t] = L::sum(acc[j]);
  }
  float inv_sum[G];
  for (int64_t j = 0; j < G; ++j) {
    float* sj = scores + j * padded;
    for (int64_t t = context; t < padded; ++t) sj[t] = -std::numeric_limits<float>::infinity();
    V m = L::set1(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < padded; t += W) m = L::max(m, L::loadu(sj + t));
    const V max = L::set1(L::max_of(m));
    V sum = L::zero();
    for (int64_t t = 0; t < padded; t += W) {
      const V e = L::exp(L::sub(L::loadu(sj + t), max));
      L::storeu(sj + t, e);
      sum = L::add(sum, e);
    }
    inv_sum[j] = 1.f / L::sum(sum);
  }
  V acc[G][C];
  for (int64_t j = 0; j < G; ++j)
    for (int64_t c = 0; c < C; ++c) acc[j][c] = L::zero();
  for (int64_t t = 0; t < context; ++t) {
    const T* v = row_of(value_head, block_table, t, context, BS, D);
    for (int64_t c = 0; c < C; ++c) {
      const V vc = L::load(v + c * W);
      for (int64_t j = 0; j < G; ++j) acc[j][c] = L::fmadd(L::set1(scores[j * padded + t]), vc, acc[j][c]);
    }
  }
  float row[W];
  for (int64_t j = 0; j < G; ++j)
    for (int64_t c = 0; c < C; ++c) {
      L::storeu(row, L::mul(acc[j][c], L::set1(inv_sum[j])));
      for (int64_t d = 0; d < W; ++d) out[j * D + c * W + d] = static_cast<T>(row[d]);
    }
  return true;
}

// The shapes of the models served (query heads per KV head 1-8; head_dim 64 or 128); others
// take the portable loop. bf16 with AVX-512 BF16 takes the tiles, everything else the per-key passes.
template <typename T>
bool attend_one_vectorized(const T* query, T* out, const T* key_head, const T* value_head, const int32_t* block_table,
                           int64_t context, bool cold, int64_t group, const Shape& s, float scale, Scratch& scratch) {
  constexpr int64_t W = VectorLanes::kWidth;
#if defined(__AVX512F__)
#define PAGEDSERVE_TILES(G, D)                                                                                                       \
  if constexpr (kBf16Dots<T, D / 16>)                                                                                                \
    return attend_tiles<T, G, D / 16>(query, out, key_head, value_head, block_table, context, cold, s, scale, scratch.offsets);       \
  else
#else
#define PAGEDSERVE_TILES(G, D)
#endif
#define PAGEDSERVE_CASE(G, D)                                                                                                  \
  if (group == G && s.head_dim == D) {                                                                                         \
    PAGEDSERVE_TILES(G, D)                                                                                                     \
    return attend_per_key<VectorLanes, T, G, D / W>(query, out, key_head, value_head, block_table, context, s, scale, scratch.floats); \
  }
#define PAGEDSERVE_CASES(D) \
  PAGEDSERVE_CASE(1, D) PAGEDSERVE_CASE(2, D) PAGEDSERVE_CASE(3, D) PAGEDSERVE_CASE(4, D) \
  PAGEDSERVE_CASE(5, D) PAGEDSERVE_CASE(6, D) PAGEDSERVE_CASE(7, D) PAGEDSERVE_CASE(8, D)
  PAGEDSERVE_CASES(64)
  PAGEDSERVE_CASES(128)
#undef PAGEDSERVE_CASES
#undef PAGEDSERVE_CASE
#undef PAGEDSERVE_TILES
  (void)cold;
  return false;
}
#endif  // PAGEDSERVE_VECTOR_ATTENTION

// Boundaries of `parts` runs of consecutive tasks of about equal total cost.
std::vector<int64_t> split_costs(const std::vector<int64_t>& cost, int64_t parts) {
  int64_t total = 0, done = 0;
  for (int64_t c : cost) total += c;
  std::vector<int64_t> bounds{0};
  for (int64_t i = 0; i < static_cast<int64_t>(cost.size()) && static_cast<int64_t>(bounds.size()) < parts; ++i) {
    done += cost[i];
    if (done * parts >= total * static_cast<int64_t>(bounds.size())) bounds.push_back(i + 1);
  }
  bounds.push_back(static_cast<int64_t>(cost.size()));
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  return bounds;
}

// Task boundaries that give each of `parts` threads about the same number of keys to read. An even
// split of the tasks would not: decode rows come longest first, so the first thread got the
// longest contexts. Each task also counts a tile's worth of fixed cost. Whole rows (all heads of
// a token) per part: the next task's prefetch stays in its part.
std::vector<int64_t> split_by_work(const std::vector<int64_t>& context_of_token, int64_t num_kv_heads, int64_t parts) {
  const int64_t num_rows = static_cast<int64_t>(context_of_token.size());
  std::vector<int64_t> cost;
  cost.reserve(num_rows);
  for (int64_t context : context_of_token) cost.push_back(context + kTaskCost);
  std::vector<int64_t> bounds = split_costs(cost, std::max<int64_t>(1, std::min(parts, num_rows * num_kv_heads)));
  for (int64_t& bound : bounds) bound *= num_kv_heads;  // rows to tasks
  return bounds;
}

// The query rows one task each per KV head takes: each row's token, sequence and context.
struct Rows {
  std::vector<int64_t> token, seq, context;
};

template <typename T>
void paged_attention_impl(const at::Tensor& query, at::Tensor& out, const at::Tensor& kv_cache, const Rows& rows,
                          const at::Tensor& block_tables, const Shape& s, float scale) {
  const std::vector<int64_t>& seq_of_token = rows.seq;
  const std::vector<int64_t>& context_of_token = rows.context;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t head_stride = s.num_blocks * s.block_size * s.head_dim;
  const T* q_base = query.data_ptr<T>();
  T* out_base = out.data_ptr<T>();
  const T* keys = kv_cache.data_ptr<T>();
  const T* values = keys + s.num_kv_heads * head_stride;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_rows = static_cast<int64_t>(seq_of_token.size());
  const std::vector<int64_t> bounds = split_by_work(context_of_token, s.num_kv_heads, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t first_part, int64_t end_part) {
    const int64_t begin = bounds[first_part], end = bounds[end_part];
    Scratch scratch;
    int64_t fast = 0;
    // A sequence's first row of this step reads its context from memory; the rows after it (a
    // prefill chunk's) find the same keys and values in cache, where a prefetch only costs.
    const auto is_cold = [&](int64_t row) { return row == 0 || seq_of_token[row - 1] != seq_of_token[row]; };
    for (int64_t task = begin; task < end; ++task) {
      if (task + 1 < end && is_cold((task + 1) / s.num_kv_heads)) {  // the next task's K/V stream in while this one computes
        const int64_t r1 = (task + 1) / s.num_kv_heads, h1 = (task + 1) % s.num_kv_heads;
        prefetch_context(keys + h1 * head_stride, values + h1 * head_stride, tables + seq_of_token[r1] * s.max_blocks,
                         context_of_token[r1], s);
      }
      const int64_t r = task / s.num_kv_heads, h = task % s.num_kv_heads;
      const int64_t offset = (rows.token[r] * s.num_heads + h * group) * s.head_dim;
      const T* key_head = keys + h * head_stride;
      const T* value_head = values + h * head_stride;
      const int32_t* table = tables + seq_of_token[r] * s.max_blocks;
#if defined(PAGEDSERVE_VECTOR_ATTENTION)
      if (attend_one_vectorized<T>(q_base + offset, out_base + offset, key_head, value_head, table, context_of_token[r], is_cold(r), group, s, scale, scratch)) {
        ++fast;
        continue;
      }
#endif
      attend_one<T>(q_base + offset, out_base + offset, key_head, value_head, table, context_of_token[r], group, s, scale, scratch.floats);
    }
    tasks_on_vector_path += fast;  // once per chunk of tasks: no shared counter in the loop
    tasks_on_portable_loop += (end - begin) - fast;
  });
}

#if defined(PAGEDSERVE_PREFILL_BLOCKS)
namespace blocks = pagedserve;  // bf16 with AVX-512 BF16 (cpu_prefill_attention.h)
#define PAGEDSERVE_ANY_PREFILL_BLOCKS 1
#elif defined(PAGEDSERVE_PREFILL_BLOCKS_AVX2)
namespace blocks = pagedserve::avx2;  // every dtype, in float32, with AVX2 and no AVX-512 (cpu_prefill_attention_avx2.h)
#define PAGEDSERVE_ANY_PREFILL_BLOCKS 1
#endif

template <typename T>
using BlockKernelOf = void (*)(const T*, T*, int64_t, int64_t, int64_t, const float*, int64_t, float);

// The kernel that takes a prefill chunk of this dtype and shape in blocks of rows, or nullptr.
template <typename T>
BlockKernelOf<T> block_kernel_for(int64_t group, int64_t head_dim) {
#if defined(PAGEDSERVE_PREFILL_BLOCKS)
  if constexpr (std::is_same_v<T, c10::BFloat16>) return pagedserve::block_kernel(group, head_dim);
  return nullptr;
#elif defined(PAGEDSERVE_PREFILL_BLOCKS_AVX2)
  return pagedserve::avx2::block_kernel<T>(group, head_dim);
#else
  (void)group, (void)head_dim;
  return nullptr;
#endif
}

// A prefill chunk taken in blocks of rows.
struct BlockSeq {
  int64_t seq, first_token, query_len, seq_len;
};

#if defined(PAGEDSERVE_ANY_PREFILL_BLOCKS)
// Packs each sequence's keys and values per KV head, then runs its blocks of rows, the threads
// splitting the blocks by keys to read.
template <typename T>
void prefill_blocks(const at::Tensor& query, at::Tensor& out, const at::Tensor& kv_cache, const std::vector<BlockSeq>& seqs,
                    const at::Tensor& block_tables, const Shape& s, float scale, BlockKernelOf<T> kernel) {
  const int64_t group = s.num_heads / s.num_kv_heads, R = blocks::block_rows(group), H = s.num_kv_heads;
  const int64_t head_stride = s.num_blocks * s.block_size * s.head_dim, row_stride = s.num_heads * s.head_dim;
  const T* keys = kv_cache.data_ptr<T>();
  const T* values = keys + H * head_stride;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<int64_t> packed_at{0};  // per (sequence, KV head)
  for (const BlockSeq& q : seqs)
    for (int64_t h = 0; h < H; ++h) packed_at.push_back(packed_at.back() + blocks::packed_floats(q.seq_len, s.head_dim));
  const std::unique_ptr<float[]> packed(new float[packed_at.back()]);  // every float is written: no zeroing
  at::parallel_for(0, static_cast<int64_t>(seqs.size()) * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const BlockSeq& q = seqs[i / H];
      const int64_t h = i % H;
      blocks::pack_head(keys + h * head_stride, values + h * head_stride, tables + q.seq * s.max_blocks, q.seq_len,
                        s.block_size, s.head_dim, packed.get() + packed_at[i]);
    }
  });
  struct Task {
    int64_t packed, first_row, rows, first_context;  // packed: the (sequence, KV head) index
  };
  std::vector<Task> tasks;
  std::vector<int64_t> cost;
  for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < seqs[i].query_len; r += R) {
        const int64_t rows = std::min(R, seqs[i].query_len - r), first_context = seqs[i].seq_len - seqs[i].query_len + r + 1;
        tasks.push_back({i * H + h, seqs[i].first_token + r, rows, first_context});
        cost.push_back(R * (first_context + rows + kTaskCost));  // a block's cost is all of its R rows
      }
  const std::vector<int64_t> bounds = split_costs(cost, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t first_part, int64_t end_part) {
    for (int64_t t = bounds[first_part]; t < bounds[end_part]; ++t) {
      const Task& task = tasks[t];
      const int64_t offset = task.first_row * row_stride + (task.packed % H) * group * s.head_dim;
      kernel(query.data_ptr<T>() + offset, out.data_ptr<T>() + offset, row_stride, task.rows, task.first_context,
             packed.get() + packed_at[task.packed], seqs[task.packed / H].seq_len, scale);
    }
  });
  int64_t computed = 0;
  for (const BlockSeq& q : seqs) computed += q.query_len * H;
  tasks_on_vector_path += computed;
  tasks_in_prefill_blocks += computed;
}
#endif

// Prefill chunks of at least a block's rows (two at the least) go in blocks where a block kernel
// takes the dtype and shape; decodes and short chunks by row.
template <typename T>
void attention_of_dtype(const at::Tensor& query, at::Tensor& out, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                        const int64_t* qsl_p, const int64_t* lens_p, int64_t first_seq, int64_t end_seq, const Shape& s, float scale) {
  const BlockKernelOf<T> kernel = block_kernel_for<T>(s.num_heads / s.num_kv_heads, s.head_dim);
  std::vector<BlockSeq> block_seqs;
  Rows rows;
  for (int64_t i = first_seq; i < end_seq; ++i) {
    const int64_t query_len = qsl_p[i + 1] - qsl_p[i];
    TORCH_CHECK(lens_p[i] <= s.max_blocks * s.block_size, "a sequence is longer than its block table");
#if defined(PAGEDSERVE_ANY_PREFILL_BLOCKS)
    if (kernel != nullptr && query_len >= std::max<int64_t>(2, blocks::block_rows(s.num_heads / s.num_kv_heads))) {
      block_seqs.push_back({i, qsl_p[i], query_len, lens_p[i]});
      continue;
    }
#endif
    for (int64_t j = 0; j < query_len; ++j) {
      rows.token.push_back(qsl_p[i] + j);
      rows.seq.push_back(i);
      rows.context.push_back(lens_p[i] - query_len + j + 1);
    }
  }
#if defined(PAGEDSERVE_ANY_PREFILL_BLOCKS)
  if (!block_seqs.empty()) prefill_blocks<T>(query, out, kv_cache, block_seqs, block_tables, s, scale, kernel);
#endif
  if (!rows.token.empty()) paged_attention_impl<T>(query, out, kv_cache, rows, block_tables, s, scale);
}

// Writes the rows of sequences [first_seq, end_seq) of `out` ([num_tokens, num_heads, head_dim]).
void paged_attention(const at::Tensor& query, at::Tensor out, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     int64_t first_seq, int64_t end_seq, double scale) {
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && kv_cache.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, out and kv_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: contiguous int32");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache: [2, kv_heads, blocks, block_size, head_dim]");
  const Shape s{query.size(1), kv_cache.size(1), kv_cache.size(2), kv_cache.size(3), kv_cache.size(4), block_tables.size(1)};
  TORCH_CHECK(query.size(2) == s.head_dim && s.num_heads % s.num_kv_heads == 0, "query heads do not fit the cache");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kHalf || query.scalar_type() == at::kFloat,
              "paged_attention: dtype must be bfloat16, float16 or float32");
  auto qsl = query_start_loc.to(at::kLong);
  auto lens = seq_lens.to(at::kLong);
  const int64_t* qsl_p = qsl.data_ptr<int64_t>();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  switch (query.scalar_type()) {
    case at::kBFloat16:
      attention_of_dtype<c10::BFloat16>(query, out, kv_cache, block_tables, qsl_p, lens_p, first_seq, end_seq, s, fscale);
      break;
    case at::kHalf:
      attention_of_dtype<c10::Half>(query, out, kv_cache, block_tables, qsl_p, lens_p, first_seq, end_seq, s, fscale);
      break;
    case at::kFloat:
      attention_of_dtype<float>(query, out, kv_cache, block_tables, qsl_p, lens_p, first_seq, end_seq, s, fscale);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: dtype must be bfloat16, float16 or float32");
  }
}

// This step's keys and values ([num_tokens, kv_heads, head_dim], rows may be strided views of the
// QKV projection) into their cache slots: one row copy per token and head, where torch's
// index_copy_ over the cache's slot dimension cost 40-160 us a layer.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), "kv_cache: contiguous [2, kv_heads, blocks, block_size, head_dim]");
  const int64_t num_kv_heads = kv_cache.size(1), slots = kv_cache.size(2) * kv_cache.size(3), head_dim = kv_cache.size(4);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(1) == num_kv_heads && t->size(2) == head_dim && t->stride(2) == 1 &&
                    t->scalar_type() == kv_cache.scalar_type(),
                "key and value: [num_tokens, kv_heads, head_dim] in the cache's dtype, rows contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0), "one slot per token");
  const auto slot_of = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot = slot_of.data_ptr<int64_t>();
  const int64_t row_bytes = head_dim * kv_cache.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const int64_t head_bytes = slots * row_bytes, half_bytes = num_kv_heads * head_bytes;
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " is outside the cache's ", slots, " slots");
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      char* to = cache + h * head_bytes + slot[t] * row_bytes;
      std::memcpy(to, static_cast<const char*>(key.data_ptr()) + (t * key.stride(0) + h * key.stride(1)) * key.element_size(), row_bytes);
      std::memcpy(to + half_bytes, static_cast<const char*>(value.data_ptr()) + (t * value.stride(0) + h * value.stride(1)) * value.element_size(), row_bytes);
    }
  }
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor(a!) out, Tensor kv_cache, Tensor block_tables, Tensor query_start_loc, "
      "Tensor seq_lens, int first_seq, int end_seq, float scale) -> ()");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("attention_isa() -> int", &attention_isa);  // no tensor to dispatch on
  m.def("attention_path_counts() -> int[]", &attention_path_counts);
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}
