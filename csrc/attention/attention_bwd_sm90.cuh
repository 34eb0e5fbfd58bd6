// Hopper backward on warpgroup MMA (wgmma.mma_async, sm_90a), head dims 64 and 128. The same
// deterministic three-kernel scheme as the mma.sync backward (attention_bwd.cuh), whose delta
// kernel it reuses:
//   1. delta = rowsum(dO * O);
//   2. dK/dV: one block of two warpgroups per 128-key tile, 64 keys per warpgroup; K and V stay in
//      shared memory, Q and dO tiles (128 rows at head_dim 64, 64 at 128) stream through
//      double-buffered shared memory. Per query tile a warpgroup computes S^T = K Q^T and
//      dP^T = V dO^T (both operands in shared memory, K-major), P^T = exp(scale S^T - lse),
//      dS^T = P^T (dP^T - delta) on its accumulator fragments, and dV += P^T dO, dK += dS^T Q
//      with P^T / dS^T as register A operands and dO / Q as MN-major shared-memory B operands;
//   3. dQ: one block per 128-row query tile (64 rows per warpgroup), Q and dO resident, K and V
//      streamed in the forward's key tiles (128 keys at head_dim 128, 64 at 64):
//      S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K.
// Every operand shape is one the forward (attention_fwd_sm90.cuh) already uses: SS wgmma with
// K-major tiles for the score-like products, RS wgmma with an MN-major tile for the rest, so no
// operand is transposed in shared memory. Each output element is accumulated by one thread in a
// fixed order, with no atomics: results are bitwise repeatable.
//
// Why dQ stays a separate kernel: accumulating dQ inside the dK/dV kernel needs either fp32
// atomics (not deterministic), or per-key-tile fp32 partials (Lk / 128 copies of dQ: 4 GiB at
// B4 H16 S4096 D128), or ordered semaphores between blocks. Recomputing S and dP costs two more
// matmuls per tile (7 instead of 5), which the simpler, proven dataflow pays for.
#pragma once
#include "attention_bwd.cuh"
#include "attention_fwd_sm90.cuh"

