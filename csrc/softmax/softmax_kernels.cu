// Softmax family kernels. A row is handled by a group of G threads: G <= 32 is a sub-warp (several
// rows per block, __shfl_xor_sync reductions), G > 32 is a whole block (block reductions).
//
// Row strategies:
// - register rows (cols <= G * ITEMS * VEC, 16-byte aligned rows): each thread keeps its
//   ITEMS vectors of VEC elements in registers in the storage type, so the row is read from HBM
//   once. Rows of one block or less (PERSISTENT false) take one row group per block on a grid
//   sized to the data: every thread loads its row, reduces and writes it, and the other resident
//   blocks keep the loads in flight meanwhile (1024-thread rows, except the fp32 forward's, take
//   the persistent loop of cluster rows instead: see kPersistentForwardGroup). The forward
//   reduces the row max, then the sum of exp(logit - row max), keeping those exps (one exp per
//   element);
// - staged rows (sm_90, unmasked rows past one register block, up to 16 blocks of 64 KB): a
//   cluster of 512-thread blocks per row, one block per SM, each owning a chunk of the row; a
//   ring of shared-memory stages, filled by bulk copies, keeps the next rows' chunks in flight
//   while the current row is reduced and written from registers (see "staged rows" below);
// - cluster rows (sm_90, masked rows up to 16x that of a 512- or 1024-thread block): the row is split
//   over a thread-block cluster of CLUSTER blocks, each keeping its slice in registers; the
//   blocks combine their partials through distributed shared memory with one cluster barrier
//   per row, so the row is still read once. The grid is persistent (PERSISTENT: one resident
//   wave) and software-pipelined: a group issues the loads of its next row before it reduces
//   and writes the current one, so a row's barriers overlap the next row's memory latency. The
//   forward takes each thread's max and sum of exp(logit - that max) in one pass, so the blocks
//   exchange one (max, sum) pair behind one cluster barrier;
// - streamed rows (longer rows, odd sizes, unaligned views, fp64): two passes over the row, an
//   online max + sum (or the backward's dot product) and then the output. The first pass may
//   stage the row in shared memory (CACHE) so the second reads it from there; otherwise the
//   second pass mostly hits L2, which the grid keeps large enough to hold every row in flight.
//
// Forward and backward share one body each; masked softmax differs only in how a logit is
// formed (scale, mask, causal), in the dropout applied to the output, and in the backward
// recomputing the probabilities from x and the saved log-sum-exp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <iterator>
#include <type_traits>
#include <utility>
#include <vector>

#include <cooperative_groups.h>

#include "../common/cluster_launch.h"
#include "../common/dispatch.cuh"
#include "../common/fast_divmod.cuh"
#include "../common/occupancy.h"
#include "../common/philox.cuh"
#include "../common/reduce.cuh"
#include "../common/stage_ring.cuh"
#include "../common/vec.cuh"
#include "softmax.h"

namespace fusedops {
namespace {

namespace cg = cooperative_groups;

// Block size when a row takes at most one warp. One warp a block (torch.compile's softmax shape
// at N = 1024) against four: launcher timing, H200, session 21, bf16 forward N = 128 / 1024 94.4
// / 94.1 -> 95.5 / 96.7% of copy, fp32 forward N = 128 96.3 -> 98.2, the masked forwards and
// every backward level (within 0.6) or up to 1.1 higher. 32 blocks an SM then cap the resident
// threads at 1024 (the 16-bit forwards' registers cap them there anyway; the rest were level or
// faster under the cap).
constexpr int kSmallGroupBlock = 32;
// Most blocks a grid over rows launches (longer row counts loop over rows).
constexpr int64_t kMaxRowGrid = int64_t(1) << 30;
// Elements of a row one thread keeps in registers (per tensor).
constexpr int kRegisterElems = 16;
// The plain forward keeps 32 of a 16-bit row (four 16-byte loads in flight a thread, occupancy
// left to ptxas): on the H200 (session 3) bf16 rows went from 84/84/82/80% of copy at N = 1024,
// 2048, 4096, 8192 with 16 to 99/93/92/91%. fp32 rows lose 5-15 points with 32, the backward
// (two tensors) is at copy speed with 16.
template <typename T> constexpr int kForwardRegisterElems = sizeof(T) == 2 ? 2 * kRegisterElems : kRegisterElems;
// Elements a thread keeps of a masked 16-bit forward row. 32 halves the per-row work a column
// (mask placement, reductions, lse) and makes a 1024-wide row one warp, reduced with shuffles
// only, at small spills in 64-256-thread groups and 1024-thread blocks. On the H200 (bf16
// [8,16,1024,1024]) 32 took the forward from 79 to 102% of copy (bool mask, launcher timing,
// which counts the broadcast mask 16 times) and causal from 71 to 97%.
constexpr int kMaskedForwardElems16 = 32;
template <typename T> constexpr int kMaskedForwardRegisterElems = sizeof(T) == 2 ? kMaskedForwardElems16 : kRegisterElems;
// Registers of raw row data (current + prefetched row) above which a kernel would exceed 64
// registers a thread (two 512-thread blocks per SM): such kernels load each row when they reach
// it and hide latency with the second block instead.
constexpr int kMaxPrefetchRegisters = 40;
// Register rows of one group take the persistent, pipelined loop from these group sizes on
// (the plan's `persistent`; cluster rows always do): the 16-bit forward and every backward from
// 1024 threads, the fp32 forward never (2048). On the H200 (2026-11-29, bench.sweep) the
// persistent loop lost 5-27 points of copy bandwidth to one row group per block at N <= 4096
// (groups <= 256) and won 2x on cluster rows. 1024-thread rows, one row per block against the
// persistent loop (launcher timing, H200, session 13): the fp32 forward (N = 16384) 89.5 -> 95.9%
// of copy (32 registers, two blocks an SM, where the loop's register prefetch takes 64); the bf16
// forward (N = 32768; 64 registers either way, the loop prefetching into L2) 84.9 -> 74.5, the
// bf16 backward (16384) 97.2 -> 92.3. Groups from kPersistentOption on are built both ways, so
// these are the switches. (Since session 36 the 16-bit forward reaches 1024 threads only without
// clusters, before sm_90: see kWideRegisterRowBytes.)
constexpr int kPersistentOption = 512;
template <typename T> constexpr int kPersistentForwardGroup = std::is_same<T, float>::value ? 2048 : 1024;
constexpr int kPersistentBackwardGroup = 1024;
template <typename T, int TENSORS>
constexpr int kPersistentGroup = TENSORS == 2 ? kPersistentBackwardGroup : kPersistentForwardGroup<T>;
static_assert(kPersistentForwardGroup<float> >= kPersistentOption &&
                  kPersistentForwardGroup<__half> >= kPersistentOption && kPersistentBackwardGroup >= kPersistentOption,
              "persistent register rows must be built");
constexpr int kStreamUnroll = 4;       // vectors loaded before any is used in streamed rows
constexpr int kStreamThreads = 512;    // threads per row for long streamed rows (128 registers each)
// Cluster rows use 512-thread blocks, two per SM, so one block's loads overlap the other's
// reductions; rows too long for 16 of them take 1024-thread blocks (one per SM).
constexpr int kClusterThreads = 512;
constexpr int kWideClusterThreads = 1024;
// Unmasked rows on sm_90 take register rows in blocks of up to 1024 threads (64 registers a
// thread) while a thread's raw row data (all its tensors) is at most this many bytes, else staged
// rows past 512 threads. H200, session 6 (launcher timing, N = 16384): the bf16 backward went
// from 89.5 to 98.7% of copy and the fp32 forward from 86.9 to 90.7 on 1024-thread register rows
// (the bf16 forward at 32768: 84.9 to 86.2); the fp32 backward (128 bytes a thread) fell from
// 92.6 to 81.4. Backward rows of 16384 streamed instead (two passes, the second from L2) lost 37
// points (bf16) and 5 (fp32, against staged rows; session 23). The 16-bit forward is the
// exception since session 36: its rows past 512 threads (N = 16385-32768) take staged rows, whose
// forward has gained since session 6 (H100 launcher, two runs, bf16 N = 32768: 87.2 / 87.5 ->
// 92.0 / 92.2, as the staged 65536's 92.3; on the H200 the staged 65536 ran 86.2-86.9 against the
// register 32768's 85.1-85.8, session 28).
constexpr int kWideRegisterRowBytes = 64;
// Unmasked fp32 backward rows of (kClusterThreads * kRegisterElems, kClusterThreads *
// kWideBackwardElems] columns (N = 16384) keep kWideBackwardElems of each tensor a thread, in
// 512-thread blocks (make_plan's cap for them), a row per block: Liger's shape there, where they
// took staged rows. Launcher timing, H200, session 27, N = 16384: 94.9 -> 101.2-101.4% of copy
// (85 registers, one block an SM, as Liger's 86). (bf16 rows of that width took 99.2-99.4 there
// with the output's vectors widened again; they took the wide re-read rows below in session 30,
// and take vector_backward_kernel since session 34.)
constexpr int kWideBackwardElems = 32;
template <typename T> constexpr bool kWideBackwardRows = std::is_same<T, float>::value;
// Unmasked fp32 forward rows of (1024 * kForwardRegisterElems, 1024 * kWideForwardElems] columns
// (N = 16385-32768) keep kWideForwardElems a thread in 1024-thread blocks, a row per block:
// Liger's shape there, where they took staged rows. Launcher timing, H100, session 37, N = 32768,
// two rounds: 93.3 / 93.5 -> 97.6 / 97.6% of copy (64 registers, no spills); the persistent loop
// over the same rows 76.6 / 76.7.
constexpr int kWideForwardThreads = 1024;
constexpr int kWideForwardElems = 32;
template <typename T> constexpr bool kWideForwardRows = std::is_same<T, float>::value;
// Unmasked backward rows of (kRereadMinRowBytes, kRereadMaxRowBytes] a tensor (fp32 N = 2049-4096,
// 16-bit N = 4097-8192; since session 34 those of exactly 16 KB take vector_backward_kernel) take
// two passes, the second from L2 (reread_backward_kernel, torch.compile's shape): 512-thread blocks
// of 32 registers, four an SM, holding kRereadUnroll<T> vectors of each tensor at a time. Launcher
// timing, H200, session 28, three runs, % of copy against the register rows: fp32 N = 4096
// 101.0-102.1 -> 102.7-103.4 (one vector at a time; two: 101.3-102.4), bf16 8192 98.8-99.2 ->
// 100.3-101.5 (two; one: level), fp16 8192 98.6-98.7 -> 101.0 (one run). Elsewhere they lost: bf16
// 4096 99.6-100.5 -> 95.3 (one) / 88.1 (two), 16384 99.9 -> 93.5-95.1; fp32 8192 102.2 -> 89-92,
// 16384 102.2 -> 67 (rows in flight past the L2); N = 1024 50-80. Without the L2 hints (plain
// loads) they lost 3-17 points more. Rows of (kRereadMaxRowBytes, kRereadWideMaxRowBytes] (fp32 N =
// 4097-8192, 16-bit 8193-16384; exactly 32 KB: vector_backward_kernel since session 34) take the
// same kernel in blocks of kRereadWideThreads (torch.compile's shape at bf16 16384: 32 warps, each
// thread both vectors of each tensor in one go). Launcher timing, H200, session 30, % of copy, two
// runs each: bf16 16384 100.0 -> 101.8-101.9 (against the wide register rows), fp16 16384 97.5-97.6
// -> 101.6-101.8 (against the persistent loop), fp32 8192 level (102.2-102.3 -> 101.3-103.5).
// 1024-thread blocks lost at the narrower rows (bf16 8192 101.2-101.9 -> 83.9, fp32 4096 103.8 ->
// 97.9), and bf16 4096 lost in every 512-thread form (8-byte vectors, one of inductor's picks
// there: 78-82 against 100.6; its other pick, one 16-byte vector, is the 95.3 above:
// docs/softmax.md says why).
constexpr int kRereadThreads = 512;
// Unmasked backward rows of exactly this many 16-byte vectors a tensor (16-bit N = 4096) take
// vector_backward_kernel: one vector a thread, one row a block of this many threads; rows of exactly
// two vectors a thread of kRereadThreads or kRereadWideThreads (16 and 32 KB) take it too, and
// 16-bit rows of exactly four vectors a thread of kRereadWideThreads (64 KB, N = 32768; fp32 rows
// of 64 KB keep the wide register rows, kWideBackwardElems). kVectorRowsTaken: which dtypes take
// which of these shapes (launch_vector_rows).
constexpr int kVectorRowThreads = 512;
template <typename T, int VECTORS> constexpr bool kVectorRowsTaken = VECTORS == 2 || sizeof(T) == 2;
constexpr int kRereadWideThreads = 1024;
constexpr int kRereadMinRowBytes = 8 * 1024;
constexpr int kRereadMaxRowBytes = 16 * 1024;
constexpr int kRereadWideMaxRowBytes = 32 * 1024;
template <typename T> constexpr int kRereadUnroll = sizeof(T) == 2 ? 2 : 1;
constexpr int kMaxCluster = 16;  // blocks per cluster (above 8 is a non-portable size)
constexpr int kMaxCacheBytes = 96 * 1024;       // shared memory staging of a streamed row
constexpr int64_t kL2InFlightBytes = 32 << 20;  // rows in flight that the L2 (60 MB) should hold

__host__ __device__ constexpr int block_threads(int group) { return group <= 32 ? kSmallGroupBlock : group; }

template <typename A> __device__ __forceinline__ A neg_inf() { return -std::numeric_limits<A>::infinity(); }
template <typename A> __device__ __forceinline__ A pos_inf() { return std::numeric_limits<A>::infinity(); }
// exp for inputs of type T: 2^(v log2 e) on MUFU.EX2 (a few ulp) for 16-bit types, whose output
// rounding is ~1000x coarser, so the kernels stay memory-bound there; the accurate expf / exp
// for fp32 and fp64. The flush-to-zero form is one multiply and the MUFU: __expf's rescaling of
// results below 2^-126 (fp32 subnormals, < 1.2e-38, far under any tolerance) adds four
// instructions an element, a third of the masked kernels' arithmetic.
constexpr double kLog2e = 1.4426950408889634;  // exp(v) = exp2(v * kLog2e)
__device__ __forceinline__ float exp2_ftz(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}
// 16-bit rows may take an exp's argument (logit - shift) * c as one FMA, logit * c - shift * c,
// with shift * c rounded, where |shift * c| < kOneFmaMaxShift: the rounding moves the argument by
// at most 2^-24 of that (2^-16: a relative error of 1.1e-5 in the exp, far under the 16-bit
// output's rounding), and the max element still gets exp2(its FMA's residual), within 2^-16 of 1.
constexpr float kOneFmaMaxShift = 256;
// The base-2 argument of a 16-bit exp: exp(v) = exp2(v * log2 e).
__device__ __forceinline__ float base2_arg(float v) { return v * float(kLog2e); }
template <typename T> __device__ __forceinline__ acc_t<T> exp_acc(acc_t<T> v) {
  if constexpr (sizeof(T) == 2) return exp2_ftz(base2_arg(v));
  else if constexpr (std::is_same<acc_t<T>, float>::value) return expf(v);
  else return exp(v);
}
// log for inputs of type T: MUFU.LG2 (2^-22 relative) for 16-bit types, where logf's ~30
// instructions, issued by a whole warp for the one lane that stores a row's log-sum-exp, cost
// the masked forward an instruction an element at 32 elements a lane; accurate for fp32 and fp64.
template <typename T> __device__ __forceinline__ acc_t<T> log_acc(acc_t<T> v) {
  if constexpr (sizeof(T) == 2) return __logf(v);
  else if constexpr (std::is_same<acc_t<T>, float>::value) return logf(v);
  else return log(v);
}

// A block's max and sum of exp(logit - max) of a row, combined across a cluster's blocks.
template <typename A> struct MaxSum {
  A max;
  A sum;
};

// max that lets a NaN through, so a NaN logit makes its row NaN, as in torch.
template <typename A> __device__ __forceinline__ A nan_max(A a, A b) { return (a > b || a != a) ? a : b; }

struct NanMaxOp {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return nan_max(a, b); }
};

// fmax: one FMNMX where nan_max takes three; it drops a NaN operand, which is fine where a NaN
// logit makes its row's sum, and so the whole row, NaN all the same (a single group's max).
struct FmaxOp {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return max(a, b); }
};

template <typename A> __device__ __forceinline__ A mul_rn(A a, A b) {
  if constexpr (std::is_same<A, double>::value) return __dmul_rn(a, b);
  else return __fmul_rn(a, b);
}

// Combines the (max, sum) partials of a row's blocks (clusters).
template <typename T> struct MaxSumOp {
  using A = acc_t<T>;
  // Commutative bit for bit, so every lane (and every block of a cluster) agrees on the result.
  __device__ __forceinline__ MaxSum<A> operator()(MaxSum<A> p, MaxSum<A> q) const {
    const A m = nan_max(p.max, q.max);
    if (m == neg_inf<A>()) return {m, A(0)};
    // Products rounded on their own: an FMA would round p's and q's terms differently.
    return {m, mul_rn(p.sum, exp_acc<T>(p.max - m)) + mul_rn(q.sum, exp_acc<T>(q.max - m))};
  }
};

template <typename A> __device__ __forceinline__ A shfl_xor(A v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
template <typename A> __device__ __forceinline__ MaxSum<A> shfl_xor(MaxSum<A> v, int mask) {
  return {shfl_xor(v.max, mask), shfl_xor(v.sum, mask)};
}

// Warp and block reductions of a value that may be a MaxSum pair (common/reduce.cuh's take a
// scalar); same shape: every lane ends with the result, the same bits in every lane.
template <int W, typename V, class Op> __device__ __forceinline__ V warp_all_reduce(V value, Op op) {
#pragma unroll
  for (int mask = W / 2; mask > 0; mask /= 2) value = op(value, shfl_xor(value, mask));
  return value;
}

// (max, sum) pairs reduce as two scalar butterflies: the max, then every lane's sum rescaled to
// it. Combining pairs at every step costs two exps and a NaN-aware max a step: about three
// times the instructions. Every lane still ends with the same bits (each step adds a value and
// its partner's, and addition commutes bit for bit).
template <int W, typename T>
__device__ __forceinline__ MaxSum<acc_t<T>> warp_all_reduce(MaxSum<acc_t<T>> value, MaxSumOp<T>) {
  using A = acc_t<T>;
  const A max = warp_all_reduce<W>(value.max, NanMaxOp{});
  const A rescaled = max == neg_inf<A>() ? A(0) : mul_rn(value.sum, exp_acc<T>(value.max - max));
  return {max, warp_all_reduce<W>(rescaled, SumOp{})};
}

template <int G, typename V, class Op>
__device__ __forceinline__ V group_reduce(V value, Op op, V identity, V* scratch) {
  value = warp_all_reduce<G <= 32 ? G : 32>(value, op);
  if constexpr (G > 32) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    value = warp_all_reduce<32>(lane < G / 32 ? scratch[lane] : identity, op);
    __syncthreads();  // scratch may be reused once this returns
  }
  return value;
}

// The rows a group visits: a grid-stride loop whose trip count is uniform across the block (and
// the cluster), so every thread reaches every reduction; `valid` says whether the group's row
// exists. With CLUSTER > 1 the CLUSTER consecutive blocks of a cluster share each row, block
// `rank` holding its rank-th slice. ROW_GRID: blocks of one row each on row_grid's 3D grid, block
// (x, y, z) taking row (z * gridDim.x + x) * gridDim.y + y (at most 2^30 rows: 32 bits), so that
// the rows sharing a mask row start one after another.
template <int G, int CLUSTER = 1, bool ROW_GRID = false> struct RowCursor {
  static_assert(!ROW_GRID || (G > 32 && CLUSTER == 1), "a row grid has blocks of one row each");
  static constexpr int kRowsPerBlock = G <= 32 ? kSmallGroupBlock / G : 1;
  __device__ static int lane() { return G <= 32 ? threadIdx.x % G : threadIdx.x; }
  __device__ static int rank() { return blockIdx.x % CLUSTER; }
  __device__ static int64_t first() {
    if constexpr (ROW_GRID) return (blockIdx.z * gridDim.x + blockIdx.x) * gridDim.y + blockIdx.y;
    return static_cast<int64_t>(blockIdx.x / CLUSTER) * kRowsPerBlock;
  }
  __device__ static int64_t step() {
    if constexpr (ROW_GRID) return static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z;
    return static_cast<int64_t>(gridDim.x / CLUSTER) * kRowsPerBlock;
  }
  // A block of G > 32 threads is one group: no division by blockDim.x (~20 instructions).
  __device__ static int64_t row(int64_t base) { return G <= 32 ? base + threadIdx.x / G : base; }
};

