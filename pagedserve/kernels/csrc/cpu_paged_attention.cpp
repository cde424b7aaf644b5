// Paged attention on the CPU straight from the KV cache: no gathered copy of K/V, no padding.
//
// The cache layout is reference.py's: one tensor per layer, [2, kv_heads, num_blocks, block_size,
// head_dim] (keys, then values). Every query token of sequences [first_seq, end_seq) is one row;
// its context is the sequence's first `seq_len - query_len + j + 1` tokens (causal). One task is a
// (query token, KV head) pair: the `group` query heads that share the KV head read each cached
// key and value once, in the cache's own dtype, and accumulate in float32 (two passes: scores,
// then the softmax-weighted sum of values).
//
// Built and loaded by native_build.py (g++ -O3 -march=native -fopenmp against torch's headers
// and its own libgomp, so at::parallel_for runs on torch's thread pool).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pagedserve::to_float;

// How many (query token, KV head) tasks each path has run since the library loaded: the tests
// assert that a model of a served shape really took the AVX-512 path, which no output can show.
std::atomic<int64_t> tasks_on_avx512{0};
std::atomic<int64_t> tasks_on_portable_loop{0};

// The instruction sets this build compiled paths for (-march=native decides): 1 the AVX-512
// attention, 2 its AVX-512 BF16 dot products. A CPU whose flags promise more was built wrong.
int64_t attention_isa() {
  int64_t isa = 0;
#if defined(__AVX512F__)
  isa |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  isa |= 2;
#endif
  return isa;
}

std::vector<int64_t> attention_path_counts() { return {tasks_on_avx512.load(), tasks_on_portable_loop.load()}; }

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

// The blocks of a sequence lie anywhere in the cache: without a prefetch, each new block's first
// rows stall on memory (measured: the prefetch made a 128-row bf16 decode 1.2x faster).
template <typename T>
inline void prefetch_block(const T* block, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(block);
  for (int64_t offset = 0; offset < elements * static_cast<int64_t>(sizeof(T)); offset += 64) __builtin_prefetch(bytes + offset);
}

// The block holding token t of a head's context; also prefetches the block after it.
template <typename T>
inline const T* block_of(const T* head, const int32_t* block_table, int64_t t, int64_t context, int64_t block_size, int64_t head_dim) {
  const int64_t b = t / block_size, elements = block_size * head_dim;
  if (t + block_size < context) prefetch_block(head + static_cast<int64_t>(block_table[b + 1]) * elements, elements);
  return head + static_cast<int64_t>(block_table[b]) * elements;
}

struct Shape {
  int64_t num_heads, num_kv_heads, num_blocks, block_size, head_dim, max_blocks;
};

