// The packed int8 and q4 GEMMs of the decode step, written once over the variant's int8 dot
// products (isa_*.h: vpdpbusd on avx512, vpmaddubsw on avx2, sdot on neon, loops on portable; on
// neon_i8mm smmla for rows two at a time, pair_sums). The integer sums are exact and the float
// folds run lane by lane in the same order on every variant, so their outputs agree wherever the
// float operations are fused alike (every variant but portable on x86).

#include "gemm.h"

namespace llmpool {

// Per row and group of `group` inputs: xs = max|x| / 127, xq = round(x / xs) (+ `shift` as unsigned
// bytes: int8 weights' ACTIVATION_SHIFT; q4's nibbles are the unsigned side, its activations stay
// signed), and optionally the group's float sum.
// Rows split across threads when there are many (at 64 rows the scalar loop was a third of the step).
template <int64_t group, int shift>
void quantize_groups(const float* x, int64_t rows, int64_t K, int8_t* xq, float* xs, float* xsum) {
  constexpr int parts = group / 16;
  const int64_t groups = K / group;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = x + r * K + g * group;
        V16 v[parts];
        V16 amax = V16::zero();
        for (int i = 0; i < parts; ++i) {
          v[i] = load16(src + 16 * i);
          amax = vmax(amax, vabs(v[i]));
        }
        const float m = hmax(amax);
        const float scale = m > 0.f ? m / 127.f : 1.f;
        const V16 inv = V16::splat(1.f / scale);
        int8_t* dst = xq + r * K + g * group;
        for (int i = 0; i < parts; ++i) store_i8(dst + 16 * i, mul(v[i], inv));
        if constexpr (shift != 0)
          for (int64_t i = 0; i < group; ++i) dst[i] = static_cast<int8_t>(dst[i] ^ 0x80);  // + 128 as unsigned
        xs[r * groups + g] = scale;
        if (xsum) {
          V16 total = v[0];
          for (int i = 1; i < parts; ++i) total = add(total, v[i]);
          xsum[r * groups + g] = hsum(total);
        }
      }
  });
}

// Every accumulator of an R x NB tile set to `value` (zero, at a tile's or a group's start).
template <int R, int NB, typename T>
inline void fill_tile(T (&acc)[R][NB], T value) {
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = value;
}

// One group's int32 sums (64 int8 inputs, 32 q4 ones) of a tile's rows from `first` on into iacc,
// one row at a time: each 64-byte step of a block's weights (4 int8 inputs, or 8 as q4 nibbles, of
// 16 columns) against each row's 4 or 8 activations (dot_s8, dot_q4). xq: the group's first
// activation of row 0; w: its first weight byte of the tile's first block.
template <int first, int R, int NB, typename W, typename A>
inline void row_sums(const int8_t* xq, int64_t K, const W* w, int64_t block_bytes, A (&iacc)[R][NB]) {
  constexpr bool q4 = std::is_same_v<W, uint8_t>;
  constexpr int64_t inputs = q4 ? 8 : 4, steps = (q4 ? Q4_GROUP : VNNI_GROUP) / inputs;
#pragma GCC unroll 1  // as the loop was before its trip count was a constant (q4's 4 steps unrolled at 1-2 rows)
  for (int64_t k = 0; k < steps; ++k) {
    std::conditional_t<q4, Q4W, S8W> wv[NB];
    for (int b = 0; b < NB; ++b) {
      const W* src = w + b * block_bytes + k * 64;
      __builtin_prefetch(src + WEIGHT_PREFETCH_TILES * NB * block_bytes);  // see WEIGHT_PREFETCH_TILES
      if constexpr (q4) wv[b] = load_q4w(src);
      else wv[b] = load_s8w(src);
    }
    for (int r = first; r < R; ++r) {
      int32_t four[2];
      std::memcpy(four, xq + r * K + k * inputs, inputs);
      for (int b = 0; b < NB; ++b) {
        if constexpr (q4) iacc[r][b] = dot_q4(iacc[r][b], wv[b], four[0], four[1]);
        else iacc[r][b] = dot_s8(iacc[r][b], wv[b], four[0]);
      }
    }
  }
}

// Rows taken two at a time by the variant's row-pair products (isa_neon.h with i8mm: smmla), the
// rest one at a time by dot_s8 / dot_q4: PAIRED<R> of a tile's R rows (0 on every other variant).
#if defined(LLMPOOL_ROW_PAIRS)
template <int R>
constexpr int PAIRED = R / 2 * 2;

