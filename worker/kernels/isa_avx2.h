// The avx2 and avxvnni variants' vectors (x86-64-v3: AVX2, FMA, F16C; Haswell, Zen 1-3 and every x86
// server since): 16 floats as two 8-float registers, int8 dot products with vpmaddubsw (unsigned x
// signed byte pairs to int16) and vpmaddwd (int16 pairs to int32), or, compiled with -mavxvnni (the
// avxvnni variant: Alder Lake and later client chips, Zen 4/5 client parts), vpdpbusd on 256 bits:
// the same exact integer sums in one instruction. Included by vec.h. Reductions add in the order the
// avx512 variant's instructions do, so the three agree to the bit.
#pragma once

#include <immintrin.h>

namespace llmpool {

// ---------------------------------------------------------------------------------------------
// 16 floats
// ---------------------------------------------------------------------------------------------
struct V16 {
  __m256 lo, hi;
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
};
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 vabs(V16 a) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, mask), _mm256_and_ps(a.hi, mask)};
}
// The 8 lanes of x summed as _mm512_reduce_add_ps sums the halves of 16: 4 + 4, then 2 + 2, then 1 + 1.
inline float hsum8(__m256 x) {
  const __m128 h = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  const __m128 q = _mm_add_ps(h, _mm_shuffle_ps(h, h, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(q) + _mm_cvtss_f32(_mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 1, 1, 1)));
}
inline float hsum(V16 a) { return hsum8(_mm256_add_ps(a.hi, a.lo)); }
inline float hmax(V16 a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  const __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m8, 1), _mm256_castps256_ps128(m8));
  const __m128 m2 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(m2), _mm_cvtss_f32(_mm_shuffle_ps(m2, m2, _MM_SHUFFLE(1, 1, 1, 1))));
}
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline V16 load16(const c10::BFloat16* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline V16 load16(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline V16 load16(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
}
inline void store16(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
// Rounded to the nearest integer (ties to even) and stored as 16 int8 (values within +-127).
inline void store_i8(int8_t* p, V16 a) {
  const __m256i words = _mm256_packs_epi32(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi));  // lanes 0-3 8-11 | 4-7 12-15
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_shuffle_epi32(bytes, _MM_SHUFFLE(3, 1, 2, 0)));
}
// e^x, the avx512 variant's polynomial on 8 lanes; 2^n built in the exponent bits (n held within
// the normal range: below about -87 the result is ~1e-38 where scalef gives smaller, never used).
inline __m256 exp8(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-100.f)), _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(-126)), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)));
}
inline V16 exp16(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }
// out[i] = sum of the lanes of r[i], for 16 vectors at once: the avx512 variant's transpose-and-add
// tree, step for step on two 8-float halves (the same pairs added, so the same sums to the bit).
inline __m256 pair_sums(__m256 a, __m256 b, __m256 c, __m256 d) {  // per 128-bit lane: the 4 sums of a, b, c, d
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))));
}
inline __m256 lane_pairs(__m256 lo, __m256 hi) {  // [lo.L0 + lo.L1, hi.L0 + hi.L1]
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
inline V16 reduce16(const V16* r) {
  V16 u[4];
  for (int q = 0; q < 4; ++q) {
    const V16 &a = r[4 * q], &b = r[4 * q + 1], &c = r[4 * q + 2], &d = r[4 * q + 3];
    u[q] = {pair_sums(a.lo, b.lo, c.lo, d.lo), pair_sums(a.hi, b.hi, c.hi, d.hi)};
  }
  const V16 x01{lane_pairs(u[0].lo, u[0].hi), lane_pairs(u[1].lo, u[1].hi)};
  const V16 x23{lane_pairs(u[2].lo, u[2].hi), lane_pairs(u[3].lo, u[3].hi)};
  return {lane_pairs(x01.lo, x01.hi), lane_pairs(x23.lo, x23.hi)};
}

// ---------------------------------------------------------------------------------------------
// int8 dot products for the packed layouts: 64 bytes hold 4 consecutive inputs of 16 columns
// ([16][4]), as two registers of 8 columns; 16 int32 sums. Activations stay signed
// (ACTIVATION_SHIFT 0): vpmaddubsw takes |w| as its unsigned side and x with w's sign as its
// signed one (vpsignb), so no pair sum reaches int16's limit (2 * 127 * 128 < 32768).
// ---------------------------------------------------------------------------------------------
constexpr int ACTIVATION_SHIFT = 0;
// Blocks of 16 columns a packed tile of 3 or 4 rows takes at once (16 registers: one block's 4 weight registers and 4 rows' 8 accumulators fit, two spilled).
constexpr int TILE_BLOCKS = 1;
struct Acc16 {
  __m256i lo, hi;
};
inline Acc16 acc_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline V16 acc_float(Acc16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }

struct S8W {  // 64 int8 weights and their magnitudes
  __m256i lo, hi, abs_lo, abs_hi;
};
inline S8W load_s8w(const int8_t* p) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  return {lo, hi, _mm256_abs_epi8(lo), _mm256_abs_epi8(hi)};
}
inline __m256i pairs_to_int32(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
inline Acc16 dot_s8(Acc16 acc, const S8W& w, int32_t four) {
  const __m256i x = _mm256_set1_epi32(four);
#if defined(__AVXVNNI__)
  return {_mm256_dpbusd_avx_epi32(acc.lo, w.abs_lo, _mm256_sign_epi8(x, w.lo)),
          _mm256_dpbusd_avx_epi32(acc.hi, w.abs_hi, _mm256_sign_epi8(x, w.hi))};
#else
  return {_mm256_add_epi32(acc.lo, pairs_to_int32(_mm256_maddubs_epi16(w.abs_lo, _mm256_sign_epi8(x, w.lo)))),
          _mm256_add_epi32(acc.hi, pairs_to_int32(_mm256_maddubs_epi16(w.abs_hi, _mm256_sign_epi8(x, w.hi))))};
#endif
}

struct Q4W {  // 64 bytes of packed q4: the low nibbles (inputs k..k+3) and the high ones (k+4..k+7)
  __m256i lo0, lo1, hi0, hi1;
};
inline Q4W load_q4w(const uint8_t* p) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  const __m256i low = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(a, low), _mm256_and_si256(b, low), _mm256_and_si256(_mm256_srli_epi16(a, 4), low),
          _mm256_and_si256(_mm256_srli_epi16(b, 4), low)};
}
struct Q4Acc {
  __m256i lo, hi;
};
inline Q4Acc q4_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
#if defined(__AVXVNNI__)
// q4 sums go straight to int32 (the nibbles are the unsigned side, the activations the signed one).
inline Q4Acc dot_q4(Q4Acc acc, const Q4W& w, int32_t x0, int32_t x1) {
  const __m256i a = _mm256_set1_epi32(x0), b = _mm256_set1_epi32(x1);
  return {_mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc.lo, w.lo0, a), w.hi0, b),
          _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc.hi, w.lo1, a), w.hi1, b)};
}
inline V16 q4_float(Q4Acc a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
#else
// q4 sums stay int16 pairs within a group of 32 inputs (4 dot_q4 calls: at most 8 * 2 * 15 * 127 =
// 30480 a lane) and widen to int32 once, in q4_float.
inline Q4Acc dot_q4(Q4Acc acc, const Q4W& w, int32_t x0, int32_t x1) {
  const __m256i a = _mm256_set1_epi32(x0), b = _mm256_set1_epi32(x1);
  const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(w.lo0, a), _mm256_maddubs_epi16(w.hi0, b));
  const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(w.lo1, a), _mm256_maddubs_epi16(w.hi1, b));
  return {_mm256_add_epi16(acc.lo, lo), _mm256_add_epi16(acc.hi, hi)};
}
inline V16 q4_float(Q4Acc a) { return {_mm256_cvtepi32_ps(pairs_to_int32(a.lo)), _mm256_cvtepi32_ps(pairs_to_int32(a.hi))}; }
#endif

}  // namespace llmpool
