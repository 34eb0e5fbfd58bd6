"""LayerNorm / RMSNorm and the add_* variants: argument errors, the CPU reference, opcheck,
torch.compile, the modules, and (marked gpu) the CUDA kernels against a float64 reference."""
import pytest
import torch
import torch.nn.functional as F

import fusedops
from fusedops import reference

from conftest import assert_close_to_reference, assert_double_backward_raises

ops = torch.ops.fusedops
gpu = pytest.mark.gpu
sanitizer = pytest.mark.sanitizer

# Hidden sizes: tiny (one warp, most lanes idle), odd (scalar path), just past a warp's or a
# block's register capacity, the model sizes, and the largest (streaming kernels).
SIZES = [1, 7, 41, 123, 769, 1023, 1500, 3584, 4096, 65536]
LOW_PRECISION = [torch.float16, torch.bfloat16]
DTYPES = [torch.float32] + LOW_PRECISION


def _torch_norm(kind, x, shape, weight, bias, eps):
    if kind == "layer_norm":
        return F.layer_norm(x, shape, weight, bias, eps)
    return F.rms_norm(x, shape, weight, eps)


def _fused_norm(kind, x, shape, weight, bias, eps):
    if kind == "layer_norm":
        return fusedops.layer_norm(x, shape, weight, bias, eps)
    return fusedops.rms_norm(x, shape, weight, eps)


def _forward_backward(fn, x, weight, bias, dy):
    """out and the gradients of (out * dy).sum() w.r.t. x, weight, bias (None where absent)."""
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (x, weight, bias)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, [t for t in leaves if t is not None], dy)
    grads = iter(grads)
    return [out.detach()] + [next(grads) if t is not None else None for t in leaves]


def _check_norm(kind, x, shape, weight=None, bias=None, eps=1e-5, atol=1e-5):
    """Our out, dx, dweight, dbias against float64, with torch's own op in x's dtype as the bar."""
    if kind == "rms_norm":
        bias = None
    dy = torch.randn_like(x)
    ours = _forward_backward(lambda a, w, b: _fused_norm(kind, a, shape, w, b, eps), x, weight, bias, dy)
    same_dtype = [None if t is None else t.to(x.dtype) for t in (weight, bias)]
    theirs = _forward_backward(lambda a, w, b: _torch_norm(kind, a, shape, w, b, eps), x, *same_dtype, dy)
    wide = [None if t is None else t.double() for t in (x, weight, bias, dy)]
    ref = _forward_backward(lambda a, w, b: _torch_norm(kind, a, shape, w, b, eps), *wide)
    for name, o, r, t in zip(["out", "dx", "dweight", "dbias"], ours, ref, theirs):
        if o is None:
            continue
        expected_dtype = {"out": x, "dx": x, "dweight": weight, "dbias": bias}[name].dtype
        assert o.dtype == expected_dtype, name
        assert_close_to_reference(o, r, t, atol=atol, name=f"{kind} {name}")


def _check_bf16_rows(kind, rows, n):
    """_check_norm on fresh bf16 [rows, n] input, weight and bias."""
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    _check_norm(kind, x, (n,), torch.randn(n, device="cuda", dtype=torch.bfloat16),
                torch.randn(n, device="cuda", dtype=torch.bfloat16))


# ---- argument errors (CPU; raised before any kernel) -----------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, w: fusedops.layer_norm(x, (5,), w), "normalized_shape"),
        (lambda x, w: fusedops.layer_norm(x, (3, 8), w), "normalized_shape"),
        (lambda x, w: fusedops.layer_norm(x, 8.0, w), "normalized_shape"),
        (lambda x, w: fusedops.rms_norm(x, ("8",), w), "normalized_shape"),
        (lambda x, w: fusedops.layer_norm(x, (8,), w[:4]), "weight"),
        (lambda x, w: fusedops.layer_norm(x, (8,), w.double()), "weight"),
        (lambda x, w: fusedops.layer_norm(x, (8,), w, w.half()), "bias"),
        (lambda x, w: fusedops.layer_norm(x.long(), (8,)), "input"),
        (lambda x, w: fusedops.layer_norm("x", (8,)), "input"),
        (lambda x, w: fusedops.layer_norm(x, (8,), w, eps=-1.0), "eps"),
        (lambda x, w: fusedops.rms_norm(x, (8,), [1.0] * 8), "weight"),
        (lambda x, w: fusedops.add_layer_norm(x, x[:, :4], (8,), w), "residual"),
        (lambda x, w: fusedops.add_rms_norm(x, x.double(), (8,), w), "residual"),
    ],
)
def test_argument_errors_name_the_argument(call, match):
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises((TypeError, ValueError), match=match):
        call(x, w)


