"""Shared test helpers. GPU tests carry the `gpu` marker and skip, with the reason shown, on a
machine without CUDA; everything else runs on the CPU path (the reference kernels)."""
import zlib

import pytest
import torch

from fusedops import _ext

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "sanitizer: small GPU case that scripts/gpu_check.sh runs under compute-sanitizer")


def pytest_collection_modifyitems(config, items):
    if not _ext.available():  # every test needs the operators; skipping them all would read as green
        pytest.exit(f"fusedops extension not loaded: {_ext.load_error}", returncode=1)
    if not HAS_CUDA:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def assert_close_to_reference(out, ref64, torch_out, factor=2.0, atol=1e-6, name="output", best_out=None):
    """FlashAttention's rule: our error against the float64 reference is at most `factor` times
    the error of PyTorch's own op in the same dtype, plus a tiny absolute term. `best_out`, where
    given, is the best result the dtype allows from what our kernel is given (a backward evaluated
    in float64 on the forward's rounded output, then rounded once): the bar is then the larger of
    its error and torch's, so a peer that is lucky at the worst element sets no bar that a
    correctly rounded kernel can miss."""
    def error(t):
        return (t.double() - ref64).abs().max().item() if out.numel() else 0.0

    ours = error(out)
    theirs, whose = error(torch_out), "torch's"
    best = error(best_out) if best_out is not None else 0.0
    if best > theirs:
        theirs, whose = best, "the correctly rounded result's"
    assert not torch.isnan(out).any(), f"{name} has NaN"
    assert ours <= factor * theirs + atol, f"{name}: max error {ours:.3e} > {factor} x {whose} {theirs:.3e} + {atol}"


def assert_double_backward_raises(fn, x, name=""):
    """create_graph=True gives fn's first-order gradient; differentiating it again raises
    "<name> has no double backward" (fusedops' backward kernels have no derivative)."""
    (dx,) = torch.autograd.grad(fn(x).pow(2).sum(), x, create_graph=True)
    (expected,) = torch.autograd.grad(fn(x).pow(2).sum(), x)
    torch.testing.assert_close(dx, expected)
    with pytest.raises(RuntimeError, match=f"{name} has no double backward" if name else "no double backward"):
        torch.autograd.grad(dx.pow(2).sum(), x)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Different random inputs in every test, reproducible from the test's id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield

