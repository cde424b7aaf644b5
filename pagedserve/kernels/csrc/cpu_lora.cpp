// LoRA's low-rank products for a step's rows of several adapters, in one call per layer.
//
// Each row j with an adapter s (row_slot[j] = s >= 0) gets out[j] += (x[j] A_s^T) B_s^T, with
// A_s^T [in, r_s] and B_s^T [r_s, out] in float32 (workers/lora/layer_lora.py). In torch that is
// an index_select, two matmuls, two casts and an index_add_ per adapter, each a few microseconds
// of dispatch for a few rows of work: at 8 decode rows over 4 adapters the products cost more
// than the base model's step. Here rows are taken in blocks of up to BLOCK rows of one adapter,
// so each block reads A_s and B_s once, and every block is a task of one parallel loop. With
// AVX-512 a block converts its rows of x to float32 once and keeps its partial sums in registers
// (thirty-two rank columns, then sixteen outputs, for each of its rows); elsewhere plain loops sum
// the same terms in the same order.
//
// A layer's B^T comes as segments (layer_lora.AdapterWeights): up to sixteen output columns of
// one projection, the rank rows [lo, hi) that feed them, and where those rows' values lie in the
// adapter's packed B. A fused layer (qkv, gate_up) thus reads only each projection's own rank
// rows, and the columns of a projection the adapter does not target are left alone.
//
// Each element is summed in a fixed order (over `in` for x A^T, over the rank for the product
// with B^T), one row at a time, so a row's result does not depend on the rows beside it. The sum
// is added to out in float32 and rounded once to out's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <cstdint>
#include <vector>

namespace {

using pagedserve::round_to;
using pagedserve::to_float;

constexpr int64_t BLOCK = 8;  // rows of one adapter that share a read of its A and B
constexpr int64_t CHUNK = 16;  // output columns of a segment at most

struct Task {
  int64_t slot;
  int64_t rows[BLOCK];
  int64_t count;
};

struct Segment {
  int64_t column, cols, lo, hi, offset, stride;  // B^T[k][column + o] = b[offset + (k - lo) * stride + o]
};

struct Adapter {
  const float* a_t;  // [in, rank]
  const float* b;  // the projections' B^T, packed
  const Segment* segments;
  int64_t num_segments, rank;
};

// Rows grouped by adapter, in row order within each, cut into blocks.
std::vector<Task> make_tasks(const int64_t* row_slot, int64_t n, int64_t num_slots) {
  std::vector<std::vector<int64_t>> by_slot(num_slots);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s = row_slot[j];
    if (s >= 0) by_slot[s].push_back(j);
  }
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_slots; ++s) {
    for (size_t start = 0; start < by_slot[s].size(); start += BLOCK) {
      Task task{s, {}, 0};
      for (size_t i = start; i < by_slot[s].size() && task.count < BLOCK; ++i) task.rows[task.count++] = by_slot[s][i];
      tasks.push_back(task);
    }
  }
  return tasks;
}

#if defined(__AVX512F__)
// x A^T for M rows (one block) and NK * 16 rank columns from k0, every partial sum in registers:
// each takes the terms over `in` in order from the first, as the portable loops below do. `xf`
// holds the block's rows of x in float32, so each term is one FMA with a broadcast from memory.
template <int M, int NK>
void x_times_a_t(const float* xf, int64_t in, const Adapter& ad, int64_t k0, float* h) {
  const int64_t rank = ad.rank;
  __mmask16 lanes[NK];
  for (int c = 0; c < NK; ++c) {
    const int64_t left = rank - k0 - 16 * c;
    lanes[c] = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  }
  __m512 acc[M * NK];
  for (int j = 0; j < M * NK; ++j) acc[j] = _mm512_setzero_ps();
  int64_t i = 0;
  do {  // in > 0 (lora_add checks): with a loop that may not run, GCC keeps acc on the stack too
    __m512 a[NK];
    for (int c = 0; c < NK; ++c) a[c] = _mm512_maskz_loadu_ps(lanes[c], ad.a_t + i * rank + k0 + 16 * c);
    for (int r = 0; r < M; ++r) {
      const __m512 xv = _mm512_set1_ps(xf[r * in + i]);
      for (int c = 0; c < NK; ++c) acc[r * NK + c] = _mm512_fmadd_ps(xv, a[c], acc[r * NK + c]);
    }
  } while (++i < in);
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < NK; ++c) _mm512_mask_storeu_ps(h + r * rank + k0 + 16 * c, lanes[c], acc[r * NK + c]);
}

