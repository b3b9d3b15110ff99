// The portable variant's vectors: plain loops over 16 floats (and 64 bytes) that compilers
// vectorize for the architecture's baseline (SSE2 on x86-64, NEON on aarch64). Every CPU runs it;
// tests check each other variant against it. Included by vec.h.
#pragma once

namespace llmpool {

struct V16 {
  float v[16];
  static V16 zero() { return splat(0.f); }
  static V16 splat(float x) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
};
template <typename Op>
inline V16 lanes(V16 a, V16 b, Op op) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = op(a.v[i], b.v[i]); return r; }
inline V16 fma(V16 a, V16 b, V16 c) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
inline V16 mul(V16 a, V16 b) { return lanes(a, b, [](float x, float y) { return x * y; }); }
inline V16 add(V16 a, V16 b) { return lanes(a, b, [](float x, float y) { return x + y; }); }
inline V16 sub(V16 a, V16 b) { return lanes(a, b, [](float x, float y) { return x - y; }); }
inline V16 div(V16 a, V16 b) { return lanes(a, b, [](float x, float y) { return x / y; }); }
inline V16 vmax(V16 a, V16 b) { return lanes(a, b, [](float x, float y) { return std::max(x, y); }); }
inline V16 vabs(V16 a) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::fabs(a.v[i]); return r; }
// In the order the avx512 variant's reduction adds: the halves, then quarters, eighths, sixteenths.
inline float hsum(V16 a) {
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = a.v[i + 8] + a.v[i];
  for (int i = 0; i < 4; ++i) q[i] = h[i + 4] + h[i];
  return (q[0] + q[2]) + (q[1] + q[3]);
}
inline float hmax(V16 a) { float m = a.v[0]; for (int i = 1; i < 16; ++i) m = std::max(m, a.v[i]); return m; }
template <typename T>
inline V16 load16(const T* p) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]); return r; }
inline void store16(float* p, V16 a) { for (int i = 0; i < 16; ++i) p[i] = a.v[i]; }
inline void store_i8(int8_t* p, V16 a) { for (int i = 0; i < 16; ++i) p[i] = static_cast<int8_t>(std::nearbyint(a.v[i])); }
inline V16 exp16(V16 x) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::exp(x.v[i]); return r; }
// out[i] = sum of the lanes of r[i], added in the avx512 variant's transpose-and-add tree: per
// 4-lane quarter L, s_L = (x[4L] + x[4L + 2]) + (x[4L + 1] + x[4L + 3]), then (s_0 + s_1) + (s_2 + s_3).
inline float tree16(const float* x) {
  float s[4];
  for (int L = 0; L < 4; ++L) s[L] = (x[4 * L] + x[4 * L + 2]) + (x[4 * L + 1] + x[4 * L + 3]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}
inline V16 reduce16(const V16* r) { V16 o; for (int i = 0; i < 16; ++i) o.v[i] = tree16(r[i].v); return o; }

// int8 dot products for the packed layouts: 64 bytes hold 4 consecutive inputs of 16 columns
// ([16][4]); 16 int32 sums. Signed activations (no shift).
constexpr int ACTIVATION_SHIFT = 0;
// Blocks of 16 columns a packed tile of 3 or 4 rows takes at once (arrays: no registers to share).
constexpr int TILE_BLOCKS = 1;
struct Acc16 {
  int32_t v[16];
};
inline Acc16 acc_zero() { Acc16 a; for (int i = 0; i < 16; ++i) a.v[i] = 0; return a; }
inline V16 acc_float(Acc16 a) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(a.v[i]); return r; }

struct S8W {
  const int8_t* p;
};
inline S8W load_s8w(const int8_t* p) { return {p}; }
inline Acc16 dot_s8(Acc16 acc, const S8W& w, int32_t four) {
  int8_t x[4];
  std::memcpy(x, &four, 4);
  for (int c = 0; c < 16; ++c)
    for (int i = 0; i < 4; ++i) acc.v[c] += static_cast<int32_t>(x[i]) * w.p[c * 4 + i];
  return acc;
}

struct Q4W {
  const uint8_t* p;
};
inline Q4W load_q4w(const uint8_t* p) { return {p}; }
using Q4Acc = Acc16;
inline Q4Acc q4_zero() { return acc_zero(); }
inline Q4Acc dot_q4(Q4Acc acc, const Q4W& w, int32_t x0, int32_t x1) {
  int8_t a[4], b[4];
  std::memcpy(a, &x0, 4);
  std::memcpy(b, &x1, 4);
  for (int c = 0; c < 16; ++c)
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = w.p[c * 4 + i];
      acc.v[c] += (byte & 0x0F) * static_cast<int32_t>(a[i]) + (byte >> 4) * static_cast<int32_t>(b[i]);
    }
  return acc;
}
inline V16 q4_float(Q4Acc a) { return acc_float(a); }

}  // namespace llmpool
