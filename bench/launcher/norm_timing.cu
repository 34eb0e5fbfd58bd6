// Launcher timing of the norm kernels (bench/launcher/timing.cuh): bf16 input and weight, 2^26
// elements, the bars' N; bytes counted as bench/norm.py counts them. Each backward also prints its
// partial rows (one row of column sums a block or cluster: the clusters the device holds at once).
#include "../../csrc/norm/norm_kernels.cu"
#include "timing.cuh"

#include <cstring>

namespace {

using fusedops::DType;
using T = __nv_bfloat16;
const int64_t kElements = timing::elements("NORM_TIMING_ELEMENTS", int64_t(1) << 26);
constexpr double kElemBytes = sizeof(T);

double norm_bytes(bool layer, bool add, bool backward, int64_t rows, int64_t n) {
  const double row_tensors = add ? 4 : (backward ? 3 : 2);
  const double params = (layer ? 2 : 1) * n * kElemBytes;
  const double stats = (layer ? 2 : 1) * rows * 4.0;
  return row_tensors * rows * n * kElemBytes + params * (backward ? 2 : 1) + stats;
}

// stats: the forwards write mean / rstd (a training forward; else an inference one).
void time_shape(int64_t n, double copy, bool forward_only, bool stats) {
  const int64_t rows = kElements / n;
  const size_t size = static_cast<size_t>(kElements);
  T* x = timing::random_buffer<T>(size, 1, 2.0f, 0.5f);
  T* residual = timing::random_buffer<T>(size, 2);
  T* dy = timing::random_buffer<T>(size, 3);
  T* dresidual_out = timing::random_buffer<T>(size, 4);
  T* weight = timing::random_buffer<T>(n, 5, 0.5f, 1.0f);
  T* bias = timing::random_buffer<T>(n, 6);
  T* out = timing::empty_buffer<T>(size);
  T* residual_out = timing::empty_buffer<T>(size);
  T* dx = timing::empty_buffer<T>(size);
  T* dweight = timing::empty_buffer<T>(n);
  T* dbias = timing::empty_buffer<T>(n);
  float* mean = timing::empty_buffer<float>(rows);
  float* rstd = timing::empty_buffer<float>(rows);
  for (const bool add : {false, true}) {
    for (const bool layer : {true, false}) {
      fusedops::NormFwdParams f{x, add ? residual : nullptr, weight, layer ? bias : nullptr, out,
                                add ? residual_out : nullptr, layer && stats ? mean : nullptr, stats ? rstd : nullptr,
                                rows, n, n, n, 1e-5};
      auto forward = [&] {
        return layer ? fusedops::launch_layer_norm_fwd(f, DType::BFloat16, DType::BFloat16, nullptr)
                     : fusedops::launch_rms_norm_fwd(f, DType::BFloat16, DType::BFloat16, nullptr);
      };
      const char* prefix = add ? (layer ? "add_ln" : "add_rms") : (layer ? "ln" : "rms");
      char name[32];
      std::snprintf(name, sizeof(name), "%s_fwd", prefix);
      timing::report(name, n, norm_bytes(layer, add, false, rows, n), timing::median_ms(forward), copy);
      if (forward_only) continue;
      if (!stats) {  // the backward reads a training forward's statistics
        f.mean = layer ? mean : nullptr;
        f.rstd = rstd;
        forward();
      }
      fusedops::NormBwdParams b{dy, add ? dresidual_out : nullptr, add ? residual_out : x, layer ? mean : nullptr,
                                rstd, weight, dx, dweight, layer ? dbias : nullptr, nullptr, nullptr, rows, n, n, n, n};
      const int64_t blocks = fusedops::norm_bwd_blocks(b, DType::BFloat16, DType::BFloat16, !layer);
      std::printf("%s_bwd N=%lld: %lld partial rows\n", prefix, static_cast<long long>(n), static_cast<long long>(blocks));
      b.weight_partial = timing::empty_buffer<float>(blocks * n);
      b.bias_partial = layer ? timing::empty_buffer<float>(blocks * n) : nullptr;
      auto backward = [&] {
        return layer ? fusedops::launch_layer_norm_bwd(b, DType::BFloat16, DType::BFloat16, nullptr)
                     : fusedops::launch_rms_norm_bwd(b, DType::BFloat16, DType::BFloat16, nullptr);
      };
      std::snprintf(name, sizeof(name), "%s_bwd", prefix);
      timing::report(name, n, norm_bytes(layer, add, true, rows, n), timing::median_ms(backward), copy);
      cudaFree(b.weight_partial);
      cudaFree(b.bias_partial);
    }
  }
  for (void* ptr : std::initializer_list<void*>{x, residual, dy, dresidual_out, weight, bias, out, residual_out, dx,
                                                dweight, dbias, mean, rstd})
    cudaFree(ptr);
}

}  // namespace

// NORM_TIMING=fwd times the forwards only; NORM_TIMING_N=n the hidden size n only;
// NORM_TIMING_STATS=none times forwards that do not write mean / rstd (inference);
// NORM_TIMING_ELEMENTS=e tensors of e elements instead of 2^26.
int main() {
  const char* cases = std::getenv("NORM_TIMING");
  const bool forward_only = cases != nullptr && std::strcmp(cases, "fwd") == 0;
  const char* stats = std::getenv("NORM_TIMING_STATS");
  const bool forward_stats = stats == nullptr || std::strcmp(stats, "none") != 0;
  const char* only_n = std::getenv("NORM_TIMING_N");
  const double copy = timing::copy_gbs();
  std::printf("copy %.1f GB/s\n", copy);
  for (const int64_t n : {512, 1024, 2048, 4096, 8192, 16384, 32768})
    if (only_n == nullptr || std::atoll(only_n) == n) time_shape(n, copy, forward_only, forward_stats);
  return 0;
}