// Reduces over the whole row: the group, then with CLUSTER > 1 the cluster's blocks, each block
// publishing its value in `slot` (its own shared memory) and reading every block's through
// distributed shared memory. All blocks combine the values in the same order, so they agree
// bit for bit. Consecutive rows alternate between two slots: a slot is rewritten two rows
// later, after the next row's cluster barrier, which every block passes only once it has read
// the slot; the kernel ends with a cluster barrier so no block exits while its slot is read.
template <int CLUSTER, typename V, class Op>
__device__ __forceinline__ V cluster_reduce(V value, Op op, V identity, V* slot) {
  if constexpr (CLUSTER > 1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    cg::cluster_group cluster = cg::this_cluster();
    if (threadIdx.x == 0) *slot = value;
    cluster.sync();
    const int lane = threadIdx.x % 32;
    value = warp_all_reduce<32>(lane < CLUSTER ? *cluster.map_shared_rank(slot, lane) : identity, op);
#else
    __trap();  // the host picks cluster rows only on sm_90 devices, which run sm_90 code
#endif
  }
  return value;
}

template <int G, int CLUSTER, typename V, class Op>
__device__ __forceinline__ V row_reduce(V value, Op op, V identity, V* scratch, V* slot) {
  return cluster_reduce<CLUSTER>(group_reduce<G>(value, op, identity, scratch), op, identity, slot);
}

template <int CLUSTER> __device__ __forceinline__ void cluster_exit_barrier() {
  if constexpr (CLUSTER > 1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    cg::this_cluster().sync();
#endif
  }
}

// Max and sum of exp(logit - max) of one row, turned into what the outputs need.
template <typename T, typename A = acc_t<T>> struct RowStats {
  A max;      // 0 for a row with no finite logit, so exp(-inf - max) = 0
  A sum;
  A inv_sum;  // 0 for a fully masked row: its probabilities are 0
  A log_sum;   // only with `logs` (log_softmax): the log costs ~20 instructions
  bool empty;  // NaN sums (a +inf or NaN logit) are not empty: NaN propagates as in torch
  __device__ RowStats(A m, A s, bool logs)
      : max(m == neg_inf<A>() ? A(0) : m),
        sum(s),
        inv_sum(s == A(0) ? A(0) : A(1) / s),
        log_sum(logs ? log_acc<T>(s) : A(0)),
        empty(s == A(0)) {}
  __device__ A prob(A logit) const { return exp_acc<T>(logit - max) * inv_sum; }
  __device__ A log_prob(A logit) const { return empty ? neg_inf<A>() : logit - max - log_sum; }
  // What log_prob subtracts from logit - max (-inf in a row without a finite logit).
  __device__ A log_shift() const { return empty ? pos_inf<A>() : log_sum; }
  // Log-sum-exp saved for the backward: +inf for a fully masked row, so exp(logit - lse) = 0.
  // Its own log: only the thread that stores it pays for it.
  __device__ A lse() const { return empty ? pos_inf<A>() : max + log_acc<T>(sum); }
};

// Two 16-bit elements as __hmax2 / __hmin2 take them.
template <typename T> using Pair16 = std::conditional_t<std::is_same<T, __half>::value, __half2, __nv_bfloat162>;

// `m` folded with the four 16-bit pairs of a 16-byte vector by `pick` (__hmax2 or __hmin2, which
// skip NaNs as fmaxf does): a tree over the vector's pairs, then one fold into m, so that a row's
// vectors make a short dependent chain.
template <typename T, class Pick>
__device__ __forceinline__ Pair16<T> fold_pairs(const void* vector16, Pair16<T> m, Pick pick) {
  constexpr int kPairs = 4;
  Pair16<T> pairs[kPairs];
  memcpy(pairs, vector16, sizeof(pairs));
#pragma unroll
  for (int width = kPairs / 2; width > 0; width /= 2)
#pragma unroll
    for (int k = 0; k < width; ++k) pairs[k] = pick(pairs[k], pairs[k + width]);
  return pick(m, pairs[0]);
}

// The vector widened to acc_t<T>. bf16 is the top half of an fp32, so a 32-bit word holding two
// becomes two floats by a shift and a mask; to_acc per element extracts the high one first.
template <typename T, int VEC>
__device__ __forceinline__ void widen(const AlignedVector<T, VEC>& v, acc_t<T> (&out)[VEC]) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value && VEC % 2 == 0) {
    uint32_t words[VEC / 2];
    memcpy(words, v.val, sizeof(words));
#pragma unroll
    for (int w = 0; w < VEC / 2; ++w) {
      out[2 * w] = __uint_as_float(words[w] << 16);
      out[2 * w + 1] = __uint_as_float(words[w] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = to_acc(v.val[j]);
  }
}

// ---- masking and dropout ---------------------------------------------------------------------

// Rows without prefetch issue every load of a row (data and mask bytes) in one loop before any
// arithmetic, zeros where not `live`: each load stays a predicated instruction that ptxas issues
// ahead of the arithmetic (a load behind a branch, or among the arithmetic of earlier vectors,
// keeps 16-bit rows to one load in flight).
// The vector is zeroed and loaded as whole 32-bit words: zeroing 16-bit or byte elements one by
// one made ptxas keep each element in its own register around the predicated load (a PRMT per
// element before and after it).
template <typename T, int VEC>
__device__ __forceinline__ AlignedVector<T, VEC> load_live(bool live, const T* src) {
  using Vec = AlignedVector<T, VEC>;
  if constexpr (sizeof(Vec) % 4 == 0) {
    constexpr int kWords = sizeof(Vec) / 4;
    AlignedVector<uint32_t, kWords> words{};
    if (live) words = load_vector<uint32_t, kWords>(reinterpret_cast<const uint32_t*>(src));
    Vec v;
    memcpy(&v, &words, sizeof(Vec));
    return v;
  } else {
    Vec v{};
    if (live) v = load_vector<T, VEC>(src);
    return v;
  }
}

template <int VEC> using MaskBytes = AlignedVector<char, VEC>;

// What a register row reads of the mask with each vector of its data: the bool bytes, or with
// ADDITIVE the additive mask's values.
template <typename T, int VEC, bool ADDITIVE>
using MaskVector = std::conditional_t<ADDITIVE, AlignedVector<T, VEC>, MaskBytes<VEC>>;

// Bit j set when bool byte j is true. torch bools are bytes 0 or 1, so a word's four bytes,
// masked to their low bits, times 0x01020408 land as bits 0-3 of its top byte (byte i times
// 2^(3-i); no sum exceeds 15, so nothing carries): three instructions per four columns where
// testing each byte takes an extract and a compare.
template <int VEC> __device__ __forceinline__ uint32_t bool_bits(const MaskBytes<VEC>& bytes) {
  uint32_t bits = 0;
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int w = 0; w < VEC / 4; ++w) {
      const uint32_t word = reinterpret_cast<const uint32_t*>(bytes.val)[w];
      bits |= (((word & 0x01010101u) * 0x01020408u) >> 24) << (4 * w);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) bits |= uint32_t(bytes.val[j] != 0) << j;
  }
  return bits;
}

// The mask of one row: a pointer to its first element and the causal limit.
template <typename T> struct MaskRow {
  const char* data;
  int64_t col_stride_bytes;
  int64_t last_visible;  // causal: columns past the query index are masked
  MaskKind kind;

  // Every column from c0 on is hidden by the causal mask: nothing there needs reading.
  __device__ __forceinline__ bool hidden_from(int64_t c0) const { return c0 > last_visible; }

  __device__ __forceinline__ acc_t<T> logit(int64_t col, acc_t<T> scaled) const {
    if (col > last_visible) return neg_inf<acc_t<T>>();
    if (kind == MaskKind::Bool) {
      if (!data[col * col_stride_bytes]) return neg_inf<acc_t<T>>();
    } else if (kind == MaskKind::Additive) {
      scaled += to_acc(*reinterpret_cast<const T*>(data + col * col_stride_bytes));
    }
    return scaled;
  }

  // Whether the mask of columns c0 ... is one aligned vector of VEC bool bytes; with
  // kVectorMask (register and cluster rows) the host has checked that every bool mask is (see
  // vector_mask).
  template <int VEC, bool kVectorMask> __device__ __forceinline__ bool vector_bytes(int64_t c0) const {
    if constexpr (kVectorMask) return kind == MaskKind::Bool;
    return VEC > 1 && kind == MaskKind::Bool && col_stride_bytes == 1 &&
           reinterpret_cast<uintptr_t>(data + c0) % VEC == 0;
  }
  // The mask bytes of columns c0 ... where they form a vector, read with the row's data so that
  // every load of the row is in flight before its arithmetic; zeros where not `live`.
  template <int VEC, bool kVectorMask> __device__ __forceinline__ MaskBytes<VEC> load_bytes(int64_t c0, bool live) const {
    return load_live<char, VEC>(live && vector_bytes<VEC, kVectorMask>(c0), data + c0);
  }
  // Bit j set when column c0 + j is visible to the causal mask (all set without it). Register
  // rows (kVectorMask) have 32-bit columns: the VEC bits shifted right by the vector's columns
  // past last_visible, a clamped funnel shift (0 from 32 on), two instructions a vector (an add
  // with a max, the shift) where clamping the visible count took five.
  template <int VEC, bool kVectorMask> __device__ __forceinline__ uint32_t causal_bits(int64_t c0) const {
    static_assert(VEC < 32, "one bit per column of a vector");
    constexpr uint32_t kAll = (1u << VEC) - 1u;
    if constexpr (kVectorMask) {
      const int last = static_cast<int>(std::min<int64_t>(last_visible, INT32_MAX));
      const int past = std::max(static_cast<int>(c0) + (VEC - 1) - last, 0);
      return __funnelshift_rc(kAll, 0u, static_cast<uint32_t>(past));
    } else {
      const int visible = static_cast<int>(std::min<int64_t>(std::max<int64_t>(last_visible - c0, -1), VEC - 1)) + 1;
      return (1u << visible) - 1u;
    }
  }
  // The additive mask's values of columns c0 ... (register and cluster rows, whose additive masks
  // the host has checked to be vectors, see vector_mask), read with the row's data; zeros where
  // not `live`.
  template <int VEC> __device__ __forceinline__ AlignedVector<T, VEC> load_added(int64_t c0, bool live) const {
    return load_live<T, VEC>(live, reinterpret_cast<const T*>(data) + c0);
  }
  // The mask of columns c0 ... as a register row reads it with its data (MaskVector).
  template <int VEC, bool kVectorMask, bool ADDITIVE>
  __device__ __forceinline__ MaskVector<T, VEC, ADDITIVE> load_vector(int64_t c0, bool live) const {
    if constexpr (ADDITIVE) {
      return load_added<VEC>(c0, live);
    } else {
      return load_bytes<VEC, kVectorMask>(c0, live);
    }
  }
  // Adds an additive mask's vector (`added`, from load_added) to VEC scaled logits starting at
  // column c0; -inf where hidden by the causal mask or not `live`, as the bool masks' bits do.
  template <int VEC, bool kVectorMask>
  __device__ __forceinline__ void apply(int64_t c0, const AlignedVector<T, VEC>& added, acc_t<T> (&scaled)[VEC],
                                        bool live = true) const {
    static_assert(kVectorMask, "additive vectors are read by register and cluster rows only");
    const uint32_t visible = live ? causal_bits<VEC, true>(c0) : 0u;
#pragma unroll
    for (int j = 0; j < VEC; ++j) scaled[j] = (visible >> j) & 1u ? scaled[j] + to_acc(added.val[j]) : neg_inf<acc_t<T>>();
  }
  // Masks VEC scaled logits starting at column c0: by one bit per column where the mask is
  // a vector of bool bytes (`bytes`, from load_bytes) or absent (causal only), else element by
  // element. kVectorMask compiles the element-by-element path out: kept in the register-row
  // kernels, its scattered loads took them from ~70 registers to ~120. The register forward
  // masks the vectors it did not load (`live` false: past the row, or hidden by the causal
  // mask) here too, with no branch around them (a branch made ptxas set the vector's registers
  // to -inf ahead of it: nine moves a vector, live or not). Launcher timing, H200, session 9
  // (masked [B, H, L, L], L = 1024): the bool-mask forward went from 80.5 to 87.0% of copy
  // (bf16) and from 74.1 to 82.2 (fp32) with it; causal rows (dropout 0.1), which branched
  // around half their vectors, from 73.4 to 71.5 (bf16).
  template <int VEC, bool kVectorMask>
  __device__ __forceinline__ void apply(int64_t c0, const MaskBytes<VEC>& bytes, acc_t<T> (&scaled)[VEC],
                                        bool live = true) const {
    if constexpr (!kVectorMask) {
      if (kind == MaskKind::Additive || (kind == MaskKind::Bool && !vector_bytes<VEC, false>(c0))) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) scaled[j] = live ? logit(c0 + j, scaled[j]) : neg_inf<acc_t<T>>();
        return;
      }
    }
    uint32_t visible = live ? causal_bits<VEC, kVectorMask>(c0) : 0u;
    if (kind == MaskKind::Bool) visible &= bool_bits(bytes);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (!((visible >> j) & 1u)) scaled[j] = neg_inf<acc_t<T>>();
    }
  }
  // Sets the raw 16-bit elements of VEC columns that a bool mask or none (not the causal mask)
  // hides to -inf, all of them where not `live`, two elements a LOP3, so that widening gives
  // their masked logits and the row max folds raw pairs (fold_pairs, one instruction per two
  // elements): apply takes a select and an fmaxf per element. A word of bool bytes (their low
  // bits, as bool_bits) times 0xff has a byte of ones per visible column, which prmt spreads over
  // half-words.
  template <int VEC>
  __device__ __forceinline__ void hide_pairs(const MaskBytes<VEC>& bytes, AlignedVector<T, VEC>& x, bool live) const {
    static_assert(sizeof(T) == 2 && VEC % 4 == 0, "16-bit elements, four columns a word of bool bytes");
    constexpr uint32_t kHiddenPair = std::is_same<T, __half>::value ? 0xfc00fc00u : 0xff80ff80u;  // -inf, -inf
    uint32_t pairs[VEC / 2], mask_words[VEC / 4];
    memcpy(pairs, x.val, sizeof(pairs));
    memcpy(mask_words, bytes.val, sizeof(mask_words));
    // Rows without a bool mask read no bytes (load_bytes gives zeros): every live column is visible.
    const uint32_t unmasked = kind != MaskKind::Bool && live ? 0x01010101u : 0u;
#pragma unroll
    for (int w = 0; w < VEC / 4; ++w) {
      const uint32_t ones = ((mask_words[w] | unmasked) & 0x01010101u) * 0xffu;
      const uint32_t keep[2] = {__byte_perm(ones, 0u, 0x1100u), __byte_perm(ones, 0u, 0x3322u)};
#pragma unroll
      for (int h = 0; h < 2; ++h) pairs[2 * w + h] = (pairs[2 * w + h] & keep[h]) | (kHiddenPair & ~keep[h]);
    }
    memcpy(x.val, pairs, sizeof(pairs));
  }
};

// The divisions that place a row in the mask, prepared on the host once per launch. Launches of
// fewer than 2^31 rows divide by FastDivmods (4 instructions where a runtime 32-bit division or
// modulo costs ~20, per dim, row and thread); larger ones divide in 64 bits. Every row of a launch
// takes the same divisions, without a branch per dim: branching on the dims in use split the
// kernels' prologue into blocks that ptxas schedules one by one, a dependent chain each.
// - Short form, every common layout: at most two divisions and a multiply. The coalesced lead dims
//   (innermost first; a run of dims the mask broadcasts over is one) are divided off in turn, but
//   broadcast dims outside all the others are not divided at all, and the outermost dim, where the
//   mask varies along it, is a multiply: nothing lies outside it, so its index is what the
//   divisions leave. With causal masking the first division is by q_len, so its remainder is the
//   query. [B, 1, L, L] masks over [B, H, L, L] divide by L and H, [B, 1, 1, L] padding masks by
//   H * L, causal rows without a mask by q_len.
//   Launcher timing, H200, session 53, [B, 16, L, L], L = 512-4096, medians of 15 paired rounds
//   (bench/results/h200-s53-launcher-locator.md): bool masks and causal rows with dropout +0.4 to
//   +3.5 points of copy (bf16 bool forward +0.5-1.4, causal forward +1.6-2.5), without dropout
//   -0.1 to +0.5.
// - Chain form, any other layout, and every additive mask: every lead dim of size > 1 (innermost
//   first, then dims of size 1 and stride 0, which FastDivmod's default divides by 1), and q_len.
//   The ADDITIVE kernels compile only this form. With the short one they moved by -3.2 to +1.7
//   points: the forwards with dropout lost 0.4-3.2 at L = 1024-4096 (fp32 at 2048 90.0 -> 86.8)
//   although they ran fewer instructions a row and only their prologues changed. In fp32 the
//   losses are occupancy: ptxas gave the 64- and 128-thread kernels (L = 1024 / 2048, -2.2 / -3.2)
//   74 registers where they had 72, which the SM allocates as 80 (8 a thread at a time), so 24
//   warps an SM fit instead of 28; at L = 512 (registers unchanged) and 4096 (256-thread blocks:
//   24 warps either way) they gained 0.8 / 0.6. The bf16 forwards (registers unchanged) lost 0.4 /
//   1.5 at L = 2048 / 4096 and the fp32 backwards 0.8 / 0.9 at 1024 / 2048: causes not found.
constexpr int kShortDivisions = 2;
struct RowLocator {
  bool fast = false;
  bool short_form = false;
  FastDivmod sizes[kMaxLeadDims];
  int64_t strides[kMaxLeadDims] = {};
  int64_t outer_stride = 0;  // short form
  FastDivmod q_len;          // chain form
};

struct LeadDim {
  int64_t size, stride;
};

// Divides by `dims` in order (slots past them keep FastDivmod's default, dividing by 1).
void set_divisions(const std::vector<LeadDim>& dims, RowLocator& r) {
  for (size_t i = 0; i < dims.size(); ++i) {
    r.sizes[i] = FastDivmod(static_cast<uint32_t>(dims[i].size));
    r.strides[i] = dims[i].stride;
  }
}

// Fills in the short form's divisions and outer stride if the layout fits it (and leaves `r` as it
// was if not). `dims`: the mask layout's lead dims of size > 1, innermost first, coalesced already
// (a run of stride-0 dims is one).
bool short_locator(std::vector<LeadDim> dims, int64_t q_len, bool causal, RowLocator& r) {
  // With causal masking the innermost dim starts with the query dim: split that off, to divide first.
  const size_t query_dims = causal ? 1 : 0;
  if (causal) {
    if (dims.empty()) dims.push_back({q_len, 0});
    const LeadDim first = dims.front();
    if (first.size % q_len != 0) return false;
    dims.front().size = q_len;
    if (first.size > q_len) dims.insert(dims.begin() + 1, LeadDim{first.size / q_len, first.stride * q_len});
  }
  // Outermost stride-0 dims read nothing. Without them, the outermost dim's index is the rest of
  // the row after the divisions: its remainder is taken only where dims outside it were dropped.
  bool outermost = true;
  while (dims.size() > query_dims && dims.back().stride == 0) {
    dims.pop_back();
    outermost = false;
  }
  int64_t outer_stride = 0;
  if (outermost && dims.size() > query_dims) {
    outer_stride = dims.back().stride;
    dims.pop_back();
  }
  if (dims.size() > kShortDivisions) return false;
  set_divisions(dims, r);
  r.outer_stride = outer_stride;
  return true;
}

RowLocator row_locator(const MaskLayout& m, int64_t rows, int64_t q_len, bool causal) {
  RowLocator r;
  r.fast = rows <= int64_t(INT32_MAX);  // every lead size and q_len divides into rows
  if (!r.fast) return r;
  std::vector<LeadDim> dims;  // innermost first; padding dims and dims the input does not have left out
  for (int d = kMaxLeadDims - 1; d >= 0; --d) {
    if (m.lead_sizes[d] > 1) dims.push_back({m.lead_sizes[d], m.lead_strides[d]});
  }
  r.short_form = m.kind != MaskKind::Additive && short_locator(dims, q_len, causal, r);
  if (r.short_form) return r;
  set_divisions(dims, r);
  r.q_len = FastDivmod(static_cast<uint32_t>(q_len));
  return r;
}

// The mask offset (in elements) and causal query of a row past 2^31 rows, in 64 bits.
__device__ __forceinline__ void locate_row_wide(const MaskLayout& m, int64_t row, int64_t q_len, int64_t& offset,
                                                int64_t& query) {
  offset = 0;
  int64_t rest = row;
#pragma unroll
  for (int d = kMaxLeadDims - 1; d >= 0; --d) {
    const int64_t size = m.lead_sizes[d];
    if (size == 1) continue;
    offset += (rest % size) * m.lead_strides[d];
    rest /= size;
  }
  query = row % q_len;
}

// Divides `rest` by the locator's first DIVISIONS sizes in turn, adding each remainder times its
// stride to `offset`; returns the quotient left, and the first remainder in `first`.
template <int DIVISIONS>
__device__ __forceinline__ uint32_t divide_off(const RowLocator& locator, uint32_t rest, int64_t& offset,
                                               uint32_t& first) {
#pragma unroll
  for (int d = 0; d < DIVISIONS; ++d) {
    const uint32_t outer = locator.sizes[d].div(rest);
    const uint32_t index = rest - outer * locator.sizes[d].divisor;
    offset += static_cast<int64_t>(index) * locator.strides[d];
    if (d == 0) first = index;
    rest = outer;
  }
  return rest;
}