namespace fusedops {
namespace attention {
namespace sm90 {

constexpr int kBwdKeys = 64 * kWarpgroups;  // key rows per dK/dV block
// Query rows per streamed Q/dO tile of the dK/dV kernel: 128 at head_dim 64 (S^T and dP^T as
// n128 wgmmas: fewer shared-memory operand bytes per FLOP and half the barriers; 254 registers a
// thread), 64 at head_dim 128, where the dK and dV accumulators take 128 registers a thread (255).
template <int D>
constexpr int dkdv_block_q() {
  return D == 64 ? 128 : 64;
}
// The dQ kernel streams K/V in the forward's tiles, block_n<D>() keys, and fits as many blocks per
// SM, blocks_per_sm<D>(): head_dim 128 holds S, dP (128 keys) and dQ in 241 registers a thread,
// head_dim 64 S, dP (64 keys) and dQ in 128, so two blocks fit an SM.

template <typename T, int D>
constexpr size_t bwd_dkdv_smem_bytes() {
  // K, V + 2 x (Q, dO) tiles, 2 x (lse, delta) rows, slack to align the tiles to the swizzle atom.
  return sizeof(T) * D * (2 * kBwdKeys + 4 * dkdv_block_q<D>()) + sizeof(float) * 4 * dkdv_block_q<D>() +
         kSwizzleAtomBytes;
}

template <typename T, int D>
constexpr size_t bwd_dq_smem_bytes() {
  return sizeof(T) * D * (2 * kBlockM + 4 * block_n<D>()) + kSwizzleAtomBytes;  // Q, dO + 2 x (K, V)
}

__device__ __forceinline__ uint32_t aligned_smem_base(const unsigned char* smem_raw) {
  return (smem_address(smem_raw) + kSwizzleAtomBytes - 1) / kSwizzleAtomBytes * kSwizzleAtomBytes;
}

// acc (64 x N per warpgroup) = A B^T over the D reduction columns, A rows `a_row0`.. of the
// SW128 tile `a` (a_rows rows), B the N rows of the SW128 tile `b`; issued, not waited for.
template <typename T, int N, int a_rows, int D>
__device__ __forceinline__ void issue_abt(float (&acc)[N / 8][4], uint32_t a, int a_row0, uint32_t b) {
  wgmma_ss<T, N, false>(acc, k_major_descriptor<a_rows>(a, a_row0, 0), k_major_descriptor<N>(b, 0, 0));
#pragma unroll
  for (int kk = 1; kk < D / 16; ++kk)
    wgmma_ss<T, N, true>(acc, k_major_descriptor<a_rows>(a, a_row0, kk), k_major_descriptor<N>(b, 0, kk));
  wgmma_commit();
}

// acc (64 x D per warpgroup) += A B, A (64 x K) the register fragments `a`, B the K x D SW128
// tile `b` read MN-major; issued, not waited for.
template <typename T, int K, int D>
__device__ __forceinline__ void issue_ab(float (&acc)[D / 8][4], const uint32_t (&a)[K / 16][4], uint32_t b) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
    for (int block = 0; block < D / kBlockColumns; ++block)
      wgmma_rs_n64<T>(reinterpret_cast<float(&)[8][4]>(acc[8 * block]), a[kk], mn_major_descriptor<K>(b, kk, block));
  wgmma_commit();
}

// Kernel 2. blockIdx.x = (batch * heads_q index) * key_tiles + key tile (the causal tiles with the
// most query tiles first). dk/dv hold one slice per query head, of OutT (fp32 for GQA partials).
template <typename T, typename OutT, int D>
__global__ void __launch_bounds__(kThreads, 1) attention_bwd_dkdv_sm90_kernel(const AttentionBwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D % kBlockColumns == 0, "head_dim must be a multiple of 64");
  constexpr int kQ = dkdv_block_q<D>();
  extern __shared__ unsigned char smem_raw[];
  constexpr int kv_bytes = kBwdKeys * D * sizeof(T), q_bytes = kQ * D * sizeof(T);
  const uint32_t k_smem = aligned_smem_base(smem_raw);
  const uint32_t v_smem = k_smem + kv_bytes;
  const uint32_t q_smem = v_smem + kv_bytes;      // 2 buffers
  const uint32_t do_smem = q_smem + 2 * q_bytes;  // 2 buffers
  float* lse_smem = reinterpret_cast<float*>(smem_raw + (do_smem + 2 * q_bytes - smem_address(smem_raw)));
  float* delta_smem = lse_smem + 2 * kQ;  // 2 buffers each

  const int tid = threadIdx.x, lane = tid % 32, warpgroup = tid / 128, warp = (tid / 32) % 4;
  const int n_tiles = (p.len_k + kBwdKeys - 1) / kBwdKeys;
  const int bh = blockIdx.x / n_tiles, n0 = (blockIdx.x % n_tiles) * kBwdKeys;
  const int b = bh / p.heads_q, h = bh % p.heads_q;
  const int h_kv = h / (p.heads_q / p.heads_kv);

  const T* q = head_ptr<T>(p.q, p.q_stride, b, h);
  const T* dout = head_ptr<T>(p.dout, p.dout_stride, b, h);
  const float* lse = p.lse + static_cast<int64_t>(bh) * p.len_q;
  const float* delta = p.delta + static_cast<int64_t>(bh) * p.len_q;
  // Causal: query i sees key j iff j <= i, so queries before n0 see nothing of this block.
  const int first_m_tile = p.causal ? n0 / kQ : 0;
  const int m_tiles = (p.len_q + kQ - 1) / kQ;

