// Stand-in for torch's c10::BFloat16 in tests/arm/neon_vs_portable.cpp (no torch headers there):
// the 16 bits (member x, as in c10) and the conversion to float the ISA headers use.
#pragma once

#include <cstdint>
#include <cstring>

namespace c10 {

struct BFloat16 {
  uint16_t x;
  operator float() const {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};

}  // namespace c10
