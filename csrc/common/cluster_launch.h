// Launches of thread-block clusters (sm_90), sized by the clusters the device holds at once.
// Host side, CUDA runtime only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "occupancy.h"

namespace fusedops {

// Clusters of `cluster` blocks of `threads` threads and `shared_bytes` dynamic shared memory, on
// `stream`. active() sets the kernel's attributes and returns the clusters the device holds at
// once (0, with no error left behind, when it cannot hold one); launch() launches `clusters`.
template <class Kernel> class ClusterLaunch {
 public:
  ClusterLaunch(Kernel kernel, int cluster, int threads, int shared_bytes, cudaStream_t stream)
      : kernel_(kernel), cluster_(cluster) {
    attribute_.id = cudaLaunchAttributeClusterDimension;
    attribute_.val.clusterDim.x = cluster;
    attribute_.val.clusterDim.y = 1;
    attribute_.val.clusterDim.z = 1;
    config_.gridDim = dim3(static_cast<unsigned>(cluster));
    config_.blockDim = dim3(threads);
    config_.dynamicSmemBytes = static_cast<size_t>(shared_bytes);
    config_.stream = stream;
    config_.attrs = &attribute_;
    config_.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // config_ points at attribute_
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;

  int active() {
    const int shared_bytes = static_cast<int>(config_.dynamicSmemBytes);
    if ((shared_bytes > 0 &&
         cudaFuncSetAttribute(kernel_, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes) != cudaSuccess) ||
        (cluster_ > 8 && cudaFuncSetAttribute(kernel_, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess)) {
      cudaGetLastError();
      return 0;
    }
    return cached_active_clusters(kernel_, config_, cluster_);
  }

  template <class... Args> cudaError_t launch(int64_t clusters, const Args&... args) {
    config_.gridDim = dim3(static_cast<unsigned>(clusters * cluster_));
    const cudaError_t err = cudaLaunchKernelEx(&config_, kernel_, args...);
    return err != cudaSuccess ? err : cudaGetLastError();
  }

 private:
  Kernel kernel_;
  int cluster_;
  cudaLaunchAttribute attribute_ = {};
  cudaLaunchConfig_t config_ = {};
};

}  // namespace fusedops
