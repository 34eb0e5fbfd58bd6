// 16-byte aligned vectors and conversions between storage and accumulation types.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fusedops {

// Arithmetic type: fp32 for every 16/32-bit storage type, fp64 stays fp64.
template <typename T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };
template <typename T> using acc_t = typename AccType<T>::type;

template <typename T> __device__ __forceinline__ acc_t<T> to_acc(T v) { return static_cast<acc_t<T>>(v); }
template <> __device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half from_acc(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc(float v) { return __float2bfloat16_rn(v); }

// Elements of T in one 16-byte access.
template <typename T> constexpr int kVec16 = 16 / sizeof(T);

template <typename T, int N> struct alignas(sizeof(T) * N) AlignedVector {
  T val[N];
};

template <typename T, int N>
__device__ __forceinline__ AlignedVector<T, N> load_vector(const T* ptr) {
  return *reinterpret_cast<const AlignedVector<T, N>*>(ptr);
}

template <typename T, int N>
__device__ __forceinline__ void store_vector(T* ptr, const AlignedVector<T, N>& v) {
  *reinterpret_cast<AlignedVector<T, N>*>(ptr) = v;
}

// L2 eviction priority of a load's lines (sm_80+ cache hints): rows a kernel reads twice are
// loaded first with kEvictLast, so that they stay in L2 for the second read against the stream of
// other rows, and then with kEvictFirst, so that their lines go first once read.
enum class L2Hint { kEvictLast, kEvictFirst };

// The L2 cache policy of HINT for every line of a load: a register operand of the hinted loads,
// created once and reused by every load under it.
template <L2Hint HINT> struct L2Policy {
  uint64_t value;
};

template <L2Hint HINT> __device__ __forceinline__ L2Policy<HINT> l2_policy() {
  L2Policy<HINT> policy{0};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (HINT == L2Hint::kEvictLast) {
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy.value));
  } else {
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy.value));
  }
#endif
  return policy;
}

// A 16-byte load of read-only global memory under `policy`; a plain load before sm_80.
template <L2Hint HINT> __device__ __forceinline__ uint4 load_hinted(const void* ptr, L2Policy<HINT> policy) {
  uint4 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (HINT == L2Hint::kEvictLast) {
    asm("ld.global.L1::evict_last.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(ptr), "l"(policy.value));
  } else {
    asm("ld.global.L1::evict_first.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(ptr), "l"(policy.value));
  }
#else
  (void)policy;
  v = *static_cast<const uint4*>(ptr);
#endif
  return v;
}

// One 16-byte store to global memory (`ptr` 16-byte aligned), as one instruction: in softmax's
// reread_backward_kernel the compiler split a stored vector (an AlignedVector or a uint4) into
// 32- and 16-bit stores (37% of copy at bf16 N = 4096).
__device__ __forceinline__ void store_16_bytes(void* ptr, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

inline bool is_aligned(const void* ptr, int bytes) {
  return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
}

}  // namespace fusedops
