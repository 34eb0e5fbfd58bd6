// Division by a divisor fixed for a whole launch as a multiply-high, an add and a shift
// (Granlund and Montgomery, "Division by invariant integers using multiplication", 1994): a
// 32-bit `%` by a runtime value costs about 20 instructions, this 4.
#pragma once
#include <cstdint>

namespace fusedops {

struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;
  uint32_t shift = 0;

  FastDivmod() = default;
  // divisor >= 1. With 2^(shift-1) < divisor <= 2^shift, the multiplier below fits 32 bits.
  explicit FastDivmod(uint32_t d) : divisor(d) {
    while ((uint64_t(1) << shift) < d) ++shift;
    multiplier = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  // n / divisor and n % divisor, exact for n < 2^31 (the sum below then stays under 2^32).
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, multiplier) + n) >> shift; }
  __device__ __forceinline__ uint32_t mod(uint32_t n) const { return n - div(n) * divisor; }
};

}  // namespace fusedops
