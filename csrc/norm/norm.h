// Launchers for LayerNorm and RMSNorm, forward and backward. Plain C++: pointers, sizes and a
// stream, no torch. The input is viewed as `rows` rows of `cols` elements (cols = the product of
// normalized_shape); row r of a strided operand starts at ptr + r * row_stride and its elements
// are contiguous. Outputs (out, residual_out, dx) are contiguous [rows, cols]. Statistics are
// fp32 [rows]. A null optional pointer means "absent".
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/dtype.h"

namespace fusedops {

// out = norm(x') * weight + bias with x' = x, or x' = x + residual (rounded to the input dtype and
// written to residual_out) when residual is given.
struct NormFwdParams {
  const void* x;
  const void* residual;  // optional
  const void* weight;    // optional, [cols]
  const void* bias;      // optional, [cols] (LayerNorm only)
  void* out;
  void* residual_out;    // written iff residual is given
  float* mean;           // LayerNorm only; null with rstd when the statistics are not kept
  float* rstd;           // optional: not written when null
  int64_t rows;
  int64_t cols;
  int64_t x_row_stride;
  int64_t residual_row_stride;
  double eps;
};

// dx = d norm(x) / dx applied to dy (+ dresidual_out, the gradient reaching residual_out in the
// add_* variants). dweight / dbias: each of `blocks` blocks writes its column sums over its rows to
// partial[block, cols] (accumulation type: fp32, fp64 for fp64 input); a second kernel adds the
// partials of every block in a fixed order, so results are bitwise reproducible.
struct NormBwdParams {
  const void* dy;
  const void* dresidual_out;  // optional
  const void* x;              // the normalized input (residual_out in the add_* variants)
  const float* mean;          // LayerNorm only
  const float* rstd;
  const void* weight;         // optional
  void* dx;
  void* dweight;              // optional: needs weight_partial
  void* dbias;                // optional: needs bias_partial
  void* weight_partial;       // [blocks, cols]
  void* bias_partial;         // [blocks, cols]
  int64_t rows;
  int64_t cols;
  int64_t dy_row_stride;
  int64_t dresidual_out_row_stride;
  int64_t x_row_stride;
};

// x_dtype: the input's; w_dtype: weight and bias (the input's, or Float32 with fp16/bf16 input).
cudaError_t launch_layer_norm_fwd(const NormFwdParams& p, DType x_dtype, DType w_dtype, cudaStream_t stream);
cudaError_t launch_rms_norm_fwd(const NormFwdParams& p, DType x_dtype, DType w_dtype, cudaStream_t stream);
cudaError_t launch_layer_norm_bwd(const NormBwdParams& p, DType x_dtype, DType w_dtype, cudaStream_t stream);
cudaError_t launch_rms_norm_bwd(const NormBwdParams& p, DType x_dtype, DType w_dtype, cudaStream_t stream);

// Number of blocks the backward launches for these operands: the row count of the partial
// buffers. Depends on the current device (its SM count), the sizes, the operands' alignment and
// which of dweight / dbias are requested; the partial pointers are not read. Returns 0 for an
// unsupported dtype pair.
int64_t norm_bwd_blocks(const NormBwdParams& p, DType x_dtype, DType w_dtype, bool rms);

}  // namespace fusedops
