// The ops this extension registers as torch.ops.llmpool.* (ops.cpp), one file per family.
#pragma once

#include <ATen/ATen.h>

namespace llmpool {

using at::Tensor;

// attention.cpp
Tensor paged_decode_attention(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                              const Tensor& lengths, int64_t max_len, double scale);
// gemm.cpp
Tensor linear(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& scale, const c10::optional<Tensor>& bias);
bool has_vnni();
// sampling.cpp
Tensor sample_temperature(const Tensor& logits, const Tensor& temperature, const Tensor& uniform);
// decode_step.cpp
Tensor llama_decode(const Tensor& hidden, const Tensor& cos, const Tensor& sin, at::TensorList input_norms, at::TensorList qkv,
                    at::TensorList qkv_scale, at::TensorList qkv_bias, at::TensorList o_proj, at::TensorList o_scale,
                    at::TensorList post_norms, at::TensorList gate_up, at::TensorList gate_up_scale, at::TensorList down,
                    at::TensorList down_scale, const Tensor& final_norm, at::TensorList k_caches, at::TensorList v_caches,
                    const Tensor& slots, const Tensor& block_tables, const Tensor& lengths, int64_t max_len, int64_t heads,
                    int64_t kv_heads, double eps, double scale);

}  // namespace llmpool
