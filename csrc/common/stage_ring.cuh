// sm_90 building blocks of the staged softmax and norm rows: a ring of shared-memory stages
// filled by bulk copies (cp.async.bulk), each completing on its stage's mbarrier (one thread
// issues a stage's copies, no registers held for the bytes in flight; every thread waits on the
// stage's phase), and the exchange of one value per block and row between a cluster's blocks.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

namespace fusedops {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Asks the L2 for `bytes` (a multiple of 16) of global memory from `src` (16-byte aligned): one
// bulk prefetch, no registers held for the bytes in flight. Nothing before sm_90.
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
#endif
}

// One mbarrier per stage, completed by the bytes of its bulk copies: thread 0 arms it with the
// stage's byte count and issues the copies; every thread waits on it with the stage's phase.
struct StageRing {
  char* data;
  uint64_t* full;
  int stages;
  int stage_bytes;

  __device__ void init() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) {
      for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&full[s])));
      // The barriers must be initialized before the async proxy (the bulk copies) uses them.
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
#endif
  }
  __device__ char* stage(int s) const { return data + s * stage_bytes; }
  __device__ void arm(int s, uint32_t bytes) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(&full[s])), "r"(bytes)
                 : "memory");
#endif
  }
  // Copies `bytes` (a multiple of 16, 16-byte aligned ends) from global `src` to `dst` in stage s.
  __device__ void copy(int s, void* dst, const void* src, uint32_t bytes) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     shared_address(dst)),
                 "l"(src), "r"(bytes), "r"(shared_address(&full[s]))
                 : "memory");
#endif
  }
  __device__ void wait(int s, uint32_t phase) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t bar = shared_address(&full[s]);
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
          : "=r"(done)
          : "r"(bar), "r"(phase)
          : "memory");
    }
#endif
  }
};

// Blocks per cluster a ClusterExchange serves at most.
constexpr int kMaxExchangeCluster = 16;

// Sends v to another block's shared memory (a shared::cluster address from mapa), completing its
// bytes on that block's mbarrier `bar` (sm_90 st.async: no fence, no barrier).
__device__ __forceinline__ void send_async(uint32_t addr, uint32_t bar, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];" ::"r"(addr), "f"(v), "r"(bar)
               : "memory");
#endif
}
__device__ __forceinline__ void send_async(uint32_t addr, uint32_t bar, float2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(addr),
               "f"(v.x), "f"(v.y), "r"(bar)
               : "memory");
#endif
}

__device__ __forceinline__ uint32_t cluster_address(uint32_t local, int rank) {
  uint32_t remote = local;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
#endif
  return remote;
}

// The cluster's reduction of one value per block and row, without a cluster barrier: a cluster
// barrier's release would also wait for every global store its threads issued before it (the
// previous row's output), once per row. Instead block r sends its value to slot r of every
// other block's inbox with st.async, which completes on the receiver's mbarrier; each block
// waits on its own mbarrier and reduces its inbox, the same values in the same order in every
// block. Rows take SLOTS inboxes and mbarriers in turn (ExchangeCursor). With two, a block that
// waits for row k's values before it sends row k + 1's: block B writes inbox p of row k + 2 only
// after it has A's value of row k + 1, which A sends only once every one of its threads is past
// row k's reads (the block barrier of row k + 1's reduction).
template <typename V, int SLOTS = 2> struct ClusterExchange {
  V (*inbox)[kMaxExchangeCluster];  // [SLOTS][kMaxExchangeCluster]
  uint64_t* bars;                   // [SLOTS]
  int cluster, rank;

  // Before any block of the cluster sends: every block's mbarriers initialized.
  __device__ void init() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cluster == 1) return;
    if (threadIdx.x == 0) {
      for (int s = 0; s < SLOTS; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&bars[s])));
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cooperative_groups::this_cluster().sync();
#endif
  }
  // Sends `value` (the same in every thread of the block) to every other block of the cluster, in
  // inbox `slot`. Only for clusters of more than one block.
  __device__ void send(V value, int slot) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t bar = shared_address(&bars[slot]);
    if (threadIdx.x == 0) {
      inbox[slot][rank] = value;  // released to the block's threads by the arrive below
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                   "r"(static_cast<uint32_t>((cluster - 1) * sizeof(V)))
                   : "memory");
    }
    const int to = static_cast<int>(threadIdx.x);
    if (to < cluster && to != rank) {
      send_async(cluster_address(shared_address(&inbox[slot][rank]), to), cluster_address(bar, to), value);
    }
