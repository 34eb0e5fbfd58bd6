// Autograd for the softmax family, in C++ for the host time of a call (see
// elementwise_autograd.cpp).
#include <torch/library.h>

#include "../common/autograd_utils.h"

namespace fusedops {
namespace {

at::Tensor softmax_fwd(const at::Tensor& x, double scale, bool log) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto fwd = op<at::Tensor(const at::Tensor&, double, bool)>("fusedops::softmax_fwd");
  return fwd.call(x, scale, log);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_softmax_fwd(const at::Tensor& x, const OptionalTensor& mask,
                                                                  double scale, bool causal, double p, bool training) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto fwd = op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const OptionalTensor&, double, bool, double, bool)>("fusedops::masked_softmax_fwd");
  return fwd.call(x, mask, scale, causal, p, training);
}

struct Softmax : torch::autograd::Function<Softmax> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double scale, bool log) {
    at::Tensor y = softmax_fwd(x, scale, log);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["log"] = log;
    ctx->save_for_backward({y});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd =
        op<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool)>("fusedops::softmax_bwd");
    const bool log = ctx->saved_data["log"].toBool();
    const at::Tensor y = ctx->get_saved_variables()[0];
    return once_differentiable(log ? "log_softmax" : "softmax", {grads[0], y}, [&]() -> variable_list {
      const at::Tensor grad_x = bwd.call(grads[0], y, ctx->saved_data["scale"].toDouble(), log);
      return {grad_x, at::Tensor(), at::Tensor()};
    });
  }
};

struct MaskedSoftmax : torch::autograd::Function<MaskedSoftmax> {
  // Outputs: out, lse, rng_state; only out is differentiable. The mask gets no gradient.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& mask, double scale,
                               bool causal, double p, bool training) {
    auto [out, lse, rng_state] = masked_softmax_fwd(x, mask, scale, causal, p, training);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["p"] = training && p > 0.0 ? p : 0.0;
    ctx->save_for_backward({x, saved_or_undefined(mask), lse, rng_state});
    ctx->mark_non_differentiable({lse, rng_state});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for lse and rng_state
    return {out, lse, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                          const at::Tensor&, const at::Tensor&, double, bool, double)>(
        "fusedops::masked_softmax_bwd");
    const auto saved = ctx->get_saved_variables();
    return once_differentiable("masked_softmax", {grads[0], saved[0], saved[1]}, [&]() -> variable_list {
      const at::Tensor grad_x =
          grads[0].defined() ? bwd.call(grads[0], saved[0], as_optional(saved[1]), saved[2], saved[3],
                                        ctx->saved_data["scale"].toDouble(), ctx->saved_data["causal"].toBool(),
                                        ctx->saved_data["p"].toDouble())
                             : at::Tensor();
      return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    });
  }
};

at::Tensor softmax_autograd(const at::Tensor& x, double scale, bool log) {
  return records_grad(x) ? Softmax::apply(x, scale, log) : softmax_fwd(x, scale, log);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_softmax_autograd(const at::Tensor& x, const OptionalTensor& mask,
                                                                       double scale, bool causal, double p,
                                                                       bool training) {
  if (!records_grad(x, mask)) return masked_softmax_fwd(x, mask, scale, causal, p, training);
  const auto outs = MaskedSoftmax::apply(x, mask, scale, causal, p, training);
  return {outs[0], outs[1], outs[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedops, Autograd, m) {
  m.impl("softmax_fwd", &softmax_autograd);
  m.impl("masked_softmax_fwd", &masked_softmax_autograd);
}

}  // namespace fusedops
