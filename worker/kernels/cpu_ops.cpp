// CPU kernels for the worker's decode path, registered as torch.ops.llmpool.*.
//
// Why they exist (worker/kernels/__init__.py has the measurements):
// - paged_decode_attention: one query token per row attends to its context straight out of the
//   paged KV cache (no copy), each KV head read once for all the query heads that share it (GQA),
//   online softmax, and the context split across threads when there are few rows (flash-decoding);
//   bf16 caches use vdpbf16ps for both the scores and the V accumulation (attend_split_bf16).
// - linear: int8 or q4 weights packed for a VNNI GEMM (any number of rows; packed_tile,
//   packed_q4_tile), or row-major int8 / q4 / bf16 / fp16 / fp32 weights in matrix-vector loops
//   for a handful of rows.
// - llama_decode: a whole decode step of a Llama-family model in one call: norms, projections,
//   rotary embedding, cache writes, attention and MLP of every layer, with no Python and no per-op
//   dispatch in between (that dispatch was ~3 ms of a 13 ms step).
// - sample_temperature: plain temperature sampling of each row in one call (the sampler's torch
//   ops took 0.13-0.6 ms of a batch-1 step).
//
// Vectors of 16 floats (AVX-512 where the compiler targets it, plain loops that compilers
// auto-vectorize elsewhere); all maths in float32.

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

namespace {

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

// ---------------------------------------------------------------------------------------------
// Small-batch linear: out[r, n] = scale[n] * sum_k x[r, k] * w[n, k] (+ bias[n]); x is float32.
// A tile of NR output rows by R input rows keeps NR*R independent accumulator chains in flight.
// ---------------------------------------------------------------------------------------------
template <typename W, int R, int NR>
void linear_tile(const float* x, int64_t rows_stride, const W* w, int64_t K, int64_t n0, float* out, int64_t out_stride,
                 const float* scale, int64_t scale_stride, const float* bias) {
  V16 acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = V16::zero();
  const int64_t K16 = K - K % 16;
  for (int64_t k = 0; k < K16; k += 16) {
    V16 xs[R];
    for (int r = 0; r < R; ++r) xs[r] = load16(x + r * rows_stride + k);
    for (int j = 0; j < NR; ++j) {
      V16 wv = load16(w + (n0 + j) * K + k);
      for (int r = 0; r < R; ++r) acc[r][j] = fma(wv, xs[r], acc[r][j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t n = n0 + j;
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[r][j]);
      for (int64_t k = K16; k < K; ++k) s += x[r * rows_stride + k] * to_float(w[n * K + k]);
      if (scale) s *= scale[n * scale_stride];
      if (bias) s += bias[n];
      out[r * out_stride + n] = s;
    }
  }
}

template <typename W, int R>
void linear_rows(const float* x, int64_t K, const W* w, int64_t n_begin, int64_t n_end, float* out, int64_t N,
                 const float* scale, int64_t scale_stride, const float* bias) {
  for_column_tiles<R>(n_begin, n_end, [&](auto NR, int64_t n) { linear_tile<W, R, decltype(NR)::value>(x, K, w, K, n, out, N, scale, scale_stride, bias); });
}

// Rows of x in groups of up to 4, sharing each weight tile while it is in L1.
template <typename W>
void linear_range(const float* x, int64_t rows, int64_t K, const W* w, int64_t n_begin, int64_t n_end, float* out,
                  int64_t N, const float* scale, int64_t scale_stride, const float* bias) {
  // Walk the output in L1-sized column panels so every row group reuses the panel's weights.
  const int64_t panel = std::max<int64_t>(8, (16 * 1024) / (K * (int64_t)sizeof(W)) / 8 * 8);
  for (int64_t p0 = n_begin; p0 < n_end; p0 += panel) {
    const int64_t p1 = std::min(n_end, p0 + panel);
    for_row_groups(rows, [&](auto R, int64_t r) { linear_rows<W, decltype(R)::value>(x + r * K, K, w, p0, p1, out + r * N, N, scale, scale_stride, bias); });
  }
}


// 4-bit weights (``--quantization q4``): per group of 32 inputs a float16 scale d and minimum m,
// w = d * q + m with q in 0..15; byte j of a group holds q[j] (low nibble) and q[j + 16] (high), the
// layout of GGUF's Q4_1 blocks. sum_k x_k w_k = sum_groups d * (q . x) + m * sum(x), so each call
// first sums x over every group (xsum) and the inner loop only unpacks nibbles and multiplies.
constexpr int64_t Q4_GROUP = 32;

#if defined(__AVX512F__)
inline void unpack_q4(const uint8_t* p, V16& lo, V16& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)))};
  hi = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)))};
}
#else
inline void unpack_q4(const uint8_t* p, V16& lo, V16& hi) {
  for (int i = 0; i < 16; ++i) {
    lo.v[i] = static_cast<float>(p[i] & 0x0F);
    hi.v[i] = static_cast<float>(p[i] >> 4);
  }
}
#endif

template <int R, int NR>
void q4_tile(const float* x, const float* xsum, int64_t K, const uint8_t* w, const c10::Half* dm, int64_t n0, float* out,
             int64_t out_stride, const float* bias) {
  const int64_t groups = K / Q4_GROUP;
  V16 acc[R][NR];
  float macc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) {
      acc[r][j] = V16::zero();
      macc[r][j] = 0.f;
    }
  for (int64_t g = 0; g < groups; ++g) {
    V16 xl[R], xh[R];
    for (int r = 0; r < R; ++r) {
      xl[r] = load16(x + r * K + g * Q4_GROUP);
      xh[r] = load16(x + r * K + g * Q4_GROUP + 16);
    }
    for (int j = 0; j < NR; ++j) {
      const int64_t n = n0 + j;
      V16 lo, hi;
      unpack_q4(w + n * (K / 2) + g * (Q4_GROUP / 2), lo, hi);
      const float d = static_cast<float>(dm[(n * groups + g) * 2]);
      const float m = static_cast<float>(dm[(n * groups + g) * 2 + 1]);
      const V16 dv = V16::splat(d);
      for (int r = 0; r < R; ++r) {
        acc[r][j] = fma(dv, fma(hi, xh[r], mul(lo, xl[r])), acc[r][j]);
        macc[r][j] += m * xsum[r * groups + g];
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) out[r * out_stride + n0 + j] = hsum(acc[r][j]) + macc[r][j] + (bias ? bias[n0 + j] : 0.f);
}

template <int R>
void q4_rows(const float* x, const float* xsum, int64_t K, const uint8_t* w, const c10::Half* dm, int64_t n_begin,
             int64_t n_end, float* out, int64_t N, const float* bias) {
  for_column_tiles<R>(n_begin, n_end, [&](auto NR, int64_t n) { q4_tile<R, decltype(NR)::value>(x, xsum, K, w, dm, n, out, N, bias); });
}

void q4_range(const float* x, const float* xsum, int64_t rows, int64_t K, const uint8_t* w, const c10::Half* dm,
              int64_t n_begin, int64_t n_end, float* out, int64_t N, const float* bias) {
  const int64_t groups = K / Q4_GROUP;
  for_row_groups(rows, [&](auto R, int64_t r) { q4_rows<decltype(R)::value>(x + r * K, xsum + r * groups, K, w, dm, n_begin, n_end, out + r * N, N, bias); });
}


#if defined(__AVX512VNNI__)
// int8 weights times int8 activations with VNNI (vpdpbusd: 64 byte products a cycle instead of 16
// float multiplies). Activations are quantized per group of 64 (scale xs = max|x| / 127) and shifted
// to unsigned (+128), which adds 128 * (sum of the group's weights) to every group's dot product;
// the quantizer stores those sums next to each row's scale, so the kernel subtracts them exactly.
constexpr int64_t VNNI_GROUP = 64;
// The quantized kernels stream their weights from DRAM once per step; the hardware prefetcher alone
// left them at about half this machine's read bandwidth. Each tile asks for the same lines of the
// tile this many tiles further on, one line per weight load, so the requests are spread out.
constexpr int64_t WEIGHT_PREFETCH_TILES = 1;

// Per row and group of 64 inputs: xs = max|x| / 127, xu = round(x / xs) + 128 (unsigned for
// vpdpbusd). 16 lanes at a time, rows split across threads when there are many (at 64 rows the
// scalar loop was a third of the step).
void quantize_activations(const float* x, int64_t rows, int64_t K, uint8_t* xu, float* xs) {
  const int64_t groups = K / VNNI_GROUP;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = x + r * K + g * VNNI_GROUP;
        __m512 v[4];
        __m512 amax = _mm512_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm512_loadu_ps(src + 16 * i);
          amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
        }
        const float m = _mm512_reduce_max_ps(amax);
        const float scale = m > 0.f ? m / 127.f : 1.f;
        const __m512 inv = _mm512_set1_ps(1.f / scale);
        uint8_t* dst = xu + r * K + g * VNNI_GROUP;
        for (int i = 0; i < 4; ++i) {
          const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv)), _mm512_set1_epi32(128));  // round to nearest even
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * i), _mm512_cvtepi32_epi8(q));
        }
        xs[r * groups + g] = scale;
      }
  });
}

