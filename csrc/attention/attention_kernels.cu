// Head-dim dispatch for the attention launchers; the kernels live in attention_hdim<D>.cu.
#include "attention.h"

namespace fusedops {

bool attention_supported(DType dtype, int head_dim) {
  return (dtype == DType::BFloat16 || dtype == DType::Float16) && (head_dim == 64 || head_dim == 128);
}

cudaError_t launch_attention_fwd(const AttentionFwdParams& p, DType dtype, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_attention_fwd_hdim<64>(p, dtype, stream);
    case 128: return launch_attention_fwd_hdim<128>(p, dtype, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_attention_bwd(const AttentionBwdParams& p, DType dtype, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_attention_bwd_hdim<64>(p, dtype, stream);
    case 128: return launch_attention_bwd_hdim<128>(p, dtype, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fusedops