// One group's int32 sums (64 int8 inputs, 32 q4 ones) of a tile's paired rows into iacc, the same
// sums dot_s8 / dot_q4 give: 8 inputs a step (two int8 steps of the layout, one q4 step), the
// block's weights zipped once for both pairs. xq: the group's first activation of row 0; w: the
// block's first weight byte of the group. One block (TILE_BLOCKS is 1 with row pairs) and named
// accumulators: GCC 12 kept an array of them in memory (every accumulator loaded and stored each step).
template <int R, int NB, typename W, typename A>
inline void pair_sums(const int8_t* xq, int64_t K, const W* w, int64_t block_bytes, A (&iacc)[R][NB]) {
  static_assert(NB == 1 && R >= 2 && R <= 4, "one block of one or two row pairs");
  constexpr bool q4 = std::is_same_v<W, uint8_t>;
  constexpr int64_t steps = q4 ? Q4_GROUP / 8 : VNNI_GROUP / 8, step_bytes = q4 ? 64 : 128;
  PairAcc rows01 = pair_zero(), rows23 = pair_zero();
#pragma GCC unroll 1  // q4's 4 steps unrolled spilled a third of the registers (i8mm, 4 rows)
  for (int64_t s = 0; s < steps; ++s) {
    const W* src = w + s * step_bytes;
    for (int64_t line = 0; line < step_bytes; line += 64)
      __builtin_prefetch(src + line + WEIGHT_PREFETCH_TILES * NB * block_bytes);  // see WEIGHT_PREFETCH_TILES
    const PairW wv = load_pairw(src);
    rows01 = dot_pair(rows01, wv, xq + s * 8, xq + K + s * 8);
    if constexpr (R == 4) rows23 = dot_pair(rows23, wv, xq + 2 * K + s * 8, xq + 3 * K + s * 8);
  }
  pair_rows(rows01, iacc[0][0], iacc[1][0]);
  if constexpr (R == 4) pair_rows(rows23, iacc[2][0], iacc[3][0]);
}
#else
template <int R>
constexpr int PAIRED = 0;
template <int R, int NB, typename W, typename A>
inline void pair_sums(const int8_t*, int64_t, const W*, int64_t, A (&)[R][NB]) {}
#endif

// int8 weights packed (``worker/quantization.py: pack_int8``): blocks of 16 output columns,
// [N / 16][K / 4][16][4], so 64 bytes hold 4 consecutive inputs of 16 columns and feed one dot
// product against those 4 activations broadcast; a tile of R rows and NB blocks keeps R * NB int32
// accumulators for a group of 64 inputs, then folds them into float with the group's activation
// scale (and, where activations are shifted, the block's weight sums): 3 operations per group per
// accumulator instead of 3 per 64 products. The scales live beside each block, [N / 16][1 + K / 64][16]:
// the columns' scales, then each group's weight sums. One layout for every batch size; at large
// batches a panel of PANEL_BLOCKS blocks is reused from cache by every group of rows.
constexpr int64_t PANEL_BLOCKS = 4;

