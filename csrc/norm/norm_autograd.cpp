// Autograd for LayerNorm / RMSNorm and their residual-add variants, in C++ for the host time of a
// call (see elementwise_autograd.cpp). One Function serves the four ops, as norm_fwd / norm_bwd do
// in norm_ops.cpp: the residual is an optional input, `rms` picks the op.
#include <torch/library.h>

#include "../common/autograd_utils.h"

namespace fusedops {
namespace {

using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The forward op, called below autograd. Outputs: out, residual_out (with a residual), mean
// (LayerNorm), rstd (empty without return_stats).
variable_list norm_fwd(const at::Tensor& input, const OptionalTensor& residual, at::IntArrayRef shape,
                       const OptionalTensor& weight, const OptionalTensor& bias, double eps, bool rms,
                       bool return_stats) {
  at::AutoDispatchBelowADInplaceOrView guard;
  if (residual && rms) {
    static const auto fwd = op<Tensor3(const at::Tensor&, const at::Tensor&, at::IntArrayRef, const OptionalTensor&,
                                       double, bool)>("fusedops::add_rms_norm_fwd");
    auto [out, residual_out, rstd] = fwd.call(input, *residual, shape, weight, eps, return_stats);
    return {out, residual_out, rstd};
  }
  if (residual) {
    static const auto fwd =
        op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
            const at::Tensor&, const at::Tensor&, at::IntArrayRef, const OptionalTensor&, const OptionalTensor&,
            double, bool)>("fusedops::add_layer_norm_fwd");
    auto [out, residual_out, mean, rstd] = fwd.call(input, *residual, shape, weight, bias, eps, return_stats);
    return {out, residual_out, mean, rstd};
  }
  if (rms) {
    static const auto fwd = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::IntArrayRef,
                                                                  const OptionalTensor&, double, bool)>(
        "fusedops::rms_norm_fwd");
    auto [out, rstd] = fwd.call(input, shape, weight, eps, return_stats);
    return {out, rstd};
  }
  static const auto fwd = op<Tensor3(const at::Tensor&, at::IntArrayRef, const OptionalTensor&, const OptionalTensor&,
                                     double, bool)>("fusedops::layer_norm_fwd");
  auto [out, mean, rstd] = fwd.call(input, shape, weight, bias, eps, return_stats);
  return {out, mean, rstd};
}

