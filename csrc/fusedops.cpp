// Every fusedops operator schema, in one place. CUDA kernels are registered by the
// <family>/<family>_ops.cpp files; the CPU kernels (the plain-PyTorch reference), fake kernels
// and autograd formulas are registered from Python (fusedops/ops/).
#include <cuda_runtime_api.h>
#include <torch/extension.h>
#include <torch/library.h>

// FUSEDOPS_ARCH_LIST is set by the build (fusedops/_build.py): the GPU architectures compiled in.
#define FUSEDOPS_STRINGIFY_(x) #x
#define FUSEDOPS_STRINGIFY(x) FUSEDOPS_STRINGIFY_(x)

TORCH_LIBRARY(fusedops, m) {
  // Elementwise
  m.def("scale_bias(Tensor x, Tensor? scale, Tensor? bias, float scale_value, float bias_value) -> Tensor");
  m.def("bias_gelu_fwd(Tensor x, Tensor? bias, bool tanh) -> Tensor");
  m.def("bias_gelu_bwd(Tensor grad, Tensor x, Tensor? bias, bool tanh) -> Tensor");
  m.def("bias_dropout_add_fwd(Tensor x, Tensor? bias, Tensor residual, float p, bool training) -> (Tensor, Tensor)");
  m.def("dropout_bwd(Tensor grad, Tensor rng_state, float p) -> Tensor");
  m.def("swiglu_fwd(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_bwd(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");

  // Softmax
  m.def("softmax_fwd(Tensor x, float scale, bool log) -> Tensor");
  m.def("softmax_bwd(Tensor grad, Tensor y, float scale, bool log) -> Tensor");
  m.def("masked_softmax_fwd(Tensor x, Tensor? mask, float scale, bool causal, float p, bool training) -> (Tensor, Tensor, Tensor)");
  m.def("masked_softmax_bwd(Tensor grad, Tensor x, Tensor? mask, Tensor lse, Tensor rng_state, float scale, bool causal, float p) -> Tensor");

  // Norms. return_stats=False: the caller does not use mean / rstd (they come back empty), unless
  // autograd records the call and saves them for the backward.
  m.def("layer_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, *, bool return_stats=True) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, float eps, *, bool return_stats=True) -> (Tensor, Tensor)");
  m.def("add_layer_norm_fwd(Tensor input, Tensor residual, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, *, bool return_stats=True) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("add_rms_norm_fwd(Tensor input, Tensor residual, int[] normalized_shape, Tensor? weight, float eps, *, bool return_stats=True) -> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_bwd(Tensor grad_out, Tensor? grad_residual_out, Tensor input, Tensor mean, Tensor rstd, int[] normalized_shape, Tensor? weight, Tensor? bias) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor grad_out, Tensor? grad_residual_out, Tensor input, Tensor rstd, int[] normalized_shape, Tensor? weight) -> (Tensor, Tensor)");

  // Attention
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)");
  m.def(
      "attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
      "float scale) -> (Tensor, Tensor, Tensor)");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("build_info", [] {
    pybind11::dict info;
    info["arch_list"] = FUSEDOPS_STRINGIFY(FUSEDOPS_ARCH_LIST);
    info["cuda_version"] = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
    info["torch_version"] = TORCH_VERSION;
    return info;
  });
}
