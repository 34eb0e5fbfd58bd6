// Fused elementwise kernels. One generic grid-stride kernel moves the bytes (16-byte vectors,
// kUnroll independent loads in flight per thread, a scalar tail); each op is a small functor
// that maps loaded values to results in the accumulation type.
#include <algorithm>

#include "../common/dispatch.cuh"
#include "../common/fast_divmod.cuh"
#include "../common/philox.cuh"
#include "../common/vec.cuh"
#include "elementwise.h"

namespace fusedops {
namespace {

constexpr int kThreads = 128;  // beat 256 and 512 for the instruction-heavy bf16 ops

// Vectors each thread loads before it computes: 2 measured best for every op but two, specialized
// below: the 16-bit GELU forward and scale_bias (bench/lessons, 2026-11-29).
template <class Op> constexpr int kUnroll = 2;

// NIN full-size inputs, NOUT outputs, NCOL column vectors broadcast along the last dim.
template <typename T, int NIN, int NOUT, int NCOL>
struct Operands {
  const T* in[NIN];
  T* out[NOUT];
  const T* col[NCOL > 0 ? NCOL : 1];
  int64_t numel;
  int64_t cols;
  FastDivmod cols_divmod;  // set by the launcher; used where indices are 32-bit
};

// Loads, computes and stores the VEC elements starting at elem0 (elem0 % VEC == 0 when VEC > 1).
template <typename T, int VEC, typename Idx, int NIN, int NOUT, int NCOL, class Op>
__device__ __forceinline__ void apply_op(const Operands<T, NIN, NOUT, NCOL>& ops, const Op& op, Idx elem0,
                                         const AlignedVector<T, VEC> (&loaded)[NIN]) {
  using A = acc_t<T>;
  A in[NIN][VEC];
  A col[NCOL > 0 ? NCOL : 1][VEC];
  A out[NOUT][VEC];
#pragma unroll
  for (int i = 0; i < NIN; ++i)
#pragma unroll
    for (int j = 0; j < VEC; ++j) in[i][j] = to_acc(loaded[i].val[j]);
  if constexpr (NCOL > 0) {
    Idx col0;
    if constexpr (sizeof(Idx) == 4) {
      col0 = ops.cols_divmod.mod(elem0);
    } else {
      col0 = elem0 % static_cast<Idx>(ops.cols);
    }
#pragma unroll
    for (int k = 0; k < NCOL; ++k) {
      if (ops.col[k] != nullptr) {
        const auto v = load_vector<T, VEC>(ops.col[k] + col0);
#pragma unroll
        for (int j = 0; j < VEC; ++j) col[k][j] = to_acc(v.val[j]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) col[k][j] = A(0);
      }
    }
  }
  op.template apply<VEC>(in, col, out, static_cast<int64_t>(elem0));
#pragma unroll
  for (int o = 0; o < NOUT; ++o) {
    AlignedVector<T, VEC> v;
#pragma unroll
    for (int j = 0; j < VEC; ++j) v.val[j] = from_acc<T>(out[o][j]);
    store_vector<T, VEC>(ops.out[o] + elem0, v);
  }
}

template <typename T, int VEC, typename Idx, int NIN, int NOUT, int NCOL, class Op>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(Operands<T, NIN, NOUT, NCOL> ops, Op op) {
  constexpr int kUnroll = fusedops::kUnroll<Op>;
  const Idx n_vec = static_cast<Idx>(ops.numel / VEC);
  const Idx stride = static_cast<Idx>(gridDim.x) * kThreads * kUnroll;
  for (Idx base = static_cast<Idx>(blockIdx.x) * kThreads * kUnroll + threadIdx.x; base < n_vec; base += stride) {
    // All loads of the kUnroll vectors are issued before any result is computed.
    AlignedVector<T, VEC> loaded[kUnroll][NIN];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const Idx v = base + u * kThreads;
      if (v < n_vec)
#pragma unroll
        for (int i = 0; i < NIN; ++i) loaded[u][i] = load_vector<T, VEC>(ops.in[i] + v * VEC);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const Idx v = base + u * kThreads;
      if (v < n_vec) apply_op<T, VEC, Idx>(ops, op, v * VEC, loaded[u]);
    }
  }
  if constexpr (VEC > 1) {
    // Scalar tail: numel % VEC elements, done by the first block.
    if (blockIdx.x == 0) {
      for (Idx e = n_vec * VEC + threadIdx.x; e < static_cast<Idx>(ops.numel); e += kThreads) {
        AlignedVector<T, 1> loaded[NIN];
#pragma unroll
        for (int i = 0; i < NIN; ++i) loaded[i].val[0] = ops.in[i][e];
        apply_op<T, 1, Idx>(ops, op, e, loaded);
      }
    }
  }
}

template <typename T, int VEC, typename Idx, int NIN, int NOUT, int NCOL, class Op>
cudaError_t launch_with(const Operands<T, NIN, NOUT, NCOL>& ops, const Op& op, cudaStream_t stream) {
  const int64_t per_block = int64_t(kThreads) * kUnroll<Op>;
  const int64_t blocks = std::min<int64_t>((ops.numel / VEC + per_block - 1) / per_block, int64_t(1) << 30);
  elementwise_kernel<T, VEC, Idx><<<static_cast<unsigned>(std::max<int64_t>(blocks, 1)), kThreads, 0, stream>>>(
      ops, op);
  return cudaGetLastError();
}

// Picks 16-byte vectors when every pointer is aligned and no vector straddles a row of a
// column vector that is present, else scalar accesses; 32-bit index arithmetic when it cannot overflow.
template <typename T, int NIN, int NOUT, int NCOL, class Op>
cudaError_t launch_elementwise(Operands<T, NIN, NOUT, NCOL> ops, const Op& op, cudaStream_t stream) {
  if (ops.numel == 0) return cudaSuccess;
  constexpr int kVec = kVec16<T>;
  bool vectorized = true;
  for (int i = 0; i < NIN; ++i) vectorized &= is_aligned(ops.in[i], 16);
  for (int o = 0; o < NOUT; ++o) vectorized &= is_aligned(ops.out[o], 16);
  for (int k = 0; k < NCOL; ++k) {
    if (ops.col[k] != nullptr) vectorized &= is_aligned(ops.col[k], 16) && ops.cols % kVec == 0;
  }
  // Largest index formed: numel + kThreads * kUnroll * gridDim (the last stride step).
  const bool small = ops.numel < (int64_t(1) << 31);
  if (small) ops.cols_divmod = FastDivmod(static_cast<uint32_t>(std::max<int64_t>(ops.cols, 1)));
  if (vectorized) {
    return small ? launch_with<T, kVec, uint32_t>(ops, op, stream) : launch_with<T, kVec, uint64_t>(ops, op, stream);
  }
  return small ? launch_with<T, 1, uint32_t>(ops, op, stream) : launch_with<T, 1, uint64_t>(ops, op, stream);
}

// 16-bit outputs round off far more than the hardware approximations err (a few fp32 ulp), so
// they take the fast exp and reciprocal; fp32 and fp64 use the accurate library functions. The
// bf16 activations are instruction-bound otherwise (bias_gelu, swiglu: ~75% of copy bandwidth).
template <typename T> constexpr bool kFastMath = sizeof(T) == 2;

__device__ __forceinline__ float exp2f_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T> __device__ __forceinline__ acc_t<T> sigmoid(acc_t<T> x) {
  if constexpr (kFastMath<T>) return __fdividef(1.0f, 1.0f + __expf(-x));  // 0 once exp(-x) > 2^126
  else return acc_t<T>(1) / (acc_t<T>(1) + exp(-x));
}

constexpr double kSqrt2OverPi = 0.7978845608028654;
constexpr double kGeluCubic = 0.044715;
constexpr double kRsqrt2 = 0.7071067811865476;
constexpr double kRsqrt2Pi = 0.3989422804014327;

// Lower tail of the standard normal, Phi(-|x|) = erfc(z) / 2 with z = |x| / sqrt 2, for 16-bit
// outputs: erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), with P our degree-5 least-squares
// fit of log(erfc(z) / t) + z^2 over z in [0, 9.5] (relative error 8.5e-6 in float64), here
// rewritten in base 2 with the 1/2 folded in: Phi(-|x|) = t 2^(Q(t) - x^2 log2(e) / 2),
// Q = log2(e) P - 1. In fp32 arithmetic x Phi(x) stays within 2.5e-5 relative of the exact value
// down to x = -13 and within 1.5e-6 absolute everywhere (checked against scipy): far below
// 16-bit rounding, at about half the instructions of erff (the bf16 erf-GELU was
// instruction-bound at 66% of copy bandwidth with erff). The tail does not cancel as
// 0.5 * (1 + erf(x / sqrt 2)) does. Also returns 2^(-x^2 log2(e) / 2) = exp(-x^2 / 2).
struct NormalTail {
  float phi_neg_abs;  // Phi(-|x|)
  float gauss;        // exp(-x^2 / 2)
};

__device__ __forceinline__ NormalTail normal_tail(float x) {
  constexpr float kQ[] = {-2.827420919e+00f, 1.470641706e+00f, 3.595960740e-01f,
                          6.978435974e-01f,  -1.034254905e+00f, 3.336066577e-01f};
  constexpr float kHalfRsqrt2 = 0.353553391f, kHalfLog2e = 0.721347520f;
  float t;  // 1 / (1 + |x| / (2 sqrt 2)): the operand is >= 1, so the approximate reciprocal is exact enough
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(fmaf(kHalfRsqrt2, fabsf(x), 1.0f)));
  float q = kQ[5];
#pragma unroll
  for (int i = 4; i >= 0; --i) q = fmaf(q, t, kQ[i]);
  const float minus_exponent = x * x * kHalfLog2e;
  return {t * exp2f_approx(q - minus_exponent), exp2f_approx(-minus_exponent)};
}