  auto load_q_do = [&](int i) {
    const int m0 = i * kQ, buffer = i % 2;
    copy_tile_swizzled<kQ, D, kThreads>(q_smem + buffer * q_bytes, q + m0 * p.q_stride.seq, p.q_stride.seq,
                                        p.len_q - m0, tid);
    copy_tile_swizzled<kQ, D, kThreads>(do_smem + buffer * q_bytes, dout + m0 * p.dout_stride.seq,
                                        p.dout_stride.seq, p.len_q - m0, tid);
    // lse and delta by cp.async too, so no thread waits on a global load here. Rows past len_q are
    // zero-filled like their Q and dO rows: their P^T column is exp2(0) = 1 but their dO row and
    // dS^T column (dP^T = V 0 = 0, delta = 0) are 0, so they add nothing to dV or dK.
    static_assert(2 * kQ <= kThreads, "one thread per lse or delta value");
    if (tid < 2 * kQ) {
      const int r = tid % kQ;
      const bool valid = m0 + r < p.len_q;
      const float* src = tid < kQ ? lse : delta;
      float* dst = tid < kQ ? lse_smem : delta_smem;
      cp_async_4(dst + buffer * kQ + r, src + (valid ? m0 + r : 0), valid);
    }
  };

  copy_tile_swizzled<kBwdKeys, D, kThreads>(k_smem, head_ptr<T>(p.k, p.k_stride, b, h_kv) + n0 * p.k_stride.seq,
                                            p.k_stride.seq, p.len_k - n0, tid);
  copy_tile_swizzled<kBwdKeys, D, kThreads>(v_smem, head_ptr<T>(p.v, p.v_stride, b, h_kv) + n0 * p.v_stride.seq,
                                            p.v_stride.seq, p.len_k - n0, tid);
  if (first_m_tile < m_tiles) load_q_do(first_m_tile);
  cp_async_commit();

  const float scale_log2 = p.scale * kLog2e;
  const int warpgroup_key0 = n0 + 64 * warpgroup;
  const int warp_key0 = warpgroup_key0 + 16 * warp;
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
  zero(dk_acc);
  zero(dv_acc);

  for (int i = first_m_tile; i < m_tiles; ++i) {
    cp_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();  // tile i visible to every wgmma; both warpgroups are done with buffer (i + 1) % 2
    if (i + 1 < m_tiles) load_q_do(i + 1);
    cp_async_commit();

    const int m0 = i * kQ, buffer = i % 2;
    if (p.causal && m0 + kQ - 1 < warpgroup_key0) continue;  // every query precedes this warpgroup's keys
    const uint32_t q_tile = q_smem + buffer * q_bytes, do_tile = do_smem + buffer * q_bytes;
    const float* lse_tile = lse_smem + buffer * kQ;
    const float* delta_tile = delta_smem + buffer * kQ;

    // Rows: this warpgroup's 64 keys; columns: the tile's kQ queries.
    float pt[kQ / 8][4], dpt[kQ / 8][4];
    wgmma_fence();
    issue_abt<T, kQ, kBwdKeys, D>(pt, k_smem, 64 * warpgroup, q_tile);
    issue_abt<T, kQ, kBwdKeys, D>(dpt, v_smem, 64 * warpgroup, do_tile);
    wgmma_wait<1>();  // S^T done, dP^T may still run
    fence_registers(pt);

    const bool mask = p.causal && m0 < warp_key0 + 15;
#pragma unroll
    for (int nb = 0; nb < kQ / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * nb + 2 * (lane % 4) + e % 2;
        const int key = warp_key0 + lane / 4 + 8 * (e / 2);
        const float prob = exp2f(fmaf(pt[nb][e], scale_log2, -lse_tile[col] * kLog2e));
        pt[nb][e] = mask && m0 + col < key ? 0.f : prob;
      }
    }
    uint32_t p_frag[kQ / 16][4];
    c_to_a_fragments<kQ, T>(p_frag, pt);
    wgmma_fence();
    issue_ab<T, kQ, D>(dv_acc, p_frag, do_tile);
    wgmma_wait<1>();  // dP^T done, dV may still run
    fence_registers(dpt);

#pragma unroll
    for (int nb = 0; nb < kQ / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * nb + 2 * (lane % 4) + e % 2;
        dpt[nb][e] = pt[nb][e] * (dpt[nb][e] - delta_tile[col]);
      }
    }
    uint32_t ds_frag[kQ / 16][4];
    c_to_a_fragments<kQ, T>(ds_frag, dpt);
    wgmma_fence();
    issue_ab<T, kQ, D>(dk_acc, ds_frag, q_tile);
    wgmma_wait<0>();
    fence_registers(dv_acc);
    fence_registers(dk_acc);
  }
  cp_async_wait<0>();  // a block with no query tile still has its K/V copies in flight

  OutT* dk = static_cast<OutT*>(p.dk) + (b * p.dk_stride.batch + h * p.dk_stride.head);
  OutT* dv = static_cast<OutT*>(p.dv) + (b * p.dv_stride.batch + h * p.dv_stride.head);
  store_rows<OutT, T, D>(dk_acc, p.scale, dk, p.dk_stride.seq, warp_key0, p.len_k, lane);
  store_rows<OutT, T, D>(dv_acc, 1.f, dv, p.dv_stride.seq, warp_key0, p.len_k, lane);
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from a build without an sm_90a cubin for this device: fail loudly
#endif
}

