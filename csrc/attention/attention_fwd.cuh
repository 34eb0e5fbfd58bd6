// FlashAttention-2-style forward kernel. One block of 4 warps owns a 64-row query tile; each
// warp owns 16 query rows, holds their Q fragments in registers and a 16 x D fp32 output
// accumulator. K and V are streamed in 64-row tiles through shared memory with cp.async double
// buffering; S = Q K^T and O += P V run on tensor cores (mma.sync m16n8k16); the softmax is
// online (running max and sum in fp32, exp2 with log2(e) folded into the scale).
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention.h"
#include "mma.cuh"

namespace fusedops {
namespace attention {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockM = 16 * kWarps;  // query rows per block
constexpr int kBlockN = 64;           // key rows per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared-memory row pitch: 16 bytes of padding make the pitch an odd number of 16-byte chunks,
// so the 8 row addresses of one ldmatrix fall in distinct bank groups.
template <int D>
constexpr int smem_pitch() {
  return D + 8;
}

template <typename T, int D>
constexpr size_t fwd_smem_bytes() {
  return sizeof(T) * smem_pitch<D>() * (kBlockM + 4 * kBlockN);  // Q + 2 x (K, V)
}

// Opts `kernel` in to `smem` bytes of dynamic shared memory and launches it on a 1-D grid of
// `blocks` blocks (nothing to do for 0; a 1-D grid holds at most INT32_MAX blocks).
template <class Params>
cudaError_t launch_with_shared_memory(void (*kernel)(Params), int64_t blocks, int threads, size_t smem,
                                      const Params& p, cudaStream_t stream) {
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(p);
  return cudaGetLastError();
}

// Blocks of a grid with one block per (batch, query head, tile of `block_m` query rows).
template <int block_m>
int64_t query_tile_blocks(const AttentionFwdParams& p) {
  return static_cast<int64_t>((p.len_q + block_m - 1) / block_m) * p.batch * p.heads_q;
}

// Block index -> (batch * heads_q index, query tile). Tiles of one head are adjacent so that
// they share K/V in L2; with causal masking the longest tiles start first.
struct TileIndex {
  int bh, m_tile;
};

__device__ __forceinline__ TileIndex tile_index(int m_tiles, bool causal) {
  const int bh = blockIdx.x / m_tiles, m = blockIdx.x % m_tiles;
  return {bh, causal ? m_tiles - 1 - m : m};
}

template <typename T>
__device__ __forceinline__ const T* head_ptr(const void* base, const AttentionStrides& s, int b, int h) {
  return static_cast<const T*>(base) + b * s.batch + h * s.head;
}

// Number of key tiles of `block_n` keys that query rows [m0, m0 + rows) attend to.
template <int block_n = kBlockN>
__device__ __forceinline__ int key_tiles(int m0, int rows, int len_k, bool causal) {
  const int keys = causal ? min(len_k, m0 + rows) : len_k;
  return (keys + block_n - 1) / block_n;
}

// Whether key tile n0 (of `block_n` keys) needs per-element masking for query rows starting at m0.
template <int block_n = kBlockN>
__device__ __forceinline__ bool tile_needs_mask(int m0, int n0, int len_k, bool causal) {
  return n0 + block_n > len_k || (causal && n0 + block_n - 1 > m0);
}

// Scores in log2 units: scale * log2(e) * (Q K^T). Applied before masking so any scale sign works.
// acc is a 16-row tile of NB n8-blocks in C layout (also a warp's share of a wgmma accumulator).
template <int NB>
__device__ __forceinline__ void scale_scores(float (&acc)[NB][4], float scale_log2) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nb][e] *= scale_log2;
}

