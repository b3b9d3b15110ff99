// The 16-float vectors and int8 dot products every kernel file shares, from the variant's ISA
// header (isa_*.h, chosen by the flags the variant is compiled with: worker/kernels/variants.py),
// and the loop helpers; all maths in float32. Each variant builds these sources into a library of
// its own, whose ops register as torch.ops.<LLMPOOL_OPS> (llmpool_avx2, ...).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "isa_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "isa_avx2.h"
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#include "isa_neon.h"
#else
#include "isa_portable.h"
#endif

namespace llmpool {

using at::Tensor;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// A small batch's rows in groups of up to 4 (a tile's accumulators stay in registers): calls
// f(std::integral_constant<int, R>{}, first_row) for each group.
template <typename F>
void for_row_groups(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) f(std::integral_constant<int, 4>{}, r);
  switch (rows - r) {
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// Output columns in tiles of NR (8 for a single row, else 4: NR * R accumulator chains in flight)
// and single-column tails: calls f(std::integral_constant<int, NR>{}, first_column).
template <int R, typename F>
void for_column_tiles(int64_t n_begin, int64_t n_end, F&& f) {
  constexpr int NR = R == 1 ? 8 : 4;
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) f(std::integral_constant<int, NR>{}, n);
  for (; n < n_end; ++n) f(std::integral_constant<int, 1>{}, n);
}

}  // namespace llmpool