struct Norm : torch::autograd::Function<Norm> {
  // Outputs as norm_fwd's; the statistics are non-differentiable.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const OptionalTensor& residual,
                               at::IntArrayRef shape, const OptionalTensor& weight, const OptionalTensor& bias,
                               double eps, bool rms) {
    variable_list outs = norm_fwd(input, residual, shape, weight, bias, eps, rms, true);
    const size_t stats = residual ? 2 : 1;
    const at::Tensor mean = rms ? at::Tensor() : outs[stats];
    // The backward normalizes residual_out = input + residual, and needs only bias's dtype.
    ctx->save_for_backward({residual ? outs[1] : input, saved_or_undefined(weight), saved_or_undefined(bias), mean,
                            outs.back()});
    ctx->saved_data["dims"] = static_cast<int64_t>(shape.size());
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["residual"] = residual.has_value();
    ctx->mark_non_differentiable(variable_list(outs.begin() + stats, outs.end()));
    // Unused outputs (the statistics, often residual_out) get no zero-filled gradient.
    ctx->set_materialize_grads(false);
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool rms = ctx->saved_data["rms"].toBool();
    const auto saved = ctx->get_saved_variables();
    variable_list inputs = saved;
    inputs.insert(inputs.end(), grads.begin(), grads.end());
    return once_differentiable(rms ? "rms_norm" : "layer_norm", inputs, [&]() -> variable_list {
      const at::Tensor &x = saved[0], &weight = saved[1], &bias = saved[2], &mean = saved[3], &rstd = saved[4];
      const bool has_residual = ctx->saved_data["residual"].toBool();
      const at::IntArrayRef shape = x.sizes().slice(x.dim() - ctx->saved_data["dims"].toInt());
      const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(x);
      const OptionalTensor grad_residual_out = has_residual ? as_optional(grads[1]) : c10::nullopt;
      // Edges of the tensor inputs given: input, residual, weight, bias.
      const size_t weight_edge = has_residual ? 2 : 1;
      const bool weight_grad = needs_grad(ctx, weight, weight_edge);
      const bool bias_grad = needs_grad(ctx, bias, weight_edge + weight.defined());
      at::Tensor dx, dweight, dbias;
      if (rms) {
        static const auto bwd =
            op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptionalTensor&, const at::Tensor&,
                                                  const at::Tensor&, at::IntArrayRef, const OptionalTensor&)>(
                "fusedops::rms_norm_bwd");
        std::tie(dx, dweight) = bwd.call(grad_out, grad_residual_out, x, rstd, shape, as_optional(weight));
      } else {
        static const auto bwd =
            op<Tensor3(const at::Tensor&, const OptionalTensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, at::IntArrayRef, const OptionalTensor&, const OptionalTensor&)>(
                "fusedops::layer_norm_bwd");
        std::tie(dx, dweight, dbias) = bwd.call(grad_out, grad_residual_out, x, mean, rstd, shape, as_optional(weight),
                                                bias_grad ? as_optional(bias) : c10::nullopt);
      }
      // One gradient per argument of apply: input, residual, shape, weight, bias, eps, rms.
      return {dx,
              has_residual ? dx : at::Tensor(),
              at::Tensor(),
              weight_grad ? dweight : at::Tensor(),
              bias_grad ? dbias : at::Tensor(),
              at::Tensor(),
              at::Tensor()};
    });
  }
};

// A call autograd records always saves the statistics (the backward reads them).
variable_list norm(const at::Tensor& input, const OptionalTensor& residual, at::IntArrayRef shape,
                   const OptionalTensor& weight, const OptionalTensor& bias, double eps, bool rms, bool return_stats) {
  if (records_grad(input, residual, weight, bias)) return Norm::apply(input, residual, shape, weight, bias, eps, rms);
  return norm_fwd(input, residual, shape, weight, bias, eps, rms, return_stats);
}

Tensor3 layer_norm_autograd(const at::Tensor& input, at::IntArrayRef shape, const OptionalTensor& weight,
                            const OptionalTensor& bias, double eps, bool return_stats) {
  const auto outs = norm(input, c10::nullopt, shape, weight, bias, eps, false, return_stats);
  return {outs[0], outs[1], outs[2]};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_autograd(const at::Tensor& input, at::IntArrayRef shape,
                                                     const OptionalTensor& weight, double eps, bool return_stats) {
  const auto outs = norm(input, c10::nullopt, shape, weight, c10::nullopt, eps, true, return_stats);
  return {outs[0], outs[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_autograd(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef shape, const OptionalTensor& weight,
    const OptionalTensor& bias, double eps, bool return_stats) {
  const auto outs = norm(input, residual, shape, weight, bias, eps, false, return_stats);
  return {outs[0], outs[1], outs[2], outs[3]};
}

Tensor3 add_rms_norm_autograd(const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef shape,
                              const OptionalTensor& weight, double eps, bool return_stats) {
  const auto outs = norm(input, residual, shape, weight, c10::nullopt, eps, true, return_stats);
  return {outs[0], outs[1], outs[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedops, Autograd, m) {
  m.impl("layer_norm_fwd", &layer_norm_autograd);
  m.impl("rms_norm_fwd", &rms_norm_autograd);
  m.impl("add_layer_norm_fwd", &add_layer_norm_autograd);
  m.impl("add_rms_norm_fwd", &add_rms_norm_autograd);
}

}  // namespace fusedops