// Sets the scores of keys past len_k, and (causal) of keys after the query, to -inf. acc is a
// 16 x (8 * NB) tile in C layout whose first row is query `row0` and first column key `n0`.
template <int NB>
__device__ __forceinline__ void mask_scores(float (&acc)[NB][4], int row0, int n0, int len_k, bool causal, int lane) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + lane / 4 + 8 * (e / 2);
      const int col = n0 + 8 * nb + 2 * (lane % 4) + e % 2;
      if (col >= len_k || (causal && col > row)) acc[nb][e] = -INFINITY;
    }
  }
}

// Starts the cp.async copies of key/value tile j into buffer j % 2 of k_smem / v_smem (two
// buffers of kBlockN rows each).
template <int D, typename T>
__device__ __forceinline__ void load_kv_tile(T* k_smem, T* v_smem, const T* k, const T* v, int64_t k_seq,
                                             int64_t v_seq, int len_k, int j, int tid) {
  constexpr int pitch = smem_pitch<D>();
  const int n0 = j * kBlockN, buffer = j % 2;
  copy_tile_async<kBlockN, D, kThreads>(k_smem + buffer * kBlockN * pitch, pitch, k + n0 * k_seq, k_seq, len_k - n0,
                                        tid);
  copy_tile_async<kBlockN, D, kThreads>(v_smem + buffer * kBlockN * pitch, pitch, v + n0 * v_seq, v_seq, len_k - n0,
                                        tid);
}

// Online-softmax step on a 16-row score tile s (C layout, log2 units, masked): updates this
// thread's running max and partial sums of rows g and g + 8, rescales the output accumulator
// o, and leaves exp2(s - max) in s.
template <int NB, int ND>
__device__ __forceinline__ void online_softmax_step(float (&s)[NB][4], float (&o)[ND][4], float (&row_max)[2],
                                                    float (&row_sum)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float tile_max = row_max[r];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) tile_max = fmaxf(tile_max, fmaxf(s[nb][2 * r], s[nb][2 * r + 1]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    // A row with every key masked so far keeps max -inf; subtract 0 then so exp2 gives 0, not NaN.
    const float shift = tile_max == -INFINITY ? 0.f : tile_max;
    const float rescale = exp2f(row_max[r] - shift);
    row_max[r] = tile_max;
    float sum = 0.f;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        s[nb][e] = exp2f(s[nb][e] - shift);
        sum += s[nb][e];
      }
    }
    row_sum[r] = row_sum[r] * rescale + sum;
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) {
      o[nd][2 * r] *= rescale;
      o[nd][2 * r + 1] *= rescale;
    }
  }
}

