// A bfloat16 linear layer for one to four rows (decode at light load): out = x W^T (+ bias), with
// W the plain row-major [out_features, in_features] weight.
//
// With so few rows a linear layer is a read of its weight. oneDNN's GEMM, even on its prepacked
// layout, streams it at about 10 GB/s on one thread of the development machine; this kernel reads
// the weight front to back, one row at a time (one sequential stream, which the hardware
// prefetcher follows best), dots each 32-element piece with every input row held in L1 (AVX-512
// BF16 pair dot products into float32), and reduces each output once at the end. Measured on
// SmolLM2-135M's layers, one or two threads: 1.1-1.6x oneDNN's packed GEMM at one to three rows,
// 0.98x (one thread) to 1.46x (two) at four (benchmarks/results/cpu_small_linear.json).
//
// Each output is the same sum in the same order whatever the number of rows, so a row's result
// does not depend on what it is batched with. Machines without AVX-512 BF16 do not use it
// (`small_linear_max_rows` answers 0).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "vec_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDSERVE_SMALL_LINEAR 1
#endif

namespace {

using BF16 = c10::BFloat16;
using pagedserve::round_to;
using pagedserve::to_float;

constexpr int64_t MAX_ROWS = 4;  // beyond this oneDNN's GEMM is as fast or faster
constexpr int64_t GRAIN = 64;    // weight rows per task

#if PAGEDSERVE_SMALL_LINEAR

inline void dot_step(__m512* acc, __m512bh w, const BF16* x, int64_t ldx, int rows, int64_t k) {
  for (int m = 0; m < rows; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * ldx + k), w);
}

// out[m, n] for weight rows [n0, n1) and M input rows. U independent accumulators per output
// keep the dot products' latency off the critical path (three at four rows was no faster).
template <int M>
void weight_rows(const BF16* x, int64_t ldx, const BF16* w, const BF16* bias, BF16* out, int64_t N,
                 int64_t K, int64_t n0, int64_t n1) {
  constexpr int U = 4;  // 4 x M accumulators: at most 16 of the 32 vector registers
  for (int64_t n = n0; n < n1; ++n) {
    const BF16* row = w + n * K;
    __m512 acc[U][M];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U)
      for (int u = 0; u < U; ++u) dot_step(acc[u], (__m512bh)_mm512_loadu_si512(row + k + 32 * u), x, ldx, M, k + 32 * u);
    for (; k + 32 <= K; k += 32) dot_step(acc[0], (__m512bh)_mm512_loadu_si512(row + k), x, ldx, M, k);
    if (k < K) {  // the tail, zero-filled on both sides
      const __mmask32 mask = (__mmask32(1) << (K - k)) - 1;
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, row + k);
      for (int m = 0; m < M; ++m)
        acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k), wv);
    }
    const float b = bias ? to_float(bias[n]) : 0.f;
    for (int m = 0; m < M; ++m) {
      __m512 sum = acc[0][m];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][m]);
      out[m * N + n] = round_to<BF16>(_mm512_reduce_add_ps(sum) + b);
    }
  }
}

using RowsFn = void (*)(const BF16*, int64_t, const BF16*, const BF16*, BF16*, int64_t, int64_t, int64_t, int64_t);
constexpr RowsFn BY_ROWS[MAX_ROWS] = {weight_rows<1>, weight_rows<2>, weight_rows<3>, weight_rows<4>};

#endif

int64_t small_linear_max_rows() {
#if PAGEDSERVE_SMALL_LINEAR
  return MAX_ROWS;
#else
  return 0;
#endif
}

// out [M, N] = x [M, K] W[N, K]^T (+ bias [N]), all bfloat16, 1 <= M <= small_linear_max_rows().
void small_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(small_linear_max_rows() > 0, "small_linear: this CPU has no AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "small_linear: bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 2 && weight.is_contiguous() && out.dim() == 2 && out.is_contiguous(),
              "small_linear: x [rows, in] (rows contiguous), weight [out, in] and out [rows, out] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && out.size(0) == M && out.size(1) == N, "small_linear: shapes do not match");
  TORCH_CHECK(M >= 1 && M <= MAX_ROWS, "small_linear: 1 to ", MAX_ROWS, " rows");
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N, "small_linear: bias [out] bfloat16");
#if PAGEDSERVE_SMALL_LINEAR
  const BF16* xp = x.data_ptr<BF16>();
  const BF16* wp = weight.data_ptr<BF16>();
  const BF16* bp = bias ? bias->data_ptr<BF16>() : nullptr;
  BF16* op = out.data_ptr<BF16>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) { BY_ROWS[M - 1](xp, ldx, wp, bp, op, N, K, begin, end); });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("small_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.def("small_linear_max_rows() -> int", &small_linear_max_rows);  // no tensor to dispatch on
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("small_linear", &small_linear); }
