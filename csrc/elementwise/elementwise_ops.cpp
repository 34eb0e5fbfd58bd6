// Torch side of the elementwise ops: argument checks, allocation, stream, launch.
// Elementwise kernels walk memory linearly, so a non-contiguous input is copied once here
// (documented in the README); contiguous inputs, offset views included, are used in place.
#include <torch/library.h>

#include "../common/torch_utils.h"
#include "elementwise.h"

namespace fusedops {
namespace {

int64_t last_dim(const at::Tensor& x) { return x.dim() ? x.size(-1) : 1; }

at::Tensor scale_bias_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& scale,
                           const c10::optional<at::Tensor>& bias, double scale_value, double bias_value) {
  const DType dtype = to_dtype(x.scalar_type(), "x");
  check_column_vector(scale, x, "scale");
  check_column_vector(bias, x, "bias");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const ScaleBiasParams p{xc.data_ptr(),   data_or_null(scale), data_or_null(bias), out.data_ptr(),
                          scale_value,     bias_value,          xc.numel(),         last_dim(x)};
  C10_CUDA_CHECK(launch_scale_bias(p, dtype, c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor bias_gelu_fwd_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& bias, bool tanh) {
  const DType dtype = to_dtype(x.scalar_type(), "x");
  check_column_vector(bias, x, "bias");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const BiasGeluParams p{xc.data_ptr(), data_or_null(bias), nullptr, out.data_ptr(), xc.numel(), last_dim(x), tanh};
  C10_CUDA_CHECK(launch_bias_gelu_fwd(p, dtype, c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor bias_gelu_bwd_cuda(const at::Tensor& grad, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                              bool tanh) {
  const DType dtype = to_dtype(x.scalar_type(), "x");
  check_like(grad, x, "grad", "x");
  check_column_vector(bias, x, "bias");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), gc = grad.contiguous();
  at::Tensor out = at::empty_like(xc);
  const BiasGeluParams p{xc.data_ptr(), data_or_null(bias), gc.data_ptr(), out.data_ptr(),
                         xc.numel(),    last_dim(x),        tanh};
  C10_CUDA_CHECK(launch_bias_gelu_bwd(p, dtype, c10::cuda::getCurrentCUDAStream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> bias_dropout_add_fwd_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                                             const at::Tensor& residual, double p, bool training) {
  const DType dtype = to_dtype(x.scalar_type(), "x");
  check_column_vector(bias, x, "bias");
  check_like(residual, x, "residual", "x");
  TORCH_CHECK(p >= 0.0 && p < 1.0, "fusedops: p must be in [0, 1), got ", p);
  const c10::cuda::CUDAGuard guard(x.device());
  const bool dropout = training && p > 0.0;
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous();
  at::Tensor out = at::empty_like(xc);
  const bool draws = dropout && xc.numel() > 0;
  at::Tensor rng_state = rng_state_tensor(x, draws);  // the kernel writes it when it draws
  BiasDropoutAddParams params{xc.data_ptr(),  data_or_null(bias), rc.data_ptr(), out.data_ptr(),
                              rng_state.data_ptr<int64_t>(),     xc.numel(),     last_dim(x),   p, dropout, {}};
  if (draws) params.philox = philox_args(4);
  C10_CUDA_CHECK(launch_bias_dropout_add_fwd(params, dtype, c10::cuda::getCurrentCUDAStream()));
  return {out, rng_state};
}

at::Tensor dropout_bwd_cuda(const at::Tensor& grad, const at::Tensor& rng_state, double p) {
  const DType dtype = to_dtype(grad.scalar_type(), "grad");
  check_same_device(rng_state, grad, "rng_state");
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.numel() == 2 && rng_state.is_contiguous(),
              "fusedops: rng_state must be the int64 tensor of 2 elements returned by the forward");
  TORCH_CHECK(p >= 0.0 && p < 1.0, "fusedops: p must be in [0, 1), got ", p);
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor gc = grad.contiguous();
  at::Tensor out = at::empty_like(gc);
  const DropoutBackwardParams params{gc.data_ptr(), rng_state.data_ptr<int64_t>(), out.data_ptr(), gc.numel(), p};
  C10_CUDA_CHECK(launch_dropout_bwd(params, dtype, c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor swiglu_fwd_cuda(const at::Tensor& gate, const at::Tensor& up) {
  const DType dtype = to_dtype(gate.scalar_type(), "gate");
  check_like(up, gate, "up", "gate");
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor gc = gate.contiguous(), uc = up.contiguous();
  at::Tensor out = at::empty_like(gc);
  const SwigluParams p{gc.data_ptr(), uc.data_ptr(), out.data_ptr(), gc.numel()};
  C10_CUDA_CHECK(launch_swiglu_fwd(p, dtype, c10::cuda::getCurrentCUDAStream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_bwd_cuda(const at::Tensor& grad, const at::Tensor& gate,
                                                   const at::Tensor& up) {
  const DType dtype = to_dtype(gate.scalar_type(), "gate");
  check_like(up, gate, "up", "gate");
  check_like(grad, gate, "grad", "gate");
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor dc = grad.contiguous(), gc = gate.contiguous(), uc = up.contiguous();
  at::Tensor grad_gate = at::empty_like(gc), grad_up = at::empty_like(uc);
  const SwigluBackwardParams p{dc.data_ptr(),        gc.data_ptr(),      uc.data_ptr(),
                               grad_gate.data_ptr(), grad_up.data_ptr(), gc.numel()};
  C10_CUDA_CHECK(launch_swiglu_bwd(p, dtype, c10::cuda::getCurrentCUDAStream()));
  return {grad_gate, grad_up};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("scale_bias", &scale_bias_cuda);
  m.impl("bias_gelu_fwd", &bias_gelu_fwd_cuda);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd_cuda);
  m.impl("bias_dropout_add_fwd", &bias_dropout_add_fwd_cuda);
  m.impl("dropout_bwd", &dropout_bwd_cuda);
  m.impl("swiglu_fwd", &swiglu_fwd_cuda);
  m.impl("swiglu_bwd", &swiglu_bwd_cuda);
}

}  // namespace fusedops
