// Head-dim dispatch for the attention launchers; the kernels live in attention_hdim<D>.cu.
#include "attention.h"

namespace fusedops {

bool attention_supported(DType dtype, int head_dim) {
  const bool head_dim_ok = head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128;
  return (dtype == DType::BFloat16 || dtype == DType::Float16) && head_dim_ok;
}

cudaError_t launch_attention_fwd(const AttentionFwdParams& p, DType dtype, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32: return launch_attention_fwd_hdim<32>(p, dtype, stream);
    case 64: return launch_attention_fwd_hdim<64>(p, dtype, stream);
    case 96: return launch_attention_fwd_hdim<96>(p, dtype, stream);
    case 128: return launch_attention_fwd_hdim<128>(p, dtype, stream);
    default: return cudaErrorInvalidValue;
  }
}

bool attention_fwd_sm90_supported(DType dtype, int head_dim) {
  return (dtype == DType::BFloat16 || dtype == DType::Float16) && (head_dim == 64 || head_dim == 128);
}

cudaError_t launch_attention_fwd_sm90(const AttentionFwdParams& p, DType dtype, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_attention_fwd_sm90_hdim<64>(p, dtype, stream);
    case 128: return launch_attention_fwd_sm90_hdim<128>(p, dtype, stream);
    default: return cudaErrorInvalidValue;
  }
}

bool attention_bwd_sm90_supported(DType dtype, int head_dim) { return attention_fwd_sm90_supported(dtype, head_dim); }

cudaError_t launch_attention_bwd_sm90(const AttentionBwdParams& p, DType dtype, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_attention_bwd_sm90_hdim<64>(p, dtype, stream);
    case 128: return launch_attention_bwd_sm90_hdim<128>(p, dtype, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_attention_bwd(const AttentionBwdParams& p, DType dtype, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32: return launch_attention_bwd_hdim<32>(p, dtype, stream);
    case 64: return launch_attention_bwd_hdim<64>(p, dtype, stream);
    case 96: return launch_attention_bwd_hdim<96>(p, dtype, stream);
    case 128: return launch_attention_bwd_hdim<128>(p, dtype, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fusedops
