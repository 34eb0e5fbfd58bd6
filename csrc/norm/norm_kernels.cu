// LayerNorm and RMSNorm kernels.
//
// A "row group" of threads owns one row: one or more warps, several groups per block for short
// rows, the whole block (or, on sm_90, a cluster of 2 blocks) for long ones. Thread `lane` of a
// group owns the VEC-element chunks starting at (k * group_size + lane) * VEC for k < VPT, so each
// load instruction of a warp is coalesced and a thread always owns the same columns (which keeps
// the backward's column sums in registers). The staged kernels are persistent and software
// pipelined: each thread copies its chunks of the coming rows into a shared-memory ring with
// cp.async while it computes the current row. Rows too long for them go to streaming kernels
// (one block per row) that re-read the row from L2.
// Statistics: mean first, then the sum of squared deviations from it (two passes over the row,
// accurate for rows with a large mean), all in fp32 (fp64 for fp64 input).
#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include <cooperative_groups.h>

#include "../common/async_copy.cuh"
#include "../common/dispatch.cuh"
#include "../common/reduce.cuh"
#include "../common/vec.cuh"
#include "norm.h"

namespace fusedops {
namespace {

namespace cg = cooperative_groups;

constexpr int kMaxThreads = 1024;

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

// The streaming kernels' rows: one per block.
struct BlockRow {
  // Sum over the block, returned to every thread. Every thread of the block must call it.
  template <typename A>
  __device__ __forceinline__ A sum(A value, A* scratch) const {
    return block_reduce(value, SumOp{}, A(0), scratch);
  }

