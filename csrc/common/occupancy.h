// Occupancy answers asked once per process: they never change for a kernel, device and launch
// shape, and the driver's occupancy queries cost microseconds on every call, which small inputs
// would pay on top of a kernel of a few microseconds. Plain C++ (CUDA runtime only).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>

namespace fusedops {

// query() computes the answer (0 when the device cannot run the shape; it must leave no CUDA
// error behind); its result is remembered per (kernel, current device, threads, dynamic shared
// bytes, cluster size).
template <class Query>
int cached_occupancy(const void* kernel, int threads, size_t shared_bytes, int cluster, Query query) {
  using Key = std::tuple<const void*, int, int, size_t, int>;
  static std::mutex mutex;
  static std::map<Key, int> answers;
  int device = 0;
  cudaGetDevice(&device);
  const Key key{kernel, device, threads, shared_bytes, cluster};
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto found = answers.find(key);
    if (found != answers.end()) return found->second;
  }
  const int answer = query();
  std::lock_guard<std::mutex> lock(mutex);
  answers.emplace(key, answer);
  return answer;
}

// Resident blocks per SM of `kernel` (at least 1: the answer is only a sizing hint).
template <class Kernel> int cached_blocks_per_sm(Kernel kernel, int threads, size_t shared_bytes) {
  return cached_occupancy(reinterpret_cast<const void*>(kernel), threads, shared_bytes, 1, [&] {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared_bytes) != cudaSuccess) {
      cudaGetLastError();
      per_sm = 1;
    }
    return per_sm > 0 ? per_sm : 1;
  });
}

// Clusters of config's shape that the device can hold at once; 0 when it can hold none. The
// kernel's function attributes (shared memory size, non-portable cluster size) must be set first.
template <class Kernel> int cached_active_clusters(Kernel kernel, const cudaLaunchConfig_t& config, int cluster) {
  return cached_occupancy(reinterpret_cast<const void*>(kernel), static_cast<int>(config.blockDim.x),
                          config.dynamicSmemBytes, cluster, [&] {
                            int active = 0;
                            if (cudaOccupancyMaxActiveClusters(&active, kernel, &config) != cudaSuccess) {
                              cudaGetLastError();
                              active = 0;
                            }
                            return active;
                          });
}

}  // namespace fusedops
