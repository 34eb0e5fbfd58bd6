// Autograd for the elementwise ops, in C++: a Python autograd kernel (torch.library.register_autograd)
// cost 3-5x the host time of the PyTorch op a fused op replaces on tiny tensors; this keeps a
// call one C++ dispatch deep. Registered for the Autograd key, so it serves CPU and CUDA alike;
// the forward redispatches below autograd to the device kernel, the backward calls the ops.
#include <torch/library.h>

#include "../common/autograd_utils.h"
#include "../common/torch_utils.h"

namespace fusedops {
namespace {

// Sum over every dim but the last, accumulated in fp32: the gradient of a per-column vector.
at::Tensor column_sum(const at::Tensor& t, at::ScalarType dtype) {
  const int64_t cols = t.dim() ? t.size(-1) : 1;
  return t.reshape({-1, cols}).sum(0, false, acc_type(dtype)).to(dtype);
}

// The forward ops, called below autograd.
at::Tensor scale_bias_fwd(const at::Tensor& x, const OptionalTensor& scale, const OptionalTensor& bias,
                          double scale_value, double bias_value) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto fwd = op<at::Tensor(const at::Tensor&, const OptionalTensor&, const OptionalTensor&, double,
                                        double)>("fusedops::scale_bias");
  return fwd.call(x, scale, bias, scale_value, bias_value);
}

at::Tensor bias_gelu_fwd(const at::Tensor& x, const OptionalTensor& bias, bool tanh) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto fwd = op<at::Tensor(const at::Tensor&, const OptionalTensor&, bool)>("fusedops::bias_gelu_fwd");
  return fwd.call(x, bias, tanh);
}

std::tuple<at::Tensor, at::Tensor> bias_dropout_add_fwd(const at::Tensor& x, const OptionalTensor& bias,
                                                        const at::Tensor& residual, double p, bool training) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto fwd = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptionalTensor&,
                                                                 const at::Tensor&, double, bool)>(
      "fusedops::bias_dropout_add_fwd");
  return fwd.call(x, bias, residual, p, training);
}

at::Tensor swiglu_fwd(const at::Tensor& gate, const at::Tensor& up) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto fwd = op<at::Tensor(const at::Tensor&, const at::Tensor&)>("fusedops::swiglu_fwd");
  return fwd.call(gate, up);
}

at::Tensor scale_bias_autograd(const at::Tensor& x, const OptionalTensor& scale, const OptionalTensor& bias,
                               double scale_value, double bias_value);

struct ScaleBias : torch::autograd::Function<ScaleBias> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& scale,
                            const OptionalTensor& bias, double scale_value, double bias_value) {
    ctx->saved_data["scale_value"] = scale_value;
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->save_for_backward({scale ? x : at::Tensor(), saved_or_undefined(scale)});
    return scale_bias_fwd(x, scale, bias, scale_value, bias_value);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &scale = saved[1], &grad = grads[0];
    at::Tensor grad_x, grad_scale, grad_bias;
    if (ctx->needs_input_grad(0)) {
      // Through the op's autograd (this Function), so a second backward of grad_x is right.
      grad_x = scale_bias_autograd(grad, as_optional(scale), c10::nullopt, ctx->saved_data["scale_value"].toDouble(),
                                   0.0);
    }
    if (needs_grad(ctx, scale, 1)) {
      grad_scale = column_sum(grad.to(acc_type(grad.scalar_type())).mul(x), scale.scalar_type());
    }
    // bias's edge follows scale's only when a scale tensor was given.
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(1 + scale.defined())) {
      grad_bias = column_sum(grad, grad.scalar_type());
    }
    return {grad_x, grad_scale, grad_bias, at::Tensor(), at::Tensor()};
  }
};

