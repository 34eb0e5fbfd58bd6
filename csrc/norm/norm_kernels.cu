// LayerNorm and RMSNorm kernels.
//
// A "row group" of threads owns one row: a warp (several rows per block) for short rows, the
// whole block for long ones. Thread `lane` of a group owns the VEC-element chunks starting at
// (k * group_size + lane) * VEC for k < VPT, so each load instruction of a warp is coalesced and
// a thread always owns the same columns (which keeps the backward's column sums in registers).
// Rows that fit (VPT chunks per thread) stay in registers between the reduction and the
// write (grids: see "register rows" below); longer rows go to a streaming kernel that re-reads
// them (from L2). On sm_90 most backward block rows are staged instead: rows arrive through a
// shared-memory ring filled by bulk copies, and long rows are split over a cluster (see "staged
// backward rows").
// Statistics: mean first, then the sum of squared deviations from it (two passes in registers,
// accurate for rows with a large mean), all in fp32 (fp64 for fp64 input).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../common/cluster_launch.h"
#include "../common/dispatch.cuh"
#include "../common/occupancy.h"
#include "../common/reduce.cuh"
#include "../common/stage_ring.cuh"
#include "../common/vec.cuh"
#include "norm.h"

namespace fusedops {
namespace {

// ---- tuning knobs (one per line so that a benchmark can flip them with sed) ----------------------
// Sizes in 16-byte chunks (8 bf16 elements). "Prefetching" kernels run on a grid of as many
// blocks as fit and load each row group's next row while working on the current one (two raw
// copies of a row per thread); "one-row" kernels load each row when it starts (half the
// registers: more threads resident). The values were the best of six knob sets timed side by side
// on the H200 (bench/lessons/2026-11-29-session3-notes.md), before the forward kept x - mean in
// registers and computed row starts once; session 4 timed the knobs added then (the one-row
// forward's grid, the register-sums backward's chunks a thread) on the H200.
// Forward warp rows (<= 64 chunks): prefetching (two rows in flight a warp) vs one-row.
constexpr bool kFwdWarpRowsPrefetch = false;
// Backward warp rows (a warp per row, 4 rows a block, warp-shuffle reductions only) up to this
// many chunks (LayerNorm / RMSNorm; 32, 64 or 128: up to 1, 2 or 4 chunks a lane, the fewest that
// hold the row); longer rows take block rows. Launcher timing, H200, session 6: LayerNorm at
// N = 512 went from 82.7 to 87.0% of copy with 2 chunks a lane, at N = 1024 from 82.3 to 88.3
// with 4; RMSNorm at N = 512 lost 0.4 with 2 (93.1 to 92.7). (4 chunks a lane in the forward's
// warp rows, N = 1024, lost 0.8 points.)
constexpr int kLnBwdWarpRowsMaxChunks = 128;
constexpr int kRmsBwdWarpRowsMaxChunks = 32;
// Forward block rows up to this many chunks (LayerNorm / RMSNorm) run one-row kernels, longer ones
// prefetch (0: all prefetch). Launcher timing, H200, N = 32768 bf16 (4096 chunks): the RMSNorm
// one-row kernel (8 chunks a thread, 64 registers, two blocks an SM) took 86.0% of copy against
// 81.2-82.2 prefetching (session 7); LayerNorm's, with x - mean kept in fp32 (128 registers), lost
// 5 points, and with its elements unpacked each pass and merged moments (see norm_fwd_kernel; 61
// registers) went from 77.5 (prefetching) to 83.8 (session 8).
constexpr int kFwdOneRowMaxChunks = 4096;
// Forward block rows, chunks per thread (2, 4 or 8; doubled up to 8 while the row needs more than
// 512 threads) of each kind: more bytes in flight a thread vs more threads a row.
constexpr int kFwdOneRowChunks = 4;
// LayerNorm one-row rows (without a residual) of at least this many chunks take 8 chunks a thread
// (recentered each pass, merged moments: half the threads a row, twice the rows an SM) instead of
// kFwdOneRowChunks. Launcher timing, H200, session 11, N = 16384 bf16: 84.1 -> 86.2% of copy
// (inference), 84.3 -> 85.6-86.0 (training); from 512 or 1024 chunks it lost 1-3 points at
// 4096 / 8192; RMSNorm was level and add_* lost 2-3 at 16384, so they keep kFwdOneRowChunks.
constexpr int kLnFwdOneRowWideMinChunks = 2048;
// add_* rows of more than this many chunks (and at most 4096) run one-row blocks of up to 1024
// threads with 4 chunks each (64 registers: one block an SM, 32 warps) instead of 512 threads with
// 8 (89-97 registers, 16 warps). Launcher timing, H200, session 11, N = 32768 bf16:
// add_layer_norm 75-78 -> 87% of copy, add_rms_norm 86-87 -> 91-92; the plain norms lost 7-11
// points with it (their 8-chunk rows take 61-64 registers, two blocks an SM).
constexpr int kAddFwdWideBlockMinChunks = 2048;
// RMSNorm one-row rows (with or without a residual) of at most this many chunks take 2 chunks a
// thread (twice the threads a row). Launcher timing, H200, session 11 (inference forwards):
// RMSNorm at N = 1024 / 2048 / 4096 bf16 91.0 / 90.6 / 88.7 -> 92.5 / 92.4 / 89.4% of copy,
// add_rms_norm at 2048 94.8 -> 96.5; at 8192 RMSNorm lost 3 and LayerNorm lost 2.5-9 at 1024-8192.
constexpr int kRmsFwdOneRowNarrowMaxChunks = 512;
constexpr int kFwdPrefetchChunks = 2;
// Forward weight and bias are loaded after the row's reductions in runs of kFwdColumnRunChunks
// chunks, each run's loads issued together before its outputs are computed, so a thread waits
// for them once a run rather than once a chunk (ptxas keeps each chunk's loads behind its own
// row-end branch): the block's tail, when it has no loads of x in flight, is that much shorter.
// Launcher timing, H200, session 18, runs of 2 against 1 (bf16, training): RMSNorm 4096-32768
// 89.8 / 89.1 / 87.6 / 86.4 -> 90.4 / 89.6 / 89.8 / 88.7% of copy, add_layer_norm 32768 87 ->
// 91, add_rms_norm 32768 91 -> 93, LayerNorm 16384 / 32768 85.9 / 83.2 -> 87.2 / 84.0, the rest
// level. Runs of 4-8 took 8-chunk kernels past 64 registers (RMSNorm 32768 -4). LayerNorm rows
// without a residual that keep x - mean in fp32 (up to 32 elements a thread) take runs of
// kLnFwdColumnRunChunks: with the bias as well, runs of 2 took them from 40-64 to 48-90
// registers (-3 to -25 points). Loading weight and bias with the row, before the reductions (8
// more registers in the 2-chunk kernels) lost 1-10; rows read with the evict-first hint
// (ld.global.cs) lost 1-3, as in session 10. fp32 weights of 16-bit rows take runs of one (runs
// of two spilled in the 1024-thread add_layer_norm rows).
constexpr int kFwdColumnRunChunks = 2;
constexpr int kLnFwdColumnRunChunks = 1;
// One-row forward grid: the blocks that fit at once, each looping over rows (the per-thread setup
// paid once, no block launches per row) vs one block per row group. One block per row group won
// by 2-9 points of copy at N = 512-16384 (launcher timing, H200, session 4).
constexpr bool kFwdResidentGrid = false;
// RMSNorm rows (16-bit, 16-byte vectors, no residual) of kRmsFwdTwoPassMinChunks to
// kRmsFwdTwoPassMaxChunks chunks take the two-pass forward (rms_norm_fwd_two_pass_kernel) in
// blocks of up to kRmsFwdTwoPassThreads threads, each loading the fewest chunks (2 or 4) that
// cover the row in one run: launcher timing, H200, session 20, N = 4096 / 8192 at 2 chunks a
// thread 93.4 / 93.1% of copy, at 4 92.7 / 92.4; N = 16384 in one run of 4 91.9, in two of 2 90.3.
constexpr int kRmsFwdTwoPassMinChunks = 512;
constexpr int kRmsFwdTwoPassMaxChunks = 2048;
constexpr int kRmsFwdTwoPassThreads = 512;
// Backward block rows up to this many chunks (LayerNorm / RMSNorm; at most 1024) run one chunk a
// thread with the column sums in registers (no shared-memory traffic); longer ones the shared-sums
// kernel (several chunks a thread, column sums in shared memory: more bytes in flight per SM).
constexpr int kLnBwdRegisterSumsMaxChunks = 1024;
constexpr int kRmsBwdRegisterSumsMaxChunks = 1024;
// Register-sums backward, chunks per thread (1 or 2; LayerNorm / RMSNorm): 2 halves the threads a
// row, so each thread's per-row work that does not scale with its elements (the row reductions,
// the row's statistics, addresses, the software-pipeline moves) is spread over twice the
// elements, at twice the registers for the column sums and the rows (512 threads a block at most).
// 1 won on the H200 (LayerNorm by 5-10 points of copy at N = 512-8192, RMSNorm by 1-2).
constexpr int kLnBwdRegisterSumsChunks = 1;
constexpr int kRmsBwdRegisterSumsChunks = 1;
// Shared-sums backward, chunks per thread (2 or 4; 2 doubles to 4 past 1024 chunks): fewer
// registers a thread (more threads) vs more bytes in flight a thread.
constexpr int kBwdSharedSumsChunks = 4;

// Staged backward rows (sm_90, 16-byte aligned rows; see "staged backward rows"): rows of more than
// k{Ln,Rms}BwdStagedMinChunks chunks take the staged kernel (rows in a shared-memory ring filled by
// bulk copies, several rows in flight per block) rather than the register-row or shared-sums
// kernels; rows of more than kStagedThreads * kBwdStagedChunks chunks are split over a cluster of
// blocks (at most kBwdStagedMaxCluster). Session 5 (launcher timing, H200): with 2 chunks a
// thread of 512, staged LayerNorm rows beat register rows by 3-10 points of copy at N = 2048-8192
// (1 chunk lost 4-5 points, 4 chunks spill); staged RMSNorm rows of up to 1024 chunks lost 3-9
// points to register rows; a staged forward lost 5-10 points at every N and was removed.
constexpr int kLnBwdStagedMinChunks = 128;
constexpr int kRmsBwdStagedMinChunks = 1024;
// add_* variants (the residual_out gradient a third tensor in every stage) take single-block
// staged rows too (true) or register rows (false; cluster rows stay staged). Launcher timing,
// H200, session 6, add_layer_norm backward at N = 2048 / 4096 / 8192: 87.9 / 90.3 / 90.9% of copy
// staged, 92.5 / 95.5 / 93.0 on register rows.
constexpr bool kAddBwdStagedBlockRows = false;
// Staged rows' chunks a thread and threads a block: rows without a residual_out gradient
// (LayerNorm, RMSNorm) take kBwdStagedChunks of kStagedThreads, the add_* variants'
// kAddBwdStagedChunks of kAddStagedThreads. The staged kernels are issue-bound, and half of a
// cluster row's instructions at 2 chunks a thread were per row, not per element (ncu, session
// 10: 579 warp instructions a row, ~300 of them elementwise); 4 chunks a thread halve that share
// (210 registers, one 256-thread block an SM). Launcher timing, H200, session 14, 512 x 2 -> 256 x
// 4: LayerNorm backward 16384 / 32768 72.9 / 64.4 -> 78.5 / 71.3% of copy, 2048-8192 +0.5 to
// +1.4; RMSNorm 16384 / 32768 82.9 / 79.6 -> 83.4 / 81.5; add_layer_norm / add_rms_norm at 16384
// 81.8 / 86.4 -> 80.5 / 85.5 (level at 32768). 2 chunks in 256-thread blocks (two an SM, as the
// softmax backward's blocks) lost 5-13 points at 16384 / 32768 (LayerNorm 83.7 / 78.5 -> 70.7 /
// 70.2, RMSNorm 84.5 / 84.5 -> 79.3 / 79.4; session 23), 4 chunks in 128-thread blocks (two or
// three an SM) 10 at LayerNorm 8192 / 16384 and 7 at 32768.
constexpr int kBwdStagedChunks = 4;
constexpr int kStagedThreads = 256;
constexpr int kAddBwdStagedChunks = 2;
constexpr int kAddStagedThreads = 512;
constexpr int kBwdStagedMaxCluster = 8;
// The ring bytes an SM aims for (single-block rows / cluster rows), split between the blocks its
// registers hold: each block's ring holds as many whole stages (rows) as fit in its share, at
// least 2 (cluster rows: kClusterMinStages) and at most kStagedMaxStages. Launcher timing, H200,
// session 6 (cluster rows not yet pipelined): 64 KB for every row took cluster rows at N = 16384
// from 70.6 / 74.2% of copy (LayerNorm / RMSNorm) to 73.3 / 77.5 and cost single-block rows at
// N = 8192 1.7 points (LayerNorm). Session 8, pipelined cluster rows (two stages held): four
// stages of a bf16 slice of 8192 columns (128 KB) and five or six (160 / 192 KB) measured level
// (LayerNorm / RMSNorm backward at 16384: 72.6 / 82.3, 72.7 / 81.6, 71.6 / 80.9), three (96 KB)
// lost 12-16 points; add_* rows (48 KB stages) went from three stages to four with 192 KB, and
// from 73.2 / 78.5 to 79.7 / 84.1 (add_layer_norm / add_rms_norm at 16384; 67.8 / 74.5 to 78.3 /
// 83.4 at 32768).
constexpr int kClusterMinStages = 4;
constexpr int kStagedSmBytes = 128 * 1024;
constexpr int kClusterStagedSmBytes = 128 * 1024;
constexpr int kStagedMaxStages = 8;

static_assert(kLnBwdWarpRowsMaxChunks == 32 || kLnBwdWarpRowsMaxChunks == 64 || kLnBwdWarpRowsMaxChunks == 128);
static_assert(kRmsBwdWarpRowsMaxChunks == 32 || kRmsBwdWarpRowsMaxChunks == 64 || kRmsBwdWarpRowsMaxChunks == 128);
static_assert(kFwdOneRowChunks == 2 || kFwdOneRowChunks == 4 || kFwdOneRowChunks == 8);
static_assert(kFwdPrefetchChunks == 2 || kFwdPrefetchChunks == 4 || kFwdPrefetchChunks == 8);
static_assert(kLnBwdRegisterSumsMaxChunks <= 1024 && kRmsBwdRegisterSumsMaxChunks <= 1024);
static_assert(kLnBwdRegisterSumsChunks == 1 || kLnBwdRegisterSumsChunks == 2);
static_assert(kRmsBwdRegisterSumsChunks == 1 || kRmsBwdRegisterSumsChunks == 2);
static_assert(kBwdSharedSumsChunks == 2 || kBwdSharedSumsChunks == 4);
static_assert(kBwdStagedChunks * kStagedThreads == kAddBwdStagedChunks * kAddStagedThreads,
              "both staged shapes split rows into clusters at the same length");
static_assert(kBwdStagedMaxCluster >= 1 && kBwdStagedMaxCluster <= 8);  // portable cluster sizes
static_assert(kClusterMinStages >= kPipelineMinStages && kStagedMaxStages >= kClusterMinStages);

constexpr int kMaxThreads = 1024;
constexpr int kWarpRowsThreads = 128;  // one warp per row: 4 rows per block
constexpr int kWarpRowsGroups = kWarpRowsThreads / 32;
constexpr int kBlockRowsThreads = 512;  // register-row blocks: up to 128 registers a thread

template <typename T> struct Tag { using type = T; };

// Calls f(Tag<T>, Tag<W>) for the supported (input, weight) dtype pairs: W = T, or W = float
// with fp16/bf16 input.
template <class F>
cudaError_t dispatch_input_weight(DType x_dtype, DType w_dtype, F f) {
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(x_dtype, T, [&]() -> cudaError_t {
    if (w_dtype == x_dtype) return f(Tag<T>{}, Tag<T>{});
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
      if (w_dtype == DType::Float32) return f(Tag<T>{}, Tag<float>{});
    }
    return cudaErrorInvalidValue;
  });
}

__device__ __forceinline__ float inv_sqrt(float v) { return rsqrtf(v); }
__device__ __forceinline__ double inv_sqrt(double v) { return rsqrt(v); }

// The threads sharing one row: a warp, or the whole block.
template <bool WARP_ROWS>
struct RowGroup {
  int lane = WARP_ROWS ? threadIdx.x % 32 : threadIdx.x;
  int size = WARP_ROWS ? 32 : blockDim.x;
  int index = WARP_ROWS ? threadIdx.x / 32 : 0;
  int count = WARP_ROWS ? blockDim.x / 32 : 1;