// kShortForm: whether the kernel compiles the short form (see RowLocator). The host gives additive
// masks the chain form, so the ADDITIVE kernels leave the short form out.
template <typename T, bool kShortForm>
__device__ __forceinline__ MaskRow<T> mask_row(const MaskLayout& m, const RowLocator& locator, int64_t row,
                                               int64_t q_len, bool causal) {
  const int64_t elem_bytes = m.kind == MaskKind::Bool ? 1 : static_cast<int64_t>(sizeof(T));
  int64_t offset = 0, query = 0;
  if (kShortForm && locator.short_form) {
    uint32_t first = 0;  // with causal masking, the query (see RowLocator)
    const uint32_t outer = divide_off<kShortDivisions>(locator, static_cast<uint32_t>(row), offset, first);
    offset += static_cast<int64_t>(outer) * locator.outer_stride;
    query = first;
  } else if (locator.fast) {
    uint32_t first = 0;
    divide_off<kMaxLeadDims>(locator, static_cast<uint32_t>(row), offset, first);
    if (causal) query = locator.q_len.mod(static_cast<uint32_t>(row));
  } else {
    locate_row_wide(m, row, q_len, offset, query);
  }
  const int64_t last_visible = causal ? query : std::numeric_limits<int64_t>::max();
  return {static_cast<const char*>(m.data) + offset * elem_bytes, m.col_stride * elem_bytes, last_visible, m.kind};
}

// Bit j set when draw j of `words` (two 16-bit draws a word, low half first) is >= threshold,
// compared in the high half-word: the low half-word shifted up, the high one as it is.
template <int N> __device__ __forceinline__ uint32_t draws_kept(const uint32_t* words, uint32_t threshold) {
  const uint32_t high_threshold = threshold << 16;  // threshold < 65536: p < 1
  uint32_t bits = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const uint32_t word = words[j / 2];
    bits |= uint32_t(((j & 1) ? word : word << 16) >= high_threshold) << j;
  }
  return bits;
}

// Bit j set when element e0 + j survives dropout (element index = linear index in the output).
template <int VEC, class Key>
__device__ __forceinline__ uint32_t keep_bits(const Key& key, uint32_t threshold, int64_t e0) {
  constexpr int kRuns = kDropoutDrawsPerBlock / VEC;  // vectors per Philox block
  if constexpr (VEC > 1 && kRuns * VEC == kDropoutDrawsPerBlock) {
    if (e0 % VEC == 0) {
      // The vector lies in one Philox block (always, on vectorized rows): one call, and each
      // element's half-word picked at compile time (for_each_keep picks it at run time, several
      // selects an element).
      const uint4 block = philox4x32_10(static_cast<uint64_t>(e0) / kDropoutDrawsPerBlock, key);
      const uint32_t words[4] = {block.x, block.y, block.z, block.w};
      const int run = static_cast<int>(e0 % kDropoutDrawsPerBlock) / VEC;
      uint32_t mine[(VEC + 1) / 2];
#pragma unroll
      for (int w = 0; w < (VEC + 1) / 2; ++w) {
        mine[w] = words[w];
#pragma unroll
        for (int r = 1; r < kRuns; ++r) mine[w] = run == r ? words[r * VEC / 2 + w] : mine[w];
      }
      return draws_kept<VEC>(mine, threshold);
    }
  }
  uint32_t bits = 0;
  for_each_keep<VEC>(key, threshold, e0, [&](int j, bool keep) { bits |= uint32_t(keep) << j; });
  return bits;
}

// The dropout decisions of a vector of VEC 16-bit outputs as masks of its packed words: half-word
// h of word w all ones where element 2w + h is kept, so dropping is one AND a word of two
// outputs, where a kept bit took a test and a select an element.
template <int VEC> struct PackedKeep {
  uint32_t words[VEC / 2];
  template <typename T> __device__ __forceinline__ void apply(AlignedVector<T, VEC>& v) const {
    static_assert(sizeof(T) == 2, "two outputs a word");
    uint32_t packed[VEC / 2];
    memcpy(packed, v.val, sizeof(packed));
#pragma unroll
    for (int w = 0; w < VEC / 2; ++w) packed[w] &= words[w];
    memcpy(v.val, packed, sizeof(packed));
  }
};

// The threshold of dropout_threshold as two SWAR compares of 16-bit draws need it: its low 15
// bits in both half-words, and all ones where its top bit is set.
struct HalfThreshold {
  uint32_t low_pair = 0;
  uint32_t top = 0;
  HalfThreshold() = default;
  __host__ __device__ explicit HalfThreshold(uint32_t threshold)
      : low_pair((threshold & 0x7fffu) * 0x10001u), top(threshold & 0x8000u ? ~0u : 0u) {}
};

// PackedKeep's word of a Philox word's two draws (low half first): per half-word, setting the top
// bit before subtracting the threshold's low bits leaves that bit set where the draw's low bits
// are >= the threshold's (no borrow crosses halves); with the draw's own top bit that gives
// draw >= threshold (one LOP3), and prmt's sign replication spreads bits 15 and 31 over their
// half-words.
__device__ __forceinline__ uint32_t kept_halves(uint32_t draws, const HalfThreshold& t) {
  const uint32_t low_ge = (draws | 0x80008000u) - t.low_pair;
  const uint32_t ge = (draws & low_ge) | (~t.top & (draws | low_ge));
  uint32_t mask;
  asm("prmt.b32 %0, %1, 0, 0xbb99;" : "=r"(mask) : "r"(ge));
  return mask;
}

// The PackedKeep of a vector of 16-bit outputs that is Philox block `block` (register rows).
template <int VEC, class Key>
__device__ __forceinline__ PackedKeep<VEC> packed_keep(const Key& key, const HalfThreshold& threshold,
                                                       uint64_t block) {
  static_assert(VEC == kDropoutDrawsPerBlock, "a vector of 16-bit outputs is one Philox block");
  const uint4 draws = philox4x32_10(block, key);
  return {{kept_halves(draws.x, threshold), kept_halves(draws.y, threshold), kept_halves(draws.z, threshold),
           kept_halves(draws.w, threshold)}};
}

// ---- per-op arguments, in device types ---------------------------------------------------------

template <typename T> struct ForwardArgs {
  const T* x;
  T* out;
  int64_t rows, cols, x_row_stride;
  acc_t<T> scale;
  bool log;
  // masked softmax only
  acc_t<T>* lse;
  int64_t* rng_state;
  int64_t q_len;
  MaskLayout mask;
  RowLocator locator;
  bool causal, dropout;
  uint32_t threshold;
  acc_t<T> keep_scale;
  PhiloxArgs philox;
  PhiloxSchedule schedule;  // philox's key outside graph capture
  HalfThreshold half_threshold;  // threshold's, for 16-bit rows
};

// The backward reads two row tensors: `a` (y, or x for masked softmax) and dy.
template <typename T> struct BackwardArgs {
  const T* a;
  const T* dy;
  T* dx;
  int64_t rows, cols, a_row_stride, dy_row_stride;
  acc_t<T> scale;
  bool log;
  // masked softmax only
  const acc_t<T>* lse;
  const int64_t* rng_state;
  int64_t q_len;
  MaskLayout mask;
  RowLocator locator;
  bool causal, dropout;
  uint32_t threshold;
  acc_t<T> keep_scale;
  HalfThreshold half_threshold;  // threshold's, for 16-bit rows
};

// What a forward row needs besides its data: the mask row and the dropout key. ADDITIVE: the
// row's additive mask is read as vectors (register and cluster rows).
template <typename T, bool MASKED, bool ADDITIVE = false> struct ForwardRow {
  static_assert(MASKED || !ADDITIVE, "an additive mask is a mask");
  MaskRow<T> mask;
  PhiloxKey key;
  __device__ ForwardRow(const ForwardArgs<T>& a, int64_t row) {
    if constexpr (MASKED) {
      mask = mask_row<T, !ADDITIVE>(a.mask, a.locator, row, a.q_len, a.causal);
      if (a.dropout) key = unpack_philox(a.philox);
    }
  }
  __device__ __forceinline__ bool hidden_from(int64_t c0) const {
    if constexpr (MASKED) return mask.hidden_from(c0);
    return false;
  }
  template <int VEC, bool kVectorMask = false>
  __device__ __forceinline__ MaskVector<T, VEC, ADDITIVE> mask_vector(int64_t c0, bool live) const {
    if constexpr (MASKED) return mask.template load_vector<VEC, kVectorMask, ADDITIVE>(c0, live);
    return {};
  }
  // The VEC logits of x[c0 ...]: scaled (unless kUnscaled: rows that fold the scale into their
  // exps), then masked (`mask_vec`: mask_vector). Rounded products: an FMA of the scaling into a
  // later subtraction of the row max (taken over rounded products) would be off by the
  // product's rounding error, which is huge for huge logits.
  template <int VEC, bool kVectorMask = false, bool kUnscaled = false>
  __device__ __forceinline__ void logits(const ForwardArgs<T>& a, int64_t c0, const AlignedVector<T, VEC>& x,
                                         const MaskVector<T, VEC, ADDITIVE>& mask_vec, acc_t<T> (&out)[VEC],
                                         bool live = true) const {
    widen(x, out);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = kUnscaled ? out[j] : mul_rn(out[j], a.scale);
    if constexpr (MASKED) mask.template apply<VEC, kVectorMask>(c0, mask_vec, out, live);
  }
  // Stores the outputs of columns c0 ... of `row` from their VEC logits, or with kExps (never
  // for log_softmax) from exp(logit - m) for some m, whose probabilities (with dropout: times
  // keep_scale) are exps * factor, or with kShiftedLogs (log_softmax only) from logit - row max,
  // whose log-probabilities are values - factor (factor = stats.log_shift()).
  // `keep`: the vector's dropout decisions, bits (keep()) or a PackedKeep, applied with kDropout:
  // kernels that branch on a.dropout once pass its value, so that rows without dropout spend no
  // instructions on it; without dropout keep() is all ones and keep_scale 1.
  template <int VEC, bool kDropout, bool kExps = false, bool kShiftedLogs = false, class Keep = uint32_t>
  __device__ __forceinline__ void store(const ForwardArgs<T>& a, int64_t row, int64_t c0, const acc_t<T> (&values)[VEC],
                                        const Keep& keep, const RowStats<T>& stats, acc_t<T> factor = 0) const {
    constexpr bool kBits = std::is_same<Keep, uint32_t>::value;
    AlignedVector<T, VEC> v;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      acc_t<T> y;
      if (kExps) {
        y = values[j] * factor;
      } else if (kShiftedLogs) {
        y = values[j] - factor;
      } else if (!MASKED && a.log) {
        y = stats.log_prob(values[j]);
      } else {
        y = stats.prob(values[j]);
      }
      if (MASKED && kDropout) {
        if (!kExps) y *= a.keep_scale;
        if constexpr (kBits) y = (keep >> j) & 1u ? y : acc_t<T>(0);
      }
      v.val[j] = from_acc<T>(y);
    }
    if constexpr (MASKED && kDropout && !kBits) keep.apply(v);
    store_vector<T, VEC>(a.out + row * a.cols + c0, v);
  }
  // Dropout bits of columns c0 ... of `row` (all kept without dropout).
  template <int VEC>
  __device__ __forceinline__ uint32_t keep(const ForwardArgs<T>& a, int64_t row, int64_t c0) const {
    if constexpr (MASKED) {
      if (a.dropout) return keep_bits<VEC>(key, a.threshold, row * a.cols + c0);
    }
    return ~0u;
  }
  __device__ __forceinline__ void finish(const ForwardArgs<T>& a, int64_t row, const RowStats<T>& stats) const {
    if constexpr (MASKED) {
      a.lse[row] = stats.lse();
      if (row == 0) {  // one thread records the stream position for the backward, zeros without dropout
        const PhiloxKey stream = a.dropout ? unpack_philox(a.philox) : PhiloxKey{0, 0};
        a.rng_state[0] = static_cast<int64_t>(stream.seed);
        a.rng_state[1] = static_cast<int64_t>(stream.offset);
      }
    }
  }
};

// A backward row turns loaded (a, dy) into (y, g) such that
//   softmax:     partial = g * y,  dx = scale * y * (g - S)
//   log_softmax: partial = g,      dx = scale * (g - exp(y) * S)
// with S the row sum of partial. Masked softmax recomputes y = exp(logit - lse) and zeros g
// where dropout dropped the output; the dropout's keep_scale, a factor of every kept g, of S
// and so of dx, is taken into `scale` (one multiply a row instead of one an element). ADDITIVE as
// in ForwardRow.
template <typename T, bool MASKED, bool ADDITIVE = false> struct BackwardRow {
  static_assert(MASKED || !ADDITIVE, "an additive mask is a mask");
  // 16-bit rows without an additive mask take each exp's argument in one FMA, x * scale * log2 e
  // - lse * log2 e, where |lse * log2 e| < kOneFmaMaxShift (logits are at most lse): two
  // instructions an element fewer than scaling, subtracting and converting to base 2. Streamed
  // rows read additive masks too (ADDITIVE false), which add to the scaled logit.
  static constexpr bool kOneFmaExps = MASKED && !ADDITIVE && sizeof(T) == 2;
  // Whether this row takes the one-FMA arguments: the same for all its vectors. prepare() decides
  // vector by vector unless its caller decided for the row (see register_backward_kernel).
  __device__ __forceinline__ bool one_fma_exps() const {
    return kOneFmaExps && mask.kind != MaskKind::Additive && fabsf(base2_arg(-lse)) < kOneFmaMaxShift;
  }
  struct DecidePerVector {};
  MaskRow<T> mask;
  PhiloxKey key;
  acc_t<T> lse;
  acc_t<T> scale;
  __device__ BackwardRow(const BackwardArgs<T>& a, int64_t row, bool valid) : scale(a.scale) {
    if constexpr (MASKED) {
      mask = mask_row<T, !ADDITIVE>(a.mask, a.locator, row, a.q_len, a.causal);
      lse = valid ? a.lse[row] : pos_inf<acc_t<T>>();
      if (a.dropout) {
        key = {static_cast<uint64_t>(a.rng_state[0]), static_cast<uint64_t>(a.rng_state[1])};
        scale *= a.keep_scale;
      }
    }
  }
  __device__ __forceinline__ bool hidden_from(int64_t c0) const {
    if constexpr (MASKED) return mask.hidden_from(c0);
    return false;
  }
  // Dropout bits of columns c0 ... of `row`.
  template <int VEC> __device__ __forceinline__ uint32_t keep(const BackwardArgs<T>& a, int64_t row, int64_t c0) const {
    return keep_bits<VEC>(key, a.threshold, row * a.cols + c0);
  }
  // The dropout decisions of a register row's vector at column c0: a PackedKeep of 16-bit
  // vectors (one Philox block each), bits of fp32 ones.
  template <int VEC>
  __device__ __forceinline__ auto register_keep(const BackwardArgs<T>& a, int64_t row, int64_t c0) const {
    if constexpr (sizeof(T) == 2) {
      return packed_keep<VEC>(key, a.half_threshold,
                              static_cast<uint64_t>(row * a.cols + c0) / kDropoutDrawsPerBlock);
    } else {
      return keep<VEC>(a, row, c0);
    }
  }
  template <int VEC, bool kVectorMask = false>
  __device__ __forceinline__ MaskVector<T, VEC, ADDITIVE> mask_vector(int64_t c0, bool live) const {
    if constexpr (MASKED) return mask.template load_vector<VEC, kVectorMask, ADDITIVE>(c0, live);
    return {};
  }
  // keep_of(): the vector's dropout decisions, drawn only where a.dropout: bits (keep()) or a
  // PackedKeep (register_keep()), which zeros the dropped dy in their packed words. one_fma: the
  // row's one_fma_exps() as a std::bool_constant, or DecidePerVector.
  template <int VEC, bool kVectorMask = false, class KeepOf, class OneFma = DecidePerVector>
  __device__ __forceinline__ void prepare(const BackwardArgs<T>& a, int64_t c0, const AlignedVector<T, VEC>& va,
                                          const AlignedVector<T, VEC>& vdy, const MaskVector<T, VEC, ADDITIVE>& mask_vec,
                                          KeepOf keep_of, acc_t<T> (&y)[VEC], acc_t<T> (&g)[VEC],
                                          OneFma one_fma = {}) const {
    widen(va, y);
    if constexpr (MASKED) {
      using Keep = decltype(keep_of());
      AlignedVector<T, VEC> kept_dy = vdy;
      uint32_t bits = ~0u;
      if (a.dropout) {
        if constexpr (std::is_same<Keep, uint32_t>::value) {
          bits = keep_of();
        } else {
          keep_of().apply(kept_dy);
        }
      }
      widen(kept_dy, g);
      // 16-bit rows turn y into the exps' base-2 arguments here, masked (-inf where hidden).
      const float exp_offset = base2_arg(-lse);
      bool take_one_fma;
      if constexpr (std::is_same<OneFma, DecidePerVector>::value) {
        take_one_fma = one_fma_exps();
      } else {
        take_one_fma = one_fma;
      }
      if (kOneFmaExps && take_one_fma) {
        const float exp_scale = a.scale * float(kLog2e);
#pragma unroll
        for (int j = 0; j < VEC; ++j) y[j] = fmaf(y[j], exp_scale, exp_offset);
        mask.template apply<VEC, kVectorMask>(c0, mask_vec, y);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) y[j] = mul_rn(y[j], a.scale);  // as the forward's logits
        mask.template apply<VEC, kVectorMask>(c0, mask_vec, y);
        if constexpr (kOneFmaExps) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) y[j] = base2_arg(y[j] - lse);  // as exp_acc
        }
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        y[j] = kOneFmaExps ? exp2_ftz(y[j]) : exp_acc<T>(y[j] - lse);
        if constexpr (std::is_same<Keep, uint32_t>::value) {
          if (a.dropout) g[j] = (bits >> j) & 1u ? g[j] : acc_t<T>(0);
        }
      }
    } else {
      widen(vdy, g);
    }
  }
  __device__ __forceinline__ acc_t<T> partial(const BackwardArgs<T>& a, acc_t<T> y, acc_t<T> g) const {
    return !MASKED && a.log ? g : g * y;
  }
  __device__ __forceinline__ acc_t<T> grad(const BackwardArgs<T>& a, acc_t<T> y, acc_t<T> g, acc_t<T> sum) const {
    return !MASKED && a.log ? scale * (g - exp_acc<T>(y) * sum) : scale * y * (g - sum);
  }
};

// ---- register rows ---------------------------------------------------------------------------

// Whether a persistent register-row kernel prefetches the next row: unmasked rows do when the two
// copies of the raw row data fit in kMaxPrefetchRegisters (not fp32 backward), except in
// 1024-thread blocks (64 registers a thread) the backward and the forward of more than
// kRegisterElems a thread, which would spill. Masked rows need registers for the mask and the
// dropout generator; they rely on occupancy to hide latency instead.
template <typename T, int G, int ITEMS, int VEC, int TENSORS, bool MASKED>
constexpr bool register_prefetch() {
  return !MASKED && 2 * TENSORS * ITEMS * VEC * int(sizeof(T)) / 4 <= kMaxPrefetchRegisters &&
         (block_threads(G) < 1024 || (TENSORS == 1 && ITEMS * VEC <= kRegisterElems));
}

