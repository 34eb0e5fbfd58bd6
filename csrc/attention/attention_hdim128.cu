// Attention kernels for head_dim 128 (one file per head dim so they compile in parallel).
#include "../common/dispatch.cuh"
#include "attention_bwd.cuh"

namespace fusedops {

template <>
cudaError_t launch_attention_fwd_hdim<128>(const AttentionFwdParams& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::BFloat16) return attention::launch_fwd<__nv_bfloat16, 128>(p, stream);
  if (dtype == DType::Float16) return attention::launch_fwd<__half, 128>(p, stream);
  return cudaErrorInvalidValue;
}

template <>
cudaError_t launch_attention_bwd_hdim<128>(const AttentionBwdParams& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::BFloat16) return attention::launch_bwd<__nv_bfloat16, 128>(p, stream);
  if (dtype == DType::Float16) return attention::launch_bwd<__half, 128>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace fusedops
