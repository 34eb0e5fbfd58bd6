"""Elementwise benchmarks: the fusion lesson (x * scale + bias unfused vs fused over 2^10..2^28
elements), every fused op forward and backward at 2^28 elements, and host overhead per call."""
import torch
import torch.nn.functional as F

import fusedops

from .common import backward_thunk, progress, try_compile

COLS = 4096


def _three_kernels(x, scale, bias):
    # The unfused fp32 pipeline: upcast, multiply-add, downcast; each step a kernel whose
    # result makes a round trip through HBM.
    up = x.float()
    out = torch.addcmul(torch.full_like(up, bias), up, torch.full((), scale, device=x.device))
    return out.to(x.dtype)


def lesson(report, quick):
    """The same expression, x * 0.5 + 2.0 on bf16, as three kernels, eager, compiled and fused."""
    compiled = try_compile(lambda x: x * 0.5 + 2.0)
    exponents = [10, 16, 20, 24, 28] if quick else list(range(10, 29, 2))
    for e in progress(exponents, "elementwise lesson"):
        x = torch.randn(2**e, dtype=torch.bfloat16, device="cuda")
        impls = {
            "3 kernels (fp32 via HBM)": lambda: _three_kernels(x, 0.5, 2.0),
            "eager": lambda: x * 0.5 + 2.0,
            "compile": (lambda: compiled(x)) if compiled else None,
            "fusedops": lambda: fusedops.scale_bias(x, 0.5, 2.0),
        }
        report.measure("x*scale+bias, bf16 (the fusion lesson)", f"2^{e}", impls, n_bytes=2 * x.numel() * 2)


def _op_cases(dtype, numel):
    rows = numel // COLS
    new = lambda: torch.randn(rows, COLS, dtype=dtype, device="cuda")  # noqa: E731
    x, r, g = new(), new(), new()
    s, b = torch.randn(COLS, dtype=dtype, device="cuda"), torch.randn(COLS, dtype=dtype, device="cuda")
    size = x.element_size() * numel
    # name, fused fn, eager fn, inputs that take gradients, forward bytes, backward bytes
    return [
        ("scale_bias", lambda x: fusedops.scale_bias(x, s, b), lambda x: x * s + b, (x,), 2 * size, 2 * size),
        ("bias_gelu tanh", lambda x: fusedops.bias_gelu(x, b, "tanh"),
         lambda x: F.gelu(x + b, approximate="tanh"), (x,), 2 * size, 3 * size),
        ("bias_gelu erf", lambda x: fusedops.bias_gelu(x, b), lambda x: F.gelu(x + b), (x,), 2 * size, 3 * size),
        ("bias_dropout_add p=0.1", lambda x, r: fusedops.bias_dropout_add(x, b, r, 0.1),
         lambda x, r: r + F.dropout(x + b, 0.1), (x, r), 3 * size, 2 * size),
        ("swiglu", fusedops.swiglu, lambda g, u: F.silu(g) * u, (g, x), 3 * size, 5 * size),
    ]


def ops_tables(report, quick):
    numel = 2**28
    for dtype in (torch.bfloat16, torch.float32):
        tag = str(dtype).replace("torch.", "")
        for name, fused, eager, inputs, fwd_bytes, bwd_bytes in progress(_op_cases(dtype, numel), f"elementwise {tag}"):
            compiled = try_compile(eager)
            impls = {"fusedops": fused, "eager": eager, "compile": compiled}
            report.measure(f"elementwise forward, 2^28 elements", f"{name} {tag}",
                           {k: (lambda f=f: f(*inputs)) if f else None for k, f in impls.items()}, n_bytes=fwd_bytes)
            report.measure(f"elementwise backward, 2^28 elements", f"{name} {tag}",
                           {k: backward_thunk(f, inputs) if f else None for k, f in impls.items()}, n_bytes=bwd_bytes)
            torch.cuda.empty_cache()


def host_overhead(report, quick):
    """One fused call on a tiny CUDA tensor against the single PyTorch op nearest to it."""
    x = torch.randn(4, 64, device="cuda")
    b = torch.randn(64, device="cuda")
    xg = x.clone().requires_grad_(True)
    pairs = [
        ("scale_bias vs torch.addcmul", lambda x: fusedops.scale_bias(x, b, b), lambda x: torch.addcmul(b, x, b)),
        ("bias_gelu vs F.gelu", lambda x: fusedops.bias_gelu(x, b), F.gelu),
        ("bias_dropout_add vs F.dropout", lambda x: fusedops.bias_dropout_add(x, b, x, 0.1), lambda x: F.dropout(x, 0.1)),
        ("swiglu vs F.silu", lambda x: fusedops.swiglu(x, x), F.silu),
    ]
    calls = 2_000 if quick else 10_000
    for name, fused, torch_op in pairs:
        for tag, t in (("", x), (", requires_grad", xg)):
            report.host_overhead(f"host overhead per call (4x64 fp32, {calls:,} calls)", name + tag,
                                 {"fusedops": lambda f=fused, t=t: f(t), "torch": lambda f=torch_op, t=t: f(t)},
                                 calls=calls)


def run(report, quick):
    lesson(report, quick)
    ops_tables(report, quick)
    host_overhead(report, quick)
