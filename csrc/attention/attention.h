// Launchers for fused scaled-dot-product attention. Plain C++: pointers, sizes, strides and a
// stream, no torch.
//
// Tensors are [batch, heads, seq, head_dim] with any batch/head/seq strides (in elements) and a
// unit head_dim stride; base pointers and strides must keep every row 16-byte aligned (the
// kernels copy rows with 16-byte cp.async). Query head h reads key/value head
// h / (heads_q / heads_kv) (GQA/MQA). Causal masking is top-left aligned: query i sees keys
// j <= i. lse (fp32, contiguous [batch, heads_q, len_q]) is the natural-log log-sum-exp of each
// scaled score row.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/dtype.h"

namespace fusedops {

struct AttentionStrides {
  int64_t batch, head, seq;
};

struct AttentionFwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  AttentionStrides q_stride, k_stride, v_stride, out_stride;
  int batch, heads_q, heads_kv, len_q, len_k, head_dim;
  float scale;
  bool causal;
};

// Backward. dq, dk, dv have their own strides; dk/dv hold one slice per query head ([batch,
// heads_q, len_k, head_dim]): with GQA the caller sums each group of query heads sharing a
// key/value head, and sets dkdv_fp32 so the partials are fp32 (else dk/dv are of the input dtype).
// delta (fp32 [batch, heads_q, len_q], contiguous) is scratch for rowsum(dout * out).
struct AttentionBwdParams {
  const void* dout;
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const float* lse;
  float* delta;
  void* dq;
  void* dk;
  void* dv;
  AttentionStrides dout_stride, q_stride, k_stride, v_stride, out_stride, dq_stride, dk_stride, dv_stride;
  int batch, heads_q, heads_kv, len_q, len_k, head_dim;
  float scale;
  bool causal;
  bool dkdv_fp32;
};

// Head dims and dtypes with a kernel: head_dim 32, 64, 96 or 128; Float16 or BFloat16.
bool attention_supported(DType dtype, int head_dim);

cudaError_t launch_attention_fwd(const AttentionFwdParams& p, DType dtype, cudaStream_t stream);

// Hopper forward on warpgroup MMA: only for sm_90 devices, and only in builds that compiled
// sm_90a (the caller checks both); head_dim 64 or 128, Float16 or BFloat16.
bool attention_fwd_sm90_supported(DType dtype, int head_dim);
cudaError_t launch_attention_fwd_sm90(const AttentionFwdParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_attention_bwd(const AttentionBwdParams& p, DType dtype, cudaStream_t stream);
// Hopper backward on warpgroup MMA, under the same conditions as the Hopper forward; as
// deterministic as launch_attention_bwd.
bool attention_bwd_sm90_supported(DType dtype, int head_dim);
cudaError_t launch_attention_bwd_sm90(const AttentionBwdParams& p, DType dtype, cudaStream_t stream);

// Per head-dim instantiations (one .cu file each, so they compile in parallel).
template <int HeadDim>
cudaError_t launch_attention_fwd_hdim(const AttentionFwdParams& p, DType dtype, cudaStream_t stream);
template <int HeadDim>
cudaError_t launch_attention_bwd_hdim(const AttentionBwdParams& p, DType dtype, cudaStream_t stream);
template <int HeadDim>
cudaError_t launch_attention_fwd_sm90_hdim(const AttentionFwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_fwd_sm90_hdim<64>(const AttentionFwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_fwd_sm90_hdim<128>(const AttentionFwdParams& p, DType dtype, cudaStream_t stream);
template <int HeadDim>
cudaError_t launch_attention_bwd_sm90_hdim(const AttentionBwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_bwd_sm90_hdim<64>(const AttentionBwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_bwd_sm90_hdim<128>(const AttentionBwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_fwd_hdim<32>(const AttentionFwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_bwd_hdim<32>(const AttentionBwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_fwd_hdim<64>(const AttentionFwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_bwd_hdim<64>(const AttentionBwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_fwd_hdim<96>(const AttentionFwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_bwd_hdim<96>(const AttentionBwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_fwd_hdim<128>(const AttentionFwdParams& p, DType dtype, cudaStream_t stream);
template <>
cudaError_t launch_attention_bwd_hdim<128>(const AttentionBwdParams& p, DType dtype, cudaStream_t stream);

}  // namespace fusedops