// Kernel 3. Block indexing as in the forward (128-row query tiles).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, blocks_per_sm<D>()) attention_bwd_dq_sm90_kernel(
    const AttentionBwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D % kBlockColumns == 0, "head_dim must be a multiple of 64");
  constexpr int kTileN = block_n<D>();  // key rows per tile
  extern __shared__ unsigned char smem_raw[];
  constexpr int q_bytes = kBlockM * D * sizeof(T), kv_bytes = kTileN * D * sizeof(T);
  const uint32_t q_smem = aligned_smem_base(smem_raw);
  const uint32_t do_smem = q_smem + q_bytes;
  const uint32_t k_smem = do_smem + q_bytes;      // 2 buffers
  const uint32_t v_smem = k_smem + 2 * kv_bytes;  // 2 buffers

  const int tid = threadIdx.x, lane = tid % 32, warpgroup = tid / 128, warp = (tid / 32) % 4;
  const int m_tiles = (p.len_q + kBlockM - 1) / kBlockM;
  const TileIndex tile = tile_index(m_tiles, p.causal);
  const int b = tile.bh / p.heads_q, h = tile.bh % p.heads_q;
  const int h_kv = h / (p.heads_q / p.heads_kv);
  const int m0 = tile.m_tile * kBlockM;

  const T* k = head_ptr<T>(p.k, p.k_stride, b, h_kv);
  const T* v = head_ptr<T>(p.v, p.v_stride, b, h_kv);
  const int n_tiles = key_tiles<kTileN>(m0, kBlockM, p.len_k, p.causal);

  auto load_kv_tile = [&](int j) {
    const int n0 = j * kTileN, buffer = j % 2;
    copy_tile_swizzled<kTileN, D, kThreads>(k_smem + buffer * kv_bytes, k + n0 * p.k_stride.seq, p.k_stride.seq,
                                             p.len_k - n0, tid);
    copy_tile_swizzled<kTileN, D, kThreads>(v_smem + buffer * kv_bytes, v + n0 * p.v_stride.seq, p.v_stride.seq,
                                             p.len_k - n0, tid);
  };
  copy_tile_swizzled<kBlockM, D, kThreads>(q_smem, head_ptr<T>(p.q, p.q_stride, b, h) + m0 * p.q_stride.seq,
                                           p.q_stride.seq, p.len_q - m0, tid);
  copy_tile_swizzled<kBlockM, D, kThreads>(do_smem,
                                           head_ptr<T>(p.dout, p.dout_stride, b, h) + m0 * p.dout_stride.seq,
                                           p.dout_stride.seq, p.len_q - m0, tid);
  load_kv_tile(0);
  cp_async_commit();

  const float scale_log2 = p.scale * kLog2e;
  const int warpgroup_row = 64 * warpgroup;
  const int warp_row0 = m0 + warpgroup_row + 16 * warp;
  const int warpgroup_last_row = m0 + warpgroup_row + 63;
  float row_lse[2], row_delta[2];
  const int64_t stats = static_cast<int64_t>(tile.bh) * p.len_q;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp_row0 + lane / 4 + 8 * r;
    row_lse[r] = row < p.len_q ? p.lse[stats + row] * kLog2e : INFINITY;
    row_delta[r] = row < p.len_q ? p.delta[stats + row] : 0.f;
  }
  float dq_acc[D / 8][4];
  zero(dq_acc);

  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();  // tile j visible to every wgmma; both warpgroups are done with buffer (j + 1) % 2
    if (j + 1 < n_tiles) load_kv_tile(j + 1);
    cp_async_commit();

    const int n0 = j * kTileN;
    if (p.causal && n0 > warpgroup_last_row) continue;  // every key of the tile is masked for these rows
    const uint32_t k_tile = k_smem + (j % 2) * kv_bytes;
    const uint32_t v_tile = v_smem + (j % 2) * kv_bytes;

    float s[kTileN / 8][4], dp[kTileN / 8][4];
    wgmma_fence();
    issue_abt<T, kTileN, kBlockM, D>(s, q_smem, warpgroup_row, k_tile);
    issue_abt<T, kTileN, kBlockM, D>(dp, do_smem, warpgroup_row, v_tile);
    wgmma_wait<1>();  // S done, dP may still run
    fence_registers(s);

    scale_scores(s, scale_log2);
    // Masked scores become -inf, hence P = 0 (tail keys are zero-filled, not -inf, otherwise).
    if (tile_needs_mask<kTileN>(warp_row0, n0, p.len_k, p.causal))
      mask_scores(s, warp_row0, n0, p.len_k, p.causal, lane);