// Standard normal CDF for fp32 and fp64: the library erf.
template <typename A> __device__ __forceinline__ A normal_cdf(A x) { return A(0.5) * (A(1) + erf(x * A(kRsqrt2))); }

// 0.5 * (1 + tanh(u)) == sigmoid(2u): the sigmoid form keeps its relative accuracy where
// 1 + tanh(u) cancels (large negative inputs).
template <typename T> __device__ __forceinline__ acc_t<T> gelu(acc_t<T> x, bool tanh_approx) {
  using A = acc_t<T>;
  if (tanh_approx) return x * sigmoid<T>(A(2 * kSqrt2OverPi) * (x + A(kGeluCubic) * x * x * x));
  // x Phi(x) = max(x, 0) - |x| Phi(-|x|) for either sign of x, without a select. |x| is capped
  // where Phi(-|x|) has long underflowed to 0, so x = +inf gives inf, not inf * 0.
  if constexpr (kFastMath<T>) return fmaf(-fminf(fabsf(x), 16.0f), normal_tail(x).phi_neg_abs, fmaxf(x, 0.0f));
  else return x * normal_cdf(x);
}

template <typename T> __device__ __forceinline__ acc_t<T> gelu_grad(acc_t<T> x, bool tanh_approx) {
  using A = acc_t<T>;
  const A x2 = x * x;
  if (tanh_approx) {
    const A s = sigmoid<T>(A(2 * kSqrt2OverPi) * (x + A(kGeluCubic) * x2 * x));
    return s + A(2 * kSqrt2OverPi) * x * s * (A(1) - s) * (A(1) + A(3 * kGeluCubic) * x2);
  }
  if constexpr (kFastMath<T>) {
    const NormalTail tail = normal_tail(x);
    return fmaf(x * float(kRsqrt2Pi), tail.gauss, x >= 0.0f ? 1.0f - tail.phi_neg_abs : tail.phi_neg_abs);
  } else {
    return normal_cdf(x) + x * exp(A(-0.5) * x2) * A(kRsqrt2Pi);
  }
}

