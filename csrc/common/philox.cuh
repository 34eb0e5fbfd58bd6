// Counter-based Philox4x32-10 (Salmon et al., SC'11). Element i of a dropout call uses the 16-bit
// half-word i % 8 (low half first) of the block generated for counter (i / 8, offset) under key
// seed, so any thread can draw any element's number and the CPU reference
// (fusedops/reference.py) reproduces the same mask bit for bit.
#pragma once
#include <cstdint>

#include "philox.h"

namespace fusedops {

constexpr int kPhiloxRounds = 10;
constexpr uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;

struct PhiloxKey {
  uint64_t seed;
  uint64_t offset;
};

// A PhiloxKey with its round keys computed on the host, for a kernel parameter: the rounds read
// each key word from the parameter bank as an operand of their xors. A key in registers costs
// two adds a round (18 a block) wherever ptxas has no uniform registers to spare for the 20
// words, as in the 16-bit masked softmax forwards (~2 instructions an element).
struct PhiloxSchedule {
  uint32_t key0[kPhiloxRounds];
  uint32_t key1[kPhiloxRounds];
  uint64_t offset;
};

inline PhiloxSchedule philox_schedule(const PhiloxKey& key) {
  PhiloxSchedule s{};
  uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
  for (int round = 0; round < kPhiloxRounds; ++round, k0 += kPhiloxWeyl0, k1 += kPhiloxWeyl1) {
    s.key0[round] = k0;
    s.key1[round] = k1;
  }
  s.offset = key.offset;
  return s;
}

__device__ __forceinline__ PhiloxKey unpack_philox(const PhiloxArgs& a) {
  if (a.captured) {
    return {static_cast<uint64_t>(*a.seed_ptr), static_cast<uint64_t>(*a.offset_ptr) + a.offset_intragraph};
  }
  return {a.seed, a.offset};
}

// The two overloads below spell out the same round: a shared round helper changed the SASS (and
// registers) of kernels that never take a PhiloxSchedule, the fp32 backward's by 100-200
// instructions (session 15, cuobjdump).
__device__ __forceinline__ uint4 philox4x32_10(uint64_t group, PhiloxKey key) {
  constexpr uint32_t kMul0 = kPhiloxMul0, kMul1 = kPhiloxMul1;
  constexpr uint32_t kWeyl0 = kPhiloxWeyl0, kWeyl1 = kPhiloxWeyl1;
  uint32_t c0 = static_cast<uint32_t>(group), c1 = static_cast<uint32_t>(group >> 32);
  uint32_t c2 = static_cast<uint32_t>(key.offset), c3 = static_cast<uint32_t>(key.offset >> 32);
  uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
#pragma unroll
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint32_t hi0 = __umulhi(kMul0, c0), lo0 = kMul0 * c0;
    const uint32_t hi1 = __umulhi(kMul1, c2), lo1 = kMul1 * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return make_uint4(c0, c1, c2, c3);
}

__device__ __forceinline__ uint4 philox4x32_10(uint64_t group, const PhiloxSchedule& schedule) {
  constexpr uint32_t kMul0 = kPhiloxMul0, kMul1 = kPhiloxMul1;
  uint32_t c0 = static_cast<uint32_t>(group), c1 = static_cast<uint32_t>(group >> 32);
  uint32_t c2 = static_cast<uint32_t>(schedule.offset), c3 = static_cast<uint32_t>(schedule.offset >> 32);
#pragma unroll
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint32_t hi0 = __umulhi(kMul0, c0), lo0 = kMul0 * c0;
    const uint32_t hi1 = __umulhi(kMul1, c2), lo1 = kMul1 * c2;
    c0 = hi1 ^ c1 ^ schedule.key0[round];
    c1 = lo1;
    c2 = hi0 ^ c3 ^ schedule.key1[round];
    c3 = lo0;
  }
  return make_uint4(c0, c1, c2, c3);
}

// Dropout draws 16 bits per element, eight elements per Philox block: half the generator work
// of one 32-bit word per element (the bf16 dropout kernel was instruction-bound), with p
// resolved to 1/65536.
constexpr int kDropoutDrawsPerBlock = 8;

__device__ __forceinline__ uint32_t dropout_draw(const uint4& block, int64_t index) {
  const int half = static_cast<int>(index & 7);
  uint32_t word;
  switch (half >> 1) {
    case 0: word = block.x; break;
    case 1: word = block.y; break;
    case 2: word = block.z; break;
    default: word = block.w; break;
  }
  return (half & 1) ? word >> 16 : word & 0xffffu;
}

// An element survives dropout with probability 1 - p when its draw is >= dropout_threshold(p).
inline uint32_t dropout_threshold(double p) {
  return static_cast<uint32_t>(p * 65536.0);
}

// Draws the keep decisions of elements e0 .. e0 + VEC - 1 and calls f(j, keep) for each.
template <int VEC, class Key, class F>
__device__ __forceinline__ void for_each_keep(const Key& key, uint32_t threshold, int64_t e0, F f) {
  uint4 block = philox4x32_10(static_cast<uint64_t>(e0) / kDropoutDrawsPerBlock, key);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const int64_t e = e0 + j;
    if (j > 0 && e % kDropoutDrawsPerBlock == 0) block = philox4x32_10(static_cast<uint64_t>(e) / kDropoutDrawsPerBlock, key);
    f(j, dropout_draw(block, e) >= threshold);
  }
}

}  // namespace fusedops