struct BiasGelu : torch::autograd::Function<BiasGelu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& bias, bool tanh) {
    ctx->saved_data["tanh"] = tanh;
    ctx->save_for_backward({x, saved_or_undefined(bias)});
    return bias_gelu_fwd(x, bias, tanh);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return once_differentiable("bias_gelu", {saved[0], saved[1], grads[0]}, [&]() -> variable_list {
      const at::Tensor &x = saved[0], &bias = saved[1];
      static const auto bwd =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, bool)>("fusedops::bias_gelu_bwd");
      const at::Tensor grad_x = bwd.call(grads[0], x, as_optional(bias), ctx->saved_data["tanh"].toBool());
      const at::Tensor grad_bias = needs_grad(ctx, bias, 1) ? column_sum(grad_x, bias.scalar_type()) : at::Tensor();
      return {grad_x, grad_bias, at::Tensor()};
    });
  }
};

struct BiasDropoutAdd : torch::autograd::Function<BiasDropoutAdd> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& bias,
                               const at::Tensor& residual, double p, bool training) {
    auto [out, rng_state] = bias_dropout_add_fwd(x, bias, residual, p, training);
    ctx->saved_data["p"] = p;
    ctx->saved_data["dropout"] = training && p > 0.0;
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->save_for_backward({rng_state});
    ctx->mark_non_differentiable({rng_state});
    return {out, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable("bias_dropout_add", {grads[0]}, [&]() -> variable_list {
      const at::Tensor& grad = grads[0];
      at::Tensor grad_x = grad;
      if (ctx->saved_data["dropout"].toBool()) {
        static const auto dropout_bwd =
            op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("fusedops::dropout_bwd");
        grad_x = dropout_bwd.call(grad, ctx->get_saved_variables()[0], ctx->saved_data["p"].toDouble());
      }
      const at::Tensor grad_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(1)
                                       ? column_sum(grad_x, grad.scalar_type())
                                       : at::Tensor();
      return {grad_x, grad_bias, grad, at::Tensor(), at::Tensor()};
    });
  }
};

struct Swiglu : torch::autograd::Function<Swiglu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return swiglu_fwd(gate, up);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return once_differentiable("swiglu", {saved[0], saved[1], grads[0]}, [&]() -> variable_list {
      static const auto bwd = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                     const at::Tensor&)>("fusedops::swiglu_bwd");
      auto [grad_gate, grad_up] = bwd.call(grads[0], saved[0], saved[1]);
      return {grad_gate, grad_up};
    });
  }
};

at::Tensor scale_bias_autograd(const at::Tensor& x, const OptionalTensor& scale, const OptionalTensor& bias,
                               double scale_value, double bias_value) {
  if (!records_grad(x, scale, bias)) return scale_bias_fwd(x, scale, bias, scale_value, bias_value);
  return ScaleBias::apply(x, scale, bias, scale_value, bias_value);
}

at::Tensor bias_gelu_autograd(const at::Tensor& x, const OptionalTensor& bias, bool tanh) {
  return records_grad(x, bias) ? BiasGelu::apply(x, bias, tanh) : bias_gelu_fwd(x, bias, tanh);
}

std::tuple<at::Tensor, at::Tensor> bias_dropout_add_autograd(const at::Tensor& x, const OptionalTensor& bias,
                                                             const at::Tensor& residual, double p, bool training) {
  if (!records_grad(x, bias, residual)) return bias_dropout_add_fwd(x, bias, residual, p, training);
  const auto outs = BiasDropoutAdd::apply(x, bias, residual, p, training);
  return {outs[0], outs[1]};
}

at::Tensor swiglu_autograd(const at::Tensor& gate, const at::Tensor& up) {
  return records_grad(gate, up) ? Swiglu::apply(gate, up) : swiglu_fwd(gate, up);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedops, Autograd, m) {
  m.impl("scale_bias", &scale_bias_autograd);
  m.impl("bias_gelu_fwd", &bias_gelu_autograd);
  m.impl("bias_dropout_add_fwd", &bias_dropout_add_autograd);
  m.impl("swiglu_fwd", &swiglu_autograd);
}

}  // namespace fusedops