// The block's rows of x in float32, row after row (the conversion is exact).
template <typename T, int M>
void rows_to_float(const int64_t* rows, const T* x, int64_t in, float* xf) {
  for (int r = 0; r < M; ++r) {
    const T* src = x + rows[r] * in;
    float* dst = xf + r * in;
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) _mm512_storeu_ps(dst + i, pagedserve::load16(src + i));
    for (; i < in; ++i) dst[i] = to_float(src[i]);
  }
}

// M rows (one block): x A^T two chunks of sixteen rank columns at a time, then each segment's
// product with B^T (up to sixteen outputs). Each element is summed over `in`, then over the rank,
// in order from the first term, as the portable loops below sum it.
template <typename T, int M>
void run_block(const int64_t* rows, T* out, const T* x, int64_t in, int64_t width, const Adapter& ad, float* h, float* xf) {
  const int64_t rank = ad.rank;
  rows_to_float<T, M>(rows, x, in, xf);
  int64_t k0 = 0;
  for (; k0 + 16 < rank; k0 += 32) x_times_a_t<M, 2>(xf, in, ad, k0, h);
  if (k0 < rank) x_times_a_t<M, 1>(xf, in, ad, k0, h);
  for (int64_t g = 0; g < ad.num_segments; ++g) {
    const Segment& seg = ad.segments[g];
    const __mmask16 cols = seg.cols == 16 ? __mmask16(0xFFFF) : __mmask16((1u << seg.cols) - 1);
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    const float* b_row = ad.b + seg.offset;
    const int64_t stride = seg.stride, hi = seg.hi;
    int64_t k = seg.lo;
    do {  // lo < hi (lora_add checks); see x_times_a_t for why not a for loop
      const __m512 b = _mm512_maskz_loadu_ps(cols, b_row);
      for (int r = 0; r < M; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(h[r * rank + k]), b, acc[r]);
      b_row += stride;
    } while (++k < hi);
    if (cols == 0xFFFF) {
      for (int r = 0; r < M; ++r) {
        T* dst = out + rows[r] * width + seg.column;
        pagedserve::store16(dst, _mm512_add_ps(pagedserve::load16(dst), acc[r]));
      }
    } else {  // a projection's last columns, when its width is not a multiple of sixteen
      alignas(64) float sum[M][16];
      for (int r = 0; r < M; ++r) _mm512_store_ps(sum[r], acc[r]);
      for (int r = 0; r < M; ++r) {
        T* dst = out + rows[r] * width + seg.column;
        for (int64_t o = 0; o < seg.cols; ++o) dst[o] = round_to<T>(to_float(dst[o]) + sum[r][o]);
      }
    }
  }
}

template <typename T>
using BlockFn = void (*)(const int64_t*, T*, const T*, int64_t, int64_t, const Adapter&, float*, float*);

// A thread's scratch: the block's x A^T and its rows of x in float32.
struct Scratch {
  std::vector<float> h, xf;
};

template <typename T>
void run_task(const Task& task, T* out, const T* x, int64_t in, int64_t width, const Adapter& ad, Scratch& scratch) {
  static constexpr BlockFn<T> BY_ROWS[BLOCK] = {run_block<T, 1>, run_block<T, 2>, run_block<T, 3>, run_block<T, 4>,
                                                 run_block<T, 5>, run_block<T, 6>, run_block<T, 7>, run_block<T, 8>};
  scratch.h.resize(task.count * ad.rank);
  scratch.xf.resize(task.count * in);
  BY_ROWS[task.count - 1](task.rows, out, x, in, width, ad, scratch.h.data(), scratch.xf.data());
}

#else

struct Scratch {
  std::vector<float> h;
};

template <typename T>
void run_task(const Task& task, T* out, const T* x, int64_t in, int64_t width, const Adapter& ad, Scratch& scratch) {
  const int64_t m = task.count, rank = ad.rank;
  std::vector<float>& h = scratch.h;
  h.assign(m * rank, 0.f);
  for (int64_t i = 0; i < in; ++i) {  // h[r] += x[r, i] * A^T[i]: each h sums over i in order
    const float* a_row = ad.a_t + i * rank;
    for (int64_t r = 0; r < m; ++r) {
      const float xv = to_float(x[task.rows[r] * in + i]);
      float* hr = h.data() + r * rank;
      for (int64_t k = 0; k < rank; ++k) hr[k] += xv * a_row[k];
    }
  }
  float acc[CHUNK];
  for (int64_t g = 0; g < ad.num_segments; ++g) {  // each sums over its rank rows in order
    const Segment& seg = ad.segments[g];
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t o = 0; o < seg.cols; ++o) acc[o] = 0.f;
      for (int64_t k = seg.lo; k < seg.hi; ++k) {
        const float hv = h[r * rank + k];
        const float* b_row = ad.b + seg.offset + (k - seg.lo) * seg.stride;
        for (int64_t o = 0; o < seg.cols; ++o) acc[o] += hv * b_row[o];
      }
      T* dst = out + task.rows[r] * width + seg.column;
      for (int64_t o = 0; o < seg.cols; ++o) dst[o] = round_to<T>(to_float(dst[o]) + acc[o]);
    }
  }
}