// Forward rows without register prefetch hide latency with occupancy. Masked rows ask for at
// least masked_forward_threads_per_sm resident threads: 1024 for fp32 rows (64 registers, 12-28
// bytes of spills) and for 16-bit rows of a block (64 registers, no spills), 768 for 16-bit warp
// rows (session 14: 85 registers a thread, where left alone they took up to 93; at 1024 they
// spilled 24-52 bytes. Since then the bool-mask ones take 71-72 with or without the bound,
// session 55's ptxas logs). Launcher timing, H200, session 14, [B, 16, L, L], fp32 768 -> 1024:
// bool mask L = 1024 / 2048 / 4096 87.0 / 79.8 / 75.2 -> 94.3 / 88.1 / 86.5% of copy, with dropout
// 75.8 / 72.4 / 69.9 -> 84.6 / 82.8 / 82.1, causal with dropout +1 to +6. Session 28, two runs
// each, bf16 768 -> 1024, L = 2048 / 4096 (rows of 64 / 128 threads): bool mask 90.4 / 89.3-89.4 ->
// 92.6-92.7 / 90.3, with dropout 74.8-75.0 / 75.5-75.8 -> 76.1-76.5 / 77.6-77.9, causal with
// dropout 84.9-85.2 / 88.5 -> 87.2-87.5 / 91.8-91.9; warp rows (L = 512 / 1024) level to -1.5.
// Plain rows are left to ptxas: a full SM (32 registers) measured the same as its choice for 16
// elements a thread and made 32 spill (H200, session 3). Masked cluster rows would spill and are
// left free, as is the 16-bit masked backward but for its DRAW_ALL block rows with an additive
// mask (kDrawAllBackwardThreadsPerSM); the fp32 masked backward takes a bound of
// kMaskedBackwardThreadsPerSM (80 registers, no spills, where ptxas chose 92-102): H200, session
// 9, launcher timing, masked [B, H, L, L] with dropout 0.1, L = 512 / 1024 / 2048 / 4096: 77.0 /
// 88.8 / 88.8 / 67.7 -> 83.8 / 94.1 / 92.1 / 91.7% of copy (16-bit rows: level or lower with it;
// 1024 threads cost it 2-6 points, session 14). 0 leaves ptxas its default (an explicit 1
// changes its register choices). Forward rows with an additive mask hold its values too and run
// at 768 threads: at 1024 the fp32 rows spilled 32 bytes without dropout and the 16-bit block
// rows 48-76 bytes at 32 elements a thread (session 40 gave them 16); at 768 they take 72-80
// registers with no spills. Launcher timing, H100, session 41, [B, 16, L, L], 1024 threads (16
// elements in 16-bit block rows) -> 768: fp32 L = 512 / 1024 / 2048 / 4096 88.0 / 90.3 / 90.9 /
// 91.5 -> 98.5 / 93.8 / 96.0 / 95.4% of copy (with dropout 0.1 level to -1.5); bf16 L = 4096
// 87.0 -> 95.1 (with dropout 87.5 -> 94.9), L = 2048 86.5 -> 84.9 (with dropout level).
// The bf16 additive forwards without dropout in rows of 64 / 128 threads (L = 2048 / 4096) run
// at 896 threads: there ptxas gives them 72 registers, no spills, where at 768 they took 78
// (allocated as 80: 24 warps an SM, at 72 28). Launcher timing, H100, session 55, ten paired
// rounds: 93.2 / 95.6 -> 94.0 / 96.3% of copy, 10 rounds of 10 won at each length. The fp16
// ones take 72 registers at 768 already (the bound changed their code, untimed: left at 768).
template <typename T> constexpr int masked_forward_threads_per_sm(int group, bool additive, bool draw_all) {
  if (additive && !draw_all && std::is_same<T, __nv_bfloat16>::value && (group == 64 || group == 128)) return 896;
  return !additive && (std::is_same<T, float>::value || group > 32) ? 1024 : 768;
}
constexpr int kMaskedBackwardThreadsPerSM = 768;
// 16-bit DRAW_ALL backward block rows with an additive mask (66-72 registers a thread where left
// alone: 3 blocks of 256 threads an SM) are held to 1024 resident threads: with the mask loaded
// after the draws they fit 64 registers without spills (loaded with the rows, 10 bytes spilled).
// Warp rows would spill 8 bytes and are left free. Launcher timing, H100, session 44, bf16
// [B, H, L, L] with dropout 0.1, L = 1024 / 2048 / 4096: 95.8 / 96.3 / 91.3 -> 98.1 / 97.4 / 97.8%
// of copy (the late mask loads alone, 66 registers: 95.7 / 96.1 / 90.7); every other case level.
constexpr int kDrawAllBackwardThreadsPerSM = 1024;
template <typename T> constexpr int masked_backward_threads_per_sm(int group, bool draw_all, bool additive) {
  if (sizeof(T) == 4) return kMaskedBackwardThreadsPerSM;
  return draw_all && additive && group > 32 ? kDrawAllBackwardThreadsPerSM : 0;
}
__host__ __device__ constexpr int register_min_blocks(int group, bool masked, int cluster, int threads_per_sm) {
  const int threads = block_threads(group);
  return masked && cluster == 1 && threads < threads_per_sm ? threads_per_sm / threads : 0;
}

// Masked register rows with dropout and without the causal mask (whose vectors are all live, but
// for those past a ragged row's end) run kernels of their own (DRAW_ALL) that draw every vector's
// dropout decisions with no branch between the draws: a branch around each vector's Philox block
// left its ten rounds (IMAD.WIDE, LOP3) a dependent chain of their own, one vector after another,
// where in one block ptxas interleaves the vectors' chains. Rows in the other kernels keep the
// branches (causal rows draw only their visible vectors) and their SASS (cuobjdump: all 253
// launcher kernels identical). The same draws in every kernel cost the rows without dropout 3-9
// points of copy (registers and code). Launcher timing, H200, session 16, [B, 16, L, L] bool
// mask, dropout 0.1, L = 512 / 1024 / 2048 / 4096, two runs each: bf16 forward 75.3-75.8 /
// 75.4-75.5 / 72.4-72.5 / 74.1-74.2 -> 77.9-78.1 / 77.7-77.9 / 74.8-74.9 / 75.2-75.5% of copy,
// fp32 forward 86.6 / 86.6 / 84.6-84.8 / 83.4-83.5 -> 89.1-89.3 / 88.1-88.4 / 86.6-86.8 /
// 84.8-85.0; bf16 backward 80.1-80.6 / 79.5-79.6 / 78.7-79.0 / 78.9-79.0 -> 79.5-79.9 / 79.9-80.2
// / 80.0-80.1 / 79.2-79.5. The fp32 backward draws vector by vector (see register_backward_kernel)
// and keeps its kernels.
template <typename T, bool MASKED, bool BACKWARD>
constexpr bool kDrawAll = MASKED && (!BACKWARD || sizeof(T) == 2);

// The columns of a register row a thread owns: vector i starts at column(i). Register rows are
// at most kMaxCluster * 1024 * kForwardRegisterElems columns long, so 32 bits index them.
template <int G, int ITEMS, int VEC, int CLUSTER> struct RowSlice {
  int first;
  __device__ RowSlice() {
    first = (RowCursor<G, CLUSTER>::rank() * G * ITEMS + RowCursor<G, CLUSTER>::lane()) * VEC;
  }
  __device__ __forceinline__ int column(int i) const { return first + i * G * VEC; }
};

// A thread's dropout decisions of a forward register row, vector i's as vector(i): PackedKeep
// masks in 16-bit rows (a vector is one Philox block), else bits in one word (vector i at bit
// i * VEC). The backward draws vector by vector instead (BackwardRow::register_keep).
template <typename T, int ITEMS, int VEC> struct RowKeep {
  static constexpr bool kPacked = sizeof(T) == 2;
  static_assert(!kPacked || VEC == kDropoutDrawsPerBlock, "a 16-bit vector is one Philox block");
  static_assert(kPacked || ITEMS * VEC <= 32, "one bit per element of a thread in one word");
  // Set by draw(), read only by rows with dropout. (bits' initial value is never read, but
  // dropping it changes the fp32 forwards' SASS, which was not re-measured.)
  PackedKeep<VEC> packed[kPacked ? ITEMS : 1];
  uint32_t bits = ~0u;

  __device__ __forceinline__ auto vector(int i) const {
    if constexpr (kPacked) {
      return packed[i];
    } else {
      return bits >> (i * VEC);
    }
  }

  // Draws the decisions of a row whose first element is element e0 of the output, for the vectors
  // whose first column c0 has live(c0); the others keep nothing (their outputs are 0 anyway), or
  // with ALL for every vector, live or not, with no branch between them (see kDrawAll). A
  // vector's Philox counter is the row's first plus a constant a vector (register rows start at
  // whole blocks). An fp32 vector is half a block: where rows start at whole blocks (`paired`,
  // cols % 8 == 0, uniform across the grid) the two lanes sharing each block draw it once, each
  // lane the blocks of every other vector, and swap the partner's half as bits (one shuffle that
  // every lane of the warp reaches), where a draw per vector generated every block twice.
  template <bool ALL, int G, int CLUSTER, class Key, class Live>
  __device__ __forceinline__ void draw(const Key& key, uint32_t threshold, const HalfThreshold& half_threshold,
                                       int64_t e0, const RowSlice<G, ITEMS, VEC, CLUSTER>& slice, bool paired,
                                       Live live) {
    if constexpr (kPacked) {
      const uint64_t first_block = static_cast<uint64_t>(e0 + slice.column(0)) / kDropoutDrawsPerBlock;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        packed[i] = {};
        if (ALL || live(slice.column(i))) packed[i] = packed_keep<VEC>(key, half_threshold, first_block + uint64_t(i) * G);
      }
    } else {
      bits = 0;
      if constexpr (2 * VEC == kDropoutDrawsPerBlock && ITEMS % 2 == 0) {
        if (paired) {
          const int parity = threadIdx.x & 1;  // G is even: pairs are lanes 2k, 2k + 1 of a group
          const int pair_column = slice.column(0) - parity * VEC;
          const uint64_t first_block = static_cast<uint64_t>(e0 + pair_column) / kDropoutDrawsPerBlock;
          uint32_t partner = 0;
#pragma unroll
          for (int j = 0; j < ITEMS / 2; ++j) {
            const int i = 2 * j + parity;
            if (ALL || live(pair_column + i * G * VEC)) {
              const uint4 block = philox4x32_10(first_block + static_cast<uint64_t>(i) * (G / 2), key);
              const uint32_t first_words[2] = {block.x, block.y}, second_words[2] = {block.z, block.w};
              const uint32_t first = draws_kept<VEC>(first_words, threshold);
              const uint32_t second = draws_kept<VEC>(second_words, threshold);
              bits |= (parity ? second : first) << (i * VEC);
              partner |= (parity ? first : second) << (i * VEC);
            }
          }
          bits |= __shfl_xor_sync(0xffffffffu, partner, 1);
          return;
        }
      }
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c0 = slice.column(i);
        if (ALL || live(c0)) bits |= keep_bits<VEC>(key, threshold, e0 + c0) << (i * VEC);
      }
    }
  }
};

// Kernels that do not prefetch into registers ask the L2 for the next row instead (sm_90 bulk
// prefetch, one instruction per group and tensor, no registers held): the block's slice of
// the row, cut at the row's end and, with causal masking, after the last visible column.
template <int G, int ITEMS, int VEC, int CLUSTER, typename T, class Args>
__device__ __forceinline__ void prefetch_row_l2(const Args& a, const T* tensor, int64_t row_stride, int64_t row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (row >= a.rows || RowCursor<G, CLUSTER>::lane() != 0) return;
  int64_t end = a.cols;
  if (a.causal) end = std::min<int64_t>(end, (row % a.q_len + VEC) / VEC * VEC);
  const int64_t begin = static_cast<int64_t>(RowCursor<G, CLUSTER>::rank()) * G * ITEMS * VEC;
  end = std::min<int64_t>(end, begin + G * ITEMS * VEC);
  if (end <= begin) return;
  // 16-byte multiples at 16-byte aligned addresses: register rows are vectorized rows.
  prefetch_l2(tensor + row * row_stride + begin, static_cast<uint32_t>((end - begin) * sizeof(T)));
#endif
}

// ROW_GRID: launched on row_grid's 3D grid (masked rows of one row a block), see RowCursor.
// DRAW_ALL: masked rows with dropout and without the causal mask (see kDrawAll).
// ADDITIVE: masked rows whose mask is additive (see ForwardRow).
template <typename T, int G, int ITEMS, int VEC, bool MASKED, int CLUSTER, bool PERSISTENT, bool ROW_GRID = false,
          bool DRAW_ALL = false, bool ADDITIVE = false>
__global__ void __launch_bounds__(block_threads(G), register_min_blocks(G, MASKED, CLUSTER,
                                                                         masked_forward_threads_per_sm<T>(G, ADDITIVE, DRAW_ALL)))
    register_forward_kernel(ForwardArgs<T> a) {
  using A = acc_t<T>;
  using Cursor = RowCursor<G, CLUSTER, ROW_GRID>;
  using Vec = AlignedVector<T, VEC>;
  using Ctx = ForwardRow<T, MASKED, ADDITIVE>;
  constexpr bool kPrefetch = PERSISTENT && register_prefetch<T, G, ITEMS, VEC, 1, MASKED>();
  // Clusters take each thread's exps against its own max, so that their blocks exchange one
  // (max, sum) pair behind one barrier; a single group reduces the row max first, then takes the
  // exps against it (one exp per element for every dtype).
  constexpr bool kOnePass = CLUSTER > 1;
  // Masked 16-bit rows of one group fold the scale into their exps: exp2((x - max x) * scale *
  // log2 e), one multiply an element fewer; the host sends them a finite scale > 0 only, for
  // which the max of x is that of the logits (other scales take streamed rows). Not with an
  // additive mask, whose values change the max.
  constexpr bool kFoldScale = MASKED && !ADDITIVE && !kOnePass && sizeof(T) == 2;
  const MaxSum<A> identity{neg_inf<A>(), A(0)};
  __shared__ A scratch[32];
  __shared__ MaxSum<A> slots[2];
  const RowSlice<G, ITEMS, VEC, CLUSTER> slice;
  // Prefetches the thread's vectors of a row; none of a row past the end, none past the row's
  // end, none hidden by the causal mask (their probabilities are 0).
  const int cols = static_cast<int>(a.cols);
  auto load = [&](int64_t row, const Ctx& ctx, Vec (&v)[ITEMS]) {
    if (row >= a.rows) return;
    const T* x = a.x + row * a.x_row_stride;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = slice.column(i);
      if (c0 < cols && !ctx.hidden_from(c0)) v[i] = load_vector<T, VEC>(x + c0);
    }
  };
  auto context = [&](int64_t row) { return Ctx(a, row < a.rows ? row : 0); };
  int64_t base = Cursor::first();
  Vec next[ITEMS] = {};
  Ctx next_ctx = context(Cursor::row(base));  // the prefetched row's
  if constexpr (kPrefetch) load(Cursor::row(base), next_ctx, next);
  for (int parity = 0; base < a.rows; base += Cursor::step(), parity ^= 1) {
    const int64_t row = Cursor::row(base);
    const bool valid = row < a.rows;
    // Without prefetch the context is made here, so only one row's is live.
    const Ctx ctx = kPrefetch ? next_ctx : context(row);
    Vec cur[ITEMS];
    if constexpr (kPrefetch) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) cur[i] = next[i];
      // The next row's loads stay in flight through this row's reductions and stores.
      const int64_t next_row = Cursor::row(base + Cursor::step());
      next_ctx = context(next_row);
      load(next_row, next_ctx, next);
    }
    // Without prefetch, every load of the row (data and mask) is issued here, before any
    // arithmetic (see load_live).
    MaskVector<T, VEC, ADDITIVE> masks[ITEMS];
    if constexpr (!kPrefetch) {
      const T* x = a.x + row * a.x_row_stride;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c0 = slice.column(i);
        const bool live = valid && c0 < cols && !ctx.hidden_from(c0);
        cur[i] = load_live<T, VEC>(live, x + c0);
        masks[i] = ctx.template mask_vector<VEC, true>(c0, live);
      }
    }
    // The dropout decisions of the thread's vectors, drawn while the loads are in flight: drawn
    // at the stores, the bf16 forward fell from 92 to 75-78% of copy without dropout and from 72
    // to 63 with it (L = 512-2048, H200, session 12, launcher timing). Hidden vectors store zeros
    // anyway. Outside graph capture the round keys are kernel parameters (a.schedule), operands
    // of Philox's xors; loaded (under capture) they take two adds a round.
    RowKeep<T, ITEMS, VEC> keep;
    if constexpr (MASKED) {
      if (a.dropout) {
        const auto live = [&](int c0) { return valid && c0 < cols && !ctx.hidden_from(c0); };
        const bool paired = a.cols % kDropoutDrawsPerBlock == 0;
        if (a.philox.captured) {
          keep.template draw<DRAW_ALL>(unpack_philox(a.philox), a.threshold, a.half_threshold, row * a.cols, slice,
                                       paired, live);
        } else {
          keep.template draw<DRAW_ALL>(a.schedule, a.threshold, a.half_threshold, row * a.cols, slice, paired, live);
        }
      }
    }
    // The thread's logits (-inf outside the row) and their max. Rows that prefetch branch
    // around the vectors outside the row; the others mask them (masked rows: also the vectors
    // hidden by the causal mask, through the mask's bits: see MaskRow::apply).
    // Rows that fold the scale without the causal mask (DRAW_ALL) mask raw pairs and take the
    // max pair by pair (see MaskRow::hide_pairs). Causal rows keep apply: masking bytes by the
    // causal mask too cost their forwards up to 3.9 points of copy (bf16 with dropout, L = 2048,
    // H100, launcher timing, session 49).
    constexpr bool kPairMask = kFoldScale && DRAW_ALL;
    constexpr bool kBranchless = !kPrefetch;
    A values[ITEMS][VEC];
    A thread_max = neg_inf<A>();
    if constexpr (kPairMask) {
      const T bound = from_acc<T>(neg_inf<A>());
      Pair16<T> pair_max(bound, bound);
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c0 = slice.column(i);
        ctx.mask.template hide_pairs<VEC>(masks[i], cur[i], valid && c0 < cols);
        pair_max = fold_pairs<T>(cur[i].val, pair_max, [](Pair16<T> p, Pair16<T> q) { return __hmax2(p, q); });
        widen(cur[i], values[i]);
      }
      thread_max = fmaxf(__low2float(pair_max), __high2float(pair_max));
    } else {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c0 = slice.column(i);
        const bool live = valid && c0 < cols && !ctx.hidden_from(c0);
        if (!kBranchless && !live) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) values[i][j] = neg_inf<A>();
          continue;
        }
        ctx.template logits<VEC, true, kFoldScale>(a, c0, cur[i], masks[i], values[i], live);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (!MASKED && kBranchless && !live) values[i][j] = neg_inf<A>();
          // One instruction where nan_max takes three. A single group need not carry a NaN in
          // the max: a NaN logit makes the sum, and so the whole row, NaN all the same.
          thread_max = kOnePass ? nan_max(thread_max, values[i][j]) : max(thread_max, values[i][j]);
        }
      }
    }
    if constexpr (PERSISTENT && !kPrefetch) {
      prefetch_row_l2<G, ITEMS, VEC, CLUSTER>(a, a.x, a.x_row_stride, Cursor::row(base + Cursor::step()));
    }
    // Sum of exp(logit - shift), with shift the row max or (one pass) the thread's max. Softmax
    // keeps those exps, except fp32 in one pass: it recomputes exp(logit - row max) on output,
    // which rounds once instead of twice. log_softmax (never one pass) keeps the logits, or for
    // bf16 rows logit - row max, so each output is one subtraction (bf16 log_softmax ran 7-8
    // points of copy bandwidth below softmax on the H200; fp32 ran level). ptxas gives the bf16
    // kernels no more registers for it, but fp16 ones 7-11 more (48 -> 55-59): they keep the logits.
    constexpr bool kShiftedLogs = !kOnePass && !MASKED && std::is_same<T, __nv_bfloat16>::value;
    const A shift_max = kOnePass ? thread_max : group_reduce<G>(thread_max, FmaxOp{}, neg_inf<A>(), scratch);
    const bool shift_empty = shift_max == neg_inf<A>();
    const A shift = shift_empty ? A(0) : shift_max;
    const bool keep_exps = (!kOnePass || sizeof(T) == 2) && (MASKED || !a.log);
    // 16-bit rows take exp2((logit - shift) * exp_scale), in one FMA where the shift is small
    // (see kOneFmaMaxShift): an add an element fewer.
    const A exp_scale = (kFoldScale ? a.scale : A(1)) * A(kLog2e);
    const A shift_exp = shift * exp_scale;
    A sum = 0;
    auto take_exps = [&](auto one_fma) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const A shifted = values[i][j] - shift;
          A e;
          if constexpr (sizeof(T) != 2) {
            e = exp_acc<T>(shifted);
          } else if constexpr (decltype(one_fma)::value) {
            e = exp2_ftz(fmaf(values[i][j], exp_scale, -shift_exp));
          } else {
            e = exp2_ftz(shifted * exp_scale);
          }
          sum += e;
          if (keep_exps) {
            values[i][j] = e;
          } else if (kShiftedLogs) {
            values[i][j] = shifted;
          }
        }
    };
    if (sizeof(T) == 2 && fabsf(shift_exp) < kOneFmaMaxShift) {
      take_exps(std::true_type{});
    } else {
      take_exps(std::false_type{});
    }
    MaxSum<A> total{shift_max, A(0)};
    if constexpr (kOnePass) {
      // The group's max and sum (two scalar reductions: cheaper than one of pairs), then one
      // exchange of (max, sum) pairs between the cluster's blocks.
      const A group_max = group_reduce<G>(thread_max, NanMaxOp{}, neg_inf<A>(), scratch);
      const A rescaled = shift_empty ? A(0) : sum * exp_acc<T>(thread_max - group_max);
      total = cluster_reduce<CLUSTER>(MaxSum<A>{group_max, group_reduce<G>(rescaled, SumOp{}, A(0), scratch)},
                                      MaxSumOp<T>{}, identity, &slots[parity]);
    } else {
      total.sum = group_reduce<G>(sum, SumOp{}, A(0), scratch);
    }
    // The row max of the logits: rounding is monotonic, so the scaled max of x is the max of the
    // rounded products, bit for bit (the backward recomputes those against this lse).
    const RowStats<T> stats(kFoldScale ? mul_rn(total.max, a.scale) : total.max, total.sum, a.log);
    // exp(logit - shift) * factor = exp(logit - row max) / row sum
    A factor = stats.inv_sum;
    if constexpr (kShiftedLogs) {
      if (a.log) factor = stats.log_shift();
    }
    if constexpr (kOnePass) factor = shift_empty ? A(0) : exp_acc<T>(thread_max - stats.max) * stats.inv_sum;
    auto store_row = [&](auto dropout) {
      constexpr bool kDropout = decltype(dropout)::value;
      const A exps_factor = kDropout ? factor * a.keep_scale : factor;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c0 = slice.column(i);
        if (valid && c0 < cols) {
          const auto vector_keep = [&] {
            if constexpr (kDropout) {
              return keep.vector(i);
            } else {
              return ~0u;
            }
          }();
          if (keep_exps) {
            ctx.template store<VEC, kDropout, true>(a, row, c0, values[i], vector_keep, stats, exps_factor);
          } else if constexpr (kShiftedLogs) {
            ctx.template store<VEC, false, false, true>(a, row, c0, values[i], vector_keep, stats, factor);
          } else {
            ctx.template store<VEC, kDropout>(a, row, c0, values[i], vector_keep, stats);
          }
        }
      }
    };
    if (MASKED && a.dropout) {
      store_row(std::true_type{});
    } else {
      store_row(std::false_type{});
    }
    if (valid && Cursor::lane() == 0 && Cursor::rank() == 0) ctx.finish(a, row, stats);
  }
  cluster_exit_barrier<CLUSTER>();
}

