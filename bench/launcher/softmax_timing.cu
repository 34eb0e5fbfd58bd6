// Launcher timing of the softmax kernels (bench/launcher/timing.cuh): bf16 and fp32 (fp16 on request), 2^27
// elements, the bars' N (and 2048, 8192, 32768, and 6144 / 12288 for the 16-bit re-read rows: 2^27 / N rows,
// rounded down); forward bytes x + y, backward y + dy + dx (as bench/softmax.py counts).
// Masked softmax: [B, H, L, L] scores (2^27 elements, H = 16, 8 at L = 4096), scale 1/8, a [B, 1, L, L] bool mask
// or the same mask as an additive one (0 / -inf in the scores' dtype; both read through broadcast strides) or
// causal, dropout 0 or 0.1; the mask's bytes counted once.
#include "../../csrc/softmax/softmax_kernels.cu"
#include "timing.cuh"

#include <cstring>

namespace {

using fusedops::DType;
const int64_t kElements = timing::elements("SOFTMAX_TIMING_ELEMENTS", int64_t(1) << 27);

// The row tensors of a forward and its backward: x (uniform in [-4, 4)), y, dy, dx.
template <typename T> struct RowTensors {
  static inline const size_t kSize = static_cast<size_t>(kElements);
  T* x = timing::random_buffer<T>(kSize, 1, 4.0f);
  T* y = timing::empty_buffer<T>(kSize);
  T* dy = timing::random_buffer<T>(kSize, 2);
  T* dx = timing::empty_buffer<T>(kSize);
  ~RowTensors() {
    for (void* ptr : std::initializer_list<void*>{x, y, dy, dx}) cudaFree(ptr);
  }
};

template <typename T> void time_dtype(DType dtype, const char* label, double copy, const char* only_n, bool log) {
  const RowTensors<T> t;
  const T *x = t.x, *dy = t.dy;
  T *y = t.y, *dx = t.dx;
  for (const int64_t n : {128, 1024, 2048, 4096, 6144, 8192, 12288, 16384, 32768, 65536, 262144}) {
    if (only_n != nullptr && std::atoll(only_n) != n) continue;
    const int64_t rows = kElements / n;
    const fusedops::SoftmaxParams f{x, y, rows, n, n, 1.0, log};
    const fusedops::SoftmaxBackwardParams b{y, dy, dx, rows, n, n, n, 1.0, log};
    char name[32];
    std::snprintf(name, sizeof(name), "%s%s_fwd", log ? "log_" : "", label);
    timing::report(name, n, 2.0 * rows * n * sizeof(T),
                   timing::median_ms([&] { return fusedops::launch_softmax_fwd(f, dtype, nullptr); }), copy);
    std::snprintf(name, sizeof(name), "%s%s_bwd", log ? "log_" : "", label);
    timing::report(name, n, 3.0 * rows * n * sizeof(T),
                   timing::median_ms([&] { return fusedops::launch_softmax_bwd(b, dtype, nullptr); }), copy);
  }
}

// Bytes 0 or 1, one in ten 0 (as bench/softmax.py's mask), and the same mask as an additive one.
__device__ bool kept(size_t i) { return (static_cast<uint32_t>(i) * 0x9E3779B1u >> 16) % 10 != 0; }
__global__ void bool_mask_kernel(char* mask, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    mask[i] = kept(i);
}
template <typename T> __global__ void additive_mask_kernel(T* mask, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    mask[i] = T(kept(i) ? 0.0f : -INFINITY);
}

template <typename T> void time_masked(DType dtype, const char* label, double copy, const char* only_n) {
  const size_t size = RowTensors<T>::kSize;
  const RowTensors<T> t;
  const T *x = t.x, *dy = t.dy;
  T *out = t.y, *dx = t.dx;
  float* lse = timing::empty_buffer<float>(size / 256);
  int64_t* rng_state = timing::empty_buffer<int64_t>(2);
  for (const int64_t length : {512, 1024, 2048, 4096}) {
    if (only_n != nullptr && std::atoll(only_n) != length) continue;
    const int64_t heads = std::min<int64_t>(16, kElements / (length * length));
    const int64_t batch = kElements / (heads * length * length);
    const size_t mask_bytes = static_cast<size_t>(batch * length * length);
    char* mask = timing::empty_buffer<char>(mask_bytes);
    bool_mask_kernel<<<1024, 256>>>(mask, mask_bytes);
    T* additive = timing::empty_buffer<T>(mask_bytes);
    additive_mask_kernel<<<1024, 256>>>(additive, mask_bytes);
    fusedops::MaskLayout bool_layout;
    bool_layout.kind = fusedops::MaskKind::Bool;
    bool_layout.data = mask;
    bool_layout.lead_sizes[1] = batch;
    bool_layout.lead_sizes[2] = heads;
    bool_layout.lead_sizes[3] = length;
    bool_layout.lead_strides[1] = length * length;
    bool_layout.lead_strides[3] = length;
    bool_layout.col_stride = 1;
    fusedops::MaskLayout additive_layout = bool_layout;
    additive_layout.kind = fusedops::MaskKind::Additive;
    additive_layout.data = additive;
    fusedops::MaskLayout causal_layout;
    for (int d = 1; d < fusedops::kMaxLeadDims; ++d) causal_layout.lead_sizes[d] = bool_layout.lead_sizes[d];
    for (const double p : {0.0, 0.1}) {
      for (const char* kind : {"bool", "add", "causal"}) {
        const bool causal = std::strcmp(kind, "causal") == 0, add = std::strcmp(kind, "add") == 0;
        if (causal && p == 0.0) continue;
        const fusedops::MaskLayout& layout = causal ? causal_layout : add ? additive_layout : bool_layout;
        const double counted_mask = causal ? 0.0 : static_cast<double>(mask_bytes) * (add ? sizeof(T) : 1);
        fusedops::MaskedSoftmaxParams f{};
        f.x = x;
        f.out = out;
        f.lse = lse;
        f.rng_state = rng_state;
        f.rows = kElements / length;
        f.cols = length;
        f.x_row_stride = length;
        f.q_len = length;
        f.mask = layout;
        f.scale = 0.125;
        f.causal = causal;
        f.p = p;
        f.dropout = p > 0.0;
        f.philox.seed = 42;
        fusedops::MaskedSoftmaxBackwardParams b{dy, x, lse, rng_state, dx, f.rows, length, length, length, length,
                                                layout, 0.125, causal, p, p > 0.0};
        char name[48];
        std::snprintf(name, sizeof(name), "%s_m%s%s_fwd", label, kind, p > 0.0 ? "_p" : "");
        timing::report(name, length, 2.0 * size * sizeof(T) + counted_mask,
                       timing::median_ms([&] { return fusedops::launch_masked_softmax_fwd(f, dtype, nullptr); }), copy);
        std::snprintf(name, sizeof(name), "%s_m%s%s_bwd", label, kind, p > 0.0 ? "_p" : "");
        timing::report(name, length, 3.0 * size * sizeof(T) + counted_mask,
                       timing::median_ms([&] { return fusedops::launch_masked_softmax_bwd(b, dtype, nullptr); }), copy);
      }
    }
    cudaFree(mask);
    cudaFree(additive);
  }
  cudaFree(lse);
  cudaFree(rng_state);
}

}  // namespace