template <int R, int NR>
void vnni_tile(const uint8_t* xu, const float* xs, int64_t K, const int8_t* w, const float* scale, int64_t scale_stride,
               int64_t n0, float* out, int64_t out_stride, const float* bias) {
  const int64_t groups = K / VNNI_GROUP;
  V16 acc[R][NR];
  float corr[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) {
      acc[r][j] = V16::zero();
      corr[r][j] = 0.f;
    }
  for (int64_t g = 0; g < groups; ++g) {
    __m512i xv[R];
    V16 sv[R];
    for (int r = 0; r < R; ++r) {
      xv[r] = _mm512_loadu_si512(xu + r * K + g * VNNI_GROUP);
      sv[r] = V16::splat(xs[r * groups + g]);
    }
    for (int j = 0; j < NR; ++j) {
      __builtin_prefetch(w + (n0 + WEIGHT_PREFETCH_TILES * NR + j) * K + g * VNNI_GROUP);  // see WEIGHT_PREFETCH_TILES
      const __m512i wv = _mm512_loadu_si512(w + (n0 + j) * K + g * VNNI_GROUP);
      const float wsum = scale[(n0 + j) * scale_stride + 1 + g];
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), xv[r], wv);
        acc[r][j] = fma(V16{_mm512_cvtepi32_ps(dot)}, sv[r], acc[r][j]);
        corr[r][j] += xs[r * groups + g] * wsum;
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r)
      out[r * out_stride + n0 + j] =
          scale[(n0 + j) * scale_stride] * (hsum(acc[r][j]) - 128.f * corr[r][j]) + (bias ? bias[n0 + j] : 0.f);
}

template <int R>
void vnni_rows(const uint8_t* xu, const float* xs, int64_t K, const int8_t* w, const float* scale, int64_t scale_stride,
               int64_t n_begin, int64_t n_end, float* out, int64_t N, const float* bias) {
  for_column_tiles<R>(n_begin, n_end, [&](auto NR, int64_t n) { vnni_tile<R, decltype(NR)::value>(xu, xs, K, w, scale, scale_stride, n, out, N, bias); });
}

void vnni_range(const uint8_t* xu, const float* xs, int64_t rows, int64_t K, const int8_t* w, const float* scale,
                int64_t scale_stride, int64_t n_begin, int64_t n_end, float* out, int64_t N, const float* bias) {
  const int64_t groups = K / VNNI_GROUP;
  for_row_groups(rows, [&](auto R, int64_t r) { vnni_rows<decltype(R)::value>(xu + r * K, xs + r * groups, K, w, scale, scale_stride, n_begin, n_end, out + r * N, N, bias); });
}
// int8 weights packed for VNNI (``worker/quantization.py: pack_int8``): blocks of 16 output
// columns, [N / 16][K / 4][16][4], so one 64-byte load holds 4 consecutive inputs of 16 columns and
// feeds one vpdpbusd against those 4 activations broadcast; a tile of R rows and NB blocks keeps
// R * NB int32 accumulators for a group of 64 inputs, then folds them into float with the group's
// activation scale and the block's weight sums (the +128 shift): 3 instructions per group per
// accumulator instead of 3 per 64 products. The scales live beside each block, [N / 16][1 + K / 64][16]:
// the columns' scales, then each group's weight sums. One layout for every batch size; at large
// batches a panel of PANEL_BLOCKS blocks is reused from cache by every group of rows.
constexpr int64_t PANEL_BLOCKS = 4;

// Every accumulator of an R x NB tile set to `value` (zero, at a tile's or a group's start).
template <int R, int NB, typename T>
inline void fill_tile(T (&acc)[R][NB], T value) {
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = value;
}

template <int R, int NB>
void packed_tile(const uint8_t* xu, const float* xs, int64_t K, const int8_t* w, const float* meta, int64_t b0, float* out,
                 int64_t out_stride, const float* bias) {
  const int64_t G = K / VNNI_GROUP, block_bytes = K * 16, meta_block = (1 + G) * 16;
  __m512 facc[R][NB];
  fill_tile(facc, _mm512_setzero_ps());
  for (int64_t g = 0; g < G; ++g) {
    __m512i iacc[R][NB];
    fill_tile(iacc, _mm512_setzero_si512());
    for (int64_t k4 = g * 16; k4 < (g + 1) * 16; ++k4) {
      __m512i wv[NB];
      for (int b = 0; b < NB; ++b) {
        const int8_t* src = w + (b0 + b) * block_bytes + k4 * 64;
        __builtin_prefetch(src + WEIGHT_PREFETCH_TILES * NB * block_bytes);  // see WEIGHT_PREFETCH_TILES
        wv[b] = _mm512_loadu_si512(src);
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xu + r * K + k4 * 4, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int b = 0; b < NB; ++b) iacc[r][b] = _mm512_dpbusd_epi32(iacc[r][b], xb, wv[b]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 shift = _mm512_mul_ps(_mm512_loadu_ps(meta + (b0 + b) * meta_block + (1 + g) * 16), _mm512_set1_ps(128.f));
      for (int r = 0; r < R; ++r)
        facc[r][b] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * G + g]), _mm512_sub_ps(_mm512_cvtepi32_ps(iacc[r][b]), shift), facc[r][b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n = (b0 + b) * 16;
    const __m512 scale = _mm512_loadu_ps(meta + (b0 + b) * meta_block);
    const __m512 add = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride + n, _mm512_fmadd_ps(facc[r][b], scale, add));
  }
}

// The packed kernels' loop: panels of PANEL_BLOCKS blocks, each swept by every group of up to 4
// rows in tiles of NB blocks (then single blocks): calls f(integral_constant R, integral_constant
// NB, first row, first block). One or two rows take one block at a time: a block's weights are
// contiguous, so each thread reads one sequential stream; a batch-1 step took 0.83x (q4) and
// 0.89x (int8) the time it took with 4 interleaved blocks. From 3 rows, 2 blocks share the loads
// of the activations (at 8 rows 1 block was 1.05x slower).
template <typename F>
void for_block_tiles(int64_t rows, int64_t b_begin, int64_t b_end, F&& f) {
  for (int64_t p0 = b_begin; p0 < b_end; p0 += PANEL_BLOCKS) {
    const int64_t p1 = std::min(b_end, p0 + PANEL_BLOCKS);
    for_row_groups(rows, [&](auto R, int64_t r) {
      constexpr int NB = decltype(R)::value <= 2 ? 1 : 2;
      int64_t b = p0;
      for (; b + NB <= p1; b += NB) f(R, std::integral_constant<int, NB>{}, r, b);
      for (; b < p1; ++b) f(R, std::integral_constant<int, 1>{}, r, b);
    });
  }
}

