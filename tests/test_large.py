"""Tensors of more than 2^31 elements (bf16: more than 2^32 bytes), where 32-bit element or byte
offsets would wrap: every family's kernels run on the whole tensor, and the rows at both ends and
around element 2^31 are checked against the float64 reference of those rows alone (rows are
independent); sums over rows against a float64 sum of every row. Each case skips, saying why, on a
GPU without the free memory it needs (19-43 GiB)."""
import pytest
import torch
import torch.nn.functional as F

import fusedops
from fusedops import reference
from conftest import assert_close_to_reference

ops = torch.ops.fusedops
gpu = pytest.mark.gpu
LARGE = 2**31
DTYPE = torch.bfloat16


def _need_memory(n_bytes):
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < n_bytes:
        pytest.skip(f"needs {n_bytes / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")


def _rows_past_large(n, tensors):
    """(rows, checked): [rows, n] holds element 2^31 in row rows - 2 and ends a row later;
    checked indexes the first two rows and the three around element 2^31, the last row among
    them. Skips unless `tensors` such bf16 tensors fit, with 8 GiB to spare for the references'
    float64 chunks."""
    rows = LARGE // n + 2
    _need_memory(tensors * rows * n * DTYPE.itemsize + 2**33)
    boundary = LARGE // n
    return rows, torch.tensor(sorted({0, 1, boundary - 1, boundary, boundary + 1}), device="cuda")


def _row_keep_masks(rows, n, rng_state, p):
    """The dropout keep mask of each listed row of a [*, n] call (n a multiple of 8), on the GPU."""
    masks = [reference.dropout_keep_mask((n,), rng_state, p, first=int(r) * n) for r in rows.tolist()]
    return torch.stack(masks).cuda()