// SOFTMAX_TIMING=masked times the masked cases only, SOFTMAX_TIMING=plain the unmasked ones only;
// SOFTMAX_TIMING_N=n the rows of length n only (unmasked N, masked L; e.g. for one kernel under ncu);
// SOFTMAX_TIMING_ELEMENTS=e tensors of e elements instead of 2^27; SOFTMAX_TIMING_FP16 (set) times
// the unmasked fp16 rows too; SOFTMAX_TIMING_LOG (set) times the unmasked rows as log_softmax.
int main() {
  const char* cases = std::getenv("SOFTMAX_TIMING");
  const char* only_n = std::getenv("SOFTMAX_TIMING_N");
  const bool masked_only = cases != nullptr && std::strcmp(cases, "masked") == 0;
  const bool plain_only = cases != nullptr && std::strcmp(cases, "plain") == 0;
  const double copy = timing::copy_gbs();
  std::printf("copy %.1f GB/s\n", copy);
  if (!masked_only) {
    const bool log = std::getenv("SOFTMAX_TIMING_LOG") != nullptr;
    time_dtype<__nv_bfloat16>(DType::BFloat16, "bf16", copy, only_n, log);
    time_dtype<float>(DType::Float32, "fp32", copy, only_n, log);
    if (std::getenv("SOFTMAX_TIMING_FP16") != nullptr) time_dtype<__half>(DType::Float16, "fp16", copy, only_n, log);
  }
  if (!plain_only) {
    time_masked<__nv_bfloat16>(DType::BFloat16, "bf16", copy, only_n);
    time_masked<float>(DType::Float32, "fp32", copy, only_n);
  }
  return 0;
}
