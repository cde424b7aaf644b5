// A float32 linear layer for CPUs with AVX2 and FMA but no AVX-512: out = x W^T (+ bias), with W
// packed once at load into panels of 16 output features, k-major ([panels, K, 16]).
//
// On a 2-core Zen 3, SmolLM2-135M's linears and LM head with their weights coming from memory ran
// 1.1-1.5x faster through it than through oneDNN's packed GEMM at 1 to 512 rows
// (benchmarks/results/cpu_fp32_linear_unrolled_zen3.json).
// Its parts, in the order they mattered when measured:
// - a 6-row by 16-column register tile: twelve accumulators, two weight loads and six broadcasts
//   for twelve FMAs per k;
// - while a panel's first row tile runs, the next panel is prefetched into L2, so the weight
//   stream from memory overlaps the arithmetic instead of stalling each panel's first tile (from
//   three rows up: PREFETCH_MIN_ROWS);
// - the input rows packed six at a time, k-major, so a tile's broadcasts read one stream (no
//   change measured on its own; it keeps a block of rows compact in L2);
// - the k loop unrolled four times and the tile's results stored a vector at a time: 1.15-1.2x at
//   64 to 1024 rows (140-150 GFLOP/s on the two cores; their FMA peak is about 183).
// The threads split the output features, so each reads its share of the weight once per call; a
// thread done with its share takes panels from the end of another's (PanelShares), so one that
// loses its core for a while does not hold up the whole call.
//
// Each output is one running sum over k in order, the bias added last, whatever the number of
// rows, the row's place in the batch or `k_block`: a row's result does not depend on what it is
// batched with.
//
// Two epilogues save a layer a pass over its output (a float32 128-token prefill of SmolLM2 spent
// 2.5 ms in 60 residual adds and 3.7 ms in 30 SiLU-and-multiplies beside 199 ms of GEMMs, 2-core
// Zen 3): `fp32_gemm` adds a residual in its store, and `fp32_gemm_silu_mul` computes an MLP's
// gate and up products for a block of rows into scratch and combines them there, so the [rows,
// 2 x intermediate] product is never written. Both give the same bits as the separate ops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_FP32_GEMM 1
#endif

namespace {

constexpr int64_t NR = 16;  // output features per panel: two 8-lane vectors
constexpr int64_t MR = 6;   // input rows per tile: 12 accumulators of the 16 vector registers
// Input rows per pass over the panels (a multiple of MR): their packed copy stays in L2 while the
// panels stream past; the weight is read once per block of rows.
constexpr int64_t MC = 96;
// The fewest rows in a block for which a panel's tile prefetches the next panel. Below it (a
// decode step of one or two requests) a panel's arithmetic is too short to hide the second
// stream, and the hardware prefetcher alone streams the thread's contiguous panels faster: the
// one-row pass over SmolLM2's layers and LM head ran 1.16x faster on two threads and 1.23x on
// one without it (17.1 GB/s, what a plain read loop gets from one core), two rows 1.08x, three
// or more rows level (a 2-core Zen 3).
constexpr int64_t PREFETCH_MIN_ROWS = 3;

// W [N, K] -> panels [ceil(N / 16), K, 16]; the last panel's missing features are zeros.
at::Tensor fp32_gemm_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "fp32_gemm_pack: a float32 [out, in] weight");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR;
  at::Tensor padded = at::zeros({P * NR, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, NR, K}).transpose(1, 2).contiguous();
}

#if PAGEDSERVE_FP32_GEMM

// `cols` floats of `src`, zero-padded to a panel's width in `buffer` where the panel is partial.
inline const float* padded(const float* src, int64_t cols, float* buffer) {
  if (cols == NR) return src;
  std::fill(buffer, buffer + NR, 0.f);
  std::copy(src, src + cols, buffer);
  return buffer;
}

inline void store_row(float* dst, __m256 lo, __m256 hi, int64_t cols) {
  if (cols == NR) {
    _mm256_storeu_ps(dst, lo);
    _mm256_storeu_ps(dst + 8, hi);
    return;
  }
  alignas(32) float row[NR];
  _mm256_store_ps(row, lo);
  _mm256_store_ps(row + 8, hi);
  std::copy(row, row + cols, dst);
}

