// The fused decode step, registered as the decoder_step op: a whole step of a
// decoder-only transformer for `rows` single-token rows (decode rows, or a prompt chunk's tokens
// each with its own context length) in one call: norms, projections, rotary embedding, cache writes,
// attention and MLP (dense or mixture of experts) of every layer, with no Python and no per-op
// dispatch in between (that dispatch was ~3 ms of a 13 ms step).
//
// One kernel serves every family it knows by their differences (worker/models/family.py describes
// a model in these terms and worker/models/fused_decode.py lays out its weights): norm kind (RMS,
// with Gemma's 1 + w folded into the weight, or LayerNorm with bias), where the norms sit (before,
// after, or both around each block; attention and MLP in parallel), activation, gated or plain MLP,
// biases, per-head or whole-projection q/k norms, partial rotary and per-layer rotary tables (or
// none), sliding windows and attention chunks, attention softcaps and scales, residual multipliers,
// and experts with top-k routing and a gated shared expert. LoRA adapters' rows get their low-rank
// products after each adapted projection (struct Lora), so they need no other path.

#include "attention.h"
#include "gemm.h"
#include "ops.h"

namespace llmpool {
namespace {

// Per-layer weight slots of `weights` (keep in step with worker/models/fused_decode.py: SLOTS).
enum Slot : int64_t {
  ATTN_NORM_W, ATTN_NORM_B, QKV_W, QKV_SCALE, QKV_BIAS, Q_NORM, K_NORM, O_W, O_SCALE, O_BIAS,
  POST_ATTN_NORM_W, POST_ATTN_NORM_B, MLP_NORM_W, MLP_NORM_B, UP_W, UP_SCALE, UP_BIAS, DOWN_W, DOWN_SCALE, DOWN_BIAS,
  POST_MLP_NORM_W, POST_MLP_NORM_B, ROUTER_W, SHARED_GATE_W, SLOTS
};
// Per-layer integers of `ints` (LAYER_INTS) and floats of `floats` (LAYER_FLOATS).
enum LayerInt : int64_t { NORM_KIND, QK_NORM, ROPE_SET, WINDOW, CHUNK, ACT, GATED, PARALLEL, EXPERTS, TOP_K, NORM_TOP_K, EXPERT_OFFSET, LAYER_INTS };
enum LayerFloat : int64_t { EPS, SCALE, SOFTCAP, RESIDUAL_MULTIPLIER, LAYER_FLOATS };
// After the layers' integers: the model's shape.
enum ShapeInt : int64_t { HEADS, KV_HEADS, ROTARY_DIM, FINAL_NORM_KIND, INTERLEAVED, SHAPE_INTS };
enum NormKind : int64_t { RMS = 0, LAYER = 1 };
enum QkNorm : int64_t { QK_NONE = 0, QK_PER_HEAD = 1, QK_WHOLE = 2 };
enum Act : int64_t { SILU = 0, GELU_TANH = 1, GELU_ERF = 2 };
constexpr int64_t EXPERT_SLOTS = 4;  // gate/up weight and scale, down weight and scale

using Weights = c10::List<c10::optional<Tensor>>;

c10::optional<Tensor> at_slot(const Weights& w, int64_t i) {
  c10::optional<Tensor> t = w.get(i);
  return t.has_value() && t->defined() ? t : c10::optional<Tensor>();
}

const float* data_or_null(const c10::optional<Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

// RMS: x / rms(x) * w; LayerNorm: (x - mean) / std * w + b. Float32 statistics, as transformers computes them.
void norm_rows(int64_t kind, const float* x, const float* w, const float* b, float* out, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * H;
      float mean = 0.f;
      if (kind == LAYER) {
        double total = 0.0;
        for (int64_t i = 0; i < H; ++i) total += xr[i];
        mean = static_cast<float>(total / H);
      }
      V16 ss = V16::zero();
      const V16 mv = V16::splat(mean);
      int64_t i = 0;
      for (; i + 16 <= H; i += 16) {
        const V16 v = sub(load16(xr + i), mv);
        ss = fma(v, v, ss);
      }
      double total = hsum(ss);
      for (; i < H; ++i) total += static_cast<double>(xr[i] - mean) * (xr[i] - mean);
      const float inv = 1.f / std::sqrt(static_cast<float>(total / H) + eps);
      for (int64_t j = 0; j < H; ++j) out[r * H + j] = (xr[j] - mean) * inv * w[j] + (b ? b[j] : 0.f);
    }
  });
}