  // Sum over the group, returned to every thread. Every thread of the block must call it.
  template <typename A>
  __device__ __forceinline__ A sum(A value, A* scratch) const {
    if constexpr (WARP_ROWS) {
      return warp_reduce(value, SumOp{});
    } else {
      return block_reduce(value, SumOp{}, A(0), scratch);
    }
  }

  // Two sums with one pass through shared memory (block rows), returned to every thread.
  template <typename A>
  __device__ __forceinline__ void sum_pair(A& a, A& b, A (&scratch)[2][32]) const {
    a = warp_reduce(a, SumOp{});
    b = warp_reduce(b, SumOp{});
    if constexpr (!WARP_ROWS) {
      const int warp_lane = threadIdx.x % 32, warp = threadIdx.x / 32;
      if (warp_lane == 0) {
        scratch[0][warp] = a;
        scratch[1][warp] = b;
      }
      __syncthreads();
      const bool holds = warp_lane < static_cast<int>(blockDim.x / 32);
      a = warp_reduce(holds ? scratch[0][warp_lane] : A(0), SumOp{});
      b = warp_reduce(holds ? scratch[1][warp_lane] : A(0), SumOp{});
      __syncthreads();  // scratch may be reused once every thread has read it
    }
  }
};

// Count, mean and sum of squared deviations from the mean (m2) of a set of values.
template <typename A> struct Moments {
  A n, mean, m2;
};

// a / b for counts (b >= 1) through the approximate reciprocal (one MUFU, about an ulp off; the
// IEEE division is a dozen instructions with a slow path). fp32 only: merged moments take rows of
// 64 elements a thread, which only 16-bit data reaches.
__device__ __forceinline__ float count_ratio(float a, float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return a * r;
}

// The moments of a warp's lanes, in every lane, from three butterflies of sums: the count and
// the sum of the values (so the mean), then m2 = the lanes' m2 plus their counts times their
// means' squared distances from that mean (Chan, Golub and LeVeque's update, taken once a lane):
// accurate whatever the lanes' means, where E[x^2] - mean^2 would cancel. A butterfly merging
// pairs of moments takes a reciprocal and three shuffles a step. Every lane ends with the same
// bits (each step adds a value and its partner's, and addition commutes bit for bit); lanes
// with n = 0 add nothing.
template <typename A> __device__ __forceinline__ Moments<A> warp_merge_moments(Moments<A> m) {
  const A n = warp_reduce(m.n, SumOp{});
  const A mean = count_ratio(warp_reduce(m.n * m.mean, SumOp{}), n > A(1) ? n : A(1));
  const A d = m.mean - mean;
  return {n, mean, warp_reduce(m.m2 + m.n * d * d, SumOp{})};
}

// The group's moments, in every thread (warp rows: shuffles only; block rows: the warps' moments
// through `scratch`, then merged by every warp in warp order). Every thread of the block calls it.
template <bool WARP_ROWS, typename A>
__device__ __forceinline__ Moments<A> group_moments(Moments<A> m, Moments<A> (&scratch)[32]) {
  m = warp_merge_moments(m);
  if constexpr (!WARP_ROWS) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) scratch[warp] = m;
    __syncthreads();
    m = lane < static_cast<int>(blockDim.x / 32) ? scratch[lane] : Moments<A>{A(0), A(0), A(0)};
    m = warp_merge_moments(m);
    __syncthreads();  // scratch may be reused once every thread has read it
  }
  return m;
}

// The group's sums of g (LayerNorm only; 0 for RMSNorm) and g * xhat, in every thread.
template <bool RMS, bool WARP_ROWS, typename A>
__device__ __forceinline__ void group_sums(const RowGroup<WARP_ROWS>& group, A& sum_g, A& sum_gx,
                                           A (&scratch)[2][32]) {
  if constexpr (RMS) {
    sum_g = A(0);
    sum_gx = group.sum(sum_gx, scratch[0]);
  } else {
    group.sum_pair(sum_g, sum_gx, scratch);
  }
}

// mean(g) (LayerNorm only) and mean(g * xhat) over the row the group holds.
template <bool RMS, bool WARP_ROWS, typename A>
__device__ __forceinline__ void row_means(const RowGroup<WARP_ROWS>& group, A sum_g, A sum_gx, A inv_cols,
                                          A (&scratch)[2][32], A& mean_g, A& mean_gx) {
  group_sums<RMS>(group, sum_g, sum_gx, scratch);
  mean_g = sum_g * inv_cols;
  mean_gx = sum_gx * inv_cols;
}

template <typename T, int VEC, typename A>
__device__ __forceinline__ void load_acc(const T* ptr, A (&v)[VEC]) {
  const auto loaded = load_vector<T, VEC>(ptr);
#pragma unroll
  for (int j = 0; j < VEC; ++j) v[j] = to_acc(loaded.val[j]);
}

// A column vector (weight, bias) at col, or `absent` everywhere when ptr is null.
template <typename W, int VEC, typename A>
__device__ __forceinline__ void load_column(const void* ptr, int64_t col, A absent, A (&v)[VEC]) {
  if (ptr == nullptr) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = absent;
    return;
  }
  load_acc<W, VEC>(static_cast<const W*>(ptr) + col, v);
}

// The normalized input at (row, col): x, or x + residual rounded to T (also written to
// residual_out, so the backward and the caller see exactly the values that were normalized).
template <typename T, int VEC, typename A>
__device__ __forceinline__ void load_input(const NormFwdParams& p, int64_t row, int64_t col, A (&v)[VEC]) {
  const auto x = load_vector<T, VEC>(static_cast<const T*>(p.x) + row * p.x_row_stride + col);
  if (p.residual == nullptr) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = to_acc(x.val[j]);
    return;
  }
  const auto r = load_vector<T, VEC>(static_cast<const T*>(p.residual) + row * p.residual_row_stride + col);
  AlignedVector<T, VEC> sum;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    sum.val[j] = from_acc<T>(to_acc(x.val[j]) + to_acc(r.val[j]));
    v[j] = to_acc(sum.val[j]);
  }
  store_vector<T, VEC>(static_cast<T*>(p.residual_out) + row * p.cols + col, sum);
}

// Re-reads the normalized input once load_input has run for (row, col) in this thread.
template <typename T, int VEC, typename A>
__device__ __forceinline__ void reload_input(const NormFwdParams& p, int64_t row, int64_t col, A (&v)[VEC]) {
  const T* src = p.residual != nullptr ? static_cast<const T*>(p.residual_out) + row * p.cols
                                       : static_cast<const T*>(p.x) + row * p.x_row_stride;
  load_acc<T, VEC>(src + col, v);
}

template <typename T, typename W, int VEC, typename A>
__device__ __forceinline__ void store_output(const NormFwdParams& p, int64_t row, int64_t col, const A (&v)[VEC],
                                             A mean, A rstd) {
  A w[VEC], b[VEC];
  load_column<W, VEC>(p.weight, col, A(1), w);
  load_column<W, VEC>(p.bias, col, A(0), b);
  AlignedVector<T, VEC> out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) out.val[j] = from_acc<T>((v[j] - mean) * rstd * w[j] + b[j]);
  store_vector<T, VEC>(static_cast<T*>(p.out) + row * p.cols + col, out);
}

// A row's statistics, unless the caller does not keep them (rstd null).
template <typename A>
__device__ __forceinline__ void store_stats(const NormFwdParams& p, int64_t row, A mean, A rstd, bool rms) {
  if (p.rstd == nullptr) return;
  if (!rms) p.mean[row] = static_cast<float>(mean);
  p.rstd[row] = static_cast<float>(rstd);
}

// The statistics of a block of warp rows (rows first .. first + group.count - 1), written by its
// first threads: one coalesced store per tensor instead of a 4-byte store per row from each warp.
// Rows written a word at a time cost the LayerNorm forward at N = 512 (bf16) 1.3 points of copy
// (launcher timing, H200, session 11: 87.9 -> 89.4 with this; 91.6-92.0 without statistics).
// Every thread of the block calls it.
template <typename A>
__device__ __forceinline__ void store_block_stats(const NormFwdParams& p, int64_t first, const RowGroup<true>& group,
                                                  A mean, A rstd, bool rms) {
  __shared__ A tile[2][32];
  if (p.rstd == nullptr) return;  // (uniform)
  if (group.lane == 0) {
    tile[0][group.index] = mean;
    tile[1][group.index] = rstd;
  }
  __syncthreads();
  if (threadIdx.x < group.count && first + threadIdx.x < p.rows)
    store_stats(p, first + threadIdx.x, tile[0][threadIdx.x], tile[1][threadIdx.x], rms);
  __syncthreads();  // the tile is reused by the next rows
}