constexpr int64_t kPrefetchBytes = 64 * 1024;  // at most this much of the next task's K and V

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
  const T* block = nullptr;
  for (int64_t t = 0; t < context; ++t) {
    if (t % BS == 0) block = block_of(key_head, block_table, t, context, BS, D);
    const T* k = block + (t % BS) * D;
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
    if (t % BS == 0) block = block_of(value_head, block_table, t, context, BS, D);
    const T* v = block + (t % BS) * D;
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
// The AVX-512 path: a dot product's horizontal sum per key costs a few shuffles instead of the
// sixteen dependent scalar adds the compiler emits for a strict float reduction, and the
// softmax's exponentials are computed sixteen at a time.



// G query heads per KV head and C chunks of 16 in head_dim, as constants: the accumulators
// then live in registers (with runtime counts the compiler kept them on the stack).
template <typename T, int64_t G, int64_t C>
bool attend_fixed(const T* query, T* out, const T* key_head, const T* value_head, const int32_t* block_table,
                  int64_t context, const Shape& s, float scale, std::vector<float>& scratch) {
  constexpr int64_t group = G, chunks = C, D = C * 16;
  const int64_t BS = s.block_size;
  const int64_t padded = (context + 15) / 16 * 16;
  scratch.resize(group * padded);
  float* scores = scratch.data();  // [group, padded]
  __m512 q[G][C];
  for (int64_t j = 0; j < group; ++j)
    for (int64_t c = 0; c < chunks; ++c) q[j][c] = _mm512_mul_ps(pagedserve::load16(query + j * D + c * 16), _mm512_set1_ps(scale));
#if defined(__AVX512BF16__)
  __m512bh q_pairs[G][C / 2 > 0 ? C / 2 : 1];  // the query's own bf16 values, unscaled
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if constexpr (C % 2 != 0) return false;
    for (int64_t j = 0; j < group; ++j)
      for (int64_t c = 0; c < chunks / 2; ++c) q_pairs[j][c] = (__m512bh)_mm512_loadu_si512(query + j * D + c * 32);
  }
#endif
  const T* block = nullptr;
  for (int64_t t = 0; t < context; ++t) {
    if (t % BS == 0) block = block_of(key_head, block_table, t, context, BS, D);
    const T* k = block + (t % BS) * D;
    __m512 acc[G];
    for (int64_t j = 0; j < group; ++j) acc[j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // Pairs of bf16 products summed into float32 lanes, one instruction per 32 elements.
      for (int64_t c = 0; c < chunks / 2; ++c) {
        const __m512bh kc = (__m512bh)_mm512_loadu_si512(k + c * 32);
        for (int64_t j = 0; j < group; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], q_pairs[j][c], kc);
      }
      for (int64_t j = 0; j < group; ++j) scores[j * padded + t] = _mm512_reduce_add_ps(acc[j]) * scale;
      continue;
    }
#endif
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 kc = pagedserve::load16(k + c * 16);
      for (int64_t j = 0; j < group; ++j) acc[j] = _mm512_fmadd_ps(q[j][c], kc, acc[j]);
    }
    for (int64_t j = 0; j < group; ++j) scores[j * padded + t] = _mm512_reduce_add_ps(acc[j]);
  }
  float inv_sum[G];
  for (int64_t j = 0; j < group; ++j) {
    float* sj = scores + j * padded;
    for (int64_t t = context; t < padded; ++t) sj[t] = -std::numeric_limits<float>::infinity();
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < padded; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sj + t));
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
      const __m512 e = pagedserve::exp16(_mm512_sub_ps(_mm512_loadu_ps(sj + t), max));
      _mm512_storeu_ps(sj + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv_sum[j] = 1.f / _mm512_reduce_add_ps(sum);
  }
  __m512 acc[G][C];
  for (int64_t j = 0; j < group; ++j)
    for (int64_t c = 0; c < chunks; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < context; ++t) {
    if (t % BS == 0) block = block_of(value_head, block_table, t, context, BS, D);
    const T* v = block + (t % BS) * D;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 vc = pagedserve::load16(v + c * 16);
      for (int64_t j = 0; j < group; ++j) acc[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * padded + t]), vc, acc[j][c]);
    }
  }
  float row[16];
  for (int64_t j = 0; j < group; ++j)
    for (int64_t c = 0; c < chunks; ++c) {
      _mm512_storeu_ps(row, _mm512_mul_ps(acc[j][c], _mm512_set1_ps(inv_sum[j])));
      for (int64_t d = 0; d < 16; ++d) out[j * D + c * 16 + d] = static_cast<T>(row[d]);
    }
  return true;
}

// The shapes of the models served (query heads per KV head 1-8; head_dim 64 or 128); others
// take the portable loop.
template <typename T>
bool attend_one_avx512(const T* query, T* out, const T* key_head, const T* value_head, const int32_t* block_table,
                       int64_t context, int64_t group, const Shape& s, float scale, std::vector<float>& scratch) {
#define PAGEDSERVE_CASE(G, C)                                                                                   \
  if (group == G && s.head_dim == C * 16)                                                                       \
    return attend_fixed<T, G, C>(query, out, key_head, value_head, block_table, context, s, scale, scratch);
#define PAGEDSERVE_CASES(C) \
  PAGEDSERVE_CASE(1, C) PAGEDSERVE_CASE(2, C) PAGEDSERVE_CASE(3, C) PAGEDSERVE_CASE(4, C) \
  PAGEDSERVE_CASE(5, C) PAGEDSERVE_CASE(6, C) PAGEDSERVE_CASE(7, C) PAGEDSERVE_CASE(8, C)
  PAGEDSERVE_CASES(4)
  PAGEDSERVE_CASES(8)
#undef PAGEDSERVE_CASES
#undef PAGEDSERVE_CASE
  return false;
}
#endif

