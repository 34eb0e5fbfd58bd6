// Launcher timing of the softmax kernels (bench/launcher/timing.cuh): bf16 and fp32, 2^27
// elements, the bars' N; forward bytes x + y, backward y + dy + dx (as bench/softmax.py counts).
#include "../../csrc/softmax/softmax_kernels.cu"
#include "timing.cuh"

namespace {

using fusedops::DType;
constexpr int64_t kElements = int64_t(1) << 27;

template <typename T> void time_dtype(DType dtype, const char* label, double copy) {
  const size_t size = static_cast<size_t>(kElements);
  T* x = timing::random_buffer<T>(size, 1, 4.0f);
  T* y = timing::empty_buffer<T>(size);
  T* dy = timing::random_buffer<T>(size, 2);
  T* dx = timing::empty_buffer<T>(size);
  for (const int64_t n : {128, 1024, 4096, 16384, 65536, 262144}) {
    const int64_t rows = kElements / n;
    const fusedops::SoftmaxParams f{x, y, rows, n, n, 1.0, false};
    const fusedops::SoftmaxBackwardParams b{y, dy, dx, rows, n, n, n, 1.0, false};
    char name[32];
    std::snprintf(name, sizeof(name), "%s_fwd", label);
    timing::report(name, n, 2.0 * size * sizeof(T),
                   timing::median_ms([&] { return fusedops::launch_softmax_fwd(f, dtype, nullptr); }), copy);
    std::snprintf(name, sizeof(name), "%s_bwd", label);
    timing::report(name, n, 3.0 * size * sizeof(T),
                   timing::median_ms([&] { return fusedops::launch_softmax_bwd(b, dtype, nullptr); }), copy);
  }
  for (void* ptr : std::initializer_list<void*>{x, y, dy, dx}) cudaFree(ptr);
}

}  // namespace

int main() {
  const double copy = timing::copy_gbs();
  std::printf("copy %.1f GB/s\n", copy);
  time_dtype<__nv_bfloat16>(DType::BFloat16, "bf16", copy);
  time_dtype<float>(DType::Float32, "fp32", copy);
  return 0;
}