void packed_range(const uint8_t* xu, const float* xs, int64_t rows, int64_t K, const int8_t* w, const float* meta,
                  int64_t b_begin, int64_t b_end, float* out, int64_t N, const float* bias) {
  const int64_t G = K / VNNI_GROUP;
  for_block_tiles(rows, b_begin, b_end, [&](auto R, auto NB, int64_t r, int64_t b) {
    packed_tile<decltype(R)::value, decltype(NB)::value>(xu + r * K, xs + r * G, K, w, meta, b, out + r * N, N, bias);
  });
}

// q4 weights packed for VNNI (``worker/quantization.py: pack_q4``): the int8 block layout at two
// weights a byte, [N / 16][K / 8][16][4]; byte i of a column's 4 holds input k + i in its low nibble
// and k + 4 + i in its high one, so one 64-byte load gives two vpdpbusd operands (a mask, a shift
// and a mask): 0.5 bytes a weight where int8 reads 1. The nibbles are unsigned, the activations
// signed int8 per group of 32 (xs = max|x| / 127, no +128 shift), so each group of 32 inputs folds
// its int32 dot products once: acc += d * xs * dot + m * sum(x), with the group's float16 scale d
// and minimum m read as one 64-byte line per block, [N / 16][K / 32][2][16].
void quantize_activations_s8(const float* x, int64_t rows, int64_t K, int8_t* xq, float* xs, float* xsum) {
  const int64_t groups = K / Q4_GROUP;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = x + r * K + g * Q4_GROUP;
        const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
        const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float scale = m > 0.f ? m / 127.f : 1.f;
        const __m512 inv = _mm512_set1_ps(1.f / scale);
        int8_t* dst = xq + r * K + g * Q4_GROUP;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
        xs[r * groups + g] = scale;
        xsum[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
      }
  });
}

template <int R, int NB>
void packed_q4_tile(const int8_t* xq, const float* xs, const float* xsum, int64_t K, const uint8_t* w, const c10::Half* meta,
                    int64_t b0, float* out, int64_t out_stride, const float* bias) {
  const int64_t G = K / Q4_GROUP, block_bytes = K * 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 facc[R][NB];
  fill_tile(facc, _mm512_setzero_ps());
  for (int64_t g = 0; g < G; ++g) {
    __m512i iacc[R][NB];
    fill_tile(iacc, _mm512_setzero_si512());
    for (int64_t k8 = g * 4; k8 < (g + 1) * 4; ++k8) {
      __m512i lo[NB], hi[NB];
      for (int b = 0; b < NB; ++b) {
        const uint8_t* src = w + (b0 + b) * block_bytes + k8 * 64;
        __builtin_prefetch(src + WEIGHT_PREFETCH_TILES * NB * block_bytes);  // see WEIGHT_PREFETCH_TILES
        const __m512i v = _mm512_loadu_si512(src);
        lo[b] = _mm512_and_si512(v, low);
        hi[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        int32_t four[2];
        std::memcpy(four, xq + r * K + k8 * 8, 8);
        const __m512i x0 = _mm512_set1_epi32(four[0]), x1 = _mm512_set1_epi32(four[1]);
        for (int b = 0; b < NB; ++b) iacc[r][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(iacc[r][b], lo[b], x0), hi[b], x1);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512i dm = _mm512_loadu_si512(meta + ((b0 + b) * G + g) * 32);
      const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm)), m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
      for (int r = 0; r < R; ++r) {
        const __m512 scaled = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][b]), _mm512_mul_ps(d, _mm512_set1_ps(xs[r * G + g])), facc[r][b]);
        facc[r][b] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * G + g]), scaled);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n = (b0 + b) * 16;
    const __m512 add = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride + n, _mm512_add_ps(facc[r][b], add));
  }
}

void packed_q4_range(const int8_t* xq, const float* xs, const float* xsum, int64_t rows, int64_t K, const uint8_t* w,
                     const c10::Half* meta, int64_t b_begin, int64_t b_end, float* out, int64_t N, const float* bias) {
  const int64_t G = K / Q4_GROUP;
  for_block_tiles(rows, b_begin, b_end, [&](auto R, auto NB, int64_t r, int64_t b) {
    packed_q4_tile<decltype(R)::value, decltype(NB)::value>(xq + r * K, xs + r * G, xsum + r * G, K, w, meta, b, out + r * N, N, bias);
  });
}
#endif

// The packed int8 layout without VNNI (other CPUs): plain loops, correct but slow.
void packed_reference(const float* x, int64_t rows, int64_t K, const int8_t* w, const float* meta, int64_t b_begin, int64_t b_end,
                      float* out, int64_t N, const float* bias) {
  const int64_t G = K / 64, meta_block = (1 + G) * 16;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = b_begin; b < b_end; ++b)
      for (int64_t c = 0; c < 16; ++c) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += x[r * K + k] * static_cast<float>(w[b * K * 16 + (k / 4) * 64 + c * 4 + k % 4]);
        out[r * N + b * 16 + c] = acc * meta[b * meta_block + c] + (bias ? bias[b * 16 + c] : 0.f);
      }
}

// The packed q4 layout without VNNI: plain loops over float activations, correct but slow.
void packed_q4_reference(const float* x, int64_t rows, int64_t K, const uint8_t* w, const c10::Half* meta, int64_t b_begin,
                         int64_t b_end, float* out, int64_t N, const float* bias) {
  const int64_t G = K / Q4_GROUP;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = b_begin; b < b_end; ++b)
      for (int64_t c = 0; c < 16; ++c) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) {
          const uint8_t byte = w[b * K * 8 + (k / 8) * 64 + c * 4 + k % 4];
          const int q = k % 8 < 4 ? byte & 0x0F : byte >> 4;
          const c10::Half* dm = meta + (b * G + k / Q4_GROUP) * 32;
          acc += x[r * K + k] * (static_cast<float>(dm[c]) * q + static_cast<float>(dm[16 + c]));
        }
        out[r * N + b * 16 + c] = acc + (bias ? bias[b * 16 + c] : 0.f);
      }
}

#if defined(__AVX512VNNI__)
// q4 weights with VNNI: the nibbles of two groups (64 weights, 32 bytes) widen to one vector of
// unsigned bytes [g0 q0-15 | g1 q0-15 | g0 q16-31 | g1 q16-31]; the activations, quantized to int8
// per 64 inputs, are laid out in that same order once per call, so vpdpbusd multiplies matching
// pairs and each 32-bit lane belongs to one group (lanes 0-3 and 8-11 to g0, 4-7 and 12-15 to g1).
// The minimum term m * sum(x) uses the float activations' group sums, exactly as in q4_tile: they
// are stored as (0, s0, 0, s1) per chunk, beside a row's scales and minimums (d0, m0, d1, m1), so
// one dot product of the two gives a row's whole minimum term.
void quantize_activations_q4(const float* x, int64_t rows, int64_t K, int8_t* xp, float* xs, float* xsum) {
  const int64_t chunks = K / VNNI_GROUP;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < chunks; ++c) {
      const float* src = x + r * K + c * VNNI_GROUP;
      float amax = 0.f, s0 = 0.f, s1 = 0.f;
      for (int64_t k = 0; k < VNNI_GROUP; ++k) amax = std::max(amax, std::fabs(src[k]));
      for (int64_t k = 0; k < 32; ++k) {
        s0 += src[k];
        s1 += src[32 + k];
      }
      const float scale = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / scale;
      int8_t* dst = xp + r * K + c * VNNI_GROUP;
      for (int64_t k = 0; k < 16; ++k) {
        dst[k] = static_cast<int8_t>(std::nearbyint(src[k] * inv));            // g0 q0-15
        dst[16 + k] = static_cast<int8_t>(std::nearbyint(src[32 + k] * inv));  // g1 q0-15
        dst[32 + k] = static_cast<int8_t>(std::nearbyint(src[16 + k] * inv));  // g0 q16-31
        dst[48 + k] = static_cast<int8_t>(std::nearbyint(src[48 + k] * inv));  // g1 q16-31
      }
      xs[r * chunks + c] = scale;
      float* sums = xsum + (r * chunks + c) * 4;
      sums[0] = 0.f, sums[1] = s0, sums[2] = 0.f, sums[3] = s1;
    }
}

