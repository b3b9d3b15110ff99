// CPU kernels for the worker's decode path, registered here as torch.ops.<LLMPOOL_OPS>.*; one file
// per op family (attention.cpp, gemm.cpp + packed.cpp, decode_step.cpp, sampling.cpp). Each variant
// (worker/kernels/variants.py: avx512, avx2, neon, portable) compiles them with its own target
// flags into a library of its own, and names its ops for itself (torch.ops.llmpool_avx2, ...), so
// a process may load several (the tests compare them) and the worker loads the best its CPU runs.
//
// Why they exist (worker/kernels/__init__.py has the measurements):
// - paged_decode_attention: one query token per row attends to its context straight out of the
//   paged KV cache (no copy), each KV head read once for all the query heads that share it (GQA),
//   online softmax, and the context split across threads when there are few rows (flash-decoding);
//   bf16 caches use vdpbf16ps for both the scores and the V accumulation (attend_split_bf16).
// - linear: int8 or q4 weights packed for an int8 GEMM (any number of rows; packed.cpp), or row-major int8 / q4 / bf16 / fp16 / fp32 weights in matrix-vector loops
//   for a handful of rows.
// - decoder_step: a whole decode step of a decoder-only model in one call (every family it knows by
//   their differences: worker/models/family.py): norms, projections, rotary embedding, cache writes,
//   attention and MLP or experts of every layer, with no Python and no per-op dispatch in between
//   (that dispatch was ~3 ms of a 13 ms step), with LoRA adapters' low-rank products for the rows
//   that have one.
// - sample_temperature: plain temperature sampling of each row in one call (the sampler's torch
//   ops took 0.13-0.6 ms of a batch-1 step); argmax_rows: greedy's pick (torch's argmax, 0.1-0.2 ms).
//
// Vectors of 16 floats and int8 dot products from the variant's isa_*.h; all maths in float32.

#include <torch/library.h>

#include "ops.h"

// TORCH_LIBRARY takes its namespace as a token: one more macro level expands LLMPOOL_OPS first.
#define LLMPOOL_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LLMPOOL_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

LLMPOOL_LIBRARY(LLMPOOL_OPS, m) {
  m.def("variant() -> str", &llmpool::variant);
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lengths, float scale) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("sample_temperature(Tensor logits, Tensor temperature, Tensor uniform) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def(
      "decoder_step(Tensor hidden, Tensor rope, Tensor?[] weights, Tensor?[] experts, int[] ints, float[] floats, "
      "Tensor[] k_caches, Tensor[] v_caches, Tensor slots, Tensor block_tables, Tensor lengths, "
      "Tensor?[] lora, int[] lora_segments) -> Tensor");
}

LLMPOOL_LIBRARY_IMPL(LLMPOOL_OPS, CPU, m) {
  m.impl("paged_decode_attention", &llmpool::paged_decode_attention);
  m.impl("linear", &llmpool::linear);
  m.impl("sample_temperature", &llmpool::sample_temperature);
  m.impl("argmax_rows", &llmpool::argmax_rows);
  m.impl("decoder_step", &llmpool::decoder_step);
}
