// Helpers shared by the *_autograd.cpp files: C++ torch::autograd::Functions registered for the
// Autograd key, whose forward calls an op below autograd and whose backward calls the ops.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace fusedops {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = c10::optional<at::Tensor>;

// The typed handle of an op. Call sites keep it in a function-local static: the lookup hashes the
// name under the dispatcher's lock.
template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

inline at::Tensor saved_or_undefined(const OptionalTensor& t) { return t ? *t : at::Tensor(); }

inline OptionalTensor as_optional(const at::Tensor& t) { return t.defined() ? OptionalTensor(t) : c10::nullopt; }

inline bool requires_grad(const at::Tensor& t) { return t.requires_grad(); }
inline bool requires_grad(const OptionalTensor& t) { return t && t->requires_grad(); }

// Whether a call must be recorded for autograd. Calls that need no graph (inference, no_grad) skip
// building a Function's node and go straight below autograd.
template <class... Tensors>
bool records_grad(const Tensors&... inputs) {
  return at::GradMode::is_enabled() && (requires_grad(inputs) || ...);
}

// needs_input_grad counts only the tensor inputs given to apply (an absent optional tensor has no
// edge), not argument positions: `edge` is the index among those.
inline bool needs_grad(AutogradContext* ctx, const at::Tensor& input, size_t edge) {
  return input.defined() && ctx->needs_input_grad(edge);
}

// A new autograd node of type NodeT. Nodes are held by std::shared_ptr up to some torch 2.1x and
// by c10::intrusive_ptr after it: the pointer type Tensor::grad_fn() returns says which.
template <class NodeT, class... Args>
auto make_node(Args&&... args) {
  using NodePtr = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<NodeT>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<NodeT>(std::forward<Args>(args)...);
  }
}

// Runs a Function's backward `fn`, whose ops have no derivative, without recording a graph. With
// create_graph, the gradients hang off a node that raises once a second backward reaches it
// (through them to `inputs`: the incoming gradients and saved tensors they were computed from),
// rather than giving silently wrong second derivatives.
template <class Fn>
variable_list once_differentiable(const char* name, const variable_list& inputs, Fn&& fn) {
  const bool create_graph = at::GradMode::is_enabled();
  variable_list grads;
  {
    at::NoGradGuard no_grad;
    grads = fn();
  }
  if (!create_graph || !torch::autograd::compute_requires_grad(inputs)) return grads;
  const auto error = make_node<torch::autograd::Error>(
      std::string("fusedops: ") + name + " has no double backward (its gradient was differentiated again)",
      torch::autograd::collect_next_edges(inputs));
  for (at::Tensor& grad : grads) {
    if (!grad.defined()) continue;
    grad = grad.detach();
    torch::autograd::set_history(grad, error);
  }
  return grads;
}

}  // namespace fusedops