template <typename T> struct ScaleBiasOp {
  using A = acc_t<T>;
  A scale, bias;
  bool scale_is_vector;
  // in: x; col: scale, bias
  template <int VEC>
  __device__ void apply(const A (&in)[1][VEC], const A (&col)[2][VEC], A (&out)[1][VEC], int64_t) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[0][j] = in[0][j] * (scale_is_vector ? col[0][j] : scale) + col[1][j] + bias;
  }
};

// A pure stream: one vector per thread keeps the most blocks resident (measured 101.5/102.6% of
// cudaMemcpy for bf16/fp32 against 100.7/101.7% with two; bench/lessons, 2026-11-29).
template <typename T> constexpr int kUnroll<ScaleBiasOp<T>> = 1;

template <typename T> struct BiasGeluFwdOp {
  using A = acc_t<T>;
  bool tanh_approx;
  // in: x; col: bias
  template <int VEC>
  __device__ void apply(const A (&in)[1][VEC], const A (&col)[1][VEC], A (&out)[1][VEC], int64_t) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[0][j] = gelu<T>(in[0][j] + col[0][j], tanh_approx);
  }
};

// The 16-bit GELU forward needs 4 to overlap its long instruction chains.
template <typename T> constexpr int kUnroll<BiasGeluFwdOp<T>> = sizeof(T) == 2 ? 4 : 2;

