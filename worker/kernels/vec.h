// 16-float vectors and the loop helpers every kernel file shares (AVX-512 where the compiler
// targets it, plain loops that compilers auto-vectorize elsewhere); all maths in float32.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace llmpool {

using at::Tensor;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// 16-float vectors
// ---------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
struct V16 {
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 splat(float x) { return {_mm512_set1_ps(x)}; }
};
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline float hsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 load16(const c10::BFloat16* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline V16 load16(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline V16 load16(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline void store16(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline float hmax(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
// e^x for 16 floats: 2^(x log2 e) split into an integer power (scalef) and a degree-6 polynomial
// of the fraction (relative error ~1e-7); anything below -100 gives 0.
inline V16 exp16(V16 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x.v, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return {_mm512_scalef_ps(p, n)};
}
// out[i] = sum of the lanes of r[i], for 16 vectors at once (a transpose-and-add tree).
inline V16 reduce16(const V16* r) {
  __m512 u[4];
  for (int q = 0; q < 4; ++q) {
    const __m512 a = r[4 * q].v, b = r[4 * q + 1].v, c = r[4 * q + 2].v, d = r[4 * q + 3].v;
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    u[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  }
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)))};
}
#else
struct V16 {
  float v[16];
  static V16 zero() { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = 0.f; return r; }
  static V16 splat(float x) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
};
inline V16 fma(V16 a, V16 b, V16 c) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
inline V16 mul(V16 a, V16 b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
inline float hsum(V16 a) { float s = 0.f; for (int i = 0; i < 16; ++i) s += a.v[i]; return s; }
template <typename T>
inline V16 load16(const T* p) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]); return r; }
inline void store16(float* p, V16 a) { for (int i = 0; i < 16; ++i) p[i] = a.v[i]; }
inline V16 add(V16 a, V16 b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
inline V16 sub(V16 a, V16 b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] - b.v[i]; return r; }
inline float hmax(V16 a) { float m = a.v[0]; for (int i = 1; i < 16; ++i) m = std::max(m, a.v[i]); return m; }
inline V16 vmax(V16 a, V16 b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::max(a.v[i], b.v[i]); return r; }
inline V16 exp16(V16 x) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::exp(x.v[i]); return r; }
inline V16 reduce16(const V16* r) { V16 o; for (int i = 0; i < 16; ++i) o.v[i] = hsum(r[i]); return o; }
#endif

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// A small batch's rows in groups of up to 4 (a tile's accumulators stay in registers): calls
// f(std::integral_constant<int, R>{}, first_row) for each group.
template <typename F>
void for_row_groups(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) f(std::integral_constant<int, 4>{}, r);
  switch (rows - r) {
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// Output columns in tiles of NR (8 for a single row, else 4: NR * R accumulator chains in flight)
// and single-column tails: calls f(std::integral_constant<int, NR>{}, first_column).
template <int R, typename F>
void for_column_tiles(int64_t n_begin, int64_t n_end, F&& f) {
  constexpr int NR = R == 1 ? 8 : 4;
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) f(std::integral_constant<int, NR>{}, n);
  for (; n < n_end; ++n) f(std::integral_constant<int, 1>{}, n);
}

}  // namespace llmpool