  // Two sums with one pass through shared memory, returned to every thread.
  template <typename A>
  __device__ __forceinline__ void sum_pair(A& a, A& b, A (&scratch)[2][32]) const {
    a = warp_reduce(a, SumOp{});
    b = warp_reduce(b, SumOp{});
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
};

// mean(g) (LayerNorm only) and mean(g * xhat) over the row.
template <bool RMS, typename A>
__device__ __forceinline__ void row_means(const BlockRow& group, A sum_g, A sum_gx, A inv_cols,
                                          A (&scratch)[2][32], A& mean_g, A& mean_gx) {
  if constexpr (RMS) {
    sum_g = A(0);
    sum_gx = group.sum(sum_gx, scratch[0]);
  } else {
    group.sum_pair(sum_g, sum_gx, scratch);
  }
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

template <typename A>
__device__ __forceinline__ void store_stats(const NormFwdParams& p, int64_t row, A mean, A rstd, bool rms) {
  if (!rms) p.mean[row] = static_cast<float>(mean);
  p.rstd[row] = static_cast<float>(rstd);
}

// Forward for rows too long for registers: one block per row, the row read once from memory and
// re-read (mostly from L2) for the variance and the output.
template <typename T, typename W, bool RMS, int VEC>
__global__ void __launch_bounds__(kMaxThreads) norm_fwd_streaming_kernel(const NormFwdParams p) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const BlockRow group;
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

// The VEC elements at (row, col) of a row-strided operand.
template <typename T, int VEC>
__device__ __forceinline__ const AlignedVector<T, VEC>* chunk_at(const void* base, int64_t row, int64_t row_stride,
                                                                  int64_t col) {
  return reinterpret_cast<const AlignedVector<T, VEC>*>(static_cast<const T*>(base) + row * row_stride + col);
}

// Sums v over a row group of `group_threads` threads (a multiple of 32 dividing blockDim.x),
// returned to every thread of the group: a warp shuffle, then (groups wider than a warp) one value
// per warp through scratch, added in warp order. Every thread of the block must call it. No
// trailing barrier: callers alternate between two scratch buffers from one call to the next (a
// thread writes buffer n only after every thread has passed the barrier of call n - 1, hence has
// finished reading the buffer of call n - 2).
template <int N, typename A>
__device__ __forceinline__ void group_sum(A (&v)[N], int group_threads, A (&scratch)[N][32]) {
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = warp_reduce(v[n], SumOp{});
  if (group_threads == 32) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
#pragma unroll
    for (int n = 0; n < N; ++n) scratch[n][warp] = v[n];
  }
  __syncthreads();
  const int group_warps = group_threads / 32, first = warp / group_warps * group_warps;
  const bool holds = lane < group_warps;
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = warp_reduce(holds ? scratch[n][first + lane] : A(0), SumOp{});
}

// Cluster rows (CLUSTER > 1, sm_90): the CLUSTER blocks of a cluster share each row, block r
// owning chunks (k * CLUSTER + r) * blockDim.x + threadIdx.x. Adds the blocks' row sums: each
// block publishes its values in `slot` (its own shared memory), and after a cluster barrier every
// block adds all blocks' values in rank order, so they agree bit for bit. Callers alternate
// between two slots: a slot is rewritten only after the next barrier, once every block read it.
template <int CLUSTER, int N, typename A>
__device__ __forceinline__ void cluster_sum(A (&v)[N], A (&slot)[N]) {
  if constexpr (CLUSTER > 1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    cg::cluster_group cluster = cg::this_cluster();
    if (threadIdx.x == 0) {
#pragma unroll
      for (int n = 0; n < N; ++n) slot[n] = v[n];
    }
    cluster.sync();
#pragma unroll
    for (int n = 0; n < N; ++n) {
      v[n] = *cluster.map_shared_rank(&slot[n], 0);
#pragma unroll
      for (int r = 1; r < CLUSTER; ++r) v[n] += *cluster.map_shared_rank(&slot[n], r);
    }
#else
    __trap();  // the host launches cluster rows only on sm_90 devices, which run sm_90 code
#endif
  }
}

template <int CLUSTER> __device__ __forceinline__ int cluster_rank() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  if constexpr (CLUSTER > 1) return static_cast<int>(cg::this_cluster().block_rank());
#endif
  return 0;
}

// No block of a cluster may exit while another can still read its shared memory.
template <int CLUSTER> __device__ __forceinline__ void cluster_exit_barrier() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  if constexpr (CLUSTER > 1) cg::this_cluster().sync();
#endif
}

// Forward for rows held by a row group of `group_threads` threads (VPT chunks of VEC elements
// each), blockDim.x / group_threads groups per block, each on its own row; blocks stride over the
// tiles of `groups` consecutive rows (a persistent grid). Software pipeline as in the backward:
// every thread copies the chunks it owns (x, residual) into a ring of `stages` shared-memory slots
// with cp.async, `stages - 1` rows ahead of the row it normalizes, and reads only its own slots.
// With CLUSTER > 1 the row group is a whole block and a row is shared by a cluster (cluster_sum).
template <typename T, typename W, bool RMS, int VEC, int VPT, int CLUSTER>
__global__ void __launch_bounds__(kMaxThreads) norm_fwd_staged_kernel(const NormFwdParams p, const int group_threads,
                                                                      const int stages) {
  using A = acc_t<T>;
  using Chunk = AlignedVector<T, VEC>;
  extern __shared__ __align__(16) unsigned char shared[];
  __shared__ A scratch[2][1][32];
  __shared__ A cluster_slots[2][1];
  const int lane = threadIdx.x % group_threads, group = threadIdx.x / group_threads;
  const int groups = blockDim.x / group_threads;
  const int row_lane = cluster_rank<CLUSTER>() * group_threads + lane, row_threads = CLUSTER * group_threads;
  const int cluster_index = blockIdx.x / CLUSTER, clusters = gridDim.x / CLUSTER;
  const int operands = p.residual != nullptr ? 2 : 1;  // x (, residual)
  Chunk* const ring = reinterpret_cast<Chunk*>(shared);
  auto slot = [&](int stage, int operand, int k) {
    return ring + ((stage * operands + operand) * VPT + k) * blockDim.x + threadIdx.x;
  };
  const int64_t tiles = (p.rows + groups - 1) / groups;
  // Tiles of this block (or cluster): fewer than 2^31 even for 2^40 rows.
  const int block_tiles = cluster_index < tiles ? static_cast<int>((tiles - 1 - cluster_index) / clusters + 1) : 0;
  auto row_of = [&](int i) { return (cluster_index + int64_t(i) * clusters) * groups + group; };
  auto issue = [&](int i, int stage) {
    const int64_t row = row_of(i);
    if (i < block_tiles && row < p.rows) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t col = (int64_t(k) * row_threads + row_lane) * VEC;
        if (col >= p.cols) continue;
        copy_async_or_now(slot(stage, 0, k), chunk_at<T, VEC>(p.x, row, p.x_row_stride, col));
        if (operands == 2) {
          copy_async_or_now(slot(stage, 1, k), chunk_at<T, VEC>(p.residual, row, p.residual_row_stride, col));
        }
      }
    }
    copy_async_commit();  // possibly empty: every iteration commits one group
  };

  const A inv_cols = A(1) / A(p.cols);
  int reductions = 0;  // alternates the scratch buffers and cluster slots
  auto row_sum = [&](A value) {
    A v[1] = {value};
    const int parity = reductions++ & 1;
    group_sum(v, group_threads, scratch[parity]);
    cluster_sum<CLUSTER>(v, cluster_slots[parity]);
    return v[0];
  };
  for (int s = 0; s < stages - 1; ++s) issue(s, s);
  int stage = 0;
  for (int i = 0; i < block_tiles; ++i) {
    issue(i + stages - 1, stage == 0 ? stages - 1 : stage - 1);
    copy_async_wait(stages - 1);
    const int64_t row = row_of(i);
    const bool valid = row < p.rows;
    // The normalized input of chunk k: x, or x + residual rounded to T.
    auto values = [&](int k, A(&v)[VEC]) {
      const Chunk xs = *slot(stage, 0, k);
      if (operands == 2) {
        const Chunk rs = *slot(stage, 1, k);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = to_acc(from_acc<T>(to_acc(xs.val[j]) + to_acc(rs.val[j])));
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = to_acc(xs.val[j]);
      }
    };
    A mean = 0;
    if constexpr (!RMS) {
      A sum = 0;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t col = (int64_t(k) * row_threads + row_lane) * VEC;
        if (!valid || col >= p.cols) continue;
        A v[VEC];
        values(k, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum += v[j];
      }
      mean = row_sum(sum) * inv_cols;
    }
    A squares = 0;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t col = (int64_t(k) * row_threads + row_lane) * VEC;
      if (!valid || col >= p.cols) continue;
      A v[VEC];
      values(k, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) squares += (v[j] - mean) * (v[j] - mean);
    }
    const A rstd = inv_sqrt(row_sum(squares) * inv_cols + A(p.eps));
    if (valid) {
      if (row_lane == 0) store_stats(p, row, mean, rstd, RMS);
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t col = (int64_t(k) * row_threads + row_lane) * VEC;
        if (col >= p.cols) continue;
        A v[VEC];
        values(k, v);
        if (operands == 2) {
          Chunk sum;
#pragma unroll
          for (int j = 0; j < VEC; ++j) sum.val[j] = from_acc<T>(v[j]);
          store_vector<T, VEC>(static_cast<T*>(p.residual_out) + row * p.cols + col, sum);
        }
        store_output<T, W, VEC>(p, row, col, v, mean, rstd);
      }
    }
    stage = stage + 1 == stages ? 0 : stage + 1;
  }
  cluster_exit_barrier<CLUSTER>();
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