// The MLP's activation of n values of `g`, times `u` when gated (u null: plain MLP), into `a`.
// SiLU 16 at a time: a libm exp per element was ~0.7 ms of a batch-1 step and grew with every row.
void activate(int64_t act, const float* g, const float* u, float* a, int64_t n) {
  int64_t i = 0;
  if (act == SILU) {
    for (; i + 16 <= n; i += 16) {
      const V16 x = load16(g + i);
      const V16 e = exp16(sub(V16::zero(), x));
      const V16 s = div(x, add(V16::splat(1.f), e));
      store16(a + i, u ? mul(s, load16(u + i)) : s);
    }
  }
  constexpr float k = 0.7978845608028654f;  // sqrt(2 / pi)
  for (; i < n; ++i) {
    const float x = g[i];
    float y;
    if (act == SILU) y = x / (1.f + std::exp(-x));
    else if (act == GELU_TANH) y = 0.5f * x * (1.f + std::tanh(k * (x + 0.044715f * x * x * x)));
    else y = 0.5f * x * (1.f + std::erf(x * 0.7071067811865476f));
    a[i] = u ? y * u[i] : y;
  }
}

// Rotary embedding on the first `rot` dims of each of `n_heads` heads of one row, in place: the
// pairs are (i, i + rot / 2) (Llama's rotate_half) or, `interleaved`, (2i, 2i + 1) (Cohere, Helium).
void rotary(float* x, int64_t n_heads, int64_t D, int64_t rot, const float* cos, const float* sin, bool interleaved) {
  const int64_t half = rot / 2, stride = interleaved ? 1 : half, step = interleaved ? 2 : 1;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * D;
    for (int64_t p = 0; p < half; ++p) {
      const int64_t i = p * step, j = i + stride;
      const float a = v[i], b = v[j];
      v[i] = a * cos[i] - b * sin[i];
      v[j] = b * cos[j] + a * sin[j];
    }
  }
}

// RMS norm of `n` groups of `size` values, in place (q/k norms: per head, or the whole projection).
void rms_groups(float* x, int64_t n, int64_t size, const float* w, float eps) {
  for (int64_t g = 0; g < n; ++g) norm_rows(RMS, x + g * size, w, nullptr, x + g * size, 1, size, eps);
}

struct Scratch {
  std::vector<float> x, x2, qkv, q, attn, up, act, delta, delta2;
};

// LoRA adapters' low-rank products (worker/lora/adapter.py lays them out): for each fused group of
// a layer (qkv, o, gate_up, down) an adapter holds A [ranks, K] and B transposed, [ranks, N] (its
// scale folded in, zeros for projections it leaves alone), and its rows, a segment of the step's
// rows, get out += (x A^T) B. `weights` is [adapter][layer][group][A, B^T] (None where the adapter
// does not adapt that group), `segments` triples of (first row, end row, adapter). Plain loops, a
// row at a time: a rank-8 group is ~40k multiply-adds a row, where run_linear's threading cost more
// than the sums (one adapter row made a 4.1 ms step 6.3 ms through it).
enum Group : int64_t { G_QKV, G_O, G_GATE_UP, G_DOWN, GROUPS };

template <typename T>
float dot_row(const T* a, const float* x, int64_t K) {
  V16 acc = V16::zero();
  int64_t i = 0;
  for (; i + 16 <= K; i += 16) acc = fma(load16(a + i), load16(x + i), acc);
  float total = hsum(acc);
  for (; i < K; ++i) total += static_cast<float>(a[i]) * x[i];
  return total;
}