// DRAW_ALL: 16-bit masked rows with dropout and without the causal mask (see kDrawAll).
// ADDITIVE: masked rows whose mask is additive (see BackwardRow).
template <typename T, int G, int ITEMS, int VEC, bool MASKED, int CLUSTER, bool PERSISTENT, bool ROW_GRID = false,
          bool DRAW_ALL = false, bool ADDITIVE = false>
__global__ void __launch_bounds__(block_threads(G), register_min_blocks(G, MASKED, CLUSTER,
                                                                         masked_backward_threads_per_sm<T>(G, DRAW_ALL, ADDITIVE)))
    register_backward_kernel(BackwardArgs<T> a) {
  static_assert(!DRAW_ALL || sizeof(T) == 2, "DRAW_ALL backward rows are 16-bit rows (one Philox block a vector)");
  using A = acc_t<T>;
  using Cursor = RowCursor<G, CLUSTER, ROW_GRID>;
  using Vec = AlignedVector<T, VEC>;
  using Ctx = BackwardRow<T, MASKED, ADDITIVE>;
  constexpr bool kPrefetch = PERSISTENT && register_prefetch<T, G, ITEMS, VEC, 2, MASKED>();
  // (y, g) of every vector are kept through the reduction by masked rows (remaking them costs
  // mask reads, exps and Philox) and by rows without prefetch; plain rows that prefetch remake
  // them from the raw vectors, which take half the registers for 16-bit types.
  constexpr bool kRemake = !MASKED && kPrefetch;
  __shared__ A scratch[32];
  __shared__ A slots[2];
  const RowSlice<G, ITEMS, VEC, CLUSTER> slice;
  // Prefetches the thread's vectors of both tensors; vectors hidden by the causal mask are not
  // read (y = 0 there, so dx = 0).
  const int cols = static_cast<int>(a.cols);
  auto load = [&](int64_t row, const Ctx& ctx, Vec (&va)[ITEMS], Vec (&vdy)[ITEMS]) {
    if (row >= a.rows) return;
    const T* src_a = a.a + row * a.a_row_stride;
    const T* src_dy = a.dy + row * a.dy_row_stride;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = slice.column(i);
      if (c0 < cols && !ctx.hidden_from(c0)) {
        va[i] = load_vector<T, VEC>(src_a + c0);
        vdy[i] = load_vector<T, VEC>(src_dy + c0);
      }
    }
  };
  auto context = [&](int64_t row) { return Ctx(a, row < a.rows ? row : 0, row < a.rows); };
  int64_t base = Cursor::first();
  Vec next_a[ITEMS] = {}, next_dy[ITEMS] = {};
  Ctx next_ctx = context(Cursor::row(base));  // the prefetched row's
  if constexpr (kPrefetch) load(Cursor::row(base), next_ctx, next_a, next_dy);
  for (int parity = 0; base < a.rows; base += Cursor::step(), parity ^= 1) {
    const int64_t row = Cursor::row(base);
    const bool valid = row < a.rows;
    // Without prefetch the context is made here, so only one row's is live.
    const Ctx ctx = kPrefetch ? next_ctx : context(row);
    Vec cur_a[ITEMS], cur_dy[ITEMS];
    if constexpr (kPrefetch) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        cur_a[i] = next_a[i];
        cur_dy[i] = next_dy[i];
      }
      // The next row's loads stay in flight through this row's reduction and stores.
      const int64_t next_row = Cursor::row(base + Cursor::step());
      next_ctx = context(next_row);
      load(next_row, next_ctx, next_a, next_dy);
    }
    // Without prefetch, every load of the row (both tensors and the mask) is issued here, before
    // any arithmetic (see load_live).
    MaskVector<T, VEC, ADDITIVE> masks[ITEMS];
    if constexpr (!kPrefetch) {
      const T* src_a = a.a + row * a.a_row_stride;
      const T* src_dy = a.dy + row * a.dy_row_stride;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c0 = slice.column(i);
        const bool live = valid && c0 < cols && !ctx.hidden_from(c0);
        cur_a[i] = load_live<T, VEC>(live, src_a + c0);
        cur_dy[i] = load_live<T, VEC>(live, src_dy + c0);
        if constexpr (!DRAW_ALL) masks[i] = ctx.template mask_vector<VEC, true>(c0, live);
      }
    }
    // (y, g) of every vector; 0 outside the row and where hidden, so dx = 0 there (plain rows
    // without prefetch get that from the zero vectors of load_live; masked rows branch around
    // those vectors, skipping their mask, exps and dropout bits: masking them as the forward
    // does lost up to 12 points of copy, fp32 at L = 4096, launcher timing, session 9).
    constexpr bool kBranchless = !MASKED && !kPrefetch;
    A y[ITEMS][VEC], g[ITEMS][VEC];
    A sum = 0;
    // DRAW_ALL: every vector's dropout decisions first, with no branch between the draws, then
    // the mask's loads, so the mask is not held through the Philox rounds (see kDrawAllBackwardThreadsPerSM).
    PackedKeep<VEC> drawn[DRAW_ALL ? ITEMS : 1];
    if constexpr (DRAW_ALL) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) drawn[i] = ctx.template register_keep<VEC>(a, row, slice.column(i));
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c0 = slice.column(i);
        masks[i] = ctx.template mask_vector<VEC, true>(c0, valid && c0 < cols && !ctx.hidden_from(c0));
      }
    }
    // One body for rows with and without dropout (prepare draws the dropout decisions where
    // a.dropout, vector by vector): splitting it on a.dropout, as the forward does, cost 16-bit
    // rows 4-6 points of copy at L = 2048 (H200, session 10, launcher timing); drawing the row's
    // decisions first, as the forward does, cost fp32 rows up to 8 (L = 2048 / 4096, session 12).
    // Rows that draw vector by vector (not DRAW_ALL) make the one-FMA choice (Ctx::one_fma_exps)
    // once a row, so that each vector's Philox rounds and exps stay in one basic block. DRAW_ALL
    // rows have drawn already; split by row they took 8 registers more (72, 6 bytes spilled).
    auto prepare_row = [&](auto one_fma) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c0 = slice.column(i);
        const bool live = valid && c0 < cols && !ctx.hidden_from(c0);
        if (!kBranchless && !live) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) y[i][j] = g[i][j] = A(0);
          continue;
        }
        ctx.template prepare<VEC, true>(a, c0, cur_a[i], cur_dy[i], masks[i],
                                        [&] {
                                          if constexpr (DRAW_ALL) {
                                            return drawn[i];
                                          } else {
                                            return ctx.template register_keep<VEC>(a, row, c0);
                                          }
                                        }, y[i], g[i], one_fma);
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum += ctx.partial(a, y[i][j], g[i][j]);
      }
    };
    if constexpr (DRAW_ALL) {
      prepare_row(typename Ctx::DecidePerVector{});
    } else if (ctx.one_fma_exps()) {
      prepare_row(std::true_type{});
    } else {
      prepare_row(std::false_type{});
    }
    if constexpr (PERSISTENT && !kPrefetch) {
      const int64_t next_row = Cursor::row(base + Cursor::step());
      prefetch_row_l2<G, ITEMS, VEC, CLUSTER>(a, a.a, a.a_row_stride, next_row);
      prefetch_row_l2<G, ITEMS, VEC, CLUSTER>(a, a.dy, a.dy_row_stride, next_row);
    }
    sum = row_reduce<G, CLUSTER>(sum, SumOp{}, A(0), scratch, &slots[parity]);
    T* dx = a.dx + row * a.cols;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = slice.column(i);
      if (valid && c0 < cols) {
        Vec v;
        if (ctx.hidden_from(c0)) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) v.val[j] = from_acc<T>(A(0));
        } else {
          if constexpr (kRemake) {
            ctx.template prepare<VEC, true>(a, c0, cur_a[i], cur_dy[i], masks[i], [] { return ~0u; }, y[i], g[i]);
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) v.val[j] = from_acc<T>(ctx.grad(a, y[i][j], g[i][j], sum));
        }
        store_vector<T, VEC>(dx + c0, v);
      }
    }
  }
  cluster_exit_barrier<CLUSTER>();
}

// ---- streamed rows ---------------------------------------------------------------------------

// Calls f(c0, vector) for each of the thread's vectors of the row, kStreamUnroll loads in flight.
// With CACHE the vectors come from (and, on the first pass, go to) the row's shared-memory copy;
// each thread reads back only what it wrote, so the copy needs no barrier.
template <int G, int VEC, bool CACHE, bool FILL, typename T, class F>
__device__ __forceinline__ void stream_row(const T* src, T* cache, int64_t cols, F f) {
  const int lane = RowCursor<G>::lane();
  for (int64_t c = static_cast<int64_t>(lane) * VEC; c < cols; c += int64_t(G) * VEC * kStreamUnroll) {
    AlignedVector<T, VEC> v[kStreamUnroll];
#pragma unroll
    for (int u = 0; u < kStreamUnroll; ++u) {
      const int64_t cu = c + int64_t(u) * G * VEC;
      if (cu < cols) v[u] = CACHE && !FILL ? load_vector<T, VEC>(cache + cu) : load_vector<T, VEC>(src + cu);
    }
#pragma unroll
    for (int u = 0; u < kStreamUnroll; ++u) {
      const int64_t cu = c + int64_t(u) * G * VEC;
      if (cu < cols) {
        if (CACHE && FILL) store_vector<T, VEC>(cache + cu, v[u]);
        f(cu, v[u]);
      }
    }
  }
}

template <typename T, int G, int VEC, bool MASKED, bool CACHE>
__global__ void __launch_bounds__(block_threads(G)) streamed_forward_kernel(ForwardArgs<T> a) {
  using A = acc_t<T>;
  using Cursor = RowCursor<G>;
  static_assert(!CACHE || G > 32, "a cached row belongs to a whole block");
  __shared__ A scratch[32];
  extern __shared__ uint4 cache_storage[];
  T* cache = reinterpret_cast<T*>(cache_storage);
  for (int64_t base = Cursor::first(); base < a.rows; base += Cursor::step()) {
    const int64_t row = Cursor::row(base);
    const bool valid = row < a.rows;
    const ForwardRow<T, MASKED> ctx(a, valid ? row : 0);
    const T* x = a.x + row * a.x_row_stride;
    const int64_t cols = valid ? a.cols : 0;
    // Online max and sum: the running sum is rescaled whenever the running max grows.
    A max = neg_inf<A>(), sum = 0;
    stream_row<G, VEC, CACHE, true>(x, cache, cols, [&](int64_t c0, const AlignedVector<T, VEC>& v) {
      A logits[VEC];
      ctx.template logits<VEC>(a, c0, v, ctx.template mask_vector<VEC>(c0, true), logits);
      A vmax = neg_inf<A>();
#pragma unroll
      for (int j = 0; j < VEC; ++j) vmax = logits[j] > vmax ? logits[j] : vmax;
      if (vmax > max) {
        sum *= exp_acc<T>(max - vmax);
        max = vmax;
      }
      if (max != neg_inf<A>()) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum += exp_acc<T>(logits[j] - max);
      }
    });
    const A row_max = group_reduce<G>(max, MaxOp{}, neg_inf<A>(), scratch);
    sum = max == neg_inf<A>() ? A(0) : sum * exp_acc<T>(max - row_max);
    sum = group_reduce<G>(sum, SumOp{}, A(0), scratch);
    const RowStats<T> stats(row_max, sum, a.log);
    stream_row<G, VEC, CACHE, false>(x, cache, cols, [&](int64_t c0, const AlignedVector<T, VEC>& v) {
      A logits[VEC];
      ctx.template logits<VEC>(a, c0, v, ctx.template mask_vector<VEC>(c0, true), logits);
      ctx.template store<VEC, MASKED>(a, row, c0, logits, ctx.template keep<VEC>(a, row, c0), stats);
    });
    if (valid && Cursor::lane() == 0) ctx.finish(a, row, stats);
  }
}

template <typename T, int G, int VEC, bool MASKED, bool CACHE>
__global__ void __launch_bounds__(block_threads(G)) streamed_backward_kernel(BackwardArgs<T> a) {
  using A = acc_t<T>;
  using Cursor = RowCursor<G>;
  static_assert(!CACHE || G > 32, "a cached row belongs to a whole block");
  __shared__ A scratch[32];
  extern __shared__ uint4 cache_storage[];
  T* cache_a = reinterpret_cast<T*>(cache_storage);
  T* cache_dy = cache_a + a.cols;
  const int lane = Cursor::lane();
  for (int64_t base = Cursor::first(); base < a.rows; base += Cursor::step()) {
    const int64_t row = Cursor::row(base);
    const bool valid = row < a.rows;
    const BackwardRow<T, MASKED> ctx(a, valid ? row : 0, valid);
    const T* src_a = a.a + row * a.a_row_stride;
    const T* src_dy = a.dy + row * a.dy_row_stride;
    const int64_t cols = valid ? a.cols : 0;
    // Both tensors advance together: the same thread owns the same columns of each.
    auto pass = [&](auto fill, auto f) {
      constexpr bool kFill = decltype(fill)::value;
      for (int64_t c = static_cast<int64_t>(lane) * VEC; c < cols; c += int64_t(G) * VEC * kStreamUnroll) {
        AlignedVector<T, VEC> va[kStreamUnroll], vdy[kStreamUnroll];
#pragma unroll
        for (int u = 0; u < kStreamUnroll; ++u) {
          const int64_t cu = c + int64_t(u) * G * VEC;
          if (cu < cols) {
            va[u] = load_vector<T, VEC>((CACHE && !kFill ? cache_a : src_a) + cu);
            vdy[u] = load_vector<T, VEC>((CACHE && !kFill ? cache_dy : src_dy) + cu);
          }
        }
#pragma unroll
        for (int u = 0; u < kStreamUnroll; ++u) {
          const int64_t cu = c + int64_t(u) * G * VEC;
          if (cu < cols) {
            if (CACHE && kFill) {
              store_vector<T, VEC>(cache_a + cu, va[u]);
              store_vector<T, VEC>(cache_dy + cu, vdy[u]);
            }
            A y[VEC], g[VEC];
            ctx.template prepare<VEC>(a, cu, va[u], vdy[u], ctx.template mask_vector<VEC>(cu, true),
                                      [&] { return ctx.template keep<VEC>(a, row, cu); }, y, g);
            f(cu, y, g);
          }
        }
      }
    };
    A sum = 0;
    pass(std::true_type{}, [&](int64_t, const A(&y)[VEC], const A(&g)[VEC]) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum += ctx.partial(a, y[j], g[j]);
    });
    sum = group_reduce<G>(sum, SumOp{}, A(0), scratch);
    pass(std::false_type{}, [&](int64_t c0, const A(&y)[VEC], const A(&g)[VEC]) {
      AlignedVector<T, VEC> v;
#pragma unroll
      for (int j = 0; j < VEC; ++j) v.val[j] = from_acc<T>(ctx.grad(a, y[j], g[j], sum));
      store_vector<T, VEC>(a.dx + row * a.cols + c0, v);
    });
  }
}

// Writes dx of a 16-byte vector of a backward row at column c0 from its y, g and the row's sum.
template <typename T, int VEC, class Row>
__device__ __forceinline__ void store_grad_vector(const Row& ctx, const BackwardArgs<T>& a, int64_t row, int c0,
                                                  const acc_t<T> (&y)[VEC], const acc_t<T> (&g)[VEC], acc_t<T> sum) {
  AlignedVector<T, VEC> v;
#pragma unroll
  for (int j = 0; j < VEC; ++j) v.val[j] = from_acc<T>(ctx.grad(a, y[j], g[j], sum));
  uint4 raw;
  memcpy(&raw, &v, sizeof(raw));
  store_16_bytes(a.dx + row * a.cols + c0, raw);
}

// y and dy of a 16-byte vector of an unmasked backward row at column c0, prepared from its raw loads.
template <typename T, int VEC, class Row>
__device__ __forceinline__ void prepare_backward_vector(const Row& ctx, const BackwardArgs<T>& a, int c0, const uint4& ry,
                                                        const uint4& rdy, acc_t<T> (&y)[VEC], acc_t<T> (&g)[VEC]) {
  AlignedVector<T, VEC> vy, vdy;
  static_assert(sizeof(vy) == sizeof(ry), "16-byte vectors");
  memcpy(&vy, &ry, sizeof(ry));
  memcpy(&vdy, &rdy, sizeof(rdy));
  ctx.template prepare<VEC>(a, c0, vy, vdy, {}, [] { return 0u; }, y, g);
}

// Unmasked backward rows of 16-byte vectors in two passes (torch.compile's shape): the first reads
// the row from HBM asking L2 to keep it (kEvictLast) for the row sum, the second re-reads it from
// L2 (kEvictFirst) for dx. A thread holds kRereadUnroll<T> vectors of each tensor at a time, not its
// share of the row, so the blocks stay small in registers and an SM holds more rows in flight.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS, 2048 / THREADS) reread_backward_kernel(BackwardArgs<T> a) {
  using A = acc_t<T>;
  constexpr int VEC = kVec16<T>;
  constexpr int UNROLL = kRereadUnroll<T>;
  __shared__ A scratch[32];
  const BackwardRow<T, false> ctx(a, 0, true);
  const auto keep = l2_policy<L2Hint::kEvictLast>();
  const auto drop = l2_policy<L2Hint::kEvictFirst>();
  const int cols = static_cast<int>(a.cols);
  constexpr int kStride = THREADS * VEC;  // columns between a thread's consecutive vectors
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* y_row = a.a + row * a.a_row_stride;
    const T* dy_row = a.dy + row * a.dy_row_stride;
    // Calls f(c0, y, g) for each of the thread's vectors, UNROLL of each tensor loaded at once.
    const auto pass = [&](auto policy, auto f) {
      for (int base = static_cast<int>(threadIdx.x) * VEC; base < cols; base += kStride * UNROLL) {
        uint4 ry[UNROLL], rdy[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int c0 = base + u * kStride;
          ry[u] = c0 < cols ? load_hinted(y_row + c0, policy) : uint4{};
          rdy[u] = c0 < cols ? load_hinted(dy_row + c0, policy) : uint4{};
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int c0 = base + u * kStride;
          if (c0 >= cols) continue;
          A y[VEC], g[VEC];
          prepare_backward_vector(ctx, a, c0, ry[u], rdy[u], y, g);
          f(c0, y, g);
        }
      }
    };
    A sum = 0;
    pass(keep, [&](int, const A(&y)[VEC], const A(&g)[VEC]) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum += ctx.partial(a, y[j], g[j]);
    });
    sum = group_reduce<THREADS>(sum, SumOp{}, A(0), scratch);
    pass(drop, [&](int c0, const A(&y)[VEC], const A(&g)[VEC]) {
      store_grad_vector<T, VEC>(ctx, a, row, c0, y, g, sum);
    });
  }
}

// Unmasked backward rows of exactly THREADS * VECTORS 16-byte vectors a tensor: one row a block,
// VECTORS vectors of y and of dy a thread, read twice as in reread_backward_kernel (under
// evict_last for the row sum, again under evict_first for dx: the row's lines leave L2 first once
// used); straight-line code, so a thread's loads are its first instructions (the register rows'
// grid-stride loop spent about 55 instructions before its first load, session 31 SASS), and
// nothing is held across the reduction. This is torch.compile's kernel at these rows. Launcher
// timing, H100, % of copy: one vector, 16-bit N = 4096 (session 33, two runs each, against the
// vectors held in registers): bf16 100.6 -> 101.4, fp16 100.5-100.6 -> 101.3-101.5 (held under
// evict_first: 98.8-98.9); two vectors (session 34, two runs each, against reread_backward_kernel):
// bf16 8192 100.6-100.8 -> 100.9-101.0, bf16 / fp16 16384 100.7-100.8 -> 101.1, fp32 8192
// 102.0-102.1 -> 102.3, fp16 8192 100.8 -> 100.4-100.8, fp32 4096 99.1-99.6 -> 101.1-102.1 (inside
// this harness's spread on that case, 99.6-102.1 over six runs of one kernel in session 33); four
// vectors, 16-bit N = 32768 (session 37, two runs each, against staged rows): bf16 96.0 ->
// 100.3-100.4, fp16 95.8-96.0 -> 100.3-100.4 (48 registers: one 1024-thread block an SM, hence
// kVectorRowsMinBlocks).
template <int THREADS, int VECTORS> constexpr int kVectorRowsMinBlocks = VECTORS > 2 ? 1 : 2048 / THREADS;
template <typename T, int THREADS, int VECTORS>
__global__ void __launch_bounds__(THREADS, kVectorRowsMinBlocks<THREADS, VECTORS>) vector_backward_kernel(BackwardArgs<T> a) {
  using A = acc_t<T>;
  constexpr int VEC = kVec16<T>;
  constexpr int kStride = THREADS * VEC;  // columns between a thread's vectors
  __shared__ A scratch[32];
  const BackwardRow<T, false> ctx(a, 0, true);
  const int64_t row = blockIdx.x;
  const int c0 = static_cast<int>(threadIdx.x) * VEC;
  const T* y_row = a.a + row * a.a_row_stride + c0;
  const T* dy_row = a.dy + row * a.dy_row_stride + c0;
  uint4 ry[VECTORS], rdy[VECTORS];
  const auto read = [&](auto policy) {
#pragma unroll
    for (int v = 0; v < VECTORS; ++v) {
      ry[v] = load_hinted(y_row + v * kStride, policy);
      rdy[v] = load_hinted(dy_row + v * kStride, policy);
    }
  };
  read(l2_policy<L2Hint::kEvictLast>());
  A sum = 0;
#pragma unroll
  for (int v = 0; v < VECTORS; ++v) {
    A y[VEC], g[VEC];
    prepare_backward_vector(ctx, a, c0 + v * kStride, ry[v], rdy[v], y, g);
#pragma unroll
    for (int j = 0; j < VEC; ++j) sum += ctx.partial(a, y[j], g[j]);
  }
  sum = group_reduce<THREADS>(sum, SumOp{}, A(0), scratch);
  read(l2_policy<L2Hint::kEvictFirst>());
#pragma unroll
  for (int v = 0; v < VECTORS; ++v) {
    A y[VEC], g[VEC];
    prepare_backward_vector(ctx, a, c0 + v * kStride, ry[v], rdy[v], y, g);
    store_grad_vector<T, VEC>(ctx, a, row, c0 + v * kStride, y, g, sum);
  }
}

