"""Attention benchmark: fusedops vs PyTorch SDPA's flash and cuDNN backends, bf16, TFLOP/s.

FLOPs: forward = 4 * B * H * Lq * Lk * D (S = Q K^T and O = P V), halved when causal;
backward = 2.5 x forward. Backward is timed alone (autograd.grad on a retained graph).
"fusedops mma.sync" is the sm_80-style forward and backward forced on Hopper
(FUSEDOPS_ATTENTION_SM90=0), to compare them with the wgmma kernels "fusedops" runs there.
"""
import contextlib
import os

import torch
import torch.nn.functional as F

import fusedops

from .common import progress

# (B, H, S, D) from shared/ANCHORS.md's attention table.
SHAPES = [(4, 16, 4096, 128), (1, 16, 16384, 128), (8, 32, 2048, 64), (2, 32, 8192, 64)]
QUICK_SHAPES = [(4, 16, 4096, 128), (8, 32, 2048, 64)]  # both Hopper forward kernels (head_dim 128 and 64)


def _backends():
    """name -> context manager factory selecting one SDPA backend (None where unavailable)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {}
    found = {}
    for name, attr in (("sdpa flash", "FLASH_ATTENTION"), ("sdpa cuDNN", "CUDNN_ATTENTION")):
        backend = getattr(SDPBackend, attr, None)
        if backend is not None:
            found[name] = lambda backend=backend: sdpa_kernel(backend)
    return found


@contextlib.contextmanager
def _mma_sync():
    """The mma.sync kernels instead of the wgmma ones (the host reads the variable per call)."""
    saved = os.environ.get("FUSEDOPS_ATTENTION_SM90")
    os.environ["FUSEDOPS_ATTENTION_SM90"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["FUSEDOPS_ATTENTION_SM90"]
        else:
            os.environ["FUSEDOPS_ATTENTION_SM90"] = saved


def _forward_fn(impl, context, q, k, v, causal):
    def fn():
        with context():
            return impl(q, k, v, is_causal=causal)

    return fn


def _backward_fn(forward, context, q, k, v):
    """Backward alone: the forward graph is built once and retained."""
    out = forward()
    grad = torch.randn_like(out)

    def fn():
        with context():
            return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    return fn


def _usable(fn):
    try:
        fn()
        torch.cuda.synchronize()
        return fn
    except Exception:  # noqa: BLE001 - a backend that cannot run this shape is reported as missing
        return None


def run(report, quick):
    backends = _backends()
    for b, h, s, d in progress(QUICK_SHAPES if quick else SHAPES, "attention"):
        for causal in (False, True):
            q, k, v = (
                torch.randn(b, h, s, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3)
            )
            flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            case = f"B{b} H{h} S{s} D{d}{' causal' if causal else ''}"
            ours = _forward_fn(fusedops.scaled_dot_product_attention, contextlib.nullcontext, q, k, v, causal)
            contexts = {"fusedops": contextlib.nullcontext, "fusedops mma.sync": _mma_sync, **backends}
            forwards = {
                "fusedops": ours,
                "fusedops mma.sync": _forward_fn(fusedops.scaled_dot_product_attention, _mma_sync, q, k, v, causal),
            }
            for name, context in backends.items():
                forwards[name] = _forward_fn(F.scaled_dot_product_attention, context, q, k, v, causal)
            forwards = {name: _usable(fn) for name, fn in forwards.items()}
            with torch.no_grad():
                report.measure("attention forward, bf16", case, forwards, flops=flops)
            backwards = {
                name: None if fn is None else _usable(_backward_fn(fn, contexts[name], q, k, v))
                for name, fn in forwards.items()
            }
            report.measure("attention backward, bf16", case, backwards, flops=2.5 * flops)
            del forwards, backwards