template <int R, int NB>
void packed_tile(const int8_t* xq, const float* xs, int64_t K, const int8_t* w, const float* meta, int64_t b0, float* out,
                 int64_t out_stride, const float* bias) {
  const int64_t G = K / VNNI_GROUP, block_bytes = K * 16, meta_block = (1 + G) * 16;
  V16 facc[R][NB];
  fill_tile(facc, V16::zero());
  for (int64_t g = 0; g < G; ++g) {
    Acc16 iacc[R][NB];
    fill_tile(iacc, acc_zero());
    const int8_t* wg = w + b0 * block_bytes + g * 16 * 64;
    if constexpr (PAIRED<R> > 0) pair_sums(xq + g * VNNI_GROUP, K, wg, block_bytes, iacc);
    if constexpr (PAIRED<R> < R) row_sums<PAIRED<R>>(xq + g * VNNI_GROUP, K, wg, block_bytes, iacc);
    for (int b = 0; b < NB; ++b) {
      const V16 shift = ACTIVATION_SHIFT ? mul(load16(meta + (b0 + b) * meta_block + (1 + g) * 16), V16::splat(ACTIVATION_SHIFT))
                                         : V16::zero();
      for (int r = 0; r < R; ++r) facc[r][b] = fma(V16::splat(xs[r * G + g]), sub(acc_float(iacc[r][b]), shift), facc[r][b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n = (b0 + b) * 16;
    const V16 scale = load16(meta + (b0 + b) * meta_block);
    const V16 bias_v = bias ? load16(bias + n) : V16::zero();
    for (int r = 0; r < R; ++r) store16(out + r * out_stride + n, fma(facc[r][b], scale, bias_v));
  }
}

// The packed kernels' loop: panels of PANEL_BLOCKS blocks, each swept by every group of up to 4
// rows in tiles of NB blocks (then single blocks): calls f(integral_constant R, integral_constant
// NB, first row, first block). One or two rows take one block at a time: a block's weights are
// contiguous, so each thread reads one sequential stream; a batch-1 step took 0.83x (q4) and
// 0.89x (int8) the time it took with 4 interleaved blocks. From 3 rows, TILE_BLOCKS blocks share the
// loads of the activations (avx512: 2; at 8 rows 1 block was 1.05x slower; avx2's 16 registers
// hold one block's tile).
template <typename F>
void for_block_tiles(int64_t rows, int64_t b_begin, int64_t b_end, F&& f) {
  for (int64_t p0 = b_begin; p0 < b_end; p0 += PANEL_BLOCKS) {
    const int64_t p1 = std::min(b_end, p0 + PANEL_BLOCKS);
    for_row_groups(rows, [&](auto R, int64_t r) {
      constexpr int NB = decltype(R)::value <= 2 ? 1 : TILE_BLOCKS;
      int64_t b = p0;
      for (; b + NB <= p1; b += NB) f(R, std::integral_constant<int, NB>{}, r, b);
      for (; b < p1; ++b) f(R, std::integral_constant<int, 1>{}, r, b);
    });
  }
}

// q4 weights packed (``worker/quantization.py: pack_q4``): the int8 block layout at two weights a
// byte, [N / 16][K / 8][16][4]; byte i of a column's 4 holds input k + i in its low nibble and
// k + 4 + i in its high one, so one 64-byte load gives two dot-product operands (a mask, a shift
// and a mask): 0.5 bytes a weight where int8 reads 1. The nibbles are unsigned, the activations
// signed int8 per group of 32 (xs = max|x| / 127, no shift), so each group of 32 inputs folds its
// int32 dot products once: acc += d * xs * dot + m * sum(x), with the group's float16 scale d and
// minimum m read as one 64-byte line per block, [N / 16][K / 32][2][16].
template <int R, int NB>
void packed_q4_tile(const int8_t* xq, const float* xs, const float* xsum, int64_t K, const uint8_t* w, const c10::Half* meta,
                    int64_t b0, float* out, int64_t out_stride, const float* bias) {
  const int64_t G = K / Q4_GROUP, block_bytes = K * 8;
  V16 facc[R][NB];
  fill_tile(facc, V16::zero());
  for (int64_t g = 0; g < G; ++g) {
    Q4Acc iacc[R][NB];
    fill_tile(iacc, q4_zero());
    const uint8_t* wg = w + b0 * block_bytes + g * 4 * 64;
    if constexpr (PAIRED<R> > 0) pair_sums(xq + g * Q4_GROUP, K, wg, block_bytes, iacc);
    if constexpr (PAIRED<R> < R) row_sums<PAIRED<R>>(xq + g * Q4_GROUP, K, wg, block_bytes, iacc);
    for (int b = 0; b < NB; ++b) {
      const c10::Half* dm = meta + ((b0 + b) * G + g) * 32;
      const V16 d = load16(dm), m = load16(dm + 16);
      for (int r = 0; r < R; ++r) {
        const V16 scaled = fma(q4_float(iacc[r][b]), mul(d, V16::splat(xs[r * G + g])), facc[r][b]);
        facc[r][b] = fma(m, V16::splat(xsum[r * G + g]), scaled);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n = (b0 + b) * 16;
    const V16 bias_v = bias ? load16(bias + n) : V16::zero();
    for (int r = 0; r < R; ++r) store16(out + r * out_stride + n, add(facc[r][b], bias_v));
  }
}

void run_packed(const float* x, int64_t rows, const Weight& w, float* out) {
  const int64_t blocks = w.N / 16, block_grain = std::max<int64_t>(1, blocks / (4 * at::get_num_threads()));
  std::vector<int8_t> xq(rows * w.K);
  if (w.type == at::kByte) {
    const int64_t G = w.K / Q4_GROUP;
    std::vector<float> xs(rows * G), xsum(rows * G);
    quantize_groups<Q4_GROUP, 0>(x, rows, w.K, xq.data(), xs.data(), xsum.data());
    const uint8_t* data = static_cast<const uint8_t*>(w.data);
    at::parallel_for(0, blocks, block_grain, [&](int64_t b0, int64_t b1) {
      for_block_tiles(rows, b0, b1, [&](auto R, auto NB, int64_t r, int64_t b) {
        packed_q4_tile<decltype(R)::value, decltype(NB)::value>(xq.data() + r * w.K, xs.data() + r * G, xsum.data() + r * G, w.K,
                                                                data, w.dm, b, out + r * w.N, w.N, w.bias);
      });
    });
    return;
  }
  const int64_t G = w.K / VNNI_GROUP;
  std::vector<float> xs(rows * G);
  quantize_groups<VNNI_GROUP, ACTIVATION_SHIFT>(x, rows, w.K, xq.data(), xs.data(), nullptr);
  const int8_t* data = static_cast<const int8_t*>(w.data);
  at::parallel_for(0, blocks, block_grain, [&](int64_t b0, int64_t b1) {
    for_block_tiles(rows, b0, b1, [&](auto R, auto NB, int64_t r, int64_t b) {
      packed_tile<decltype(R)::value, decltype(NB)::value>(xq.data() + r * w.K, xs.data() + r * G, w.K, data, w.scale, b,
                                                           out + r * w.N, w.N, w.bias);
    });
  });
}

void quantize_activations(const float* x, int64_t rows, int64_t K, int8_t* xq, float* xs) {
  quantize_groups<VNNI_GROUP, ACTIVATION_SHIFT>(x, rows, K, xq, xs, nullptr);
}

}  // namespace llmpool