// Forward for rows too long for registers: one block per row, the row read once from memory and
// re-read (mostly from L2) for the variance and the output.
template <typename T, typename W, bool RMS, int VEC>
__global__ void __launch_bounds__(kMaxThreads) norm_fwd_streaming_kernel(const NormFwdParams p) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const RowGroup<false> group;
  const A inv_cols = A(1) / A(p.cols);
  const int64_t step = int64_t(blockDim.x) * VEC;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    A sum = 0, squares = 0;
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < p.cols; col += step) {
      A v[VEC];
      load_input<T, VEC>(p, row, col, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        sum += v[j];
        squares += v[j] * v[j];
      }
    }
    const A mean = RMS ? A(0) : group.sum(sum, scratch) * inv_cols;
    if (!RMS) {
      squares = 0;
      for (int64_t col = int64_t(threadIdx.x) * VEC; col < p.cols; col += step) {
        A v[VEC];
        reload_input<T, VEC>(p, row, col, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) squares += (v[j] - mean) * (v[j] - mean);
      }
    }
    const A rstd = inv_sqrt(group.sum(squares, scratch) * inv_cols + A(p.eps));
    if (threadIdx.x == 0) store_stats(p, row, mean, rstd, RMS);
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < p.cols; col += step) {
      A v[VEC];
      reload_input<T, VEC>(p, row, col, v);
      store_output<T, W, VEC>(p, row, col, v, mean, rstd);
    }
  }
}

// ---- register rows, software-pipelined ---------------------------------------------------------
// A thread holds its VPT chunks of a row as stored (raw 16-byte vectors: 4 registers per 8 bf16
// elements). The row group's next row is loaded into a second set of raw registers before the
// current one is reduced and written, so every thread keeps loads in flight across the row
// reductions and barriers. Column offsets inside a row are 32-bit (register rows are short).

// Element j of a chunk of T stored as raw words (Word: uint32_t, or uint16_t for a lone 16-bit
// element), in the accumulation type. 16-bit elements stay packed two per 32-bit register.
template <typename T, typename Word>
__device__ __forceinline__ acc_t<T> raw_element(const Word* words, int j) {
  if constexpr (std::is_same_v<T, double>) {
    return __hiloint2double(static_cast<int>(words[2 * j + 1]), static_cast<int>(words[2 * j]));
  } else if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(words[j]);
  } else {
    const uint32_t bits =
        sizeof(Word) == 2 ? uint32_t(words[j]) : (j % 2 == 0 ? words[j / 2] & 0xffffu : words[j / 2] >> 16);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return __uint_as_float(bits << 16);
    } else {
      return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    }
  }
}

// VPT chunks of VEC elements of T as stored (raw words, so that the compiler keeps 16-bit data
// packed: 4 registers per 8 bf16 elements).
template <typename T, int VEC, int VPT>
struct Chunks {
  using Word = std::conditional_t<(sizeof(T) * VEC) % 4 == 0, uint32_t, uint16_t>;
  static constexpr int kWords = int(sizeof(T) * VEC / sizeof(Word));
  using Chunk = AlignedVector<Word, kWords>;
  Chunk v[VPT];

  __device__ __forceinline__ acc_t<T> get(int k, int j) const { return raw_element<T>(v[k].val, j); }
  __device__ __forceinline__ void set(int k, const AlignedVector<T, VEC>& values) { memcpy(&v[k], &values, sizeof(Chunk)); }
  __device__ __forceinline__ static Chunk load(const T* ptr) { return load_vector<Word, kWords>(reinterpret_cast<const Word*>(ptr)); }
};

template <typename T, int VEC, int VPT, typename A>
__device__ __forceinline__ void fill_chunks(A value, Chunks<T, VEC, VPT>& c) {
  AlignedVector<T, VEC> values;
#pragma unroll
  for (int j = 0; j < VEC; ++j) values.val[j] = from_acc<T>(value);
#pragma unroll
  for (int k = 0; k < VPT; ++k) c.set(k, values);
}

// One raw chunk of a column vector (weight, bias) at col, or `absent` when ptr is null.
template <typename W, int VEC>
__device__ __forceinline__ Chunks<W, VEC, 1> column_chunk(const void* ptr, int col, const Chunks<W, VEC, 1>& absent) {
  if (ptr == nullptr) return absent;
  Chunks<W, VEC, 1> c;
  c.v[0] = c.load(static_cast<const W*>(ptr) + col);
  return c;
}

// base + offset, opaque to the compiler: a row's start is then computed once per row, and each
// chunk's address is one add to it, instead of the row offset's 64-bit multiply-add being redone
// for every chunk (about 6 instructions a chunk). The assumption keeps the accesses global-memory
// ones (LDG/STG, not generic).
template <typename P>
__device__ __forceinline__ P* row_start(P* base, int64_t offset) {
  P* ptr = base + offset;
  asm("" : "+l"(ptr));
  __builtin_assume(__isGlobal(ptr));
  return ptr;
}

// This thread's chunks of the row at row_ptr; zeros for an invalid row and past the row's end.
template <typename T, int VEC, int VPT, bool WARP_ROWS>
__device__ __forceinline__ void load_chunks(const T* row_ptr, bool valid, const RowGroup<WARP_ROWS>& group, int cols,
                                            Chunks<T, VEC, VPT>& c) {
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int col = (k * group.size + group.lane) * VEC;
    c.v[k] = valid && col < cols ? c.load(row_ptr + col) : typename Chunks<T, VEC, VPT>::Chunk{};
  }
}

// A column vector (weight, bias) for this thread's chunks, or `absent` everywhere when ptr is null.
template <typename W, int VEC, int VPT, bool WARP_ROWS, typename A>
__device__ __forceinline__ void load_column_chunks(const void* ptr, A absent, const RowGroup<WARP_ROWS>& group,
                                                   int cols, Chunks<W, VEC, VPT>& c) {
  if (ptr == nullptr) {
    fill_chunks(absent, c);
  } else {
    load_chunks(static_cast<const W*>(ptr), true, group, cols, c);
  }
}

// This thread's chunks first_chunk ... first_chunk + RUN - 1 of a column vector (weight, bias), or
// `absent` everywhere when ptr is null; the first is within the row (the caller skips runs that
// are not). A later chunk past the row's end reads the row's last chunk instead (an L1 hit, never
// used), so the loads need no select of zeros (registers).
template <typename W, int VEC, int RUN, bool WARP_ROWS, typename A>
__device__ __forceinline__ void load_column_run(const void* ptr, A absent, const RowGroup<WARP_ROWS>& group, int cols,
                                                int first_chunk, Chunks<W, VEC, RUN>& c) {
  if (ptr == nullptr) {
    fill_chunks(absent, c);
    return;
  }
#pragma unroll
  for (int k = 0; k < RUN; ++k) {
    const int col = ((first_chunk + k) * group.size + group.lane) * VEC;
    c.v[k] = c.load(static_cast<const W*>(ptr) + (k == 0 ? col : min(col, cols - VEC)));
  }
}

// Makes the compiler forget what it knows about c's registers (no instruction is emitted), so
// values converted from c before this point are converted again after it instead of being kept
// live across it: one conversion per element instead of VEC registers per chunk.
template <typename T, int VEC, int VPT>
__device__ __forceinline__ void forget_values(Chunks<T, VEC, VPT>& c) {
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
#pragma unroll
    for (int i = 0; i < c.kWords; ++i) {
      if constexpr (sizeof(c.v[k].val[i]) == 4) {
        asm volatile("" : "+r"(c.v[k].val[i]));
      } else {
        asm volatile("" : "+h"(c.v[k].val[i]));
      }
    }
  }
}

// The rows this thread's group handles: row, row + step, ... (step = row groups in the grid).
template <bool WARP_ROWS>
struct RowWalk {
  int64_t row;
  int64_t step;
  __device__ __forceinline__ explicit RowWalk(const RowGroup<WARP_ROWS>& group)
      : row(int64_t(blockIdx.x) * group.count + group.index), step(int64_t(gridDim.x) * group.count) {}
};

// The normalized input of one row (zeros unless valid): x, or x + residual rounded to T (ADD).
template <bool ADD, typename T, int VEC, int VPT, bool WARP_ROWS>
__device__ __forceinline__ void load_fwd_row(const NormFwdParams& p, int64_t row, bool valid,
                                             const RowGroup<WARP_ROWS>& group, int cols, Chunks<T, VEC, VPT>& x,
                                             Chunks<T, VEC, VPT>& residual) {
  load_chunks(row_start(static_cast<const T*>(p.x), row * p.x_row_stride), valid, group, cols, x);
  if constexpr (ADD)
    load_chunks(row_start(static_cast<const T*>(p.residual), row * p.residual_row_stride), valid, group, cols, residual);
}

// Forward, row held in registers (raw); blocks stride over rows. With PREFETCH the group's next row is loaded before the current one is reduced (two raw copies of a row
// per thread); without it each row is loaded when it starts. Weight and bias are read at the
// write, per row.
// MAX_THREADS: the launch bound (registers per thread), without a minimum of blocks: ptxas picks
// the occupancy.
template <typename T, typename W, bool RMS, bool ADD, bool WARP_ROWS, int VEC, int VPT, bool PREFETCH,
          int MAX_THREADS>
__global__ void __launch_bounds__(MAX_THREADS) norm_fwd_kernel(const NormFwdParams p) {
  using A = acc_t<T>;
  using Row = Chunks<T, VEC, VPT>;
  // x - mean is computed once for every element (also past the row's end, so that the output can
  // reuse it) and kept in the accumulation type for the variance and the output, except with 64
  // elements a thread in two raw rows (prefetch) or in a LayerNorm row, where it would spill or
  // take 128 registers: each pass then unpacks again from the raw row.
  constexpr bool kRecenterEachPass = (PREFETCH || !RMS) && VPT * VEC > 32;
  // LayerNorm rows unpacked each pass take their statistics in one reduction: each thread's count,
  // mean and squared deviations over its own elements, merged over the row (Chan et al.), instead
  // of a reduction for the mean and then one for the variance: a pass over the row fewer (at
  // N = 32768 bf16, one-row: 83.8% of copy against 68.1 with the two reductions; launcher timing,
  // H200, session 8). Rows kept in registers lost 4-7 points with it (N = 1024-16384), warp rows
  // 5 (N = 512): their two reductions are cheaper than the merges.
  constexpr bool kMergedMoments = !RMS && kRecenterEachPass;
  __shared__ A scratch[32];
  __shared__ Moments<A> moments_scratch[32];
  const RowGroup<WARP_ROWS> group;
  const int cols = static_cast<int>(p.cols);
  const A inv_cols = A(1) / A(cols);
  constexpr int kRunChunks = sizeof(W) * VEC > 16                   ? 1
                             : RMS || ADD || kRecenterEachPass ? kFwdColumnRunChunks
                                                               : kLnFwdColumnRunChunks;
  constexpr int kRun = VPT < kRunChunks ? VPT : kRunChunks;
  RowWalk<WARP_ROWS> walk(group);
  Row next_x, next_residual;
  if constexpr (PREFETCH) load_fwd_row<ADD>(p, walk.row, walk.row < p.rows, group, cols, next_x, next_residual);
  // Every thread of the block runs the same iterations (row-group reductions need them all).
  for (int64_t first = walk.row - group.index; first < p.rows; first += walk.step, walk.row += walk.step) {
    const int64_t row = walk.row;
    const bool valid = row < p.rows;
    if constexpr (!PREFETCH) load_fwd_row<ADD>(p, row, valid, group, cols, next_x, next_residual);
    Row x = next_x;
    if constexpr (ADD) {
      T* residual_out_row = row_start(static_cast<T*>(p.residual_out), row * p.cols);
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        AlignedVector<T, VEC> rounded;
#pragma unroll
        for (int j = 0; j < VEC; ++j) rounded.val[j] = from_acc<T>(x.get(k, j) + next_residual.get(k, j));
        x.set(k, rounded);
        const int col = (k * group.size + group.lane) * VEC;
        if (valid && col < cols) store_vector<T, VEC>(residual_out_row + col, rounded);
      }
    }
    if constexpr (PREFETCH)
      load_fwd_row<ADD>(p, row + walk.step, row + walk.step < p.rows, group, cols, next_x, next_residual);
    // The row's mean (RMSNorm: 0) and sum of squares about it; without kRecenterEachPass,
    // centered = x - mean for every element (also past the row's end) for the output.
    A mean, squares;
    A centered[VPT][VEC];
    if constexpr (kMergedMoments) {  // (so kRecenterEachPass)
      // One pass: sums of d = x - the thread's first element and of d^2. Shifted by one of its
      // own elements, m2 = s2 - s1^2 / n cancels at most n-fold (n (mean - shift)^2 <= n m2).
      // Against a pass for the mean and one for m2 (launcher timing, H200, session 25, bf16):
      // 1325 -> 1232 instructions in the 8-chunk kernel, N = 32768 84.0-84.8 -> 85.7% of copy,
      // 16384 level.
      const A shift = x.get(0, 0);
      A s1 = 0, s2 = 0;
      int count = 0;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        if ((k * group.size + group.lane) * VEC >= cols) continue;
        count += VEC;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const A d = x.get(k, j) - shift;
          s1 += d;
          s2 += d * d;
        }
      }
      const A mean_shift = count_ratio(s1, A(count > 1 ? count : 1));
      const A thread_mean = shift + mean_shift;
      const A m2 = max(s2 - s1 * mean_shift, A(0));
      const Moments<A> moments = group_moments<WARP_ROWS>(Moments<A>{A(count), thread_mean, m2}, moments_scratch);
      mean = moments.mean;
      squares = moments.m2;
    } else {
      A sum = 0;
#pragma unroll
      for (int k = 0; k < VPT; ++k)
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum += x.get(k, j);
      mean = RMS ? A(0) : group.sum(sum, scratch) * inv_cols;
      if constexpr (kRecenterEachPass) forget_values(x);
      squares = 0;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        if constexpr (!kRecenterEachPass) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) centered[k][j] = x.get(k, j) - mean;
        }
        if ((k * group.size + group.lane) * VEC < cols) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const A c = kRecenterEachPass ? x.get(k, j) - mean : centered[k][j];
            squares += c * c;
          }
        }
      }
      squares = group.sum(squares, scratch);
    }
    const A rstd = inv_sqrt(squares * inv_cols + A(p.eps));
    if constexpr (WARP_ROWS) {
      store_block_stats(p, first, group, mean, rstd, RMS);
    } else if (valid && group.lane == 0) {
      store_stats(p, row, mean, rstd, RMS);
    }
    if (!valid) continue;
    if constexpr (kRecenterEachPass) forget_values(x);
    T* out_row = row_start(static_cast<T*>(p.out), row * p.cols);
