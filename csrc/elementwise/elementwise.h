// Launchers for the fused elementwise ops. Plain C++: pointers, sizes and a stream, no torch.
// Every tensor is contiguous with `numel` elements; column vectors (scale, bias) have `cols`
// elements and broadcast along the last dim. A null column vector means "absent".
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/dtype.h"
#include "../common/philox.h"

namespace fusedops {

struct ScaleBiasParams {
  const void* x;
  const void* scale;  // optional column vector; else scale_value
  const void* bias;   // optional column vector; else bias_value
  void* out;
  double scale_value;
  double bias_value;
  int64_t numel;
  int64_t cols;
};

// Forward: out = gelu(x + bias). Backward: out = grad * gelu'(x + bias).
struct BiasGeluParams {
  const void* x;
  const void* bias;  // optional column vector
  const void* grad;  // backward only
  void* out;
  int64_t numel;
  int64_t cols;
  bool tanh_approximation;
};

// out = residual + dropout(x + bias). With dropout off (p = 0 or eval) no numbers are drawn.
// When dropout is on, the kernel records the (seed, offset) it used in rng_state[0..1], which
// is all the backward needs to regenerate the mask.
struct BiasDropoutAddParams {
  const void* x;
  const void* bias;  // optional column vector
  const void* residual;
  void* out;
  int64_t* rng_state;
  int64_t numel;
  int64_t cols;
  double p;
  bool dropout;
  PhiloxArgs philox;
};

// grad_in = grad * mask / (1 - p), the mask regenerated from rng_state = (seed, offset).
struct DropoutBackwardParams {
  const void* grad;
  const int64_t* rng_state;
  void* grad_in;
  int64_t numel;
  double p;
};

struct SwigluParams {
  const void* gate;
  const void* up;
  void* out;
  int64_t numel;
};

struct SwigluBackwardParams {
  const void* grad;
  const void* gate;
  const void* up;
  void* grad_gate;
  void* grad_up;
  int64_t numel;
};

cudaError_t launch_scale_bias(const ScaleBiasParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_bias_gelu_fwd(const BiasGeluParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_bias_gelu_bwd(const BiasGeluParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_bias_dropout_add_fwd(const BiasDropoutAddParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_dropout_bwd(const DropoutBackwardParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_swiglu_fwd(const SwigluParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_swiglu_bwd(const SwigluBackwardParams& p, DType dtype, cudaStream_t stream);

}  // namespace fusedops