// Rows [m, m + M) of one panel over one block of k (`kc` of them): `a` the packed rows (k-major,
// six per k), `b` the panel, `next` (or null) the next panel to prefetch. `resume`: carry on the
// sums an earlier k block left in `c` (so each output is one running sum over all of K, whatever
// the block size); `bias` (or null) is added after the last block, then, in the RESIDUAL tiles,
// `residual` (or null: row 0's values, its rows `ldc` apart like c's). The residual's tiles are
// their own instantiation: its add compiled into the one tile made the plain GEMM 5-7% slower at
// 64 and 128 rows, the k loop unchanged (a 2-core Zen 3, the two builds loaded side by side with
// weights of their own, calls alternating); apart, 1-2% (the code's placement: not pinned down).
template <int M, bool RESIDUAL>
void tile(const float* a, const float* b, const float* next, int64_t kc, float* c, int64_t ldc, bool resume,
          const float* bias, const float* residual, int64_t cols) {
  alignas(32) float buffer[NR];
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define PAGEDSERVE_RESUME(i)                                       \
  if constexpr (M > i) {                                           \
    const float* sums = padded(c + i * ldc, cols, buffer);         \
    c##i##0 = _mm256_loadu_ps(sums);                               \
    c##i##1 = _mm256_loadu_ps(sums + 8);                           \
  }
  if (resume) {
    PAGEDSERVE_RESUME(0) PAGEDSERVE_RESUME(1) PAGEDSERVE_RESUME(2) PAGEDSERVE_RESUME(3) PAGEDSERVE_RESUME(4) PAGEDSERVE_RESUME(5)
  }
#undef PAGEDSERVE_RESUME
#define PAGEDSERVE_ROW(i)                                         \
  if constexpr (M > i) {                                          \
    const __m256 av = _mm256_broadcast_ss(a + k * MR + i);        \
    c##i##0 = _mm256_fmadd_ps(av, b0, c##i##0);                   \
    c##i##1 = _mm256_fmadd_ps(av, b1, c##i##1);                   \
  }
  // Unrolled four times: the loop's own counter and pointer updates took issue slots from the
  // FMAs; unrolled, 64-1024 rows ran 1.15-1.2x faster on a Zen 3 (twice: less; eight times: no more).
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + k * NR), _MM_HINT_T1);  // one line a k
    const __m256 b0 = _mm256_loadu_ps(b + k * NR), b1 = _mm256_loadu_ps(b + k * NR + 8);
    PAGEDSERVE_ROW(0) PAGEDSERVE_ROW(1) PAGEDSERVE_ROW(2) PAGEDSERVE_ROW(3) PAGEDSERVE_ROW(4) PAGEDSERVE_ROW(5)
  }
#undef PAGEDSERVE_ROW
  // Named accumulators to the end: indexing an array of them inside the k loop made the compiler
  // keep them in memory (a third of the speed).
#define PAGEDSERVE_STORE(i)                                                                           \
  if constexpr (M > i) {                                                                              \
    if (bias != nullptr) {                                                                            \
      c##i##0 = _mm256_add_ps(c##i##0, bias0);                                                        \
      c##i##1 = _mm256_add_ps(c##i##1, bias1);                                                        \
    }                                                                                                 \
    if (RESIDUAL && residual != nullptr) {                                                            \
      const float* values = padded(residual + i * ldc, cols, buffer);                                 \
      c##i##0 = _mm256_add_ps(c##i##0, _mm256_loadu_ps(values));                                      \
      c##i##1 = _mm256_add_ps(c##i##1, _mm256_loadu_ps(values + 8));                                  \
    }                                                                                                 \
    store_row(c + i * ldc, c##i##0, c##i##1, cols);                                                   \
  }
  __m256 bias0 = _mm256_setzero_ps(), bias1 = bias0;
  if (bias != nullptr) {
    const float* values = padded(bias, cols, buffer);
    bias0 = _mm256_loadu_ps(values);
    bias1 = _mm256_loadu_ps(values + 8);
  }
  PAGEDSERVE_STORE(0) PAGEDSERVE_STORE(1) PAGEDSERVE_STORE(2) PAGEDSERVE_STORE(3) PAGEDSERVE_STORE(4) PAGEDSERVE_STORE(5)
#undef PAGEDSERVE_STORE
}

