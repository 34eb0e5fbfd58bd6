// Torch side of fused attention: argument checks, allocation, stream, launch.
// q, k, v, out and dout are [batch, heads, seq, head_dim] and used in place with any
// batch/head/seq strides (e.g. a [B, L, H, D] tensor transposed to [B, H, L, D]) as long as the
// head_dim stride is 1 and rows are 16-byte aligned; any other tensor is copied once to a
// contiguous one (documented in docs/attention.md).
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <limits>

#include "../common/torch_utils.h"
#include "attention.h"

namespace fusedops {
namespace {

// Whether the kernels can read t in place: unit last-dim stride, 16-byte aligned base and rows.
bool kernel_layout(const at::Tensor& t) {
  if (t.stride(3) != 1 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  return true;
}

at::Tensor in_kernel_layout(const at::Tensor& t) {
  return kernel_layout(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

#define FUSEDOPS_ATTENTION_STRINGIFY_(x) #x
#define FUSEDOPS_ATTENTION_STRINGIFY(x) FUSEDOPS_ATTENTION_STRINGIFY_(x)

// Whether the build compiled sm_90a (the arch list reaches C++ as one token, e.g. 8.0_9.0a): the
// Hopper wgmma kernel exists only there; other builds hold a stub that traps.
bool build_has_sm90a() {
#ifdef FUSEDOPS_ARCH_LIST
  return std::strstr(FUSEDOPS_ATTENTION_STRINGIFY(FUSEDOPS_ARCH_LIST), "9.0a") != nullptr;
#else
  return false;
#endif
}

bool env_is_zero(const char* name) {
  const char* knob = std::getenv(name);
  return knob != nullptr && std::strcmp(knob, "0") == 0;
}

bool is_sm90_device(const at::Tensor& t) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(t.get_device());
  return prop->major == 9 && prop->minor == 0;
}

// The forward runs the Hopper wgmma kernel on sm_90 devices in sm_90a builds for the head dims it
// has, unless FUSEDOPS_ATTENTION_SM90=0 (read per call, to compare the two paths); else mma.sync.
bool use_sm90_forward(const at::Tensor& q, DType dtype) {
  if (!build_has_sm90a() || !attention_fwd_sm90_supported(dtype, static_cast<int>(q.size(3)))) return false;
  return !env_is_zero("FUSEDOPS_ATTENTION_SM90") && is_sm90_device(q);
}

// The backward likewise, unless FUSEDOPS_ATTENTION_SM90=0 or FUSEDOPS_ATTENTION_SM90_BWD=0 (the
// latter keeps the wgmma forward: compares the two backwards alone).
bool use_sm90_backward(const at::Tensor& q, DType dtype) {
  if (!build_has_sm90a() || !attention_bwd_sm90_supported(dtype, static_cast<int>(q.size(3)))) return false;
  return !env_is_zero("FUSEDOPS_ATTENTION_SM90") && !env_is_zero("FUSEDOPS_ATTENTION_SM90_BWD") && is_sm90_device(q);
}

// Output shaped like `ref`, in ref's memory layout when the kernels can write that layout (the
// fake kernels in fusedops/ops/attention.py mirror this rule).
at::Tensor empty_output_like(const at::Tensor& ref) {
  at::Tensor out = ref.stride(3) == 1 ? at::empty_like(ref) : at::empty(ref.sizes(), ref.options());
  return kernel_layout(out) ? out : at::empty(ref.sizes(), ref.options());
}

AttentionStrides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

int checked_int(int64_t value, const char* what) {
  TORCH_CHECK(value <= std::numeric_limits<int>::max(), "fusedops: attention ", what, " ", value, " is too large");
  return static_cast<int>(value);
}

// Checks q, k, v; returns the dtype.
DType check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4, "fusedops: query must be 4-D [batch, heads, seq, head_dim], got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 4, "fusedops: key must be 4-D [batch, heads, seq, head_dim], got shape ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "fusedops: value has shape ", v.sizes(), " but key has shape ", k.sizes());
  check_same_device(k, q, "key");
  check_same_device(v, q, "value");
  check_same_dtype(k, q, "key");
  check_same_dtype(v, q, "value");
  const DType dtype = to_dtype(q.scalar_type(), "query");
  TORCH_CHECK(attention_supported(dtype, static_cast<int>(q.size(3))),
              "fusedops: attention kernels support float16/bfloat16 with head_dim 32, 64, 96 or 128, got ",
              q.scalar_type(), " with head_dim ", q.size(3));
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), "fusedops: key has shape ", k.sizes(),
              ", incompatible with query of shape ", q.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "fusedops: query heads (", q.size(1),
              ") must be a multiple of key/value heads (", k.size(1), ")");
  TORCH_CHECK(k.size(2) > 0 || q.numel() == 0, "fusedops: key must have at least one position");
  checked_int(q.size(0) * q.size(1), "batch * heads");
  checked_int(q.size(2), "query length");
  checked_int(k.size(2), "key length");
  return dtype;
}

