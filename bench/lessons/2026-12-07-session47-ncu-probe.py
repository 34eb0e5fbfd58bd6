"""ncu probe: one profiled launch of each peer's kernels for a few cases where a peer leads.
Run by 2026-12-07-session47-ncu-probe.sh (ncu --profile-from-start off) with CASE one of CASES."""
import sys

import torch

import fusedops
from bench.common import backward_thunk, try_compile
from bench import norm, softmax
from bench.norm import _eager, _fused, _liger, _timed_pair


def softmax_bwd(log):
    x = torch.randn(softmax.NUMEL // 32768, 32768, dtype=torch.float32, device="cuda")
    eager = (lambda t: torch.log_softmax(t, -1)) if log else (lambda t: torch.softmax(t, -1))
    ours = fusedops.log_softmax if log else fusedops.softmax
    return {"fusedops": backward_thunk(ours, (x,)), "compile": backward_thunk(try_compile(eager), (x,))}


def norm_fwd(kind, n):
    x = torch.randn(norm.NUMEL // n, n, dtype=norm.DTYPE, device="cuda")
    w = torch.randn(n, dtype=norm.DTYPE, device="cuda")
    b = torch.randn(n, dtype=norm.DTYPE, device="cuda") if "layer" in kind else None
    impls = {"fusedops": _fused(kind, n), "compile": try_compile(_eager(kind, n)), "liger": _liger(kind)}
    return {k: _timed_pair(f, x, None, w, b)[0] for k, f in impls.items() if f is not None}


CASES = {
    "softmax_bwd": lambda: softmax_bwd(False),
    "log_softmax_bwd": lambda: softmax_bwd(True),
    "ln_fwd_4096": lambda: norm_fwd("layer_norm", 4096),
    "ln_fwd_1024": lambda: norm_fwd("layer_norm", 1024),
    "rms_fwd_32768": lambda: norm_fwd("rms_norm", 32768),
}

thunks = CASES[sys.argv[1]]()
for f in thunks.values():  # compile and warm up outside the profiled range
    for _ in range(3):
        f()
torch.cuda.synchronize()
for name, f in thunks.items():
    torch.cuda.cudart().cudaProfilerStart()
    f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled", name, flush=True)