def _forward_backward(fn, inputs, grad):
    """fn(*inputs) and its gradients with respect to inputs, for the output gradient grad (cast to
    the output's dtype): how each test runs torch's op, in float64 and in bf16, on its rows."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, grad.to(out.dtype))


def _assert_row_sums(ours, terms, *tensors, name):
    """ours against the float64 sum over rows of terms(*rows), taken 2^27 elements at a time. The
    bound, 2^-21 of the largest column sum of the terms' magnitudes (about 0.16 over 2^19 rows of
    normal terms), is far above what fp32 partial sums err and below what one row missed or
    counted twice moves a column (about 1); on top, half an ulp of ours' dtype for its rounding."""
    chunk = max(1, 2**27 // tensors[0].shape[-1])
    total = magnitude = 0
    for parts in zip(*(t.split(chunk) for t in tensors)):
        term = terms(*(p.double() for p in parts))
        total, magnitude = total + term.sum(0), magnitude + term.abs().sum(0)
    excess = (ours.double() - total).abs() - total.abs() * torch.finfo(ours.dtype).eps / 2
    assert excess.max().item() <= 2**-21 * magnitude.max().item(), f"{name}: max excess error {excess.max().item():.3e}"


def test_keep_mask_from_an_element_on_is_the_whole_masks_tail():
    rng_state = torch.tensor([1234, 56], dtype=torch.int64)
    whole = reference.dropout_keep_mask((40, 24), rng_state, 0.4)
    assert torch.equal(reference.dropout_keep_mask((24,), rng_state, 0.4, first=37 * 24), whole[37])


@gpu
@pytest.mark.parametrize("n, log", [(4104, False), (4104, True), (65536, False), (2**20, False)])
def test_softmax(n, log):
    """Register rows (4104), cluster rows (65536) and streamed rows (2^20), forward and backward."""
    rows, checked = _rows_past_large(n, tensors=4)
    x = torch.randn(rows, n, dtype=DTYPE, device="cuda").requires_grad_(True)
    grad = torch.randn_like(x)
    fn = fusedops.log_softmax if log else fusedops.softmax
    out = fn(x)
    (dx,) = torch.autograd.grad(out, x, grad)
    x, grad, out, dx = (t.detach()[checked] for t in (x, grad, out, dx))  # frees the full tensors

    def torch_fn(t):
        return torch.log_softmax(t, -1) if log else torch.softmax(t, -1)

    ref_out, (ref_dx,) = _forward_backward(torch_fn, [x.double()], grad)
    torch_out, (torch_dx,) = _forward_backward(torch_fn, [x], grad)
    backward = torch._log_softmax_backward_data if log else torch._softmax_backward_data
    best_dx = backward(grad.double(), out.double(), -1, torch.float64).to(DTYPE)
    assert_close_to_reference(out, ref_out, torch_out, name="output")
    assert_close_to_reference(dx, ref_dx, torch_dx, name="grad", best_out=best_dx)


@gpu
def test_masked_softmax_causal_dropout():
    """[1, 33, 8192, 8192] scores (33 * 2^26 elements) with a [1, 1, L, L] bool mask, causal and
    dropout: output, gradient and the keep mask bit for bit (Philox drawn at each element's own
    index past 2^31)."""
    heads, length, p = 33, 8192, 0.25
    _need_memory(4 * heads * length * length * DTYPE.itemsize + 2**31)
    x = torch.randn(1, heads, length, length, dtype=DTYPE, device="cuda").requires_grad_(True)
    mask = torch.rand(1, 1, length, length, device="cuda") > 0.2
    grad = torch.randn_like(x)
    out, lse, rng_state = ops.masked_softmax_fwd(x, mask, 1.0, True, p, True)
    (dx,) = torch.autograd.grad(out, x, grad)
    boundary = LARGE // length
    rows = torch.tensor([0, 1, boundary - 1, boundary, boundary + 1, heads * length - 1], device="cuda")
    x, grad, out, dx, lse = (t.detach().reshape(heads * length, -1)[rows].squeeze(-1) for t in (x, grad, out, dx, lse))
    queries = rows % length
    visible = mask[0, 0, queries] & (torch.arange(length, device="cuda") <= queries[:, None])
    keep = _row_keep_masks(rows, length, rng_state, p)
    probs64, lse64 = reference.masked_softmax(x.double(), visible, 1.0, False, 0.0, None)
    ref_out = torch.where(keep, probs64 / (1 - p), 0.0)
    dropped_grad = torch.where(keep, grad.double() / (1 - p), 0.0)
    ref_dx = reference.masked_softmax_backward(dropped_grad, x.double(), visible, lse64, None, 1.0, False, 0.0)
    assert torch.equal(out[visible] != 0, keep[visible] & (probs64[visible].to(DTYPE) != 0))
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(dx.double(), ref_dx, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), lse64, atol=1e-4, rtol=1e-5)


def _norm(layer, x, weight, bias):
    n = x.shape[-1]
    return F.layer_norm(x, (n,), weight, bias, 1e-5) if layer else F.rms_norm(x, (n,), weight, 1e-5)


@gpu
@pytest.mark.parametrize("n", [4104, 32768])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "add_layer_norm"])
def test_norm(kind, n):
    """Register rows (4104) and the backward's staged cluster rows (32768); fp32 weight and bias,
    so dweight and dbias (sums over 2^19 or 2^16 rows) come back in fp32."""
    layer, add = "layer" in kind, kind.startswith("add_")
    rows, checked = _rows_past_large(n, tensors=7 if add else 4)
    x = torch.randn(rows, n, dtype=DTYPE, device="cuda")
    residual = torch.randn_like(x) if add else None
    weight = torch.randn(n, device="cuda")
    bias = torch.randn(n, device="cuda") if layer else None
    names = ["x"] + ["residual"] * add + ["weight"] + ["bias"] * layer
    leaves = [t.requires_grad_(True) for t in (x, residual, weight, bias) if t is not None]
    if add:
        out, normed = fusedops.add_layer_norm(x, residual, (n,), weight, bias)
        normed = normed.detach()
        torch.testing.assert_close(normed[checked], (x[checked] + residual[checked]).detach(), rtol=0, atol=0)
    else:
        out = fusedops.layer_norm(x, (n,), weight, bias) if layer else fusedops.rms_norm(x, (n,), weight, 1e-5)
        normed = x.detach()
    dy = torch.randn_like(out)
    grads = dict(zip(names, torch.autograd.grad(out, leaves, dy)))
    if add:
        assert torch.equal(grads["residual"][checked], grads["x"][checked])

    def run(dtype):
        w, b = (None if t is None else t.detach().to(dtype) for t in (weight, bias))
        return _forward_backward(lambda h: _norm(layer, h, w, b), [normed[checked].to(dtype)], dy[checked])

    ref_out, (ref_dx,) = run(torch.float64)
    torch_out, (torch_dx,) = run(DTYPE)
    assert_close_to_reference(out.detach()[checked], ref_out, torch_out, name=f"{kind} out")
    assert_close_to_reference(grads["x"][checked], ref_dx, torch_dx, name=f"{kind} dx")

    def xhat(h):
        centred = h - h.mean(-1, keepdim=True) if layer else h
        return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)

    _assert_row_sums(grads["weight"], lambda h, g: g * xhat(h), normed, dy, name="dweight")
    if layer:
        _assert_row_sums(grads["bias"], lambda g: g, dy, name="dbias")


