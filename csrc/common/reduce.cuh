// Warp and block reductions: a warp reduces with __shfl_xor_sync (every lane ends with the
// result), then one value per warp goes through shared memory and the first warp reduces those.
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

// Block-wide reduction; every thread returns the result. `scratch` holds at least 32 values and
// may be reused once this returns (the trailing barrier protects it). Assumes blockDim.x is a
// multiple of 32 and every thread of the block calls it.
template <typename A, class Op>
__device__ __forceinline__ A block_reduce(A value, Op op, A identity, A* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  value = warp_reduce(value, op);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < warps ? scratch[lane] : identity;
  value = warp_reduce(value, op);
  __syncthreads();
  return value;
}

}  // namespace fusedops