#pragma unroll
    for (int run = 0; run < VPT; run += kRun) {
      if ((run * group.size + group.lane) * VEC >= cols) continue;
      // Raw (W-typed) weight and bias, read per row (L1 hits): held across rows or converted they
      // would cost registers (occupancy) in every kernel that is not already limited by them.
      Chunks<W, VEC, kRun> weight, bias;
      load_column_run<W>(p.weight, A(1), group, cols, run, weight);
      load_column_run<W>(RMS ? nullptr : p.bias, A(0), group, cols, run, bias);  // RMSNorm has no bias
#pragma unroll
      for (int i = 0; i < kRun; ++i) {
        const int k = run + i;
        const int col = (k * group.size + group.lane) * VEC;
        if (col >= cols) continue;
        AlignedVector<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const A c = kRecenterEachPass ? x.get(k, j) - mean : centered[k][j];
          out.val[j] = from_acc<T>(c * rstd * weight.get(i, j) + bias.get(i, j));
        }
        store_vector<T, VEC>(out_row + col, out);
      }
    }
  }
}

// RMSNorm forward in two passes over each row (16-bit rows of 16-byte vectors, no residual): the
// first reads the row from HBM asking L2 to keep it (kEvictLast) for its sum of squares, the
// second re-reads it from L2 (kEvictFirst) for the output. A thread holds UNROLL chunks at a time
// (40 registers, three 512-thread blocks an SM) instead of its share of the row plus the weight
// across the reductions, so more rows per SM keep loads in flight. torch.compile's RMSNorm
// forward has this shape (94% of copy at N = 8192, H200). Launcher timing, H200, session 20
// (bf16, % of copy, register rows -> two passes): N = 4096 / 8192 / 16384 91.1 / 89.1 / 89.7 ->
// 93.4 / 93.1 / 91.9; at 32768 88.5 -> 86.7 (1024-thread blocks or more chunks a thread: 67-84),
// so 32768 keeps the one-row kernel. LayerNorm in two passes (shifted sums in the first, the
// threads' moments merged) took 59-64 registers and lost 2-9 points at 4096-32768; with the
// moments in two block reductions instead (40 registers) it lost 4-15, issue-bound (session 21,
// docs/norm.md).
template <typename T, typename W, int VEC, int UNROLL>
__global__ void __launch_bounds__(kRmsFwdTwoPassThreads) rms_norm_fwd_two_pass_kernel(const NormFwdParams p) {
  using A = acc_t<T>;
  using Row = Chunks<T, VEC, UNROLL>;
  static_assert(sizeof(typename Row::Chunk) == 16, "16-byte chunks");
  __shared__ A scratch[32];
  const RowGroup<false> group;
  const int cols = static_cast<int>(p.cols);
  const A inv_cols = A(1) / A(cols);
  const int stride = group.size * VEC;  // columns between a thread's consecutive chunks
  const int first_col = group.lane * VEC;
  // This thread's UNROLL chunks from column `base` on (zeros past the row's end).
  const auto load_run = [&](const T* row_ptr, int base, auto policy, Row& c) {
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const int col = base + k * stride;
      const uint4 v = col < cols ? load_hinted(row_ptr + col, policy) : uint4{};
      memcpy(&c.v[k], &v, sizeof(v));
    }
  };
  const auto keep = l2_policy<L2Hint::kEvictLast>();
  const auto drop = l2_policy<L2Hint::kEvictFirst>();
  Chunks<W, VEC, 1> ones;  // an absent weight
  fill_chunks(A(1), ones);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x_row = row_start(static_cast<const T*>(p.x), row * p.x_row_stride);
    A squares = 0;  // zeros past the row's end add nothing
    for (int base = first_col; base < cols; base += UNROLL * stride) {
      Row x;
      load_run(x_row, base, keep, x);
#pragma unroll
      for (int k = 0; k < UNROLL; ++k)
#pragma unroll
        for (int j = 0; j < VEC; ++j) squares += x.get(k, j) * x.get(k, j);
    }
    const A rstd = inv_sqrt(group.sum(squares, scratch) * inv_cols + A(p.eps));
    if (group.lane == 0) store_stats(p, row, A(0), rstd, true);
    T* out_row = row_start(static_cast<T*>(p.out), row * p.cols);
    for (int base = first_col; base < cols; base += UNROLL * stride) {
      Row x;
      load_run(x_row, base, drop, x);
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        const int col = base + k * stride;
        if (col >= cols) continue;
        const Chunks<W, VEC, 1> weight = column_chunk<W, VEC>(p.weight, col, ones);
        AlignedVector<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) out.val[j] = from_acc<T>(x.get(k, j) * rstd * weight.get(0, j));
        store_vector<T, VEC>(out_row + col, out);
      }
    }
  }
}

// ---- backward ----------------------------------------------------------------------------------
// With g = dy * weight and xhat = (x - mean) * rstd:
//   LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))
//   dweight = sum over rows of dy * xhat, dbias = sum over rows of dy.

// Loads x and dy at (row, col) and returns xhat, g; adds this row's terms to the column sums.
template <typename T, typename W, int VEC, typename A>
__device__ __forceinline__ void load_grad_terms(const NormBwdParams& p, int64_t row, int64_t col, A mean, A rstd,
                                                A (&xhat)[VEC], A (&g)[VEC], A (&dweight)[VEC], A (&dbias)[VEC]) {
  A x[VEC], dy[VEC], w[VEC];
  load_acc<T, VEC>(static_cast<const T*>(p.x) + row * p.x_row_stride + col, x);
  load_acc<T, VEC>(static_cast<const T*>(p.dy) + row * p.dy_row_stride + col, dy);
  load_column<W, VEC>(p.weight, col, A(1), w);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    xhat[j] = (x[j] - mean) * rstd;
    g[j] = dy[j] * w[j];
    dweight[j] += dy[j] * xhat[j];
    dbias[j] += dy[j];
  }
}

template <typename T, int VEC, typename A>
__device__ __forceinline__ void store_dx(const NormBwdParams& p, int64_t row, int64_t col, const A (&xhat)[VEC],
                                         const A (&g)[VEC], A rstd, A mean_g, A mean_gx) {
  A extra[VEC];
  if (p.dresidual_out != nullptr) {
    load_acc<T, VEC>(static_cast<const T*>(p.dresidual_out) + row * p.dresidual_out_row_stride + col, extra);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) extra[j] = A(0);
  }
  AlignedVector<T, VEC> dx;
#pragma unroll
  for (int j = 0; j < VEC; ++j) dx.val[j] = from_acc<T>(rstd * (g[j] - mean_g - xhat[j] * mean_gx) + extra[j]);
  store_vector<T, VEC>(static_cast<T*>(p.dx) + row * p.cols + col, dx);
}

template <typename A, int VEC>
__device__ __forceinline__ A* partial_at(void* buffer, const NormBwdParams& p, int64_t col) {
  return static_cast<A*>(buffer) + int64_t(blockIdx.x) * p.cols + col;
}

// Stores the group's column sums (per owned chunk) to `row` (columns below cols).
template <int VEC, int VPT, bool WARP_ROWS, typename A>
__device__ __forceinline__ void store_column_sums(A* row, const RowGroup<WARP_ROWS>& group, int64_t cols,
                                                  const A (&sums)[VPT][VEC]) {
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t col = (int64_t(k) * group.size + group.lane) * VEC;
    if (col < cols) {
      AlignedVector<A, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.val[j] = sums[k][j];
      store_vector<A, VEC>(row + col, out);
    }
  }
}

// Writes the block's column sums `sums` (per warp, per owned chunk) to partial[blockIdx.x]. With
// one warp per row the warps own the same columns: their sums are added in warp order through
// shared memory.
template <bool WARP_ROWS, int VEC, int VPT, typename A>
__device__ __forceinline__ void write_block_partial(void* buffer, const NormBwdParams& p,
                                                    const RowGroup<WARP_ROWS>& group, const A (&sums)[VPT][VEC]) {
  if constexpr (WARP_ROWS) {
    constexpr int kRowElems = 32 * VPT * VEC;
    __shared__ A tile[kWarpRowsGroups][kRowElems];
#pragma unroll
    for (int k = 0; k < VPT; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j) tile[group.index][(k * 32 + group.lane) * VEC + j] = sums[k][j];
    __syncthreads();
    for (int e = threadIdx.x; e < kRowElems && e < p.cols; e += blockDim.x) {
      A total = tile[0][e];
      for (int w = 1; w < group.count; ++w) total += tile[w][e];
      partial_at<A, 1>(buffer, p, 0)[e] = total;
    }
    __syncthreads();
  } else {
    store_column_sums(partial_at<A, VEC>(buffer, p, 0), group, p.cols, sums);
  }
}

// The backward's operands of one row: x, dy and the row's statistics.
template <typename T, int VEC, int VPT>
struct BwdRow {
  Chunks<T, VEC, VPT> x, dy;
  acc_t<T> mean, rstd;
};

// A row's saved statistics (mean 0 for RMSNorm); zeros past the last row.
template <bool RMS, typename A>
__device__ __forceinline__ void load_row_stats(const NormBwdParams& p, int64_t row, A& mean, A& rstd) {
  const bool valid = row < p.rows;
  mean = (!RMS && valid) ? A(p.mean[row]) : A(0);
  rstd = valid ? A(p.rstd[row]) : A(0);
}

template <bool RMS, typename T, int VEC, int VPT, bool WARP_ROWS>
__device__ __forceinline__ void load_bwd_row(const NormBwdParams& p, int64_t row, const RowGroup<WARP_ROWS>& group,
                                             int cols, BwdRow<T, VEC, VPT>& r) {
  const bool valid = row < p.rows;
  load_row_stats<RMS>(p, row, r.mean, r.rstd);
  load_chunks(row_start(static_cast<const T*>(p.x), row * p.x_row_stride), valid, group, cols, r.x);
  load_chunks(row_start(static_cast<const T*>(p.dy), row * p.dy_row_stride), valid, group, cols, r.dy);
}

// A row's terms in this thread: xhat = (x - mean) * rstd and g = dy * weight, and their sums
// (of g, g * xhat) over the thread's elements; also adds the row's terms to the column sums
// dweight (dy * xhat) and dbias (dy; LayerNorm only).
template <bool RMS, typename T, typename W, int VEC, int VPT, typename A>
__device__ __forceinline__ void row_terms(const BwdRow<T, VEC, VPT>& now, const Chunks<W, VEC, VPT>& weight,
                                          A (&xhat)[VPT][VEC], A (&g)[VPT][VEC], A& sum_g, A& sum_gx,
                                          A (&dweight)[VPT][VEC], A (&dbias)[VPT][VEC]) {
  sum_g = sum_gx = A(0);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const A dy = now.dy.get(k, j);
      xhat[k][j] = (now.x.get(k, j) - now.mean) * now.rstd;
      g[k][j] = dy * weight.get(k, j);
      sum_g += g[k][j];
      sum_gx += g[k][j] * xhat[k][j];
      dweight[k][j] += dy * xhat[k][j];
      if constexpr (!RMS) dbias[k][j] += dy;
    }
  }
}

// Writes the group's `cols` columns of a row's dx at dx_row, dx_of(k, j) for element j of the
// thread's chunk k plus `extra` (the residual_out gradient) when p has one.
template <typename T, int VEC, int VPT, bool WARP_ROWS, class DxOf>
__device__ __forceinline__ void write_dx(const NormBwdParams& p, const RowGroup<WARP_ROWS>& group, T* dx_row,
                                         int cols, const Chunks<T, VEC, VPT>& extra, DxOf dx_of) {
  // One loop per case (uniform branch): adding a zero residual_out gradient would cost an add a
  // element (x + 0 is not x for x = -0, so the compiler keeps it).
  const auto write = [&](auto with_extra) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (k * group.size + group.lane) * VEC;
      if (col >= cols) continue;
      AlignedVector<T, VEC> dx;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        auto v = dx_of(k, j);
        if constexpr (decltype(with_extra)::value) v += extra.get(k, j);
        dx.val[j] = from_acc<T>(v);
      }
      store_vector<T, VEC>(dx_row + col, dx);
    }
  };
  if (p.dresidual_out != nullptr) {
    write(std::true_type{});
  } else {
    write(std::false_type{});
  }
}