// Writes the block's column sums to partial row `partial_row`. Row groups own the same columns:
// their sums are added in group order in shared memory (`sums`, cols elements) first. A thread
// owns the chunks (k * row_threads + row_lane) * VEC (row_threads = group_threads without clusters).
template <int VEC, int VPT, typename A>
__device__ __forceinline__ void write_block_partial(void* buffer, const NormBwdParams& p, int64_t partial_row,
                                                    int group_threads, int row_lane, int row_threads,
                                                    const A (&column_sums)[VPT][VEC], A* sums) {
  const int group = threadIdx.x / group_threads;
  const int groups = blockDim.x / group_threads;
  A* const partial = static_cast<A*>(buffer) + partial_row * p.cols;
  if (groups == 1) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t col = (int64_t(k) * row_threads + row_lane) * VEC;
      if (col >= p.cols) continue;
      AlignedVector<A, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.val[j] = column_sums[k][j];
      store_vector<A, VEC>(partial + col, out);
    }
    return;
  }
  for (int g = 0; g < groups; ++g) {
    if (group == g) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t col = (int64_t(k) * row_threads + row_lane) * VEC;
        if (col >= p.cols) continue;
#pragma unroll
        for (int j = 0; j < VEC; ++j) sums[col + j] = (g == 0 ? A(0) : sums[col + j]) + column_sums[k][j];
      }
    }
    __syncthreads();
  }
  for (int64_t col = threadIdx.x; col < p.cols; col += blockDim.x) partial[col] = sums[col];
  __syncthreads();  // sums may be reused
}

