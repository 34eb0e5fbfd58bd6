// Warp reductions with __shfl_xor_sync (every lane ends with the result), and the shared memory
// of block reductions (one value per warp through shared memory, then a warp reduces those).
#pragma once
#include <cuda_runtime.h>

namespace fusedops {

struct SumOp {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};

struct MaxOp {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return a > b ? a : b; }
};

// Reduces over the `width` lanes of each aligned group of `width` lanes (width a power of 2 <= 32).
template <int width = 32, typename A, class Op>
__device__ __forceinline__ A warp_reduce(A value, Op op) {
#pragma unroll
  for (int mask = width / 2; mask > 0; mask /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, mask));
  return value;
}

// The shared memory of a block's successive reductions: two buffers used in turn (next()), so
// that a reduction needs one barrier (between the warps' writes and the reads), not a second one
// before its buffer is reused. Reduction i + 2 writes the buffer that reduction i read; a thread
// writes it only after passing reduction i + 1's barrier, which no thread passes before every
// thread has read reduction i's values. Every thread of the block makes the same next() calls.
template <typename Buffer>
struct TurnScratch {
  Buffer* buffers;  // [2], shared
  int turn = 0;
  __device__ __forceinline__ Buffer& next() {
    Buffer& buffer = buffers[turn];
    turn ^= 1;
    return buffer;
  }
};

}  // namespace fusedops
