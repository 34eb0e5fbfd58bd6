// Asynchronous global -> shared copies (cp.async, sm_80+): a thread issues copies, groups them
// with copy_async_commit(), and copy_async_wait(n) blocks until at most n of its groups are still
// in flight. The copied data is visible to the issuing thread after the wait; other threads need
// a barrier as well.
#pragma once
#include <cuda_runtime.h>

namespace fusedops {

// Copies BYTES (4, 8 or 16; both addresses aligned to it) from global to shared memory.
template <int BYTES>
__device__ __forceinline__ void copy_async(void* shared_dst, const void* global_src) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(global_src), "n"(BYTES) : "memory");
  }
}

// Copies one V (any trivially copyable type): asynchronously when its size suits cp.async, else
// with a plain load and store (the copy is then complete on return).
template <typename V>
__device__ __forceinline__ void copy_async_or_now(V* shared_dst, const V* global_src) {
  if constexpr (sizeof(V) == 4 || sizeof(V) == 8 || sizeof(V) == 16) {
    copy_async<sizeof(V)>(shared_dst, global_src);
  } else {
    *shared_dst = *global_src;
  }
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `pending` (0 to 7; more counts as 7) of this thread's committed groups are
// still in flight.
__device__ __forceinline__ void copy_async_wait(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;\n" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;\n" ::: "memory"); break;
  }
}

// Programmatic dependent launch (sm_90+; no-ops before): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the previous kernel in the
// stream still runs; wait_for_prior_grid() blocks until that kernel has finished and its writes
// are visible. allow_dependent_launch() lets the next such kernel start early.
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}

}  // namespace fusedops
