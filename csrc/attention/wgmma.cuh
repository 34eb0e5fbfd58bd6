// Hopper (sm_90a) warpgroup MMA building blocks for the attention forward kernel: shared-memory
// matrix descriptors, the 128-byte-swizzled tile layout they describe, and wgmma.mma_async
// wrappers. Only code compiled for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL) may call these.
//
// Tile layout ("SW128", PTX ISA "Shared Memory Matrix Layout", 128B swizzling): a rows x D tile of
// 16-bit values is stored as D / 64 column blocks, one after the other; a column block holds 64
// columns of every row, one 128-byte line per row, so 8 consecutive rows form one 1024-byte
// swizzle atom. Inside an atom, the 16-byte chunk c (columns 8c..8c+7 of the block) of row r sits
// at chunk position c ^ (r % 8). The swizzle is a function of address bits [4,7) ^ [7,10), which
// is why every block must start on a 1024-byte boundary and why a descriptor may point 32, 64 or
// 96 bytes into an atom (the next 16 columns) without changing the pattern.
//
// The same storage serves as
//   * a K-major operand (A = Q rows, or B = K rows for S = Q K^T, the reduction dim D contiguous):
//     8-row groups are SBO = 1024 bytes apart; wgmma k-step kk (16 columns) starts in column block
//     kk / 4 at byte 32 * (kk % 4); LBO is unused for swizzled K-major layouts;
//   * an MN-major B operand (V in O = P V: the reduction dim is the row, N = D contiguous,
//     imm-trans-b = 1): 8-row groups of the reduction dim are SBO = 1024 bytes apart, a k-step of
//     16 rows starts 2048 bytes further, and each 64-column block is used by its own n64 wgmma, so
//     the stride between 64-column blocks (LBO for MN-major) is never needed.
//
// Register fragments (PTX ISA, "Register Fragments" for wgmma .m64nNk16): warp w of the
// warpgroup owns rows 16w..16w+15 of the 64-row tile, and within those rows both the fp32
// accumulator (N / 8 blocks of 4 floats) and the 16-bit A operand (4 x .b32) use exactly the
// mma.sync m16n8k16 C and A layouts described in mma.cuh. So the accumulator is a float[N / 8][4]
// in that layout, and c_to_a_fragments turns S into the A operand of P V.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "mma.cuh"

namespace fusedops {
namespace attention {
namespace sm90 {

constexpr int kSwizzleAtomBytes = 1024;  // 8 rows x 128 bytes
constexpr int kBlockColumns = 64;        // 16-bit columns per 128-byte line

// Byte offset of the 16-byte chunk `chunk` (columns 8 * chunk ..) of `row` in a SW128 tile of
// `rows` rows.
template <int rows>
__device__ __forceinline__ uint32_t swizzled_offset(int row, int chunk) {
  return (chunk / 8) * (rows * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
}

// Copies a rows x D tile (row pitch `gstride` elements) into SW128 layout at `smem` with cp.async;
// rows at or past `valid_rows` are zero-filled. Consecutive threads take consecutive chunks of a
// row: coalesced 16-byte global reads, and the 8 chunks of a 128-byte line land in 8 distinct
// bank groups. A thread keeps one chunk column and steps down the rows, so it needs one source
// pointer and one shared offset, not one per copy.
template <int rows, int D, int threads, typename T>
__device__ __forceinline__ void copy_tile_swizzled(uint32_t smem, const T* gmem, int64_t gstride, int valid_rows,
                                                   int tid) {
  constexpr int chunks_per_row = D / 8;
  constexpr int rows_per_pass = threads / chunks_per_row;
  static_assert(threads % chunks_per_row == 0 && rows % rows_per_pass == 0, "every thread copies whole passes");
  static_assert(rows_per_pass % 8 == 0, "a thread's rows share one swizzle phase");
  const int row0 = tid / chunks_per_row, chunk = tid % chunks_per_row;
  const uint32_t dst = smem + swizzled_offset<rows>(row0, chunk);
  const T* src = gmem + row0 * gstride + 8 * chunk;
#pragma unroll
  for (int i = 0; i < rows / rows_per_pass; ++i) {
    const bool valid = row0 + i * rows_per_pass < valid_rows;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + i * rows_per_pass * 128),
                 "l"(valid ? src : gmem), "r"(valid ? 16 : 0));
    src += rows_per_pass * gstride;
  }
}

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format") of the shared-state-space
// address `smem`: start address, leading and
// stride byte offsets (each >> 4 in 14 bits), base offset 0 (atoms are 1024-byte aligned), swizzle
// mode 1 = 128B in bits 62-63.
__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t smem, uint32_t leading_bytes, uint32_t stride_bytes) {
  const uint64_t start = (smem & 0x3FFFF) >> 4;
  const uint64_t leading = (leading_bytes & 0x3FFFF) >> 4;
  const uint64_t stride = (stride_bytes & 0x3FFFF) >> 4;
  return start | (leading << 16) | (stride << 32) | (1ull << 62);
}

// Descriptor of a K-major operand: 16 reduction columns starting at column 16 * kk, of the
// 8-row-group-aligned rows starting at `first_row` of a SW128 tile of `rows` rows.
template <int rows>
__device__ __forceinline__ uint64_t k_major_descriptor(uint32_t tile, int first_row, int kk) {
  return sw128_descriptor(tile + (kk / 4) * (rows * 128) + first_row * 128 + (kk % 4) * 32, 16, kSwizzleAtomBytes);
}

// Descriptor of an MN-major B operand: reduction rows 16 * kk .. 16 * kk + 15 and the 64 columns of
// column block `block` of a SW128 tile of `rows` rows. Its one 64-column block needs only the
// 1024-byte step between 8-row groups of the reduction dim; that step is given as both LBO and
// SBO, so the descriptor reads the same under either reading of which field holds it.
template <int rows>
__device__ __forceinline__ uint64_t mn_major_descriptor(uint32_t tile, int kk, int block) {
  return sw128_descriptor(tile + block * (rows * 128) + kk * 16 * 128, kSwizzleAtomBytes, kSwizzleAtomBytes);
}

// wgmma.fence: orders this thread's earlier register writes (accumulators, A fragments) before
// the wgmma.mma_async that read them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

template <int pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}

