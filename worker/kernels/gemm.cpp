// Projections for the decode path, registered as the `linear` op and used by the fused decode
// step: int8 or q4 weights packed for an int8 GEMM (any number of rows; packed.cpp), or row-major
// int8 / q4 / bf16 / fp16 / fp32 weights in matrix-vector loops for a handful of rows.

#include "gemm.h"

#include "ops.h"

namespace llmpool {

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

#if defined(__AVX512F__)
inline void unpack_q4(const uint8_t* p, V16& lo, V16& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)))};
  hi = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)))};
}
#else
inline void unpack_q4(const uint8_t* p, V16& lo, V16& hi) {
  alignas(64) float l[16], h[16];
  for (int i = 0; i < 16; ++i) {
    l[i] = static_cast<float>(p[i] & 0x0F);
    h[i] = static_cast<float>(p[i] >> 4);
  }
  lo = load16(l);
  hi = load16(h);
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
// to unsigned (+128, quantize_activations in packed.cpp), which adds 128 * (sum of the group's
// weights) to every group's dot product; the quantizer stores those sums next to each row's scale,
// so the kernel subtracts them exactly. Row-major int8 and q4 weights (shapes the packers cannot
// block) use these on the avx512 variant and the float loops above elsewhere.

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
#endif

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
  if (w.packed) {  // packed.cpp, on every variant
    run_packed(x, rows, w, out);
    return;
  }
#if defined(__AVX512VNNI__)
  if (w.type == at::kChar && w.K % VNNI_GROUP == 0 && w.scale_stride == 1 + w.K / VNNI_GROUP) {
    std::vector<int8_t> xq(rows * w.K);
    std::vector<float> xs(rows * (w.K / VNNI_GROUP));
    quantize_activations(x, rows, w.K, xq.data(), xs.data());
    const uint8_t* xu = reinterpret_cast<const uint8_t*>(xq.data());  // shifted: unsigned bytes
    at::parallel_for(0, w.N, grain, [&](int64_t n0, int64_t n1) {
      vnni_range(xu, xs.data(), rows, w.K, static_cast<const int8_t*>(w.data), w.scale, w.scale_stride, n0, n1, out, w.N, w.bias);
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

#define LLMPOOL_STR2(x) #x
#define LLMPOOL_STR(x) LLMPOOL_STR2(x)
// The variant these kernels were compiled as (worker/kernels/variants.py), for logs and checks.
std::string variant() { return LLMPOOL_STR(LLMPOOL_VARIANT); }

}  // namespace llmpool
