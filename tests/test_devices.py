"""Operands on a GPU other than the current one: every family's kernels must launch on the
operands' device and stream (device guard, per-device kernel attributes and occupancy answers),
giving bit for bit what the same call gives on the current GPU. Skips on a machine with one GPU."""
import pytest
import torch

import fusedops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _calls():
    """(name, fn of tensors, input shapes): shapes that take each family's main paths (register
    rows, cluster rows with their shared-memory opt-in, streamed rows, tensor-core attention)."""
    def norm_layer(x, w, b):
        return fusedops.layer_norm(x, (x.shape[-1],), w, b)

    def norm_rms(x, w):
        return fusedops.rms_norm(x, (x.shape[-1],), w)

    def attention(q, k, v):
        return fusedops.scaled_dot_product_attention(q, k, v, is_causal=True)

    return [
        ("softmax 4096", fusedops.softmax, [(64, 4096)]),
        ("softmax 65536", fusedops.softmax, [(8, 65536)]),
        ("log_softmax 2^20", fusedops.log_softmax, [(2, 2**20)]),
        ("masked_softmax causal", lambda x: fusedops.masked_softmax(x, causal=True), [(2, 4, 256, 256)]),
        ("layer_norm 4096", norm_layer, [(256, 4096), (4096,), (4096,)]),
        ("layer_norm 32768", norm_layer, [(64, 32768), (32768,), (32768,)]),
        ("rms_norm 8192", norm_rms, [(128, 8192), (8192,)]),
        ("bias_gelu", fusedops.bias_gelu, [(256, 4096), (4096,)]),
        ("swiglu", fusedops.swiglu, [(256, 4096), (256, 4096)]),
        ("attention", attention, [(2, 4, 512, 128)] * 3),
    ]


CALLS = _calls()


@pytest.mark.parametrize("name, fn, shapes", CALLS, ids=[c[0] for c in CALLS])
def test_second_gpu_matches_current_gpu(name, fn, shapes):
    inputs = [torch.randn(s, dtype=torch.bfloat16, device="cuda:0") for s in shapes]
    grad = torch.randn(shapes[0], dtype=torch.bfloat16, device="cuda:0")

    def run(device):
        leaves = [t.to(device).requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, grad.to(device))
        return [out.detach()] + list(grads)

    with torch.cuda.device(0):
        here = run("cuda:0")
        there = run("cuda:1")
        torch.cuda.synchronize(1)
    assert all(t.device == torch.device("cuda:1") for t in there)
    for a, b in zip(here, there):
        assert torch.equal(a, b.to("cuda:0")), name