// dx of a row whose xhat and g this thread holds.
template <typename T, int VEC, int VPT, bool WARP_ROWS, typename A>
__device__ __forceinline__ void write_dx(const NormBwdParams& p, const RowGroup<WARP_ROWS>& group, T* dx_row,
                                         int cols, A rstd, const A (&xhat)[VPT][VEC], const A (&g)[VPT][VEC],
                                         A mean_g, A mean_gx, const Chunks<T, VEC, VPT>& extra) {
  write_dx(p, group, dx_row, cols, extra,
           [&](int k, int j) { return rstd * (g[k][j] - mean_g - xhat[k][j] * mean_gx); });
}

// Backpropagates one row held in registers (`now`, with `extra` the residual_out gradient when
// there is one): writes dx and adds the row's terms to the column sums `dweight` / `dbias`.
// after_reduction() runs once every thread of the group has passed the row's reductions. Every
// thread of the block calls it for every row step; an invalid row (rstd 0, zeros) adds nothing.
template <bool RMS, typename T, typename W, int VEC, int VPT, bool WARP_ROWS, typename A, class AfterReduction>
__device__ __forceinline__ void backprop_row(const NormBwdParams& p, const RowGroup<WARP_ROWS>& group, int64_t row,
                                             bool valid, const BwdRow<T, VEC, VPT>& now,
                                             const Chunks<T, VEC, VPT>& extra, const Chunks<W, VEC, VPT>& weight,
                                             A (&dweight)[VPT][VEC], A (&dbias)[VPT][VEC], A (&scratch)[2][32],
                                             int cols, A inv_cols, AfterReduction after_reduction) {
  A xhat[VPT][VEC], g[VPT][VEC], sum_g, sum_gx;
  row_terms<RMS>(now, weight, xhat, g, sum_g, sum_gx, dweight, dbias);
  A mean_g, mean_gx;
  row_means<RMS>(group, sum_g, sum_gx, inv_cols, scratch, mean_g, mean_gx);
  after_reduction();
  if (!valid) return;
  write_dx(p, group, row_start(static_cast<T*>(p.dx), row * p.cols), cols, now.rstd, xhat, g, mean_g, mean_gx, extra);
}

// Backward, row held in registers; the weight and the block's column sums stay in registers
// across its rows. Blocks stride over rows (a persistent grid): block b writes partial row b.
// Invalid rows load zeros (rstd 0), so they add nothing to the column sums.
template <typename T, typename W, bool RMS, bool WARP_ROWS, int VEC, int VPT, int MAX_THREADS>
__global__ void __launch_bounds__(MAX_THREADS) norm_bwd_kernel(const NormBwdParams p) {
  using A = acc_t<T>;
  __shared__ A scratch[2][32];
  const RowGroup<WARP_ROWS> group;
  const int cols = static_cast<int>(p.cols);
  const A inv_cols = A(1) / A(cols);
  Chunks<W, VEC, VPT> weight;
  load_column_chunks(p.weight, A(1), group, cols, weight);
  A dweight[VPT][VEC], dbias[VPT][VEC];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dweight[k][j] = dbias[k][j] = A(0);

  RowWalk<WARP_ROWS> walk(group);
  BwdRow<T, VEC, VPT> next;
  load_bwd_row<RMS>(p, walk.row, group, cols, next);
  for (int64_t first = walk.row - group.index; first < p.rows; first += walk.step, walk.row += walk.step) {
    const int64_t row = walk.row;
    BwdRow<T, VEC, VPT> now = next;
    load_bwd_row<RMS>(p, row + walk.step, group, cols, next);
    const bool valid = !WARP_ROWS || row < p.rows;  // a block row is always valid (the loop condition)
    Chunks<T, VEC, VPT> extra;  // the gradient reaching residual_out: needed only after the reduction
    if (p.dresidual_out != nullptr)
      load_chunks(row_start(static_cast<const T*>(p.dresidual_out), row * p.dresidual_out_row_stride), valid, group,
                  cols, extra);
    backprop_row<RMS>(p, group, row, valid, now, extra, weight, dweight, dbias, scratch, cols, inv_cols, [] {});
  }
  if (p.weight_partial != nullptr) write_block_partial<WARP_ROWS, VEC, VPT>(p.weight_partial, p, group, dweight);
  if (p.bias_partial != nullptr) write_block_partial<WARP_ROWS, VEC, VPT>(p.bias_partial, p, group, dbias);
}

// ---- staged backward rows (sm_90) --------------------------------------------------------------
// Backward rows whose bytes in flight would otherwise be bounded by the registers (one row ahead,
// next to the column sums): a ring of shared-memory stages, each holding one row of x, dy and
// (add_* variants) the gradient reaching residual_out, filled by bulk copies that thread 0 issues
// as soon as the block is done reading a stage, so that several rows per block stay in flight
// through the reductions and stores (see k{,Cluster}StagedSmBytes). Threads copy their chunks of
// a row from its stage into registers (the register rows' layout); the weight and the block's
// column sums stay in registers.
// Rows too long for one block are split over a cluster of `cluster` blocks, block r owning the
// slice_cols columns from r * slice_cols: the blocks add their row sums through distributed
// shared memory (ClusterExchange), and partial row c of the column sums is cluster c's. Their
// loop is a software pipeline: a block reduces row i and sends its sums, then waits for row
// i - 1's sums (sent an iteration earlier, so normally there already) and writes row i - 1's dx,
// re-reading its x and dy from the stage. The exchange's latency and the cluster's blocks'
// drift hide behind a row's work instead of stalling every row; two rows' stages are held.

struct StagedRows {
  int stages;      // ring stages
  int slot_bytes;  // a stage's bytes per tensor: the slice's bytes rounded up to 128
  int cluster;     // blocks per row
  int slice_cols;  // columns per block: cols / cluster, a multiple of the vector width
};

// This thread's chunks of a row slice held in shared memory at `slot` (zeros past its end).
template <typename T, int VEC, int VPT>
__device__ __forceinline__ void load_staged_chunks(const char* slot, const RowGroup<false>& group, int cols,
                                                   Chunks<T, VEC, VPT>& c) {
  load_chunks(reinterpret_cast<const T*>(slot), true, group, cols, c);
}

// CLUSTER: rows split over clusters (shape.cluster > 1, fp32 sums) or one block per row, compiled
// without the exchange (its code costs the single-block rows ~10 points of copy). VPT chunks a
// thread, at most MAX_THREADS threads a block.
template <typename T, typename W, bool RMS, int VEC, int VPT, int MAX_THREADS, bool CLUSTER>
__global__ void __launch_bounds__(MAX_THREADS) norm_bwd_staged_kernel(const NormBwdParams p, StagedRows shape) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  static_assert(!CLUSTER || std::is_same_v<A, float>, "cluster rows exchange fp32 sums");
  extern __shared__ uint4 stage_storage[];
  __shared__ uint64_t full[kStagedMaxStages];
  __shared__ A scratch[2][32];
  __shared__ float2 inbox[kPipelineSlots][kMaxExchangeCluster];
  __shared__ uint64_t exchange_bars[kPipelineSlots];
  const RowGroup<false> group;
  const int cluster = CLUSTER ? shape.cluster : 1;
  const int rank = CLUSTER ? static_cast<int>(blockIdx.x) % cluster : 0;
  const int64_t col_begin = int64_t(rank) * shape.slice_cols;
  const int cols = shape.slice_cols;
  const A inv_cols = A(1) / A(p.cols);
  const bool has_extra = p.dresidual_out != nullptr;
  const int tensors = has_extra ? 3 : 2;
  const StageRing ring{reinterpret_cast<char*>(stage_storage), full, shape.stages, tensors * shape.slot_bytes};
  ring.init();
  const ClusterExchange<float2, kPipelineSlots> exchange{inbox, exchange_bars, cluster, rank};
  if constexpr (CLUSTER) exchange.init();
  const uint32_t slice_bytes = static_cast<uint32_t>(cols * sizeof(T));
  auto fill = [&](int stage, int64_t row) {  // thread 0
    char* slot = ring.stage(stage);
    ring.arm(stage, tensors * slice_bytes);
    ring.copy(stage, slot, static_cast<const T*>(p.x) + row * p.x_row_stride + col_begin, slice_bytes);
    ring.copy(stage, slot + shape.slot_bytes, static_cast<const T*>(p.dy) + row * p.dy_row_stride + col_begin,
              slice_bytes);
    if (has_extra) {
      ring.copy(stage, slot + 2 * shape.slot_bytes,
                static_cast<const T*>(p.dresidual_out) + row * p.dresidual_out_row_stride + col_begin, slice_bytes);
    }
  };
  // The cluster's rows: first, first + step, ...
  const int64_t first = blockIdx.x / cluster, step = gridDim.x / cluster;
  if (threadIdx.x == 0) {
    for (int s = 0; s < shape.stages && first + s * step < p.rows; ++s) fill(s, first + s * step);
  }
  Chunks<W, VEC, VPT> weight;
  load_column_chunks(p.weight == nullptr ? nullptr : static_cast<const W*>(p.weight) + col_begin, A(1), group, cols,
                     weight);
  A dweight[VPT][VEC], dbias[VPT][VEC];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dweight[k][j] = dbias[k][j] = A(0);
  const int64_t ahead = int64_t(shape.stages) * step;
  A next_mean, next_rstd;
  load_row_stats<RMS>(p, first, next_mean, next_rstd);
  // A row's x and dy, and its residual_out gradient when there is one, from its stage.
  const auto load_stage = [&](int stage, BwdRow<T, VEC, VPT>& r) {
    load_staged_chunks(ring.stage(stage), group, cols, r.x);
    load_staged_chunks(ring.stage(stage) + shape.slot_bytes, group, cols, r.dy);
  };
  const auto load_extra = [&](int stage, Chunks<T, VEC, VPT>& extra) {
    if (has_extra) load_staged_chunks(ring.stage(stage) + 2 * shape.slot_bytes, group, cols, extra);
  };
  const auto refill = [&](int stage, int64_t done_row) {  // once every thread is done reading it
    if (threadIdx.x == 0 && done_row + ahead < p.rows) fill(stage, done_row + ahead);
  };
  if constexpr (CLUSTER) {
    // pipeline_rows: a row's reduce carries its statistics (mean, rstd) to its finish.
    const auto reduce = [&](int64_t row, const auto& at, const auto& slot, const FreedStage& freed) {
      BwdRow<T, VEC, VPT> now;
      now.mean = next_mean;
      now.rstd = next_rstd;
      load_row_stats<RMS>(p, row + step, next_mean, next_rstd);
      ring.wait(at.stage, at.phase);
      load_stage(at.stage, now);
      A xhat[VPT][VEC], g[VPT][VEC], sum_g, sum_gx;
      row_terms<RMS>(now, weight, xhat, g, sum_g, sum_gx, dweight, dbias);
      group_sums<RMS>(group, sum_g, sum_gx, scratch);
      if (freed.any) refill(freed.stage, freed.row);
      exchange.send(make_float2(sum_g, sum_gx), slot.slot);
      return make_float2(now.mean, now.rstd);
    };
    const auto finish = [&](int64_t row, const auto& at, const auto& slot, float2 stats) {
      // The blocks' sums of the row in rank order: the same bits in every block.
      const float2* sums = exchange.wait(slot.slot, slot.phase);
      A sum_g = 0, sum_gx = 0;
      for (int r = 0; r < cluster; ++r) {
        sum_g += sums[r].x;
        sum_gx += sums[r].y;
      }
      BwdRow<T, VEC, VPT> again;  // the row's operands re-read from its stage
      load_stage(at.stage, again);
      Chunks<T, VEC, VPT> extra;
      load_extra(at.stage, extra);
      // reduce added the row to the column sums, and xhat * mean_gx is (x - mean) times
      // rstd * mean_gx: five instructions an element here instead of ten. With the ring's stage
      // index taken without a division (pipeline_rows), H200, session 10, launcher timing, two
      // runs: LayerNorm backward 16384 / 32768 70.4-71.4 / 62.9-63.3 -> 72.6-72.8 / 64.3-64.7% of
      // copy, RMSNorm 81.5-82.0 / 74.2-74.4 -> 82.9-83.0 / 79.3-79.8 (add_*: level).
      const A mean = stats.x, rstd = stats.y, mean_g = sum_g * inv_cols, x_factor = rstd * (sum_gx * inv_cols);
      write_dx(p, group, row_start(static_cast<T*>(p.dx), row * p.cols + col_begin), cols, extra, [&](int k, int j) {
        const A x = again.x.get(k, j);
        return rstd * (again.dy.get(k, j) * weight.get(k, j) - mean_g - (RMS ? x : x - mean) * x_factor);
      });
    };
    pipeline_rows(first, step, p.rows, shape.stages, reduce, finish);
  } else {
    StagedCursor at;
    for (int64_t row = first; row < p.rows; row += step) {
      BwdRow<T, VEC, VPT> now;
      now.mean = next_mean;
      now.rstd = next_rstd;
      load_row_stats<RMS>(p, row + step, next_mean, next_rstd);
      ring.wait(at.stage, at.phase);
      Chunks<T, VEC, VPT> extra;
      load_stage(at.stage, now);
      load_extra(at.stage, extra);
      backprop_row<RMS>(p, group, row, true, now, extra, weight, dweight, dbias, scratch, cols, inv_cols,
                        [&] { refill(at.stage, row); });
      at.next(shape.stages);
    }
  }
  const int64_t partial_offset = first * p.cols + col_begin;
  if (p.weight_partial != nullptr)
    store_column_sums(static_cast<A*>(p.weight_partial) + partial_offset, group, cols, dweight);
  if (p.bias_partial != nullptr) store_column_sums(static_cast<A*>(p.bias_partial) + partial_offset, group, cols, dbias);
  if constexpr (CLUSTER) cooperative_groups::this_cluster().sync();  // no block exits while its inbox is written