// Backward for rows held by a row group of `group_threads` threads (VPT chunks of VEC elements
// each); blockDim.x / group_threads groups per block, each on its own row. Blocks stride over
// the tiles of `groups` consecutive rows (a persistent grid) and keep their column sums in
// registers; block b writes partial row b.
// Software pipeline: every thread copies the chunks it owns (x, dy, dresidual_out) and its row's
// statistics into a ring of `stages` shared-memory slots with cp.async, `stages - 1` rows ahead of
// the one it computes, so each SM keeps tens of KB of loads in flight through the reductions. A
// thread reads only the slots it filled itself: no barrier guards the ring.
// With CLUSTER > 1 the row group is a whole block and a row is shared by a cluster (cluster_sum);
// the clusters stride over the rows and cluster c writes partial row c.
template <typename T, typename W, bool RMS, int VEC, int VPT, int CLUSTER>
__global__ void __launch_bounds__(kMaxThreads) norm_bwd_kernel(const NormBwdParams p, const int group_threads,
                                                               const int stages) {
  using A = acc_t<T>;
  using Chunk = AlignedVector<T, VEC>;
  constexpr int kSums = RMS ? 1 : 2;
  extern __shared__ __align__(16) unsigned char shared[];
  __shared__ A scratch[2][kSums][32];
  __shared__ A cluster_slots[2][kSums];
  const int lane = threadIdx.x % group_threads, group = threadIdx.x / group_threads;
  const int groups = blockDim.x / group_threads;
  const int row_lane = cluster_rank<CLUSTER>() * group_threads + lane, row_threads = CLUSTER * group_threads;
  const int cluster_index = blockIdx.x / CLUSTER, clusters = gridDim.x / CLUSTER;
  const int operands = p.dresidual_out != nullptr ? 3 : 2;  // x, dy (, dresidual_out)
  Chunk* const ring = reinterpret_cast<Chunk*>(shared);
  float* const ring_stats = reinterpret_cast<float*>(ring + stages * operands * VPT * blockDim.x);
  auto slot = [&](int stage, int operand, int k) {
    return ring + ((stage * operands + operand) * VPT + k) * blockDim.x + threadIdx.x;
  };
  auto stat_slot = [&](int stage, int which) { return ring_stats + (stage * 2 + which) * blockDim.x + threadIdx.x; };

  const int64_t tiles = (p.rows + groups - 1) / groups;
  // Tiles of this block (or cluster): fewer than 2^31 even for 2^40 rows.
  const int block_tiles = cluster_index < tiles ? static_cast<int>((tiles - 1 - cluster_index) / clusters + 1) : 0;
  auto row_of = [&](int i) { return (cluster_index + int64_t(i) * clusters) * groups + group; };
  auto issue = [&](int i, int stage) {
    const int64_t row = row_of(i);
    if (i < block_tiles && row < p.rows) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t col = (int64_t(k) * row_threads + row_lane) * VEC;
        if (col >= p.cols) continue;
        copy_async_or_now(slot(stage, 0, k), chunk_at<T, VEC>(p.x, row, p.x_row_stride, col));
        copy_async_or_now(slot(stage, 1, k), chunk_at<T, VEC>(p.dy, row, p.dy_row_stride, col));
        if (operands == 3) {
          copy_async_or_now(slot(stage, 2, k), chunk_at<T, VEC>(p.dresidual_out, row, p.dresidual_out_row_stride, col));
        }
      }
      if (!RMS) copy_async<4>(stat_slot(stage, 0), p.mean + row);
      copy_async<4>(stat_slot(stage, 1), p.rstd + row);
    }
    copy_async_commit();  // possibly empty: every iteration commits one group
  };

  const A inv_cols = A(1) / A(p.cols);
  A dweight[VPT][VEC], dbias[VPT][VEC];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dweight[k][j] = dbias[k][j] = A(0);

  for (int s = 0; s < stages - 1; ++s) issue(s, s);
  int stage = 0;
  for (int i = 0; i < block_tiles; ++i) {
    issue(i + stages - 1, stage == 0 ? stages - 1 : stage - 1);
    copy_async_wait(stages - 1);
    const int64_t row = row_of(i);
    const bool valid = row < p.rows;
    const A mean = (!RMS && valid) ? A(*stat_slot(stage, 0)) : A(0);
    const A rstd = valid ? A(*stat_slot(stage, 1)) : A(0);
    // xhat and g of chunk k (read back from the ring when needed again: cheaper than registers).
    auto terms = [&](int k, int64_t col, A(&xhat)[VEC], A(&g)[VEC], A(&dy)[VEC]) {
      A x[VEC], w[VEC];
      const Chunk xs = *slot(stage, 0, k), dys = *slot(stage, 1, k);
      load_column<W, VEC>(p.weight, col, A(1), w);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        x[j] = to_acc(xs.val[j]);
        dy[j] = to_acc(dys.val[j]);
        xhat[j] = (x[j] - mean) * rstd;
        g[j] = dy[j] * w[j];
      }
    };
    A sum_g = 0, sum_gx = 0;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t col = (int64_t(k) * row_threads + row_lane) * VEC;
      if (!valid || col >= p.cols) continue;
      A xhat[VEC], g[VEC], dy[VEC];
      terms(k, col, xhat, g, dy);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        sum_g += g[j];
        sum_gx += g[j] * xhat[j];
        dweight[k][j] += dy[j] * xhat[j];
        if constexpr (!RMS) dbias[k][j] += dy[j];
      }
    }
    A row_sums[kSums] = {sum_gx};
    if constexpr (!RMS) row_sums[1] = sum_g;
    group_sum(row_sums, group_threads, scratch[i & 1]);
    cluster_sum<CLUSTER>(row_sums, cluster_slots[i & 1]);
    const A mean_gx = row_sums[0] * inv_cols;
    const A mean_g = RMS ? A(0) : row_sums[kSums - 1] * inv_cols;
    if (valid) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t col = (int64_t(k) * row_threads + row_lane) * VEC;
        if (col >= p.cols) continue;
        A xhat[VEC], g[VEC], dy[VEC];
        terms(k, col, xhat, g, dy);
        Chunk dx;
        if (operands == 3) {
          const Chunk extra = *slot(stage, 2, k);
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            dx.val[j] = from_acc<T>(rstd * (g[j] - mean_g - xhat[j] * mean_gx) + to_acc(extra.val[j]));
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) dx.val[j] = from_acc<T>(rstd * (g[j] - mean_g - xhat[j] * mean_gx));
        }
        store_vector<T, VEC>(static_cast<T*>(p.dx) + row * p.cols + col, dx);
      }
    }
    stage = stage + 1 == stages ? 0 : stage + 1;
  }
  allow_dependent_launch();  // the column sums may start launching; they wait for this grid to end
  copy_async_wait(0);
  __syncthreads();  // the ring is free: it holds the column sums of the row groups now
  A* const column_sums = reinterpret_cast<A*>(shared);
  if (p.weight_partial != nullptr) {
    write_block_partial<VEC, VPT>(p.weight_partial, p, cluster_index, group_threads, row_lane, row_threads, dweight,
                                  column_sums);
  }
  if (!RMS && p.bias_partial != nullptr) {
    write_block_partial<VEC, VPT>(p.bias_partial, p, cluster_index, group_threads, row_lane, row_threads, dbias,
                                  column_sums);
  }
  cluster_exit_barrier<CLUSTER>();
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

