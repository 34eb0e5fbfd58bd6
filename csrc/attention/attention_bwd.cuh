// FlashAttention-2-style backward, deterministic (no atomics), in three kernels:
//   1. delta = rowsum(dO * O), fp32, one warp per query row;
//   2. per 64-row key tile (block of 4 warps, 16 key rows each), iterating over query tiles:
//      P^T = exp(scale * K Q^T - lse) recomputed, dV += P^T dO, dP^T = V dO^T,
//      dS^T = P^T * (dP^T - delta), dK += scale * dS^T Q;
//   3. per 64-row query tile (16 query rows per warp), iterating over key tiles:
//      P and dS recomputed the same way, dQ += scale * dS K.
// Each output element is summed by one thread in a fixed order, so results are bitwise
// repeatable. Q/dO (kernel 2) and K/V (kernel 3) tiles are double-buffered with cp.async.
#pragma once
#include "../common/vec.cuh"
#include "attention_fwd.cuh"

namespace fusedops {
namespace attention {

// Query rows per iteration of the dK/dV kernel: 32 at head_dim 128 keeps the dK and dV
// accumulators (2 x 64 fp32 registers per thread) and the P^T/dP^T tiles within 255 registers.
template <int D>
constexpr int bwd_block_q() {
  return D > 64 ? 32 : 64;
}

template <typename T, int D>
constexpr size_t bwd_dkdv_smem_bytes() {
  return sizeof(T) * smem_pitch<D>() * (2 * kBlockN + 4 * bwd_block_q<D>()) + sizeof(float) * 4 * bwd_block_q<D>();
}

template <typename T, int D>
constexpr size_t bwd_dq_smem_bytes() {
  return sizeof(T) * smem_pitch<D>() * (2 * kBlockM + 4 * kBlockN);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_bwd_delta_kernel(const AttentionBwdParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= static_cast<int64_t>(p.batch) * p.heads_q * p.len_q) return;
  const int i = row % p.len_q, bh = row / p.len_q, b = bh / p.heads_q, h = bh % p.heads_q;
  const T* dout = head_ptr<T>(p.dout, p.dout_stride, b, h) + i * p.dout_stride.seq;
  const T* out = head_ptr<T>(p.out, p.out_stride, b, h) + i * p.out_stride.seq;
  float sum = 0.f;
#pragma unroll
  for (int d = lane; d < D; d += 32) sum += to_acc(dout[d]) * to_acc(out[d]);
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, mask);
  if (lane == 0) p.delta[row] = sum;
}

// Writes a 16 x D fp32 accumulator (C layout, first row `row0`) times `factor` to rows < rows,
// as OutT (T or float for the GQA partial sums).
template <typename OutT, typename T, int D>
__device__ __forceinline__ void store_rows(const float (&acc)[D / 8][4], float factor, OutT* base, int64_t row_stride,
                                           int row0, int rows, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + lane / 4 + 8 * r;
    if (row >= rows) continue;
    OutT* dst = base + row * row_stride + 2 * (lane % 4);
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      const float x = acc[nd][2 * r] * factor, y = acc[nd][2 * r + 1] * factor;
      if constexpr (sizeof(OutT) == 4) {
        *reinterpret_cast<float2*>(dst + 8 * nd) = make_float2(x, y);
      } else {
        *reinterpret_cast<uint32_t*>(dst + 8 * nd) = pack2<T>(x, y);
      }
    }
  }
}

