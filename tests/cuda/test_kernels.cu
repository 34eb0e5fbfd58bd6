// Kernel tests without torch (built by CMake, run by ctest; needs a GPU to pass). Each case
// fills inputs on the host, runs a launcher on device memory and compares with a host loop.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "../../csrc/elementwise/elementwise.h"
#include "../../csrc/softmax/softmax.h"

namespace {

#define CHECK_CUDA(expr)                                                                        \
  do {                                                                                          \
    cudaError_t err_ = (expr);                                                                  \
    if (err_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      return false;                                                                             \
    }                                                                                           \
  } while (0)

std::vector<float> random_values(size_t n, unsigned seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    v[i] = static_cast<float>(seed >> 8) / 16777216.0f * 4.0f - 2.0f;
  }
  return v;
}

bool close(float a, float b) { return std::fabs(a - b) <= 1e-5f * (1.0f + std::fabs(b)); }

// x * scale[col] + 0.5 over rows x cols, with an odd cols so the scalar tail runs too.
bool test_scale_bias(int rows, int cols) {
  const size_t n = size_t(rows) * cols;
  std::vector<float> x = random_values(n, 1), scale = random_values(cols, 2), out(n, NAN);
  float *dx, *dscale, *dout;
  CHECK_CUDA(cudaMalloc(&dx, n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dscale, cols * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dout, n * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dscale, scale.data(), cols * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dout, 0xff, n * sizeof(float)));  // NaN poison
  const fusedops::ScaleBiasParams p{dx, dscale, nullptr, dout, 1.0, 0.5, int64_t(n), cols};
  CHECK_CUDA(fusedops::launch_scale_bias(p, fusedops::DType::Float32, nullptr));
  CHECK_CUDA(cudaMemcpy(out.data(), dout, n * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(dx);
  cudaFree(dscale);
  cudaFree(dout);
  for (size_t i = 0; i < n; ++i) {
    const float expected = x[i] * scale[i % cols] + 0.5f;
    if (!close(out[i], expected)) {
      std::fprintf(stderr, "scale_bias %dx%d: out[%zu] = %g, expected %g\n", rows, cols, i, out[i], expected);
      return false;
    }
  }
  return true;
}

// silu(gate) * up.
bool test_swiglu(size_t n) {
  std::vector<float> gate = random_values(n, 3), up = random_values(n, 4), out(n, NAN);
  float *dgate, *dup, *dout;
  CHECK_CUDA(cudaMalloc(&dgate, n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dup, n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dout, n * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dgate, gate.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dup, up.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dout, 0xff, n * sizeof(float)));
  const fusedops::SwigluParams p{dgate, dup, dout, int64_t(n)};
  CHECK_CUDA(fusedops::launch_swiglu_fwd(p, fusedops::DType::Float32, nullptr));
  CHECK_CUDA(cudaMemcpy(out.data(), dout, n * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(dgate);
  cudaFree(dup);
  cudaFree(dout);
  for (size_t i = 0; i < n; ++i) {
    const float expected = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    if (!close(out[i], expected)) {
      std::fprintf(stderr, "swiglu %zu: out[%zu] = %g, expected %g\n", n, i, out[i], expected);
      return false;
    }
  }
  return true;
}

// The bf16 softmax backward dx = y * (dy - sum(y * dy)) against a double-precision host loop on
// the same bf16 inputs: rows of 1001 columns (unaligned rows: the scalar path), 4096, 8192 and 16384
// (the straight-line rows of one vector a thread, and of two in 512- and 1024-thread blocks). dx may
// be off by its bf16 rounding (2^-9 relative, allowed twice) plus the fp32 row sum's error.
bool test_softmax_backward_bf16(int rows, int cols) {
  const size_t n = size_t(rows) * cols;
  const std::vector<float> y_values = random_values(n, 5), dy_values = random_values(n, 6);
  std::vector<__nv_bfloat16> y(n), dy(n), dx(n);
  for (size_t i = 0; i < n; ++i) {
    y[i] = __float2bfloat16(std::fabs(y_values[i]) / 2.0f);  // probabilities' range, [0, 1)
    dy[i] = __float2bfloat16(dy_values[i]);
  }
  __nv_bfloat16 *dev_y, *dev_dy, *dev_dx;
  const size_t bytes = n * sizeof(__nv_bfloat16);
  CHECK_CUDA(cudaMalloc(&dev_y, bytes));
  CHECK_CUDA(cudaMalloc(&dev_dy, bytes));
  CHECK_CUDA(cudaMalloc(&dev_dx, bytes));
  CHECK_CUDA(cudaMemcpy(dev_y, y.data(), bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dev_dy, dy.data(), bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dev_dx, 0xff, bytes));  // NaN poison
  const fusedops::SoftmaxBackwardParams p{dev_y, dev_dy, dev_dx, rows, cols, cols, cols, 1.0, false};
  CHECK_CUDA(fusedops::launch_softmax_bwd(p, fusedops::DType::BFloat16, nullptr));
  CHECK_CUDA(cudaMemcpy(dx.data(), dev_dx, bytes, cudaMemcpyDeviceToHost));
  cudaFree(dev_y);
  cudaFree(dev_dy);
  cudaFree(dev_dx);
  for (int r = 0; r < rows; ++r) {
    const size_t row = size_t(r) * cols;
    double sum = 0, magnitude = 0;
    for (int c = 0; c < cols; ++c) {
      const double yc = __bfloat162float(y[row + c]), dyc = __bfloat162float(dy[row + c]);
      sum += yc * dyc;
      magnitude += std::fabs(yc * dyc);
    }
    for (int c = 0; c < cols; ++c) {
      const double yc = __bfloat162float(y[row + c]);
      const double expected = yc * (__bfloat162float(dy[row + c]) - sum);
      const double got = __bfloat162float(dx[row + c]);
      if (!(std::fabs(got - expected) <= std::fabs(expected) / 128.0 + yc * magnitude * 1e-5)) {
        std::fprintf(stderr, "softmax backward bf16 %dx%d: dx[%d][%d] = %g, expected %g\n", rows, cols, r, c, got,
                     expected);
        return false;
      }
    }
  }
  return true;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "test_kernels: no CUDA device\n");
    return 1;
  }
  bool ok = test_scale_bias(3, 7) && test_scale_bias(129, 1024) && test_swiglu(1) && test_swiglu(100003);
  for (const int cols : {1001, 4096, 8192, 16384}) ok = ok && test_softmax_backward_bf16(600, cols);
  std::printf("test_kernels: %s\n", ok ? "passed" : "FAILED");
  return ok ? 0 : 1;
}