template <typename T>
void paged_attention_impl(const at::Tensor& query, at::Tensor& out, const at::Tensor& kv_cache,
                          const std::vector<int64_t>& seq_of_token, const std::vector<int64_t>& context_of_token,
                          const at::Tensor& block_tables, int64_t first_token, const Shape& s, float scale) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t head_stride = s.num_blocks * s.block_size * s.head_dim;
  const T* q_base = query.data_ptr<T>();
  T* out_base = out.data_ptr<T>();
  const T* keys = kv_cache.data_ptr<T>();
  const T* values = keys + s.num_kv_heads * head_stride;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_rows = static_cast<int64_t>(seq_of_token.size());
  at::parallel_for(0, num_rows * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    int64_t fast = 0;
    for (int64_t task = begin; task < end; ++task) {
      if (task + 1 < end) {  // the next task's K/V stream in while this one computes
        const int64_t r1 = (task + 1) / s.num_kv_heads, h1 = (task + 1) % s.num_kv_heads;
        prefetch_context(keys + h1 * head_stride, values + h1 * head_stride, tables + seq_of_token[r1] * s.max_blocks,
                         context_of_token[r1], s);
      }
      const int64_t r = task / s.num_kv_heads, h = task % s.num_kv_heads;
      const int64_t offset = ((first_token + r) * s.num_heads + h * group) * s.head_dim;
      const T* key_head = keys + h * head_stride;
      const T* value_head = values + h * head_stride;
      const int32_t* table = tables + seq_of_token[r] * s.max_blocks;
#if defined(__AVX512F__)
      if (attend_one_avx512<T>(q_base + offset, out_base + offset, key_head, value_head, table, context_of_token[r], group, s, scale, scratch)) {
        ++fast;
        continue;
      }
#endif
      attend_one<T>(q_base + offset, out_base + offset, key_head, value_head, table, context_of_token[r], group, s, scale, scratch);
    }
    tasks_on_avx512 += fast;  // once per chunk of tasks: no shared counter in the loop
    tasks_on_portable_loop += (end - begin) - fast;
  });
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
  auto qsl = query_start_loc.to(at::kLong);
  auto lens = seq_lens.to(at::kLong);
  const int64_t* qsl_p = qsl.data_ptr<int64_t>();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  std::vector<int64_t> seq_of_token, context_of_token;
  for (int64_t i = first_seq; i < end_seq; ++i) {
    const int64_t query_len = qsl_p[i + 1] - qsl_p[i];
    TORCH_CHECK(lens_p[i] <= s.max_blocks * s.block_size, "a sequence is longer than its block table");
    for (int64_t j = 0; j < query_len; ++j) {
      seq_of_token.push_back(i);
      context_of_token.push_back(lens_p[i] - query_len + j + 1);
    }
  }
  const int64_t first_token = qsl_p[first_seq];
  const float fscale = static_cast<float>(scale);
  switch (query.scalar_type()) {
    case at::kBFloat16:
      paged_attention_impl<c10::BFloat16>(query, out, kv_cache, seq_of_token, context_of_token, block_tables, first_token, s, fscale);
      break;
    case at::kHalf:
      paged_attention_impl<c10::Half>(query, out, kv_cache, seq_of_token, context_of_token, block_tables, first_token, s, fscale);
      break;
    case at::kFloat:
      paged_attention_impl<float>(query, out, kv_cache, seq_of_token, context_of_token, block_tables, first_token, s, fscale);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: dtype must be bfloat16, float16 or float32");
  }
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor(a!) out, Tensor kv_cache, Tensor block_tables, Tensor query_start_loc, "
      "Tensor seq_lens, int first_seq, int end_seq, float scale) -> ()");
  m.def("attention_isa() -> int", &attention_isa);  // no tensor to dispatch on
  m.def("attention_path_counts() -> int[]", &attention_path_counts);
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