// Kernel 2. blockIdx.x = (batch * heads_q index) * key_tiles + key tile. dk/dv hold one slice
// per query head, of OutT (fp32 when they are GQA partial sums, see AttentionBwdParams).
template <typename T, typename OutT, int D>
__global__ void __launch_bounds__(kThreads) attention_bwd_dkdv_kernel(const AttentionBwdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kBlockQ = bwd_block_q<D>();
  constexpr int pitch = smem_pitch<D>();
  T* k_smem = reinterpret_cast<T*>(smem_raw);
  T* v_smem = k_smem + kBlockN * pitch;
  T* q_smem = v_smem + kBlockN * pitch;     // 2 buffers
  T* do_smem = q_smem + 2 * kBlockQ * pitch;  // 2 buffers
  float* lse_smem = reinterpret_cast<float*>(do_smem + 2 * kBlockQ * pitch);  // 2 buffers, log2 units
  float* delta_smem = lse_smem + 2 * kBlockQ;                                 // 2 buffers

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n_tiles = (p.len_k + kBlockN - 1) / kBlockN;
  const int bh = blockIdx.x / n_tiles, n0 = (blockIdx.x % n_tiles) * kBlockN;
  const int b = bh / p.heads_q, h = bh % p.heads_q;
  const int h_kv = h / (p.heads_q / p.heads_kv);

  const T* q = head_ptr<T>(p.q, p.q_stride, b, h);
  const T* dout = head_ptr<T>(p.dout, p.dout_stride, b, h);
  const float* lse = p.lse + static_cast<int64_t>(bh) * p.len_q;
  const float* delta = p.delta + static_cast<int64_t>(bh) * p.len_q;
  // Causal: query i sees key j iff j <= i, so queries before n0 see nothing of this tile.
  const int first_m_tile = p.causal ? n0 / kBlockQ : 0;
  const int m_tiles = (p.len_q + kBlockQ - 1) / kBlockQ;

  auto load_q_do = [&](int i) {
    const int m0 = i * kBlockQ, buffer = i % 2;
    copy_tile_async<kBlockQ, D, kThreads>(q_smem + buffer * kBlockQ * pitch, pitch, q + m0 * p.q_stride.seq,
                                          p.q_stride.seq, p.len_q - m0, tid);
    copy_tile_async<kBlockQ, D, kThreads>(do_smem + buffer * kBlockQ * pitch, pitch,
                                          dout + m0 * p.dout_stride.seq, p.dout_stride.seq, p.len_q - m0, tid);
    // Rows past len_q get lse = +inf, so their P is exactly 0.
    for (int r = tid; r < kBlockQ; r += kThreads) {
      const bool valid = m0 + r < p.len_q;
      lse_smem[buffer * kBlockQ + r] = valid ? lse[m0 + r] * kLog2e : INFINITY;
      delta_smem[buffer * kBlockQ + r] = valid ? delta[m0 + r] : 0.f;
    }
  };

  copy_tile_async<kBlockN, D, kThreads>(k_smem, pitch, head_ptr<T>(p.k, p.k_stride, b, h_kv) + n0 * p.k_stride.seq,
                                        p.k_stride.seq, p.len_k - n0, tid);
  copy_tile_async<kBlockN, D, kThreads>(v_smem, pitch, head_ptr<T>(p.v, p.v_stride, b, h_kv) + n0 * p.v_stride.seq,
                                        p.v_stride.seq, p.len_k - n0, tid);
  if (first_m_tile < m_tiles) load_q_do(first_m_tile);
  cp_async_commit();

  const float scale_log2 = p.scale * kLog2e;
  const int key0 = n0 + 16 * warp;  // first key row of this warp
  const T* k_warp = k_smem + 16 * warp * pitch;
  const T* v_warp = v_smem + 16 * warp * pitch;
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
  zero(dk_acc);
  zero(dv_acc);

  for (int i = first_m_tile; i < m_tiles; ++i) {
    cp_async_wait<0>();
    __syncthreads();  // tile i visible; every warp is done with buffer (i + 1) % 2
    if (i + 1 < m_tiles) load_q_do(i + 1);
    cp_async_commit();

    const int m0 = i * kBlockQ, buffer = i % 2;
    const T* q_tile = q_smem + buffer * kBlockQ * pitch;
    const T* do_tile = do_smem + buffer * kBlockQ * pitch;
    const float* lse_tile = lse_smem + buffer * kBlockQ;
    const float* delta_tile = delta_smem + buffer * kBlockQ;

    // P^T: rows = this warp's 16 keys, columns = the tile's kBlockQ queries.
    float pt[kBlockQ / 8][4];
    zero(pt);
    gemm_abt_smem_a<kBlockQ, D>(pt, k_warp, pitch, q_tile, pitch, lane);
    const bool mask = p.causal && m0 < key0 + 15;
#pragma unroll
    for (int nb = 0; nb < kBlockQ / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * nb + 2 * (lane % 4) + e % 2;
        const int key = key0 + lane / 4 + 8 * (e / 2);
        const float prob = exp2f(fmaf(pt[nb][e], scale_log2, -lse_tile[col]));
        pt[nb][e] = mask && m0 + col < key ? 0.f : prob;
      }
    }
    uint32_t a_frag[kBlockQ / 16][4];
    c_to_a_fragments<kBlockQ, T>(a_frag, pt);
    gemm_ab<D, kBlockQ>(dv_acc, a_frag, do_tile, pitch, lane);

    float dpt[kBlockQ / 8][4];
    zero(dpt);
    gemm_abt_smem_a<kBlockQ, D>(dpt, v_warp, pitch, do_tile, pitch, lane);
#pragma unroll
    for (int nb = 0; nb < kBlockQ / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * nb + 2 * (lane % 4) + e % 2;
        dpt[nb][e] = pt[nb][e] * (dpt[nb][e] - delta_tile[col]);
      }
    }
    c_to_a_fragments<kBlockQ, T>(a_frag, dpt);
    gemm_ab<D, kBlockQ>(dk_acc, a_frag, q_tile, pitch, lane);
  }
  cp_async_wait<0>();  // a block with no query tile still has its K/V copies in flight

  OutT* dk = static_cast<OutT*>(p.dk) + (b * p.dk_stride.batch + h * p.dk_stride.head);
  OutT* dv = static_cast<OutT*>(p.dv) + (b * p.dv_stride.batch + h * p.dv_stride.head);
  store_rows<OutT, T, D>(dk_acc, p.scale, dk, p.dk_stride.seq, key0, p.len_k, lane);
  store_rows<OutT, T, D>(dv_acc, 1.f, dv, p.dv_stride.seq, key0, p.len_k, lane);
}