template <typename T> struct BiasGeluBwdOp {
  using A = acc_t<T>;
  bool tanh_approx;
  // in: grad, x; col: bias
  template <int VEC>
  __device__ void apply(const A (&in)[2][VEC], const A (&col)[1][VEC], A (&out)[1][VEC], int64_t) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[0][j] = in[0][j] * gelu_grad<T>(in[1][j] + col[0][j], tanh_approx);
  }
};

template <typename T> struct BiasDropoutAddOp {
  using A = acc_t<T>;
  PhiloxArgs philox;
  int64_t* rng_state;
  uint32_t threshold;
  A keep_scale;
  bool dropout;
  // in: x, residual; col: bias
  template <int VEC>
  __device__ void apply(const A (&in)[2][VEC], const A (&col)[1][VEC], A (&out)[1][VEC], int64_t elem0) const {
    if (!dropout) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) out[0][j] = in[1][j] + in[0][j] + col[0][j];
      return;
    }
    if (elem0 == 0) {  // exactly one thread records the stream position for the backward
      const PhiloxKey key = unpack_philox(philox);
      rng_state[0] = static_cast<int64_t>(key.seed);
      rng_state[1] = static_cast<int64_t>(key.offset);
    }
    for_each_keep<VEC>(unpack_philox(philox), threshold, elem0, [&](int j, bool keep) {
      out[0][j] = in[1][j] + (keep ? (in[0][j] + col[0][j]) * keep_scale : A(0));
    });
  }
};

template <typename T> struct DropoutBwdOp {
  using A = acc_t<T>;
  PhiloxArgs philox;
  uint32_t threshold;
  A keep_scale;
  // in: grad
  template <int VEC>
  __device__ void apply(const A (&in)[1][VEC], const A (&)[1][VEC], A (&out)[1][VEC], int64_t elem0) const {
    for_each_keep<VEC>(unpack_philox(philox), threshold, elem0,
                       [&](int j, bool keep) { out[0][j] = keep ? in[0][j] * keep_scale : A(0); });
  }
};

template <typename T> struct SwigluFwdOp {
  using A = acc_t<T>;
  // in: gate, up
  template <int VEC>
  __device__ void apply(const A (&in)[2][VEC], const A (&)[1][VEC], A (&out)[1][VEC], int64_t) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[0][j] = in[0][j] * sigmoid<T>(in[0][j]) * in[1][j];
  }
};

template <typename T> struct SwigluBwdOp {
  using A = acc_t<T>;
  // in: grad, gate, up; out: grad_gate, grad_up
  template <int VEC>
  __device__ void apply(const A (&in)[3][VEC], const A (&)[1][VEC], A (&out)[2][VEC], int64_t) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const A g = in[1][j], s = sigmoid<T>(g);
      out[0][j] = in[0][j] * in[2][j] * s * (A(1) + g * (A(1) - s));
      out[1][j] = in[0][j] * g * s;
    }
  }
};

}  // namespace

