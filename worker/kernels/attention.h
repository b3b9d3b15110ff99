// Paged decode attention (attention.cpp): one query token per row over its context in the paged
// KV cache, read in place.
#pragma once

#include "vec.h"

namespace llmpool {

struct AttnShape {
  int64_t rows, heads, kv_heads, head_dim, block_size, max_blocks;
  float scale;
  float softcap = 0.f;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
};

// q [rows, heads, D] float32 -> out [rows, heads, D] float32: row r attends to positions
// [begins[r], lengths[r]) (begins null: from 0; a sliding window or an attention chunk starts later).
// C: the cache's element type: c10::BFloat16, c10::Half or float, instantiated in attention.cpp.
template <typename C>
void decode_attention(const float* q, const C* k_cache, const C* v_cache, const int64_t* tables, const int64_t* lengths,
                      const int64_t* begins, const AttnShape& s, float* out);
extern template void decode_attention<c10::BFloat16>(const float*, const c10::BFloat16*, const c10::BFloat16*, const int64_t*,
                                                     const int64_t*, const int64_t*, const AttnShape&, float*);
extern template void decode_attention<c10::Half>(const float*, const c10::Half*, const c10::Half*, const int64_t*, const int64_t*,
                                                 const int64_t*, const AttnShape&, float*);
extern template void decode_attention<float>(const float*, const float*, const float*, const int64_t*, const int64_t*,
                                             const int64_t*, const AttnShape&, float*);

template <typename F>
void dispatch_cache(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kFloat: f(float{}); break;
    default: TORCH_CHECK(false, "unsupported KV cache dtype");
  }
}

AttnShape attn_shape(const Tensor& k_cache, const Tensor& tables, int64_t rows, int64_t heads, double scale);
void check_tables(const Tensor& tables, const Tensor& lengths, int64_t rows);

}  // namespace llmpool
