// Attention kernels for head_dim 64 (one file per head dim so they compile in parallel).
#include "../common/dispatch.cuh"
#include "attention_bwd.cuh"

namespace fusedops {

template <>
cudaError_t launch_attention_fwd_hdim<64>(const AttentionFwdParams& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::BFloat16) return attention::launch_fwd<__nv_bfloat16, 64>(p, stream);
  if (dtype == DType::Float16) return attention::launch_fwd<__half, 64>(p, stream);
  return cudaErrorInvalidValue;
}

template <>
cudaError_t launch_attention_bwd_hdim<64>(const AttentionBwdParams& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::BFloat16) return attention::launch_bwd<__nv_bfloat16, 64>(p, stream);
  if (dtype == DType::Float16) return attention::launch_bwd<__half, 64>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace fusedops
