// Vector math shared by the CPU kernels.
#pragma once

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

}  // namespace pagedserve
#endif