// ---- staged rows (sm_90) ----------------------------------------------------------------------

// Long unmasked rows on sm_90: a cluster of `cluster` blocks per row, each owning one chunk of
// the row (threads * VECS vectors per tensor; see StagedChunk for the shapes). A ring of
// shared-memory stages holds the block's chunks of the next rows, filled by sm_90 bulk copies
// (one instruction per chunk and tensor, issued by one thread, no registers held) as soon as a
// stage has been read, so 128-192 KB per SM stay in flight through every row's reductions,
// cluster barrier and stores. A thread copies its vectors of the current row from the stage into
// registers (in the storage type), the block's reduction barrier frees the stage for the next
// fill, and the row is written from registers.
constexpr int kStagedRingBytes = 192 * 1024;  // shared memory of the stage rings of an SM
constexpr int kStagedMaxCluster = kMaxExchangeCluster;
// A block's chunk of the row: its threads, the bytes it owns of each tensor and the blocks an SM
// holds at once (their registers: launch bounds; their shared memory: each its share of
// kStagedRingBytes).
struct StagedChunk {
  int threads;
  int bytes;
  int blocks_per_sm;
  constexpr int vecs() const { return bytes / (16 * threads); }
};
// Each direction's chunks, tried in order: a row takes the first whose blocks hold it in a cluster
// of at most kStagedMaxCluster. 512 threads of 8 vectors issue fewer instructions a byte than
// 1024 of 4 (the reductions are per thread). The forward's 256-thread blocks (two an SM) let one
// block's row reduction and cluster exchange overlap another's loads and stores (ncu, session 6:
// with one 512-thread block an SM, no warp was eligible 48% of the time at bf16 N = 65536);
// launcher timing, H200, session 23, bf16 forward N = 65536: 128- or 64-thread blocks of 16 or 8
// KB (four or eight an SM) lost 4-5 points, 16 KB chunks of 256 threads 1-14 (two, three or four
// an SM). The backward's 256-thread blocks of 16 KB (two an SM) took it from 89.6 / 87.2% of copy
// to 93.6 / 93.3 at bf16 N = 32768 / 65536 and from 91.7 / 91.2 to 95.4 / 94.2 at fp32 (session
// 23, pipelined rows either way); unpipelined 16-bit rows lost 7 with them. Session 6: clusters
// of 9-16 blocks of 32 KB chunks (rather than 5-8 of 64 KB) took the bf16 backward at N = 262144
// from 79.4 to 85.4; the forward in 32 KB chunks of 512-thread blocks lost 12-18 points at
// N = 65536 (session 7).
constexpr StagedChunk kForwardChunks[] = {{256, 32 * 1024, 2}, {512, 64 * 1024, 1}};
constexpr StagedChunk kBackwardChunks[] = {{256, 16 * 1024, 2}, {512, 32 * 1024, 1}, {512, 64 * 1024, 1}};
template <int TENSORS> constexpr const auto& staged_chunks() {
  if constexpr (TENSORS == 1) {
    return kForwardChunks;
  } else {
    return kBackwardChunks;
  }
}
// Cluster rows of up to this many blocks run as a software pipeline (staged_forward_kernel,
// staged_backward_kernel's PIPELINED; pipeline_rows in stage_ring.cuh): a block reduces row i
// and sends its (max, sum) / sum, then waits for row i - 1's (sent an iteration earlier) and
// writes row i - 1 from its stage, so the exchange's latency and the cluster's drift hide behind
// a row's work; rows i - 1 and i are held (three stages: one in flight). Launcher timing, H200,
// session 8: fp32 forward N = 65536 / 262144 81.2 / 69.7 -> 84.8 / 79.0% of copy, backward 16384
// 90.5 -> 94.2 (level at 65536 and 262144). 16-bit rows lost with it then, forward 65536 /
// 262144 81.3 / 78.2 -> 78.6 / 74.2 (their kept exps recomputed from the stage) and backward
// 84.9 / 84.2 -> 83.1 / 80.0.
// Session 23, with the exps recomputed folded (see staged_forward_kernel) and the (max, sum)
// butterflies of session 22: forward 65536 83.8 -> 84.8, backward 32768 / 65536 86.7 / 85.3 ->
// 89.6 / 87.2, but clusters of 16 (N = 262144) lost 1.2 / 0.7 (81.1 / 84.5 -> 79.9 / 83.8).
// Session 25, with the forward's pipelined output at 72 registers (session 24, was 125): the bf16
// forward at N = 262144 (16 blocks) 81.4-81.8 -> 83.3; so only the 16-bit backward stops at 8,
// and the forward has no unpipelined kernel (its staged rows are always clusters of 3-16).
template <typename T> constexpr int pipelined_max_cluster(int tensors) {
  return sizeof(T) == 2 && tensors == 2 ? 8 : kStagedMaxCluster;
}
// Pipelined fp32 forward clusters of at least this many blocks hold each row's vectors in
// registers from its reduction to its output (staged_forward_kernel, HOLD), so a row's stage is
// refilled at its own block barrier instead of the next row's: two stages of the ring in flight
// rather than one. Launcher timing, H200, session 24, fp32 forward N = 262144 (16 blocks): 82.8 ->
// 89.1-89.7% of copy; at 8 blocks or fewer (N = 32768 / 65536) it lost 0.8 (89.5 / 89.4 -> 88.7 /
// 88.7), and 16-bit rows (128 registers held, against 72-80) lost 2-4 at N = 65536 and gained
// nothing pipelined at 262144.
constexpr int kHeldRowsMinCluster = 9;
constexpr int kMaxStages = 16;
// 16-bit rows take the thread's max logit over the raw packed pairs (one __hmax2 per two
// elements), scaled once, instead of unpacking and scaling each element (see packed_extreme).
constexpr bool kPackedMax = true;

// The shape of a staged launch, fixed per row length: blocks per row, stages in the ring, and
// the bytes a stage reserves per tensor (a chunk, or the whole row when it is shorter).
struct StagedShape {
  int cluster;
  int stages;
  int tensor_bytes;
};

// The staged kernels' device helpers, compiled only where the kernels have bodies (an sm_80
// pass would warn about each unused one).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// Where a block of a staged cluster works: its rank, its chunk of the row (first column and
// length in elements, at least one element: the cluster is sized to the row), and its rows.
template <typename T, int VECS, int THREADS> struct StagedSlice {
  static constexpr int kChunk = THREADS * VECS * kVec16<T>;  // elements per tensor
  int cluster, rank, begin, len;
  int64_t first, step;
  __device__ StagedSlice(int64_t cols, int cluster_size) {
    cluster = cluster_size;
    rank = blockIdx.x % cluster;
    begin = rank * kChunk;
    len = static_cast<int>(std::min<int64_t>(cols - begin, kChunk));
    first = blockIdx.x / cluster;
    step = gridDim.x / cluster;
  }
  // Column (in the chunk) of the thread's vector i; live when inside the chunk.
  __device__ __forceinline__ int column(int i) const {
    return (i * THREADS + static_cast<int>(threadIdx.x)) * kVec16<T>;
  }
};

using PackedWords = AlignedVector<uint32_t, 4>;  // a 16-byte vector of 16-bit pairs

// The live 16-bit element x whose logit mul_rn(x, scale) is the thread's max: the max x (the min
// for a negative scale), NaNs skipped (-inf, +inf for a negative scale, if none), two raw
// elements an instruction. Exact for a finite nonzero scale: mul_rn(., scale) is monotone
// (decreasing if scale < 0) and NaN only at NaN, which __hmax2/__hmin2 skip as fmaxf does, so the
// max logit is mul_rn(extreme, scale). The element-wise fold may differ in a zero's sign.
template <typename T, int VECS, int THREADS>
__device__ __forceinline__ float packed_extreme(const StagedSlice<T, VECS, THREADS>& slice,
                                                const PackedWords (&words)[VECS], float scale) {
  using T2 = Pair16<T>;
  auto fold = [&](auto pick, float start) {
    const T bound = from_acc<T>(start);
    T2 m(bound, bound);
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
      if (slice.column(i) < slice.len) m = fold_pairs<T>(words[i].val, m, pick);
    }
    return m;
  };
  float extreme;
  if (scale > 0.0f) {
    const T2 m = fold([](T2 p, T2 q) { return __hmax2(p, q); }, -std::numeric_limits<float>::infinity());
    extreme = fmaxf(__low2float(m), __high2float(m));
  } else {
    const T2 m = fold([](T2 p, T2 q) { return __hmin2(p, q); }, std::numeric_limits<float>::infinity());
    extreme = fminf(__low2float(m), __high2float(m));
  }
  return extreme;
}

// Hides a vector's value from the compiler, so the values computed from it before are
// recomputed after rather than kept live in (fp32) registers across the row's reductions.
template <typename T, int VEC> __device__ __forceinline__ void opaque(AlignedVector<T, VEC>& v) {
  static_assert(sizeof(v) == 16, "16-byte vectors");
  uint32_t* words = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int w = 0; w < 4; ++w) asm volatile("" : "+r"(words[w]));
}

// Block reduction of a value whose warps' partials go to scratch[parity]; `after_sync` runs
// once every thread has passed the barrier (the stage it read is free). Two scratch buffers
// alternate between rows, so no second barrier is needed: buffer p is rewritten two rows later,
// after the next row's barrier, which every thread passes only once it has read it.
template <int WARPS, typename V, class Op, class AfterSync>
__device__ __forceinline__ V staged_block_reduce(V value, Op op, V (&scratch)[2][WARPS], int parity,
                                                 AfterSync after_sync) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  value = warp_all_reduce<32>(value, op);
  if (lane == 0) scratch[parity][warp] = value;
  __syncthreads();
  after_sync();
  // Every group of WARPS lanes reduces all the partials, in the same order: every lane of every
  // warp ends with the same bits.
  static_assert(WARPS <= 32 && 32 % WARPS == 0, "a warp reduces the block's warps");
  return warp_all_reduce<WARPS>(scratch[parity][lane % WARPS], op);
}

// st.async of a (max, sum) pair (see send_async in stage_ring.cuh).
__device__ __forceinline__ void send_async(uint32_t addr, uint32_t bar, MaxSum<float> v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(addr),
               "f"(v.max), "f"(v.sum), "r"(bar)
               : "memory");
#endif
}

// The reduction of an inbox of the cluster's blocks' values (see ClusterExchange): every group of
// kMaxExchangeCluster lanes reduces all of them, in the same order.
template <typename V, class Op>
__device__ __forceinline__ V inbox_reduce(const V* inbox, int cluster, Op op, V identity) {
  const int from = threadIdx.x % kMaxExchangeCluster;
  return warp_all_reduce<kMaxExchangeCluster>(from < cluster ? inbox[from] : identity, op);
}

// The cluster's reduction of one value per block and row.
template <typename V, class Op, int SLOTS>
__device__ __forceinline__ V cluster_exchange_reduce(const ClusterExchange<V, SLOTS>& exchange, V value, Op op,
                                                     V identity, int slot, uint32_t phase) {
  if (exchange.cluster == 1) return value;
  return inbox_reduce(exchange.exchange(value, slot, phase), exchange.cluster, op, identity);
}

// The frame of a staged kernel: thread 0 fills the ring's first stages with the block's first
// rows, then rows(std::bool_constant<log>) runs the block's rows (softmax and log_softmax each
// get their own loop: no per-element branch on log), and no block exits while its sends to the
// cluster are in flight.
template <typename T, int VECS, int THREADS, class Fill, class Rows>
__device__ __forceinline__ void run_staged_rows(const StagedSlice<T, VECS, THREADS>& slice, int stages, int64_t rows,
                                                bool log, Fill fill, Rows body) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages && slice.first + s * slice.step < rows; ++s) fill(s, slice.first + s * slice.step);
  }
  if (log) {
    body(std::true_type{});
  } else {
    body(std::false_type{});
  }
  if (slice.cluster > 1) cg::this_cluster().sync();
}
#endif

// THREADS: a StagedChunk's threads. Cluster rows as a software pipeline (pipelined_max_cluster:
// every forward cluster; launch_staged); HOLD: rows held in registers (kHeldRowsMinCluster).
template <typename T, int VECS, int THREADS, int BLOCKS, bool HOLD = false>
__global__ void __launch_bounds__(THREADS, BLOCKS)
    staged_forward_kernel(ForwardArgs<T> a, StagedShape shape) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  constexpr int VEC = kVec16<T>;
  using Vec = AlignedVector<T, VEC>;
  extern __shared__ uint4 stage_storage[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ MaxSum<A> scratch[2][THREADS / 32];
  // st.async.v2: 8-byte aligned
  __shared__ alignas(2 * sizeof(A)) MaxSum<A> inbox[kPipelineSlots][kStagedMaxCluster];
  __shared__ uint64_t exchange_bars[kPipelineSlots];
  const StagedSlice<T, VECS, THREADS> slice(a.cols, shape.cluster);
  const StageRing ring{reinterpret_cast<char*>(stage_storage), full, shape.stages, shape.tensor_bytes};
  ring.init();
  const ClusterExchange<MaxSum<A>, kPipelineSlots> exchange{inbox, exchange_bars, slice.cluster, slice.rank};
  exchange.init();
  const uint32_t bytes = static_cast<uint32_t>(slice.len * sizeof(T));
  auto fill = [&](int stage, int64_t row) {  // thread 0
    ring.arm(stage, bytes);
    ring.copy(stage, ring.stage(stage), a.x + row * a.x_row_stride + slice.begin, bytes);
  };
  const int64_t ahead = static_cast<int64_t>(shape.stages) * slice.step;
  auto refill = [&](int stage, int64_t done_row) {  // once every thread is done reading it
    if (threadIdx.x == 0 && done_row + ahead < a.rows) fill(stage, done_row + ahead);
  };
  const MaxSum<A> identity{neg_inf<A>(), A(0)};
  // Each pass recomputes the logits from the registers, rounded on their own (no FMA into the
  // subtraction that follows), so the max pass and the exp passes see the same values: an FMA
  // would leave the max logit the rounding residual of its product, huge for huge logits. (16-bit
  // rows subtract the raw max element before scaling instead: exact at the max as well.)
  auto logit = [&](T x) { return mul_rn(to_acc(x), a.scale); };
  // A zero or non-finite scale makes NaN logits of non-NaN inputs: those take the element-wise max.
  constexpr bool kPacked = kPackedMax && sizeof(T) == 2;
  const bool packed_max = kPacked && isfinite(a.scale) && a.scale != A(0);
  // The thread's vectors of the row in `stage`. With the packed max they are loaded as 32-bit
  // words: loaded as 16-bit elements, ptxas kept one element a register and repacked the pairs
  // (spills).
  using Words = PackedWords[kPacked ? VECS : 1];
  auto load_row = [&](int stage, Vec (&v)[VECS], Words& words) {
    const T* chunk = reinterpret_cast<const T*>(ring.stage(stage));
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
      if (slice.column(i) >= slice.len) continue;
      if constexpr (kPacked) {
        words[i] = load_vector<uint32_t, 4>(reinterpret_cast<const uint32_t*>(chunk + slice.column(i)));
      } else {
        v[i] = load_vector<T, VEC>(chunk + slice.column(i));
      }
    }
    if constexpr (kPacked) {
#pragma unroll
      for (int i = 0; i < VECS; ++i) memcpy(&v[i], &words[i], sizeof(Vec));
    }
  };
  // The thread's max logit (-inf if it has none); with the packed max, *extreme (when asked for)
  // is the raw element it is the rounded product of (see packed_extreme).
  auto max_logit = [&](const Vec (&v)[VECS], const Words& words, A* extreme = nullptr) {
    A thread_max = neg_inf<A>();
    if (packed_max) {
      if constexpr (kPacked) {
        const A raw = packed_extreme(slice, words, a.scale);
        if (extreme != nullptr) *extreme = raw;
        thread_max = __fmul_rn(raw, a.scale);
      }
    } else {
#pragma unroll
      for (int i = 0; i < VECS; ++i) {
        if (slice.column(i) >= slice.len) continue;
#pragma unroll
        for (int j = 0; j < VEC; ++j) thread_max = fmaxf(thread_max, logit(v[i].val[j]));
      }
    }
    return thread_max;
  };
  // Writes the thread's vector i of `row`'s outputs.
  auto store_output = [&](int64_t row, int i, const Vec& y) {
    store_vector<T, VEC>(a.out + row * a.cols + slice.begin + slice.column(i), y);
  };
  // Writes the thread's outputs of `row`, value(i, j) for element j of vector i.
  auto store_row = [&](int64_t row, auto value) {
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
      if (slice.column(i) >= slice.len) continue;
      Vec y;
#pragma unroll
      for (int j = 0; j < VEC; ++j) y.val[j] = from_acc<T>(value(i, j));
      store_output(row, i, y);
    }
  };
  // A row's max and sum over the cluster, as what the output needs: the max (0 for a row without
  // a finite logit, whose sum is 0: probabilities 0, log-probabilities -inf), 1 / sum, log(sum).
  struct Totals {
    A row_max, inv_sum, log_sum;
  };
  auto totals = [&](MaxSum<A> total, auto log_tag) {
    constexpr bool kLog = decltype(log_tag)::value;
    return Totals{total.max == neg_inf<A>() ? A(0) : total.max, total.sum == A(0) ? A(0) : A(1) / total.sum,
                  kLog ? (total.sum == A(0) ? pos_inf<A>() : logf(total.sum)) : A(0)};
  };
  auto recomputed = [&](const Vec (&v)[VECS], const Totals& t, auto log_tag) {
    constexpr bool kLog = decltype(log_tag)::value;
    return [&, t](int i, int j) {
      const A shifted = logit(v[i].val[j]) - t.row_max;
      return kLog ? shifted - t.log_sum : exp_acc<T>(shifted) * t.inv_sum;
    };
  };
  // 16-bit rows take logit - thread max as d * log_scale with d = x * x_scale - raw_shift, and its
  // exp as exp2(d * exp_scale). Under the packed max that is (x - the thread's extreme element)
  // * scale with the scale folded into the exp's log2(e) (as the masked 16-bit forwards do): a
  // multiply an element fewer than rounding each logit first, and as close to the exact value.
  // A zero or non-finite scale (rows of NaN or of equal logits) takes x * scale - thread max in
  // one FMA.
  constexpr bool kFold = sizeof(T) == 2;
  const A x_scale = packed_max ? A(1) : a.scale;
  const A log_scale = packed_max ? a.scale : A(1);
  const A exp_scale = log_scale * A(kLog2e);
  // Where a thread's exps start: its max logit (0 when it has none) and, folded, the raw shift.
  // Where the shift's exp argument raw * exp_scale is small (kOneFmaMaxShift), the exps take it
  // rounded, in one FMA with the element's.
  struct Shift {
    bool empty;
    A max, raw;
    bool one_fma;
    A raw_exp;
  };
  auto thread_shift = [&](A thread_max, A extreme) {
    const bool empty = thread_max == neg_inf<A>();
    const A shift = empty ? A(0) : thread_max;
    const A raw = packed_max ? (empty ? A(0) : extreme) : shift;
    const A raw_exp = raw * exp_scale;
    return Shift{empty, shift, raw, packed_max && fabsf(raw_exp) < kOneFmaMaxShift, raw_exp};
  };
  // Calls each(i, j, d, e) for element j of vector i: e = exp(logit - shift) and (folded) d.
  auto for_each_exp = [&](const Vec (&v)[VECS], const Shift& shift, auto each) {
    auto elements = [&](auto one_fma) {
#pragma unroll
      for (int i = 0; i < VECS; ++i) {
        if (slice.column(i) >= slice.len) continue;
        if constexpr (kFold) {
          A x[VEC];
          widen(v[i], x);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const A d = fmaf(x[j], x_scale, -shift.raw);
            each(i, j, d, exp2_ftz(one_fma ? fmaf(x[j], exp_scale, -shift.raw_exp) : d * exp_scale));
          }
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) each(i, j, A(0), exp_acc<T>(logit(v[i].val[j]) - shift.max));
        }
      }
    };
    if (kFold && shift.one_fma) {
      elements(std::true_type{});
    } else {
      elements(std::false_type{});
    }
  };
  // Folded rows' outputs from exp(logit - shift) (log_softmax: logit - shift): times
  // exp(shift - row max) / sum, and minus (row max - shift) + log(sum).
  struct Rescale {
    A factor, offset;
  };
  auto rescale = [&](const Shift& shift, const Totals& t) {
    return Rescale{shift.empty ? A(0) : exp_acc<T>(shift.max - t.row_max) * t.inv_sum,
                   (t.row_max - shift.max) + t.log_sum};
  };
  // pipeline_rows: reduce and send row i's (max, sum), then write row i - 1 from its stage
  // (folded rows: from the thread's shift, carried); the stage of row i - 2 is refilled past row
  // i's barrier. HOLD: row i - 1 from its vectors, carried, and each row's stage refilled past its
  // own barrier.
  auto pipelined_rows = [&](auto log_tag) {
    [[maybe_unused]] constexpr bool kLog = decltype(log_tag)::value;
    struct Carry {
      Shift shift;
      Vec held[VECS];  // HOLD: the row's vectors (unused, so not kept, otherwise)
    };
    const auto reduce = [&](int64_t row, const auto& at, const auto& slot, const FreedStage& freed) {
      ring.wait(at.stage, at.phase);
      Carry carry;
      Vec loaded[VECS];
      // Loaded where they are carried: a copy took 200 moves and 24 registers more.
      Vec (&v)[VECS] = HOLD ? carry.held : loaded;
      [[maybe_unused]] Words words;
      load_row(at.stage, v, words);
      A extreme = 0;
      A thread_max = max_logit(v, words, &extreme);
      carry.shift = thread_shift(thread_max, extreme);
      A sum = 0;
      for_each_exp(v, carry.shift, [&](int, int, A, A e) { sum += e; });
      // fmaxf skips NaN, but a NaN logit makes the sum NaN: the max carries it on, so the row is NaN.
      if (sum != sum) thread_max = sum;
      const MaxSum<A> total =
          staged_block_reduce(MaxSum<A>{thread_max, sum}, MaxSumOp<T>{}, scratch, at.exchange.slot, [&] {
            if constexpr (HOLD) {
              refill(at.stage, row);
            } else if (freed.any) {
              refill(freed.stage, freed.row);
            }
          });
      exchange.send(total, slot.slot);
      return carry;
    };
    const auto finish = [&](int64_t row, const auto& at, const auto& slot, const Carry& carry) {
      const MaxSum<A> total = inbox_reduce(exchange.wait(slot.slot, slot.phase), slice.cluster, MaxSumOp<T>{}, identity);
      const Totals t = totals(total, log_tag);
      Vec loaded[VECS];
      if constexpr (!HOLD) {
        [[maybe_unused]] Words words;
        load_row(at.stage, loaded, words);
      }
      const Vec (&v)[VECS] = HOLD ? carry.held : std::as_const(loaded);
      if constexpr (kFold) {
        // Each vector stored as its exps are taken: a row of fp32 outputs before the stores took
        // 125 registers, this 72-80 (launcher timing, H200, session 24, bf16 N = 65536: 85.0 ->
        // 86.2-87.2% of copy).
        const Rescale r = rescale(carry.shift, t);
        Vec y;
        for_each_exp(v, carry.shift, [&](int i, int j, A d, A e) {
          y.val[j] = from_acc<T>(kLog ? d * log_scale - r.offset : e * r.factor);
          if (j == VEC - 1) store_output(row, i, y);
        });
      } else {
        store_row(row, recomputed(v, t, log_tag));
      }
    };
    pipeline_rows(slice.first, slice.step, a.rows, shape.stages, reduce, finish);
  };
  run_staged_rows(slice, shape.stages, a.rows, a.log, fill, pipelined_rows);