template <typename T>
void axpy_row(float scale, const T* b, float* y, int64_t N) {
  const V16 sv = V16::splat(scale);
  int64_t i = 0;
  for (; i + 16 <= N; i += 16) store16(y + i, fma(sv, load16(b + i), load16(y + i)));
  for (; i < N; ++i) y[i] += scale * static_cast<float>(b[i]);
}

struct Lora {
  const Weights& weights;
  at::IntArrayRef segments;
  int64_t layers;

  void add(int64_t layer, int64_t group, const float* in, int64_t K, float* out, int64_t N) const {
    for (size_t i = 0; i + 2 < segments.size(); i += 3) {
      const int64_t slot = ((segments[i + 2] * layers + layer) * GROUPS + group) * 2;
      const c10::optional<Tensor> a = at_slot(weights, slot), bt = at_slot(weights, slot + 1);
      if (!a.has_value()) continue;
      const int64_t R = a->size(0);
      TORCH_CHECK(bt.has_value() && a->dim() == 2 && a->is_contiguous() && bt->is_contiguous() && a->size(1) == K &&
                      bt->size(0) == R && bt->size(1) == N && a->scalar_type() == bt->scalar_type(),
                  "LoRA layer ", layer, " group ", group, ": A and B^T do not fit the model's shapes");
      dispatch_cache(a->scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        const T* pa = static_cast<const T*>(a->data_ptr());
        const T* pb = static_cast<const T*>(bt->data_ptr());
        at::parallel_for(segments[i], segments[i + 1], 4, [&](int64_t r0, int64_t r1) {
          std::vector<float> low(R);
          for (int64_t r = r0; r < r1; ++r) {
            for (int64_t j = 0; j < R; ++j) low[j] = dot_row(pa + j * K, in + r * K, K);
            for (int64_t j = 0; j < R; ++j) axpy_row(low[j], pb + j * N, out + r * N, N);
          }
        });
      });
    }
  }
};

// The MLP of `rows` rows of `in` [rows, H] into `out` [rows, H]: gated (up holds gate then up) or
// plain; `lora` adds adapters' products to layer `layer`'s gate_up and down (null: none).
void mlp(const float* in, int64_t rows, const Weight& up, const Weight& down, int64_t act, bool gated, Scratch& s, float* out,
         const Lora* lora = nullptr, int64_t layer = 0) {
  const int64_t inter = gated ? up.N / 2 : up.N;
  s.up.resize(rows * up.N);
  s.act.resize(rows * inter);
  run_linear(in, rows, up, s.up.data());
  if (lora) lora->add(layer, G_GATE_UP, in, up.K, s.up.data(), up.N);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = s.up.data() + r * up.N;
    activate(act, g, gated ? g + inter : nullptr, s.act.data() + r * inter, inter);
  }
  run_linear(s.act.data(), rows, down, out);
  if (lora) lora->add(layer, G_DOWN, s.act.data(), inter, out, down.N);
}

Weight weight_at(const Weights& w, int64_t base, int64_t slot, int64_t scale_slot, int64_t bias_slot) {
  return as_weight(*at_slot(w, base + slot), at_slot(w, base + scale_slot), bias_slot < 0 ? c10::optional<Tensor>() : at_slot(w, base + bias_slot));
}

