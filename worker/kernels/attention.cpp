// Paged decode attention, registered as the paged_decode_attention op and used by the
// fused decode step: one query token per row attends to its context straight out of the paged KV
// cache (no copy), each KV head read once for all the query heads that share it (GQA), online
// softmax, and the context split across threads when there are few rows (flash-decoding); bf16
// caches use vdpbf16ps for both the scores and the V accumulation (attend_split_bf16) where the
// avx512 variant runs on a CPU with AVX512-BF16 (compiled for it alone, chosen at run time).

#include "attention.h"

#include "ops.h"

namespace llmpool {


#if defined(LLMPOOL_ISA_AVX512)
// Whether this CPU has AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4; not Cascade or Ice Lake),
// read once.
const bool HAS_AVX512_BF16 = __builtin_cpu_supports("avx512bf16");
#endif

constexpr int MAX_GROUP = 16;   // query heads per KV head
constexpr int MAX_HEAD_DIM = 256;

// Online softmax over one tile of 16 positions for one head: the tile's dot products (lanes of
// `dots`, those from n on masked; capped when `softcap` > 0) update the running max `m` and sum `l`
// and rescale the head's accumulator; returns the tile's unnormalised weights.
inline V16 softmax_tile(const V16* dots, int64_t n, float& m, float& l, V16* acc, int64_t D16, float softcap) {
  alignas(64) float scores[16];
  store16(scores, reduce16(dots));
  if (softcap > 0.f)
    for (int64_t i = 0; i < n; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
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
        store16(probs[g], softmax_tile(dots, n, m[h], l[h], acc.data() + h * D16, D16, s.softcap));
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

#if defined(LLMPOOL_ISA_AVX512)
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
__attribute__((target("avx512bf16"))) void attend_split_bf16(const float* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int64_t* table,
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
        const V16 p = softmax_tile(dots, n, m[h], l[h], acc.data() + h * D16, D16, s.softcap);
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

// A row's context splits come from its own length alone, never from the thread count or the batch:
// then a row's scores and sums run in one order wherever it lands, and a seeded answer does not change
// with the load (activations are quantized to int8 in the step, so a change in the last bit of an
// attention output could flip a rounding and move the logits by a whole unit). One split per 256
// positions, at most 16 (on 2 threads a lone row took about as long with 8 splits as with 2).
constexpr int64_t SPLIT_POSITIONS = 256, MAX_SPLITS = 16;

inline int64_t splits_for(int64_t n) { return std::clamp<int64_t>((n + SPLIT_POSITIONS - 1) / SPLIT_POSITIONS, 1, MAX_SPLITS); }


// q [rows, heads, D] float32 -> out [rows, heads, D] float32.
template <typename C>
void decode_attention(const float* q, const C* k_cache, const C* v_cache, const int64_t* tables, const int64_t* lengths,
                      const int64_t* begins, const AttnShape& s, float* out) {
  const int64_t H = s.heads, D = s.head_dim;
  const int64_t part_size = H * (D + 2);
  int64_t most = 1;  // the most splits of any row: each row has that many parts, its own first and empty ones after
  for (int64_t row = 0; row < s.rows; ++row) {
    const int64_t len = lengths[row], start = begins ? std::min(len, begins[row]) : 0;
    most = std::max(most, splits_for(len - start));
  }
  std::vector<float> parts(s.rows * most * part_size);
  at::parallel_for(0, s.rows * most, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t split = item % most, row = item / most;
      const int64_t len = lengths[row], start = begins ? std::min(len, begins[row]) : 0;
      const int64_t n = len - start, splits = splits_for(n);
      const int64_t chunk = ((n + splits - 1) / splits + 15) / 16 * 16;  // whole tiles of 16 positions
      const int64_t begin = std::min(len, start + split * chunk), end = std::min(len, begin + chunk);
      if (split >= splits || begin >= end) {  // nothing here: an empty part, skipped when the parts are combined
        float* part = parts.data() + item * part_size;
        for (int64_t h = 0; h < H; ++h) part[h * (D + 2) + D] = NEG_INF, part[h * (D + 2) + D + 1] = 0.f;
        continue;
      }
#if defined(LLMPOOL_ISA_AVX512)
      if constexpr (std::is_same_v<C, c10::BFloat16>) {
        if (D % 32 == 0 && HAS_AVX512_BF16) {
          attend_split_bf16(q + row * H * D, k_cache, v_cache, tables + row * s.max_blocks, begin, end, s, parts.data() + item * part_size);
          continue;
        }
      }
#endif
      attend_split(q + row * H * D, k_cache, v_cache, tables + row * s.max_blocks, begin, end, s, parts.data() + item * part_size);
    }
  });
  for (int64_t row = 0; row < s.rows; ++row) {
    const float* base = parts.data() + row * most * part_size;
    for (int64_t h = 0; h < H; ++h) {
      float M = NEG_INF;
      for (int64_t sp = 0; sp < most; ++sp) M = std::max(M, base[sp * part_size + h * (D + 2) + D]);
      float* o = out + (row * H + h) * D;
      std::fill(o, o + D, 0.f);
      float L = 0.f;
      for (int64_t sp = 0; sp < most; ++sp) {
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

template void decode_attention<c10::BFloat16>(const float*, const c10::BFloat16*, const c10::BFloat16*, const int64_t*, const int64_t*,
                                              const int64_t*, const AttnShape&, float*);
template void decode_attention<c10::Half>(const float*, const c10::Half*, const c10::Half*, const int64_t*, const int64_t*,
                                          const int64_t*, const AttnShape&, float*);
template void decode_attention<float>(const float*, const float*, const float*, const int64_t*, const int64_t*, const int64_t*,
                                      const AttnShape&, float*);

AttnShape attn_shape(const Tensor& k_cache, const Tensor& tables, int64_t rows, int64_t heads, double scale) {
  AttnShape s{rows, heads, k_cache.size(2), k_cache.size(3), k_cache.size(1), tables.size(1), static_cast<float>(scale)};
  TORCH_CHECK(heads % s.kv_heads == 0 && heads / s.kv_heads <= MAX_GROUP, "unsupported head grouping");
  TORCH_CHECK(s.head_dim % 16 == 0 && s.head_dim <= MAX_HEAD_DIM, "head_dim must be a multiple of 16, at most 256");
  return s;
}

void check_tables(const Tensor& tables, const Tensor& lengths, int64_t rows) {
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.size(0) == rows, "block tables: int64 [rows, max_blocks]");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.numel() == rows, "lengths: int64 [rows]");
}

Tensor paged_decode_attention(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                              const Tensor& lengths, double scale) {
  const int64_t rows = query.size(0), heads = query.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(), "caches");
  check_tables(block_tables, lengths, rows);
  const AttnShape s = attn_shape(k_cache, block_tables, rows, heads, scale);
  TORCH_CHECK(query.size(2) == s.head_dim, "query head_dim");
  Tensor q = query.to(at::kFloat).contiguous();
  Tensor out = at::empty({rows, heads, s.head_dim}, q.options());
  dispatch_cache(k_cache.scalar_type(), [&](auto tag) {
    using C = decltype(tag);
    decode_attention(q.data_ptr<float>(), static_cast<const C*>(k_cache.data_ptr()), static_cast<const C*>(v_cache.data_ptr()),
                     block_tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), nullptr, s, out.data_ptr<float>());
  });
  return out.to(query.scalar_type());
}

}  // namespace llmpool
