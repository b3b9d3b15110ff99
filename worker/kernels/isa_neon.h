// The neon variant's vectors (armv8.2-a with the dot-product extension: Graviton 2-4, Ampere,
// Apple M1 and later, Cortex-A76 and later): 16 floats as four 4-float registers, int8 dot products
// with sdot (4 signed byte pairs into each int32 lane). Included by vec.h. The neon_i8mm variant is
// this header compiled with +i8mm as well: the same primitives, plus row pairs with smmla (below).
#pragma once

#include <arm_neon.h>

namespace llmpool {

// ---------------------------------------------------------------------------------------------
// 16 floats
// ---------------------------------------------------------------------------------------------
struct V16 {
  float32x4_t v[4];
  static V16 zero() { return splat(0.f); }
  static V16 splat(float x) { const float32x4_t s = vdupq_n_f32(x); return {{s, s, s, s}}; }
};
#define LLMPOOL_LANES4(expr) \
  V16 r;                     \
  for (int i = 0; i < 4; ++i) r.v[i] = (expr); \
  return r
inline V16 fma(V16 a, V16 b, V16 c) { LLMPOOL_LANES4(vfmaq_f32(c.v[i], a.v[i], b.v[i])); }
inline V16 mul(V16 a, V16 b) { LLMPOOL_LANES4(vmulq_f32(a.v[i], b.v[i])); }
inline V16 add(V16 a, V16 b) { LLMPOOL_LANES4(vaddq_f32(a.v[i], b.v[i])); }
inline V16 sub(V16 a, V16 b) { LLMPOOL_LANES4(vsubq_f32(a.v[i], b.v[i])); }
inline V16 div(V16 a, V16 b) { LLMPOOL_LANES4(vdivq_f32(a.v[i], b.v[i])); }
inline V16 vmax(V16 a, V16 b) { LLMPOOL_LANES4(vmaxq_f32(a.v[i], b.v[i])); }
inline V16 vabs(V16 a) { LLMPOOL_LANES4(vabsq_f32(a.v[i])); }
// In the order the avx512 variant's reduction adds: the halves, then quarters, eighths, sixteenths.
inline float hsum(V16 a) {
  const float32x4_t h0 = vaddq_f32(a.v[2], a.v[0]), h1 = vaddq_f32(a.v[3], a.v[1]);
  const float32x4_t q = vaddq_f32(h1, h0);
  return (vgetq_lane_f32(q, 0) + vgetq_lane_f32(q, 2)) + (vgetq_lane_f32(q, 1) + vgetq_lane_f32(q, 3));
}
inline float hmax(V16 a) { return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.v[0], a.v[1]), vmaxq_f32(a.v[2], a.v[3]))); }
inline V16 load16(const float* p) { LLMPOOL_LANES4(vld1q_f32(p + 4 * i)); }
inline V16 load16(const c10::BFloat16* p) {
  LLMPOOL_LANES4(vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p) + 4 * i), 16)));
}
inline V16 load16(const c10::Half* p) {
  LLMPOOL_LANES4(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p) + 4 * i))));
}
inline V16 load16(const int8_t* p) {
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_s8(vget_high_s8(b));
  return {{vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
           vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)))}};
}
inline void store16(float* p, V16 a) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, a.v[i]);
}
// Rounded to the nearest integer (ties to even) and stored as 16 int8 (values within +-127).
inline void store_i8(int8_t* p, V16 a) {
  const int16x8_t lo = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(a.v[0])), vqmovn_s32(vcvtnq_s32_f32(a.v[1])));
  const int16x8_t hi = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(a.v[2])), vqmovn_s32(vcvtnq_s32_f32(a.v[3])));
  vst1q_s8(p, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
}
// e^x, the avx512 variant's polynomial; 2^n built in the exponent bits (see isa_avx2.h).
inline float32x4_t exp4(float32x4_t x) {
  const float32x4_t t = vmulq_f32(vmaxq_f32(x, vdupq_n_f32(-100.f)), vdupq_n_f32(1.44269504088896341f));
  const float32x4_t n = vrndnq_f32(t);
  const float32x4_t f = vsubq_f32(t, n);
  float32x4_t p = vdupq_n_f32(1.5403530393381606e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3333558146428443e-3f), p, f);
  p = vfmaq_f32(vdupq_n_f32(9.6181291076284772e-3f), p, f);
  p = vfmaq_f32(vdupq_n_f32(5.5504108664821580e-2f), p, f);
  p = vfmaq_f32(vdupq_n_f32(2.4022650695910071e-1f), p, f);
  p = vfmaq_f32(vdupq_n_f32(6.9314718055994531e-1f), p, f);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, f);
  const int32x4_t e = vminq_s32(vmaxq_s32(vcvtq_s32_f32(n), vdupq_n_s32(-126)), vdupq_n_s32(127));
  return vmulq_f32(p, vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(e, vdupq_n_s32(127)), 23)));
}
inline V16 exp16(V16 x) { LLMPOOL_LANES4(exp4(x.v[i])); }
// out[i] = sum of the lanes of r[i], added in the avx512 variant's transpose-and-add tree: per
// 4-lane quarter L, s_L = (x[4L] + x[4L + 2]) + (x[4L + 1] + x[4L + 3]), then (s_0 + s_1) + (s_2 + s_3).
inline float tree16(const float* x) {
  float s[4];
  for (int L = 0; L < 4; ++L) s[L] = (x[4 * L] + x[4 * L + 2]) + (x[4 * L + 1] + x[4 * L + 3]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}
inline V16 reduce16(const V16* r) {
  alignas(16) float in[16], out[16];
  for (int i = 0; i < 16; ++i) {
    store16(in, r[i]);
    out[i] = tree16(in);
  }
  return load16(out);
}
#undef LLMPOOL_LANES4

// ---------------------------------------------------------------------------------------------
// int8 dot products for the packed layouts: 64 bytes hold 4 consecutive inputs of 16 columns
// ([16][4]), as four registers of 4 columns; sdot sums each column's 4 byte products into its
// lane. Signed activations (no shift); q4's nibbles (0-15) are valid signed bytes as they are.
// ---------------------------------------------------------------------------------------------
constexpr int ACTIVATION_SHIFT = 0;
// Blocks of 16 columns a packed tile of 3 or 4 rows takes at once (32 registers). With i8mm, 1: a
// block's 4 rows as two smmla pairs hold 16 accumulators, its zipped weights 8 and the rows' 2.
#if defined(__ARM_FEATURE_MATMUL_INT8)
constexpr int TILE_BLOCKS = 1;
#else
constexpr int TILE_BLOCKS = 2;
#endif
struct Acc16 {
  int32x4_t v[4];
};
inline Acc16 acc_zero() { const int32x4_t z = vdupq_n_s32(0); return {{z, z, z, z}}; }
inline V16 acc_float(Acc16 a) { return {{vcvtq_f32_s32(a.v[0]), vcvtq_f32_s32(a.v[1]), vcvtq_f32_s32(a.v[2]), vcvtq_f32_s32(a.v[3])}}; }

struct S8W {
  int8x16x4_t v;
};
inline S8W load_s8w(const int8_t* p) { return {vld1q_s8_x4(p)}; }
inline Acc16 dot_s8(Acc16 acc, const S8W& w, int32_t four) {
  const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(four));
  for (int i = 0; i < 4; ++i) acc.v[i] = vdotq_s32(acc.v[i], w.v.val[i], x);
  return acc;
}

