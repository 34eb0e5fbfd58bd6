"""LayerNorm / RMSNorm and the add_* variants, bf16 input and weight, 2^26 elements, forward and
backward: fusedops vs eager vs torch.compile vs Liger.

Bytes (each operand once): forward reads x (and residual) and writes out (and residual_out);
backward reads x and dy (and the residual_out gradient) and writes dx. Weights, their
gradients and the fp32 statistics are added on top (they are small next to the rows).
Backward is timed alone: autograd.grad on a graph built once (retain_graph).
"""
import torch
import torch.nn.functional as F

import fusedops

from .common import liger, try_compile

NUMEL = 2**26
SIZES = [512, 1024, 2048, 4096, 8192, 16384, 32768]
QUICK_SIZES = [4096]
DTYPE = torch.bfloat16
EPS = 1e-5


def _liger_functions():
    """(LayerNorm, RMSNorm) autograd Functions of Liger, or (None, None) without it."""
    if liger() is None:
        return None, None
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:  # noqa: BLE001 - a missing peer is reported as missing
        return None, None
    return LigerLayerNormFunction, LigerRMSNormFunction


def _eager(kind, n):
    """The plain-PyTorch function of `kind` on (x, residual, weight, bias)."""
    shape = (n,)

    def norm(x, w, b):
        return F.layer_norm(x, shape, w, b, EPS) if "layer" in kind else F.rms_norm(x, shape, w, EPS)

    if kind.startswith("add_"):

        def add_norm(x, r, w, b):
            residual_out = x + r
            return norm(residual_out, w, b), residual_out

        return add_norm
    return lambda x, r, w, b: norm(x, w, b)


def _fused(kind, n):
    shape = (n,)
    return {
        "layer_norm": lambda x, r, w, b: fusedops.layer_norm(x, shape, w, b, EPS),
        "rms_norm": lambda x, r, w, b: fusedops.rms_norm(x, shape, w, EPS),
        "add_layer_norm": lambda x, r, w, b: fusedops.add_layer_norm(x, r, shape, w, b, EPS),
        "add_rms_norm": lambda x, r, w, b: fusedops.add_rms_norm(x, r, shape, w, EPS),
    }[kind]


def _liger(kind):
    ln, rms = _liger_functions()
    if kind == "layer_norm" and ln is not None:
        return lambda x, r, w, b: ln.apply(x, w, b, EPS)
    if kind == "rms_norm" and rms is not None:
        return lambda x, r, w, b: rms.apply(x, w, EPS)
    return None


def _timed_pair(fn, x, r, w, b):
    """(forward thunk, backward thunk) for fn; None, None when fn is None."""
    if fn is None:
        return None, None
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (x, r, w, b)]
    inputs = [t for t in leaves if t is not None]
    state = {}

    def forward():
        with torch.no_grad():
            return fn(*leaves)

    def backward():
        if "graph" not in state:
            outs = fn(*leaves)
            outs = outs if isinstance(outs, tuple) else (outs,)
            state["graph"] = (outs, [torch.randn_like(o) for o in outs])
        outs, grads = state["graph"]
        return torch.autograd.grad(outs, inputs, grads, retain_graph=True)

    return forward, backward


def _bytes(kind, n, rows, backward):
    elem = torch.finfo(DTYPE).bits // 8
    # each full-size operand once: forward x -> out; backward x, dy -> dx; add_* one more of each
    rows_bytes = 4 if kind.startswith("add_") else (3 if backward else 2)
    params = (2 if "layer" in kind else 1) * n * elem
    stats = (2 if "layer" in kind else 1) * rows * 4
    extra = params * (2 if backward else 1) + stats
    return rows_bytes * rows * n * elem + extra


def run(report, quick):
    sizes = QUICK_SIZES if quick else SIZES
    kinds = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]
    for kind in kinds:
        for n in sizes:
            rows = NUMEL // n
            x = torch.randn(rows, n, device="cuda", dtype=DTYPE)
            r = torch.randn_like(x) if kind.startswith("add_") else None
            w = torch.randn(n, device="cuda", dtype=DTYPE)
            b = torch.randn(n, device="cuda", dtype=DTYPE) if "layer" in kind else None
            compile_peer = None if quick and kind.startswith("add_") else try_compile(_eager(kind, n))
            impls = {
                "fusedops": _timed_pair(_fused(kind, n), x, r, w, b),
                "eager": _timed_pair(_eager(kind, n), x, r, w, b),
                "compile": _timed_pair(compile_peer, x, r, w, b),
                "liger": _timed_pair(_liger(kind), x, r, w, b),
            }
            case = f"{rows}x{n}"
            for direction, index in (("forward", 0), ("backward", 1)):
                report.measure(
                    f"{kind} {direction} (bf16, 2^26 elements)",
                    case,
                    {name: pair[index] for name, pair in impls.items()},
                    n_bytes=_bytes(kind, n, rows, direction == "backward"),
                )
            del x, r, w, b, impls
            torch.cuda.empty_cache()
