// The avx512 variant's vectors (AVX-512 F/BW/DQ/VL + VNNI: Cascade Lake, Ice Lake, Sapphire Rapids,
// Zen 4 and later): 16 floats in one register, int8 dot products with vpdpbusd. Included by vec.h.
#pragma once

#include <immintrin.h>

#define LLMPOOL_ISA_AVX512 1

namespace llmpool {

// ---------------------------------------------------------------------------------------------
// 16 floats
// ---------------------------------------------------------------------------------------------
struct V16 {
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 splat(float x) { return {_mm512_set1_ps(x)}; }
};
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 vabs(V16 a) { return {_mm512_abs_ps(a.v)}; }
inline float hsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float hmax(V16 a) { return _mm512_reduce_max_ps(a.v); }
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
// Rounded to the nearest integer (ties to even) and stored as 16 int8 (values within +-127).
inline void store_i8(int8_t* p, V16 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a.v)));
}
// e^x for 16 floats: 2^(x log2 e) split into an integer power (scalef) and a degree-6 polynomial
// of the fraction (relative error ~1e-7); anything below -100 gives ~0.
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

// ---------------------------------------------------------------------------------------------
// int8 dot products for the packed layouts: 64 bytes hold 4 consecutive inputs of 16 columns
// ([16][4]); 16 int32 sums, one a column. vpdpbusd multiplies unsigned by signed bytes, so int8
// activations are stored shifted (+128, ACTIVATION_SHIFT) and the GEMM subtracts 128 * the weight sums.
// ---------------------------------------------------------------------------------------------
constexpr int ACTIVATION_SHIFT = 128;
// Blocks of 16 columns a packed tile of 3 or 4 rows takes at once (32 registers: 2 blocks' weights beside 4 rows' accumulators).
constexpr int TILE_BLOCKS = 2;
struct Acc16 {
  __m512i v;
};
inline Acc16 acc_zero() { return {_mm512_setzero_si512()}; }
inline V16 acc_float(Acc16 a) { return {_mm512_cvtepi32_ps(a.v)}; }

struct S8W {  // 64 int8 weights
  __m512i v;
};
inline S8W load_s8w(const int8_t* p) { return {_mm512_loadu_si512(p)}; }
// acc[c] += sum_i x[i] * w[c][i] for the four (shifted) activation bytes in `four`.
inline Acc16 dot_s8(Acc16 acc, const S8W& w, int32_t four) { return {_mm512_dpbusd_epi32(acc.v, _mm512_set1_epi32(four), w.v)}; }

struct Q4W {  // 64 bytes of packed q4: the low nibbles (inputs k..k+3) and the high ones (k+4..k+7)
  __m512i lo, hi;
};
inline Q4W load_q4w(const uint8_t* p) {
  const __m512i v = _mm512_loadu_si512(p), low = _mm512_set1_epi8(0x0F);
  return {_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
}
using Q4Acc = Acc16;
inline Q4Acc q4_zero() { return acc_zero(); }
// acc[c] += sum_i lo[c][i] * x0[i] + hi[c][i] * x1[i] (x: signed activation bytes, 4 in each int).
inline Q4Acc dot_q4(Q4Acc acc, const Q4W& w, int32_t x0, int32_t x1) {
  return {_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc.v, w.lo, _mm512_set1_epi32(x0)), w.hi, _mm512_set1_epi32(x1))};
}
inline V16 q4_float(Q4Acc a) { return acc_float(a); }

}  // namespace llmpool