#endif
}

// THREADS: a StagedChunk's threads. PIPELINED: cluster rows as a software pipeline
// (pipelined_max_cluster).
template <typename T, int VECS, int THREADS, int BLOCKS, bool PIPELINED>
__global__ void __launch_bounds__(THREADS, BLOCKS)
    staged_backward_kernel(BackwardArgs<T> a, StagedShape shape) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  constexpr int VEC = kVec16<T>;
  using Vec = AlignedVector<T, VEC>;
  constexpr int kSlots = PIPELINED ? kPipelineSlots : 2;
  extern __shared__ uint4 stage_storage[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ A scratch[2][THREADS / 32];
  __shared__ A inbox[kSlots][kStagedMaxCluster];
  __shared__ uint64_t exchange_bars[kSlots];
  const StagedSlice<T, VECS, THREADS> slice(a.cols, shape.cluster);
  // A stage holds the block's chunk of `a` (y), then its chunk of dy.
  const StageRing ring{reinterpret_cast<char*>(stage_storage), full, shape.stages, 2 * shape.tensor_bytes};
  ring.init();
  const ClusterExchange<A, kSlots> exchange{inbox, exchange_bars, slice.cluster, slice.rank};
  exchange.init();
  const uint32_t bytes = static_cast<uint32_t>(slice.len * sizeof(T));
  auto fill = [&](int stage, int64_t row) {  // thread 0
    ring.arm(stage, 2 * bytes);
    ring.copy(stage, ring.stage(stage), a.a + row * a.a_row_stride + slice.begin, bytes);
    ring.copy(stage, ring.stage(stage) + shape.tensor_bytes, a.dy + row * a.dy_row_stride + slice.begin, bytes);
  };
  const int64_t ahead = static_cast<int64_t>(shape.stages) * slice.step;
  auto refill = [&](int stage, int64_t done_row) {  // once every thread is done reading it
    if (threadIdx.x == 0 && done_row + ahead < a.rows) fill(stage, done_row + ahead);
  };
  // Vector i of the thread's chunk of tensor t (0: y, 1: dy) of the row in `stage`.
  auto stage_vector = [&](int stage, int t, int i) {
    return load_vector<T, VEC>(reinterpret_cast<const T*>(ring.stage(stage) + t * shape.tensor_bytes) +
                               slice.column(i));
  };
  // softmax: dx = scale * y * (dy - sum(dy * y)); log_softmax: dx = scale * (dy - exp(y) * sum(dy)).
  // y_of(i) / dy_of(i): the thread's vector i of each.
  auto thread_sum = [&](auto y_of, auto dy_of, auto log_tag) {
    constexpr bool kLog = decltype(log_tag)::value;
    A sum = 0;
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
      if (slice.column(i) >= slice.len) continue;
      A y[VEC], g[VEC];
      widen(y_of(i), y);
      widen(dy_of(i), g);
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum += kLog ? g[j] : g[j] * y[j];
    }
    return sum;
  };
  auto store_row = [&](int64_t row, auto y_of, auto dy_of, A sum, auto log_tag) {
    constexpr bool kLog = decltype(log_tag)::value;
    T* dx = a.dx + row * a.cols + slice.begin;
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
      if (slice.column(i) >= slice.len) continue;
      A y[VEC], g[VEC];
      widen(y_of(i), y);
      widen(dy_of(i), g);
      Vec out;
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        out.val[j] = from_acc<T>(kLog ? a.scale * (g[j] - exp_acc<T>(y[j]) * sum) : a.scale * y[j] * (g[j] - sum));
      store_vector<T, VEC>(dx + slice.column(i), out);
    }
  };
  auto rows = [&](auto log_tag) {
    StagedCursor at;
    for (int64_t row = slice.first; row < a.rows; row += slice.step) {
      ring.wait(at.stage, at.phase);
      // Every vector in registers before the reduction, whose barrier frees the stage.
      Vec va[VECS], vdy[VECS];
#pragma unroll
      for (int i = 0; i < VECS; ++i) {
        if (slice.column(i) < slice.len) {
          va[i] = stage_vector(at.stage, 0, i);
          vdy[i] = stage_vector(at.stage, 1, i);
        }
      }
      const auto y_of = [&](int i) { return va[i]; };
      const auto dy_of = [&](int i) { return vdy[i]; };
      A sum = staged_block_reduce(thread_sum(y_of, dy_of, log_tag), SumOp{}, scratch, at.exchange.slot,
                                  [&] { refill(at.stage, row); });
      sum = cluster_exchange_reduce(exchange, sum, SumOp{}, A(0), at.exchange.slot, at.exchange.phase);
#pragma unroll
      for (int i = 0; i < VECS; ++i) {
        opaque(va[i]);
        opaque(vdy[i]);
      }
      store_row(row, y_of, dy_of, sum, log_tag);
      at.next(shape.stages);
    }
  };
  // PIPELINED (pipeline_rows): reduce and send row i's sum, then write row i - 1's dx from its
  // stage. Both read the stage vector by vector (it is held until the next row's barrier).
  auto pipelined_rows = [&](auto log_tag) {
    const auto reduce = [&](int64_t, const auto& at, const auto& slot, const FreedStage& freed) {
      ring.wait(at.stage, at.phase);
      const A thread = thread_sum([&](int i) { return stage_vector(at.stage, 0, i); },
                                  [&](int i) { return stage_vector(at.stage, 1, i); }, log_tag);
      const A sum = staged_block_reduce(thread, SumOp{}, scratch, at.exchange.slot, [&] {
        if (freed.any) refill(freed.stage, freed.row);
      });
      exchange.send(sum, slot.slot);
      return NoCarry{};
    };
    const auto finish = [&](int64_t row, const auto& at, const auto& slot, NoCarry) {
      const A sum = inbox_reduce(exchange.wait(slot.slot, slot.phase), slice.cluster, SumOp{}, A(0));
      store_row(row, [&](int i) { return stage_vector(at.stage, 0, i); },
                [&](int i) { return stage_vector(at.stage, 1, i); }, sum, log_tag);
    };
    pipeline_rows(slice.first, slice.step, a.rows, shape.stages, reduce, finish);
  };
  if constexpr (PIPELINED) {
    run_staged_rows(slice, shape.stages, a.rows, a.log, fill, pipelined_rows);
  } else {
    run_staged_rows(slice, shape.stages, a.rows, a.log, fill, rows);
  }
#endif
}

// ---- launch ----------------------------------------------------------------------------------

int device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&value, attribute, device);
  return value;
}

int sm_count() { return std::max(device_attribute(cudaDevAttrMultiProcessorCount), 1); }

// Blocks for a grid-stride loop over rows.
int64_t row_blocks(int64_t rows, int group) {
  const int64_t per_block = group <= 32 ? kSmallGroupBlock / group : 1;
  return std::max<int64_t>(std::min<int64_t>((rows + per_block - 1) / per_block, kMaxRowGrid), 1);
}

// Which row strategy a shape takes.
struct Plan {
  bool vectorized;  // 16-byte accesses: aligned pointers, row strides and cols multiples of VEC
  int group;        // threads per row
  int items;        // register rows: vectors per thread; 0 for streamed rows
  int cluster;      // blocks per row of cluster and staged rows, else 1
  int cluster_threads;
  bool persistent;  // register and cluster rows: a persistent, pipelined grid, else a row group per block
  bool cache;       // streamed rows kept in shared memory (also the fallback of cluster and staged rows)
  size_t cache_bytes;
  int staged_chunk;  // staged rows: the index of their chunk (see staged_chunk), else -1
  dim3 row_grid{0, 1, 1};  // masked register rows of one row a block: row_grid's 3D grid, or x = 0: row order
};

// Staged rows: the index of the row's chunk in staged_chunks<tensors>() and its blocks per row
// (`cluster`); -1 when no chunk fits the row in kStagedMaxCluster blocks.
template <typename T, size_t CHUNKS>
int staged_chunk(int64_t cols, const StagedChunk (&chunks)[CHUNKS], int& cluster) {
  for (size_t i = 0; i < CHUNKS; ++i) {
    const int64_t chunk = chunks[i].bytes / static_cast<int64_t>(sizeof(T));
    const int64_t blocks = (cols + chunk - 1) / chunk;
    if (blocks <= kStagedMaxCluster) {
      cluster = static_cast<int>(blocks);
      return static_cast<int>(i);
    }
  }
  return -1;
}

// per_thread: elements a thread keeps in registers on register and cluster rows. `masked`
// rows take cluster rows where unmasked ones take staged rows, and streamed rows unless their
// mask is a vector mask (vector_mask).
template <typename T>
Plan make_plan(int64_t cols, bool aligned, int tensors, int per_thread, bool masked, bool vector_mask = true) {
  constexpr int kVec = kVec16<T>;
  Plan plan{false, 32, 0, 1, 0, false, false, 0, -1};
  plan.vectorized = aligned && cols % kVec == 0 && !std::is_same<T, double>::value;
  if (!plan.vectorized) {
    plan.group = cols <= 1024 ? 32 : kStreamThreads;
    return plan;
  }
  const int items = per_thread / kVec;
  const bool clusters = device_attribute(cudaDevAttrComputeCapabilityMajor) >= 9;
  if (!vector_mask && cols <= 1024) {  // a warp per row, element by element
    plan.vectorized = false;
    return plan;
  }
  const bool sixteen_bit_forward = tensors == 1 && sizeof(T) == 2;
  const bool wide_register_rows =
      !masked && !sixteen_bit_forward && int64_t(tensors) * per_thread * sizeof(T) <= kWideRegisterRowBytes;
  const int max_group = clusters && !wide_register_rows ? kClusterThreads : 1024;
  if (vector_mask && cols <= int64_t(per_thread) * max_group) {
    const int64_t threads = (cols + per_thread - 1) / per_thread;
    int group = 4;
    while (group < threads) group *= 2;
    plan.group = group;
    plan.items = items;
    plan.persistent = group >= (tensors == 2 ? kPersistentGroup<T, 2> : kPersistentGroup<T, 1>);
    return plan;
  }
  plan.group = kStreamThreads;
  plan.cache_bytes = static_cast<size_t>(cols) * sizeof(T) * tensors;
  plan.cache = plan.cache_bytes <= static_cast<size_t>(kMaxCacheBytes);
  if (!plan.cache) plan.cache_bytes = 0;
  if (clusters && !masked) {
    plan.staged_chunk = tensors == 1 ? staged_chunk<T>(cols, staged_chunks<1>(), plan.cluster)
                                     : staged_chunk<T>(cols, staged_chunks<2>(), plan.cluster);
  } else if (clusters && vector_mask && cols <= int64_t(per_thread) * kWideClusterThreads * kMaxCluster) {
    plan.cluster_threads =
        cols <= int64_t(per_thread) * kClusterThreads * kMaxCluster ? kClusterThreads : kWideClusterThreads;
    const int64_t per_block = int64_t(per_thread) * plan.cluster_threads;
    int cluster = 2;
    while (cluster * per_block < cols) cluster *= 2;
    plan.cluster = cluster;
    plan.items = items;
    plan.persistent = true;
  }
  return plan;
}

template <class Kernel, class Args>
cudaError_t launch_streamed(Kernel kernel, const Args& args, const Plan& plan, int64_t row_bytes, cudaStream_t stream) {
  int64_t blocks = row_blocks(args.rows, plan.group);
  if (plan.group > 32) {
    if (plan.cache_bytes > 48 * 1024) {
      const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(plan.cache_bytes));
      if (err != cudaSuccess) return err;
    }
    const int per_sm = cached_blocks_per_sm(kernel, plan.group, plan.cache_bytes);
    const int sms = sm_count();
    // Without the cache the second pass re-reads the row: keep the rows in flight within L2.
    const int64_t fit = plan.cache ? per_sm : std::max<int64_t>(1, kL2InFlightBytes / (sms * std::max<int64_t>(row_bytes, 1)));
    blocks = std::min<int64_t>(blocks, int64_t(sms) * std::max<int64_t>(1, std::min<int64_t>(per_sm, fit)));
  }
  kernel<<<static_cast<unsigned>(blocks), block_threads(plan.group), plan.cache_bytes, stream>>>(args);
  return cudaGetLastError();
}

// Register rows: a block per row group (up to 2^30 blocks, then the kernels loop) or, persistent,
// one resident wave of blocks (the kernels loop over rows and prefetch), or fewer when there are
// fewer rows.
template <class Kernel, class Args>
cudaError_t launch_register_rows(Kernel kernel, const Args& args, int group, bool persistent, cudaStream_t stream) {
  const int threads = block_threads(group);
  int64_t blocks = row_blocks(args.rows, group);
  if (persistent) blocks = std::min<int64_t>(blocks, int64_t(sm_count()) * cached_blocks_per_sm(kernel, threads, 0));
  kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(args);
  return cudaGetLastError();
}

// Launches one resident wave of clusters of `cluster` blocks of `threads` threads and
// `shared_bytes` dynamic shared memory (or one cluster per row when there are fewer rows), each
// looping over rows, with the kernel's arguments `kernel_args`; cudaErrorNotSupported, with no
// launch and no error left behind, when the device cannot co-schedule such a cluster.
template <class Kernel, class... KernelArgs>
cudaError_t launch_cluster_wave(Kernel kernel, int64_t rows, int cluster, int threads, int shared_bytes,
                                cudaStream_t stream, const KernelArgs&... kernel_args) {
  ClusterLaunch<Kernel> wave(kernel, cluster, threads, shared_bytes, stream);
  const int active = wave.active();
  if (active == 0) return cudaErrorNotSupported;
  return wave.launch(std::min<int64_t>(rows, active), kernel_args...);
}

// Staged rows: one resident wave of clusters (BLOCKS blocks per SM, each with
// its share of kStagedRingBytes as its stage ring, in dynamic shared memory), each looping over
// rows, or one cluster per row when there are fewer rows. Cluster rows run `pipelined` (the
// software-pipelined kernel) up to pipelined_max_cluster blocks where the ring holds
// kPipelineMinStages, `held` instead (where given) from kHeldRowsMinCluster blocks on, and
// single-block rows, longer 16-bit backward clusters and smaller rings `plain`; without a plain
// kernel (the forward's: its staged rows are clusters of at least three blocks with three stages)
// such rows return cudaErrorNotSupported, which streams them.
template <typename T, int VECS, int THREADS, int BLOCKS, class Kernel, class Args>
cudaError_t launch_staged(Kernel plain, Kernel pipelined, const Args& args, int cluster, int tensors,
                          cudaStream_t stream, Kernel held = nullptr) {
  StagedShape shape;
  shape.cluster = cluster;
  const int64_t chunk_bytes = int64_t(THREADS) * VECS * 16;
  shape.tensor_bytes = static_cast<int>((std::min<int64_t>(chunk_bytes, args.cols * int64_t(sizeof(T))) + 127) / 128 * 128);
  const int ring_bytes = kStagedRingBytes / BLOCKS;
  shape.stages = std::min(kMaxStages, ring_bytes / (tensors * shape.tensor_bytes));
  const int shared_bytes = shape.stages * tensors * shape.tensor_bytes;
  const bool pipeline =
      cluster > 1 && cluster <= pipelined_max_cluster<T>(tensors) && shape.stages >= kPipelineMinStages;
  const Kernel kernel = !pipeline ? plain : held != nullptr && cluster >= kHeldRowsMinCluster ? held : pipelined;
  if (kernel == nullptr) return cudaErrorNotSupported;
  return launch_cluster_wave(kernel, args.rows, cluster, THREADS, shared_bytes, stream, args, shape);
}

// Register rows of group G, persistent or not as the plan says. Only what make_plan can choose
// is built: a row group per block below kPersistentGroup, persistent from kPersistentOption on.
template <int G, int ITEMS, int VEC, class Launch>
cudaError_t dispatch_register_rows(const Plan& plan, Launch launch) {
  if constexpr (G >= kPersistentOption) {
    if (plan.persistent) return launch.template register_rows<G, ITEMS, VEC, true>();
  }
  if constexpr (G < kPersistentGroup<typename Launch::Scalar, Launch::kTensors>) {
    if (!plan.persistent) return launch.template register_rows<G, ITEMS, VEC, false>();
  }
  return cudaErrorInvalidConfiguration;
}

// Launch::staged<VECS, THREADS, BLOCKS>() of chunk `index` of the launch's direction (see staged_chunks).
template <class Launch, size_t... I>
void dispatch_staged(int index, const Launch& launch, cudaError_t& err, std::index_sequence<I...>) {
  constexpr auto& kChunks = staged_chunks<Launch::kTensors>();
  ((index == static_cast<int>(I)
        ? (err = launch.template staged<kChunks[I].vecs(), kChunks[I].threads, kChunks[I].blocks_per_sm>(), 0)
        : 0),
   ...);
}