// Kernel 3. Block indexing as in the forward.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_bwd_dq_kernel(const AttentionBwdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int pitch = smem_pitch<D>();
  T* q_smem = reinterpret_cast<T*>(smem_raw);
  T* do_smem = q_smem + kBlockM * pitch;
  T* k_smem = do_smem + kBlockM * pitch;     // 2 buffers
  T* v_smem = k_smem + 2 * kBlockN * pitch;  // 2 buffers

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int m_tiles = (p.len_q + kBlockM - 1) / kBlockM;
  const TileIndex tile = tile_index(m_tiles, p.causal);
  const int b = tile.bh / p.heads_q, h = tile.bh % p.heads_q;
  const int h_kv = h / (p.heads_q / p.heads_kv);
  const int m0 = tile.m_tile * kBlockM;

  const T* k = head_ptr<T>(p.k, p.k_stride, b, h_kv);
  const T* v = head_ptr<T>(p.v, p.v_stride, b, h_kv);
  const int n_tiles = key_tiles(m0, kBlockM, p.len_k, p.causal);


  copy_tile_async<kBlockM, D, kThreads>(q_smem, pitch, head_ptr<T>(p.q, p.q_stride, b, h) + m0 * p.q_stride.seq,
                                        p.q_stride.seq, p.len_q - m0, tid);
  copy_tile_async<kBlockM, D, kThreads>(do_smem, pitch,
                                        head_ptr<T>(p.dout, p.dout_stride, b, h) + m0 * p.dout_stride.seq,
                                        p.dout_stride.seq, p.len_q - m0, tid);
  load_kv_tile<D>(k_smem, v_smem, k, v, p.k_stride.seq, p.v_stride.seq, p.len_k, 0, tid);
  cp_async_commit();

  const float scale_log2 = p.scale * kLog2e;
  const int warp_row0 = m0 + 16 * warp;
  float row_lse[2], row_delta[2];
  const int64_t stats = static_cast<int64_t>(tile.bh) * p.len_q;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp_row0 + lane / 4 + 8 * r;
    row_lse[r] = row < p.len_q ? p.lse[stats + row] * kLog2e : INFINITY;
    row_delta[r] = row < p.len_q ? p.delta[stats + row] : 0.f;
  }
  const T* q_warp = q_smem + 16 * warp * pitch;
  const T* do_warp = do_smem + 16 * warp * pitch;
  float dq_acc[D / 8][4];
  zero(dq_acc);

  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<0>();
    __syncthreads();
    if (j + 1 < n_tiles) load_kv_tile<D>(k_smem, v_smem, k, v, p.k_stride.seq, p.v_stride.seq, p.len_k, j + 1, tid);
    cp_async_commit();

    const int n0 = j * kBlockN, buffer = j % 2;
    const T* k_tile = k_smem + buffer * kBlockN * pitch;
    float s[kBlockN / 8][4];
    zero(s);
    gemm_abt_smem_a<kBlockN, D>(s, q_warp, pitch, k_tile, pitch, lane);
    scale_scores(s, scale_log2);
    // Masked scores become -inf, hence P = 0 (tail keys are zero-filled, not -inf, otherwise).
    if (tile_needs_mask(warp_row0, n0, p.len_k, p.causal)) mask_scores(s, warp_row0, n0, p.len_k, p.causal, lane);