#endif
}

// Adds v to the column sums at sums[col] (only this thread touches these elements).
template <typename A, int VEC>
__device__ __forceinline__ void add_sums(A* sums, int64_t col, const A (&v)[VEC]) {
  if (sums == nullptr) return;
  auto acc = load_vector<A, VEC>(sums + col);
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc.val[j] += v[j];
  store_vector<A, VEC>(sums + col, acc);
}

// Backward for rows whose column sums do not fit in registers (VPT chunks per thread): the row is
// still held in registers and prefetched as in norm_bwd_kernel, but the block's dweight / dbias
// sums live in shared memory (weight sums, then bias sums, cols each), each thread adding to its
// own columns only (no barriers), and the weight and the residual_out gradient are read where
// they are used, leaving the registers to the two raw copies of the row.
template <typename T, typename W, bool RMS, int VEC, int VPT, int MAX_THREADS>
__global__ void __launch_bounds__(MAX_THREADS) norm_bwd_shared_sums_kernel(const NormBwdParams p) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char shared_sums[];
  __shared__ A scratch[2][32];
  const RowGroup<false> group;
  const int cols = static_cast<int>(p.cols);
  const A inv_cols = A(1) / A(cols);
  A* weight_sums = nullptr;
  A* bias_sums = nullptr;
  {
    A* next_sums = reinterpret_cast<A*>(shared_sums);
    if (p.weight_partial != nullptr) {
      weight_sums = next_sums;
      next_sums += cols;
    }
    if (p.bias_partial != nullptr) bias_sums = next_sums;
  }
  // Chunk k of this thread starts at lane * VEC + offset[k]. The offsets are hidden from the
  // compiler so that it cannot prove two chunks' sums apart: it then keeps each chunk's shared
  // read-modify-write after the previous one instead of hoisting all reads (registers).
  int offset[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    offset[k] = k * group.size * VEC;
    asm volatile("" : "+r"(offset[k]));
  }
  const int lane_col = group.lane * VEC;
  Chunks<W, VEC, 1> ones;
  fill_chunks(A(1), ones);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int col = lane_col + offset[k];
    if (col >= cols) continue;
    if (weight_sums != nullptr) store_vector<A, VEC>(weight_sums + col, AlignedVector<A, VEC>{});
    if (bias_sums != nullptr) store_vector<A, VEC>(bias_sums + col, AlignedVector<A, VEC>{});
  }

  RowWalk<false> walk(group);
  BwdRow<T, VEC, VPT> next;
  load_bwd_row<RMS>(p, walk.row, group, cols, next);
  for (; walk.row < p.rows; walk.row += walk.step) {  // block rows: the row is block-uniform
    const int64_t row = walk.row;
    BwdRow<T, VEC, VPT> now = next;
    load_bwd_row<RMS>(p, row + walk.step, group, cols, next);
    A sum_g = 0, sum_gx = 0;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (k * group.size + group.lane) * VEC;
      const auto w = col < cols ? column_chunk<W, VEC>(p.weight, col, ones) : Chunks<W, VEC, 1>{};
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A xhat = (now.x.get(k, j) - now.mean) * now.rstd;
        const A g = now.dy.get(k, j) * w.get(0, j);
        sum_g += g;
        sum_gx += g * xhat;
      }
    }
    A mean_g, mean_gx;
    row_means<RMS>(group, sum_g, sum_gx, inv_cols, scratch, mean_g, mean_gx);
    forget_values(now.x);
    forget_values(now.dy);
    T* dx_row = row_start(static_cast<T*>(p.dx), row * p.cols);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = lane_col + offset[k];
      if (col >= cols) continue;
      // Raw (stored-type) weight and residual_out gradient: half the registers of converted ones.
      const auto w = column_chunk<W, VEC>(p.weight, col, ones);
      Chunks<T, VEC, 1> extra{};
      if (p.dresidual_out != nullptr)
        extra.v[0] = extra.load(static_cast<const T*>(p.dresidual_out) + row * p.dresidual_out_row_stride + col);
      A dweight[VEC], dbias[VEC];
      AlignedVector<T, VEC> dx;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A dy = now.dy.get(k, j);
        const A xhat = (now.x.get(k, j) - now.mean) * now.rstd;
        dx.val[j] = from_acc<T>(now.rstd * (dy * w.get(0, j) - mean_g - xhat * mean_gx) + extra.get(0, j));
        dweight[j] = dy * xhat;
        dbias[j] = dy;
      }
      store_vector<T, VEC>(dx_row + col, dx);
      add_sums<A, VEC>(weight_sums, col, dweight);
      add_sums<A, VEC>(bias_sums, col, dbias);
    }
  }
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int col = lane_col + offset[k];
    if (col >= cols) continue;
    if (weight_sums != nullptr)
      store_vector<A, VEC>(partial_at<A, VEC>(p.weight_partial, p, col), load_vector<A, VEC>(weight_sums + col));
    if (bias_sums != nullptr)
      store_vector<A, VEC>(partial_at<A, VEC>(p.bias_partial, p, col), load_vector<A, VEC>(bias_sums + col));
  }
}

// Backward for rows too long for registers: one block per row; the row is read for the two
// row sums and re-read (mostly from L2) for dx. The block's column sums accumulate in shared
// memory when they fit (SHARED_SUMS: weight sums, then bias sums, cols each; copied to the
// partial rows at the end), else directly in its partial rows in global memory.
template <typename T, typename W, bool RMS, int VEC, bool SHARED_SUMS>
__global__ void __launch_bounds__(kMaxThreads) norm_bwd_streaming_kernel(const NormBwdParams p) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char shared_sums[];
  __shared__ A scratch[2][32];
  const RowGroup<false> group;
  const A inv_cols = A(1) / A(p.cols);
  const int64_t step = int64_t(blockDim.x) * VEC;
  A* weight_partial = p.weight_partial != nullptr ? partial_at<A, VEC>(p.weight_partial, p, 0) : nullptr;
  A* bias_partial = p.bias_partial != nullptr ? partial_at<A, VEC>(p.bias_partial, p, 0) : nullptr;
  A* weight_sums = weight_partial;
  A* bias_sums = bias_partial;
  if constexpr (SHARED_SUMS) {
    A* next = reinterpret_cast<A*>(shared_sums);
    if (weight_sums != nullptr) {
      weight_sums = next;
      next += p.cols;
    }
    if (bias_sums != nullptr) bias_sums = next;
  }
  for (int64_t col = int64_t(threadIdx.x) * VEC; col < p.cols; col += step) {
    if (weight_sums != nullptr) store_vector<A, VEC>(weight_sums + col, AlignedVector<A, VEC>{});
    if (bias_sums != nullptr) store_vector<A, VEC>(bias_sums + col, AlignedVector<A, VEC>{});
  }
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const A mean = RMS ? A(0) : A(p.mean[row]);
    const A rstd = p.rstd[row];
    A sum_g = 0, sum_gx = 0;
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < p.cols; col += step) {
      A xhat[VEC], g[VEC], unused_w[VEC], unused_b[VEC];
      load_grad_terms<T, W, VEC>(p, row, col, mean, rstd, xhat, g, unused_w, unused_b);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        sum_g += g[j];
        sum_gx += g[j] * xhat[j];
      }
    }
    A mean_g, mean_gx;
    row_means<RMS>(group, sum_g, sum_gx, inv_cols, scratch, mean_g, mean_gx);
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < p.cols; col += step) {
      A xhat[VEC], g[VEC], dweight[VEC], dbias[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) dweight[j] = dbias[j] = A(0);
      load_grad_terms<T, W, VEC>(p, row, col, mean, rstd, xhat, g, dweight, dbias);
      store_dx<T, VEC>(p, row, col, xhat, g, rstd, mean_g, mean_gx);
      add_sums<A, VEC>(weight_sums, col, dweight);
      add_sums<A, VEC>(bias_sums, col, dbias);
    }
  }
  if constexpr (SHARED_SUMS) {
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < p.cols; col += step) {
      if (weight_sums != nullptr) store_vector<A, VEC>(weight_partial + col, load_vector<A, VEC>(weight_sums + col));
      if (bias_sums != nullptr) store_vector<A, VEC>(bias_partial + col, load_vector<A, VEC>(bias_sums + col));
    }
  }
}

// Up to two column sums of the same shape, one per blockIdx.z: input[z] [rows, cols] into out[z]
// (selected, not indexed: an indexed parameter array goes through a stack copy).
template <typename In, typename Out> struct ColumnSumPair {
  const In* input[2];
  Out* out[2];
};

// Waits until the grid this one depends on (launched with programmatic stream serialization)
// has completed and its writes are visible; returns at once for a grid launched without it.
__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Column sums of a segment of rows: out[z][segment * out_step + c] = sum over the rows b in
// [segment * segment_rows, min(rows, (segment + 1) * segment_rows)) of input[z][b * row_stride + c],
// segment = blockIdx.y, z = blockIdx.z; b in increasing order per thread, then the lanes in
// order: bitwise reproducible. Block (32, lanes) owns 32 columns: thread (tx, ty) sums rows
// first + ty, + lanes, ... of column tx (coalesced), then thread (tx, 0) adds the lanes' sums.
// out may be the input itself when each segment writes into its own first row (read by this
// block only, before the barrier).
template <typename In, typename Out>
__global__ void __launch_bounds__(kMaxThreads) column_sum_kernel(const ColumnSumPair<In, Out> io, int64_t rows,
                                                                 int64_t row_stride, int64_t segment_rows,
                                                                 int64_t cols, int64_t out_step) {
  using A = acc_t<In>;
  __shared__ A lane_sums[32][32];
  wait_for_primary_grid();
  const int tx = threadIdx.x, ty = threadIdx.y, lanes = blockDim.y;
  const int64_t col = int64_t(blockIdx.x) * 32 + tx;
  const int64_t first = int64_t(blockIdx.y) * segment_rows;
  const int64_t end = rows < first + segment_rows ? rows : first + segment_rows;
  A sum = 0;
  if (col < cols) {
    const In* at = (blockIdx.z == 0 ? io.input[0] : io.input[1]) + (first + ty) * row_stride + col;
#pragma unroll 8
    for (int64_t b = first + ty; b < end; b += lanes, at += lanes * row_stride) sum += to_acc(*at);
  }
  lane_sums[ty][tx] = sum;
  __syncthreads();
  if (ty == 0 && col < cols) {
    for (int lane = 1; lane < lanes; ++lane) sum += lane_sums[lane][tx];
    (blockIdx.z == 0 ? io.out[0] : io.out[1])[int64_t(blockIdx.y) * out_step + col] = from_acc<Out>(sum);
  }
}

// ---- launch ------------------------------------------------------------------------------------

int threads_for(int64_t chunks) {
  return static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, (chunks + 31) / 32 * 32)));
}

using FwdKernel = void (*)(NormFwdParams);
using BwdKernel = void (*)(NormBwdParams);
using StagedBwdKernel = void (*)(NormBwdParams, StagedRows);

template <typename W>
bool column_aligned(const void* ptr, int vec) {
  return ptr == nullptr || is_aligned(ptr, vec * static_cast<int>(sizeof(W)));
}

bool rows_aligned(const void* ptr, int64_t row_stride, int vec, int elem_bytes) {
  return ptr == nullptr || (is_aligned(ptr, vec * elem_bytes) && row_stride % vec == 0);
}

// The device's SM count and per-block shared-memory limit (1 SM, no opt-in on failure).
struct DeviceLimits {
  int sms = 1;
  int max_shared = 0;
  int major = 0;
};

DeviceLimits device_limits() {
  DeviceLimits d;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&d.max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    d = DeviceLimits{};
  }
  return d;
}