#pragma unroll
    for (int nb = 0; nb < kTileN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nb][e] = exp2f(s[nb][e] - row_lse[e / 2]);
    wgmma_wait<0>();
    fence_registers(dp);

#pragma unroll
    for (int nb = 0; nb < kTileN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[nb][e] = s[nb][e] * (dp[nb][e] - row_delta[e / 2]);
    uint32_t ds_frag[kTileN / 16][4];
    c_to_a_fragments<kTileN, T>(ds_frag, dp);
    wgmma_fence();
    issue_ab<T, kTileN, D>(dq_acc, ds_frag, k_tile);
    wgmma_wait<0>();
    fence_registers(dq_acc);
  }

  T* dq = static_cast<T*>(p.dq) + (b * p.dq_stride.batch + h * p.dq_stride.head);
  store_rows<T, T, D>(dq_acc, p.scale, dq, p.dq_stride.seq, warp_row0, p.len_q, lane);
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from a build without an sm_90a cubin for this device: fail loudly
#endif
}

template <typename T, int D>
cudaError_t launch_bwd_sm90(const AttentionBwdParams& p, cudaStream_t stream) {
  auto dkdv = p.dkdv_fp32 ? attention_bwd_dkdv_sm90_kernel<T, float, D> : attention_bwd_dkdv_sm90_kernel<T, T, D>;
  return launch_bwd_kernels<kBlockM, kBwdKeys, T, D>(p, dkdv, bwd_dkdv_smem_bytes<T, D>(),
                                                     attention_bwd_dq_sm90_kernel<T, D>, bwd_dq_smem_bytes<T, D>(),
                                                     kThreads, stream);
}

}  // namespace sm90
}  // namespace attention
}  // namespace fusedops
