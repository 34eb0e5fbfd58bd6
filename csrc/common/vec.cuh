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

inline bool is_aligned(const void* ptr, int bytes) {
  return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
}

}  // namespace fusedops
