"""Softmax family: API and errors (CPU, run in CI), numerics, masks and dropout on the GPU."""
import pytest
import torch
from torch.library import opcheck

import fusedops
from fusedops import reference
from conftest import assert_close_to_reference, assert_double_backward_raises

ops = torch.ops.fusedops
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Row lengths by the path they take (on sm_90): 1, 7, 41, 1023, 4097 (no 16-byte vector fits:
# streamed scalar rows), 8 and 128 (sub-warp groups), 1024 and 4096 (a block per row, in
# registers), 200 and 1000 (register rows whose groups reach past the row's end: their last
# vectors load nothing), 16384 (register rows: 512 threads of 32 elements in the 16-bit forward
# and the fp32 backward, 1024 threads of 16 in the fp32 forward; the 16-bit backward's
# straight-line rows of two vectors a thread),
# 32768 and 65536 (staged rows: clusters of 2-8 blocks, fewer rows than clusters; at 32768 the
# fp32 forward takes 1024 threads of 32 elements and the 16-bit backward straight-line rows of
# four vectors a thread); plus a row count past 65535 (1-D grid over rows).
# LONG_SHAPES: 262144 (staged: 16 blocks, of 256 threads in the 16-bit forward, 512 elsewhere),
# 1048576 (streamed, two passes).
SHAPES = [(1,), (3, 7), (6, 41), (5, 1023), (4, 4097), (70000, 8), (3, 5, 128), (33, 1024), (2, 3, 4096),
          (700, 200), (9, 1000), (7, 16384), (3, 32768), (2, 65536)]
LONG_SHAPES = [(2, 262144), (1, 1048576)]


def _torch_softmax(x, scale, log):
    z = x * scale
    return torch.log_softmax(z, -1) if log else torch.softmax(z, -1)


def _torch_masked(x, mask, scale, causal):
    """PyTorch's own masked softmax in x's dtype: where + softmax, fully masked rows as zeros
    with a zero gradient (a row of -inf logits would give NaN through softmax's backward)."""
    z = reference.masked_logits(x, mask, scale, causal).to(x.dtype)
    empty = (z == float("-inf")).all(-1, keepdim=True)
    return torch.softmax(z.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)


def _grads(fn, x, grad):
    x = x.detach().requires_grad_(True)  # keeps x's strides and storage offset
    out = fn(x)
    (dx,) = torch.autograd.grad(out, x, grad)
    return out.detach(), dx


# ---------------------------------------------------------------------------------------------
# CPU: errors, reference semantics, opcheck, torch.compile


def test_errors_name_the_argument():
    x = torch.randn(2, 3, 4, 8)
    with pytest.raises(TypeError, match="input must be"):
        fusedops.softmax(torch.ones(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        fusedops.log_softmax([1.0, 2.0])
    with pytest.raises(IndexError, match="dim 4 is out of range"):
        fusedops.softmax(x, 4)
    with pytest.raises(TypeError, match="dim must be an int"):
        fusedops.softmax(x, 1.0)
    with pytest.raises(TypeError, match="scale must be a Python number"):
        fusedops.log_softmax(x, scale="2")
    with pytest.raises(TypeError, match="mask must be bool or have input's dtype"):
        fusedops.masked_softmax(x, torch.ones(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="mask of shape \\(3, 1, 1, 8\\) is not broadcastable"):
        fusedops.masked_softmax(x, torch.ones(3, 1, 1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask of shape"):
        fusedops.masked_softmax(x, torch.ones(1, 2, 3, 4, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        fusedops.masked_softmax(x, "causal")
    with pytest.raises(ValueError, match="input must have at least 2 dims"):
        fusedops.masked_softmax(torch.randn(8), causal=True)
    with pytest.raises(ValueError, match="input must have at least 1 dim "):
        fusedops.masked_softmax(torch.tensor(1.0))
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError, match="dropout_p must be a number in \\[0, 1\\)"):
            fusedops.masked_softmax(x, dropout_p=p)


@pytest.mark.parametrize("log", [False, True])
def test_cpu_matches_torch(log):
    x = torch.randn(3, 5, 40)
    for dim in (-1, 1, 0):
        ours = (fusedops.log_softmax if log else fusedops.softmax)(x, dim, scale=0.7)
        theirs = torch.log_softmax(0.7 * x, dim) if log else torch.softmax(0.7 * x, dim)
        torch.testing.assert_close(ours, theirs)


def test_cpu_gradients_match_autograd():
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: fusedops.softmax(t, scale=1.3), (x,))
    torch.autograd.gradcheck(lambda t: fusedops.log_softmax(t, 0, scale=-0.4), (x,))
    mask = torch.rand(4, 7) > 0.3
    mask[:, 0] = True
    torch.autograd.gradcheck(lambda t: fusedops.masked_softmax(t, mask, scale=0.5), (x,))
    torch.autograd.gradcheck(lambda t: fusedops.masked_softmax(t, causal=True, scale=2.0), (x,))


@pytest.mark.parametrize("fn", [fusedops.softmax, fusedops.log_softmax, fusedops.masked_softmax])
def test_cpu_double_backward_raises_clearly(fn):
    assert_double_backward_raises(fn, torch.randn(3, 8, dtype=torch.float64, requires_grad=True))


def test_cpu_additive_mask_gets_no_gradient():
    """A float mask that requires grad is an input of the C++ autograd but gets no gradient."""
    x = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    out = fusedops.masked_softmax(x, mask, scale=0.5)
    dx, dmask = torch.autograd.grad(out.pow(2).sum(), [x, mask], allow_unused=True)
    assert dmask is None
    expected = torch.softmax(0.5 * x + mask.detach(), -1)
    (ref,) = torch.autograd.grad(expected.pow(2).sum(), x)
    torch.testing.assert_close(dx, ref)
    _, lse, rng_state = ops.masked_softmax_fwd(x, mask, 1.0, False, 0.0, True)
    assert not lse.requires_grad and not rng_state.requires_grad


def test_cpu_masked_matches_sdpa_conventions():
    x = torch.randn(2, 3, 6, 9)
    keep = torch.rand(2, 1, 6, 9) > 0.4
    additive = torch.randn(2, 1, 1, 9)
    for mask in (keep, additive, None):
        for causal in (False, True):
            ours = fusedops.masked_softmax(x, mask, scale=0.3, causal=causal)
            z = 0.3 * x
            if mask is not None:
                z = z.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else z + mask
            if causal:
                z = z.masked_fill(~torch.ones(6, 9, dtype=torch.bool).tril(), float("-inf"))
            torch.testing.assert_close(ours, torch.softmax(z, -1).nan_to_num(0.0))


def _fully_masked_rows_check(device, dtype=torch.float32):
    x = torch.randn(3, 4, 16, dtype=dtype, device=device, requires_grad=True)
    mask = torch.rand(3, 4, 16, device=device) > 0.5
    mask[0, 1] = False
    mask[2, :] = False
    out = fusedops.masked_softmax(x, mask)
    assert not torch.isnan(out).any()
    assert (out[0, 1] == 0).all() and (out[2] == 0).all()
    out.backward(torch.randn_like(out))
    assert not torch.isnan(x.grad).any()
    assert (x.grad[0, 1] == 0).all() and (x.grad[2] == 0).all()
    assert (x.grad[~mask] == 0).all()


def test_cpu_fully_masked_rows_give_zeros():
    _fully_masked_rows_check("cpu")


def test_cpu_dropout_fraction_and_replay():
    x = torch.randn(16, 64, 1024, dtype=torch.float64, requires_grad=True)  # 2^20 elements
    torch.manual_seed(3)
    out, lse, rng_state = ops.masked_softmax_fwd(x, None, 1.0, False, 0.3, True)
    assert abs((out == 0).double().mean().item() - 0.3) < 0.01
    torch.manual_seed(3)
    assert torch.equal(ops.masked_softmax_fwd(x, None, 1.0, False, 0.3, True)[0], out)
    keep = reference.dropout_keep_mask(x.shape, rng_state, 0.3)
    grad = torch.randn_like(x)
    (dx,) = torch.autograd.grad(out, x, grad)
    y = torch.softmax(x.detach(), -1)
    g = torch.where(keep, grad / 0.7, 0.0)
    torch.testing.assert_close(dx, y * (g - (g * y).sum(-1, keepdim=True)))


def _op_samples(device, dtype):
    x = torch.randn(4, 6, 12, dtype=dtype, device=device, requires_grad=True)
    mask = torch.rand(4, 1, 12, device=device) > 0.3
    additive = torch.randn(1, 6, 12, dtype=dtype, device=device)
    return [
        (ops.softmax_fwd, (x, 0.5, False)),
        (ops.softmax_fwd, (x, 1.0, True)),
        (ops.softmax_bwd, (torch.randn_like(x), torch.softmax(x, -1).detach(), 2.0, False)),
        (ops.masked_softmax_fwd, (x, mask, 0.5, True, 0.0, True)),
        (ops.masked_softmax_fwd, (x, additive, 1.0, False, 0.0, True)),
        (ops.masked_softmax_fwd, (x, None, 1.0, True, 0.0, False)),
    ]


def test_opcheck_cpu():
    for op, args in _op_samples("cpu", torch.float32):
        opcheck(op, args)
    x = torch.randn(4, 6, 12)
    out, lse, rng = ops.masked_softmax_fwd(x, None, 1.0, True, 0.0, True)
    opcheck(ops.masked_softmax_bwd, (torch.randn_like(x), x, None, lse, rng, 1.0, True, 0.0))


def _compiled_matches_eager(device, dtype):
    x = torch.randn(3, 4, 8, 40, dtype=dtype, device=device)
    mask = torch.rand(3, 1, 8, 40, device=device) > 0.3
    grad = torch.randn_like(x)

    def fn(t):
        return (fusedops.softmax(t, scale=0.5) + fusedops.log_softmax(t, 2)
                + fusedops.masked_softmax(t, mask, scale=0.3, causal=True))

    eager_out, eager_dx = _grads(fn, x, grad)
    compiled_out, compiled_dx = _grads(torch.compile(fn, fullgraph=True), x, grad)
    # Inductor adds the three outputs (and their gradients) in fp32 and rounds once, eager rounds
    # after every add: in bf16 that differs by an ulp of the sum.
    tolerance = {"atol": 8e-3, "rtol": 1.6e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(compiled_out, eager_out, **tolerance)
    torch.testing.assert_close(compiled_dx, eager_dx, **tolerance)


def test_compile_fullgraph_cpu():
    _compiled_matches_eager("cpu", torch.float32)


# ---------------------------------------------------------------------------------------------
# GPU: numerics against a float64 reference, with PyTorch's own error as the yardstick


def _check_softmax(shape, dtype, log, scale=1.0, x=None, grad=None):
    x = torch.randn(shape, dtype=dtype, device="cuda") if x is None else x
    grad = torch.randn(shape, dtype=dtype, device="cuda") if grad is None else grad
    fn = fusedops.log_softmax if log else fusedops.softmax
    out, dx = _grads(lambda t: fn(t, scale=scale), x, grad)
    ref_out, ref_dx = _grads(lambda t: _torch_softmax(t, scale, log), x.double(), grad.double())
    torch_out, torch_dx = _grads(lambda t: _torch_softmax(t, scale, log), x, grad)
    assert_close_to_reference(out, ref_out, torch_out, name="output")
    assert_close_to_reference(dx, ref_dx, torch_dx, name="grad", best_out=_best_grad(torch_out, grad, scale, log))


def _best_grad(out, grad, scale, log):
    """The gradient a correctly rounded backward gives from the forward's output rounded to its
    dtype: PyTorch's CUDA softmax backward rounds intermediates (session 34: a quarter of its bf16
    results more than half an ulp off on the y it is given, ours fewer than 1 in 20000), yet its worst error against
    the float64 reference can be the smaller by luck (bf16 N = 8192: 1.9e-5 against our 4.2e-5)."""
    backward = torch._log_softmax_backward_data if log else torch._softmax_backward_data
    return (scale * backward(grad.double(), out.double(), -1, torch.float64)).to(out.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("log", [False, True])
def test_softmax_matches_reference(shape, dtype, log):
    _check_softmax(shape, dtype, log, scale=0.8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", LONG_SHAPES, ids=str)
@pytest.mark.parametrize("log", [False, True])
def test_softmax_long_rows(shape, dtype, log):
    _check_softmax(shape, dtype, log)


@pytest.mark.gpu
@pytest.mark.parametrize("log", [False, True])
def test_softmax_under_autocast_keeps_the_input_dtype(log):
    """fusedops ops are on none of autocast's lists: under torch.autocast a bf16 input stays
    bf16 (torch's softmax computes in and returns fp32 there), with torch's values rounded once."""
    x = torch.randn(64, 1000, dtype=torch.bfloat16, device="cuda")
    fused, theirs = (fusedops.log_softmax, torch.log_softmax) if log else (fusedops.softmax, torch.softmax)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fused(x, -1, scale=0.5)
        expected = theirs(x * 0.5, -1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.to(torch.bfloat16))


# Many rows per launch. Register rows take a block per row group (many blocks, the last one partly
# past the end); staged rows run on a persistent grid (one resident wave of clusters) that loops
# over rows through a ring of shared-memory stages, so every cluster handles many rows, reusing each
# stage and alternating its partial slots. A staged forward block's chunk is 32 KB (256 threads of 8
# vectors, two an SM: 16384 16-bit / 8192 fp32 elements), a backward block's 16 KB of each tensor
# (256 threads of 4 vectors, two an SM: 8192 / 4096 elements); where that takes more than 16 blocks,
# the backward's is 32 KB in 512-thread blocks, and where that does too, either's is 64 KB in
# 512-thread blocks. Register rows reach 1024 threads (the fp32 forward 16384) or 512 threads of
# 32 elements (the 16-bit forward and the fp32 backward 16384); the fp32 forward's rows of 16385-32768
# elements take 1024 threads of 32 elements (reg at 20000 and 32768 below).
# Forward clusters, 16-bit backward ones of up to 8 blocks and fp32 backward ones run pipelined,
# fp32 forward clusters of 9 or more holding each row in registers (131072, 131080, 262144). Row
# lengths (forward / backward blocks, bf16 then fp32; "reg" for register rows): 8192 (forward: a
# register block of 256 / 512 threads; backward: the straight-line vector rows), 8200 (reg / the
# 1024-thread re-read rows; reg / reg: the fp32 backward in 512 threads of 32 elements, its last
# vectors past the row's end), 20000 (2 / 3; reg / 5), 32768 (2 / vector rows; reg / 8), 40008 (3 / 5; 5 / 10:
# odd clusters, partial last chunks), 65536 (4 / 8; 8 / 16), 131072 (8 / 16; 16 / 16
# with 32 KB), 131080 (9 / 9 with 32 KB; 9 / 9 with 64 KB: non-portable clusters), 262144 (16 / 16
# with 32 KB; 16 / 16 with 64 KB), 262152 (9 / 9 with 64 KB; streamed), 524288 (16 / 16 with 64 KB;
# streamed), 524296 (streamed).
MANY_ROW_SHAPES = [(70000, 256), (20000, 1024), (3000, 8192), (4000, 8200), (2000, 20000), (600, 32768), (400, 40008),
                   (300, 65536), (60, 131072), (40, 131080), (30, 262144), (12, 262152), (6, 524288),
                   (4, 524296)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", MANY_ROW_SHAPES, ids=str)
@pytest.mark.parametrize("log", [False, True])
def test_softmax_rows_loop(shape, dtype, log):
    _check_softmax(shape, dtype, log, scale=1.3)


# The staged 16-bit forward takes the max logit over the raw inputs (their min for a negative
# scale) where the scale is finite and nonzero, element by element otherwise (0: every logit 0).
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(300, 40008), (30, 262144)], ids=str)
@pytest.mark.parametrize("scale", [-0.6, 0.0])
def test_staged_rows_negative_and_zero_scale(shape, dtype, scale):
    for log in (False, True):
        _check_softmax(shape, dtype, log, scale=scale)


# The staged 16-bit forward takes a thread's exps in one FMA each while its shift's exp argument
# is under 256 in magnitude, else as (x - shift) * scale: logits of standard deviation 40 put
# threads on both sides (pipelined clusters of 4 blocks at 65536 columns, of 16 at 262144).
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(300, 65536), (30, 262144)], ids=str)
def test_staged_rows_large_logits(shape, dtype):
    x = (torch.randn(shape, device="cuda") * 40).to(dtype)
    for log in (False, True):
        _check_softmax(shape, dtype, log, scale=1.1, x=x)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_masked_rows_loop(causal):
    """Masked register rows over many blocks (bool mask, dropout off)."""
    x = torch.randn(4, 64, 96, 1024, dtype=torch.bfloat16, device="cuda")
    _check_masked(x, _keep_mask((4, 1, 96, 1024)), 0.125, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("log", [False, True])
def test_softmax_float64(log):
    for shape in [(3, 7), (4, 1024), (2, 5000)]:
        _check_softmax(shape, torch.float64, log, scale=1.5)


@pytest.mark.gpu
@pytest.mark.sanitizer
# (6000, 128): many blocks of row groups; (5, 1000): groups reaching past the row's end;
# staged rows (forward / backward blocks, fp16 then fp32): (2, 20000) (2 / 3; fp32 forward: 1024-thread
# register rows of 32 elements a thread, whose last 12768 slots lie past the row's end / 5), (1, 70000)
# (5 / 9; 9 / 9 with 32 KB backward chunks), (2, 140000) (9 / 9 with 32 KB; 9 / 9 with 64 KB
# chunks, non-portable clusters; fp32 forward rows of 9 blocks held in registers); (800, 20000):
# more rows than the persistent grid of clusters holds, so clusters loop, each stage refilled and
# reused under its next phase, each inbox of the cluster exchange reused; (1600, 8200) runs the
# fp32 forward's 1024-thread register rows (one row a block), the fp16 backward's 1024-thread
# re-read rows and the fp32 backward's 512-thread rows of 32 elements a thread.
@pytest.mark.parametrize("shape", [(3, 7), (5, 64), (4, 1024), (5, 1000), (2, 4096), (2, 20000), (1, 70000),
                                   (2, 140000), (6000, 128), (800, 20000), (1600, 8200)], ids=str)
def test_softmax_small_cases_sanitizer(shape):
    for log in (False, True):
        _check_softmax(shape, torch.float16, log)
        _check_softmax(shape, torch.float32, log)


# Backward rows of exactly 8 KB a tensor (16-bit: one 16-byte vector a thread of a 512-thread
# block; fp32: register rows), of exactly 16 and 32 KB (two vectors a thread of 512- and
# 1024-thread blocks), of exactly 64 KB (16-bit: four vectors a thread of 1024; fp32: register
# rows of 512 threads), and rows re-read from L2 in a loop, of 8-16 KB a tensor in 512-thread blocks
# (fp32 N = 2049-4095, 16-bit 4097-8191) and of 16-32 KB in 1024-thread blocks (fp32 4097-8191,
# 16-bit 8193-16383): each over more rows than one wave of blocks holds, and the shortest of the
# loop's rows, whose last vectors are past the row's end (one thread's second vector in 16-bit
# rows, read two at a time).
@pytest.mark.gpu
@pytest.mark.sanitizer
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_bytes, rows",
                         [(8192, 600), (16384, 600), (32768, 600), (65536, 300), (8192 + 16, 5), (16384 - 16, 600),
                          (16384 + 16, 5), (32768 - 16, 600)])
def test_softmax_reread_backward_rows_sanitizer(dtype, row_bytes, rows):
    for log in (False, True):
        _check_softmax((rows, row_bytes // dtype.itemsize), dtype, log, scale=0.9)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [7, 1024, 4096, 8192, 40000])
def test_views_used_in_place(dtype, cols):
    """Row-strided views (aligned and at storage offset 1) and non-contiguous grad_outputs
    (transposed; row-strided, as the backward's vector rows read it in place)."""
    base = torch.randn(6, 2 * cols + 8, dtype=dtype, device="cuda")
    grad_base = torch.randn(6, cols + 24, dtype=dtype, device="cuda")
    for x in (base[:, :cols], base[:, 1:cols + 1], base[:, 8:cols + 8]):
        for grad in (torch.randn(cols, 6, dtype=dtype, device="cuda").t(), grad_base[:, 8:cols + 8]):
            _check_softmax(x.shape, dtype, False, x=x, grad=grad)
            _check_softmax(x.shape, dtype, True, x=x, grad=grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_dim_other_than_last(dtype):
    x = torch.randn(4, 300, 6, dtype=dtype, device="cuda")
    for dim in (0, 1, -2):
        for fn, ref in ((fusedops.softmax, torch.softmax), (fusedops.log_softmax, torch.log_softmax)):
            out = fn(x, dim)
            assert_close_to_reference(out, ref(x.double(), dim), ref(x, dim))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [9, 256, 4096, 40000])
@pytest.mark.parametrize("scale", [1.0, 0.7])  # 0.7: logits are rounded products (an FMA would differ)
def test_infinities_and_large_inputs(dtype, cols, scale):
    # fp16 tops out at 65504: its log-probs (down to -2 * big * scale) must stay finite
    big = 3e3 if dtype == torch.float16 else 1e30
    x = torch.randn(4, cols, dtype=torch.float32, device="cuda") * big
    x = x.to(dtype)
    x[1, ::3] = float("-inf")  # -inf entries get probability 0
    x[2] = float("-inf")       # a row with no finite logit gives zeros (torch: NaN)
    x[3, 1] = float("inf")     # +inf makes the row NaN, as in torch
    out = fusedops.softmax(x, scale=scale)
    ref = torch.softmax(x.double() * scale, -1)
    torch.testing.assert_close(out[:2].double(), ref[:2], atol=1e-2 if dtype != torch.float32 else 1e-6, rtol=0)
    assert (out[1, ::3] == 0).all()
    assert (out[2] == 0).all()
    assert torch.isnan(out[3]).any()
    log_out = fusedops.log_softmax(x, scale=scale)
    log_ref = torch.log_softmax(x.double() * scale, -1)
    assert torch.isfinite(log_out[0]).all()
    torch.testing.assert_close(log_out[0].max().double(), log_ref[0].max(), atol=1e-2, rtol=0)  # the row's top log-prob
    assert (log_out[2] == float("-inf")).all()
    assert (log_out[1, ::3] == float("-inf")).all()


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [5000, 40008, 262144])
def test_softmax_repeatable(cols):
    x = torch.randn(max(1, 2**20 // cols), cols, device="cuda")
    grad = torch.randn_like(x)
    first = _grads(fusedops.softmax, x, grad)
    second = _grads(fusedops.softmax, x, grad)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [8200, 40008, 131080])
def test_staged_rows_strided_views(dtype, cols):
    """Staged rows read x and grad_output through their own row strides (aligned row-strided
    views, offset by 8 elements), and take many rows per cluster."""
    rows = 2 * 132 + 3
    base = torch.randn(rows, cols + 16, dtype=dtype, device="cuda")
    grad_base = torch.randn(rows, cols + 24, dtype=dtype, device="cuda")
    x, grad = base[:, 8:cols + 8], grad_base[:, 16:cols + 16]
    for log in (False, True):
        _check_softmax(x.shape, dtype, log, scale=0.7, x=x, grad=grad)


# ---- masked_softmax ----------------------------------------------------------------------------


def _keep_mask(shape, p_keep=0.7):
    """A random bool mask that keeps key 0 of every row, so no row is fully masked and PyTorch's
    own result (the yardstick) has no NaN."""
    mask = torch.rand(shape, device="cuda") < p_keep
    mask[..., 0] = True
    return mask


def _check_masked(x, mask, scale, causal, grad=None):
    grad = torch.randn_like(x) if grad is None else grad
    out, dx = _grads(lambda t: fusedops.masked_softmax(t, mask, scale=scale, causal=causal), x, grad)
    mask64 = mask.double() if mask is not None and mask.dtype != torch.bool else mask
    ref_out, ref_dx = _grads(lambda t: _torch_masked(t, mask64, scale, causal), x.double(), grad.double())
    torch_out, torch_dx = _grads(lambda t: _torch_masked(t, mask, scale, causal), x, grad)
    assert_close_to_reference(out, ref_out, torch_out, name="output")
    assert_close_to_reference(dx, ref_dx, torch_dx, name="grad")


def _mask_shapes(kind, lq, lk):
    if kind == "bool":
        return [(2, 1, lq, lk), (2, 1, 1, lk), (lq, lk), (2, 3, lq, lk)]
    if kind == "additive":
        return [(2, 1, lq, lk), (1, 3, lq, 1), (lk,)]
    return [None]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq", [(5, 7), (64, 64), (33, 1024), (8, 4096), (4, 20000)], ids=str)
@pytest.mark.parametrize("kind", ["bool", "additive", "none"])
@pytest.mark.parametrize("causal", [False, True])
def test_masked_softmax_matches_reference(dtype, seq, kind, causal):
    """Broadcast masks of several shapes, read through their strides (0 along broadcast dims)."""
    lq, lk = seq
    x = torch.randn(2, 3, lq, lk, dtype=dtype, device="cuda")
    for shape in _mask_shapes(kind, lq, lk):
        mask = None
        if kind == "bool":
            mask = _keep_mask(shape)
        elif kind == "additive":
            mask = torch.randn(shape, dtype=dtype, device="cuda")
        _check_masked(x, mask, 0.6, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_softmax_many_rows_and_views(dtype):
    x = torch.randn(70000, 8, dtype=dtype, device="cuda")
    mask = _keep_mask((8,))
    _check_masked(x, mask, 1.0, False)
    x = torch.randn(2, 4, 300, 300, dtype=dtype, device="cuda")
    mask = _keep_mask((1, 1, 300, 300)).expand(2, 1, 300, 300)  # stride-0 view
    grad = torch.randn(300, 2, 4, 300, dtype=dtype, device="cuda").permute(1, 2, 0, 3)  # non-contiguous
    _check_masked(x, mask, 0.125, True, grad)
    base = torch.randn(2, 4, 64, 130, dtype=dtype, device="cuda")
    _check_masked(base[..., 1:129], None, 1.0, True)  # offset view, row stride 130


def _mask_maker(kind, dtype):
    """Makes masks of a shape: bool (_keep_mask) or additive (its kept keys random, the rest -inf)."""
    def make(shape):
        keep = _keep_mask(shape)
        if kind == "bool":
            return keep
        return torch.randn(shape, dtype=dtype, device="cuda").masked_fill(~keep, float("-inf"))
    return make


def _permuted_mask(make, shape, storage_order):
    """A mask of `shape` whose dims lie in memory in `storage_order` (outermost first), key 0 kept."""
    mask = make([shape[d] for d in storage_order]).permute([storage_order.index(d) for d in range(len(shape))])
    mask[..., 0] = True if mask.dtype == torch.bool else 0.0
    return mask


# (x shape, mask) pairs whose row-to-mask maps take each form of the kernels' row locator: at
# most two divisions and a multiply (broadcast dims inside, outside and between the mask's own,
# transposed masks, a lone query dim), or the chain of every lead dim (three or more divisions;
# and every additive mask).
MASK_LAYOUTS = [
    ((2, 3, 5), lambda lk, make: make((2, 1, 5, lk))),
    ((2, 3, 5), lambda lk, make: make((2, 3, 1, lk))),
    ((2, 3, 5), lambda lk, make: make((5, lk))),
    ((2, 3, 5), lambda lk, make: make((1, 1, 5, lk)).expand(2, 3, 5, lk)),
    ((2, 3, 5), lambda lk, make: _permuted_mask(make, (2, 1, 5, lk), (0, 1, 3, 2))),
    ((2, 3, 5), lambda lk, make: _permuted_mask(make, (2, 3, 5, lk), (2, 0, 3, 1))),
    ((3, 1), lambda lk, make: make((3, 1, lk))),
    ((6,), lambda lk, make: make((6, lk))),
    ((2, 3, 4, 5), lambda lk, make: make((1, 3, 1, 5, lk))),
    ((2, 3, 4, 5), lambda lk, make: make((2, 1, 4, 1, lk))),
    ((2, 3, 4, 5), lambda lk, make: _permuted_mask(make, (2, 3, 4, 5, lk), (3, 1, 4, 0, 2))),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lk", [40, 1024])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", range(len(MASK_LAYOUTS)))
def test_masked_softmax_mask_layouts(dtype, lk, kind, causal, layout):
    """Each row reads the mask row of its own index, whatever the mask's broadcast dims and
    strides: values and gradients against the float64 reference."""
    lead, make_mask = MASK_LAYOUTS[layout]
    x = torch.randn(*lead, lk, dtype=dtype, device="cuda")
    _check_masked(x, make_mask(lk, _mask_maker(kind, dtype)), 0.6, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_fully_masked_rows(dtype):
    _fully_masked_rows_check("cuda", dtype)
    x = torch.randn(2, 2, 8, 5000, dtype=dtype, device="cuda", requires_grad=True)
    mask = torch.ones(2, 1, 8, 5000, dtype=torch.bool, device="cuda")
    mask[1, 0, 3] = False
    out = fusedops.masked_softmax(x, mask, dropout_p=0.2)
    out.backward(torch.randn_like(out))
    assert (out[1, :, 3] == 0).all() and (x.grad[1, :, 3] == 0).all()
    assert not torch.isnan(out).any() and not torch.isnan(x.grad).any()


def _check_dropout_against_reference(x, mask, scale, causal, p):
    """masked_softmax with dropout p on x: output, lse and gradient against the float64 reference
    replaying the recorded rng_state. Returns (out, dx, rng_state)."""
    grad = torch.randn_like(x)
    xg = x.clone().requires_grad_(True)
    out, lse, rng_state = ops.masked_softmax_fwd(xg, mask, scale, causal, p, True)
    (dx,) = torch.autograd.grad(out, xg, grad)
    ref_out, ref_lse = reference.masked_softmax(x.double(), mask, scale, causal, p, rng_state)
    ref_dx = reference.masked_softmax_backward(grad.double(), x.double(), mask, ref_lse, rng_state, scale, causal, p)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[x.dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(dx.double(), ref_dx, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    return out, dx, rng_state


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, lk", [(torch.float32, 1024), (torch.bfloat16, 2048)], ids=str)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masked_heads_sharing_mask_rows_past_the_l2(dtype, lk, kind):
    """4096 query rows of a [B, 1, L, Lk] mask move 16 MB or more (scores and mask) between two
    heads' reads of a mask row: these rows run on a 3D grid that visits the heads of a query one
    after another (row_grid). Values, gradients and the dropout stream stay those of each row's
    own index."""
    x = torch.randn(2, 3, 4096, lk, dtype=dtype, device="cuda")
    mask = _mask_maker(kind, dtype)((2, 1, 4096, lk))
    _check_masked(x, mask, 0.6, True)
    _check_dropout_against_reference(x, mask, 0.6, False, 0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_masked_nonpositive_scale(dtype, scale):
    """16-bit register rows fold a positive scale into their exps; other scales take streamed rows."""
    x = torch.randn(2, 3, 64, 1024, dtype=dtype, device="cuda")
    _check_masked(x, _keep_mask((2, 1, 64, 1024)), scale, True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lk", [1024, 4096, 20000])
@pytest.mark.parametrize("offset", [-400.0, 400.0])
def test_masked_large_logits(dtype, lk, offset):
    """Logits near +-400: the row max (forward) and lse (backward) times log2 e pass
    kOneFmaMaxShift, so 16-bit rows take their exps' arguments in two steps instead of one FMA.
    Values and gradients as the reference's, with and without the causal mask and dropout.
    (fp32 rows, which never take one FMA, are left out: a backward that recomputes y from lse
    rounded in fp32 is off by up to |lse| * 2^-24 relative, 100x torch's error at lse = 400.)"""
    x = (torch.randn(2, 3, 8, lk, device="cuda") * 3 + offset).to(dtype)
    mask = _keep_mask((2, 1, 8, lk))
    for causal in (False, True):
        _check_masked(x, mask, 1.0, causal)
        _check_dropout_against_reference(x, mask, 1.0, causal, 0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lk", [128, 1000, 4096, 20000])
def test_additive_mask_vector_rows(dtype, lk):
    """Additive masks contiguous along the row are read as vectors of the input's dtype by
    register rows (128; 1000, whose last vectors lie past the row's end; 4096) and cluster rows
    (20000): bias values, -inf, the dtype's most negative value (as Hugging Face's masks) and a
    fully masked row, with the causal mask and with dropout, against the float64 reference. A
    mask that is not vector-aligned (an offset view) takes streamed rows and agrees too."""
    x = torch.randn(2, 3, 6, lk, dtype=dtype, device="cuda")
    bias = torch.randn(2, 1, 6, lk, dtype=dtype, device="cuda")
    bias[..., 1::3] = float("-inf")
    bias[..., 2::5] = torch.finfo(dtype).min
    bias[1, 0, 4] = float("-inf")
    for causal in (False, True):
        _check_masked(x, bias, 0.6, causal)
        _check_dropout_against_reference(x, bias, 0.6, causal, 0.25)
    unaligned = torch.randn(2, 1, 6, lk + 1, dtype=dtype, device="cuda")[..., 1:]
    _check_masked(x, unaligned, 0.6, False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_mask_of_zeros_and_infinities_is_the_bool_mask(dtype):
    """An additive mask of 0 and -inf is the bool mask it encodes: the same values (fp32 rows
    compute the same logits either way, bit for bit; 16-bit bool rows fold the scale into their
    exps, so they round differently) and the same dropout."""
    x = torch.randn(4, 8, 64, 1024, dtype=dtype, device="cuda")
    keep = _keep_mask((4, 1, 64, 1024))
    additive = torch.zeros(keep.shape, dtype=dtype, device="cuda").masked_fill(~keep, float("-inf"))
    grad = torch.randn_like(x)
    for p in (0.0, 0.2):
        results = []
        for mask in (keep, additive):
            torch.manual_seed(3)
            results.append(_grads(lambda t: fusedops.masked_softmax(t, mask, scale=0.125, dropout_p=p), x, grad))
        (out_bool, dx_bool), (out_add, dx_add) = results
        assert torch.equal(out_bool == 0, out_add == 0)
        tol = 0.0 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out_add, out_bool, atol=tol, rtol=tol)
        torch.testing.assert_close(dx_add, dx_bool, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.sanitizer
def test_masked_small_cases_sanitizer():
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(2, 3, 9, 33, dtype=dtype, device="cuda")
        _check_masked(x, _keep_mask((2, 1, 9, 33)), 0.5, True)
        x = torch.randn(1, 2, 4, 20000, dtype=dtype, device="cuda")
        _check_masked(x, torch.randn(1, 1, 1, 20000, dtype=dtype, device="cuda"), 1.0, False)
        y = fusedops.masked_softmax(x.requires_grad_(True), None, dropout_p=0.3)
        y.sum().backward()
        # register rows with dropout, without and with the causal mask (DRAW_ALL kernels and not)
        x = torch.randn(2, 3, 9, 1000, dtype=dtype, device="cuda")
        for causal in (False, True):
            _check_dropout_against_reference(x, _keep_mask((2, 1, 9, 1000)), 0.5, causal, 0.3)
            # an additive mask read as vectors
            _check_dropout_against_reference(x, torch.randn(2, 1, 9, 1000, dtype=dtype, device="cuda"), 0.5, causal, 0.3)


# ---- dropout -----------------------------------------------------------------------------------


def _dropout_run(x, mask, p, seed, causal=False):
    torch.manual_seed(seed)
    xg = x.detach().clone().requires_grad_(True)
    out = fusedops.masked_softmax(xg, mask, scale=0.5, causal=causal, dropout_p=p)
    grad = torch.ones_like(out)
    out.backward(grad)
    return out.detach(), xg.grad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_fraction_and_reproducibility(dtype):
    p = 0.3
    x = torch.randn(16, 64, 1024, dtype=dtype, device="cuda")  # 2^20 elements
    out, dx = _dropout_run(x, None, p, seed=1)
    dropped = (out == 0).double().mean().item()
    assert abs(dropped - p) < 0.01
    out2, dx2 = _dropout_run(x, None, p, seed=1)
    assert torch.equal(out, out2) and torch.equal(dx, dx2)
    out3, _ = _dropout_run(x, None, p, seed=2)
    assert not torch.equal(out == 0, out3 == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lk", [7, 128, 132, 1000, 1024, 20000])
@pytest.mark.parametrize("p", [0.25, 0.75])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bool_mask", [True, False])
def test_dropout_matches_reference(dtype, lk, p, causal, bool_mask):
    """The kernel's keep mask is the Philox stream of the reference, bit for bit: streamed rows (7),
    register rows starting at whole Philox blocks or not (128, 132: fp32 lanes share blocks only
    in the former) or whose threads' last vectors lie past the row's end (1000), cluster rows
    (20000); thresholds below and above 2^15 (16-bit rows compare the draws' top bit apart);
    with the causal mask (only visible vectors draw) and without (every vector draws, DRAW_ALL
    kernels, whose 16-bit rows mask raw pairs: with a bool mask or none)."""
    x = torch.randn(2, 3, 5, lk, dtype=dtype, device="cuda")
    mask = torch.rand(2, 1, 5, lk, device="cuda") > 0.2 if bool_mask else None
    out, dx, rng_state = _check_dropout_against_reference(x, mask, 0.5, causal, p)
    keep = reference.dropout_keep_mask(x.shape, rng_state, p).cuda()
    assert (out[~keep] == 0).all() and (dx[~keep] != 0).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_under_cuda_graph_replay(dtype):
    """Each replay of a captured dropout draws fresh numbers (seed and offset read at replay): the
    reference's Philox stream of the rng_state it records."""
    x = torch.randn(8, 64, 256, dtype=dtype, device="cuda")
    with torch.no_grad():
        fusedops.masked_softmax(x, dropout_p=0.5)  # warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, _, rng_state = ops.masked_softmax_fwd(x, None, 1.0, False, 0.5, True)
        graph.replay()
        first = out.clone()
        first_keep = reference.dropout_keep_mask(x.shape, rng_state, 0.5).cuda()
        graph.replay()
        keep = reference.dropout_keep_mask(x.shape, rng_state, 0.5).cuda()
    assert torch.equal(first != 0, first_keep) and torch.equal(out != 0, keep)
    assert not torch.equal(first == 0, out == 0)
    assert abs((out == 0).float().mean().item() - 0.5) < 0.01


@pytest.mark.gpu
def test_dropout_off_in_eval():
    x = torch.randn(4, 8, 64, device="cuda")
    torch.testing.assert_close(fusedops.masked_softmax(x, dropout_p=0.5, training=False), torch.softmax(x, -1))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 8, 64), (4, 0, 64)])
@pytest.mark.parametrize("p, training", [(0.0, True), (0.5, False)])
def test_rng_state_is_zeros_without_dropout(shape, p, training):
    """The forward allocates rng_state uninitialized and its kernel writes zeros when it draws
    nothing: the caching allocator's freed garbage must not leak into the returned state."""
    x = torch.randn(shape, device="cuda")
    for _ in range(4):
        torch.full((1 << 14,), -7, dtype=torch.long, device="cuda")  # 128 KB of garbage, freed at once
        _, _, rng_state = ops.masked_softmax_fwd(x, None, 1.0, False, p, training)
        assert rng_state.tolist() == [0, 0]


# ---- opcheck and torch.compile on CUDA ---------------------------------------------------------


@pytest.mark.gpu
def test_opcheck_cuda():
    for dtype in DTYPES:
        for op, args in _op_samples("cuda", dtype):
            opcheck(op, args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compile_fullgraph_cuda(dtype):
    _compiled_matches_eager("cuda", dtype)
