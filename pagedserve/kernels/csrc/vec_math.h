// Vector math shared by the CPU kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace pagedserve {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as torch does (NaN inputs do not occur in the kernels' finite math).
inline c10::BFloat16 from_float(float f, c10::BFloat16) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(bits >> 16);
  return out;
}
inline c10::Half from_float(float f, c10::Half) { return static_cast<c10::Half>(f); }
inline float from_float(float f, float) { return f; }

template <typename T>
inline T round_to(float f) {
  return from_float(f, T());
}

// A sum of n terms in a fixed order: sixteen lanes, then the lanes in turn. `#pragma omp simd
// reduction` lets the compiler peel a loop by its data's alignment, so the same inputs at another
// address could sum in another order and a row's result depend on where its scratch landed.
template <typename Term>
inline float fixed_order_sum(int64_t n, Term term) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int64_t l = 0; l < 16; ++l) lanes[l] += term(i + l);
  float sum = 0.f;
  for (int64_t l = 0; l < 16; ++l) sum += lanes[l];
  for (; i < n; ++i) sum += term(i);
  return sum;
}

}  // namespace pagedserve

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedserve {

// Sixteen values of a dtype to float32 lanes and back (round to nearest even, as torch does).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16(c10::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
// A float32 value rounded to the dtype and back: the torch layers round between their ops.
template <typename T>
inline __m512 round16(__m512 v) {
  alignas(64) T tmp[16];
  store16(tmp, v);
  return load16(tmp);
}

// exp(x) for x in [-87, 88] (clamped): 2^n * p(r) with |r| <= ln2/2, relative error ~1e-7.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  const __m512 rr = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// v[k]'s sixteen lanes combined by `op` (add, max), for k = 0..15, as one vector (lane k): one
// tree of shuffles for all sixteen instead of a horizontal reduction each. The same tree for
// every k, so a key's score does not depend on where it sits in its tile.
template <typename Op>
inline __m512 combine_lanes16(const __m512* v, Op op) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    pairs[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: keys 4i..4i+3, one partial each
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 lo = op(_mm512_shuffle_f32x4(quads[0], quads[1], even), _mm512_shuffle_f32x4(quads[0], quads[1], odd));
  const __m512 hi = op(_mm512_shuffle_f32x4(quads[2], quads[3], even), _mm512_shuffle_f32x4(quads[2], quads[3], odd));
  return op(_mm512_shuffle_f32x4(lo, hi, even), _mm512_shuffle_f32x4(lo, hi, odd));
}
inline __m512 sum_lanes16(const __m512* v) {
  return combine_lanes16(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}
inline __m512 max_lanes16(const __m512* v) {
  return combine_lanes16(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
}

// The sixteen-lane operations the kernels written once for both widths use (Lanes8 below).
struct Lanes16 {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  template <typename T>
  static V load(const T* p) { return load16(p); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V exp(V x) { return exp16(x); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static float max_of(V v) { return _mm512_reduce_max_ps(v); }
};

}  // namespace pagedserve
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace pagedserve {

// Eight values of a dtype to float32 lanes: AVX2, for CPUs without AVX-512 (Zen 3, Intel client
// cores), where the kernels' sixteen-lane paths are not compiled.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  // packus works within 128-bit halves: lanes 0-3 and 4-7 land in 64-bit words 0 and 2
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
template <typename T>
inline __m256 round8(__m256 v) {
  alignas(32) T tmp[8];
  store8(tmp, v);
  return load8(tmp);
}

// exp16's polynomial on eight lanes; 2^n is built in the exponent bits (AVX2 has no scalef):
// the clamp keeps n in [-126, 127], where 2^n is a normal float.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  const __m256 rr = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f));
  const __m256i two_to_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n));
}

// Lanes summed (or maxed) in one fixed order: halves, then pairs, then the last two.
inline float sum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float max8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

struct Lanes8 {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  template <typename T>
  static V load(const T* p) { return load8(p); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V exp(V x) { return exp8(x); }
  static float sum(V v) { return sum8(v); }
  static float max_of(V v) { return max8(v); }
};

}  // namespace pagedserve
#endif

namespace pagedserve {

// One row's SiLU-and-multiply: dst = silu(gate) * up over `width` values, silu rounded to the dtype
// before the product, as torch's two ops do. cpu_layers.cpp's silu_and_mul and the float32 GEMM's
// fused one (cpu_fp32_gemm.cpp) both call it, so the two give the same bits.
template <typename T>
inline void silu_mul_row(T* dst, const T* gate, const T* up, int64_t width) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // exp sixteen at a time (the scalar std::exp made this slower than torch's two ops)
  for (; i + 16 <= width; i += 16) {
    const __m512 g = load16(gate + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = round16<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    store16(dst + i, _mm512_mul_ps(silu, load16(up + i)));
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  for (; i + 8 <= width; i += 8) {  // the same, eight at a time (Zen 3)
    const __m256 g = load8(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = round8<T>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    store8(dst + i, _mm256_mul_ps(silu, load8(up + i)));
  }
#endif
  for (; i < width; ++i) {
    const float g = to_float(gate[i]);
    const float silu = to_float(round_to<T>(g / (1.f + std::exp(-g))));
    dst[i] = round_to<T>(silu * to_float(up[i]));
  }
}

}  // namespace pagedserve