using TileFn = void (*)(const float*, const float*, const float*, int64_t, float*, int64_t, bool, const float*, const float*, int64_t);
// The tile for `rows` (1 to MR) rows.
template <bool RESIDUAL>
TileFn tile_for(int64_t rows) {
  switch (rows) {
    case 1: return &tile<1, RESIDUAL>;
    case 2: return &tile<2, RESIDUAL>;
    case 3: return &tile<3, RESIDUAL>;
    case 4: return &tile<4, RESIDUAL>;
    case 5: return &tile<5, RESIDUAL>;
    default: return &tile<6, RESIDUAL>;
  }
}

// x's rows, six to a block, k-major: block i holds rows 6i..6i+5 (zeros past the last row).
void pack_rows(const float* x, int64_t ldx, int64_t M, int64_t K, float* packed) {
  const int64_t blocks = (M + MR - 1) / MR;
  at::parallel_for(0, blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t r = 0; r < MR; ++r) {
        float* dst = packed + i * K * MR + r;
        const int64_t m = i * MR + r;
        for (int64_t k = 0; k < K; ++k) dst[k * MR] = m < M ? x[m * ldx + k] : 0.f;
      }
  });
}

#endif

bool fp32_gemm_built() {
#if PAGEDSERVE_FP32_GEMM
  return true;
#else
  return false;
#endif
}

#if PAGEDSERVE_FP32_GEMM

// Who computes which panel of a block of rows. Each thread starts on its own contiguous share of
// the panels and takes them in order (so it can prefetch the next one); once its share is done, it
// takes panels from the end of the share with the most left. On a small machine a model thread
// loses its core now and then to the server's other processes; with fixed shares the whole call
// then waits for it, and the other thread idles at the end. Taking its panels, the other thread
// carries on (only the panel in hand waits). A panel is one thread's over all of K, so a panel's
// K blocks now run one after another (before, every panel's first block came first): the same
// sums; what the order costs where K passes `k_block` (not SmolLM2: 1536 at most) is unmeasured.
class PanelShares {
 public:
  PanelShares(int64_t blocks, int64_t threads, int64_t panels) : threads_(threads), shares_(blocks * threads) {
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t t = 0; t < threads; ++t)
        shares_[b * threads + t].word.store(pack(t * panels / threads, (t + 1) * panels / threads));
  }

  // The next panel of the share (block, thread) from its front, or -1 once it is empty.
  int64_t take_front(int64_t block, int64_t thread) { return take(at(block, thread), true); }

  // A panel from the end of the fullest other share of the block, or -1 once all are empty.
  int64_t steal(int64_t block, int64_t thread, int64_t* next) {
    while (true) {
      Share* fullest = nullptr;
      int64_t most = 0;
      for (int64_t t = 0; t < threads_; ++t) {
        const uint64_t word = at(block, t).word.load(std::memory_order_relaxed);
        if (t != thread && back(word) - front(word) > most) {
          most = back(word) - front(word);
          fullest = &at(block, t);
        }
      }
      if (fullest == nullptr) return -1;
      const int64_t panel = take(*fullest, false);
      if (panel >= 0) {
        *next = most > 1 ? panel - 1 : -1;  // the next steal most likely takes the one before
        return panel;
      }
    }
  }

  // The panel after `panel` in the thread's own share, if it is still there (to prefetch).
  int64_t next_own(int64_t block, int64_t thread, int64_t panel) {
    return panel + 1 < back(at(block, thread).word.load(std::memory_order_relaxed)) ? panel + 1 : -1;
  }

 private:
  struct alignas(64) Share {  // a cache line each: the owners' takes do not bounce one line
    std::atomic<uint64_t> word{0};  // [front, back) of the share's panels: front low, back high
  };
  static uint64_t pack(int64_t front, int64_t back) { return uint64_t(front) | (uint64_t(back) << 32); }
  static int64_t front(uint64_t word) { return int64_t(word & 0xffffffffu); }
  static int64_t back(uint64_t word) { return int64_t(word >> 32); }
  Share& at(int64_t block, int64_t thread) { return shares_[block * threads_ + thread]; }

  static int64_t take(Share& share, bool from_front) {
    uint64_t word = share.word.load(std::memory_order_relaxed);
    while (front(word) < back(word)) {
      const uint64_t taken = from_front ? pack(front(word) + 1, back(word)) : pack(front(word), back(word) - 1);
      if (share.word.compare_exchange_weak(word, taken, std::memory_order_relaxed)) return from_front ? front(word) : back(word) - 1;
    }
    return -1;
  }

  int64_t threads_;
  std::vector<Share> shares_;
};