struct Q4W {
  int8x16_t lo[4], hi[4];
};
inline Q4W load_q4w(const uint8_t* p) {
  const uint8x16x4_t v = vld1q_u8_x4(p);
  const uint8x16_t low = vdupq_n_u8(0x0F);
  Q4W w;
  for (int i = 0; i < 4; ++i) {
    w.lo[i] = vreinterpretq_s8_u8(vandq_u8(v.val[i], low));
    w.hi[i] = vreinterpretq_s8_u8(vshrq_n_u8(v.val[i], 4));
  }
  return w;
}
using Q4Acc = Acc16;
inline Q4Acc q4_zero() { return acc_zero(); }
inline Q4Acc dot_q4(Q4Acc acc, const Q4W& w, int32_t x0, int32_t x1) {
  const int8x16_t a = vreinterpretq_s8_s32(vdupq_n_s32(x0)), b = vreinterpretq_s8_s32(vdupq_n_s32(x1));
  for (int i = 0; i < 4; ++i) acc.v[i] = vdotq_s32(vdotq_s32(acc.v[i], w.lo[i], a), w.hi[i], b);
  return acc;
}
inline V16 q4_float(Q4Acc a) { return acc_float(a); }

#if defined(__ARM_FEATURE_MATMUL_INT8)
// ---------------------------------------------------------------------------------------------
// Row pairs with i8mm (armv8.6-a, optional from 8.2: Graviton 3/4, Neoverse V1/V2/N2, Apple M2 and
// later). smmla multiplies a 2x8 int8 block (two rows' 8 activations) by an 8x2 one (two columns'
// 8 weights, each column's 8 bytes contiguous) into 2x2 int32 sums: 32 products an instruction where
// sdot gives 16, and each weight register serves two rows. The packed layouts hold a column's
// inputs 4 to a 64-byte step, so two steps' words (int8) or a step's two nibbles (q4) are zipped
// into column pairs first, once per tile for every pair of rows (packed.cpp: LLMPOOL_ROW_PAIRS).
// ggml's q4_0/q8_0 dot products (ggml-cpu/arch/arm/quants.c) pair rows for smmla the same way.
// ---------------------------------------------------------------------------------------------
#define LLMPOOL_ROW_PAIRS 1
// 16 columns' 8 inputs: v[p] holds columns 2p and 2p + 1, 8 bytes each.
struct PairW {
  int8x16_t v[8];
};
// v[p]: (row 0, column 2p), (0, 2p + 1), (1, 2p), (1, 2p + 1).
struct PairAcc {
  int32x4_t v[8];
};
inline PairAcc pair_zero() {
  PairAcc a;
  for (int p = 0; p < 8; ++p) a.v[p] = vdupq_n_s32(0);
  return a;
}
// Each column's 4-byte words of two 4-input steps (a.val[i], b.val[i]: columns 4i..4i+3) side by side.
inline PairW zip_columns(const int32x4_t (&a)[4], const int32x4_t (&b)[4]) {
  PairW w;
  for (int i = 0; i < 4; ++i) {
    w.v[2 * i] = vreinterpretq_s8_s32(vzip1q_s32(a[i], b[i]));
    w.v[2 * i + 1] = vreinterpretq_s8_s32(vzip2q_s32(a[i], b[i]));
  }
  return w;
}
// Two consecutive 64-byte steps of the int8 layout: inputs k..k+3, then k+4..k+7.
inline PairW load_pairw(const int8_t* p) {
  const int32x4x4_t a = vld1q_s32_x4(reinterpret_cast<const int32_t*>(p));
  const int32x4x4_t b = vld1q_s32_x4(reinterpret_cast<const int32_t*>(p + 64));
  return zip_columns({a.val[0], a.val[1], a.val[2], a.val[3]}, {b.val[0], b.val[1], b.val[2], b.val[3]});
}
// One 64-byte step of the q4 layout: low nibbles (inputs k..k+3), then high ones (k+4..k+7).
inline PairW load_pairw(const uint8_t* p) {
  const Q4W q = load_q4w(p);
  int32x4_t lo[4], hi[4];
  for (int i = 0; i < 4; ++i) {
    lo[i] = vreinterpretq_s32_s8(q.lo[i]);
    hi[i] = vreinterpretq_s32_s8(q.hi[i]);
  }
  return zip_columns(lo, hi);
}
// Rows 0 and 1's 8 activations (x0, x1: 8 bytes each) against the 16 columns.
inline PairAcc dot_pair(PairAcc acc, const PairW& w, const int8_t* x0, const int8_t* x1) {
  const int8x16_t x = vcombine_s8(vld1_s8(x0), vld1_s8(x1));
  for (int p = 0; p < 8; ++p) acc.v[p] = vmmlaq_s32(acc.v[p], x, w.v[p]);
  return acc;
}
// The pair's sums as each row's 16 (the Acc16 of dot_s8 / dot_q4 over the same inputs).
inline void pair_rows(const PairAcc& a, Acc16& row0, Acc16& row1) {
  for (int i = 0; i < 4; ++i) {
    const int64x2_t c01 = vreinterpretq_s64_s32(a.v[2 * i]), c23 = vreinterpretq_s64_s32(a.v[2 * i + 1]);
    row0.v[i] = vreinterpretq_s32_s64(vzip1q_s64(c01, c23));
    row1.v[i] = vreinterpretq_s32_s64(vzip2q_s64(c01, c23));
  }
}
#endif

}  // namespace llmpool