// Per column tile: each row's float16 (d, m) pairs widened to float once (16 an instruction) into
// `dmf`; per chunk the nibbles unpack with one variable shift of the 32 bytes broadcast to both
// halves, and the two groups' scales come from one in-lane permute of that row's (d0, m0, d1, m1).
template <int R, int NR>
void q4_vnni_tile(const int8_t* xp, const float* xs, const float* xsum, int64_t K, const uint8_t* w, const c10::Half* dm,
                  int64_t n0, float* out, int64_t out_stride, const float* bias, float* dmf) {
  const int64_t chunks = K / VNNI_GROUP, per_row = chunks * 4;
  for (int j = 0; j < NR; ++j) {
    const c10::Half* src = dm + (n0 + j) * per_row;
    float* dst = dmf + j * per_row;
    for (int64_t i = 0; i < per_row; i += 16) {
      const __mmask16 mask = per_row - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (per_row - i)) - 1);
      _mm512_mask_storeu_ps(dst + i, mask, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, src + i)));
    }
  }
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);  // low nibbles, then high
  const __m512i pick_d = _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);       // d0 in lanes 0-3, 8-11
  V16 acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = V16::zero();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i xv[R];
    V16 sv[R];
    for (int r = 0; r < R; ++r) {
      xv[r] = _mm512_loadu_si512(xp + r * K + c * VNNI_GROUP);
      sv[r] = V16::splat(xs[r * chunks + c]);
    }
    for (int j = 0; j < NR; ++j) {
      const int64_t n = n0 + j;
      __builtin_prefetch(w + (n + WEIGHT_PREFETCH_TILES * NR) * (K / 2) + c * 32);  // see WEIGHT_PREFETCH_TILES
      const __m512i packed = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * (K / 2) + c * 32)));
      const __m512i q = _mm512_and_si512(_mm512_srlv_epi16(packed, shifts), low_mask);
      const __m512 dv = _mm512_permutevar_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(dmf + j * per_row + c * 4)), pick_d);
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv[r]);
        acc[r][j] = {_mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, sv[r].v), acc[r][j].v)};
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) {
      V16 mins = V16::zero();  // sum over chunks of m0 * s0 + m1 * s1
      for (int64_t i = 0; i < per_row; i += 16) {
        const __mmask16 mask = per_row - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (per_row - i)) - 1);
        mins = {_mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, dmf + j * per_row + i), _mm512_maskz_loadu_ps(mask, xsum + r * per_row + i), mins.v)};
      }
      out[r * out_stride + n0 + j] = hsum(acc[r][j]) + hsum(mins) + (bias ? bias[n0 + j] : 0.f);
    }
}

template <int R>
void q4_vnni_rows(const int8_t* xp, const float* xs, const float* xsum, int64_t K, const uint8_t* w, const c10::Half* dm,
                  int64_t n_begin, int64_t n_end, float* out, int64_t N, const float* bias) {
  std::vector<float> dmf(8 * (K / VNNI_GROUP) * 4);
  for_column_tiles<R>(n_begin, n_end, [&](auto NR, int64_t n) { q4_vnni_tile<R, decltype(NR)::value>(xp, xs, xsum, K, w, dm, n, out, N, bias, dmf.data()); });
}

void q4_vnni_range(const int8_t* xp, const float* xs, const float* xsum, int64_t rows, int64_t K, const uint8_t* w,
                   const c10::Half* dm, int64_t n_begin, int64_t n_end, float* out, int64_t N, const float* bias) {
  const int64_t chunks = K / VNNI_GROUP;
  for_row_groups(rows, [&](auto R, int64_t r) { q4_vnni_rows<decltype(R)::value>(xp + r * K, xs + r * chunks, xsum + r * chunks * 4, K, w, dm, n_begin, n_end, out + r * N, N, bias); });
}
#endif

// A projection's weights as the fused step sees them.
struct Weight {
  const void* data;
  at::ScalarType type;
  int64_t N, K;
  const float* scale;     // int8: per output row, then (when K % 64 == 0) each group of 64's weight sum
  int64_t scale_stride;   // floats per row in `scale`
  const c10::Half* dm;    // q4: [N, K / 32, 2] scale and minimum per group, else nullptr
  const float* bias;      // nullptr when none
  bool packed;            // int8 in the VNNI block layout (see packed_tile); `scale` is its [N / 16][1 + K / 64][16];
                          // q4 (uint8) in packed_q4_tile's, with `dm` its [N / 16][K / 32][2][16]
};

Weight as_weight(const Tensor& w, const c10::optional<Tensor>& scale, const c10::optional<Tensor>& bias) {
  if (w.dim() == 4 && w.scalar_type() == at::kByte) {  // packed q4: [N / 16, K / 8, 16, 4]
    TORCH_CHECK(w.is_contiguous() && w.size(2) == 16 && w.size(3) == 4 && w.size(1) % 4 == 0,
                "packed q4 weights must be contiguous [N / 16, K / 8, 16, 4] with K a multiple of 32");
    Weight out{w.data_ptr(), at::kByte, w.size(0) * 16, w.size(1) * 8, nullptr, 0, nullptr, nullptr, true};
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kHalf && scale->is_contiguous() &&
                    scale->numel() == w.size(0) * (out.K / Q4_GROUP) * 32,
                "packed q4 weights need float16 [N / 16, K / 32, 2, 16] scales and minimums");
    out.dm = static_cast<const c10::Half*>(scale->data_ptr());
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out.N, "bias must be float32 [N]");
      out.bias = bias->data_ptr<float>();
    }
    return out;
  }
  if (w.dim() == 4) {  // packed int8: [N / 16, K / 4, 16, 4]
    TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous() && w.size(2) == 16 && w.size(3) == 4 && w.size(1) % 16 == 0,
                "packed int8 weights must be contiguous [N / 16, K / 4, 16, 4] with K a multiple of 64");
    Weight out{w.data_ptr(), at::kChar, w.size(0) * 16, w.size(1) * 4, nullptr, 0, nullptr, nullptr, true};
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->numel() == w.size(0) * (1 + out.K / 64) * 16,
                "packed int8 weights need float32 [N / 16, 1 + K / 64, 16] scales and group sums");
    out.scale = scale->data_ptr<float>();
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out.N, "bias must be float32 [N]");
      out.bias = bias->data_ptr<float>();
    }
    return out;
  }
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weight must be a contiguous matrix");
  Weight out{w.data_ptr(), w.scalar_type(), w.size(0), w.size(1), nullptr, 1, nullptr, nullptr, false};
  if (w.scalar_type() == at::kByte) {  // q4: two weights a byte
    out.K = w.size(1) * 2;
    TORCH_CHECK(out.K % Q4_GROUP == 0, "q4 weights need inputs in groups of 32");
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kHalf && scale->numel() == out.N * (out.K / Q4_GROUP) * 2,
                "q4 weights need a float16 [N, K / 32, 2] scale-and-minimum tensor");
    out.dm = static_cast<const c10::Half*>(scale->data_ptr());
  } else if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->size(0) == w.size(0),
                "int8 weights need a float32 scale per output row");
    out.scale = scale->data_ptr<float>();
    out.scale_stride = scale->numel() / w.size(0);
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == w.size(0), "bias must be float32 [N]");
    out.bias = bias->data_ptr<float>();
  }
  return out;
}

