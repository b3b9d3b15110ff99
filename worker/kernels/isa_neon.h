// The neon variant's vectors (armv8.2-a with the dot-product extension: Graviton 2-4, Ampere,
// Apple M1 and later, Cortex-A76 and later): 16 floats as four 4-float registers, int8 dot products
// with sdot (4 signed byte pairs into each int32 lane). Included by vec.h.
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
// Blocks of 16 columns a packed tile of 3 or 4 rows takes at once (32 registers).
constexpr int TILE_BLOCKS = 2;
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

}  // namespace llmpool
