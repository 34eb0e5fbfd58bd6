// Launcher timing without torch: the library's launchers called on raw device buffers, timed
// with CUDA events after an L2 flush and a GPU spin that hides the host's enqueueing (as
// bench/common.py's bench_ms does), reported against cudaMemcpy in the same process. Built per
// kernel-file variant by bench/launcher/variants.sh, so knobs are compared within one run.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define TIMING_CHECK(call)                                                                         \
  do {                                                                                             \
    const cudaError_t err_ = (call);                                                               \
    if (err_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

namespace timing {

// The element count of the timed tensors: the environment variable `env` where set (e.g. twice
// the default: two counts in one run split a kernel's time into a fixed cost a call and a
// streaming rate), else `fallback` (the bars' count).
inline int64_t elements(const char* env, int64_t fallback) {
  const char* value = std::getenv(env);
  return value != nullptr ? std::atoll(value) : fallback;
}

constexpr size_t kFlushBytes = size_t(256) << 20;
constexpr long long kCoverCycles = 400000;  // ~0.2 ms: longer than a launcher's host work

__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Uniform values in [offset - scale, offset + scale), from a hash of the index and seed.
template <typename T> __global__ void fill_kernel(T* data, size_t n, uint32_t seed, float scale, float offset) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA77u;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    const float u = (h >> 8) * (1.0f / 16777216.0f);
    data[i] = static_cast<T>(offset + scale * (2.0f * u - 1.0f));
  }
}

template <typename T> T* random_buffer(size_t n, uint32_t seed, float scale = 1.0f, float offset = 0.0f) {
  T* data = nullptr;
  TIMING_CHECK(cudaMalloc(&data, std::max<size_t>(n, 1) * sizeof(T)));
  fill_kernel<T><<<1024, 256>>>(data, n, seed, scale, offset);
  TIMING_CHECK(cudaGetLastError());
  return data;
}

template <typename T> T* empty_buffer(size_t n) {
  T* data = nullptr;
  TIMING_CHECK(cudaMalloc(&data, std::max<size_t>(n, 1) * sizeof(T)));
  return data;
}

// Median milliseconds of launch() (a callable returning cudaError_t) with a cold L2.
template <class Launch> double median_ms(Launch launch, int reps = 25) {
  static void* flush = nullptr;
  if (flush == nullptr) TIMING_CHECK(cudaMalloc(&flush, kFlushBytes));
  for (int i = 0; i < 3; ++i) TIMING_CHECK(launch());
  TIMING_CHECK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> starts(reps), ends(reps);
  for (int i = 0; i < reps; ++i) {
    TIMING_CHECK(cudaEventCreate(&starts[i]));
    TIMING_CHECK(cudaEventCreate(&ends[i]));
    TIMING_CHECK(cudaMemsetAsync(flush, i & 0xff, kFlushBytes));
    spin_kernel<<<1, 1>>>(kCoverCycles);
    TIMING_CHECK(cudaEventRecord(starts[i]));
    TIMING_CHECK(launch());
    TIMING_CHECK(cudaEventRecord(ends[i]));
  }
  TIMING_CHECK(cudaDeviceSynchronize());
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) {
    TIMING_CHECK(cudaEventElapsedTime(&ms[i], starts[i], ends[i]));
    cudaEventDestroy(starts[i]);
    cudaEventDestroy(ends[i]);
  }
  std::nth_element(ms.begin(), ms.begin() + reps / 2, ms.end());
  return ms[reps / 2];
}

// Device-to-device copy bandwidth (bytes read + written), GB/s.
inline double copy_gbs(size_t bytes = size_t(1) << 30) {
  void* src = empty_buffer<char>(bytes);
  void* dst = empty_buffer<char>(bytes);
  const double ms = median_ms([&] { return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice); });
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * bytes / ms / 1e6;
}

inline void report(const char* name, int64_t n, double bytes, double ms, double copy) {
  const double gbs = bytes / ms / 1e6;
  std::printf("%-16s N=%-7lld %8.1f GB/s %6.1f%%\n", name, static_cast<long long>(n), gbs, 100.0 * gbs / copy);
  std::fflush(stdout);
}

}  // namespace timing