// out [rows, N] = x [rows, K] @ w.T, split over output columns across threads.
void run_linear(const float* x, int64_t rows, const Weight& w, float* out) {
  const int64_t grain = std::max<int64_t>(16, w.N / (4 * at::get_num_threads()));
  if (w.packed && w.type == at::kByte) {
    const int64_t blocks = w.N / 16, block_grain = std::max<int64_t>(1, blocks / (4 * at::get_num_threads()));
    const uint8_t* data = static_cast<const uint8_t*>(w.data);
#if defined(__AVX512VNNI__)
    std::vector<int8_t> xq(rows * w.K);
    std::vector<float> xs(rows * (w.K / Q4_GROUP)), xsum(rows * (w.K / Q4_GROUP));
    quantize_activations_s8(x, rows, w.K, xq.data(), xs.data(), xsum.data());
    at::parallel_for(0, blocks, block_grain, [&](int64_t b0, int64_t b1) {
      packed_q4_range(xq.data(), xs.data(), xsum.data(), rows, w.K, data, w.dm, b0, b1, out, w.N, w.bias);
    });
#else
    at::parallel_for(0, blocks, block_grain, [&](int64_t b0, int64_t b1) { packed_q4_reference(x, rows, w.K, data, w.dm, b0, b1, out, w.N, w.bias); });
#endif
    return;
  }
  if (w.packed) {
    const int64_t blocks = w.N / 16, block_grain = std::max<int64_t>(1, blocks / (4 * at::get_num_threads()));
#if defined(__AVX512VNNI__)
    std::vector<uint8_t> xu(rows * w.K);
    std::vector<float> xs(rows * (w.K / VNNI_GROUP));
    quantize_activations(x, rows, w.K, xu.data(), xs.data());
    at::parallel_for(0, blocks, block_grain, [&](int64_t b0, int64_t b1) {
      packed_range(xu.data(), xs.data(), rows, w.K, static_cast<const int8_t*>(w.data), w.scale, b0, b1, out, w.N, w.bias);
    });
#else
    at::parallel_for(0, blocks, block_grain, [&](int64_t b0, int64_t b1) {
      packed_reference(x, rows, w.K, static_cast<const int8_t*>(w.data), w.scale, b0, b1, out, w.N, w.bias);
    });
#endif
    return;
  }
#if defined(__AVX512VNNI__)
  if (w.type == at::kChar && w.K % VNNI_GROUP == 0 && w.scale_stride == 1 + w.K / VNNI_GROUP) {
    std::vector<uint8_t> xu(rows * w.K);
    std::vector<float> xs(rows * (w.K / VNNI_GROUP));
    quantize_activations(x, rows, w.K, xu.data(), xs.data());
    at::parallel_for(0, w.N, grain, [&](int64_t n0, int64_t n1) {
      vnni_range(xu.data(), xs.data(), rows, w.K, static_cast<const int8_t*>(w.data), w.scale, w.scale_stride, n0, n1, out, w.N, w.bias);
    });
    return;
  }
#endif
#if defined(__AVX512VNNI__)
  if (w.type == at::kByte && w.K % VNNI_GROUP == 0) {
    std::vector<int8_t> xp(rows * w.K);
    std::vector<float> xs(rows * (w.K / VNNI_GROUP)), sums(rows * (w.K / VNNI_GROUP) * 4);
    quantize_activations_q4(x, rows, w.K, xp.data(), xs.data(), sums.data());
    at::parallel_for(0, w.N, grain, [&](int64_t n0, int64_t n1) {
      q4_vnni_range(xp.data(), xs.data(), sums.data(), rows, w.K, static_cast<const uint8_t*>(w.data), w.dm, n0, n1, out, w.N, w.bias);
    });
    return;
  }
#endif
  std::vector<float> xsum;
  if (w.type == at::kByte) {
    const int64_t groups = w.K / Q4_GROUP;
    xsum.resize(rows * groups);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        float t = 0.f;
        for (int64_t k = 0; k < Q4_GROUP; ++k) t += x[r * w.K + g * Q4_GROUP + k];
        xsum[r * groups + g] = t;
      }
  }
  at::parallel_for(0, w.N, grain, [&](int64_t n0, int64_t n1) {
    switch (w.type) {
      case at::kByte: q4_range(x, xsum.data(), rows, w.K, static_cast<const uint8_t*>(w.data), w.dm, n0, n1, out, w.N, w.bias); break;
      case at::kChar: linear_range(x, rows, w.K, static_cast<const int8_t*>(w.data), n0, n1, out, w.N, w.scale, w.scale_stride, w.bias); break;
      case at::kBFloat16: linear_range(x, rows, w.K, static_cast<const c10::BFloat16*>(w.data), n0, n1, out, w.N, w.scale, w.scale_stride, w.bias); break;
      case at::kHalf: linear_range(x, rows, w.K, static_cast<const c10::Half*>(w.data), n0, n1, out, w.N, w.scale, w.scale_stride, w.bias); break;
      case at::kFloat: linear_range(x, rows, w.K, static_cast<const float*>(w.data), n0, n1, out, w.N, w.scale, w.scale_stride, w.bias); break;
      default: TORCH_CHECK(false, "unsupported weight dtype");
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Paged decode attention (flash-decoding over context splits).
// ---------------------------------------------------------------------------------------------
struct AttnShape {
  int64_t rows, heads, kv_heads, head_dim, block_size, max_blocks, splits;
  float scale;
};

constexpr int MAX_GROUP = 16;   // query heads per KV head
constexpr int MAX_HEAD_DIM = 256;

// Online softmax over one tile of 16 positions for one head: the tile's dot products (lanes of
// `dots`, those from n on masked) update the running max `m` and sum `l` and rescale the head's
// accumulator; returns the tile's unnormalised weights.
inline V16 softmax_tile(const V16* dots, int64_t n, float& m, float& l, V16* acc, int64_t D16) {
  alignas(64) float scores[16];
  store16(scores, reduce16(dots));
  for (int64_t i = n; i < 16; ++i) scores[i] = NEG_INF;
  const V16 sv = load16(scores);
  const float new_m = std::max(m, hmax(sv));
  const float correction = std::exp(m - new_m);  // 0 on the first tile (m = -inf)
  const V16 p = exp16(sub(sv, V16::splat(new_m)));
  l = l * correction + hsum(p);
  m = new_m;
  if (correction != 1.f)
    for (int64_t d = 0; d < D16; ++d) acc[d] = mul(acc[d], V16::splat(correction));
  return p;
}

// One (row, context split) for every head: partial max, sum and unnormalised output per query head.
// All KV heads of a position are read together, so the cache is walked front to back once.
// `part` holds [heads][head_dim + 2] floats: acc..., max, sum.
template <typename C>
void attend_split(const float* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t begin, int64_t end,
                  const AttnShape& s, float* part) {
  const int64_t H = s.heads, KVH = s.kv_heads, G = H / KVH, D = s.head_dim, BS = s.block_size;
  const int64_t D16 = D / 16, slot_size = KVH * D;
  std::vector<V16> acc(H * D16, V16::zero()), qv(H * D16);
  std::vector<float> m(H, NEG_INF), l(H, 0.f);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < D16; ++d) qv[h * D16 + d] = mul(load16(q + h * D + d * 16), V16::splat(s.scale));
  alignas(64) float probs[MAX_GROUP][16];
  V16 keys[16][MAX_HEAD_DIM / 16];
  V16 dots[16];
  int64_t slots[16];
  for (int64_t t0 = begin; t0 < end; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, end - t0);
    int64_t block = t0 / BS, offset = t0 % BS;  // walk the blocks: no division per position
    for (int64_t i = 0; i < 16; ++i) {
      if (i < n) {  // a short tile repeats its last position, masked below
        slots[i] = table[block] * BS + offset;
        if (++offset == BS) offset = 0, ++block;
      } else {
        slots[i] = slots[n - 1];
      }
    }
    if (t0 + 16 < end) {  // ask for the next tile's block now: the hardware prefetcher alone left DRAM idle
      const int64_t next = table[(t0 + 16) / BS] * BS * slot_size;
      const int64_t bytes = BS * slot_size * static_cast<int64_t>(sizeof(C));
      const char* kp = reinterpret_cast<const char*>(k_cache + next);
      const char* vp = reinterpret_cast<const char*>(v_cache + next);
      for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(kp + b);
        __builtin_prefetch(vp + b);
      }
    }
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t d = 0; d < D16; ++d) keys[i][d] = load16(k_cache + slots[i] * slot_size + kvh * D + d * 16);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        const V16* qh = qv.data() + h * D16;
        for (int64_t i = 0; i < 16; ++i) {
          V16 dot = mul(qh[0], keys[i][0]);
          for (int64_t d = 1; d < D16; ++d) dot = fma(qh[d], keys[i][d], dot);
          dots[i] = dot;
        }
        store16(probs[g], softmax_tile(dots, n, m[h], l[h], acc.data() + h * D16, D16));
      }
      V16* acc_kv = acc.data() + kvh * G * D16;
      for (int64_t i = 0; i < n; ++i) {
        const C* v_row = v_cache + slots[i] * slot_size + kvh * D;
        for (int64_t d = 0; d < D16; ++d) {
          const V16 vd = load16(v_row + d * 16);
          for (int64_t g = 0; g < G; ++g) acc_kv[g * D16 + d] = fma(V16::splat(probs[g][i]), vd, acc_kv[g * D16 + d]);
        }
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* out = part + h * (D + 2);
    for (int64_t d = 0; d < D16; ++d) store16(out + d * 16, acc[h * D16 + d]);
    out[D] = m[h];
    out[D + 1] = l[h];
  }
}