// Persistent grid: as many blocks as fit on the device at once, at most `needed`.
template <typename Kernel>
int64_t persistent_blocks(Kernel kernel, int threads, int shared_bytes, int sms, int64_t needed) {
  const int per_sm = cached_blocks_per_sm(kernel, threads, static_cast<size_t>(shared_bytes));
  return std::max<int64_t>(1, std::min<int64_t>(needed, int64_t(sms) * per_sm));
}

// The staged backward's shape for rows of `cols` columns (a multiple of VEC) and `tensors` input
// tensors, in blocks of at most MAX_THREADS threads of VPT chunks: blocks per row (a cluster for
// rows of more than MAX_THREADS * VPT chunks, each block owning an equal slice, with fp32 row
// sums), `threads` a block and the ring (see k{,Cluster}StagedSmBytes; `shared_bytes` of dynamic
// shared memory). stages = 0 when the row does not take staged rows.
template <typename T, int VEC, int VPT, int MAX_THREADS, typename Kernel>
StagedRows staged_bwd_shape(Kernel kernel, int64_t cols, int tensors, const DeviceLimits& device, int& threads,
                            int& shared_bytes) {
  constexpr int64_t kStaticBytes = 1024;  // the kernel's mbarriers, reduction scratch and inboxes
  constexpr int64_t kBlockChunks = int64_t(MAX_THREADS) * VPT;
  StagedRows shape{0, 0, 1, 0};
  const int64_t chunks = cols / VEC;
  while (shape.cluster < kBwdStagedMaxCluster && chunks > shape.cluster * kBlockChunks) shape.cluster *= 2;
  if (chunks > shape.cluster * kBlockChunks) return shape;
  if (shape.cluster > 1 && (!std::is_same_v<acc_t<T>, float> || cols % (shape.cluster * VEC) != 0)) return shape;
  shape.slice_cols = static_cast<int>(cols / shape.cluster);
  threads = threads_for((shape.slice_cols / VEC + VPT - 1) / VPT);
  shape.slot_bytes = static_cast<int>((shape.slice_cols * int64_t(sizeof(T)) + 127) / 128 * 128);
  const int64_t stage_bytes = int64_t(tensors) * shape.slot_bytes;
  const int64_t fit = (device.max_shared - kStaticBytes) / stage_bytes;
  const int64_t blocks_per_sm = std::max(1, cached_blocks_per_sm(kernel, threads, 0));
  const int64_t sm_bytes = shape.cluster > 1 ? kClusterStagedSmBytes : kStagedSmBytes;
  const int64_t min_stages = shape.cluster > 1 ? kClusterMinStages : 2;
  const int64_t stages =
      std::min(fit, std::clamp<int64_t>(sm_bytes / (blocks_per_sm * stage_bytes), min_stages, kStagedMaxStages));
  if (stages >= min_stages) {
    shape.stages = static_cast<int>(stages);
    shared_bytes = static_cast<int>(stages * stage_bytes);
  }
  return shape;
}

struct FwdLaunch {
  FwdKernel kernel;
  int threads;
  int groups;       // row groups per block
  bool resident;    // the blocks that fit at once, each looping over rows; else one block per row group
};

// Block rows from VPT chunks per thread, doubled (up to 8) while the row needs more than
// MAX_THREADS threads (also the kernel's launch bound), or up to MAX_CHUNKS chunks (the longest
// row this chain is used for); longer rows stream. PREFETCH kernels are used except for the add_*
// variants at 8 chunks per thread, which would spill (they also hold the residual) and load one
// row at a time.
template <typename T, typename W, bool RMS, bool ADD, int VEC, int VPT, bool PREFETCH, int64_t MAX_CHUNKS,
          int MAX_THREADS = kBlockRowsThreads>
FwdLaunch block_rows_launch(int64_t chunks) {
  if constexpr (VPT < 8 && int64_t(MAX_THREADS) * VPT < MAX_CHUNKS) {
    if (chunks > int64_t(MAX_THREADS) * VPT)
      return block_rows_launch<T, W, RMS, ADD, VEC, 2 * VPT, PREFETCH, MAX_CHUNKS, MAX_THREADS>(chunks);
  }
  if (chunks > int64_t(MAX_THREADS) * VPT) return {norm_fwd_streaming_kernel<T, W, RMS, VEC>, kMaxThreads, 1, false};
  constexpr bool kPrefetch = PREFETCH && !(ADD && VPT == 8);
  return {norm_fwd_kernel<T, W, RMS, ADD, false, VEC, VPT, kPrefetch, MAX_THREADS>,
          threads_for((chunks + VPT - 1) / VPT), 1, kPrefetch || kFwdResidentGrid};
}

// The two-pass forward for RMSNorm rows of kRmsFwdTwoPassMinChunks to kRmsFwdTwoPassMaxChunks
// chunks (16-bit, 16-byte vectors, no residual): the fewest chunks a thread (2 or 4) that cover
// the row in one run, one block per row. A null kernel for other rows.
template <typename T, typename W, bool RMS, bool ADD, int VEC>
FwdLaunch rms_two_pass_launch(int64_t chunks) {
  if constexpr (RMS && !ADD && sizeof(T) == 2 && VEC * sizeof(T) == 16) {
    if (chunks >= kRmsFwdTwoPassMinChunks && chunks <= kRmsFwdTwoPassMaxChunks) {
      const bool pairs = chunks <= 2 * kRmsFwdTwoPassThreads;
      const int64_t per_thread = pairs ? 2 : 4;
      return {pairs ? rms_norm_fwd_two_pass_kernel<T, W, VEC, 2> : rms_norm_fwd_two_pass_kernel<T, W, VEC, 4>,
              std::min(kRmsFwdTwoPassThreads, threads_for((chunks + per_thread - 1) / per_thread)), 1, false};
    }
  }
  return {nullptr, 0, 0, false};
}

// Register rows: a warp per row (4 rows per block) with 1 or 2 chunks per thread up to 64 chunks,
// else a block per row (see the knobs); past 8 chunks per thread of 512 threads rows stream.
template <typename T, typename W, bool RMS, bool ADD, int VEC>
FwdLaunch register_rows_launch(int64_t chunks) {
  constexpr bool kWarpPrefetch = kFwdWarpRowsPrefetch;
  if (chunks <= 32) {
    return {norm_fwd_kernel<T, W, RMS, ADD, true, VEC, 1, kWarpPrefetch, kWarpRowsThreads>, kWarpRowsThreads,
            kWarpRowsGroups, kWarpPrefetch || kFwdResidentGrid};
  }
  if (chunks <= 64) {
    return {norm_fwd_kernel<T, W, RMS, ADD, true, VEC, 2, kWarpPrefetch, kWarpRowsThreads>, kWarpRowsThreads,
            kWarpRowsGroups, kWarpPrefetch || kFwdResidentGrid};
  }
  if (ADD && chunks > kAddFwdWideBlockMinChunks && chunks <= 4 * kMaxThreads)
    return block_rows_launch<T, W, RMS, ADD, VEC, 4, false, 4 * kMaxThreads, kMaxThreads>(chunks);
  if (!RMS && !ADD && chunks >= kLnFwdOneRowWideMinChunks && chunks <= kFwdOneRowMaxChunks)
    return block_rows_launch<T, W, RMS, ADD, VEC, 8, false, kFwdOneRowMaxChunks>(chunks);
  if (RMS && chunks <= kRmsFwdOneRowNarrowMaxChunks)
    return block_rows_launch<T, W, RMS, ADD, VEC, 2, false, kFwdOneRowMaxChunks>(chunks);
  if (chunks <= kFwdOneRowMaxChunks)
    return block_rows_launch<T, W, RMS, ADD, VEC, kFwdOneRowChunks, false, kFwdOneRowMaxChunks>(chunks);
  return block_rows_launch<T, W, RMS, ADD, VEC, kFwdPrefetchChunks, true, int64_t(kBlockRowsThreads) * 8>(chunks);
}

