"""Elementwise ops: API and errors (CPU, run in CI), numerics and RNG on the GPU."""
import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fusedops
from fusedops import reference
from conftest import assert_close_to_reference, assert_double_backward_raises

ops = torch.ops.fusedops
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Sizes: 1 (single element), 7 and 1023 (no 16-byte vector fits evenly), 4096 (vector path),
# and a row count past 65535.
SHAPES = [(1,), (3, 7), (5, 1023), (2, 3, 4096), (70000, 8)]


def _inputs(shape, dtype, device, n=1):
    return [torch.randn(shape, dtype=dtype, device=device) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# CPU: errors, reference semantics, opcheck, torch.compile


def test_errors_name_the_argument():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="x must be"):
        fusedops.scale_bias(torch.ones(4, dtype=torch.int32), 2.0, 1.0)
    with pytest.raises(ValueError, match="bias must be 1-D of size x.shape\\[-1\\] = 8"):
        fusedops.scale_bias(x, 2.0, torch.randn(7))
    with pytest.raises(TypeError, match="scale has dtype"):
        fusedops.scale_bias(x, torch.randn(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="scale must be a Python number"):
        fusedops.scale_bias(x, "2")
    with pytest.raises(ValueError, match="approximate must be"):
        fusedops.bias_gelu(x, None, approximate="fast")
    with pytest.raises(ValueError, match="residual has shape"):
        fusedops.bias_dropout_add(x, None, torch.randn(4, 9), 0.1)
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="p must be a number in \\[0, 1\\)"):
            fusedops.bias_dropout_add(x, None, x, p)
    with pytest.raises(ValueError, match="up has shape"):
        fusedops.swiglu(x, torch.randn(8, 4))


@pytest.mark.gpu
def test_errors_on_device_mix():
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match="bias is on cpu but x is on cuda"):
        fusedops.bias_gelu(x, torch.randn(8))
    with pytest.raises(ValueError, match="residual is on cpu"):
        fusedops.bias_dropout_add(x, None, torch.randn(4, 8), 0.1)
    with pytest.raises(RuntimeError, match="bias is on cpu"):  # the op itself checks too
        ops.bias_gelu_fwd(x, torch.randn(8), False)


def test_cpu_matches_torch():
    x, r, g = _inputs((6, 40), torch.float32, "cpu", 3)
    s, b = torch.randn(40), torch.randn(40)
    torch.testing.assert_close(fusedops.scale_bias(x, s, b), x * s + b)
    torch.testing.assert_close(fusedops.scale_bias(x, 0.5, 2.0), x * 0.5 + 2.0)
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(fusedops.bias_gelu(x, b, approximate), F.gelu(x + b, approximate=approximate))
    torch.testing.assert_close(fusedops.bias_dropout_add(x, b, r, 0.3, training=False), r + x + b)
    torch.testing.assert_close(fusedops.swiglu(g, x), F.silu(g) * x)


def test_philox_reference_known_answer():
    # Random123's published known-answer vector for philox4x32-10 with counter = key = 0.
    words = reference.philox_words(4, seed=0, offset=0)
    assert [hex(int(w)) for w in words] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"]


def _opcheck_cases(device):
    x, r = _inputs((3, 16), torch.float32, device, 2)
    b = torch.randn(16, device=device)
    x.requires_grad_(True)
    b.requires_grad_(True)
    return [
        (ops.scale_bias.default, (x, b, b, 1.0, 0.0)),
        (ops.scale_bias.default, (x, None, None, 3.0, -1.0)),
        (ops.bias_gelu_fwd.default, (x, b, True)),
        (ops.bias_gelu_bwd.default, (r, x.detach(), b.detach(), False)),
        # p = 0 keeps the op deterministic, which opcheck's repeated runs compare.
        (ops.bias_dropout_add_fwd.default, (x, b, r, 0.0, True)),
        (ops.swiglu_fwd.default, (x, r)),
        (ops.swiglu_bwd.default, (r, x.detach(), r)),
    ]


@pytest.mark.parametrize("case", range(7))
def test_opcheck_cpu(case):
    op, args = _opcheck_cases("cpu")[case]
    opcheck(op, args)


def _all_ops(x, s, b, r, g):
    y = fusedops.scale_bias(x, s, b)
    y = fusedops.bias_gelu(y, b, "tanh")
    y = fusedops.bias_dropout_add(y, b, r, 0.0)
    return fusedops.swiglu(g, y)


def test_compile_fullgraph_cpu():
    x, r, g = _inputs((4, 32), torch.float32, "cpu", 3)
    s, b = torch.randn(32), torch.randn(32)
    compiled = torch.compile(_all_ops, fullgraph=True)
    torch.testing.assert_close(compiled(x, s, b, r, g), _all_ops(x, s, b, r, g))


def test_backward_cpu_matches_autograd():
    x, r, g = (t.requires_grad_(True) for t in _inputs((5, 24), torch.float64, "cpu", 3))
    s, b = (t.requires_grad_(True) for t in _inputs((24,), torch.float64, "cpu", 2))
    torch.autograd.gradcheck(lambda *a: _all_ops(*a), (x, s, b, r, g))