cudaError_t launch_scale_bias(const ScaleBiasParams& p, DType dtype, cudaStream_t stream) {
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    using A = acc_t<T>;
    Operands<T, 1, 1, 2> ops{{static_cast<const T*>(p.x)},
                             {static_cast<T*>(p.out)},
                             {static_cast<const T*>(p.scale), static_cast<const T*>(p.bias)},
                             p.numel,
                             p.cols};
    const A bias = p.bias ? A(0) : A(p.bias_value);
    return launch_elementwise(ops, ScaleBiasOp<T>{A(p.scale_value), bias, p.scale != nullptr}, stream);
  });
}

cudaError_t launch_bias_gelu_fwd(const BiasGeluParams& p, DType dtype, cudaStream_t stream) {
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    Operands<T, 1, 1, 1> ops{{static_cast<const T*>(p.x)}, {static_cast<T*>(p.out)}, {static_cast<const T*>(p.bias)},
                             p.numel, p.cols};
    return launch_elementwise(ops, BiasGeluFwdOp<T>{p.tanh_approximation}, stream);
  });
}

cudaError_t launch_bias_gelu_bwd(const BiasGeluParams& p, DType dtype, cudaStream_t stream) {
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    Operands<T, 2, 1, 1> ops{{static_cast<const T*>(p.grad), static_cast<const T*>(p.x)},
                             {static_cast<T*>(p.out)},
                             {static_cast<const T*>(p.bias)},
                             p.numel,
                             p.cols};
    return launch_elementwise(ops, BiasGeluBwdOp<T>{p.tanh_approximation}, stream);
  });
}

cudaError_t launch_bias_dropout_add_fwd(const BiasDropoutAddParams& p, DType dtype, cudaStream_t stream) {
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    using A = acc_t<T>;
    Operands<T, 2, 1, 1> ops{{static_cast<const T*>(p.x), static_cast<const T*>(p.residual)},
                             {static_cast<T*>(p.out)},
                             {static_cast<const T*>(p.bias)},
                             p.numel,
                             p.cols};
    const BiasDropoutAddOp<T> op{p.philox, p.rng_state, dropout_threshold(p.p), A(1.0 / (1.0 - p.p)), p.dropout};
    return launch_elementwise(ops, op, stream);
  });
}

cudaError_t launch_dropout_bwd(const DropoutBackwardParams& p, DType dtype, cudaStream_t stream) {
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    using A = acc_t<T>;
    Operands<T, 1, 1, 0> ops{{static_cast<const T*>(p.grad)}, {static_cast<T*>(p.grad_in)}, {nullptr}, p.numel, 1};
    PhiloxArgs recorded;
    recorded.captured = true;  // seed and offset are read from device memory
    recorded.seed_ptr = p.rng_state;
    recorded.offset_ptr = p.rng_state + 1;
    return launch_elementwise(ops, DropoutBwdOp<T>{recorded, dropout_threshold(p.p), A(1.0 / (1.0 - p.p))}, stream);
  });
}

cudaError_t launch_swiglu_fwd(const SwigluParams& p, DType dtype, cudaStream_t stream) {
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    Operands<T, 2, 1, 0> ops{{static_cast<const T*>(p.gate), static_cast<const T*>(p.up)},
                             {static_cast<T*>(p.out)},
                             {nullptr},
                             p.numel,
                             1};
    return launch_elementwise(ops, SwigluFwdOp<T>{}, stream);
  });
}

cudaError_t launch_swiglu_bwd(const SwigluBackwardParams& p, DType dtype, cudaStream_t stream) {
  return FUSEDOPS_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    Operands<T, 3, 2, 0> ops{
        {static_cast<const T*>(p.grad), static_cast<const T*>(p.gate), static_cast<const T*>(p.up)},
        {static_cast<T*>(p.grad_gate), static_cast<T*>(p.grad_up)},
        {nullptr},
        p.numel,
        1};
    return launch_elementwise(ops, SwigluBwdOp<T>{}, stream);
  });
}

}  // namespace fusedops