// Instantiates and launches the kernel of a plan:
// Launch::register_rows<G, ITEMS, VEC, PERSISTENT>(), Launch::cluster_rows<CLUSTER, G, ITEMS, VEC>()
// or Launch::streamed<G, VEC, CACHE>(), with PER_THREAD elements a thread on register and cluster
// rows.
template <typename T, int PER_THREAD, class Launch>
cudaError_t dispatch_plan(const Plan& plan, Launch launch) {
  constexpr int kVec = kVec16<T>;
  constexpr int kItems = PER_THREAD / kVec;
  if (plan.staged_chunk >= 0) {
    cudaError_t err = cudaErrorNotSupported;
    if constexpr (!std::is_same<T, double>::value) {
      constexpr auto& kChunks = staged_chunks<Launch::kTensors>();
      dispatch_staged(plan.staged_chunk, launch, err, std::make_index_sequence<std::size(kChunks)>{});
    }
    if (err != cudaErrorNotSupported) return err;
    // The device cannot hold such a cluster with its stage ring: stream the row instead.
  } else if (plan.cluster > 1) {
    cudaError_t err = cudaErrorNotSupported;
    if constexpr (!std::is_same<T, double>::value) {
      if (plan.cluster_threads == kWideClusterThreads) {
        if (plan.cluster == kMaxCluster) err = launch.template cluster_rows<kMaxCluster, kWideClusterThreads, kItems, kVec>();
      } else {
        switch (plan.cluster) {
          case 2: err = launch.template cluster_rows<2, kClusterThreads, kItems, kVec>(); break;
          case 4: err = launch.template cluster_rows<4, kClusterThreads, kItems, kVec>(); break;
          case 8: err = launch.template cluster_rows<8, kClusterThreads, kItems, kVec>(); break;
          case 16: err = launch.template cluster_rows<16, kClusterThreads, kItems, kVec>(); break;
          default: break;
        }
      }
    }
    if (err != cudaErrorNotSupported) return err;
    // The device cannot hold such a cluster: stream the row instead.
  } else if (plan.items > 0) {
    if constexpr (!std::is_same<T, double>::value) {
      switch (plan.group) {
        case 4: return dispatch_register_rows<4, kItems, kVec>(plan, launch);
        case 8: return dispatch_register_rows<8, kItems, kVec>(plan, launch);
        case 16: return dispatch_register_rows<16, kItems, kVec>(plan, launch);
        case 32: return dispatch_register_rows<32, kItems, kVec>(plan, launch);
        case 64: return dispatch_register_rows<64, kItems, kVec>(plan, launch);
        case 128: return dispatch_register_rows<128, kItems, kVec>(plan, launch);
        case 256: return dispatch_register_rows<256, kItems, kVec>(plan, launch);
        case 512: return dispatch_register_rows<512, kItems, kVec>(plan, launch);
        case 1024: return dispatch_register_rows<1024, kItems, kVec>(plan, launch);
        default: return cudaErrorInvalidConfiguration;
      }
    }
    return cudaErrorInvalidConfiguration;
  }
  if (!plan.vectorized) {
    return plan.group == 32 ? launch.template streamed<32, 1, false>()
                            : launch.template streamed<kStreamThreads, 1, false>();
  }
  if constexpr (!std::is_same<T, double>::value) {
    return plan.cache ? launch.template streamed<kStreamThreads, kVec, true>()
                      : launch.template streamed<kStreamThreads, kVec, false>();
  }
  return cudaErrorInvalidConfiguration;
}

// Launches the forward's or the backward's kernel of each kind of row, for dispatch_plan. The
// forward reads one row tensor, the backward two. ADDITIVE: register and cluster rows read an
// additive mask as vectors (streamed rows read any mask element by element).
template <typename T, bool MASKED, bool BACKWARD, bool ADDITIVE = false> struct RowLaunch {
  using Scalar = T;
  using Args = std::conditional_t<BACKWARD, BackwardArgs<T>, ForwardArgs<T>>;
  static constexpr int kTensors = BACKWARD ? 2 : 1;
  const Args& args;
  const Plan& plan;
  cudaStream_t stream;
  template <int G, int ITEMS, int VEC, int CLUSTER, bool PERSISTENT, bool ROW_GRID = false, bool DRAW_ALL = false>
  static constexpr auto register_kernel() {
    if constexpr (BACKWARD) {
      return register_backward_kernel<T, G, ITEMS, VEC, MASKED, CLUSTER, PERSISTENT, ROW_GRID, DRAW_ALL, ADDITIVE>;
    } else {
      return register_forward_kernel<T, G, ITEMS, VEC, MASKED, CLUSTER, PERSISTENT, ROW_GRID, DRAW_ALL, ADDITIVE>;
    }
  }
  template <int G, int ITEMS, int VEC, bool PERSISTENT> cudaError_t register_rows() const {
    if constexpr (kDrawAll<T, MASKED, BACKWARD> && !PERSISTENT) {
      if (args.dropout && !args.causal) return register_rows_drawing<G, ITEMS, VEC, PERSISTENT, true>();
    }
    return register_rows_drawing<G, ITEMS, VEC, PERSISTENT, false>();
  }
  template <int G, int ITEMS, int VEC, bool PERSISTENT, bool DRAW_ALL> cudaError_t register_rows_drawing() const {
    // The row grid has kernels of its own, so that rows in row order run the same code without it.
    if constexpr (MASKED && !PERSISTENT && G > 32) {
      if (plan.row_grid.x != 0) {
        register_kernel<G, ITEMS, VEC, 1, false, true, DRAW_ALL>()<<<plan.row_grid, block_threads(G), 0, stream>>>(args);
        return cudaGetLastError();
      }
    }
    return launch_register_rows(register_kernel<G, ITEMS, VEC, 1, PERSISTENT, false, DRAW_ALL>(), args, G, PERSISTENT,
                                stream);
  }
  template <int CLUSTER, int G, int ITEMS, int VEC> cudaError_t cluster_rows() const {
    if constexpr (MASKED) {
      return launch_cluster_wave(register_kernel<G, ITEMS, VEC, CLUSTER, true>(), args.rows, CLUSTER, G, 0, stream, args);
    } else {
      return cudaErrorNotSupported;  // make_plan gives unmasked rows staged rows instead
    }
  }
  template <int VECS, int THREADS, int BLOCKS> cudaError_t staged() const {
    // Masked rows take cluster rows.
    if constexpr (MASKED) {
      return cudaErrorNotSupported;
    } else if constexpr (BACKWARD) {
      return launch_staged<T, VECS, THREADS, BLOCKS>(staged_backward_kernel<T, VECS, THREADS, BLOCKS, false>,
                                                     staged_backward_kernel<T, VECS, THREADS, BLOCKS, true>, args,
                                                     plan.cluster, kTensors, stream);
    } else {
      using Kernel = decltype(&staged_forward_kernel<T, VECS, THREADS, BLOCKS>);
      // Held rows for fp32 only (kHeldRowsMinCluster); no plain kernel (see launch_staged).
      Kernel held = nullptr;
      if constexpr (std::is_same_v<T, float>) held = staged_forward_kernel<T, VECS, THREADS, BLOCKS, true>;
      return launch_staged<T, VECS, THREADS, BLOCKS>(Kernel{nullptr}, staged_forward_kernel<T, VECS, THREADS, BLOCKS>,
                                                     args, plan.cluster, kTensors, stream, held);
    }
  }
  template <int G, int VEC, bool CACHE> cudaError_t streamed() const {
    const int64_t row_bytes = kTensors * args.cols * int64_t(sizeof(T));
    if constexpr (BACKWARD) {
      return launch_streamed(streamed_backward_kernel<T, G, VEC, MASKED, CACHE>, args, plan, row_bytes, stream);
    } else {
      return launch_streamed(streamed_forward_kernel<T, G, VEC, MASKED, CACHE>, args, plan, row_bytes, stream);
    }
  }
};
template <typename T, bool MASKED, bool ADDITIVE = false> using ForwardLaunch = RowLaunch<T, MASKED, false, ADDITIVE>;
template <typename T, bool MASKED, bool ADDITIVE = false> using BackwardLaunch = RowLaunch<T, MASKED, true, ADDITIVE>;

bool rows_aligned(const void* ptr, int64_t row_stride, int elem_bytes) {
  return is_aligned(ptr, 16) && (row_stride * elem_bytes) % 16 == 0;
}

// A mask column's bytes: a bool byte, or an additive value of the input's dtype.
template <typename T> int mask_column_bytes(const MaskLayout& m) {
  return m.kind == MaskKind::Additive ? static_cast<int>(sizeof(T)) : 1;
}

// Whether the mask reads as vectors of `vec` elements (or there is none: causal only), as
// register and cluster rows read it (bool bytes as one bit per column, additive values of the
// input's dtype as they are): contiguous along the row, and every row's mask starting at a
// vector-aligned address. Other masks take streamed rows.
template <typename T> bool vector_mask(const MaskLayout& m, int vec) {
  if (m.kind == MaskKind::None) return true;
  if (m.col_stride != 1 || !is_aligned(m.data, vec * mask_column_bytes<T>(m))) return false;
  for (int d = 0; d < kMaxLeadDims; ++d) {
    if (m.lead_sizes[d] > 1 && m.lead_strides[d] % vec != 0) return false;
  }
  return true;
}

// Vectors of mask elements are read one by one, so the mask never limits vectorization.
template <typename T>
ForwardArgs<T> forward_args(const void* x, void* out, int64_t rows, int64_t cols, int64_t x_row_stride, double scale,
                            bool log) {
  ForwardArgs<T> a{};
  a.x = static_cast<const T*>(x);
  a.out = static_cast<T*>(out);
  a.rows = rows;
  a.cols = cols;
  a.x_row_stride = x_row_stride;
  a.scale = static_cast<acc_t<T>>(scale);
  a.log = log;
  a.q_len = 1;
  return a;
}

template <typename T>
BackwardArgs<T> backward_args(const void* a_ptr, const void* dy, void* dx, int64_t rows, int64_t cols,
                              int64_t a_row_stride, int64_t dy_row_stride, double scale, bool log) {
  BackwardArgs<T> a{};
  a.a = static_cast<const T*>(a_ptr);
  a.dy = static_cast<const T*>(dy);
  a.dx = static_cast<T*>(dx);
  a.rows = rows;
  a.cols = cols;
  a.a_row_stride = a_row_stride;
  a.dy_row_stride = dy_row_stride;
  a.scale = static_cast<acc_t<T>>(scale);
  a.log = log;
  a.q_len = 1;
  return a;
}

// The grid of masked register rows (one row per block): in row order the rows that share a
// broadcast mask row (the H heads of a [B, 1, L, L] mask over [B, H, L, L] scores) are L rows
// apart, and once those L rows outgrow the L2 every head reads the mask row from DRAM again. A 3D
// grid (H, L, B), whose blocks start x fastest, visits the heads of a query one after another
// instead (the ROW_GRID kernels; dim3(0, 1, 1): row order). Taken when the rows between two reads
// of a mask row move (read and write) at least kRowGridMinBytes; well below that the heads-inner
// order lost 0.3-5 points (session 13). Launcher timing, H200, session 14, [B, 16, L, L] with a
// [B, 1, L, L] bool mask, row order -> row grid: bf16 L = 4096 forward 80.4 -> 89.8% of copy,
// backward 89.2 -> 93.8 (with dropout 75.6 -> 77.2); fp32 L = 2048 / 4096 forward 77.1 /
// 71.3 -> 79.5 / 75.2 (with dropout 68.2 / 65.5 -> 72.2 / 69.8), backward 95.5 / 96.0 -> 97.8 /
// 99.2. The bytes moved count the mask's own (a byte a column for bool, the dtype's for additive):
// so a bf16 backward at L = 2048 with an additive mask (24 MB of rows, 8 MB of mask) takes the
// grid, 84.5 -> 96.3% of copy (with dropout 84.9 -> 94.7; launcher, H100, session 40). The bound is
// half of kL2InFlightBytes: the heads-inner order already won at 16-28 MB of rows in flight (mask
// rows leave the L2 sooner than 32 MB of traffic; why, not measured) and 12 MB lost a case
// (session 42's launcher timing, in docs/softmax.md).
constexpr int64_t kRowGridMinBytes = kL2InFlightBytes / 2;

template <typename T>
dim3 row_grid(const MaskLayout& m, const Plan& plan, int64_t rows, int64_t cols, int row_tensors) {
  constexpr int kInner = kMaxLeadDims - 1, kShared = kMaxLeadDims - 2;
  const int64_t inner = m.lead_sizes[kInner], shared = m.lead_sizes[kShared];
  const bool one_row_blocks = plan.items > 0 && plan.cluster == 1 && !plan.persistent && plan.group > 32;
  if (m.kind == MaskKind::None || !one_row_blocks || m.lead_strides[kInner] == 0 || shared == 1 ||
      m.lead_strides[kShared] != 0 || rows > kMaxRowGrid ||
      inner * cols * (int64_t(sizeof(T)) * row_tensors + mask_column_bytes<T>(m)) < kRowGridMinBytes) {
    return dim3(0, 1, 1);
  }
  const int64_t outer = rows / (inner * shared);
  if (inner > 65535 || outer > 65535) return dim3(0, 1, 1);
  return dim3(static_cast<unsigned>(shared), static_cast<unsigned>(inner), static_cast<unsigned>(outer));
}

// The masked-softmax arguments the forward and the backward share: the saved statistics, the
// mask and its row locator, causal masking and dropout.
template <typename T, class Params, class Args> void masked_args(const Params& p, Args& args) {
  args.lse = static_cast<decltype(args.lse)>(p.lse);
  args.rng_state = p.rng_state;
  args.q_len = p.q_len;
  args.mask = p.mask;
  args.locator = row_locator(p.mask, p.rows, p.q_len, p.causal);
  args.causal = p.causal;
  args.dropout = p.dropout;
  // Without dropout every element is kept at scale 1 (kernels may apply these regardless).
  args.threshold = p.dropout ? dropout_threshold(p.p) : 0u;
  args.half_threshold = HalfThreshold(args.threshold);
  args.keep_scale = static_cast<acc_t<T>>(p.dropout ? 1.0 / (1.0 - p.p) : 1.0);
}

}  // namespace

cudaError_t launch_softmax_fwd(const SoftmaxParams& p, DType dtype, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    const auto args = forward_args<T>(p.x, p.y, p.rows, p.cols, p.x_row_stride, p.scale, p.log);
    const bool aligned = rows_aligned(p.x, p.x_row_stride, sizeof(T)) && is_aligned(p.y, 16);
    const Plan plan = make_plan<T>(p.cols, aligned, 1, kForwardRegisterElems<T>, false);
    if constexpr (kWideForwardRows<T>) {
      if (plan.vectorized && p.cols > kWideForwardThreads * kForwardRegisterElems<T> &&
          p.cols <= kWideForwardThreads * kWideForwardElems) {
        const Plan wide{true, kWideForwardThreads, kWideForwardElems / kVec16<T>, 1, 0, false, false, 0, -1};
        return ForwardLaunch<T, false>{args, wide, stream}
            .template register_rows<kWideForwardThreads, kWideForwardElems / kVec16<T>, kVec16<T>, false>();
      }
    }
    return dispatch_plan<T, kForwardRegisterElems<T>>(plan, ForwardLaunch<T, false>{args, plan, stream});
  });
}

// Launches vector_backward_kernel<T, THREADS, VECTORS> (a block a row) when each row is exactly
// THREADS * VECTORS 16-byte vectors a tensor and the dtype takes that shape (kVectorRowsTaken);
// otherwise launches nothing and returns false.
template <typename T, int THREADS, int VECTORS>
bool launch_vector_rows(const BackwardArgs<T>& args, bool block_a_row, int64_t row_bytes, cudaStream_t stream) {
  if constexpr (!kVectorRowsTaken<T, VECTORS>) {
    return false;
  } else {
    if (!block_a_row || row_bytes != int64_t(THREADS) * VECTORS * int64_t(sizeof(uint4))) return false;
    vector_backward_kernel<T, THREADS, VECTORS><<<static_cast<unsigned>(args.rows), THREADS, 0, stream>>>(args);
    return true;
  }
}

cudaError_t launch_softmax_bwd(const SoftmaxBackwardParams& p, DType dtype, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    const auto args = backward_args<T>(p.y, p.dy, p.dx, p.rows, p.cols, p.y_row_stride, p.dy_row_stride, p.scale, p.log);
    const bool aligned = rows_aligned(p.y, p.y_row_stride, sizeof(T)) &&
                         rows_aligned(p.dy, p.dy_row_stride, sizeof(T)) && is_aligned(p.dx, 16);
    if constexpr (!std::is_same<T, double>::value) {
      const int64_t row_bytes = p.cols * int64_t(sizeof(T));
      // A block a row: longer grids than row_blocks allows take the loops below.
      const bool block_a_row = aligned && p.rows <= kMaxRowGrid;
      if (launch_vector_rows<T, kVectorRowThreads, 1>(args, block_a_row, row_bytes, stream) ||
          launch_vector_rows<T, kRereadThreads, 2>(args, block_a_row, row_bytes, stream) ||
          launch_vector_rows<T, kRereadWideThreads, 2>(args, block_a_row, row_bytes, stream) ||
          launch_vector_rows<T, kRereadWideThreads, 4>(args, block_a_row, row_bytes, stream)) {
        return cudaGetLastError();
      }
      if (aligned && p.cols % kVec16<T> == 0 && row_bytes > kRereadMinRowBytes &&
          row_bytes <= kRereadWideMaxRowBytes) {
        const auto blocks = static_cast<unsigned>(row_blocks(p.rows, kRereadThreads));
        if (row_bytes <= kRereadMaxRowBytes) {
          reread_backward_kernel<T, kRereadThreads><<<blocks, kRereadThreads, 0, stream>>>(args);
        } else {
          reread_backward_kernel<T, kRereadWideThreads><<<blocks, kRereadWideThreads, 0, stream>>>(args);
        }
        return cudaGetLastError();
      }
    }
    if constexpr (kWideBackwardRows<T>) {
      if (p.cols > kClusterThreads * kRegisterElems && p.cols <= kClusterThreads * kWideBackwardElems) {
        const Plan plan = make_plan<T>(p.cols, aligned, 2, kWideBackwardElems, false);
        if (plan.items > 0 && plan.group == kClusterThreads) {
          return dispatch_register_rows<kClusterThreads, kWideBackwardElems / kVec16<T>, kVec16<T>>(
              plan, BackwardLaunch<T, false>{args, plan, stream});
        }
      }
    }
    const Plan plan = make_plan<T>(p.cols, aligned, 2, kRegisterElems, false);
    return dispatch_plan<T, kRegisterElems>(plan, BackwardLaunch<T, false>{args, plan, stream});
  });
}

cudaError_t launch_masked_softmax_fwd(const MaskedSoftmaxParams& p, DType dtype, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    auto args = forward_args<T>(p.x, p.out, p.rows, p.cols, p.x_row_stride, p.scale, false);
    masked_args<T>(p, args);
    args.philox = p.philox;
    if (!p.philox.captured) args.schedule = philox_schedule({p.philox.seed, p.philox.offset});
    // 16-bit register rows without an additive mask fold the scale into their exps, which needs a
    // finite scale > 0; with another scale every such 16-bit row takes streamed rows (the plan
    // has no separate switch for register rows of one group).
    const bool additive = p.mask.kind == MaskKind::Additive;
    const bool foldable = additive || sizeof(T) != 2 || (std::isfinite(p.scale) && p.scale > 0.0);
    const bool aligned = rows_aligned(p.x, p.x_row_stride, sizeof(T)) && is_aligned(p.out, 16);
    // Every kind of masked row takes kMaskedForwardRegisterElems elements a thread (with an
    // additive mask too: see masked_forward_threads_per_sm).
    const auto launch = [&](auto additive_mask) {
      constexpr bool kAdditive = decltype(additive_mask)::value;
      constexpr int kPerThread = kMaskedForwardRegisterElems<T>;
      Plan plan = make_plan<T>(p.cols, aligned && foldable, 1, kPerThread, true, vector_mask<T>(p.mask, kVec16<T>));
      plan.row_grid = row_grid<T>(p.mask, plan, p.rows, p.cols, 2);
      return dispatch_plan<T, kPerThread>(plan, ForwardLaunch<T, true, kAdditive>{args, plan, stream});
    };
    return additive ? launch(std::true_type{}) : launch(std::false_type{});
  });
}

cudaError_t launch_masked_softmax_bwd(const MaskedSoftmaxBackwardParams& p, DType dtype, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    auto args = backward_args<T>(p.x, p.dy, p.dx, p.rows, p.cols, p.x_row_stride, p.dy_row_stride, p.scale, false);
    masked_args<T>(p, args);
    const bool aligned = rows_aligned(p.x, p.x_row_stride, sizeof(T)) &&
                         rows_aligned(p.dy, p.dy_row_stride, sizeof(T)) && is_aligned(p.dx, 16);
    Plan plan = make_plan<T>(p.cols, aligned, 2, kRegisterElems, true, vector_mask<T>(p.mask, kVec16<T>));
    plan.row_grid = row_grid<T>(p.mask, plan, p.rows, p.cols, 3);
    if (p.mask.kind == MaskKind::Additive) {
      return dispatch_plan<T, kRegisterElems>(plan, BackwardLaunch<T, true, true>{args, plan, stream});
    }
    return dispatch_plan<T, kRegisterElems>(plan, BackwardLaunch<T, true>{args, plan, stream});
  });
}

}  // namespace fusedops
