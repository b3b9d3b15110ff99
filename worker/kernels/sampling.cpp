// Sampling kernels, registered as torch.ops.llmpool.*.

#include "ops.h"
#include "vec.h"

namespace llmpool {

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

// Each row's largest logit's index, the first where it repeats, as torch.argmax gives it (a NaN
// counts as largest: its first one): greedy decoding's pick in a pass of 16-wide maxima and a scan
// for the first match. torch's argmax is a scalar reduction in an OpenMP region: 0.1-0.2 ms over a
// 49,152-token row, and a wait for the second thread whenever another process holds it.
Tensor argmax_rows(const Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(), "logits: contiguous float32 [rows, vocab]");
  const int64_t rows = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "logits: an empty vocabulary");
  Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = lp + r * V;
      V16 mv = V16::splat(NEG_INF), odd = V16::zero();  // odd: x * 0 is NaN for a NaN (or an infinity)
      int64_t i = 0;
      for (; i + 16 <= V; i += 16) {
        const V16 v = load16(x + i);
        mv = vmax(mv, v);
        odd = add(odd, mul(v, V16::zero()));
      }
      float m = hmax(mv);
      bool nan = std::isnan(hsum(odd)) || std::isnan(m);
      for (; i < V; ++i) {
        m = std::max(m, x[i]);
        nan = nan || std::isnan(x[i]);
      }
      int64_t pick = -1;
      for (int64_t j = 0; nan && pick < 0 && j < V; ++j)  // only where an infinity or a NaN is in the row
        if (std::isnan(x[j])) pick = j;
      for (int64_t j = 0; pick < 0 && j < V; ++j)
        if (x[j] == m) pick = j;
      op[r] = std::max<int64_t>(pick, 0);
    }
  });
  return out;
}

}  // namespace llmpool
