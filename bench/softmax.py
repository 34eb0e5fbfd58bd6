"""Softmax family benchmarks at 2^27 elements: softmax and log_softmax over the last dim for
N in {128 ... 262144} (forward: read x + write y; backward: read y + read dy + write dx), and
masked softmax over [B, H, L, L] with a broadcast [B, 1, L, L] bool or additive mask or
causal=True, with dropout (bytes: read x + read the mask once + write the output)."""
import torch
import torch.nn.functional as F

import fusedops

from .common import backward_thunk, liger, progress, try_compile

NUMEL = 2**27
# The N, plus 32768: inside the 90% bar's range (1024-65536), where the 16-bit forward
# takes staged clusters of two blocks and the fp32 forward 1024-thread register rows of 32
# elements a thread.
SIZES = [128, 1024, 4096, 16384, 32768, 65536, 262144]
# quick: bf16 only, one register-row and one staged-row size (torch.compile takes seconds per shape)
QUICK_SIZES = [1024, 65536]


def _liger_softmax():
    """Liger's softmax (forward and backward), or None when Liger or its softmax is missing."""
    module = liger()
    if module is None:
        return None
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except Exception:  # noqa: BLE001 - an older Liger without softmax is reported as missing
        return None
    return LigerSoftmaxFunction.apply


def _measure_fwd_bwd(report, table, case, impls, x, fwd_bytes, bwd_bytes):
    report.measure(f"{table} forward", case, {k: (lambda f=f: f(x)) if f else None for k, f in impls.items()},
                   n_bytes=fwd_bytes)
    report.measure(f"{table} backward", case, {k: backward_thunk(f, (x,)) if f else None for k, f in impls.items()},
                   n_bytes=bwd_bytes)
    torch.cuda.empty_cache()


def softmax_tables(report, quick):
    liger_softmax = _liger_softmax()
    for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
        tag = str(dtype).replace("torch.", "")
        for n in progress(QUICK_SIZES if quick else SIZES, f"softmax {tag}"):
            x = torch.randn(NUMEL // n, n, dtype=dtype, device="cuda")
            size = x.numel() * x.element_size()
            case = f"{NUMEL // n} x {n} {tag}"
            eager = lambda t: torch.softmax(t, -1)  # noqa: E731
            impls = {"fusedops": fusedops.softmax, "eager": eager, "compile": try_compile(eager),
                     "liger": liger_softmax if n <= 65536 else None}  # Liger refuses rows > 65536
            _measure_fwd_bwd(report, "softmax, 2^27 elements,", case, impls, x, 2 * size, 3 * size)
            log_eager = lambda t: torch.log_softmax(t, -1)  # noqa: E731
            log_impls = {"fusedops": fusedops.log_softmax, "eager": log_eager, "compile": try_compile(log_eager)}
            _measure_fwd_bwd(report, "log_softmax, 2^27 elements,", case, log_impls, x, 2 * size, 3 * size)
            del x


def masked_tables(report, quick):
    """[B, H, L, L] scores, scale 1/8, dropout 0.1: a broadcast bool mask, the same mask as an
    additive one (0 and -inf in the scores' dtype, as Hugging Face models build theirs), and causal."""
    shapes = [(8, 16, 1024)] if quick else [(32, 16, 512), (8, 16, 1024), (2, 16, 2048), (1, 8, 4096)]
    p, scale = 0.1, 0.125
    for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
        tag = str(dtype).replace("torch.", "")
        for b, h, length in progress(shapes, f"masked_softmax {tag}"):
            x = torch.randn(b, h, length, length, dtype=dtype, device="cuda")
            mask = torch.rand(b, 1, length, length, device="cuda") > 0.1
            additive = torch.zeros(mask.shape, dtype=dtype, device="cuda").masked_fill(~mask, float("-inf"))
            causal_keep = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()
            size = x.numel() * x.element_size()
            case = f"{b}x{h}x{length}x{length} {tag}"
            for name, keep, causal, mask_bytes, logits in (
                ("bool mask [B,1,L,L]", mask, False, mask.numel(),
                 lambda t: torch.where(mask, t * scale, float("-inf"))),
                ("additive mask [B,1,L,L]", additive, False, additive.numel() * additive.element_size(),
                 lambda t: t * scale + additive),
                ("causal", None, True, 0, lambda t: torch.where(causal_keep, t * scale, float("-inf"))),
            ):

                def eager(t, logits=logits):
                    return F.dropout(torch.softmax(logits(t), -1), p)

                def fused(t, keep=keep, causal=causal):
                    return fusedops.masked_softmax(t, keep, scale=scale, causal=causal, dropout_p=p)

                impls = {"fusedops": fused, "eager": eager, "compile": try_compile(eager)}
                _measure_fwd_bwd(report, f"masked_softmax {name}, dropout {p},", case, impls, x,
                                 2 * size + mask_bytes, 3 * size + mask_bytes)
            # fusedops alone without dropout: the gap to the table above is the Philox cost
            no_dropout = {"fusedops": lambda t, mask=mask: fusedops.masked_softmax(t, mask, scale=scale)}
            _measure_fwd_bwd(report, "masked_softmax bool mask [B,1,L,L], no dropout,", case, no_dropout, x,
                             2 * size + mask.numel(), 3 * size + mask.numel())
            del x, mask, additive


def run(report, quick):
    softmax_tables(report, quick)
    masked_tables(report, quick)