#endif

#if PAGEDSERVE_FP32_GEMM

// One panel against rows [m0, m1) over all of K, in k blocks of at most `k_block`: `a` the packed
// rows, `b` the panels, `next` (or -1) the panel to prefetch, row m0's outputs at `c` and each next
// row's `ldc` after; `bias` and `residual` (or null) as the tile takes them, for row m0.
void panel_rows(const float* a, const float* b, int64_t K, int64_t k_block, int64_t m0, int64_t m1, int64_t p, int64_t next,
                float* c, int64_t ldc, const float* bias, const float* residual, int64_t cols) {
  for (int64_t k0 = 0; k0 < K; k0 += k_block) {
    const int64_t kc = std::min(K - k0, k_block);
    const bool last = k0 + kc == K;
    for (int64_t m = m0; m < m1; m += MR) {
      const bool prefetch = m == m0 && next >= 0 && m1 - m0 >= PREFETCH_MIN_ROWS;
      const TileFn tile_fn = residual != nullptr ? tile_for<true>(m1 - m) : tile_for<false>(m1 - m);
      tile_fn(a + m * K + k0 * MR, b + (p * K + k0) * NR, prefetch ? b + (next * K + k0) * NR : nullptr, kc,
              c + (m - m0) * ldc, ldc, k0 > 0, last ? bias : nullptr, last && residual != nullptr ? residual + (m - m0) * ldc : nullptr, cols);
    }
  }
}

// x's rows packed (`a`), then `run(a, block, unit, next)` for every block of MC rows and every one
// of `units` units of work (a panel, or a pair of them), split among the threads by PanelShares;
// `next` is the unit the thread most likely takes next (or -1), to prefetch.
template <typename Run>
void over_blocks(const at::Tensor& x, int64_t units, const Run& run) {
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor rows = at::empty({(M + MR - 1) / MR * K * MR}, x.options());
  float* a = rows.data_ptr<float>();
  pack_rows(x.data_ptr<float>(), x.stride(0), M, K, a);
  const int64_t threads = at::get_num_threads(), blocks = (M + MC - 1) / MC;
  PanelShares shares(blocks, threads, units);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t block = 0; block < blocks; ++block) {
        for (int64_t u = shares.take_front(block, t); u >= 0; u = shares.take_front(block, t))
          run(a, block, u, shares.next_own(block, t, u));
        int64_t next = -1;
        for (int64_t u = shares.steal(block, t, &next); u >= 0; u = shares.steal(block, t, &next)) run(a, block, u, next);
      }
  });
}

#endif

// The checks both ops make: W has `weight_rows_per_column` rows per column of out.
void check_gemm(const char* name, const at::Tensor& out, const at::Tensor& x, const at::Tensor& panels, int64_t weight_rows_per_column,
                int64_t k_block) {
  TORCH_CHECK(fp32_gemm_built(), name, ": built without AVX2 and FMA");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.is_contiguous(), name, ": x [rows, in] (rows contiguous), out [rows, out] contiguous");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR && panels.is_contiguous(), name, ": panels as fp32_gemm_pack makes them");
  const int64_t weight_rows = weight_rows_per_column * out.size(1);
  TORCH_CHECK(panels.size(1) == x.size(1) && out.size(0) == x.size(0) && (weight_rows + NR - 1) / NR == panels.size(0), name, ": shapes do not match");
  TORCH_CHECK(k_block >= 1, name, ": k_block >= 1");
}

