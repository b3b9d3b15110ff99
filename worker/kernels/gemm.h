// Projections for the decode path: small-batch matrix-vector loops (gemm.cpp) and packed int8 / q4
// GEMMs (packed.cpp).
#pragma once

#include "vec.h"

namespace llmpool {

// 4-bit weights (q4): per group of 32 inputs a float16 scale and minimum (GGUF's Q4_1 blocks).
constexpr int64_t Q4_GROUP = 32;
// int8 activations are quantized per group of 64 inputs for the int8 weights' dot products.
constexpr int64_t VNNI_GROUP = 64;
// The quantized kernels stream their weights from DRAM once per step; the hardware prefetcher alone
// left them at about half this machine's read bandwidth. Each tile asks for the same lines of the
// tile this many tiles further on, one line per weight load, so the requests are spread out.
constexpr int64_t WEIGHT_PREFETCH_TILES = 1;

// A projection's weights as the fused step sees them.
struct Weight {
  const void* data;
  at::ScalarType type;
  int64_t N, K;
  const float* scale;     // int8: per output row, then (when K % 64 == 0) each group of 64's weight sum
  int64_t scale_stride;   // floats per row in `scale`
  const c10::Half* dm;    // q4: [N, K / 32, 2] scale and minimum per group, else nullptr
  const float* bias;      // nullptr when none
  bool packed;            // int8 in the packed block layout (see packed_tile); `scale` is its [N / 16][1 + K / 64][16];
                          // q4 (uint8) in packed_q4_tile's, with `dm` its [N / 16][K / 32][2][16]
};

Weight as_weight(const Tensor& w, const c10::optional<Tensor>& scale, const c10::optional<Tensor>& bias);

// out [rows, N] = x [rows, K] @ w.T, split over output columns across threads.
void run_linear(const float* x, int64_t rows, const Weight& w, float* out);
// run_linear for packed weights (packed.cpp).
void run_packed(const float* x, int64_t rows, const Weight& w, float* out);
// Per row and group of 64: xs = max|x| / 127 and x / xs rounded to int8 (+ ACTIVATION_SHIFT).
void quantize_activations(const float* x, int64_t rows, int64_t K, int8_t* xq, float* xs);

}  // namespace llmpool
