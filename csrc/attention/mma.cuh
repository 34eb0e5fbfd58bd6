// Tensor-core building blocks for the attention kernels (sm_80+): cp.async, ldmatrix and
// mma.sync.m16n8k16 wrappers, and warp-level GEMMs on 16-row tiles built from them.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
// In a warp, lane = 4 * g + t (g = lane / 4 in 0..7, t = lane % 4 in 0..3):
//   A (16 x 16, row-major), 4 x .b32 registers of two 16-bit values (low half = lower column):
//     a0: row g,     cols 2t, 2t+1      a2: row g,     cols 2t+8, 2t+9
//     a1: row g + 8, cols 2t, 2t+1      a3: row g + 8, cols 2t+8, 2t+9
//   B (16 x 8, "col": indexed [k][n]), 2 x .b32:
//     b0: rows k = 2t, 2t+1, col n = g  b1: rows k = 2t+8, 2t+9, col n = g
//   C/D (16 x 8, fp32), 4 floats:
//     c0, c1: row g, cols 2t, 2t+1      c2, c3: row g + 8, cols 2t, 2t+1
// ldmatrix.m8n8.x4 loads four 8 x 8 16-bit matrices; lanes 8i..8i+7 give the row addresses of
// matrix i, and register i of every lane receives matrix i: without .trans, lane 4g + t gets
// row g, elements 2t, 2t+1; with .trans it gets elements (2t, g) and (2t+1, g), i.e. the
// transposed matrix. Hence:
//   * an A fragment of a row-major [16][16] tile = ldmatrix.x4 with lane l addressing row l % 16,
//     column 8 * (l / 16);
//   * B fragments of B = X^T where X is stored [n][k] (k contiguous, e.g. K in S = Q K^T) =
//     ldmatrix.x4 (no .trans) with lane l addressing row n = (l % 8) + 8 * (l / 16), column
//     k = 8 * ((l / 8) % 2): registers {b0, b1} of n-block 0 and {b0, b1} of n-block 1;
//   * B fragments of B = X where X is stored [k][n] (n contiguous, e.g. V in O = P V) =
//     ldmatrix.x4.trans with lane l addressing row k = l % 16, column n = 8 * (l / 16).
// The C fragments of two adjacent n-blocks (16 columns) are, converted to 16-bit, exactly an A
// fragment of those 16 columns: {c0c1, c2c3} of the first block become {a0, a1}, of the second
// {a2, a3}. This is how P = softmax(S) feeds O += P V without leaving registers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fusedops {
namespace attention {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses registers; zero-fills the destination when !valid
// (src must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}

// The same for one 4-byte value (.ca: the 4-byte size exists only with caching in L1).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(smem)), "l"(gmem),
               "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}

// d += a * b on one m16n8k16 tile, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 values as one .b32 register of two 16-bit values (lo = the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---- warp GEMMs on a 16-row tile -------------------------------------------------------------
// `stride` is the row pitch of a shared-memory tile in elements. Accumulators acc[N / 8][4] hold
// a 16 x N fp32 tile in the C layout above.

// A fragments of the 16 x K tile at `tile` (row-major), one set of 4 registers per 16 columns.
template <int K, typename T>
__device__ __forceinline__ void load_a_fragments(uint32_t (&a)[K / 16][4], const T* tile, int stride, int lane) {
  const T* base = tile + (lane % 16) * stride + 8 * (lane / 16);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) ldmatrix_x4(a[kk], base + 16 * kk);
}

// acc (16 x N) += A (16 x K, fragments) * X^T, X stored [N][K] in shared memory.
template <int N, int K, typename T>
__device__ __forceinline__ void gemm_abt(float (&acc)[N / 8][4], const uint32_t (&a)[K / 16][4], const T* x,
                                         int stride, int lane) {
  const T* base = x + ((lane % 8) + 8 * (lane / 16)) * stride + 8 * ((lane / 8) % 2);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
    for (int nn = 0; nn < N / 16; ++nn) {
      uint32_t b[4];
      ldmatrix_x4(b, base + 16 * nn * stride + 16 * kk);
      mma_16816<T>(acc[2 * nn], a[kk], b[0], b[1]);
      mma_16816<T>(acc[2 * nn + 1], a[kk], b[2], b[3]);
    }
  }
}

// acc (16 x N) += A * X^T like gemm_abt, with A read from the row-major 16 x K shared-memory
// tile `a_tile` one 16-column slice at a time (fewer live registers than holding all of A).
template <int N, int K, typename T>
__device__ __forceinline__ void gemm_abt_smem_a(float (&acc)[N / 8][4], const T* a_tile, int a_stride, const T* x,
                                                int stride, int lane) {
  const T* a_base = a_tile + (lane % 16) * a_stride + 8 * (lane / 16);
  const T* base = x + ((lane % 8) + 8 * (lane / 16)) * stride + 8 * ((lane / 8) % 2);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[4];
    ldmatrix_x4(a, a_base + 16 * kk);
#pragma unroll
    for (int nn = 0; nn < N / 16; ++nn) {
      uint32_t b[4];
      ldmatrix_x4(b, base + 16 * nn * stride + 16 * kk);
      mma_16816<T>(acc[2 * nn], a, b[0], b[1]);
      mma_16816<T>(acc[2 * nn + 1], a, b[2], b[3]);
    }
  }
}

// acc (16 x N) += A (16 x K, fragments) * X, X stored [K][N] in shared memory.
template <int N, int K, typename T>
__device__ __forceinline__ void gemm_ab(float (&acc)[N / 8][4], const uint32_t (&a)[K / 16][4], const T* x,
                                        int stride, int lane) {
  const T* base = x + (lane % 16) * stride + 8 * (lane / 16);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
    for (int nn = 0; nn < N / 16; ++nn) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, base + 16 * kk * stride + 16 * nn);
      mma_16816<T>(acc[2 * nn], a[kk], b[0], b[1]);
      mma_16816<T>(acc[2 * nn + 1], a[kk], b[2], b[3]);
    }
  }
}

// A fragments (16-bit) of the 16 x N fp32 tile held in C layout.
template <int N, typename T>
__device__ __forceinline__ void c_to_a_fragments(uint32_t (&a)[N / 16][4], const float (&c)[N / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    a[kk][0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
    a[kk][1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
    a[kk][2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[kk][3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// Copies a rows x D tile (row pitch `gstride` elements in global memory) into shared memory
// (pitch `sstride`) with cp.async, 16 bytes per copy; rows at or past `valid_rows` are zero-filled.
template <int rows, int D, int threads, typename T>
__device__ __forceinline__ void copy_tile_async(T* smem, int sstride, const T* gmem, int64_t gstride, int valid_rows,
                                                int tid) {
  constexpr int chunks_per_row = D / 8;
  static_assert(rows * chunks_per_row % threads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < rows * chunks_per_row / threads; ++i) {
    const int c = tid + i * threads;
    const int row = c / chunks_per_row, col = 8 * (c % chunks_per_row);
    const bool valid = row < valid_rows;
    cp_async_16(smem + row * sstride + col, valid ? gmem + row * gstride + col : gmem, valid);
  }
}

}  // namespace attention
}  // namespace fusedops