// out [M, N] = x [M, K] W^T (+ bias [N]) (+ residual [M, N]), float32, W as fp32_gemm_pack left it.
// `k_block`: the most of K one pass of a panel covers (a larger K is split, so a panel's share
// stays in L2). The residual is added last, to the biased product, as `residual + linear(x)` adds.
void fp32_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias, int64_t k_block,
               const c10::optional<at::Tensor>& residual) {
  check_gemm("fp32_gemm", out, x, panels, 1, k_block);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "fp32_gemm: bias [out] float32");
  if (residual)
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->is_contiguous() && residual->sizes() == out.sizes() &&
                    residual->data_ptr() != out.data_ptr(), "fp32_gemm: residual [rows, out] float32, contiguous, not out itself");
#if PAGEDSERVE_FP32_GEMM
  if (M == 0) return;
  const float* b = panels.data_ptr<float>();
  const float* bias_data = bias ? bias->data_ptr<float>() : nullptr;
  const float* residual_data = residual ? residual->data_ptr<float>() : nullptr;
  float* c = out.data_ptr<float>();
  over_blocks(x, panels.size(0), [&](const float* a, int64_t block, int64_t p, int64_t next) {
    const int64_t m0 = block * MC, m1 = std::min(M, m0 + MC), first = m0 * N + p * NR;
    panel_rows(a, b, K, k_block, m0, m1, p, next, c + first, N, bias_data != nullptr ? bias_data + p * NR : nullptr,
               residual_data != nullptr ? residual_data + first : nullptr, std::min(NR, N - p * NR));
  });
#endif
}

// out [M, I] = silu(x Wg^T) * (x Wu^T), float32, for an MLP's merged weight W = [Wg; Wu] ([2I, K],
// no bias) as fp32_gemm_pack left it, I a multiple of 16 (so each panel is all gate or all up).
// The products are fp32_gemm's (the same tiles and sums) and the SiLU-and-multiply is
// silu_and_mul's (silu_mul_row): the same bits as the two ops. A unit of work is the pair of
// panels (gate j, up j) against a block of rows: both products into the thread's scratch (the
// up panel prefetched during the gate's first tile, the next pair's gate during the up's), then
// combined into out's 16 columns.
void fp32_gemm_silu_mul(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, int64_t k_block) {
  check_gemm("fp32_gemm_silu_mul", out, x, panels, 2, k_block);
  const int64_t M = x.size(0), K = x.size(1), I = out.size(1);
  TORCH_CHECK(I % NR == 0, "fp32_gemm_silu_mul: the intermediate size must be a multiple of 16");
#if PAGEDSERVE_FP32_GEMM
  if (M == 0) return;
  const int64_t pairs = I / NR;
  const float* b = panels.data_ptr<float>();
  float* c = out.data_ptr<float>();
  over_blocks(x, pairs, [&](const float* a, int64_t block, int64_t j, int64_t next) {
    alignas(32) float gate[MC * NR], up[MC * NR];
    const int64_t m0 = block * MC, m1 = std::min(M, m0 + MC);
    panel_rows(a, b, K, k_block, m0, m1, j, pairs + j, gate, NR, nullptr, nullptr, NR);
    panel_rows(a, b, K, k_block, m0, m1, pairs + j, next, up, NR, nullptr, nullptr, NR);
    for (int64_t m = m0; m < m1; ++m) pagedserve::silu_mul_row(c + m * I + j * NR, gate + (m - m0) * NR, up + (m - m0) * NR, NR);
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("fp32_gemm_pack(Tensor weight) -> Tensor");
  m.def("fp32_gemm(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias, int k_block, Tensor? residual=None) -> ()");
  m.def("fp32_gemm_silu_mul(Tensor(a!) out, Tensor x, Tensor panels, int k_block) -> ()");
  m.def("fp32_gemm_built() -> bool", &fp32_gemm_built);  // no tensor to dispatch on
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("fp32_gemm_pack", &fp32_gemm_pack);
  m.impl("fp32_gemm", &fp32_gemm);
  m.impl("fp32_gemm_silu_mul", &fp32_gemm_silu_mul);
}
