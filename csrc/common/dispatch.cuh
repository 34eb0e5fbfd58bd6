// Maps a runtime DType onto the CUDA element type: the one place per launcher where dtype
// dispatch happens.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "dtype.h"

#define FUSEDOPS_DISPATCH_FLOAT_TYPES(DTYPE, T, ...)   \
  [&]() -> cudaError_t {                               \
    switch (DTYPE) {                                   \
      case ::fusedops::DType::Float32: {               \
        using T = float;                               \
        return __VA_ARGS__();                          \
      }                                                \
      case ::fusedops::DType::Float16: {               \
        using T = __half;                              \
        return __VA_ARGS__();                          \
      }                                                \
      case ::fusedops::DType::BFloat16: {              \
        using T = __nv_bfloat16;                       \
        return __VA_ARGS__();                          \
      }                                                \
      case ::fusedops::DType::Float64: {               \
        using T = double;                              \
        return __VA_ARGS__();                          \
      }                                                \
    }                                                  \
    return cudaErrorInvalidValue;                      \
  }()