// The problem shape and softmax settings both kernels' params carry (sizes checked to fit int).
template <class Params>
void set_problem(Params& p, const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  p.batch = static_cast<int>(q.size(0));
  p.heads_q = static_cast<int>(q.size(1));
  p.heads_kv = static_cast<int>(k.size(1));
  p.len_q = static_cast<int>(q.size(2));
  p.len_k = static_cast<int>(k.size(2));
  p.head_dim = static_cast<int>(q.size(3));
  p.scale = static_cast<float>(scale);
  p.causal = causal;
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      bool causal, double scale) {
  const DType dtype = check_qkv(q, k, v);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = empty_output_like(q);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  const at::Tensor qc = in_kernel_layout(q), kc = in_kernel_layout(k), vc = in_kernel_layout(v);
  AttentionFwdParams p{};
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_stride = strides_of(qc);
  p.k_stride = strides_of(kc);
  p.v_stride = strides_of(vc);
  p.out_stride = strides_of(out);
  set_problem(p, q, k, causal, scale);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(use_sm90_forward(q, dtype) ? launch_attention_fwd_sm90(p, dtype, stream)
                                            : launch_attention_fwd(p, dtype, stream));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(const at::Tensor& dout, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  const at::Tensor& out, const at::Tensor& lse,
                                                                  bool causal, double scale) {
  const DType dtype = check_qkv(q, k, v);
  TORCH_CHECK(dout.sizes() == q.sizes(), "fusedops: grad_out has shape ", dout.sizes(), " but query has shape ",
              q.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), "fusedops: out has shape ", out.sizes(), " but query has shape ", q.sizes());
  check_same_device(dout, q, "grad_out");
  check_same_device(out, q, "out");
  check_same_device(lse, q, "lse");
  check_same_dtype(dout, q, "grad_out");
  check_same_dtype(out, q, "out");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2)}),
              "fusedops: lse must be the contiguous float32 [batch, heads, seq_q] tensor returned by attention_fwd");
  const c10::cuda::CUDAGuard guard(q.device());
  const bool grouped = k.size(1) != q.size(1);
  at::Tensor dq = empty_output_like(q);
  // With GQA every query head gets its own fp32 dK/dV slice, summed over the group below.
  const auto per_head = std::vector<int64_t>{q.size(0), q.size(1), k.size(2), k.size(3)};
  at::Tensor dk = grouped ? at::empty(per_head, q.options().dtype(at::kFloat)) : empty_output_like(k);
  at::Tensor dv = grouped ? at::empty(per_head, q.options().dtype(at::kFloat)) : empty_output_like(v);
  if (q.numel() == 0 || k.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
  } else {
    const at::Tensor qc = in_kernel_layout(q), kc = in_kernel_layout(k), vc = in_kernel_layout(v);
    const at::Tensor dc = in_kernel_layout(dout), oc = in_kernel_layout(out);
    at::Tensor delta = at::empty_like(lse);
    AttentionBwdParams p{};
    p.dout = dc.data_ptr();
    p.q = qc.data_ptr();
    p.k = kc.data_ptr();
    p.v = vc.data_ptr();
    p.out = oc.data_ptr();
    p.lse = lse.data_ptr<float>();
    p.delta = delta.data_ptr<float>();
    p.dq = dq.data_ptr();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    p.dout_stride = strides_of(dc);
    p.q_stride = strides_of(qc);
    p.k_stride = strides_of(kc);
    p.v_stride = strides_of(vc);
    p.out_stride = strides_of(oc);
    p.dq_stride = strides_of(dq);
    p.dk_stride = strides_of(dk);
    p.dv_stride = strides_of(dv);
    set_problem(p, q, k, causal, scale);
    p.dkdv_fp32 = grouped;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    C10_CUDA_CHECK(use_sm90_backward(q, dtype) ? launch_attention_bwd_sm90(p, dtype, stream)
                                               : launch_attention_bwd(p, dtype, stream));
  }
  if (grouped) {
    const auto grouped_shape = std::vector<int64_t>{k.size(0), k.size(1), q.size(1) / k.size(1), k.size(2), k.size(3)};
    dk = dk.view(grouped_shape).sum(2).to(q.scalar_type());
    dv = dv.view(grouped_shape).sum(2).to(q.scalar_type());
  }
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("attention_fwd", &attention_fwd_cuda);
  m.impl("attention_bwd", &attention_bwd_cuda);
}

}  // namespace fusedops