// Mixture of experts: softmax over the router's logits, the top k (renormalised when asked), and
// each expert computed only for the rows routed to it; plus a shared expert behind a sigmoid gate.
void moe(const float* in, int64_t rows, int64_t H, const Weights& w, int64_t base, const Weights& experts, const int64_t* li,
         Scratch& s, float* out) {
  const int64_t E = li[EXPERTS], K = li[TOP_K], first = li[EXPERT_OFFSET];
  const Weight router = as_weight(*at_slot(w, base + ROUTER_W), {}, {});
  std::vector<float> logits(rows * E);
  run_linear(in, rows, router, logits.data());
  std::vector<std::vector<std::pair<int64_t, float>>> routed(E);  // expert -> (row, weight)
  std::vector<int64_t> order(E);
  for (int64_t r = 0; r < rows; ++r) {
    float* p = logits.data() + r * E;
    const float m = *std::max_element(p, p + E);
    float total = 0.f;
    for (int64_t e = 0; e < E; ++e) total += p[e] = std::exp(p[e] - m);
    for (int64_t e = 0; e < E; ++e) p[e] /= total;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float kept = 0.f;
    for (int64_t k = 0; k < K; ++k) kept += p[order[k]];
    for (int64_t k = 0; k < K; ++k) routed[order[k]].push_back({r, li[NORM_TOP_K] ? p[order[k]] / kept : p[order[k]]});
  }
  std::fill(out, out + rows * H, 0.f);
  std::vector<float> xe, ye;
  for (int64_t e = 0; e < E; ++e) {
    const auto& mine = routed[e];
    if (mine.empty()) continue;
    const int64_t n = static_cast<int64_t>(mine.size()), slot = (first + e) * EXPERT_SLOTS;
    xe.resize(n * H);
    ye.resize(n * H);
    for (int64_t i = 0; i < n; ++i) std::memcpy(xe.data() + i * H, in + mine[i].first * H, H * sizeof(float));
    const Weight up = as_weight(*at_slot(experts, slot), at_slot(experts, slot + 1), {});
    const Weight down = as_weight(*at_slot(experts, slot + 2), at_slot(experts, slot + 3), {});
    mlp(xe.data(), n, up, down, li[ACT], true, s, ye.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < H; ++j) out[mine[i].first * H + j] += mine[i].second * ye[i * H + j];
  }
  if (at_slot(w, base + UP_W).has_value()) {  // the shared expert, scaled by sigmoid(x . gate)
    std::vector<float> shared(rows * H), gate(rows);
    mlp(in, rows, weight_at(w, base, UP_W, UP_SCALE, UP_BIAS), weight_at(w, base, DOWN_W, DOWN_SCALE, DOWN_BIAS), li[ACT], true, s, shared.data());
    run_linear(in, rows, as_weight(*at_slot(w, base + SHARED_GATE_W), {}, {}), gate.data());
    for (int64_t r = 0; r < rows; ++r) {
      const float g = 1.f / (1.f + std::exp(-gate[r]));
      for (int64_t j = 0; j < H; ++j) out[r * H + j] += g * shared[r * H + j];
    }
  }
}

}  // namespace

