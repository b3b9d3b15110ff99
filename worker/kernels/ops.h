// The ops this extension registers as torch.ops.<LLMPOOL_OPS>.* (ops.cpp), one file per family.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace llmpool {

using at::Tensor;

// attention.cpp
Tensor paged_decode_attention(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                              const Tensor& lengths, double scale);
// gemm.cpp
Tensor linear(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& scale, const c10::optional<Tensor>& bias);
std::string variant();
// sampling.cpp
Tensor sample_temperature(const Tensor& logits, const Tensor& temperature, const Tensor& uniform);
Tensor argmax_rows(const Tensor& logits);
// decode_step.cpp
Tensor decoder_step(const Tensor& hidden, const Tensor& rope, const c10::List<c10::optional<Tensor>>& weights,
                    const c10::List<c10::optional<Tensor>>& experts, at::IntArrayRef ints, at::ArrayRef<double> floats,
                    at::TensorList k_caches, at::TensorList v_caches, const Tensor& slots, const Tensor& block_tables,
                    const Tensor& lengths, const c10::List<c10::optional<Tensor>>& lora,
                    at::IntArrayRef lora_segments);

}  // namespace llmpool