#endif
  }
  // Waits for every block's value in inbox `slot` (phase: the slot's ExchangeCursor phase): returns
  // the inbox, block r's value at [r], the same in every block.
  __device__ const V* wait(int slot, uint32_t phase) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t bar = shared_address(&bars[slot]);
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
          " selp.u32 %0, 1, 0, p;\n}"
          : "=r"(done)
          : "r"(bar), "r"(phase)
          : "memory");
    }
#endif
    return inbox[slot];
  }
  __device__ const V* exchange(V value, int slot, uint32_t phase) const {
    send(value, slot);
    return wait(slot, phase);
  }
};

// A row's inbox of SLOTS taken in turn, and that inbox's mbarrier phase; advanced once per row.
template <int SLOTS> struct ExchangeCursor {
  int slot = 0;
  uint32_t phase = 0;  // flips once every SLOTS rows
  __device__ __forceinline__ void next() {
    const uint32_t wraps = slot == SLOTS - 1;
    phase ^= wraps;
    slot = wraps ? 0 : slot + 1;
  }
};

// Where a block is in its stage ring and in its cluster's two inboxes; advanced once per row.
struct StagedCursor {
  int stage = 0;
  uint32_t phase = 0;
  ExchangeCursor<2> exchange;  // exchange.slot: also the scratch buffer of this row
  __device__ __forceinline__ void next(int stages) {
    exchange.next();
    if (++stage == stages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// The software pipeline of staged cluster rows first, first + step, ... (below `rows`): iteration
// i runs reduce(row i, its cursor, its inbox) -- read the row from its stage, reduce it over the
// block, send the block's partial to the cluster -- then finish(row i - 1, its cursor, its inbox,
// what reduce returned for it) -- wait for that inbox and write the row from its stage -- so a
// row's exchange has a whole row's work to arrive in. Rows i - 1 and i are held: a ring of at
// least three stages, and reduce refills the stage of row i - 2 after its block barrier. A
// block B sends row m's partial once it has every partial of row m - 2 (its finish in iteration
// m - 1), which block A sent after reading row m - 4's inbox; A may still be reading row
// m - 3's, and rows m - 2 and m - 1 may be pending: four inboxes. (Checked on a random-
// interleaving model: bench/lessons/2026-12-01-session8-pipeline-model.py.) reduce returns what
// its row's finish needs besides the row (NoCarry: nothing); its `freed` names the stage every
// thread is done with once past its block barrier.
constexpr int kPipelineSlots = 4;
constexpr int kPipelineMinStages = 3;
struct NoCarry {};
struct FreedStage {
  bool any;     // false for a block's first two rows
  int stage;    // row i - 2's stage
  int64_t row;  // row i - 2
};
template <class Reduce, class Finish>
__device__ __forceinline__ void pipeline_rows(int64_t first, int64_t step, int64_t rows, int stages, Reduce reduce,
                                              Finish finish) {
  StagedCursor at, prev_at;
  ExchangeCursor<kPipelineSlots> slot, prev_slot;
  using Carry = decltype(reduce(first, at, slot, FreedStage{}));
  Carry prev{};
  for (int64_t row = first;; row += step) {
    const bool reduces = row < rows;
    Carry now{};
    if (reduces) {
      // The stage two rows back (stages >= 2), without a division.
      const FreedStage freed{row - 2 * step >= first, at.stage >= 2 ? at.stage - 2 : at.stage + stages - 2,
                             row - 2 * step};
      now = reduce(row, at, slot, freed);
    }
    if (row > first) finish(row - step, prev_at, prev_slot, prev);
    if (!reduces) break;
    prev = now;
    prev_at = at;
    at.next(stages);
    prev_slot = slot;
    slot.next();
  }
}

}  // namespace fusedops