// `hidden` [rows, H] (embeddings, already scaled) -> the final-normed hidden [rows, H] float32; the
// layers' new keys and values land in the caches at `slots`. `rope` is [sets, rows, 2, rotary_dim]
// (cos, sin) float32; a layer uses set ROPE_SET (-1: no rotary). `lora` and `lora_segments`: the
// adapters of the rows that have one (struct Lora; both empty when none has).
Tensor decoder_step(const Tensor& hidden, const Tensor& rope, const Weights& weights, const Weights& experts, at::IntArrayRef ints,
                    at::ArrayRef<double> floats, at::TensorList k_caches, at::TensorList v_caches, const Tensor& slots,
                    const Tensor& block_tables, const Tensor& lengths, const Weights& lora,
                    at::IntArrayRef lora_segments) {
  const int64_t rows = hidden.size(0), H = hidden.size(1), layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * SLOTS + 2, "decoder_step: ", SLOTS, " weight slots a layer, then the final norm");
  TORCH_CHECK(static_cast<int64_t>(ints.size()) == layers * LAYER_INTS + SHAPE_INTS, "decoder_step: integers per layer, then the shape");
  TORCH_CHECK(static_cast<int64_t>(floats.size()) == layers * LAYER_FLOATS + 1, "decoder_step: floats per layer, then the final eps");
  const int64_t* shape = ints.data() + layers * LAYER_INTS;
  const int64_t heads = shape[HEADS], kv_heads = shape[KV_HEADS], rot = shape[ROTARY_DIM];
  const int64_t D = k_caches[0].size(3), q_size = heads * D, kv_size = kv_heads * D, width = q_size + 2 * kv_size;
  check_tables(block_tables, lengths, rows);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == rows, "slots: int64 [rows]");
  TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.is_contiguous() && rope.dim() == 4 && rope.size(1) == rows && rope.size(2) == 2 &&
                  rope.size(3) == rot && rot <= D && rot % 2 == 0,
              "rope: float32 [sets, rows, 2, rotary_dim]");
  Tensor h = hidden.to(at::kFloat).contiguous().clone();
  float* hp = h.data_ptr<float>();
  Scratch s;
  s.x.resize(rows * H);
  s.x2.resize(rows * H);
  s.qkv.resize(rows * width);
  s.q.resize(rows * q_size);
  s.attn.resize(rows * q_size);
  s.delta.resize(rows * H);
  s.delta2.resize(rows * H);
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<int64_t> begins(rows);
  TORCH_CHECK(lora_segments.size() % 3 == 0, "lora_segments: (first row, end row, adapter) triples");
  for (size_t i = 0; i < lora_segments.size(); i += 3) {
    const int64_t adapter = lora_segments[i + 2];
    TORCH_CHECK(0 <= lora_segments[i] && lora_segments[i] <= lora_segments[i + 1] && lora_segments[i + 1] <= rows && adapter >= 0 &&
                    (adapter + 1) * layers * GROUPS * 2 <= static_cast<int64_t>(lora.size()),
                "lora_segments: rows or adapter out of range");
  }
  const Lora adapters{lora, lora_segments, layers};
  const Lora* with_lora = lora_segments.empty() ? nullptr : &adapters;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t base = layer * SLOTS;
    const int64_t* li = ints.data() + layer * LAYER_INTS;
    const double* lf = floats.data() + layer * LAYER_FLOATS;
    const float eps = static_cast<float>(lf[EPS]);
    const Weight w_qkv = weight_at(weights, base, QKV_W, QKV_SCALE, QKV_BIAS);
    const Weight w_o = weight_at(weights, base, O_W, O_SCALE, O_BIAS);
    TORCH_CHECK(w_qkv.N == width && w_qkv.K == H && w_o.N == H && w_o.K == q_size, "layer ", layer, ": attention shapes do not match the model's sizes");
    auto norm = [&](int64_t w_slot, const float* in, float* out) {
      norm_rows(li[NORM_KIND], in, at_slot(weights, base + w_slot)->data_ptr<float>(), data_or_null(at_slot(weights, base + w_slot + 1)), out, rows, H, eps);
    };
    const bool pre_attn = at_slot(weights, base + ATTN_NORM_W).has_value();
    if (pre_attn) norm(ATTN_NORM_W, hp, s.x.data());
    else std::memcpy(s.x.data(), hp, rows * H * sizeof(float));
    run_linear(s.x.data(), rows, w_qkv, s.qkv.data());
    if (with_lora) with_lora->add(layer, G_QKV, s.x.data(), H, s.qkv.data(), width);
    const float* qn = data_or_null(at_slot(weights, base + Q_NORM));
    const float* kn = data_or_null(at_slot(weights, base + K_NORM));
    const int64_t rope_set = li[ROPE_SET];
    for (int64_t r = 0; r < rows; ++r) {
      float* row = s.qkv.data() + r * width;
      if (li[QK_NORM] == QK_PER_HEAD) {
        rms_groups(row, heads, D, qn, eps);
        rms_groups(row + q_size, kv_heads, D, kn, eps);
      } else if (li[QK_NORM] == QK_WHOLE) {
        rms_groups(row, 1, q_size, qn, eps);
        rms_groups(row + q_size, 1, kv_size, kn, eps);
      }
      if (rope_set >= 0) {
        const float* cs = rope.data_ptr<float>() + (rope_set * rows + r) * 2 * rot;
        rotary(row, heads, D, rot, cs, cs + rot, shape[INTERLEAVED] != 0);
        rotary(row + q_size, kv_heads, D, rot, cs, cs + rot, shape[INTERLEAVED] != 0);
      }
      std::memcpy(s.q.data() + r * q_size, row, q_size * sizeof(float));
      const int64_t q_pos = len[r] - 1;
      begins[r] = li[WINDOW] > 0 ? std::max<int64_t>(0, q_pos + 1 - li[WINDOW]) : li[CHUNK] > 0 ? q_pos / li[CHUNK] * li[CHUNK] : 0;
    }
    AttnShape shape_l = attn_shape(k_caches[layer], block_tables, rows, heads, lf[SCALE]);
    shape_l.softcap = static_cast<float>(lf[SOFTCAP]);
    const Tensor& kc = k_caches[layer];
    const Tensor& vc = v_caches[layer];
    dispatch_cache(kc.scalar_type(), [&](auto tag) {
      using C = decltype(tag);
      C* kcache = static_cast<C*>(kc.data_ptr());
      C* vcache = static_cast<C*>(vc.data_ptr());
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = s.qkv.data() + r * width;
        for (int64_t i = 0; i < kv_size; ++i) {
          kcache[slot[r] * kv_size + i] = from_float<C>(row[q_size + i]);
          vcache[slot[r] * kv_size + i] = from_float<C>(row[q_size + kv_size + i]);
        }
      }
      decode_attention(s.q.data(), static_cast<const C*>(kcache), static_cast<const C*>(vcache), block_tables.data_ptr<int64_t>(), len,
                       begins.data(), shape_l, s.attn.data());
    });
    run_linear(s.attn.data(), rows, w_o, s.delta.data());
    if (with_lora) with_lora->add(layer, G_O, s.attn.data(), q_size, s.delta.data(), H);
    if (at_slot(weights, base + POST_ATTN_NORM_W).has_value()) norm(POST_ATTN_NORM_W, s.delta.data(), s.delta.data());
    // The MLP's input: its own norm of the residual stream (after attention, or before it when the
    // two blocks run in parallel), else the attention's normed input (parallel blocks sharing one).
    const float resid = static_cast<float>(lf[RESIDUAL_MULTIPLIER]);
    const bool parallel = li[PARALLEL] != 0;
    if (!parallel)
      for (int64_t i = 0; i < rows * H; ++i) hp[i] += resid * s.delta[i];
    const float* mlp_in = s.x.data();
    if (at_slot(weights, base + MLP_NORM_W).has_value()) {
      norm(MLP_NORM_W, hp, s.x2.data());
      mlp_in = s.x2.data();
    } else if (!parallel) {
      mlp_in = hp;
    }
    TORCH_CHECK(!(with_lora && li[EXPERTS] > 0), "LoRA adapters on experts are not applied");
    if (li[EXPERTS] > 0) moe(mlp_in, rows, H, weights, base, experts, li, s, s.delta2.data());
    else mlp(mlp_in, rows, weight_at(weights, base, UP_W, UP_SCALE, UP_BIAS), weight_at(weights, base, DOWN_W, DOWN_SCALE, DOWN_BIAS), li[ACT], li[GATED] != 0, s, s.delta2.data(),
             with_lora, layer);
    if (at_slot(weights, base + POST_MLP_NORM_W).has_value()) norm(POST_MLP_NORM_W, s.delta2.data(), s.delta2.data());
    for (int64_t i = 0; i < rows * H; ++i) hp[i] += resid * (s.delta2[i] + (parallel ? s.delta[i] : 0.f));
  }
  Tensor out = at::empty({rows, H}, h.options());
  const int64_t final_slot = layers * SLOTS;
  norm_rows(shape[FINAL_NORM_KIND], hp, at_slot(weights, final_slot)->data_ptr<float>(), data_or_null(at_slot(weights, final_slot + 1)),
            out.data_ptr<float>(), rows, H, static_cast<float>(floats[layers * LAYER_FLOATS]));
  return out;
}

}  // namespace llmpool
