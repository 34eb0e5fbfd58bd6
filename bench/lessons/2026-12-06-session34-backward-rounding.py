"""Is each softmax backward correctly rounded from the y it is given? Errors in ulps against float64
evaluated on that y, ours and PyTorch's CUDA backward (session 34; needs a GPU and a built fusedops)."""
import torch, fusedops
torch.manual_seed(1)

def ulp_stats(dx, y, dy):
    y64, dy64 = y.double(), dy.double()
    ref = y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))
    mag = ref.abs().clamp_min(torch.finfo(dx.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag))) * torch.finfo(dx.dtype).eps
    e = (dx.double() - ref).abs() / ulp
    return f"max {e.max().item():.2f} ulp, >0.5 ulp {(e > 0.51).float().mean().item():.4f}, >1 ulp {(e > 1.01).float().mean().item():.5f}"

for dtype in (torch.bfloat16, torch.float16):
    for rows, cols in ((600, 1024), (600, 4096), (600, 8192), (600, 16384), (64, 65536)):
        x = torch.randn(rows, cols, dtype=dtype, device="cuda")
        dy = torch.randn(rows, cols, dtype=dtype, device="cuda")
        xo = x.clone().requires_grad_(True); yo = fusedops.softmax(xo); (dxo,) = torch.autograd.grad(yo, xo, dy)
        y = yo.detach()
        dxt = torch._softmax_backward_data(dy, y, -1, dtype)
        print(f"{dtype} {rows}x{cols}: ours {ulp_stats(dxo, y, dy)} | torch {ulp_stats(dxt, y, dy)} | differ {(dxo != dxt).float().mean().item():.3f}")
