"""Host time per call of the norm and softmax ops on tiny tensors: fusedops vs torch.

    python -m bench.host_overhead [--device cuda|cpu] [--calls N]

Tiny inputs keep every kernel far shorter than the host work that queues it, so the wall time of
a long loop of calls divided by the number of calls is the CPU cost of one call (Python wrapper,
argument checks, dispatch, autograd, allocation, launch). The device is synchronized only
outside the timed loop. On CPU the fusedops kernels are the Python reference: only the fusedops
column minus its kernel is meaningful there (compare builds, not fusedops against torch).
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, device, calls, repeats=5):
    """Median over `repeats` loops of the microseconds per call of fn()."""
    for _ in range(max(calls // 10, 20)):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        _sync(device)
    return statistics.median(samples)


def _forward_backward(forward, leaves):
    """fn() running forward then backward of the first output (grads w.r.t. leaves, no .grad writes)."""

    def run():
        out = forward()
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, leaves, grad_outputs=grad, allow_unused=True)

    out = forward()
    grad = torch.ones_like(out[0] if isinstance(out, tuple) else out)
    return run


def cases(device, n=4096):
    """(name, {"fusedops": (fn, leaves), "torch": (fn, leaves)}) for each op."""
    import fusedops

    bf16 = torch.bfloat16
    x = torch.randn(4, n, device=device, dtype=bf16, requires_grad=True)
    r = torch.randn(4, n, device=device, dtype=bf16, requires_grad=True)
    w = torch.randn(n, device=device, dtype=bf16, requires_grad=True)
    b = torch.randn(n, device=device, dtype=bf16, requires_grad=True)
    s = torch.randn(4, n, device=device, dtype=bf16, requires_grad=True)
    scores = torch.randn(1, 4, 64, 64, device=device, dtype=bf16, requires_grad=True)
    keep = torch.rand(1, 1, 64, 64, device=device) > 0.1
    additive = torch.zeros(keep.shape, device=device, dtype=bf16).masked_fill(~keep, float("-inf"))

    def torch_add_norm(norm):
        def run():
            res = x + r
            return norm(res), res

        return run

    yield "layer_norm", {
        "fusedops": (lambda: fusedops.layer_norm(x, (n,), w, b), [x, w, b]),
        "torch": (lambda: F.layer_norm(x, (n,), w, b), [x, w, b]),
    }
    yield "rms_norm", {
        "fusedops": (lambda: fusedops.rms_norm(x, (n,), w), [x, w]),
        "torch": (lambda: F.rms_norm(x, (n,), w), [x, w]),
    }
    yield "add_layer_norm", {
        "fusedops": (lambda: fusedops.add_layer_norm(x, r, (n,), w, b), [x, r, w, b]),
        "torch": (torch_add_norm(lambda t: F.layer_norm(t, (n,), w, b)), [x, r, w, b]),
    }
    yield "add_rms_norm", {
        "fusedops": (lambda: fusedops.add_rms_norm(x, r, (n,), w), [x, r, w]),
        "torch": (torch_add_norm(lambda t: F.rms_norm(t, (n,), w)), [x, r, w]),
    }
    yield "softmax", {
        "fusedops": (lambda: fusedops.softmax(s), [s]),
        "torch": (lambda: torch.softmax(s, -1), [s]),
    }
    yield "log_softmax", {
        "fusedops": (lambda: fusedops.log_softmax(s), [s]),
        "torch": (lambda: torch.log_softmax(s, -1), [s]),
    }
    yield "masked_softmax (bool mask)", {
        "fusedops": (lambda: fusedops.masked_softmax(scores, keep), [scores]),
        "torch": (lambda: torch.softmax(scores + additive, -1), [scores]),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    parser.add_argument("--cols", type=int, default=4096, help="the norms' and softmax's last dim")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny CPU kernels: intra-op threads add only scheduling stalls
    import fusedops

    print(f"device: {args.device}; fusedops build: {fusedops.build_info()}; median host us per call "
          f"(bf16; norms (4, {args.cols}) with weight (and bias), softmax (4, {args.cols}), "
          "masked_softmax (1, 4, 64, 64))\n")
    print("| op | fusedops fwd | torch fwd | fusedops fwd+bwd | torch fwd+bwd |")
    print("|---|---:|---:|---:|---:|")
    for name, impls in cases(args.device, args.cols):
        row = []
        for mode in ("fwd", "fwd+bwd"):
            for impl in ("fusedops", "torch"):
                fn, leaves = impls[impl]
                if mode == "fwd":
                    with torch.no_grad():
                        row.append(per_call_us(fn, args.device, args.calls))
                else:
                    row.append(per_call_us(_forward_backward(fn, leaves), args.device, args.calls))
        print(f"| {name} | " + " | ".join(f"{us:.1f}" for us in row) + " |", flush=True)


if __name__ == "__main__":
    main()