// Backward for rows too long for registers: one block per row; the row is read for the two
// row sums and re-read (mostly from L2) for dx. The block's column sums accumulate in shared
// memory when they fit (SHARED_SUMS: weight sums, then bias sums, cols each; copied to the
// partial rows at the end), else directly in its partial rows in global memory.
template <typename T, typename W, bool RMS, int VEC, bool SHARED_SUMS>
__global__ void __launch_bounds__(kMaxThreads) norm_bwd_streaming_kernel(const NormBwdParams p) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char shared_sums[];
  __shared__ A scratch[2][32];
  const BlockRow group;
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

// dweight / dbias: out[c] = sum over b of partial[b, c]. blockIdx.y picks the operand (0: weight,
// 1: bias). Block (32, 32) owns 32 column vectors of VEC columns: thread (tx, ty) adds partial rows
// ty, ty + 32, ... of vector tx in increasing order, then thread (tx, 0) adds the 32 results of
// its vector in ty order: a fixed order, so bitwise reproducible. Launched as a dependent grid of
// the backward kernel: it waits for that kernel's partials before reading them.
template <typename A, typename W, int VEC>
__global__ void __launch_bounds__(kMaxThreads) column_sum_kernel(const A* weight_partial, W* dweight,
                                                                 const A* bias_partial, W* dbias, int64_t blocks,
                                                                 int64_t cols) {
  using Vec = AlignedVector<A, VEC>;
  __shared__ Vec tile[32][32];
  wait_for_prior_grid();
  const A* partial = blockIdx.y == 0 ? weight_partial : bias_partial;
  W* out = blockIdx.y == 0 ? dweight : dbias;
  if (partial == nullptr) return;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col = (int64_t(blockIdx.x) * 32 + tx) * VEC;
  Vec sum{};
  if (col < cols) {
#pragma unroll 4
    for (int64_t b = ty; b < blocks; b += 32) {
      const Vec v = load_vector<A, VEC>(partial + b * cols + col);
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum.val[j] += v.val[j];
    }
  }
  tile[ty][tx] = sum;
  __syncthreads();
  if (ty != 0 || col >= cols) return;
  for (int r = 1; r < 32; ++r) {
    const Vec v = tile[r][tx];
#pragma unroll
    for (int j = 0; j < VEC; ++j) sum.val[j] += v.val[j];
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[col + j] = from_acc<W>(sum.val[j]);
}

// ---- launch ------------------------------------------------------------------------------------

int threads_for(int64_t chunks) {
  return static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, (chunks + 31) / 32 * 32)));
}

using BwdKernel = void (*)(NormBwdParams);
using StagedFwdKernel = void (*)(NormFwdParams, int, int);
using StagedBwdKernel = void (*)(NormBwdParams, int, int);

template <typename W>
bool column_aligned(const void* ptr, int vec) {
  return ptr == nullptr || is_aligned(ptr, vec * static_cast<int>(sizeof(W)));
}

bool rows_aligned(const void* ptr, int64_t row_stride, int vec, int elem_bytes) {
  return ptr == nullptr || (is_aligned(ptr, vec * elem_bytes) && row_stride % vec == 0);
}

// What the launch plans read of the current device.
struct DeviceLimits {
  int sms = 1;
  int shared_per_block = 48 * 1024;  // opt-in maximum for one block
  int shared_per_sm = 48 * 1024;
  bool sm90 = false;  // thread-block clusters and programmatic dependent launch
};