// Normalizes a warp's 16 x D output accumulator (C layout, first row `row0` of head (b, h)) and
// writes O and the LSE of its rows below len_q, once.
template <typename T, int D>
__device__ __forceinline__ void write_output(const AttentionFwdParams& p, int b, int h, int row0,
                                             const float (&o_acc)[D / 8][4], const float (&row_max)[2],
                                             const float (&row_sum)[2], int lane) {
  T* out = static_cast<T*>(p.out) + b * p.out_stride.batch + h * p.out_stride.head;
  float* lse = p.lse + (static_cast<int64_t>(b) * p.heads_q + h) * p.len_q;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row0 + lane / 4 + 8 * r;
    if (row >= p.len_q) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    T* out_row = out + row * p.out_stride.seq + 2 * (lane % 4);
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd)
      *reinterpret_cast<uint32_t*>(out_row + 8 * nd) = pack2<T>(o_acc[nd][2 * r] * inv, o_acc[nd][2 * r + 1] * inv);
    // A row without any visible key gets lse = +inf, so that the backward's P = exp(s - lse) = 0.
    if (lane % 4 == 0) lse[row] = sum > 0.f ? (row_max[r] + log2f(sum)) * kLn2 : INFINITY;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_fwd_kernel(const AttentionFwdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int pitch = smem_pitch<D>();
  T* q_smem = reinterpret_cast<T*>(smem_raw);
  T* k_smem = q_smem + kBlockM * pitch;       // 2 buffers
  T* v_smem = k_smem + 2 * kBlockN * pitch;  // 2 buffers

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int m_tiles = (p.len_q + kBlockM - 1) / kBlockM;
  const TileIndex tile = tile_index(m_tiles, p.causal);
  const int b = tile.bh / p.heads_q, h = tile.bh % p.heads_q;
  const int h_kv = h / (p.heads_q / p.heads_kv);
  const int m0 = tile.m_tile * kBlockM;

  const T* q = head_ptr<T>(p.q, p.q_stride, b, h) + m0 * p.q_stride.seq;
  const T* k = head_ptr<T>(p.k, p.k_stride, b, h_kv);
  const T* v = head_ptr<T>(p.v, p.v_stride, b, h_kv);
  const int n_tiles = key_tiles(m0, kBlockM, p.len_k, p.causal);


  copy_tile_async<kBlockM, D, kThreads>(q_smem, pitch, q, p.q_stride.seq, p.len_q - m0, tid);
  load_kv_tile<D>(k_smem, v_smem, k, v, p.k_stride.seq, p.v_stride.seq, p.len_k, 0, tid);
  cp_async_commit();

  const float scale_log2 = p.scale * kLog2e;
  uint32_t q_frag[D / 16][4];
  float o_acc[D / 8][4];
  zero(o_acc);
  // Running max (in log2 units, scaled) and this thread's partial row sum for rows g and g + 8.
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const int warp_row0 = m0 + 16 * warp;

  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // tile j visible to all; every warp is done with buffer (j + 1) % 2
    if (j + 1 < n_tiles) load_kv_tile<D>(k_smem, v_smem, k, v, p.k_stride.seq, p.v_stride.seq, p.len_k, j + 1, tid);
    cp_async_commit();
    if (j == 0) load_a_fragments<D>(q_frag, q_smem + 16 * warp * pitch, pitch, lane);

    const int n0 = j * kBlockN, buffer = j % 2;
    float s[kBlockN / 8][4];
    zero(s);
    gemm_abt<kBlockN, D>(s, q_frag, k_smem + buffer * kBlockN * pitch, pitch, lane);
    scale_scores(s, scale_log2);
    if (tile_needs_mask(warp_row0, n0, p.len_k, p.causal)) mask_scores(s, warp_row0, n0, p.len_k, p.causal, lane);

    online_softmax_step(s, o_acc, row_max, row_sum);

    uint32_t p_frag[kBlockN / 16][4];
    c_to_a_fragments<kBlockN, T>(p_frag, s);
    gemm_ab<D, kBlockN>(o_acc, p_frag, v_smem + buffer * kBlockN * pitch, pitch, lane);
  }

  write_output<T, D>(p, b, h, warp_row0, o_acc, row_max, row_sum, lane);
}

template <typename T, int D>
cudaError_t launch_fwd(const AttentionFwdParams& p, cudaStream_t stream) {
  return launch_with_shared_memory(attention_fwd_kernel<T, D>, query_tile_blocks<kBlockM>(p), kThreads,
                                   fwd_smem_bytes<T, D>(), p, stream);
}

}  // namespace attention
}  // namespace fusedops

// Defines the explicit specialization NAME<D> (declared in attention.h) of a head-dim launcher:
// maps the runtime dtype onto IMPL<T, D>. Each attention*_hdim<D>.cu expands it, so head dims
// and kernel families compile in parallel.
#define FUSEDOPS_ATTENTION_LAUNCHER(NAME, PARAMS, IMPL, D)                                 \
  namespace fusedops {                                                                     \
  template <>                                                                              \
  cudaError_t NAME<D>(const PARAMS& p, DType dtype, cudaStream_t stream) {                 \
    if (dtype == DType::BFloat16) return IMPL<__nv_bfloat16, D>(p, stream);                \
    if (dtype == DType::Float16) return IMPL<__half, D>(p, stream);                        \
    return cudaErrorInvalidValue;                                                          \
  }                                                                                        \
  }  // namespace fusedops
