// Kernel tests without torch (built by CMake, run by ctest; needs a GPU to pass). Each case
// fills inputs on the host, runs a launcher on device memory and compares with a host loop.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
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

// Masked softmax over H heads of [L, cols] scores sharing one [L, cols] mask, read as vectors
// by register rows (cols 1000, 4096) and cluster rows (20000); at L = 4096 the rows between two
// heads' reads of a mask row move more than 16 MB, and one-row blocks take the heads-inner grid
// (row_grid).
struct MaskedCase {
  int heads = 3, length = 6, cols;
  int64_t rows() const { return int64_t(heads) * length; }
  size_t size() const { return size_t(rows()) * cols; }
  size_t mask_size() const { return size_t(length) * cols; }
  fusedops::MaskLayout layout(fusedops::MaskKind kind, const void* data) const {
    fusedops::MaskLayout m;
    m.kind = kind;
    m.data = data;
    m.lead_sizes[2] = heads;
    m.lead_sizes[3] = length;
    m.lead_strides[3] = cols;
    m.col_stride = 1;
    return m;
  }
};

// Runs the forward and the backward of a masked softmax on device tensors; out and dx to the host.
template <typename T>
bool run_masked(const MaskedCase& c, fusedops::DType dtype, const fusedops::MaskLayout& mask, const T* x, const T* dy,
                bool causal, double p, std::vector<T>& out, std::vector<T>& dx) {
  T *dev_out, *dev_dx;
  float* lse;
  int64_t* rng_state;
  const size_t bytes = c.size() * sizeof(T);
  CHECK_CUDA(cudaMalloc(&dev_out, bytes));
  CHECK_CUDA(cudaMalloc(&dev_dx, bytes));
  CHECK_CUDA(cudaMalloc(&lse, c.rows() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&rng_state, 2 * sizeof(int64_t)));
  CHECK_CUDA(cudaMemset(dev_out, 0xff, bytes));  // NaN poison
  CHECK_CUDA(cudaMemset(dev_dx, 0xff, bytes));
  fusedops::MaskedSoftmaxParams f{};
  f.x = x;
  f.out = dev_out;
  f.lse = lse;
  f.rng_state = rng_state;
  f.rows = c.rows();
  f.cols = c.cols;
  f.x_row_stride = c.cols;
  f.q_len = c.length;
  f.mask = mask;
  f.scale = 0.5;
  f.causal = causal;
  f.p = p;
  f.dropout = p > 0.0;
  f.philox.seed = 7;
  const fusedops::MaskedSoftmaxBackwardParams b{dy,     x,        lse,  rng_state, dev_dx, f.rows, c.cols, c.cols,
                                                c.cols, c.length, mask, f.scale,   causal, p,      p > 0.0};
  CHECK_CUDA(fusedops::launch_masked_softmax_fwd(f, dtype, nullptr));
  CHECK_CUDA(fusedops::launch_masked_softmax_bwd(b, dtype, nullptr));
  out.resize(c.size());
  dx.resize(c.size());
  CHECK_CUDA(cudaMemcpy(out.data(), dev_out, bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(dx.data(), dev_dx, bytes, cudaMemcpyDeviceToHost));
  for (void* ptr : {static_cast<void*>(dev_out), static_cast<void*>(dev_dx), static_cast<void*>(lse),
                    static_cast<void*>(rng_state)})
    cudaFree(ptr);
  return true;
}

template <typename T> bool upload(const std::vector<T>& host, T** dev) {
  CHECK_CUDA(cudaMalloc(dev, host.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(*dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return true;
}

// fp32: an additive mask of 0 and -inf gives the bool mask's output and gradient bit for bit
// (the same logits either way), with and without causal masking and dropout.
bool test_additive_mask_is_bool_mask_fp32(int cols, int length = 6) {
  const MaskedCase c{3, length, cols};
  const std::vector<float> x_values = random_values(c.size(), 7), dy_values = random_values(c.size(), 8);
  const std::vector<float> draws = random_values(c.mask_size(), 9);
  std::vector<char> keep(c.mask_size());
  std::vector<float> additive(c.mask_size());
  for (size_t i = 0; i < keep.size(); ++i) {
    keep[i] = draws[i] > -1.2f;  // about 80% kept
    additive[i] = keep[i] ? 0.0f : -INFINITY;
  }
  float *x, *dy, *dev_additive;
  char* dev_keep;
  if (!upload(x_values, &x) || !upload(dy_values, &dy) || !upload(additive, &dev_additive) || !upload(keep, &dev_keep))
    return false;
  bool ok = true;
  for (const bool causal : {false, true}) {
    for (const double p : {0.0, 0.3}) {
      std::vector<float> out_bool, dx_bool, out_add, dx_add;
      ok = ok &&
           run_masked(c, fusedops::DType::Float32, c.layout(fusedops::MaskKind::Bool, dev_keep), x, dy, causal, p,
                      out_bool, dx_bool) &&
           run_masked(c, fusedops::DType::Float32, c.layout(fusedops::MaskKind::Additive, dev_additive), x, dy, causal,
                      p, out_add, dx_add);
      if (ok && (std::memcmp(out_bool.data(), out_add.data(), c.size() * sizeof(float)) != 0 ||
                 std::memcmp(dx_bool.data(), dx_add.data(), c.size() * sizeof(float)) != 0)) {
        std::fprintf(stderr, "masked softmax fp32 cols %d causal %d p %g: additive 0 / -inf differs from bool\n", cols,
                     causal, p);
        ok = false;
      }
    }
  }
  for (void* ptr : {static_cast<void*>(x), static_cast<void*>(dy), static_cast<void*>(dev_additive),
                    static_cast<void*>(dev_keep)})
    cudaFree(ptr);
  return ok;
}

// bf16 scores with an additive mask of bias values and -inf (a fully masked row included),
// against a double-precision host loop on the same bf16 inputs: y = softmax(x * scale + mask),
// dx = scale * y * (dy - sum(y * dy)); each may be off by its bf16 rounding (2^-9 relative,
// allowed twice) plus the fp32 arithmetic's error.
bool test_additive_mask_bf16(int cols, bool causal, int length = 6) {
  const MaskedCase c{3, length, cols};
  const std::vector<float> x_values = random_values(c.size(), 10), dy_values = random_values(c.size(), 11);
  const std::vector<float> mask_values = random_values(c.mask_size(), 12);
  std::vector<__nv_bfloat16> x(c.size()), dy(c.size()), mask(c.mask_size()), out, dx;
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = __float2bfloat16(x_values[i]);
    dy[i] = __float2bfloat16(dy_values[i]);
  }
  for (size_t i = 0; i < mask.size(); ++i) {
    const bool hidden = i % 7 == 3 || i / cols == 4;  // query 4's row fully masked
    mask[i] = __float2bfloat16(hidden ? -INFINITY : mask_values[i]);
  }
  __nv_bfloat16 *dev_x, *dev_dy, *dev_mask;
  if (!upload(x, &dev_x) || !upload(dy, &dev_dy) || !upload(mask, &dev_mask)) return false;
  bool ok = run_masked(c, fusedops::DType::BFloat16, c.layout(fusedops::MaskKind::Additive, dev_mask), dev_x, dev_dy,
                       causal, 0.0, out, dx);
  cudaFree(dev_x);
  cudaFree(dev_dy);
  cudaFree(dev_mask);
  std::vector<double> logits(cols), y(cols);
  for (int64_t r = 0; ok && r < c.rows(); ++r) {
    const size_t row = size_t(r) * cols, mask_row = size_t(r % c.length) * cols;
    double max_logit = -INFINITY;
    for (int j = 0; j < cols; ++j) {
      const bool visible = !causal || j <= r % c.length;
      logits[j] = visible ? double(__bfloat162float(x[row + j])) * 0.5 + __bfloat162float(mask[mask_row + j]) : -INFINITY;
      max_logit = std::max(max_logit, logits[j]);
    }
    double sum = 0, dot = 0, magnitude = 0;
    for (int j = 0; j < cols; ++j) sum += y[j] = max_logit == -INFINITY ? 0.0 : std::exp(logits[j] - max_logit);
    for (int j = 0; j < cols; ++j) {
      y[j] = sum > 0 ? y[j] / sum : 0.0;
      dot += y[j] * __bfloat162float(dy[row + j]);
      magnitude += std::fabs(y[j] * __bfloat162float(dy[row + j]));
    }
    for (int j = 0; ok && j < cols; ++j) {
      const double expected_dx = 0.5 * y[j] * (__bfloat162float(dy[row + j]) - dot);
      const double got_y = __bfloat162float(out[row + j]), got_dx = __bfloat162float(dx[row + j]);
      if (!(std::fabs(got_y - y[j]) <= y[j] / 128.0 + 1e-6) ||
          !(std::fabs(got_dx - expected_dx) <= std::fabs(expected_dx) / 128.0 + y[j] * magnitude * 1e-4 + 1e-9)) {
        std::fprintf(stderr, "masked softmax bf16 additive cols %d causal %d: [%lld][%d] y %g (expected %g), dx %g (expected %g)\n",
                     cols, causal, static_cast<long long>(r), j, got_y, y[j], got_dx, expected_dx);
        ok = false;
      }
    }
  }
  return ok;
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
  for (const int cols : {1000, 4096, 20000}) {
    ok = ok && test_additive_mask_is_bool_mask_fp32(cols);
    for (const bool causal : {false, true}) ok = ok && test_additive_mask_bf16(cols, causal);
  }
  ok = ok && test_additive_mask_is_bool_mask_fp32(1024, 4096) && test_additive_mask_bf16(2048, true, 4096);
  std::printf("test_kernels: %s\n", ok ? "passed" : "FAILED");
  return ok ? 0 : 1;
}