#if defined(__AVX512BF16__)
constexpr int64_t PREFETCH_TILES = 1;  // how far ahead (in tiles of 16 positions) K and V rows are fetched

// The slots of positions [t, t + 16) (a short tile repeats its last position, masked by the caller).
inline int64_t tile_slots(const int64_t* table, int64_t t, int64_t end, int64_t BS, int64_t* slots) {
  const int64_t n = std::min<int64_t>(16, end - t);
  int64_t block = t / BS, offset = t % BS;  // walk the blocks: no division per position
  for (int64_t i = 0; i < 16; ++i) {
    if (i < n) {
      slots[i] = table[block] * BS + offset;
      if (++offset == BS) offset = 0, ++block;
    } else {
      slots[i] = slots[n - 1];
    }
  }
  return n;
}

// attend_split for bf16 caches (the default), where vdpbf16ps does 32 bf16 products an instruction.
// Per tile of 16 positions: the scores of every head from the K rows, then the V rows two positions
// at a time, their rows interleaved (unpack lo/hi of 16-bit elements) against the pair of their
// probabilities rounded to bf16, so no V element is widened to float. The unpacks permute d within
// each 32-wide chunk (vector 2c holds d = 32c + 8L + e, vector 2c + 1 holds d = 32c + 8L + 4 + e, at
// lane 4L + e); the output is put back in order at the end. The rows PREFETCH_TILES ahead are asked
// for while a tile computes, a few lines at a time: this loop is bound by memory latency otherwise
// (one burst per tile, or the hardware prefetcher alone, left it waiting on loads).
void attend_split_bf16(const float* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int64_t* table,
                       int64_t begin, int64_t end, const AttnShape& s, float* part) {
  using C = c10::BFloat16;
  const int64_t H = s.heads, KVH = s.kv_heads, G = H / KVH, D = s.head_dim, BS = s.block_size;
  const int64_t D16 = D / 16, D32 = D / 32, slot_size = KVH * D, row_bytes = slot_size * static_cast<int64_t>(sizeof(C));
  std::vector<V16> acc(H * D16, V16::zero());
  std::vector<__m512bh> qb(H * D32);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t c = 0; c < D32; ++c)
      qb[h * D32 + c] = _mm512_cvtne2ps_pbh(mul(load16(q + h * D + 32 * c + 16), V16::splat(s.scale)).v,
                                            mul(load16(q + h * D + 32 * c), V16::splat(s.scale)).v);
  std::vector<float> m(H, NEG_INF), l(H, 0.f);
  std::vector<uint32_t> prob_pairs(H * 8);
  V16 dots[16];
  int64_t slots[PREFETCH_TILES + 1][16];
  int64_t counts[PREFETCH_TILES + 1];
  for (int64_t k = 0; k <= PREFETCH_TILES; ++k) counts[k] = begin + 16 * k < end ? tile_slots(table, begin + 16 * k, end, BS, slots[k]) : 0;
  for (int64_t tile = 0, t0 = begin; t0 < end; ++tile, t0 += 16) {
    const int64_t* cur = slots[tile % (PREFETCH_TILES + 1)];
    const int64_t n = counts[tile % (PREFETCH_TILES + 1)];
    const int64_t* ahead = slots[(tile + PREFETCH_TILES) % (PREFETCH_TILES + 1)];
    const int64_t n_ahead = counts[(tile + PREFETCH_TILES) % (PREFETCH_TILES + 1)];
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        const __m512bh* qh = qb.data() + h * D32;
        for (int64_t i = 0; i < 16; ++i) {
          const C* k_row = k_cache + cur[i] * slot_size + kvh * D;
          __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[0], reinterpret_cast<__m512bh>(_mm512_loadu_si512(k_row)));
          for (int64_t c = 1; c < D32; ++c)
            dot = _mm512_dpbf16_ps(dot, qh[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(k_row + c * 32)));
          dots[i] = {dot};
        }
        const V16 p = softmax_tile(dots, n, m[h], l[h], acc.data() + h * D16, D16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob_pairs.data() + h * 8), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p.v)));
      }
    }
    for (int64_t i = 0; i < n; i += 2) {  // an odd tile's last pair borrows a masked position (probability 0)
      if (i < n_ahead) {
        for (int64_t j = i; j < std::min(i + 2, n_ahead); ++j) {
          const char* kp = reinterpret_cast<const char*>(k_cache + ahead[j] * slot_size);
          const char* vp = reinterpret_cast<const char*>(v_cache + ahead[j] * slot_size);
          for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(kp + b);
            __builtin_prefetch(vp + b);
          }
        }
      }
      const C* a = v_cache + cur[i] * slot_size;
      const C* b = v_cache + cur[i + 1] * slot_size;
      for (int64_t kvh = 0; kvh < KVH; ++kvh)
        for (int64_t c = 0; c < D32; ++c) {
          const __m512i va = _mm512_loadu_si512(a + kvh * D + c * 32), vb = _mm512_loadu_si512(b + kvh * D + c * 32);
          const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(va, vb));
          const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(va, vb));
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kvh * G + g;
            const __m512bh pg = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(prob_pairs[h * 8 + i / 2])));
            V16* ah = acc.data() + h * D16 + 2 * c;
            ah[0] = {_mm512_dpbf16_ps(ah[0].v, lo, pg)};
            ah[1] = {_mm512_dpbf16_ps(ah[1].v, hi, pg)};
          }
        }
    }
    const int64_t next = t0 + 16 * (PREFETCH_TILES + 1);  // this tile's buffer now takes the tile after the prefetched ones
    counts[tile % (PREFETCH_TILES + 1)] = next < end ? tile_slots(table, next, end, BS, slots[tile % (PREFETCH_TILES + 1)]) : 0;
  }
  alignas(64) float lanes[16];
  for (int64_t h = 0; h < H; ++h) {
    float* out = part + h * (D + 2);
    for (int64_t j = 0; j < D16; ++j) {
      store16(lanes, acc[h * D16 + j]);
      for (int64_t k = 0; k < 16; ++k) out[32 * (j / 2) + 8 * (k / 4) + 4 * (j % 2) + k % 4] = lanes[k];
    }
    out[D] = m[h];
    out[D + 1] = l[h];
  }
}
#endif

// The fewest context splits that give every thread as many (row, split) items as the others: a
// thread streams long runs of the cache best (a lone row on 2 threads: 2 splits took 0.95-0.99x the
// step time of 8), and equal shares keep any thread from waiting. From 4 rows a thread on, rows are
// not split (evening out one row more took 1.02-1.05x at 33 rows). At least 8 blocks a split.
int64_t pick_splits(int64_t rows, int64_t max_len, int64_t block_size) {
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = rows >= 4 * threads ? 1 : threads / std::gcd(rows, threads);
  const int64_t most = std::max<int64_t>(1, max_len / (8 * block_size));
  return std::max<int64_t>(1, std::min(wanted, most));
}

