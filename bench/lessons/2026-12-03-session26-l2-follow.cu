// Session 26 (H200): what a softmax forward leaves in L2 for the kernels after it (the call-3 table
// of bench/results/h200-s26-launcher.md). After the L2 flush and GPU spin of timing.cuh: the
// softmax forward of 2^27 elements at N = 32768, optionally a copy of the same bytes, then a
// 32 MB buffer R read four times; a second read slower than with the committed stage ring means
// the softmax's lines crowd R out of L2. Call 2 ran an earlier form (the output's last 32 MB read
// first, R twice). Built from the tree's root (a variant's csrc in place of the committed one):
//   nvcc -O3 --expt-relaxed-constexpr -std=c++17 -arch=sm_90a -I. bench/lessons/2026-12-03-session26-l2-follow.cu
#include "csrc/softmax/softmax_kernels.cu"
#include "bench/launcher/timing.cuh"

namespace {

__global__ void read_kernel(const uint4* data, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = data[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

enum class Before { kSoftmax, kSoftmaxThenCopy, kCopy };

void time_readers(bool fp32) {
  constexpr int64_t kElements = int64_t(1) << 27, kCols = 32768;
  constexpr size_t kReaderBytes = size_t(32) << 20;
  constexpr int kReps = 25, kReads = 4;
  const size_t bytes = kElements * (fp32 ? 4 : 2);
  char* x = timing::random_buffer<char>(bytes, 1);
  char* y = timing::empty_buffer<char>(bytes);
  char* copy_src = timing::random_buffer<char>(bytes, 5);
  char* copy_dst = timing::empty_buffer<char>(bytes);
  const uint4* reader = reinterpret_cast<const uint4*>(timing::random_buffer<char>(kReaderBytes, 3));
  unsigned* sink = timing::empty_buffer<unsigned>(1);
  void* flush = timing::empty_buffer<char>(timing::kFlushBytes);
  const fusedops::SoftmaxParams params{x, y, kElements / kCols, kCols, kCols, 1.0, false};
  const auto dtype = fp32 ? fusedops::DType::Float32 : fusedops::DType::BFloat16;
  for (const Before before : {Before::kSoftmax, Before::kSoftmaxThenCopy, Before::kCopy}) {
    std::vector<float> ms[2 + kReads];
    for (auto& m : ms) m.resize(kReps);
    for (int rep = 0; rep < kReps; ++rep) {
      cudaEvent_t events[3 + kReads];
      for (auto& e : events) TIMING_CHECK(cudaEventCreate(&e));
      TIMING_CHECK(cudaMemsetAsync(flush, rep & 0xff, timing::kFlushBytes));
      timing::spin_kernel<<<1, 1>>>(timing::kCoverCycles);
      TIMING_CHECK(cudaEventRecord(events[0]));
      if (before != Before::kCopy) TIMING_CHECK(fusedops::launch_softmax_fwd(params, dtype, nullptr));
      TIMING_CHECK(cudaEventRecord(events[1]));
      if (before != Before::kSoftmax) TIMING_CHECK(cudaMemcpyAsync(copy_dst, copy_src, bytes, cudaMemcpyDeviceToDevice));
      TIMING_CHECK(cudaEventRecord(events[2]));
      for (int k = 0; k < kReads; ++k) {
        read_kernel<<<132 * 8, 256>>>(reader, kReaderBytes / 16, sink);
        TIMING_CHECK(cudaEventRecord(events[3 + k]));
      }
      TIMING_CHECK(cudaDeviceSynchronize());
      for (int k = 0; k < 2 + kReads; ++k) TIMING_CHECK(cudaEventElapsedTime(&ms[k][rep], events[k], events[k + 1]));
      for (auto& e : events) cudaEventDestroy(e);
    }
    std::printf("%s N=%lld %-14s", fp32 ? "fp32" : "bf16", static_cast<long long>(kCols),
                before == Before::kSoftmax ? "softmax" : before == Before::kSoftmaxThenCopy ? "softmax+copy" : "copy");
    const char* labels[2 + kReads] = {" softmax ", " us | copy ", " | R ", ", ", ", ", ", "};
    for (int k = 0; k < 2 + kReads; ++k) {
      std::nth_element(ms[k].begin(), ms[k].begin() + kReps / 2, ms[k].end());
      std::printf("%s%.1f", labels[k], 1e3 * ms[k][kReps / 2]);
    }
    std::printf("\n");
  }
  for (void* ptr : std::initializer_list<void*>{x, y, copy_src, copy_dst, const_cast<uint4*>(reader), sink, flush})
    cudaFree(ptr);
}

}  // namespace

int main() {
  time_readers(false);
  time_readers(true);
  return 0;
}
