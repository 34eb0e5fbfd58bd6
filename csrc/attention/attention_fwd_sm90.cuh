// Hopper forward kernel on warpgroup MMA (wgmma.mma_async, sm_90a), head dims 64 and 128.
//
// One block of two warpgroups owns a 128-row query tile, 64 rows per warpgroup. Q is copied once
// into shared memory; K and V stream through shared memory in 128-row tiles, double-buffered with
// cp.async, all in the 128-byte-swizzled layout wgmma descriptors describe (wgmma.cuh). Per key
// tile each warpgroup computes S = Q K^T (64 x 128, fp32, both operands in shared memory), runs
// the online softmax of attention_fwd.cuh on its accumulator fragments (they are mma.sync C
// fragments per warp), converts P to 16-bit A fragments in registers and accumulates
// O += P V with V as the MN-major shared-memory operand. Causal tiles past the diagonal are never
// loaded. O and the fp32 LSE are written exactly as the mma.sync kernel writes them, so the
// backward is shared.
//
// Compiled as a stub for every architecture but sm_90a; the host launches it only on sm_90 devices
// when the build holds an sm_90a cubin.
#pragma once
#include "attention_fwd.cuh"
#include "wgmma.cuh"

namespace fusedops {
namespace attention {
namespace sm90 {

constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kBlockM = 64 * kWarpgroups;  // query rows per block

// Key rows per tile, and blocks per SM the kernel is built for. head_dim 128: 128-key tiles, one
// block (205 registers a thread). head_dim 64: 64-key tiles keep S at 32 registers so that two
// blocks fit an SM (at most 128 registers a thread, 2 x 49 KiB of shared memory) and one block's
// softmax overlaps the other's wgmma.
template <int D>
constexpr int block_n() {
  return D == 64 ? 64 : 128;
}
template <int D>
constexpr int blocks_per_sm() {
  return D == 64 ? 2 : 1;
}

template <typename T, int D>
constexpr size_t fwd_smem_bytes() {
  // Q + 2 x (K, V), plus slack to align the tiles to the 1024-byte swizzle atom.
  return sizeof(T) * D * (kBlockM + 4 * block_n<D>()) + kSwizzleAtomBytes;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, blocks_per_sm<D>()) attention_fwd_sm90_kernel(const AttentionFwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D % kBlockColumns == 0, "head_dim must be a multiple of 64");
  constexpr int kTileN = block_n<D>();  // key rows per tile
  extern __shared__ unsigned char smem_raw[];
  constexpr int q_bytes = kBlockM * D * sizeof(T), kv_bytes = kTileN * D * sizeof(T);
  // Shared-state-space addresses (32-bit): wgmma descriptors and cp.async take those.
  const uint32_t q_smem = (smem_address(smem_raw) + kSwizzleAtomBytes - 1) / kSwizzleAtomBytes * kSwizzleAtomBytes;
  const uint32_t k_smem = q_smem + q_bytes;       // 2 buffers
  const uint32_t v_smem = k_smem + 2 * kv_bytes;  // 2 buffers

  const int tid = threadIdx.x, lane = tid % 32, warpgroup = tid / 128, warp = (tid / 32) % 4;
  const int m_tiles = (p.len_q + kBlockM - 1) / kBlockM;
  const TileIndex tile = tile_index(m_tiles, p.causal);
  const int b = tile.bh / p.heads_q, h = tile.bh % p.heads_q;
  const int h_kv = h / (p.heads_q / p.heads_kv);
  const int m0 = tile.m_tile * kBlockM;

  const T* q = head_ptr<T>(p.q, p.q_stride, b, h) + m0 * p.q_stride.seq;
  const T* k = head_ptr<T>(p.k, p.k_stride, b, h_kv);
  const T* v = head_ptr<T>(p.v, p.v_stride, b, h_kv);
  // Key tiles of the block; with causal masking the first warpgroup may see none of the last one.
  const int n_tiles = key_tiles<kTileN>(m0, kBlockM, p.len_k, p.causal);

  auto load_kv_tile = [&](int j) {
    const int n0 = j * kTileN, buffer = j % 2;
    copy_tile_swizzled<kTileN, D, kThreads>(k_smem + buffer * kv_bytes, k + n0 * p.k_stride.seq, p.k_stride.seq,
                                             p.len_k - n0, tid);
    copy_tile_swizzled<kTileN, D, kThreads>(v_smem + buffer * kv_bytes, v + n0 * p.v_stride.seq, p.v_stride.seq,
                                             p.len_k - n0, tid);
  };
  copy_tile_swizzled<kBlockM, D, kThreads>(q_smem, q, p.q_stride.seq, p.len_q - m0, tid);
  load_kv_tile(0);
  cp_async_commit();

  const float scale_log2 = p.scale * kLog2e;
  float o_acc[D / 8][4];
  zero(o_acc);
  // Running max (in log2 units, scaled) and this thread's partial row sum for rows g and g + 8.
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const int warpgroup_row = 64 * warpgroup;
  const int warp_row0 = m0 + warpgroup_row + 16 * warp;
  const int warpgroup_last_row = m0 + warpgroup_row + 63;

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

    float s[kTileN / 8][4];
    wgmma_fence();
    wgmma_ss<T, kTileN, false>(s, k_major_descriptor<kBlockM>(q_smem, warpgroup_row, 0),
                                k_major_descriptor<kTileN>(k_tile, 0, 0));
#pragma unroll
    for (int kk = 1; kk < D / 16; ++kk)
      wgmma_ss<T, kTileN, true>(s, k_major_descriptor<kBlockM>(q_smem, warpgroup_row, kk),
                                 k_major_descriptor<kTileN>(k_tile, 0, kk));
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(s);

    scale_scores(s, scale_log2);
    if (tile_needs_mask<kTileN>(warp_row0, n0, p.len_k, p.causal))
      mask_scores(s, warp_row0, n0, p.len_k, p.causal, lane);
    online_softmax_step(s, o_acc, row_max, row_sum);
    uint32_t p_frag[kTileN / 16][4];
    c_to_a_fragments<kTileN, T>(p_frag, s);

    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTileN / 16; ++kk)
#pragma unroll
      for (int block = 0; block < D / kBlockColumns; ++block)
        wgmma_rs_n64<T>(reinterpret_cast<float(&)[8][4]>(o_acc[8 * block]), p_frag[kk],
                        mn_major_descriptor<kTileN>(v_tile, kk, block));
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(o_acc);
  }

  write_output<T, D>(p, b, h, warp_row0, o_acc, row_max, row_sum, lane);
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from a build without an sm_90a cubin for this device: fail loudly
#endif
}

template <typename T, int D>
cudaError_t launch_fwd_sm90(const AttentionFwdParams& p, cudaStream_t stream) {
  return launch_with_shared_memory(attention_fwd_sm90_kernel<T, D>, query_tile_blocks<kBlockM>(p), kThreads,
                                   fwd_smem_bytes<T, D>(), p, stream);
}

}  // namespace sm90
}  // namespace attention
}  // namespace fusedops
