// Defines the launchers for one head dim; each attention_hdim<D>.cu expands it once, so the
// head dims compile in parallel.
#pragma once
#include "attention_bwd.cuh"

#define FUSEDOPS_ATTENTION_HEAD_DIM(D)                                                                          \
  namespace fusedops {                                                                                          \
  template <>                                                                                                   \
  cudaError_t launch_attention_fwd_hdim<D>(const AttentionFwdParams& p, DType dtype, cudaStream_t stream) {     \
    if (dtype == DType::BFloat16) return attention::launch_fwd<__nv_bfloat16, D>(p, stream);                    \
    if (dtype == DType::Float16) return attention::launch_fwd<__half, D>(p, stream);                            \
    return cudaErrorInvalidValue;                                                                               \
  }                                                                                                             \
  template <>                                                                                                   \
  cudaError_t launch_attention_bwd_hdim<D>(const AttentionBwdParams& p, DType dtype, cudaStream_t stream) {     \
    if (dtype == DType::BFloat16) return attention::launch_bwd<__nv_bfloat16, D>(p, stream);                    \
    if (dtype == DType::Float16) return attention::launch_bwd<__half, D>(p, stream);                            \
    return cudaErrorInvalidValue;                                                                               \
  }                                                                                                             \
  }  // namespace fusedops