// q [rows, heads, D] float32 -> out [rows, heads, D] float32.
template <typename C>
void decode_attention(const float* q, const C* k_cache, const C* v_cache, const int64_t* tables, const int64_t* lengths,
                      const AttnShape& s, float* out) {
  const int64_t H = s.heads, D = s.head_dim;
  const int64_t part_size = H * (D + 2);
  std::vector<float> parts(s.rows * s.splits * part_size);
  at::parallel_for(0, s.rows * s.splits, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t split = item % s.splits, row = item / s.splits;
      const int64_t len = lengths[row];
      const int64_t chunk = ((len + s.splits - 1) / s.splits + s.block_size - 1) / s.block_size * s.block_size;
      const int64_t begin = std::min(len, split * chunk), end = std::min(len, begin + chunk);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<C, c10::BFloat16>) {
        if (D % 32 == 0) {
          attend_split_bf16(q + row * H * D, k_cache, v_cache, tables + row * s.max_blocks, begin, end, s, parts.data() + item * part_size);
          continue;
        }
      }
#endif
      attend_split(q + row * H * D, k_cache, v_cache, tables + row * s.max_blocks, begin, end, s, parts.data() + item * part_size);
    }
  });
  for (int64_t row = 0; row < s.rows; ++row) {
    const float* base = parts.data() + row * s.splits * part_size;
    for (int64_t h = 0; h < H; ++h) {
      float M = NEG_INF;
      for (int64_t sp = 0; sp < s.splits; ++sp) M = std::max(M, base[sp * part_size + h * (D + 2) + D]);
      float* o = out + (row * H + h) * D;
      std::fill(o, o + D, 0.f);
      float L = 0.f;
      for (int64_t sp = 0; sp < s.splits; ++sp) {
        const float* p = base + sp * part_size + h * (D + 2);
        if (p[D + 1] == 0.f) continue;
        const float w = std::exp(p[D] - M);
        L += p[D + 1] * w;
        for (int64_t d = 0; d < D; ++d) o[d] += p[d] * w;
      }
      const float inv = L > 0.f ? 1.f / L : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

template <typename F>
void dispatch_cache(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kFloat: f(float{}); break;
    default: TORCH_CHECK(false, "unsupported KV cache dtype");
  }
}

AttnShape attn_shape(const Tensor& k_cache, const Tensor& tables, int64_t rows, int64_t heads, int64_t max_len, double scale) {
  AttnShape s{rows, heads, k_cache.size(2), k_cache.size(3), k_cache.size(1), tables.size(1), 1, static_cast<float>(scale)};
  TORCH_CHECK(heads % s.kv_heads == 0 && heads / s.kv_heads <= MAX_GROUP, "unsupported head grouping");
  TORCH_CHECK(s.head_dim % 16 == 0 && s.head_dim <= MAX_HEAD_DIM, "head_dim must be a multiple of 16, at most 256");
  s.splits = pick_splits(rows, max_len, s.block_size);
  return s;
}

void check_tables(const Tensor& tables, const Tensor& lengths, int64_t rows) {
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.size(0) == rows, "block tables: int64 [rows, max_blocks]");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.numel() == rows, "lengths: int64 [rows]");
}

// ---------------------------------------------------------------------------------------------
// Registered ops
// ---------------------------------------------------------------------------------------------
Tensor paged_decode_attention(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                              const Tensor& lengths, int64_t max_len, double scale) {
  const int64_t rows = query.size(0), heads = query.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(), "caches");
  check_tables(block_tables, lengths, rows);
  const AttnShape s = attn_shape(k_cache, block_tables, rows, heads, max_len, scale);
  TORCH_CHECK(query.size(2) == s.head_dim, "query head_dim");
  Tensor q = query.to(at::kFloat).contiguous();
  Tensor out = at::empty({rows, heads, s.head_dim}, q.options());
  dispatch_cache(k_cache.scalar_type(), [&](auto tag) {
    using C = decltype(tag);
    decode_attention(q.data_ptr<float>(), static_cast<const C*>(k_cache.data_ptr()), static_cast<const C*>(v_cache.data_ptr()),
                     block_tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), s, out.data_ptr<float>());
  });
  return out.to(query.scalar_type());
}

// Temperature sampling of each row of float32 logits at its uniform number: the first token whose
// cumulative e^((x - max) / T) exceeds u times the total (the inverse CDF the torch sampler uses,
// sums in double as torch's cumsum does). Three passes over a row in one call instead of about
// ten torch ops (0.4-0.6 ms a batch-1 step in the worker; this is tens of microseconds).
Tensor sample_temperature(const Tensor& logits, const Tensor& temperature, const Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(), "logits: contiguous float32 [rows, vocab]");
  const int64_t rows = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == rows, "temperature: float32 [rows]");
  TORCH_CHECK(uniform.scalar_type() == at::kFloat && uniform.numel() == rows, "uniform: float32 [rows]");
  Tensor t = temperature.contiguous(), u = uniform.contiguous();
  Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float *tp = t.data_ptr<float>(), *up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    const int64_t blocks = (V + 15) / 16;
    std::vector<float> probs(blocks * 16, 0.f);
    std::vector<double> block_sums(blocks);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = lp + r * V;
      V16 mv = V16::splat(NEG_INF);
      int64_t i = 0;
      for (; i + 16 <= V; i += 16) mv = vmax(mv, load16(x + i));
      float m = hmax(mv);
      for (; i < V; ++i) m = std::max(m, x[i]);
      const float inv_t = 1.f / tp[r];
      for (i = 0; i + 16 <= V; i += 16) store16(probs.data() + i, exp16(mul(sub(load16(x + i), V16::splat(m)), V16::splat(inv_t))));
      for (; i < V; ++i) probs[i] = std::exp((x[i] - m) * inv_t);
      // Sums per block of 16, then the block where u * total falls, then the token within it.
      double total = 0.0;
      for (int64_t blk = 0; blk < blocks; ++blk) total += block_sums[blk] = hsum(load16(probs.data() + blk * 16));
      const double target = static_cast<double>(up[r]) * total;
      double running = 0.0;
      int64_t blk = 0;
      while (blk + 1 < blocks && running + block_sums[blk] <= target) running += block_sums[blk++];
      int64_t pick = -1;
      for (int64_t j = blk * 16; j < std::min(V, blk * 16 + 16); ++j) {
        if (probs[j] <= 0.f) continue;
        pick = j;  // rounding may leave the walk short of the target: then the block's last token
        running += probs[j];
        if (running > target) break;
      }
      for (int64_t j = V - 1; pick < 0 && j >= 0; --j)  // a block without probability (only when all are 0)
        if (probs[j] > 0.f) pick = j;
      op[r] = std::max<int64_t>(pick, 0);
    }
  });
  return out;
}

Tensor linear(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& scale, const c10::optional<Tensor>& bias) {
  Tensor xf = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  const Weight w = as_weight(weight, scale, bias);
  TORCH_CHECK(xf.size(1) == w.K, "linear: input features do not match the weight");
  Tensor out = at::empty({xf.size(0), w.N}, xf.options());
  run_linear(xf.data_ptr<float>(), xf.size(0), w, out.data_ptr<float>());
  auto shape = x.sizes().vec();
  shape.back() = w.N;
  return out.view(shape);
}

void rms_norm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * H;
      V16 ss = V16::zero();
      int64_t i = 0;
      for (; i + 16 <= H; i += 16) {
        const V16 v = load16(xr + i);
        ss = fma(v, v, ss);
      }
      double total = hsum(ss);
      for (; i < H; ++i) total += static_cast<double>(xr[i]) * xr[i];
      const float inv = 1.f / std::sqrt(static_cast<float>(total / H) + eps);
      for (int64_t j = 0; j < H; ++j) out[r * H + j] = xr[j] * inv * weight[j];
    }
  });
}