def test_backward_cpu_scalar_scale_tensor_bias():
    """The C++ autograd finds bias's gradient edge when scale is a number (no scale tensor)."""
    x = torch.randn(5, 24, dtype=torch.float64, requires_grad=True)
    b = torch.randn(24, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t, c: fusedops.scale_bias(t, 1.5, c), (x, b))
    (db,) = torch.autograd.grad(fusedops.scale_bias(x.detach(), 1.5, b).sum(), b)
    torch.testing.assert_close(db, torch.full_like(b, 5.0))


def test_cpu_double_backward():
    """scale_bias is linear in x: its second derivative goes through its own autograd and is right.
    The other ops' backward kernels have no derivative: differentiating their gradients raises."""
    x = torch.randn(5, 24, dtype=torch.float64, requires_grad=True)
    s = torch.randn(24, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradgradcheck(lambda t, c: fusedops.scale_bias(t, c, 0.5), (x, s))
    for name, fn in (
        ("bias_gelu", lambda t: fusedops.bias_gelu(t, s)),
        ("bias_dropout_add", lambda t: fusedops.bias_dropout_add(t, s, t, 0.0)),
        ("swiglu", lambda t: fusedops.swiglu(t, t)),
    ):
        assert_double_backward_raises(fn, x, name)


# ---------------------------------------------------------------------------------------------
# GPU


def _check(out, ref_fn, args, dtype, name):
    """out vs the float64 reference, allowing 2x the error of the same expression in torch at dtype."""
    ref64 = ref_fn(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    torch_out = ref_fn(*args)
    assert_close_to_reference(out, ref64, torch_out, name=name)


def _eager_scale_bias(x, s, b):
    return x * s + b


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_gpu(shape, dtype):
    x, r, g = _inputs(shape, dtype, "cuda", 3)
    n = shape[-1]
    s, b = torch.randn(n, dtype=dtype, device="cuda"), torch.randn(n, dtype=dtype, device="cuda")
    _check(fusedops.scale_bias(x, s, b), _eager_scale_bias, (x, s, b), dtype, "scale_bias")
    _check(fusedops.scale_bias(x, 0.75, -2.5), _eager_scale_bias, (x, 0.75, -2.5), dtype, "scale_bias scalar")
    for approximate in ("none", "tanh"):
        _check(fusedops.bias_gelu(x, b, approximate), lambda x, b: F.gelu(x + b, approximate=approximate), (x, b),
               dtype, "bias_gelu")
    _check(fusedops.bias_gelu(x, None), F.gelu, (x,), dtype, "bias_gelu without bias")
    _check(fusedops.bias_dropout_add(x, b, r, 0.5, training=False), lambda x, b, r: r + (x + b), (x, b, r), dtype,
           "bias_dropout_add eval")
    _check(fusedops.swiglu(g, x), lambda g, x: F.silu(g) * x, (g, x), dtype, "swiglu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_tails_gpu(approximate, dtype):
    """Deep tails, where the fitted 16-bit normal CDF and the sigmoid form must not cancel."""
    x = torch.linspace(-16, 16, 8191, device="cuda").to(dtype).requires_grad_(True)
    y = fusedops.bias_gelu(x, None, approximate)
    _check(y.detach(), lambda x: F.gelu(x, approximate=approximate), (x.detach(),), dtype, "bias_gelu tails")
    (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
    x64 = x.detach().double().requires_grad_(True)
    (ref,) = torch.autograd.grad(F.gelu(x64, approximate=approximate).sum(), x64)
    xt = x.detach().requires_grad_(True)
    (theirs,) = torch.autograd.grad(F.gelu(xt, approximate=approximate).sum(), xt)
    assert_close_to_reference(grad, ref, theirs, factor=3.0, atol=1e-5, name="bias_gelu tails grad")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (33, 1023), (64, 4096)])
def test_backward_gpu(shape, dtype):
    def run(fn, *inputs):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        grad = torch.randn_like(out)
        out.backward(grad)
        return [t.grad for t in leaves], grad

    x, r, g = _inputs(shape, dtype, "cuda", 3)
    s, b = _inputs(shape[-1:], dtype, "cuda", 2)
    cases = [
        (fusedops.scale_bias, _eager_scale_bias, (x, s, b)),
        (lambda x, b: fusedops.bias_gelu(x, b, "tanh"), lambda x, b: F.gelu(x + b, approximate="tanh"), (x, b)),
        (lambda x, b: fusedops.bias_gelu(x, b), lambda x, b: F.gelu(x + b), (x, b)),
        (fusedops.swiglu, lambda g, u: F.silu(g) * u, (g, x)),
    ]
    for fused, eager, inputs in cases:
        grads, grad = run(fused, *inputs)
        ref_grads = _grads(eager, [t.double() for t in inputs], grad.double())
        torch_grads = _grads(eager, list(inputs), grad)
        for ours, ref, theirs in zip(grads, ref_grads, torch_grads):
            # Column-vector gradients sum over rows: allow the usual factor on a longer reduction.
            assert_close_to_reference(ours, ref, theirs, factor=3.0, atol=1e-5 * shape[0], name="grad")


def _grads(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    fn(*leaves).backward(grad)
    return [t.grad for t in leaves]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_misaligned_views_gpu(dtype):
    """storage_offset 1 breaks 16-byte alignment: the scalar path must give the vector path's answer."""
    base = torch.randn(4096 * 3 + 1, dtype=dtype, device="cuda")
    x = base[1:].view(3, 4096)
    assert x.data_ptr() % 16 != 0
    b = torch.randn(4096, dtype=dtype, device="cuda")
    torch.testing.assert_close(fusedops.bias_gelu(x, b), fusedops.bias_gelu(x.clone(), b), rtol=0, atol=0)
    _check(fusedops.scale_bias(x, b, b), _eager_scale_bias, (x, b, b), dtype, "misaligned scale_bias")


@pytest.mark.gpu
def test_non_contiguous_input_gpu():
    x = torch.randn(64, 48, device="cuda").t()
    b = torch.randn(64, device="cuda")
    torch.testing.assert_close(fusedops.bias_gelu(x, b), F.gelu(x + b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_mask_matches_reference_and_fraction(dtype):
    p = 0.3
    x = torch.randn(1000, 1003, dtype=dtype, device="cuda")
    zeros = torch.zeros_like(x)
    out, rng_state = ops.bias_dropout_add_fwd(x, None, zeros, p, True)
    keep = reference.dropout_keep_mask(x.shape, rng_state, p).cuda()
    # The CUDA mask is bit-for-bit the CPU Philox reference's.
    assert torch.equal(out != 0, keep & (x != 0))
    expected = torch.where(keep, x.float() / (1 - p), torch.zeros_like(x, dtype=torch.float32)).to(dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert abs((~keep).float().mean().item() - p) < 0.01
    grad = torch.randn_like(x)
    torch.testing.assert_close(ops.dropout_bwd(grad, rng_state, p), reference.dropout_backward(grad.cpu(), rng_state, p).cuda())


@pytest.mark.gpu
def test_dropout_reproducible_under_seed():
    x, r = _inputs((257, 999), torch.bfloat16, "cuda", 2)
    torch.manual_seed(1234)
    first = fusedops.bias_dropout_add(x, None, r, 0.5)
    second = fusedops.bias_dropout_add(x, None, r, 0.5)
    torch.manual_seed(1234)
    again = fusedops.bias_dropout_add(x, None, r, 0.5)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)
    torch.manual_seed(4321)
    assert not torch.equal(first, fusedops.bias_dropout_add(x, None, r, 0.5))


@pytest.mark.gpu
def test_dropout_backward_uses_forward_mask():
    x = torch.randn(300, 512, device="cuda", requires_grad=True)
    b = torch.randn(512, device="cuda", requires_grad=True)
    r = torch.randn(300, 512, device="cuda", requires_grad=True)
    out = fusedops.bias_dropout_add(x, b, r, 0.25)
    grad = torch.randn_like(out)
    out.backward(grad)
    kept = (out - r).detach() != 0
    torch.testing.assert_close(x.grad, torch.where(kept, grad / 0.75, torch.zeros_like(grad)))
    torch.testing.assert_close(b.grad, x.grad.sum(0))
    torch.testing.assert_close(r.grad, grad)


@pytest.mark.gpu
def test_dropout_in_cuda_graph_draws_fresh_masks():
    x, r = _inputs((64, 1024), torch.float32, "cuda", 2)
    static_out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fusedops.bias_dropout_add(x, None, r, 0.5)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out.copy_(fusedops.bias_dropout_add(x, None, r, 0.5))
    graph.replay()
    first = static_out.clone()
    graph.replay()
    assert not torch.equal(first, static_out)
    assert abs(((static_out - r) == 0).float().mean().item() - 0.5) < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(7))
def test_opcheck_cuda(case):
    op, args = _opcheck_cases("cuda")[case]
    opcheck(op, args)


@pytest.mark.gpu
def test_compile_fullgraph_cuda():
    x, r, g = _inputs((16, 256), torch.bfloat16, "cuda", 3)
    s, b = _inputs((256,), torch.bfloat16, "cuda", 2)
    compiled = torch.compile(_all_ops, fullgraph=True)
    torch.testing.assert_close(compiled(x, s, b, r, g), _all_ops(x, s, b, r, g), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.sanitizer
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 7), (5, 136)])
def test_sanitizer_cases(shape, dtype):
    x, r, g = (t.requires_grad_(True) for t in _inputs(shape, dtype, "cuda", 3))
    s, b = (t.requires_grad_(True) for t in _inputs(shape[-1:], dtype, "cuda", 2))
    y = fusedops.swiglu(g, fusedops.bias_dropout_add(fusedops.bias_gelu(fusedops.scale_bias(x, s, b), b), b, r, 0.2))
    y.sum().backward()
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()
