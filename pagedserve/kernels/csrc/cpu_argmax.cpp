// The greedy sampler's argmax over each row of the logits, in the logits' own dtype.
//
// torch's argmax on the CPU reduces a row on one thread, and the sampler first widened bf16
// logits to float32: for 211 rows of SmolLM2's 49152 (2-core Zen 4) the copy and the argmax took
// 5.75 ms of a 200-210 ms decode step (the copy alone 11.8 ms without tcmalloc), this kernel 0.71
// (`benchmarks/sampler_cpu.py`, `greedy_bf16`). Here the threads split the rows and read each
// once, sixteen lanes at a time; widening bf16 or fp16 to float32 is exact, so the answer is the
// same. torch's rules hold: the first index of the largest value, and a NaN counts as the
// largest (the first NaN wins).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace {

using pagedserve::to_float;

// The first index of row[begin, end)'s largest value after `best` at `best_index` (strictly
// larger wins, so an earlier index keeps a tie), or of its first NaN.
template <typename T>
int64_t scan_scalar(const T* row, int64_t begin, int64_t end, float best, int64_t best_index) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = to_float(row[i]);
    if (std::isnan(v)) return i;
    if (v > best) best = v, best_index = i;
  }
  return best_index;
}

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16) {
    // Each lane keeps the largest value it has seen and where (strictly larger replaces, so the
    // earliest of equal values stays); the lanes are merged at the end, least index among ties.
    __m512 best = pagedserve::load16(row);
    if (_mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q)) return scan_scalar(row, 0, 16, -INFINITY, 0);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i best_index = index;
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = pagedserve::load16(row + i);
      index = _mm512_add_epi32(index, step);
      if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return scan_scalar(row, i, i + 16, -INFINITY, i);
      const __mmask16 larger = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, larger, v);
      best_index = _mm512_mask_mov_epi32(best_index, larger, index);
    }
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    const int64_t first = _mm512_mask_reduce_min_epi32(at_top, best_index);
    return scan_scalar(row, i, n, top, first);
  }
#endif
  return scan_scalar(row, 0, n, -INFINITY, 0);
}

// ids[r] = argmax(logits[r]): logits [rows, vocab] with contiguous rows (any row stride).
void argmax_rows(at::Tensor ids, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0, "argmax_rows: logits [rows, vocab], each row contiguous");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.numel() == logits.size(0), "argmax_rows: ids int64, one per row");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "argmax_rows: a row longer than int32 indices");
  const int64_t n = logits.size(1), stride = logits.stride(0);
  int64_t* out = ids.data_ptr<int64_t>();
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* base = static_cast<const T*>(logits.data_ptr());
    at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(base + r * stride, n);
    });
  };
  switch (logits.scalar_type()) {
    case at::kBFloat16: return run(c10::BFloat16());
    case at::kHalf: return run(c10::Half());
    case at::kFloat: return run(0.f);
    default: TORCH_CHECK(false, "argmax_rows: logits must be bfloat16, float16 or float32");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) { m.def("argmax_rows(Tensor(a!) ids, Tensor logits) -> ()"); }

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