// a = silu(g) * u = g / (1 + e^-g) * u, 16 at a time: a libm exp per element was ~0.7 ms of a
// batch-1 step (46k calls) and grew with every row.
void silu_mul(const float* g, const float* u, float* a, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const V16 x = load16(g + i);
    const V16 e = exp16(sub(V16::zero(), x));
#if defined(__AVX512F__)
    store16(a + i, mul(V16{_mm512_div_ps(x.v, _mm512_add_ps(_mm512_set1_ps(1.f), e.v))}, load16(u + i)));
#else
    for (int j = 0; j < 16; ++j) a[i + j] = x.v[j] / (1.f + e.v[j]) * u[i + j];
#endif
  }
  for (; i < n; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// rotate_half rotary embedding of `n_heads` heads of one row, in place.
void rotary(float* x, int64_t n_heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// A whole decode step of a Llama-family model for `rows` single-token rows. Per layer the lists hold
// the fused weights as worker/llama.py builds them: input norm, QKV (+ scale, + bias), output
// projection, post-attention norm, gate/up, down. `hidden` [rows, H] (embeddings) -> final-normed
// hidden [rows, H] float32; the layers' new keys and values land in the caches at `slots`.
Tensor llama_decode(const Tensor& hidden, const Tensor& cos, const Tensor& sin, at::TensorList input_norms,
                    at::TensorList qkv, at::TensorList qkv_scale, at::TensorList qkv_bias, at::TensorList o_proj,
                    at::TensorList o_scale, at::TensorList post_norms, at::TensorList gate_up, at::TensorList gate_up_scale,
                    at::TensorList down, at::TensorList down_scale, const Tensor& final_norm, at::TensorList k_caches,
                    at::TensorList v_caches, const Tensor& slots, const Tensor& block_tables, const Tensor& lengths,
                    int64_t max_len, int64_t heads, int64_t kv_heads, double eps, double scale) {
  const int64_t rows = hidden.size(0), H = hidden.size(1), layers = static_cast<int64_t>(qkv.size());
  const int64_t D = k_caches[0].size(3);
  const int64_t q_size = heads * D, kv_size = kv_heads * D;
  check_tables(block_tables, lengths, rows);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == rows, "slots: int64 [rows]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.size(0) == rows && cos.size(1) == D, "cos: float32 [rows, head_dim]");
  const AttnShape s = attn_shape(k_caches[0], block_tables, rows, heads, max_len, scale);
  auto opt = hidden.options().dtype(at::kFloat);
  Tensor h = hidden.to(at::kFloat).contiguous().clone();
  Tensor x = at::empty({rows, H}, opt);
  Tensor qkv_out = at::empty({rows, q_size + 2 * kv_size}, opt);
  Tensor q = at::empty({rows, q_size}, opt);
  Tensor attn = at::empty({rows, q_size}, opt);
  auto opt_at = [](at::TensorList list, int64_t i) -> c10::optional<Tensor> {
    return list.empty() ? c10::optional<Tensor>() : c10::optional<Tensor>(list[i]);
  };
  const int64_t inter2 = as_weight(gate_up[0], opt_at(gate_up_scale, 0), {}).N, inter = inter2 / 2;
  Tensor gu = at::empty({rows, inter2}, opt);
  Tensor act = at::empty({rows, inter}, opt);
  Tensor delta = at::empty({rows, H}, opt);
  float *hp = h.data_ptr<float>(), *xp = x.data_ptr<float>(), *qkvp = qkv_out.data_ptr<float>(), *qp = q.data_ptr<float>();
  float *ap = attn.data_ptr<float>(), *gup = gu.data_ptr<float>(), *actp = act.data_ptr<float>(), *dp = delta.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float feps = static_cast<float>(eps);
  for (int64_t layer = 0; layer < layers; ++layer) {
    // Every projection's shape is checked against the buffers it writes before anything runs.
    const Weight w_qkv = as_weight(qkv[layer], opt_at(qkv_scale, layer), opt_at(qkv_bias, layer));
    const Weight w_o = as_weight(o_proj[layer], opt_at(o_scale, layer), {});
    const Weight w_gate_up = as_weight(gate_up[layer], opt_at(gate_up_scale, layer), {});
    const Weight w_down = as_weight(down[layer], opt_at(down_scale, layer), {});
    TORCH_CHECK(w_qkv.N == q_size + 2 * kv_size && w_qkv.K == H && w_o.N == H && w_o.K == q_size && w_gate_up.N == inter2 &&
                    w_gate_up.K == H && w_down.N == H && w_down.K == inter,
                "layer ", layer, ": projection shapes do not match the model's sizes");
    rms_norm_rows(hp, input_norms[layer].data_ptr<float>(), xp, rows, H, feps);
    run_linear(xp, rows, w_qkv, qkvp);
    const Tensor& kc = k_caches[layer];
    const Tensor& vc = v_caches[layer];
    dispatch_cache(kc.scalar_type(), [&](auto tag) {
      using C = decltype(tag);
      C* kcache = static_cast<C*>(kc.data_ptr());
      C* vcache = static_cast<C*>(vc.data_ptr());
      for (int64_t r = 0; r < rows; ++r) {
        float* row = qkvp + r * (q_size + 2 * kv_size);
        rotary(row, heads, D, cp + r * D, sp + r * D);
        rotary(row + q_size, kv_heads, D, cp + r * D, sp + r * D);
        std::memcpy(qp + r * q_size, row, q_size * sizeof(float));
        C* kdst = kcache + slot[r] * kv_size;
        C* vdst = vcache + slot[r] * kv_size;
        for (int64_t i = 0; i < kv_size; ++i) {
          kdst[i] = from_float<C>(row[q_size + i]);
          vdst[i] = from_float<C>(row[q_size + kv_size + i]);
        }
      }
      decode_attention(qp, static_cast<const C*>(kcache), static_cast<const C*>(vcache), block_tables.data_ptr<int64_t>(),
                       lengths.data_ptr<int64_t>(), s, ap);
    });
    run_linear(ap, rows, w_o, dp);
    for (int64_t i = 0; i < rows * H; ++i) hp[i] += dp[i];
    rms_norm_rows(hp, post_norms[layer].data_ptr<float>(), xp, rows, H, feps);
    run_linear(xp, rows, w_gate_up, gup);
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = gup + r * inter2;
      const float* u = g + inter;
      float* a = actp + r * inter;
      silu_mul(g, u, a, inter);
    }
    run_linear(actp, rows, w_down, dp);
    for (int64_t i = 0; i < rows * H; ++i) hp[i] += dp[i];
  }
  rms_norm_rows(hp, final_norm.data_ptr<float>(), xp, rows, H, feps);
  return x;
}

// Whether the int8 VNNI kernels were compiled in (the packed int8 layout is only worth using then).
bool has_vnni() {
#if defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(llmpool, m) {
  m.def("has_vnni() -> bool", &has_vnni);
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lengths, int max_len, float scale) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("sample_temperature(Tensor logits, Tensor temperature, Tensor uniform) -> Tensor");
  m.def(
      "llama_decode(Tensor hidden, Tensor cos, Tensor sin, Tensor[] input_norms, Tensor[] qkv, Tensor[] qkv_scale, "
      "Tensor[] qkv_bias, Tensor[] o_proj, Tensor[] o_scale, Tensor[] post_norms, Tensor[] gate_up, Tensor[] gate_up_scale, "
      "Tensor[] down, Tensor[] down_scale, Tensor final_norm, Tensor[] k_caches, Tensor[] v_caches, Tensor slots, "
      "Tensor block_tables, Tensor lengths, int max_len, int heads, int kv_heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmpool, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("linear", &linear);
  m.impl("sample_temperature", &sample_temperature);
  m.impl("llama_decode", &llama_decode);
}
