// 16-byte aligned vectors and conversions between storage and accumulation types.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

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

// Cache hints for 16-byte accesses (other sizes are plain accesses). Hinted loads assume the data
// is not written while the kernel runs (the compiler may move them like reads of constants).
//   StreamCs: ld/st.global.cs, evict first in L1 and L2 (data touched once).
//   StreamNoAllocate: not allocated in L1, evict first in L2 (data touched once).
//   Keep: evict last in L1 (small data read again and again, e.g. a norm's weight).
enum class Hint { None, StreamCs, StreamNoAllocate, Keep };

// An L2 evict-first cache policy for .L2::cache_hint accesses (the compiler may share one
// between accesses: no side effects).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

template <Hint H, typename T, int N>
__device__ __forceinline__ AlignedVector<T, N> load_vector_hinted(const T* ptr) {
  if constexpr (H == Hint::None || sizeof(AlignedVector<T, N>) != 16) {
    return load_vector<T, N>(ptr);
  } else {
    uint4 bits;
    if constexpr (H == Hint::StreamCs) {
      bits = __ldcs(reinterpret_cast<const uint4*>(ptr));
    } else if constexpr (H == Hint::StreamNoAllocate) {
      asm("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
          : "=r"(bits.x), "=r"(bits.y), "=r"(bits.z), "=r"(bits.w)
          : "l"(__cvta_generic_to_global(ptr)), "l"(l2_evict_first_policy()));
    } else {
      asm("ld.global.L1::evict_last.v4.u32 {%0, %1, %2, %3}, [%4];"
          : "=r"(bits.x), "=r"(bits.y), "=r"(bits.z), "=r"(bits.w)
          : "l"(__cvta_generic_to_global(ptr)));
    }
    AlignedVector<T, N> v;
    memcpy(&v, &bits, sizeof(v));
    return v;
  }
}

template <Hint H, typename T, int N>
__device__ __forceinline__ void store_vector_hinted(T* ptr, const AlignedVector<T, N>& v) {
  if constexpr (H == Hint::None || H == Hint::Keep || sizeof(AlignedVector<T, N>) != 16) {
    store_vector<T, N>(ptr, v);
  } else {
    uint4 bits;
    memcpy(&bits, &v, sizeof(bits));
    if constexpr (H == Hint::StreamCs) {
      __stcs(reinterpret_cast<uint4*>(ptr), bits);
    } else {
      asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(
                       __cvta_generic_to_global(ptr)),
                   "r"(bits.x), "r"(bits.y), "r"(bits.z), "r"(bits.w), "l"(l2_evict_first_policy()));
    }
  }
}

inline bool is_aligned(const void* ptr, int bytes) {
  return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
}

}  // namespace fusedops
