// A ring of shared-memory stages filled by sm_90 bulk copies (cp.async.bulk), each completing
// on its stage's mbarrier: one thread issues a stage's copies (no registers held for the bytes in
// flight), every thread waits on the stage's phase. Used by the staged softmax and norm rows.
#pragma once

#include <cstdint>

namespace fusedops {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One mbarrier per stage, completed by the bytes of its bulk copies: thread 0 arms it with the
// stage's byte count and issues the copies; every thread waits on it with the stage's phase.
struct StageRing {
  char* data;
  uint64_t* full;
  int stages;
  int stage_bytes;

  __device__ void init() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) {
      for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&full[s])));
      // The barriers must be initialized before the async proxy (the bulk copies) uses them.
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
#endif
  }
  __device__ char* stage(int s) const { return data + s * stage_bytes; }
  __device__ void arm(int s, uint32_t bytes) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(&full[s])), "r"(bytes)
                 : "memory");
#endif
  }
  // Copies `bytes` (a multiple of 16, 16-byte aligned ends) from global `src` to `dst` in stage s.
  __device__ void copy(int s, void* dst, const void* src, uint32_t bytes) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     shared_address(dst)),
                 "l"(src), "r"(bytes), "r"(shared_address(&full[s]))
                 : "memory");
#endif
  }
  __device__ void wait(int s, uint32_t phase) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t bar = shared_address(&full[s]);
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
          : "=r"(done)
          : "r"(bar), "r"(phase)
          : "memory");
    }
#endif
  }
};

}  // namespace fusedops