// Makes the compiler treat every accumulator register as rewritten here, so no read of them is
// moved above the preceding wgmma_wait (the asm of wgmma.mma_async "returns" at issue).
template <int NB>
__device__ __forceinline__ void fence_registers(float (&d)[NB][4]) {
#pragma unroll
  for (int i = 0; i < NB; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// Generic (thread) writes to shared memory, cp.async's included, become visible to the async
// proxy that wgmma reads through only after this fence (and a barrier across the writers).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Accumulator operand lists: M is "+f" (read and written) or "=f" (written only, so the old
// values are dead and their registers free before the wgmma).
#define FUSEDOPS_ACC4(M, i) M(d[i][0]), M(d[i][1]), M(d[i][2]), M(d[i][3])
#define FUSEDOPS_ACC32(M)                                                                                    \
  FUSEDOPS_ACC4(M, 0), FUSEDOPS_ACC4(M, 1), FUSEDOPS_ACC4(M, 2), FUSEDOPS_ACC4(M, 3), FUSEDOPS_ACC4(M, 4), \
      FUSEDOPS_ACC4(M, 5), FUSEDOPS_ACC4(M, 6), FUSEDOPS_ACC4(M, 7)
#define FUSEDOPS_ACC64(M)                                                                                         \
  FUSEDOPS_ACC32(M), FUSEDOPS_ACC4(M, 8), FUSEDOPS_ACC4(M, 9), FUSEDOPS_ACC4(M, 10), FUSEDOPS_ACC4(M, 11),        \
      FUSEDOPS_ACC4(M, 12), FUSEDOPS_ACC4(M, 13), FUSEDOPS_ACC4(M, 14), FUSEDOPS_ACC4(M, 15)
#define FUSEDOPS_REGS32                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31}"
#define FUSEDOPS_REGS64                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "   \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x N per warpgroup, fp32) = (accumulate ? d : 0) + A * B, A (64 x 16) and B (16 x N) both
// K-major in shared memory; N is 64 or 128.
template <typename T, int N, bool accumulate>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t a_desc, uint64_t b_desc);

// d (64 x 64 per warpgroup, fp32) += A * B, A (64 x 16) in registers (mma.cuh A layout per warp),
// B (16 x 64) MN-major in shared memory.
template <typename T>
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b_desc);

#define FUSEDOPS_READ_WRITE(x) "+f"(x)
#define FUSEDOPS_WRITE(x) "=f"(x)
// SS wgmma of width N: operands REGS are d, A and B the descriptors, SCALE the scale-d flag.
#define FUSEDOPS_DEFINE_WGMMA_SS(T, TYPE, N, REGS, ACC, A, B, SCALE)                                                              \
  template <>                                                                                                      \
  __device__ __forceinline__ void wgmma_ss<T, N, true>(float (&d)[N / 8][4], uint64_t a_desc, uint64_t b_desc) {  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS ", " A ", " B             \
                 ", p, 1, 1, 0, 0;\n}\n"                                                                             \
                 : ACC(FUSEDOPS_READ_WRITE)                                                                       \
                 : "l"(a_desc), "l"(b_desc), "r"(1));                                                             \
  }                                                                                                                \
  template <>                                                                                                      \
  __device__ __forceinline__ void wgmma_ss<T, N, false>(float (&d)[N / 8][4], uint64_t a_desc, uint64_t b_desc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS ", " A ", " B             \
                 ", p, 1, 1, 0, 0;\n}\n"                                                                             \
                 : ACC(FUSEDOPS_WRITE)                                                                            \
                 : "l"(a_desc), "l"(b_desc), "r"(0));                                                             \
  }

#define FUSEDOPS_DEFINE_WGMMA(T, TYPE)                                                                             \
  FUSEDOPS_DEFINE_WGMMA_SS(T, TYPE, 128, FUSEDOPS_REGS64, FUSEDOPS_ACC64, "%64", "%65", "%66")                    \
  FUSEDOPS_DEFINE_WGMMA_SS(T, TYPE, 64, FUSEDOPS_REGS32, FUSEDOPS_ACC32, "%32", "%33", "%34")                     \
  template <>                                                                                                      \
  __device__ __forceinline__ void wgmma_rs_n64<T>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b_desc) {   \
    asm volatile(                                                                                                  \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                               \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " FUSEDOPS_REGS32                            \
        ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                                            \
        : FUSEDOPS_ACC32(FUSEDOPS_READ_WRITE)                                                                      \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));                                      \
  }

FUSEDOPS_DEFINE_WGMMA(__nv_bfloat16, "bf16")
FUSEDOPS_DEFINE_WGMMA(__half, "f16")

#undef FUSEDOPS_DEFINE_WGMMA
#undef FUSEDOPS_DEFINE_WGMMA_SS
#undef FUSEDOPS_WRITE
#undef FUSEDOPS_READ_WRITE
#undef FUSEDOPS_REGS64
#undef FUSEDOPS_REGS32
#undef FUSEDOPS_ACC64
#undef FUSEDOPS_ACC32
#undef FUSEDOPS_ACC4

}  // namespace sm90
}  // namespace attention
}  // namespace fusedops
