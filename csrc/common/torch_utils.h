// Torch-side helpers shared by the *_ops.cpp files: dtype mapping, argument checks, the Philox
// state of PyTorch's CUDA generator. Kernels never see this header.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>

#include "dtype.h"
#include "philox.h"

namespace fusedops {

inline DType to_dtype(at::ScalarType t, const char* arg) {
  switch (t) {
    case at::kFloat: return DType::Float32;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kDouble: return DType::Float64;
    default: TORCH_CHECK(false, "fusedops: ", arg, " must be float16, bfloat16, float32 or float64, got ", t);
  }
  return DType::Float32;  // unreachable
}

// The arithmetic type of the kernels (and of saved statistics): fp64 for fp64, else fp32.
inline at::ScalarType acc_type(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* arg) {
  TORCH_CHECK(t.device() == ref.device(), "fusedops: ", arg, " is on ", t.device(), " but the input is on ",
              ref.device());
}

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& ref, const char* arg) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "fusedops: ", arg, " has dtype ", t.scalar_type(),
              " but the input has dtype ", ref.scalar_type());
}

inline void check_same_shape(const at::Tensor& t, const at::Tensor& ref, const char* arg, const char* ref_name) {
  TORCH_CHECK(t.sizes() == ref.sizes(), "fusedops: ", arg, " has shape ", t.sizes(), " but ", ref_name,
              " has shape ", ref.sizes());
}

// t must be on ref's device, with ref's dtype and shape.
inline void check_like(const at::Tensor& t, const at::Tensor& ref, const char* arg, const char* ref_name) {
  check_same_device(t, ref, arg);
  check_same_dtype(t, ref, arg);
  check_same_shape(t, ref, arg, ref_name);
}

// A per-column vector (bias, scale) broadcast along the last dim of `ref`.
inline void check_column_vector(const c10::optional<at::Tensor>& t, const at::Tensor& ref, const char* arg) {
  if (!t) return;
  check_same_device(*t, ref, arg);
  check_same_dtype(*t, ref, arg);
  TORCH_CHECK(t->dim() == 1 && ref.dim() >= 1 && t->size(0) == ref.size(-1), "fusedops: ", arg,
              " must be 1-D with size input.shape[-1] = ", ref.dim() ? ref.size(-1) : 0, ", got shape ",
              t->sizes());
  TORCH_CHECK(t->is_contiguous(), "fusedops: ", arg, " must be contiguous");
}

inline const void* data_or_null(const c10::optional<at::Tensor>& t) {
  return t ? t->data_ptr() : nullptr;
}

// The (seed, offset) a dropout kernel records for its backward: left to the kernel when it writes
// it (no fill kernel a call), zeros when no kernel does.
inline at::Tensor rng_state_tensor(const at::Tensor& like, bool written_by_kernel) {
  const auto options = like.options().dtype(at::kLong);
  return written_by_kernel ? at::empty({2}, options) : at::zeros({2}, options);
}

// Reserves `increment` counter values of the default CUDA generator for one kernel launch.
inline PhiloxArgs philox_args(uint64_t increment) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(c10::nullopt,
                                                                    at::cuda::detail::getDefaultCUDAGenerator());
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(increment);
  }
  PhiloxArgs args;
  args.captured = state.captured_;
  if (state.captured_) {
    args.seed_ptr = state.seed_.ptr;
    args.offset_ptr = state.offset_.ptr;
    args.offset_intragraph = state.offset_intragraph_;
  } else {
    args.seed = state.seed_.val;
    args.offset = state.offset_.val;
  }
  return args;
}

}  // namespace fusedops