DeviceLimits query_device_limits(int device) {
  DeviceLimits limits;
  int major = 0;
  if (cudaDeviceGetAttribute(&limits.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limits.shared_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&limits.shared_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    return DeviceLimits{};
  }
  limits.sm90 = major >= 9;
  return limits;
}

DeviceLimits device_limits() {
  constexpr int kMaxDevices = 64;
  static std::once_flag queried[kMaxDevices];
  static DeviceLimits limits[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return DeviceLimits{};
  if (device >= kMaxDevices) return query_device_limits(device);
  std::call_once(queried[device], [device] { limits[device] = query_device_limits(device); });
  return limits[device];
}

constexpr int kStagedBlockThreads = 512;  // row groups narrower than this share a block
constexpr int kMaxStages = 8;             // copy_async_wait takes up to 7 pending groups
constexpr int kStaticSharedReserve = 1024;  // static shared memory + the per-block reservation

// Occupancy of a kernel on the current device, and the opt-in for its dynamic shared memory:
// both cached (per device, kernel, block size, shared memory) because the backward plans its
// launch twice per call (for the partial buffer's size, then to launch).
struct LaunchCache {
  std::mutex mutex;
  std::map<std::tuple<int, const void*, int, int>, int> blocks_per_sm;
  std::map<std::tuple<int, const void*, int, int>, int> active_clusters;
  std::map<std::pair<int, const void*>, int> shared_granted;
};

LaunchCache& launch_cache() {
  static LaunchCache cache;
  return cache;
}

int blocks_per_sm(const void* kernel, int threads, int shared_bytes) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  LaunchCache& cache = launch_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  const auto key = std::make_tuple(device, kernel, threads, shared_bytes);
  const auto found = cache.blocks_per_sm.find(key);
  if (found != cache.blocks_per_sm.end()) return found->second;
  int per_sm = 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return 1;
  }
  return cache.blocks_per_sm[key] = std::max(per_sm, 1);
}

// Lets `kernel` use `shared_bytes` of dynamic shared memory; false where the device refuses.
bool grant_dynamic_shared(const void* kernel, int shared_bytes) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  LaunchCache& cache = launch_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  int& granted = cache.shared_granted[{device, kernel}];
  if (shared_bytes <= granted) return true;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  granted = shared_bytes;
  return true;
}

// A launch of a staged (software-pipelined, persistent) kernel.
struct StagedPlan {
  int group_threads = 0;  // threads per row
  int threads = 0;
  int stages = 0;
  int shared_bytes = 0;
  int64_t blocks = 0;
};

// Row groups of ceil(chunks / vpt) threads (rounded up to warps), as many per block as fit
// kStagedBlockThreads; as many pipeline stages (up to kMaxStages) as the shared memory of the
// blocks that the registers allow per SM can hold. `stage_bytes_per_thread`: one thread's share
// of one stage; `other_shared_bytes`: shared memory the kernel needs besides the stages (it may
// reuse the ring). Returns false where fewer than two stages fit or the shared memory cannot be
// granted.
bool plan_staged(const void* kernel, int64_t rows, int64_t chunks, int vpt, int64_t stage_bytes_per_thread,
                 int64_t other_shared_bytes, const DeviceLimits& limits, StagedPlan& plan) {
  const int group_threads = threads_for((chunks + vpt - 1) / vpt);
  const int threads = group_threads * std::max(1, kStagedBlockThreads / group_threads);
  const int64_t stage_bytes = threads * stage_bytes_per_thread;
  const int64_t per_block_max = limits.shared_per_block - kStaticSharedReserve;
  const int by_registers = blocks_per_sm(kernel, threads, 0);
  int stages = kMaxStages;
  while (stages > 2 && (stages * stage_bytes > per_block_max ||
                        by_registers * (stages * stage_bytes + kStaticSharedReserve) > limits.shared_per_sm)) {
    --stages;
  }
  const int64_t shared_bytes = std::max(stages * stage_bytes, other_shared_bytes);
  if (shared_bytes > per_block_max || !grant_dynamic_shared(kernel, static_cast<int>(shared_bytes))) return false;
  plan.group_threads = group_threads;
  plan.threads = threads;
  plan.stages = stages;
  plan.shared_bytes = static_cast<int>(shared_bytes);
  const int groups = threads / group_threads;
  const int64_t tiles = (rows + groups - 1) / groups;
  const int per_sm = blocks_per_sm(kernel, threads, plan.shared_bytes);
  plan.blocks = std::max<int64_t>(1, std::min<int64_t>(tiles, int64_t(limits.sms) * per_sm));
  return true;
}

constexpr int kClusterBlocks = 2;  // blocks per row of the cluster rows (sm_90)

cudaLaunchConfig_t cluster_config(const StagedPlan& shape, int64_t clusters, int cluster, cudaStream_t stream,
                                  cudaLaunchAttribute& attribute) {
  attribute = {};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(clusters * cluster));
  config.blockDim = dim3(shape.threads);
  config.dynamicSmemBytes = shape.shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return config;
}