#pragma unroll
    for (int nb = 0; nb < kBlockN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nb][e] = exp2f(s[nb][e] - row_lse[e / 2]);

    float dp[kBlockN / 8][4];
    zero(dp);
    gemm_abt_smem_a<kBlockN, D>(dp, do_warp, pitch, v_smem + buffer * kBlockN * pitch, pitch, lane);
#pragma unroll
    for (int nb = 0; nb < kBlockN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[nb][e] = s[nb][e] * (dp[nb][e] - row_delta[e / 2]);
    uint32_t ds_frag[kBlockN / 16][4];
    c_to_a_fragments<kBlockN, T>(ds_frag, dp);
    gemm_ab<D, kBlockN>(dq_acc, ds_frag, k_tile, pitch, lane);
  }

  T* dq = static_cast<T*>(p.dq) + (b * p.dq_stride.batch + h * p.dq_stride.head);
  store_rows<T, T, D>(dq_acc, p.scale, dq, p.dq_stride.seq, warp_row0, p.len_q, lane);
}

// The three backward launches, shared by the mma.sync and the wgmma backwards: delta =
// rowsum(dO o O), then dK/dV with one block per `block_n` keys of a head, then dQ with one
// block per `block_m` query rows. Every grid is checked before the first launch.
template <int block_m, int block_n, typename T, int D>
cudaError_t launch_bwd_kernels(const AttentionBwdParams& p, void (*dkdv)(AttentionBwdParams), size_t dkdv_smem,
                               void (*dq)(AttentionBwdParams), size_t dq_smem, int threads, cudaStream_t stream) {
  const int64_t bh = static_cast<int64_t>(p.batch) * p.heads_q;
  const int64_t rows = bh * p.len_q;
  if (rows == 0 || p.len_k == 0) return cudaSuccess;
  const int64_t m_blocks = bh * ((p.len_q + block_m - 1) / block_m);
  const int64_t n_blocks = bh * ((p.len_k + block_n - 1) / block_n);
  const int64_t delta_blocks = (rows + kWarps - 1) / kWarps;
  if (m_blocks > INT32_MAX || n_blocks > INT32_MAX || delta_blocks > INT32_MAX) return cudaErrorInvalidConfiguration;

  attention_bwd_delta_kernel<T, D><<<static_cast<unsigned>(delta_blocks), kThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = launch_with_shared_memory(dkdv, n_blocks, threads, dkdv_smem, p, stream);
  if (err != cudaSuccess) return err;
  return launch_with_shared_memory(dq, m_blocks, threads, dq_smem, p, stream);
}

template <typename T, int D>
cudaError_t launch_bwd(const AttentionBwdParams& p, cudaStream_t stream) {
  auto dkdv = p.dkdv_fp32 ? attention_bwd_dkdv_kernel<T, float, D> : attention_bwd_dkdv_kernel<T, T, D>;
  return launch_bwd_kernels<kBlockM, kBlockN, T, D>(p, dkdv, bwd_dkdv_smem_bytes<T, D>(), attention_bwd_dq_kernel<T, D>,
                                                    bwd_dq_smem_bytes<T, D>(), kThreads, stream);
}

}  // namespace attention
}  // namespace fusedops
