// Torch side of the softmax family: argument checks, row views, allocation, stream, launch.
// Inputs whose last dim has stride 1 and whose leading dims collapse to one row stride are read
// in place (offset and row-strided views included); anything else is made contiguous here
// (documented in docs/softmax.md). Outputs are contiguous.
#include <torch/library.h>

#include <vector>

#include "../common/torch_utils.h"
#include "softmax.h"

namespace fusedops {
namespace {

// A tensor seen as rows x cols with one row stride, and the tensor that backs the view.
struct Rows {
  at::Tensor tensor;
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
};

// Row stride of t when its leading dims collapse into one strided dim with a unit last dim;
// -1 when they do not.
int64_t collapsed_row_stride(const at::Tensor& t) {
  const int64_t dims = t.dim();
  if (dims == 0) return 1;
  const int64_t cols = t.size(-1);
  if (cols > 1 && t.stride(-1) != 1) return -1;
  int64_t row_stride = -1, expected = -1;
  for (int64_t d = dims - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (row_stride < 0) {
      row_stride = t.stride(d);
    } else if (t.stride(d) != expected) {
      return -1;
    }
    expected = t.stride(d) * t.size(d);
  }
  if (row_stride < 0) row_stride = cols;  // a single row
  return row_stride < cols ? -1 : row_stride;
}

Rows as_rows(const at::Tensor& t) {
  const int64_t cols = t.dim() ? t.size(-1) : 1;
  const int64_t rows = cols ? t.numel() / cols : 0;
  int64_t stride = collapsed_row_stride(t);
  if (stride >= 0) return {t, rows, cols, stride};
  return {t.contiguous(), rows, cols, cols};
}

at::Tensor softmax_fwd_cuda(const at::Tensor& x, double scale, bool log) {
  const DType dtype = to_dtype(x.scalar_type(), "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows in = as_rows(x);
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const SoftmaxParams p{in.tensor.data_ptr(), y.data_ptr(), in.rows, in.cols, in.row_stride, scale, log};
  C10_CUDA_CHECK(launch_softmax_fwd(p, dtype, c10::cuda::getCurrentCUDAStream()));
  return y;
}

at::Tensor softmax_bwd_cuda(const at::Tensor& grad, const at::Tensor& y, double scale, bool log) {
  const DType dtype = to_dtype(y.scalar_type(), "y");
  check_like(grad, y, "grad", "y");
  const c10::cuda::CUDAGuard guard(y.device());
  const Rows ry = as_rows(y), rg = as_rows(grad);
  at::Tensor dx = at::empty(y.sizes(), y.options().memory_format(at::MemoryFormat::Contiguous));
  const SoftmaxBackwardParams p{ry.tensor.data_ptr(), rg.tensor.data_ptr(), dx.data_ptr(), ry.rows, ry.cols,
                                ry.row_stride,        rg.row_stride,        scale,         log};
  C10_CUDA_CHECK(launch_softmax_bwd(p, dtype, c10::cuda::getCurrentCUDAStream()));
  return dx;
}

// The mask broadcast to x's shape (a view with stride 0 along broadcast dims), described by the
// strides of x's leading dims, coalesced to at most kMaxLeadDims dims. Returns the tensor that
// backs the layout (the mask itself, or a contiguous copy for masks whose strides do not
// coalesce into kMaxLeadDims dims, which needs an input of more than 5 dims).
at::Tensor mask_layout(const c10::optional<at::Tensor>& mask, const at::Tensor& x, MaskLayout& layout) {
  if (!mask) return at::Tensor();
  check_same_device(*mask, x, "mask");
  const bool is_bool = mask->scalar_type() == at::kBool;
  TORCH_CHECK(is_bool || mask->scalar_type() == x.scalar_type(), "fusedops: mask must be bool or have x's dtype ",
              x.scalar_type(), ", got ", mask->scalar_type());
  TORCH_CHECK(x.dim() >= 1 && mask->dim() <= x.dim(), "fusedops: mask of shape ", mask->sizes(),
              " is not broadcastable to x of shape ", x.sizes());
  for (int64_t d = 1; d <= mask->dim(); ++d) {
    TORCH_CHECK(mask->size(-d) == 1 || mask->size(-d) == x.size(-d), "fusedops: mask of shape ", mask->sizes(),
                " is not broadcastable to x of shape ", x.sizes());
  }
  at::Tensor source = *mask;
  for (int attempt = 0; attempt < 2; ++attempt) {
    const at::Tensor view = source.expand(x.sizes());
    std::vector<int64_t> sizes, strides;  // leading dims, innermost first
    for (int64_t d = x.dim() - 2; d >= 0; --d) {
      if (view.size(d) == 1) continue;
      if (!sizes.empty() && strides.back() * sizes.back() == view.stride(d)) {
        sizes.back() *= view.size(d);  // contiguous with (or broadcast like) the inner dim
      } else {
        sizes.push_back(view.size(d));
        strides.push_back(view.stride(d));
      }
    }
    if (static_cast<int>(sizes.size()) <= kMaxLeadDims) {
      layout.kind = is_bool ? MaskKind::Bool : MaskKind::Additive;
      layout.data = view.data_ptr();
      for (size_t i = 0; i < sizes.size(); ++i) {
        layout.lead_sizes[kMaxLeadDims - 1 - i] = sizes[i];
        layout.lead_strides[kMaxLeadDims - 1 - i] = strides[i];
      }
      layout.col_stride = view.stride(-1);
      return view;
    }
    source = view.contiguous();
  }
  TORCH_CHECK(false, "fusedops: internal error laying out the mask");
  return at::Tensor();
}

// The log-sum-exp is saved in the accumulation type.

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_softmax_fwd_cuda(const at::Tensor& x,
                                                                       const c10::optional<at::Tensor>& mask,
                                                                       double scale, bool causal, double p,
                                                                       bool training) {
  const DType dtype = to_dtype(x.scalar_type(), "x");
  TORCH_CHECK(x.dim() >= 1, "fusedops: x must have at least 1 dim");
  TORCH_CHECK(!causal || x.dim() >= 2, "fusedops: causal=True needs x with at least 2 dims (..., Lq, Lk), got ",
              x.sizes());
  TORCH_CHECK(p >= 0.0 && p < 1.0, "fusedops: dropout_p must be in [0, 1), got ", p);
  const c10::cuda::CUDAGuard guard(x.device());
  MaskedSoftmaxParams params{};
  const at::Tensor mask_view = mask_layout(mask, x, params.mask);
  const Rows in = as_rows(x);
  const bool dropout = training && p > 0.0;
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(acc_type(x.scalar_type())));
  at::Tensor rng_state = rng_state_tensor(x, x.numel() > 0);
  params.x = in.tensor.data_ptr();
  params.out = out.data_ptr();
  params.lse = lse.data_ptr();
  params.rng_state = rng_state.data_ptr<int64_t>();
  params.rows = in.rows;
  params.cols = in.cols;
  params.x_row_stride = in.row_stride;
  params.q_len = x.dim() >= 2 ? std::max<int64_t>(x.size(-2), 1) : 1;
  params.scale = scale;
  params.causal = causal;
  params.p = dropout ? p : 0.0;
  params.dropout = dropout;
  if (dropout && x.numel() > 0) params.philox = philox_args(4);
  C10_CUDA_CHECK(launch_masked_softmax_fwd(params, dtype, c10::cuda::getCurrentCUDAStream()));
  return {out, lse, rng_state};
}

at::Tensor masked_softmax_bwd_cuda(const at::Tensor& grad, const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                                   const at::Tensor& lse, const at::Tensor& rng_state, double scale, bool causal,
                                   double p) {
  const DType dtype = to_dtype(x.scalar_type(), "x");
  TORCH_CHECK(x.dim() >= 1, "fusedops: x must have at least 1 dim");
  check_like(grad, x, "grad", "x");
  check_same_device(lse, x, "lse");
  TORCH_CHECK(lse.scalar_type() == acc_type(x.scalar_type()) && lse.is_contiguous() && lse.numel() * x.size(-1) == x.numel(),
              "fusedops: lse must be the ", acc_type(x.scalar_type()), " tensor of shape x.shape[:-1] returned by masked_softmax_fwd");
  check_same_device(rng_state, x, "rng_state");
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.numel() == 2 && rng_state.is_contiguous(),
              "fusedops: rng_state must be the int64 tensor of 2 elements returned by the forward");
  TORCH_CHECK(p >= 0.0 && p < 1.0, "fusedops: dropout_p must be in [0, 1), got ", p);
  const c10::cuda::CUDAGuard guard(x.device());
  MaskedSoftmaxBackwardParams params{};
  const at::Tensor mask_view = mask_layout(mask, x, params.mask);
  const Rows rx = as_rows(x), rg = as_rows(grad);
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  params.dy = rg.tensor.data_ptr();
  params.x = rx.tensor.data_ptr();
  params.lse = lse.data_ptr();
  params.rng_state = rng_state.data_ptr<int64_t>();
  params.dx = dx.data_ptr();
  params.rows = rx.rows;
  params.cols = rx.cols;
  params.dy_row_stride = rg.row_stride;
  params.x_row_stride = rx.row_stride;
  params.q_len = x.dim() >= 2 ? std::max<int64_t>(x.size(-2), 1) : 1;
  params.scale = scale;
  params.causal = causal;
  params.p = p;
  params.dropout = p > 0.0;
  C10_CUDA_CHECK(launch_masked_softmax_bwd(params, dtype, c10::cuda::getCurrentCUDAStream()));
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("softmax_fwd", &softmax_fwd_cuda);
  m.impl("softmax_bwd", &softmax_bwd_cuda);
  m.impl("masked_softmax_fwd", &masked_softmax_fwd_cuda);
  m.impl("masked_softmax_bwd", &masked_softmax_bwd_cuda);
}

}  // namespace fusedops