// Clusters of `kernel` with `shape` that the device runs at once (cached like blocks_per_sm); 0
// where it cannot run one.
int max_active_clusters(const void* kernel, const StagedPlan& shape, const DeviceLimits& limits) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  LaunchCache& cache = launch_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  const auto key = std::make_tuple(device, kernel, shape.threads, shape.shared_bytes);
  const auto found = cache.active_clusters.find(key);
  if (found != cache.active_clusters.end()) return found->second;
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config =
      cluster_config(shape, limits.sms / kClusterBlocks, kClusterBlocks, nullptr, attribute);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();  // the caller falls back to another kernel
    clusters = 0;
  }
  return cache.active_clusters[key] = clusters;
}

template <typename T, typename W, bool RMS, int VEC>
cudaError_t launch_fwd_with(const NormFwdParams& p, cudaStream_t stream) {
  const int64_t chunks = (p.cols + VEC - 1) / VEC;
  if (chunks <= 4 * int64_t(kMaxThreads)) {
    // Row groups hold VPT chunks of x (, residual) per stage.
    const int vpt = chunks <= kMaxThreads ? 1 : chunks <= 2 * kMaxThreads ? 2 : 4;
    const StagedFwdKernel kernel = vpt == 1   ? norm_fwd_staged_kernel<T, W, RMS, VEC, 1, 1>
                                   : vpt == 2 ? norm_fwd_staged_kernel<T, W, RMS, VEC, 2, 1>
                                              : norm_fwd_staged_kernel<T, W, RMS, VEC, 4, 1>;
    const int operands = p.residual != nullptr ? 2 : 1;
    const DeviceLimits limits = device_limits();
    StagedPlan plan;
    if (plan_staged(reinterpret_cast<const void*>(kernel), p.rows, chunks, vpt,
                    vpt * operands * VEC * int64_t(sizeof(T)), 0, limits, plan)) {
      kernel<<<static_cast<unsigned>(plan.blocks), plan.threads, plan.shared_bytes, stream>>>(p, plan.group_threads,
                                                                                             plan.stages);
      return cudaGetLastError();
    }
    if (vpt == 4 && limits.sm90) {
      // Cluster rows (the add_* variants' top size class): a row over kClusterBlocks blocks with
      // 2 chunks per thread, so that two stages of both operands fit.
      const StagedFwdKernel cluster_kernel = norm_fwd_staged_kernel<T, W, RMS, VEC, 2, kClusterBlocks>;
      const int64_t block_chunks = (chunks + kClusterBlocks - 1) / kClusterBlocks;
      if (plan_staged(reinterpret_cast<const void*>(cluster_kernel), p.rows, block_chunks, 2,
                      2 * operands * VEC * int64_t(sizeof(T)), 0, limits, plan)) {
        const int clusters = max_active_clusters(reinterpret_cast<const void*>(cluster_kernel), plan, limits);
        if (clusters > 0) {
          cudaLaunchAttribute attribute;
          const cudaLaunchConfig_t config =
              cluster_config(plan, std::min<int64_t>(p.rows, clusters), kClusterBlocks, stream, attribute);
          return cudaLaunchKernelEx(&config, cluster_kernel, p, plan.group_threads, plan.stages);
        }
      }
    }
  }
  // Rows whose stages do not fit in shared memory (and no cluster of blocks shares them): one
  // block per row, re-read from L2.
  const int64_t blocks = std::min<int64_t>(p.rows, int64_t(1) << 30);  // a grid-stride loop takes the rest
  norm_fwd_streaming_kernel<T, W, RMS, VEC><<<static_cast<unsigned>(blocks), kMaxThreads, 0, stream>>>(p);
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
  return vectorized ? launch_fwd_with<T, W, RMS, kVec>(p, stream) : launch_fwd_with<T, W, RMS, 1>(p, stream);
}

struct BwdPlan {
  StagedBwdKernel staged = nullptr;  // else `streaming`
  StagedPlan shape;                  // of `staged`
  int cluster = 1;                   // blocks per row of `staged`
  BwdKernel streaming = nullptr;
  int threads = 0;
  int64_t blocks = 0;  // the partial rows: blocks, or clusters of `staged`
  int shared_bytes = 0;
};