// The two-pass RMSNorm forward where it applies, else register rows.
template <typename T, typename W, bool RMS, bool ADD, int VEC>
cudaError_t launch_fwd_with(const NormFwdParams& p, cudaStream_t stream) {
  const int64_t chunks = (p.cols + VEC - 1) / VEC;
  FwdLaunch launch = rms_two_pass_launch<T, W, RMS, ADD, VEC>(chunks);
  if (launch.kernel == nullptr) launch = register_rows_launch<T, W, RMS, ADD, VEC>(chunks);
  // Rows past the grid are taken by the kernels' grid-stride loops.
  const int64_t row_groups = std::min<int64_t>((p.rows + launch.groups - 1) / launch.groups, int64_t(1) << 30);
  const int64_t blocks = launch.resident
                             ? persistent_blocks(launch.kernel, launch.threads, 0, device_limits().sms, row_groups)
                             : row_groups;
  launch.kernel<<<static_cast<unsigned>(blocks), launch.threads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename W, bool RMS>
cudaError_t launch_fwd(const NormFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  constexpr int kVec = kVec16<T>;
  constexpr int kBytes = sizeof(T);
  const bool vectorized = p.cols % kVec == 0 && rows_aligned(p.x, p.x_row_stride, kVec, kBytes) &&
                          rows_aligned(p.residual, p.residual_row_stride, kVec, kBytes) &&
                          rows_aligned(p.residual_out, p.cols, kVec, kBytes) && rows_aligned(p.out, p.cols, kVec, kBytes) &&
                          column_aligned<W>(p.weight, kVec) && column_aligned<W>(p.bias, kVec);
  if (p.residual != nullptr) {
    return vectorized ? launch_fwd_with<T, W, RMS, true, kVec>(p, stream)
                      : launch_fwd_with<T, W, RMS, true, 1>(p, stream);
  }
  return vectorized ? launch_fwd_with<T, W, RMS, false, kVec>(p, stream) : launch_fwd_with<T, W, RMS, false, 1>(p, stream);
}

// The backward's warp-row kernel with the fewest chunks a lane (VPT, doubled up to MAX_VPT) that
// hold `chunks`.
template <typename T, typename W, bool RMS, int VEC, int VPT, int MAX_VPT>
BwdKernel bwd_warp_rows_kernel(int64_t chunks) {
  if constexpr (VPT < MAX_VPT) {
    if (chunks > 32 * VPT) return bwd_warp_rows_kernel<T, W, RMS, VEC, 2 * VPT, MAX_VPT>(chunks);
  }
  return norm_bwd_kernel<T, W, RMS, true, VEC, VPT, kWarpRowsThreads>;
}

struct BwdPlan {
  BwdKernel kernel;
  StagedBwdKernel staged_kernel;  // staged rows: launched instead of `kernel`, with `staged`
  StagedRows staged;
  int threads;
  int64_t blocks;
  int shared_bytes;
  bool bias_from_dy;  // dbias summed over dy's columns after the kernel, not by it
  DeviceLimits device;
};

// Staged rows on sm_90 past k{Ln,Rms}BwdStagedMinChunks (16-byte rows whose slices fit; see
// staged_bwd_shape), else register rows: a warp per row (4 rows per block) up to
// k{Ln,Rms}BwdWarpRowsMaxChunks chunks, else a block per row with k{Ln,Rms}BwdRegisterSumsChunks chunks
// per thread (column sums in registers) up to k{Ln,Rms}BwdRegisterSumsMaxChunks, then
// kBwdSharedSumsChunks (doubled to 4 past 1024 chunks) chunks per thread of at most 512 threads
// with the column sums in shared memory up to 2048 chunks when the sums fit; longer rows stream.
// Persistent grid, at most one block per row group.
template <typename T, typename W, bool RMS, int VEC>
BwdPlan plan_bwd_with(const NormBwdParams& p) {
  using A = acc_t<T>;
  constexpr int64_t kRegisterSumsMaxChunks = RMS ? kRmsBwdRegisterSumsMaxChunks : kLnBwdRegisterSumsMaxChunks;
  const DeviceLimits device = device_limits();
  const int64_t chunks = (p.cols + VEC - 1) / VEC;
  BwdPlan plan;
  plan.device = device;
  plan.shared_bytes = 0;
  plan.bias_from_dy = false;
  plan.staged_kernel = nullptr;
  if constexpr (VEC == kVec16<T>) {
    const bool add = p.dresidual_out != nullptr;
    const bool cluster_rows = chunks > int64_t(kStagedThreads) * kBwdStagedChunks;
    if (device.major >= 9 && chunks > (RMS ? kRmsBwdStagedMinChunks : kLnBwdStagedMinChunks) &&
        (kAddBwdStagedBlockRows || !add || cluster_rows)) {
      const auto staged = [&](auto vpt, auto max_threads) {
        constexpr int kVpt = decltype(vpt)::value, kMaxThreads = decltype(max_threads)::value;
        StagedBwdKernel kernel = norm_bwd_staged_kernel<T, W, RMS, VEC, kVpt, kMaxThreads, false>;
        if constexpr (std::is_same_v<A, float>) {
          if (cluster_rows) kernel = norm_bwd_staged_kernel<T, W, RMS, VEC, kVpt, kMaxThreads, true>;
        }
        plan.staged = staged_bwd_shape<T, VEC, kVpt, kMaxThreads>(kernel, p.cols, add ? 3 : 2, device, plan.threads,
                                                                  plan.shared_bytes);
        return kernel;
      };
      using std::integral_constant;
      const StagedBwdKernel kernel =
          add ? staged(integral_constant<int, kAddBwdStagedChunks>{}, integral_constant<int, kAddStagedThreads>{})
              : staged(integral_constant<int, kBwdStagedChunks>{}, integral_constant<int, kStagedThreads>{});
      if (plan.staged.stages > 0) {
        ClusterLaunch<StagedBwdKernel> wave(kernel, plan.staged.cluster, plan.threads, plan.shared_bytes, nullptr);
        const int active = wave.active();
        if (active > 0) {
          plan.staged_kernel = kernel;
          plan.blocks = std::min<int64_t>(p.rows, active);  // partial rows: one a cluster
          return plan;
        }
      }
      plan.shared_bytes = 0;
    }
  }
  constexpr int kWarpRowsMaxChunks = RMS ? kRmsBwdWarpRowsMaxChunks : kLnBwdWarpRowsMaxChunks;
  int groups = 1;
  if (chunks <= kWarpRowsMaxChunks) {
    plan.kernel = bwd_warp_rows_kernel<T, W, RMS, VEC, 1, kWarpRowsMaxChunks / 32>(chunks);
    plan.threads = kWarpRowsThreads, groups = kWarpRowsGroups;
  } else if (chunks <= kRegisterSumsMaxChunks) {
    constexpr int kChunks = RMS ? kRmsBwdRegisterSumsChunks : kLnBwdRegisterSumsChunks;
    plan.kernel = norm_bwd_kernel<T, W, RMS, false, VEC, kChunks, kChunks == 1 ? kMaxThreads : kBlockRowsThreads>;
    plan.threads = threads_for((chunks + kChunks - 1) / kChunks);
  } else {
    const int64_t static_bytes = 2 * 32 * sizeof(A);
    int64_t sums_bytes = ((p.dweight != nullptr) + (p.dbias != nullptr)) * p.cols * int64_t(sizeof(A));
    if (sums_bytes + static_bytes > device.max_shared && p.dweight != nullptr && p.dbias != nullptr) {
      // Both column sums do not fit in shared memory, the weight's alone do: dbias (the column
      // sums of dy) is taken from dy after the kernel, rather than both sums going through the
      // partial rows in global memory for every row.
      sums_bytes /= 2;
      plan.bias_from_dy = true;
    }
    const bool sums_fit = sums_bytes + static_bytes <= device.max_shared;
    const bool register_rows = chunks <= kBlockRowsThreads * 4;
    int vpt = 4;
    BwdKernel shared_kernel = register_rows ? norm_bwd_shared_sums_kernel<T, W, RMS, VEC, 4, kBlockRowsThreads>
                                            : norm_bwd_streaming_kernel<T, W, RMS, VEC, true>;
    if constexpr (kBwdSharedSumsChunks == 2) {
      if (chunks <= kBlockRowsThreads * 2) {
        vpt = 2;
        shared_kernel = norm_bwd_shared_sums_kernel<T, W, RMS, VEC, 2, kBlockRowsThreads>;
      }
    }
    plan.kernel = norm_bwd_streaming_kernel<T, W, RMS, VEC, false>;
    plan.threads = threads_for((chunks + 1) / 2);
    if (sums_fit && (sums_bytes == 0 || cudaFuncSetAttribute(shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                             static_cast<int>(sums_bytes)) == cudaSuccess)) {
      plan.kernel = shared_kernel;
      plan.shared_bytes = static_cast<int>(sums_bytes);
      if (register_rows) plan.threads = threads_for((chunks + vpt - 1) / vpt);
    }
  }
  plan.blocks = persistent_blocks(plan.kernel, plan.threads, plan.shared_bytes, device.sms,
                                  (p.rows + groups - 1) / groups);
  return plan;
}

template <typename T, typename W, bool RMS>
BwdPlan plan_bwd(const NormBwdParams& p) {
  constexpr int kVec = kVec16<T>;
  constexpr int kBytes = sizeof(T);
  const bool vectorized = p.cols % kVec == 0 && rows_aligned(p.x, p.x_row_stride, kVec, kBytes) &&
                          rows_aligned(p.dy, p.dy_row_stride, kVec, kBytes) &&
                          rows_aligned(p.dresidual_out, p.dresidual_out_row_stride, kVec, kBytes) &&
                          rows_aligned(p.dx, p.cols, kVec, kBytes) && column_aligned<W>(p.weight, kVec);
  return vectorized ? plan_bwd_with<T, W, RMS, kVec>(p) : plan_bwd_with<T, W, RMS, 1>(p);
}

// One launch of column_sum_kernel over `tensors` inputs, grid (column tiles, segments), with
// programmatic stream serialization on sm_90: the launch is processed while the backward kernel
// before it drains, and the kernel waits for that kernel's writes (wait_for_primary_grid). Each
// column takes the most row lanes (up to 32) that keep the grid within one wave of 2048 threads
// an SM, and at least enough for 32 rows a lane: tiny blocks in several waves cost the sums more
// than their loads do.
template <typename In, typename Out>
cudaError_t launch_column_sums(const ColumnSumPair<In, Out>& io, int tensors, int64_t rows, int64_t row_stride,
                               int64_t segment_rows, int64_t cols, int64_t out_step, const DeviceLimits& device,
                               cudaStream_t stream) {
  const int64_t segments = (rows + segment_rows - 1) / segment_rows;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(segments), tensors);
  const int64_t threads_per_lane = (cols + 31) / 32 * 32 * tensors * segments;
  const int64_t wave_threads = int64_t(device.sms) * 2048;
  int lanes = 1;
  while (lanes < 32 && lanes < segment_rows &&
         (2 * lanes * threads_per_lane <= wave_threads || segment_rows > 32 * lanes))
    lanes *= 2;
  config.blockDim = dim3(32, lanes);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = device.major >= 9 ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, column_sum_kernel<In, Out>, io, rows, row_stride, segment_rows,
                                             cols, out_step);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// Column sums of up to this many rows take one pass (at most 32 rows a thread).
constexpr int64_t kColumnSumOnePassRows = 1024;

// out[t] = the column sums of input[t] [rows, cols] (row stride in elements) for t < tensors, in a
// fixed order, every tensor in the same launches. Past kColumnSumOnePassRows rows and two
// segments of segment_rows rows (short rows run many small blocks), the segments are summed
// first, so that no thread walks hundreds of rows in sequence, into row s * scratch_step of
// scratch[t] for segment s (scratch may be the input itself with scratch_step = segment_rows:
// each segment then writes its own first row), then the segment totals.
template <typename In, typename A, typename W>
cudaError_t column_sums(const ColumnSumPair<In, W>& io, int tensors, int64_t rows, int64_t row_stride, int64_t cols,
                        int64_t segment_rows, A* const (&scratch)[2], int64_t scratch_step, const DeviceLimits& device,
                        cudaStream_t stream) {
  if (rows <= std::max(kColumnSumOnePassRows, 2 * segment_rows))
    return launch_column_sums(io, tensors, rows, row_stride, rows, cols, 0, device, stream);
  const int64_t segments = (rows + segment_rows - 1) / segment_rows;
  const cudaError_t err = launch_column_sums(ColumnSumPair<In, A>{{io.input[0], io.input[1]}, {scratch[0], scratch[1]}},
                                             tensors, rows, row_stride, segment_rows, cols, scratch_step * cols, device,
                                             stream);
  if (err != cudaSuccess) return err;
  return launch_column_sums(ColumnSumPair<A, W>{{scratch[0], scratch[1]}, {io.out[0], io.out[1]}}, tensors, segments,
                            scratch_step * cols, segments, cols, 0, device, stream);
}

template <typename T, typename W, bool RMS>
cudaError_t launch_bwd(const NormBwdParams& p, cudaStream_t stream) {
  using A = acc_t<T>;
  if (p.cols == 0) return cudaSuccess;
  if (p.rows == 0) {  // empty sums
    if (p.dweight != nullptr) {
      const cudaError_t err = cudaMemsetAsync(p.dweight, 0, p.cols * sizeof(W), stream);
      if (err != cudaSuccess) return err;
    }
    return p.dbias != nullptr ? cudaMemsetAsync(p.dbias, 0, p.cols * sizeof(W), stream) : cudaSuccess;
  }
  constexpr int64_t kSegmentRows = 256;
  const BwdPlan plan = plan_bwd<T, W, RMS>(p);
  NormBwdParams kernel_params = p;
  if (plan.bias_from_dy) kernel_params.bias_partial = nullptr;
  cudaError_t err;
  if (plan.staged_kernel != nullptr && plan.staged.cluster > 1) {  // the kernel's attributes were set by the plan
    err = ClusterLaunch<StagedBwdKernel>(plan.staged_kernel, plan.staged.cluster, plan.threads, plan.shared_bytes,
                                         stream)
              .launch(plan.blocks, kernel_params, plan.staged);
  } else if (plan.staged_kernel != nullptr) {
    plan.staged_kernel<<<static_cast<unsigned>(plan.blocks), plan.threads, plan.shared_bytes, stream>>>(kernel_params,
                                                                                                        plan.staged);
    err = cudaGetLastError();
  } else {
    plan.kernel<<<static_cast<unsigned>(plan.blocks), plan.threads, plan.shared_bytes, stream>>>(kernel_params);
    err = cudaGetLastError();
  }
  A* const partials[2] = {static_cast<A*>(p.weight_partial), static_cast<A*>(p.bias_partial)};
  W* const sums[2] = {static_cast<W*>(p.dweight), static_cast<W*>(p.dbias)};
  // The partial rows' column sums: dweight's and dbias's (unless dbias comes from dy) together.
  A* inputs[2] = {nullptr, nullptr};
  W* outputs[2] = {nullptr, nullptr};
  int tensors = 0;
  for (int t = 0; t < 2; ++t) {
    if (sums[t] == nullptr || (t == 1 && plan.bias_from_dy)) continue;
    inputs[tensors] = partials[t];
    outputs[tensors] = sums[t];
    ++tensors;
  }
  if (err == cudaSuccess && tensors > 0) {
    err = column_sums(ColumnSumPair<A, W>{{inputs[0], inputs[1]}, {outputs[0], outputs[1]}}, tensors, plan.blocks,
                      p.cols, p.cols, kSegmentRows, inputs, kSegmentRows, plan.device, stream);
  }
  if (err == cudaSuccess && p.dbias != nullptr && plan.bias_from_dy) {
    // Segments of dy rows, at most one per partial row (the segment totals' scratch).
    const int64_t segment_rows = std::max(kSegmentRows, (p.rows + plan.blocks - 1) / plan.blocks);
    A* const scratch[2] = {partials[1], nullptr};
    err = column_sums(ColumnSumPair<T, W>{{static_cast<const T*>(p.dy), nullptr}, {sums[1], nullptr}}, 1, p.rows,
                      p.dy_row_stride, p.cols, segment_rows, scratch, 1, plan.device, stream);
  }
  return err;
}

}  // namespace

cudaError_t launch_layer_norm_fwd(const NormFwdParams& p, DType x_dtype, DType w_dtype, cudaStream_t stream) {
  return dispatch_input_weight(x_dtype, w_dtype, [&](auto t, auto w) {
    return launch_fwd<typename decltype(t)::type, typename decltype(w)::type, false>(p, stream);
  });
}

cudaError_t launch_rms_norm_fwd(const NormFwdParams& p, DType x_dtype, DType w_dtype, cudaStream_t stream) {
  return dispatch_input_weight(x_dtype, w_dtype, [&](auto t, auto w) {
    return launch_fwd<typename decltype(t)::type, typename decltype(w)::type, true>(p, stream);
  });
}

cudaError_t launch_layer_norm_bwd(const NormBwdParams& p, DType x_dtype, DType w_dtype, cudaStream_t stream) {
  return dispatch_input_weight(x_dtype, w_dtype, [&](auto t, auto w) {
    return launch_bwd<typename decltype(t)::type, typename decltype(w)::type, false>(p, stream);
  });
}

cudaError_t launch_rms_norm_bwd(const NormBwdParams& p, DType x_dtype, DType w_dtype, cudaStream_t stream) {
  return dispatch_input_weight(x_dtype, w_dtype, [&](auto t, auto w) {
    return launch_bwd<typename decltype(t)::type, typename decltype(w)::type, true>(p, stream);
  });
}

int64_t norm_bwd_blocks(const NormBwdParams& p, DType x_dtype, DType w_dtype, bool rms) {
  int64_t blocks = 0;
  dispatch_input_weight(x_dtype, w_dtype, [&](auto t, auto w) {
    using T = typename decltype(t)::type;
    using W = typename decltype(w)::type;
    blocks = rms ? plan_bwd<T, W, true>(p).blocks : plan_bwd<T, W, false>(p).blocks;
    return cudaSuccess;
  });
  return blocks;
}

}  // namespace fusedops
