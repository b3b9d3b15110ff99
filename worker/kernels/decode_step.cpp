// The fused decode step, registered as torch.ops.llmpool.llama_decode: a whole decode step of a
// Llama-family model in one call (norms, projections, rotary embedding, cache writes, attention and
// MLP of every layer), with no Python and no per-op dispatch in between (that dispatch was ~3 ms of a
// 13 ms step).

#include "attention.h"
#include "gemm.h"
#include "ops.h"

namespace llmpool {

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
// the fused weights as worker/models/llama.py builds them: input norm, QKV (+ scale, + bias), output
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

}  // namespace llmpool