// Persistent grid: as many blocks as fit on the device at once, at most one per row tile.
template <typename T, typename W, bool RMS, int VEC>
BwdPlan plan_bwd_with(const NormBwdParams& p) {
  using A = acc_t<T>;
  const DeviceLimits limits = device_limits();
  BwdPlan plan;
  const int64_t chunks = (p.cols + VEC - 1) / VEC;
  // A thread's share of a stage: VPT chunks of x, dy (, dresidual_out) and the row's statistics.
  const int operands = p.dresidual_out != nullptr ? 3 : 2;
  auto stage_bytes_per_thread = [&](int vpt) {
    return vpt * operands * VEC * int64_t(sizeof(T)) + 2 * int64_t(sizeof(float));
  };
  if (chunks <= 2 * int64_t(kMaxThreads)) {
    // The block's column sums are added in shared memory when it has several row groups.
    const int vpt = chunks <= kMaxThreads ? 1 : 2;
    const StagedBwdKernel kernel =
        vpt == 1 ? norm_bwd_kernel<T, W, RMS, VEC, 1, 1> : norm_bwd_kernel<T, W, RMS, VEC, 2, 1>;
    if (plan_staged(reinterpret_cast<const void*>(kernel), p.rows, chunks, vpt, stage_bytes_per_thread(vpt),
                    p.cols * int64_t(sizeof(A)), limits, plan.shape)) {
      plan.staged = kernel;
      plan.blocks = plan.shape.blocks;
      return plan;
    }
  } else if (limits.sm90 && chunks <= 2 * int64_t(kMaxThreads) * kClusterBlocks) {
    // Cluster rows (sm_90): a row over kClusterBlocks blocks, 2 chunks per thread.
    const StagedBwdKernel kernel = norm_bwd_kernel<T, W, RMS, VEC, 2, kClusterBlocks>;
    const int64_t block_chunks = (chunks + kClusterBlocks - 1) / kClusterBlocks;
    if (plan_staged(reinterpret_cast<const void*>(kernel), p.rows, block_chunks, 2, stage_bytes_per_thread(2), 0,
                    limits, plan.shape)) {
      const int clusters = max_active_clusters(reinterpret_cast<const void*>(kernel), plan.shape, limits);
      if (clusters > 0) {
        plan.staged = kernel;
        plan.cluster = kClusterBlocks;
        plan.blocks = std::min<int64_t>(p.rows, clusters);
        return plan;
      }
    }
  }
  plan.threads = threads_for((p.cols + 2 * VEC - 1) / (2 * VEC));
  const int64_t sums_bytes = ((p.dweight != nullptr) + (p.dbias != nullptr)) * p.cols * int64_t(sizeof(A));
  plan.streaming = norm_bwd_streaming_kernel<T, W, RMS, VEC, false>;
  if (sums_bytes > 0 && sums_bytes + kStaticSharedReserve <= limits.shared_per_block) {
    const BwdKernel shared_kernel = norm_bwd_streaming_kernel<T, W, RMS, VEC, true>;
    if (grant_dynamic_shared(reinterpret_cast<const void*>(shared_kernel), static_cast<int>(sums_bytes))) {
      plan.streaming = shared_kernel;
      plan.shared_bytes = static_cast<int>(sums_bytes);
    }
  }
  const int per_sm = blocks_per_sm(reinterpret_cast<const void*>(plan.streaming), plan.threads, plan.shared_bytes);
  plan.blocks = std::max<int64_t>(1, std::min<int64_t>(p.rows, int64_t(limits.sms) * per_sm));
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

// dweight and dbias from the partial rows, in one launch that may start while the backward
// kernel finishes (programmatic dependent launch where the device has it).
template <typename A, typename W>
cudaError_t launch_column_sums(const NormBwdParams& p, int64_t blocks, cudaStream_t stream) {
  constexpr int kVec = kVec16<A>;
  const bool vectorized = p.cols % kVec == 0;  // partial rows start 16-byte aligned
  cudaLaunchConfig_t config = {};
  const int64_t block_cols = 32 * (vectorized ? kVec : 1);
  config.gridDim = dim3(static_cast<unsigned>((p.cols + block_cols - 1) / block_cols), p.dbias != nullptr ? 2 : 1);
  config.blockDim = dim3(32, 32);
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (device_limits().sm90) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  const auto* weight_partial = static_cast<const A*>(p.weight_partial);
  const auto* bias_partial = static_cast<const A*>(p.bias_partial);
  auto* dweight = static_cast<W*>(p.dweight);
  auto* dbias = static_cast<W*>(p.dbias);
  return vectorized ? cudaLaunchKernelEx(&config, column_sum_kernel<A, W, kVec>, weight_partial, dweight, bias_partial,
                                         dbias, blocks, p.cols)
                    : cudaLaunchKernelEx(&config, column_sum_kernel<A, W, 1>, weight_partial, dweight, bias_partial,
                                         dbias, blocks, p.cols);
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
  const BwdPlan plan = plan_bwd<T, W, RMS>(p);
  const unsigned blocks = static_cast<unsigned>(plan.blocks);
  if (plan.cluster > 1) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = cluster_config(plan.shape, plan.blocks, plan.cluster, stream, attribute);
    const cudaError_t err = cudaLaunchKernelEx(&config, plan.staged, p, plan.shape.group_threads, plan.shape.stages);
    if (err != cudaSuccess) return err;
  } else if (plan.staged != nullptr) {
    plan.staged<<<blocks, plan.shape.threads, plan.shape.shared_bytes, stream>>>(p, plan.shape.group_threads,
                                                                                 plan.shape.stages);
  } else {
    plan.streaming<<<blocks, plan.threads, plan.shared_bytes, stream>>>(p);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || (p.dweight == nullptr && p.dbias == nullptr)) return err;
  return launch_column_sums<A, W>(p, plan.blocks, stream);
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