@gpu
def test_elementwise():
    """The 64-bit index path (2^31 elements or more): bias_gelu forward and backward (dbias, the
    column sum of dx over every row) and bias_dropout_add's keep mask."""
    n, p = 4104, 0.25
    rows, checked = _rows_past_large(n, tensors=4)
    x = torch.randn(rows, n, dtype=DTYPE, device="cuda").requires_grad_(True)
    bias = torch.randn(n, dtype=DTYPE, device="cuda").requires_grad_(True)
    out = fusedops.bias_gelu(x, bias)
    grad = torch.randn_like(out)
    dx, dbias = torch.autograd.grad(out, (x, bias), grad)
    x, bias, out = x.detach(), bias.detach(), out.detach()

    ref_out, (ref_dx,) = _forward_backward(lambda h: F.gelu(h + bias.double()), [x[checked].double()], grad[checked])
    torch_out, (torch_dx,) = _forward_backward(lambda h: F.gelu(h + bias), [x[checked]], grad[checked])
    assert_close_to_reference(out[checked], ref_out, torch_out, name="bias_gelu out")
    assert_close_to_reference(dx[checked], ref_dx, torch_dx, name="bias_gelu dx")
    # dbias is the column sum of the rounded dx, as PyTorch's autograd sums a broadcast bias's gradient.
    _assert_row_sums(dbias, lambda g: g, dx, name="dbias")
    del out, grad, dx
    out, rng_state = ops.bias_dropout_add_fwd(x, bias, torch.zeros_like(x), p, True)
    keep = _row_keep_masks(checked, n, rng_state, p)
    summed = x[checked].float() + bias.float()
    assert torch.equal(out[checked] != 0, keep & (summed != 0))
    torch.testing.assert_close(out[checked], torch.where(keep, summed / (1 - p), 0.0).to(DTYPE))


@gpu
def test_attention():
    """[16385, 8, 128, 128] q, k, v (2^31 + 2^17 elements each; the last batch starts at element
    2^31), causal: the first and last batches' output and gradients, FlashAttention's rule."""
    shape = (16385, 8, 128, 128)
    _need_memory(8 * torch.Size(shape).numel() * DTYPE.itemsize + 2**33)
    q, k, v = (torch.randn(shape, dtype=DTYPE, device="cuda").requires_grad_(True) for _ in range(3))
    out = fusedops.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    batches = torch.tensor([0, shape[0] - 1], device="cuda")
    q, k, v, grad, out = (t.detach()[batches] for t in (q, k, v, grad, out))
    grads = [g[batches] for g in grads]

    def sdpa(*inputs):
        return F.scaled_dot_product_attention(*inputs, is_causal=True)

    ref_out, ref_grads = _forward_backward(sdpa, [q.double(), k.double(), v.double()], grad)
    torch_out, torch_grads = _forward_backward(sdpa, [q, k, v], grad)
    assert_close_to_reference(out, ref_out, torch_out, factor=2.0, atol=1e-5, name="attention out")
    for name, ours, ref, theirs in zip(["dq", "dk", "dv"], grads, ref_grads, torch_grads):
        assert_close_to_reference(ours, ref, theirs, factor=3.0, atol=1e-4, name=name)
