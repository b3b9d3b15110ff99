// Projections for the decode path: small-batch matrix-vector loops and packed VNNI GEMMs (gemm.cpp).
#pragma once

#include "vec.h"

namespace llmpool {

// 4-bit weights (q4): per group of 32 inputs a float16 scale and minimum (GGUF's Q4_1 blocks).
constexpr int64_t Q4_GROUP = 32;
// int8 activations are quantized per group of 64 inputs for vpdpbusd.
constexpr int64_t VNNI_GROUP = 64;

// A projection's weights as the fused step sees them.
struct Weight {
  const void* data;
  at::ScalarType type;
  int64_t N, K;
  const float* scale;     // int8: per output row, then (when K % 64 == 0) each group of 64's weight sum
  int64_t scale_stride;   // floats per row in `scale`
  const c10::Half* dm;    // q4: [N, K / 32, 2] scale and minimum per group, else nullptr
  const float* bias;      // nullptr when none
  bool packed;            // int8 in the VNNI block layout (see packed_tile); `scale` is its [N / 16][1 + K / 64][16];
                          // q4 (uint8) in packed_q4_tile's, with `dm` its [N / 16][K / 32][2][16]
};

Weight as_weight(const Tensor& w, const c10::optional<Tensor>& scale, const c10::optional<Tensor>& bias);

// out [rows, N] = x [rows, K] @ w.T, split over output columns across threads.
void run_linear(const float* x, int64_t rows, const Weight& w, float* out);

}  // namespace llmpool
