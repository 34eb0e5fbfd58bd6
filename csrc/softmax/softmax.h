// Launchers for the softmax family. Plain C++: pointers, sizes, strides and a stream, no torch.
// Every op works on `rows` rows of `cols` elements along the last dim. Inputs are read in place
// with their own row stride (the last dim has stride 1); outputs are contiguous.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/dtype.h"
#include "../common/philox.h"

namespace fusedops {

// y = softmax(scale * x) or log_softmax(scale * x) along each row.
struct SoftmaxParams {
  const void* x;
  void* y;
  int64_t rows;
  int64_t cols;
  int64_t x_row_stride;
  double scale;
  bool log;
};

// dx = scale * y * (dy - sum(dy * y))         (softmax)
// dx = scale * (dy - exp(y) * sum(dy))        (log_softmax)
struct SoftmaxBackwardParams {
  const void* y;
  const void* dy;
  void* dx;
  int64_t rows;
  int64_t cols;
  int64_t y_row_stride;
  int64_t dy_row_stride;
  double scale;
  bool log;
};

enum class MaskKind { None, Bool, Additive };

// Where the mask element of (row, col) lives. The rows are the leading dims of the input,
// described (outermost first, padded on the left with size 1) by lead_sizes; the mask is read
// through strides in elements, 0 along broadcast dims, never expanded in memory.
constexpr int kMaxLeadDims = 4;
struct MaskLayout {
  MaskKind kind = MaskKind::None;
  const void* data = nullptr;  // bool (1 byte) or the input's dtype
  int64_t lead_sizes[kMaxLeadDims] = {1, 1, 1, 1};
  int64_t lead_strides[kMaxLeadDims] = {0, 0, 0, 0};
  int64_t col_stride = 0;
};

// out = dropout(softmax(scale * x masked)), with masked logits -inf (bool mask False, or causal
// col > row % q_len) or mask added (additive mask). A fully masked row gives zeros. Also writes
// the row's log-sum-exp (fp32, fp64 for fp64 input; +inf for a fully masked row) for the backward, and
// in rng_state[0..1] the (seed, offset) its dropout used (zeros without dropout).
struct MaskedSoftmaxParams {
  const void* x;
  void* out;
  void* lse;  // fp32 (fp64 for fp64 input), one per row
  int64_t* rng_state;
  int64_t rows;
  int64_t cols;
  int64_t x_row_stride;
  int64_t q_len;  // size of dim -2 (causal)
  MaskLayout mask;
  double scale;
  bool causal;
  double p;
  bool dropout;
  PhiloxArgs philox;
};

// dx of masked_softmax, recomputing the probabilities from x, the mask and the saved lse, and
// regenerating the dropout mask from rng_state.
struct MaskedSoftmaxBackwardParams {
  const void* dy;
  const void* x;
  const void* lse;
  const int64_t* rng_state;
  void* dx;
  int64_t rows;
  int64_t cols;
  int64_t dy_row_stride;
  int64_t x_row_stride;
  int64_t q_len;
  MaskLayout mask;
  double scale;
  bool causal;
  double p;
  bool dropout;
};

cudaError_t launch_softmax_fwd(const SoftmaxParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_softmax_bwd(const SoftmaxBackwardParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_masked_softmax_fwd(const MaskedSoftmaxParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_masked_softmax_bwd(const MaskedSoftmaxBackwardParams& p, DType dtype, cudaStream_t stream);

}  // namespace fusedops