def _check_rms_eps_none(device):
    """eps=None is the epsilon of the type F.rms_norm computes in: float32's for 16-bit input
    (not the input dtype's, which its docs name: bf16's would shrink these rows' outputs 9x)."""
    for dtype, scale in [(torch.float64, 1e-9), (torch.float32, 1e-4), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)]:
        x = torch.randn(3, 16, dtype=dtype, device=device) * scale
        add = torch.zeros_like(x)
        expected = F.rms_norm(x, (16,))
        torch.testing.assert_close(fusedops.rms_norm(x, (16,)), expected)
        torch.testing.assert_close(fusedops.add_rms_norm(x, add, (16,))[0], expected)
        torch.testing.assert_close(fusedops.nn.RMSNorm(16, device=device, dtype=dtype)(x), expected)


def test_rms_eps_none_is_the_compute_dtype_eps():
    _check_rms_eps_none("cpu")


# ---- CPU reference and autograd formulas -----------------------------------------------------


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape", [(2, 3, 40), (5, 6, 7)])
@pytest.mark.parametrize("affine", [True, False])
def test_reference_matches_torch_float64(kind, shape, affine):
    x = torch.randn(shape, dtype=torch.float64) * 3 + 1
    normalized = shape[-2:] if shape[-1] == 7 else shape[-1:]
    weight = torch.randn(normalized, dtype=torch.float64) if affine else None
    bias = torch.randn(normalized, dtype=torch.float64) if affine else None
    if kind == "rms_norm":
        bias = None
    dy = torch.randn_like(x)
    ours = _forward_backward(lambda a, w, b: _fused_norm(kind, a, normalized, w, b, 1e-5), x, weight, bias, dy)
    theirs = _forward_backward(lambda a, w, b: _torch_norm(kind, a, normalized, w, b, 1e-5), x, weight, bias, dy)
    for o, t in zip(ours, theirs):
        if t is not None:  # the backward reads the fp32 statistics saved by the forward
            torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_add_variants_cpu_gradients(kind):
    x, r = torch.randn(4, 3, 24, dtype=torch.float64), torch.randn(4, 3, 24, dtype=torch.float64)
    w, b = torch.randn(24, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    g_out, g_res = torch.randn_like(x), torch.randn_like(x)

    def run(fused):
        leaves = [t.clone().requires_grad_(True) for t in (x, r, w, b)]
        xi, ri, wi, bi = leaves
        if fused:
            if kind == "layer_norm":
                out, res = fusedops.add_layer_norm(xi, ri, (24,), wi, bi)
            else:
                out, res = fusedops.add_rms_norm(xi, ri, (24,), wi, eps=1e-6)
        else:
            res = xi + ri
            out = F.layer_norm(res, (24,), wi, bi) if kind == "layer_norm" else F.rms_norm(res, (24,), wi, 1e-6)
        ((out * g_out).sum() + (res * g_res).sum()).backward()
        return [out, res] + [t.grad for t in leaves]

    for o, t in zip(run(True), run(False)):
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("affine", ["weight", "bias", "both", "none"])
@pytest.mark.parametrize("wanted", ["all", "input", "params"])
def test_cpu_gradients_for_each_needed_input(kind, affine, wanted):
    """The C++ autograd: every combination of present weight / bias and of inputs whose gradient
    is asked for gives torch's gradients (only the asked-for ones are computed)."""
    if kind.endswith("rms_norm") and affine in ("bias", "both"):
        affine = "weight" if affine == "both" else "none"
    x, r, dy, dres = (torch.randn(3, 2, 12, dtype=torch.float64) for _ in range(4))
    w = torch.randn(12, dtype=torch.float64) if affine in ("weight", "both") else None
    b = torch.randn(12, dtype=torch.float64) if affine in ("bias", "both") else None
    residual = kind.startswith("add")
    layer = kind.endswith("layer_norm")

    def run(fused):
        xi, ri = x.clone().requires_grad_(wanted != "params"), r.clone().requires_grad_(wanted != "params")
        wi, bi = (None if t is None else t.clone().requires_grad_(wanted != "input") for t in (w, b))
        if residual:
            res = xi + ri
            if fused:
                call = fusedops.add_layer_norm if layer else fusedops.add_rms_norm
                out, res = call(xi, ri, (12,), wi, bi) if layer else call(xi, ri, (12,), wi, eps=1e-6)
        else:
            res = xi
        if not (residual and fused):
            if layer:
                out = (fusedops.layer_norm if fused else F.layer_norm)(res, (12,), wi, bi)
            else:
                out = (fusedops.rms_norm if fused else F.rms_norm)(res, (12,), wi, 1e-6)
        leaves = [t for t in (xi, ri if residual else None, wi, bi) if t is not None and t.requires_grad]
        loss = (out * dy).sum() + ((res * dres).sum() if residual else 0)
        return [out] + list(torch.autograd.grad(loss, leaves)) if leaves else [out]

    for o, t in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", [True, False])
def test_cpu_add_variants_residual_out_only(layer):
    """Only residual_out reaches the loss: out's gradient is absent (not zero-filled)."""
    x, r = (torch.randn(4, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    _, res = fusedops.add_layer_norm(x, r, (16,), w) if layer else fusedops.add_rms_norm(x, r, (16,), w)
    dx, dr, dw = torch.autograd.grad((res * 3).sum(), [x, r, w], allow_unused=True)
    torch.testing.assert_close(dx, torch.full_like(x, 3.0))
    torch.testing.assert_close(dr, torch.full_like(r, 3.0))
    assert dw is None or not dw.any()


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "add_layer_norm"])
def test_cpu_double_backward_raises_clearly(kind):
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    if kind == "add_layer_norm":
        fn = lambda t: fusedops.add_layer_norm(t, torch.ones_like(t), (8,), w)[0]  # noqa: E731
    else:
        fn = lambda t: getattr(fusedops, kind)(t, (8,), w)  # noqa: E731
    assert_double_backward_raises(fn, torch.randn(3, 8, dtype=torch.float64, requires_grad=True))


def test_cpu_statistics_are_not_differentiable():
    x = torch.randn(3, 8, requires_grad=True)
    out, mean, rstd = ops.layer_norm_fwd(x, [8], None, None, 1e-5)
    assert out.requires_grad and not mean.requires_grad and not rstd.requires_grad


# The forwards on [3, 5, 8] input: (name, positional arguments, number of statistics).
def _forward_calls(x, r, w):
    return [
        ("layer_norm_fwd", (x, [8], w, None, 1e-5), 2),
        ("rms_norm_fwd", (x, [8], w, 1e-6), 1),
        ("add_layer_norm_fwd", (x, r, [8], w, None, 1e-5), 2),
        ("add_rms_norm_fwd", (x, r, [8], w, 1e-6), 1),
    ]


@pytest.mark.parametrize("index", range(4))
def test_cpu_return_stats_false(index):
    """return_stats=False gives empty statistics, unless autograd records the call (its backward
    reads them); the output is the same either way."""
    x, r, w = torch.randn(3, 5, 8), torch.randn(3, 5, 8), torch.randn(8)
    name, args, count = _forward_calls(x, r, w)[index]
    op = getattr(ops, name)
    outs = op(*args, return_stats=False)
    assert all(s.shape == (0,) and s.dtype == torch.float32 for s in outs[-count:]), name
    for o, f in zip(outs[:-count], op(*args)[:-count]):
        torch.testing.assert_close(o, f, rtol=0, atol=0)
    w.requires_grad_(True)
    assert all(s.shape == (3, 5) for s in op(*args, return_stats=False)[-count:]), name
    with torch.no_grad():
        assert all(s.shape == (0,) for s in op(*args, return_stats=False)[-count:]), name


# ---- opcheck and torch.compile on CPU --------------------------------------------------------


def _op_samples(device, dtype=torch.float32):
    x = torch.randn(3, 5, 16, device=device, dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(16, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(16, device=device, dtype=dtype, requires_grad=True)
    xg = x.clone().requires_grad_(True)
    _, mean, rstd = reference.layer_norm(x, [16], w.detach(), b.detach(), 1e-5)
    yield ops.layer_norm_fwd, (xg, [16], w, b, 1e-5)
    yield ops.layer_norm_fwd, (xg, [5, 16], None, None, 1e-5)
    yield ops.rms_norm_fwd, (xg, [16], w, 1e-6)
    yield ops.add_layer_norm_fwd, (xg, r.clone().requires_grad_(True), [16], w, b, 1e-5)
    yield ops.add_rms_norm_fwd, (xg, r.clone().requires_grad_(True), [16], None, 1e-6)
    yield ops.layer_norm_bwd, (torch.randn_like(x), r, x, mean, rstd, [16], w.detach(), b.detach())
    yield ops.layer_norm_bwd, (torch.randn_like(x), None, x, mean, rstd, [16], None, None)
    yield ops.rms_norm_bwd, (torch.randn_like(x), None, x, rstd, [16], w.detach())
    yield ops.layer_norm_fwd, (x, [16], w.detach(), b.detach(), 1e-5), {"return_stats": False}
    yield ops.add_rms_norm_fwd, (x, r, [16], w.detach(), 1e-6), {"return_stats": False}


@pytest.mark.parametrize("index", range(10))
def test_opcheck_cpu(index):
    torch.library.opcheck(*list(_op_samples("cpu"))[index])


def _block(x, r, w_ln, b_ln, w_rms):
    y = fusedops.layer_norm(x, (x.shape[-1],), w_ln, b_ln)
    out, res = fusedops.add_rms_norm(y, r, (x.shape[-1],), w_rms)
    return out * 2 + res


def test_compile_fullgraph_cpu():
    x, r = torch.randn(4, 7, 32), torch.randn(4, 7, 32)
    w_ln, b_ln, w_rms = torch.randn(32), torch.randn(32), torch.randn(32)
    compiled = torch.compile(_block, fullgraph=True)
    torch.testing.assert_close(compiled(x, r, w_ln, b_ln, w_rms), _block(x, r, w_ln, b_ln, w_rms))


def _compiled_gradients_match_eager(device):
    """Gradients through the C++ autograd of all four ops, compiled (AOT traces the Function) vs eager."""
    x, r = (torch.randn(4, 7, 32, device=device, requires_grad=True) for _ in range(2))
    w, b, w_rms = (torch.randn(32, device=device, requires_grad=True) for _ in range(3))

    def fn(x, r, w, b, w_rms):
        y = fusedops.layer_norm(x, (32,), w, b) + fusedops.rms_norm(x, (32,), w_rms)
        out, res = fusedops.add_layer_norm(y, r, (32,), w, None)
        out2, res2 = fusedops.add_rms_norm(out, res, (32,), None)
        return (out2 * res2).sum()

    leaves = (x, r, w, b, w_rms)
    eager = torch.autograd.grad(fn(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(fn, fullgraph=True)(*leaves), leaves)
    for e, c in zip(eager, compiled, strict=True):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)


def test_compile_fullgraph_gradients_cpu():
    _compiled_gradients_match_eager("cpu")


# ---- modules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("LayerNorm", {}),
        ("LayerNorm", {"bias": False}),
        ("LayerNorm", {"elementwise_affine": False}),
        ("RMSNorm", {}),
        ("RMSNorm", {"eps": 1e-6}),
        ("RMSNorm", {"elementwise_affine": False}),
    ],
)
def test_module_state_dict_and_forward_cpu(name, kwargs, monkeypatch):
    ours, theirs = getattr(fusedops.nn, name), getattr(torch.nn, name)
    torch_module = theirs((6, 16), **kwargs)
    with torch.no_grad():
        for p in torch_module.parameters():
            p.normal_()
    module = ours((6, 16), **kwargs)
    assert isinstance(module, theirs)
    assert module.state_dict().keys() == torch_module.state_dict().keys()
    module.load_state_dict(torch_module.state_dict())
    x = torch.randn(3, 6, 16, dtype=torch.float64)
    expected = torch_module.double()(x)

    def torch_forward(*args):
        raise AssertionError("the fused module fell back to torch's forward")

    monkeypatch.setattr(theirs, "forward", torch_forward)
    torch.testing.assert_close(module.double()(x), expected)


# ---- GPU: the CUDA kernels -------------------------------------------------------------------


def _rows_for(n):
    return max(3, min(512, 2**20 // n))


@gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_against_float64(kind, dtype, n):
    x = torch.randn(_rows_for(n), n, device="cuda", dtype=dtype) * 2 + 0.5
    w = torch.randn(n, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    _check_norm(kind, x, (n,), w, b)


@gpu
@pytest.mark.parametrize("n", [512, 2048, 8192, 16384, 32768])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_benchmark_shapes(kind, n):
    """The benchmark's hidden sizes (bf16): every forward and backward kernel variant they select."""
    x = torch.randn(max(3, 2**22 // n), n, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    _check_norm(kind, x, (n,), w, b)


# (hidden, dtype) pairs that select every row variant of both directions at the default knobs of
# norm_kernels.cu, vectorized (16-byte chunks) and scalar (odd hidden): forward warp rows with 1
# and 2 chunks per thread, one-row block kernels (4 chunks per thread; RMSNorm 8 up to 4096
# chunks) and prefetching block kernels (8 chunks per thread); backward warp rows, block rows
# with the column sums in registers, staged rows (sm_90: one block a row, LayerNorm only, or a
# cluster of blocks a row), and block rows with the column sums in shared memory. Other knob
# settings move the boundaries between these sizes, which span every path's range.
REGISTER_VARIANTS = [
    (256, torch.bfloat16),  # fwd warp 1 chunk, bwd warp rows
    (512, torch.bfloat16),  # fwd warp 2 chunks, bwd LN warp rows of 2 chunks, RMS register-sum rows
    (1024, torch.bfloat16),  # fwd one-row (RMSNorm 2 chunks a thread), bwd LN warp rows of 4 chunks
    (4096, torch.bfloat16),  # fwd one-row (RMSNorm 2 chunks), bwd LN staged rows, RMS register-sum rows
    (16384, torch.bfloat16),  # fwd one-row (LayerNorm 8 chunks a thread), bwd staged rows on clusters of 2
    (32768, torch.bfloat16),  # fwd LN prefetching 8 chunks, RMS one-row 8; bwd staged rows on clusters of 4
    (20000, torch.bfloat16),  # fwd LN prefetching 8 chunks, RMS one-row 8, threads past the row's end
    (16384, torch.float32),  # fwd LN prefetching 8 chunks (fp32 vectors of 4), RMS one-row 8
    (8200, torch.bfloat16),  # bwd shared-sum rows (8200 does not split into 2 slices of 16-byte chunks)
    (8192, torch.float32),  # fwd one-row (fp32 vectors of 4), bwd staged rows on clusters of 2
    (13, torch.float16),  # scalar: fwd warp 1, bwd warp rows
    (41, torch.float16),  # scalar: fwd warp 2, bwd register-sum rows
    (769, torch.float16),  # scalar: fwd one-row, bwd register-sum rows
    (1500, torch.bfloat16),  # scalar: fwd one-row, bwd shared-sum rows
    (3001, torch.bfloat16),  # scalar: fwd prefetching 8
]


@gpu
@pytest.mark.parametrize("n, dtype", REGISTER_VARIANTS)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_register_variants_many_rows_per_block(kind, n, dtype):
    """Enough rows that every block of the prefetching kernels' grids (the blocks that fit at
    once) takes several (the next-row prefetch crosses iterations), plus a last round where only
    some row groups have a row (one-row kernels: more than one wave of blocks)."""
    rows = max(1003, 2**23 // n + 1)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 2 + 0.5
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    _check_norm(kind, x, (n,), w, b)


@gpu
@pytest.mark.parametrize("n, rows", [(32768, 1100), (40000, 30)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_layer_norm_bias_sums_from_dy(dtype, n, rows):
    """LayerNorm whose dweight and dbias column sums do not both fit in shared memory: dbias is
    summed over dy's columns after the kernel (in segments past 1024 rows, else in one pass)."""
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 2 + 0.5
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    _check_norm("layer_norm", x, (n,), w, b)


@gpu
@pytest.mark.parametrize("n", [512, 1023, 4096, 16384])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_mixed_precision_fp32_weight(kind, dtype, n):
    x = torch.randn(64, n, device="cuda", dtype=dtype)
    w, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    _check_norm(kind, x, (n,), w, b)


@gpu
@sanitizer
@pytest.mark.parametrize("n", [7, 64, 1500])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_small_cases(kind, n):
    _check_bf16_rows(kind, 5, n)


@gpu
@sanitizer
@pytest.mark.parametrize("n, rows", [(512, 10000), (4096, 2000), (16384, 300), (32768, 300)])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_pipelined_rows_small(kind, n, rows):
    """More rows than one wave of the prefetching grids (the next-row prefetch crosses
    iterations and the last round has idle row groups): warp rows, block rows, shared-sum
    backward rows."""
    _check_bf16_rows(kind, rows, n)


@gpu
@sanitizer
@pytest.mark.parametrize("n", [4104, 8200, 16376])
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_rms_norm_two_pass_rows(dtype, weight_dtype, n):
    """RMSNorm rows of 513, 1025 and 2047 chunks (the two-pass forward): 2 and 4 chunks a thread,
    threads past the row's end, a weight in the input dtype or fp32."""
    x = torch.randn(40, n, device="cuda", dtype=dtype) * 3 - 1
    w = torch.randn(n, device="cuda", dtype=weight_dtype or dtype)
    _check_norm("rms_norm", x, (n,), w)


@gpu
@sanitizer
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_streaming_small(kind):
    n = 40000  # past the register capacity of both directions
    x = torch.randn(3, n, device="cuda", dtype=torch.float32)
    _check_norm(kind, x, (n,), torch.randn(n, device="cuda"), torch.randn(n, device="cuda"))


@gpu
@pytest.mark.parametrize("n", [768, 16384])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("affine", ["none", "weight", "bias"])
def test_gpu_weight_or_bias_none(kind, affine, n):
    x = torch.randn(300, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16) if affine == "weight" else None
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if affine == "bias" else None
    _check_norm(kind, x, (n,), w, b)


@gpu
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_several_normalized_dims(kind):
    x = torch.randn(2, 9, 12, 64, device="cuda", dtype=torch.float16)
    w, b = torch.randn(12, 64, device="cuda", dtype=torch.float16), torch.randn(12, 64, device="cuda", dtype=torch.float16)
    _check_norm(kind, x, (12, 64), w, b)


@gpu
@pytest.mark.parametrize("n", [64, 7])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_many_rows(kind, n):
    _check_bf16_rows(kind, 70000, n)


@gpu
@pytest.mark.parametrize("n", [1024, 4096, 65536])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_offset_views(kind, n):
    """storage_offset 1 (misaligned: scalar path) and a row-strided view (vector path, row stride)."""
    buffer = torch.randn(16 * n + 1, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    offset = buffer[1:].view(16, n)
    assert offset.storage_offset() == 1
    _check_norm(kind, offset, (n,), w, b)
    wide = torch.randn(16, n + 64, device="cuda", dtype=torch.bfloat16)[:, 8 : 8 + n]
    _check_norm(kind, wide, (n,), w, b)


@gpu
def test_gpu_offset_view_gradient():
    n = 1000
    x = torch.randn(16, n, device="cuda")
    w, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    mean, rstd = reference.layer_norm(x, [n], w, b, 1e-5)[1:]
    dy = torch.randn(16 * n + 1, device="cuda")[1:].view(16, n)
    dx, dw, db = ops.layer_norm_bwd(dy, None, x, mean, rstd, [n], w, b)
    rdx, rdw, rdb = reference.layer_norm_backward(dy.double(), None, x.double(), mean, rstd, [n], w.double(), b.double())
    for o, r in [(dx, rdx), (dw, rdw), (db, rdb)]:
        torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.parametrize("n", [123, 1024, 4096, 16384, 32768, 65536])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_backward_bitwise_deterministic(kind, n):
    rows = {32768: 1100, 65536: 40}.get(n, 3000)
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True) if kind == "layer_norm" else None
    dy = torch.randn_like(x)
    params = [t for t in (x, w, b) if t is not None]
    first = None
    for _ in range(50):
        out = _fused_norm(kind, x, (n,), w, b, 1e-5)
        grads = torch.autograd.grad(out, params, dy)
        if first is None:
            first = grads
        for g, f in zip(grads, first):
            assert torch.equal(g, f)


@gpu
@pytest.mark.parametrize("residual_grad", [False, True])
@pytest.mark.parametrize("n, rows", [(4096, 1000), (32768, 3), (32768, 500)])
def test_gpu_backward_in_cuda_graph(n, rows, residual_grad):
    """The backward's launches (staged rows, cluster rows, the column sums launched with
    programmatic dependent launch) captured in a CUDA graph and replayed on new inputs give the
    eager call's bits: fewer rows than the grid holds (3) and several rounds of rows (500), with
    and without add_layer_norm's residual_out gradient."""
    x, dy, dresidual = (torch.randn(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dresidual = dresidual if residual_grad else None
    _, mean, rstd = ops.layer_norm_fwd(x, [n], w, b, 1e-5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.layer_norm_bwd(dy, dresidual, x, mean, rstd, [n], w, b)  # warm-up: the plan's attributes
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = ops.layer_norm_bwd(dy, dresidual, x, mean, rstd, [n], w, b)
    torch.cuda.current_stream().wait_stream(stream)
    dy.copy_(torch.randn_like(dy))
    graph.replay()
    eager = ops.layer_norm_bwd(dy, dresidual, x, mean, rstd, [n], w, b)
    for g, e in zip(captured, eager):  # captured's memory is only written by the replay
        assert torch.equal(g, e)


@gpu
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_fp16_large_sum_of_squares(kind):
    n = 4096
    x = (torch.randn(32, n, device="cuda") * 100 + 200).half()  # sum of squares ~ 2e8 >> 65504
    w, b = torch.randn(n, device="cuda", dtype=torch.half), torch.randn(n, device="cuda", dtype=torch.half)
    out = _fused_norm(kind, x, (n,), w, b if kind == "layer_norm" else None, 1e-5)
    assert torch.isfinite(out).all()
    _check_norm(kind, x, (n,), w, b)


@gpu
@pytest.mark.parametrize("n", [7, 512, 1500, 4096, 16384, 32768])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_layer_norm_large_mean_and_outliers(dtype, n):
    """Rows whose mean dwarfs their spread, with an outlier column: statistics from E[x^2] -
    mean^2, or merged with the wrong weights, lose the variance here."""
    x = torch.randn(_rows_for(n), n, device="cuda") + 3000
    x[:, 0] += 1e4
    x = x.to(dtype)
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    _check_norm("layer_norm", x, (n,), w, b)


@gpu
@pytest.mark.parametrize("n", [7, 512, 1024, 1500, 3001, 8192, 16384, 32768, 40000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_add_variants(kind, dtype, n):
    _check_add_variant(kind, torch.randn(40 if n > 8192 else 1003, n, device="cuda", dtype=dtype))


@gpu
@sanitizer
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gpu_add_variants_staged_rows(kind):
    """add_* rows through the staged kernels' three-tensor stages (cluster rows), several per
    cluster."""
    _check_add_variant(kind, torch.randn(300, 16384, device="cuda", dtype=torch.bfloat16))


def _check_add_variant(kind, x):
    """add_<kind> on x and a fresh residual: out, residual_out and every gradient against float64."""
    n = x.shape[-1]
    dtype = x.dtype
    r = torch.randn_like(x)
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    g_out, g_res = torch.randn_like(x), torch.randn_like(x)

    def run(xi, ri, wi, bi, fused):
        leaves = [t.detach().clone().requires_grad_(True) for t in (xi, ri, wi, bi)]
        a, c, wl, bl = leaves
        if fused:
            if kind == "layer_norm":
                out, res = fusedops.add_layer_norm(a, c, (n,), wl, bl)
            else:
                out, res = fusedops.add_rms_norm(a, c, (n,), wl, eps=1e-6)
        else:
            res = a + c
            out = F.layer_norm(res, (n,), wl, bl) if kind == "layer_norm" else F.rms_norm(res, (n,), wl, 1e-6)
        loss = (out * g_out.to(out.dtype)).sum() + (res * g_res.to(res.dtype)).sum()
        loss.backward()
        grads = [t.grad for t in leaves]
        if kind == "rms_norm":
            grads[3] = None
        return [out.detach(), res.detach()] + grads

    ours = run(x, r, w, b, True)
    theirs = run(x, r, w, b, False)
    ref = run(x.double(), r.double(), w.double(), b.double(), False)
    names = ["out", "residual_out", "d input", "d residual", "dweight", "dbias"]
    for name, o, rf, t in zip(names, ours, ref, theirs):
        if o is not None:
            assert_close_to_reference(o, rf, t, atol=1e-5, name=f"add_{kind} {name}")


@gpu
@pytest.mark.parametrize("index", range(10))
def test_gpu_opcheck(index):
    torch.library.opcheck(*list(_op_samples("cuda"))[index])


# Hidden sizes that select every forward kernel (see REGISTER_VARIANTS), 16-byte chunks and
# scalar: warp rows of 1 and 2 chunks, one-row blocks of 2, 4 and 8 chunks a thread, add_* rows in
# 1024-thread blocks, prefetching rows, the streaming kernel past them.
INFERENCE_SIZES = [(256, torch.bfloat16), (512, torch.bfloat16), (1024, torch.bfloat16), (4096, torch.float16),
                   (16384, torch.bfloat16), (32768, torch.bfloat16), (65536, torch.bfloat16), (41, torch.float16),
                   (3001, torch.bfloat16), (16384, torch.float32)]


@gpu
@pytest.mark.parametrize("n, dtype", INFERENCE_SIZES)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_gpu_inference_forward_matches_training(kind, dtype, n):
    """Without autograd the forward writes no statistics; its outputs are the training forward's,
    bit for bit, and that forward's statistics match the reference."""
    rows = max(3, 2**21 // n) + 1
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 2 + 0.5
    r = torch.randn_like(x)
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    layer = "layer" in kind
    args = (x, r) if kind.startswith("add_") else (x,)
    args += ([n], w, b, 1e-5) if layer else ([n], w, 1e-5)
    op = getattr(ops, f"{kind}_fwd")
    count = 2 if layer else 1
    inference = op(*args, return_stats=False)
    assert all(t.numel() == 0 for t in inference[-count:])
    training = op(*args)
    for o, t in zip(inference[:-count], training[:-count]):
        assert torch.equal(o, t), kind
    normalized = training[1] if kind.startswith("add_") else x
    expected = reference.layer_norm(normalized, [n], w, b, 1e-5) if layer else reference.rms_norm(normalized, [n], w, 1e-5)
    for got, want in zip(training[-count:], expected[-count:]):
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)


@gpu
@sanitizer
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_gpu_inference_forward_small(kind):
    """The inference and training forwards of warp rows (block statistics) and 1024-thread rows."""
    for n in (512, 32768):
        test_gpu_inference_forward_matches_training(kind, torch.bfloat16, n)


@gpu
def test_gpu_rms_eps_none_is_the_compute_dtype_eps():
    _check_rms_eps_none("cuda")


@gpu
def test_gpu_compile_fullgraph_gradients():
    _compiled_gradients_match_eager("cuda")


@gpu
def test_gpu_compile_fullgraph():
    x, r = torch.randn(4, 7, 256, device="cuda"), torch.randn(4, 7, 256, device="cuda")
    w_ln, b_ln, w_rms = (torch.randn(256, device="cuda") for _ in range(3))
    compiled = torch.compile(_block, fullgraph=True)
    torch.testing.assert_close(compiled(x, r, w_ln, b_ln, w_rms), _block(x, r, w_ln, b_ln, w_rms))


@gpu
@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_gpu_modules(name):
    ours, theirs = getattr(fusedops.nn, name), getattr(torch.nn, name)
    torch_module = theirs(1024, device="cuda", dtype=torch.bfloat16)
    module = ours(1024, device="cuda", dtype=torch.bfloat16)
    module.load_state_dict(torch_module.state_dict())
    x = torch.randn(8, 64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = module(x)
    out.sum().backward()
    torch.testing.assert_close(out, torch_module(x), rtol=2e-2, atol=2e-2)
    assert module.weight.grad is not None and torch.isfinite(module.weight.grad).all()


@gpu
@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_gpu_modules_under_autocast_keep_the_input_dtype(name):
    """fusedops ops are on none of autocast's lists: under torch.autocast a bf16 input with fp32
    parameters (the mixed-precision case) runs the fused kernel and comes back in bf16, where
    torch may compute in and return fp32; dx is bf16, dweight / dbias fp32. Against a float64
    reference, out and dx are as close as torch's under autocast rounded to bf16 (its RMSNorm
    rounds intermediates to bf16, so its dx is the less accurate one)."""
    ours, theirs = getattr(fusedops.nn, name), getattr(torch.nn, name)
    torch_module = theirs(1024, device="cuda")
    with torch.no_grad():
        for p in torch_module.parameters():
            p.normal_()
    module = ours(1024, device="cuda")
    module.load_state_dict(torch_module.state_dict())
    reference_module = theirs(1024, device="cuda", dtype=torch.float64)
    reference_module.load_state_dict(torch_module.state_dict())
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)

    def run(m, x, autocast):
        leaf = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = m(leaf)
        out.backward(dy.to(out.dtype))
        return out.detach(), leaf.grad, [p.grad for p in m.parameters()]

    out, dx, param_grads = run(module, x, True)
    torch_out, torch_dx, _ = run(torch_module, x, True)
    ref_out, ref_dx, ref_param_grads = run(reference_module, x.double(), False)
    assert out.dtype == dx.dtype == torch.bfloat16
    assert_close_to_reference(out, ref_out, torch_out.to(torch.bfloat16), name="output")
    assert_close_to_reference(dx, ref_dx, torch_dx.to(torch.bfloat16), name="dx")
    for ours_grad, ref_grad in zip(param_grads, ref_param_grads):
        assert ours_grad.dtype == torch.float32
        torch.testing.assert_close(ours_grad.double(), ref_grad, rtol=1e-4, atol=1e-4)