#endif

template <typename T>
void add_all(const std::vector<Task>& tasks, const std::vector<Adapter>& adapters, at::Tensor& out, const at::Tensor& x) {
  T* op = out.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const int64_t in = x.size(1), width = out.size(1);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t t = begin; t < end; ++t) run_task(tasks[t], op, xp, in, width, adapters[tasks[t].slot], scratch);
  });
}

// One adapter's arguments, checked: every segment within out's columns, A^T's rank and b.
Adapter check_adapter(int64_t s, const at::Tensor& a_t, const at::Tensor& b, const at::Tensor& segments, int64_t in, int64_t width) {
  TORCH_CHECK(a_t.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a_t.is_contiguous() && b.is_contiguous(),
              "lora_add: A^T and B float32, contiguous");
  TORCH_CHECK(a_t.dim() == 2 && a_t.size(0) == in && b.dim() == 1, "lora_add: adapter ", s, " has A^T ", a_t.sizes(), " and B ", b.sizes(),
              " for x with ", in, " columns (A^T [in, rank], B one dimension)");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.is_contiguous() && segments.dim() == 2 && segments.size(1) == 6,
              "lora_add: adapter ", s, "'s segments must be int64 [S, 6]");
  static_assert(sizeof(Segment) == 6 * sizeof(int64_t));
  const auto* segs = reinterpret_cast<const Segment*>(segments.data_ptr<int64_t>());
  const int64_t rank = a_t.size(1), num_segments = segments.size(0);
  for (int64_t g = 0; g < num_segments; ++g) {
    const Segment& seg = segs[g];
    TORCH_CHECK(seg.column >= 0 && seg.cols >= 1 && seg.cols <= CHUNK && seg.column + seg.cols <= width,
                "lora_add: adapter ", s, "'s segment ", g, " is outside out's ", width, " columns");
    TORCH_CHECK(seg.lo >= 0 && seg.lo < seg.hi && seg.hi <= rank, "lora_add: adapter ", s, "'s segment ", g, " has rank rows outside its rank");
    TORCH_CHECK(seg.offset >= 0 && seg.stride >= seg.cols && seg.offset + (seg.hi - seg.lo - 1) * seg.stride + seg.cols <= b.numel(),
                "lora_add: adapter ", s, "'s segment ", g, " reads past its B");
  }
  return {a_t.data_ptr<float>(), b.data_ptr<float>(), segs, num_segments, rank};
}

// out [n, width] += each adapted row's (x [n, in] A_s^T) B_s^T; row_slot [n] int64 names the
// row's entry of a_t / b / segments (A^T [in, r_s] float32, the projections' B^T packed in one
// float32 vector, int64 [S, 6] segments: see Segment), -1 for none.
void lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& row_slot, at::TensorList a_t, at::TensorList b,
              at::TensorList segments) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == out.scalar_type(),
              "lora_add: out [rows, width] and x [rows, in] contiguous, of one dtype");
  TORCH_CHECK(row_slot.scalar_type() == at::kLong && row_slot.is_contiguous() && row_slot.numel() == x.size(0) && out.size(0) == x.size(0),
              "lora_add: row_slot [rows] int64");
  TORCH_CHECK(a_t.size() == b.size() && a_t.size() == segments.size(), "lora_add: one B and one segments for each A");
  const int64_t n = x.size(0), in = x.size(1), width = out.size(1);
  TORCH_CHECK(in > 0, "lora_add: x needs at least one column");
  const int64_t num_slots = static_cast<int64_t>(a_t.size());
  std::vector<Adapter> adapters;
  for (int64_t s = 0; s < num_slots; ++s) adapters.push_back(check_adapter(s, a_t[s], b[s], segments[s], in, width));
  const int64_t* slots = row_slot.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(slots[j] >= -1 && slots[j] < num_slots, "lora_add: row ", j, " names adapter ", slots[j]);
  const std::vector<Task> tasks = make_tasks(slots, n, num_slots);
  switch (out.scalar_type()) {
    case at::kFloat: return add_all<float>(tasks, adapters, out, x);
    case at::kBFloat16: return add_all<c10::BFloat16>(tasks, adapters, out, x);
    case at::kHalf: return add_all<c10::Half>(tasks, adapters, out, x);
    default: TORCH_CHECK(false, "lora_add: float32, bfloat16 or float16, not ", out.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor row_slot, Tensor[] a_t, Tensor[] b, Tensor[] segments) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("lora_add", &lora_add); }
