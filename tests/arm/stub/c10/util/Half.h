// Stand-in for torch's c10::Half in tests/arm/neon_vs_portable.cpp: the 16 bits (member x, as in
// c10) and an IEEE binary16 -> binary32 conversion in software (subnormals, infinities and NaNs
// included), the reference the NEON header's hardware conversion is checked against.
#pragma once

#include <cstdint>
#include <cstring>

namespace c10 {

struct Half {
  uint16_t x;
  operator float() const {
    const uint32_t sign = static_cast<uint32_t>(x & 0x8000) << 16;
    uint32_t exponent = (x >> 10) & 0x1F, mantissa = x & 0x3FF, bits;
    if (exponent == 0x1F) {
      bits = sign | 0x7F800000u | (mantissa << 13);  // infinity or NaN (payload kept)
    } else if (exponent != 0) {
      bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // 127 - 15 = 112
    } else if (mantissa == 0) {
      bits = sign;  // +-0
    } else {  // subnormal: shift the mantissa up until its leading 1 is the implicit bit
      exponent = 113;
      while (!(mantissa & 0x400)) {
        mantissa <<= 1;
        --exponent;
      }
      bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};

}  // namespace c10
