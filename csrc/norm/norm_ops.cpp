// Torch side of LayerNorm / RMSNorm: argument checks, allocation, stream, launch.
// The input is viewed as [rows, cols] with cols = prod(normalized_shape). Operands whose
// normalized dims are contiguous (offset views and row-strided views included) are used in
// place; any other layout is copied once, explicitly, to a contiguous tensor.
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include "../common/torch_utils.h"
#include "norm.h"

namespace fusedops {
namespace {

int64_t normalized_cols(const at::Tensor& input, at::IntArrayRef shape) {
  const int64_t k = static_cast<int64_t>(shape.size());
  TORCH_CHECK(k >= 1 && k <= input.dim() && input.sizes().slice(input.dim() - k) == shape,
              "fusedops: normalized_shape ", shape, " must equal the trailing dims of input, of shape ",
              input.sizes());
  return c10::multiply_integers(shape);
}

at::IntArrayRef leading_shape(const at::Tensor& input, at::IntArrayRef shape) {
  return input.sizes().slice(0, input.dim() - shape.size());
}

// A [rows, cols] view of t with unit column stride, or a contiguous copy when none exists.
at::Tensor as_rows(const at::Tensor& t, int64_t rows, int64_t cols) {
  at::Tensor view = t.reshape({rows, cols});
  return cols == 1 || view.stride(1) == 1 ? view : view.contiguous();
}

int64_t row_stride(const at::Tensor& rows_view) {
  return rows_view.size(0) > 1 ? rows_view.stride(0) : rows_view.size(1);
}

// Weight and bias: the input's dtype, or fp32 with fp16/bf16 input; both the same dtype.
DType check_affine(const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                   const at::Tensor& input, at::IntArrayRef shape) {
  const at::ScalarType x_type = input.scalar_type();
  c10::optional<at::ScalarType> w_type;
  for (const auto& [t, name] : {std::pair{&weight, "weight"}, std::pair{&bias, "bias"}}) {
    if (!*t) continue;
    const at::Tensor& v = **t;
    check_same_device(v, input, name);
    TORCH_CHECK(v.sizes() == shape, "fusedops: ", name, " must have shape normalized_shape = ", shape, ", got ",
                v.sizes());
    TORCH_CHECK(v.is_contiguous(), "fusedops: ", name, " must be contiguous");
    const bool mixed = v.scalar_type() == at::kFloat && (x_type == at::kHalf || x_type == at::kBFloat16);
    TORCH_CHECK(v.scalar_type() == x_type || mixed, "fusedops: ", name, " has dtype ", v.scalar_type(),
                " but must have the input's dtype ", x_type, " (or float32 with float16/bfloat16 input)");
    TORCH_CHECK(!w_type || *w_type == v.scalar_type(), "fusedops: bias has dtype ", v.scalar_type(),
                " but weight has dtype ", *w_type);
    w_type = v.scalar_type();
  }
  return to_dtype(w_type.value_or(x_type), "weight");
}

void check_stats(const at::Tensor& t, const at::Tensor& input, int64_t rows, const char* name) {
  check_same_device(t, input, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == rows && t.is_contiguous(), "fusedops: ", name,
              " must be the contiguous float32 tensor of ", rows, " elements returned by the forward");
}

// out, residual_out (undefined without residual), mean (undefined for RMSNorm), rstd; without
// return_stats mean and rstd are empty and the kernel does not write them.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd(const at::Tensor& input,
                                                                    const c10::optional<at::Tensor>& residual,
                                                                    at::IntArrayRef shape,
                                                                    const c10::optional<at::Tensor>& weight,
                                                                    const c10::optional<at::Tensor>& bias, double eps,
                                                                    bool rms, bool return_stats) {
  const DType x_dtype = to_dtype(input.scalar_type(), "input");
  const int64_t cols = normalized_cols(input, shape);
  const DType w_dtype = check_affine(weight, bias, input, shape);
  if (residual) {
    check_same_device(*residual, input, "residual");
    check_same_dtype(*residual, input, "residual");
    TORCH_CHECK(residual->sizes() == input.sizes(), "fusedops: residual has shape ", residual->sizes(),
                " but input has shape ", input.sizes());
  }
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  const at::Tensor x = as_rows(input, rows, cols);
  const at::Tensor r = residual ? as_rows(*residual, rows, cols) : at::Tensor();
  at::Tensor out = at::empty(input.sizes(), input.options());
  at::Tensor residual_out = residual ? at::empty(input.sizes(), input.options()) : at::Tensor();
  const auto stats_options = input.options().dtype(at::kFloat);
  const auto stats = [&] {
    return return_stats ? at::empty(leading_shape(input, shape), stats_options) : at::empty({0}, stats_options);
  };
  at::Tensor mean = rms ? at::Tensor() : stats();
  at::Tensor rstd = stats();
  NormFwdParams p{};
  p.x = x.data_ptr();
  p.residual = residual ? r.data_ptr() : nullptr;
  p.weight = data_or_null(weight);
  p.bias = data_or_null(bias);
  p.out = out.data_ptr();
  p.residual_out = residual ? residual_out.data_ptr() : nullptr;
  p.mean = rms || !return_stats ? nullptr : mean.data_ptr<float>();
  p.rstd = return_stats ? rstd.data_ptr<float>() : nullptr;
  p.rows = rows;
  p.cols = cols;
  p.x_row_stride = row_stride(x);
  p.residual_row_stride = residual ? row_stride(r) : 0;
  p.eps = eps;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(rms ? launch_rms_norm_fwd(p, x_dtype, w_dtype, stream)
                     : launch_layer_norm_fwd(p, x_dtype, w_dtype, stream));
  return {out, residual_out, mean, rstd};
}

// dx, dweight (empty without weight), dbias (empty without bias). Only bias's dtype is read.
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(const at::Tensor& grad_out,
                                                        const c10::optional<at::Tensor>& grad_residual_out,
                                                        const at::Tensor& input, const c10::optional<at::Tensor>& mean,
                                                        const at::Tensor& rstd, at::IntArrayRef shape,
                                                        const c10::optional<at::Tensor>& weight,
                                                        const c10::optional<at::Tensor>& bias, bool rms) {
  const DType x_dtype = to_dtype(input.scalar_type(), "input");
  const int64_t cols = normalized_cols(input, shape);
  const DType w_dtype = check_affine(weight, bias, input, shape);
  const at::Tensor* grads[] = {&grad_out, grad_residual_out ? &*grad_residual_out : nullptr};
  const char* grad_names[] = {"grad_out", "grad_residual_out"};
  for (int i = 0; i < 2; ++i) {
    if (grads[i] == nullptr) continue;
    const at::Tensor* t = grads[i];
    const char* name = grad_names[i];
    check_same_device(*t, input, name);
    check_same_dtype(*t, input, name);
    TORCH_CHECK(t->sizes() == input.sizes(), "fusedops: ", name, " has shape ", t->sizes(), " but input has shape ",
                input.sizes());
  }
  const int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  if (!rms) {
    TORCH_CHECK(mean.has_value(), "fusedops: mean is required for layer_norm_bwd");
    check_stats(*mean, input, rows, "mean");
  }
  check_stats(rstd, input, rows, "rstd");
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = as_rows(input, rows, cols), dy = as_rows(grad_out, rows, cols);
  const at::Tensor dres = grad_residual_out ? as_rows(*grad_residual_out, rows, cols) : at::Tensor();
  at::Tensor dx = at::empty(input.sizes(), input.options());
  const auto w_options = input.options().dtype(weight ? weight->scalar_type() : input.scalar_type());
  const auto b_options = input.options().dtype(bias ? bias->scalar_type() : input.scalar_type());
  at::Tensor dweight = at::empty(weight ? shape : at::IntArrayRef{0}, w_options);
  at::Tensor dbias = at::empty(bias ? shape : at::IntArrayRef{0}, b_options);
  NormBwdParams p{};
  p.dy = dy.data_ptr();
  p.dresidual_out = grad_residual_out ? dres.data_ptr() : nullptr;
  p.x = x.data_ptr();
  p.mean = rms ? nullptr : mean->data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.weight = data_or_null(weight);
  p.dx = dx.data_ptr();
  p.rows = rows;
  p.cols = cols;
  p.dy_row_stride = row_stride(dy);
  p.dresidual_out_row_stride = grad_residual_out ? row_stride(dres) : 0;
  p.x_row_stride = row_stride(x);
  p.dweight = weight ? dweight.data_ptr() : nullptr;
  p.dbias = bias ? dbias.data_ptr() : nullptr;
  at::Tensor weight_partial, bias_partial;  // alive until the launches below are queued
  if ((weight || bias) && rows > 0 && cols > 0) {
    const int64_t blocks = norm_bwd_blocks(p, x_dtype, w_dtype, rms);
    const auto partial_options = input.options().dtype(x_dtype == DType::Float64 ? at::kDouble : at::kFloat);
    if (weight) weight_partial = at::empty({blocks, cols}, partial_options);
    if (bias) bias_partial = at::empty({blocks, cols}, partial_options);
    p.weight_partial = weight ? weight_partial.data_ptr() : nullptr;
    p.bias_partial = bias ? bias_partial.data_ptr() : nullptr;
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(rms ? launch_rms_norm_bwd(p, x_dtype, w_dtype, stream)
                     : launch_layer_norm_bwd(p, x_dtype, w_dtype, stream));
  return {dx, dweight, dbias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cuda(const at::Tensor& input, at::IntArrayRef shape,
                                                                   const c10::optional<at::Tensor>& weight,
                                                                   const c10::optional<at::Tensor>& bias, double eps,
                                                                   bool return_stats) {
  auto [out, unused, mean, rstd] = norm_fwd(input, c10::nullopt, shape, weight, bias, eps, false, return_stats);
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cuda(const at::Tensor& input, at::IntArrayRef shape,
                                                     const c10::optional<at::Tensor>& weight, double eps,
                                                     bool return_stats) {
  auto [out, unused, mean, rstd] = norm_fwd(input, c10::nullopt, shape, weight, c10::nullopt, eps, true, return_stats);
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd_cuda(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef shape,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps, bool return_stats) {
  return norm_fwd(input, residual, shape, weight, bias, eps, false, return_stats);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_fwd_cuda(const at::Tensor& input,
                                                                     const at::Tensor& residual, at::IntArrayRef shape,
                                                                     const c10::optional<at::Tensor>& weight,
                                                                     double eps, bool return_stats) {
  auto [out, residual_out, mean, rstd] = norm_fwd(input, residual, shape, weight, c10::nullopt, eps, true, return_stats);
  return {out, residual_out, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cuda(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_residual_out, const at::Tensor& input,
    const at::Tensor& mean, const at::Tensor& rstd, at::IntArrayRef shape, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias) {
  return norm_bwd(grad_out, grad_residual_out, input, mean, rstd, shape, weight, bias, false);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(const at::Tensor& grad_out,
                                                     const c10::optional<at::Tensor>& grad_residual_out,
                                                     const at::Tensor& input, const at::Tensor& rstd,
                                                     at::IntArrayRef shape, const c10::optional<at::Tensor>& weight) {
  auto [dx, dweight, unused] =
      norm_bwd(grad_out, grad_residual_out, input, c10::nullopt, rstd, shape, weight, c10::nullopt, true);
  return {dx, dweight};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cuda);
  m.impl("rms_norm_fwd", &rms_norm_fwd_cuda);
  m.impl("add_layer_norm_fwd", &add_layer_norm_fwd_cuda);
  m.impl("add_rms_norm_fwd", &add_rms_norm_fwd_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cuda);
}

}  // namespace fusedops
