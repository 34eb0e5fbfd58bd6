"""fusedops alone (no peers, so it takes seconds) at every N the issues name: softmax
forward/backward, masked softmax with dropout, LayerNorm/RMSNorm forward/backward, as % of the
copy bandwidth measured in the same run. For tuning between full benchmark runs.

    python -m bench.sweep [softmax,norm]
"""
import sys

import torch

import fusedops

from .common import backward_thunk, bench_ms, copy_bandwidth_gbs


def main():
    families = sys.argv[1].split(",") if len(sys.argv) > 1 else ["softmax", "norm"]
    copy = copy_bandwidth_gbs()
    print(f"copy {copy:.0f} GB/s")

    def rate(n_bytes, ms):
        return f"{n_bytes / ms / 1e6:7.0f} GB/s {100 * n_bytes / ms / 1e6 / copy:5.1f}%"

    if "softmax" in families:
        for dtype in (torch.bfloat16, torch.float32):
            for n in [128, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144]:
                x = torch.randn(2**27 // n, n, device="cuda", dtype=dtype)
                size = x.numel() * x.element_size()
                for op in (fusedops.softmax, fusedops.log_softmax):
                    forward = bench_ms(lambda: op(x))
                    backward = bench_ms(backward_thunk(op, (x,)))
                    print(f"{op.__name__:11s} {dtype} N={n:6d} fwd {rate(2 * size, forward)}"
                          f"  bwd {rate(3 * size, backward)}", flush=True)
        x = torch.randn(8, 16, 1024, 1024, device="cuda", dtype=torch.bfloat16)
        for causal in (False, True):
            mask = None if causal else torch.rand(8, 1, 1024, 1024, device="cuda") > 0.2
            n_bytes = 2 * x.numel() * 2 + (0 if causal else mask.numel())
            for dropout_p in (0.0, 0.1):
                def masked(x):
                    return fusedops.masked_softmax(x, mask, causal=causal, dropout_p=dropout_p)

                forward = bench_ms(lambda: masked(x))
                backward = bench_ms(backward_thunk(masked, (x,)))
                print(f"masked_softmax dropout {dropout_p} causal={causal} fwd {rate(n_bytes, forward)}"
                      f"  bwd {rate(3 * x.numel() * 2, backward)}", flush=True)
    if "norm" in families:
        for n in [512, 1024, 2048, 4096, 8192, 16384, 32768]:
            x = torch.randn(2**26 // n, n, device="cuda", dtype=torch.bfloat16)
            w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            size = x.numel() * 2

            def layer_norm(x, w, b):
                return fusedops.layer_norm(x, (n,), w, b)

            def rms_norm(x, w):
                return fusedops.rms_norm(x, (n,), w)

            print(f"norm N={n:6d} LN fwd {rate(2 * size, bench_ms(lambda: layer_norm(x, w, b)))}"
                  f" bwd {rate(3 * size, bench_ms(backward_thunk(layer_norm, (x, w, b))))}"
                  f" | RMS fwd {rate(2 * size, bench_ms(lambda: rms_norm(x, w)))}"
                  f" bwd {rate(3 * size, bench_ms(backward_thunk(rms_norm, (x, w))))}", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("bench.sweep: needs a CUDA GPU")
    main()
