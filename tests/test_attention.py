"""Fused attention: API and argument errors, fallback behaviour, the reference, opcheck and
torch.compile on CPU; accuracy (FlashAttention's rule), strides, GQA, causal alignment, huge
head counts and determinism on GPU."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import assert_close_to_reference
import fusedops
from fusedops import reference
from fusedops.ops.attention import _fallback_reason

ops = torch.ops.fusedops
DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [32, 64, 96, 128]
# (Lq, Lk): single positions, a single query or key, odd lengths that end mid-tile, Lq != Lk
# both ways (top-left causal alignment), and lengths just around and well past a tile multiple.
SEQ_LENS = [(1, 1), (1, 239), (239, 1), (113, 203), (127, 513), (1023, 1024)]


def _qkv(b, hq, hkv, lq, lk, d, dtype, device="cuda", seq_major=False, requires_grad=False):
    """Random q, k, v; seq_major builds [B, L, H, D] tensors and returns their [B, H, L, D] views."""

    def make(h, length):
        if seq_major:
            t = torch.randn(b, length, h, d, dtype=dtype, device=device).transpose(1, 2)
        else:
            t = torch.randn(b, h, length, d, dtype=dtype, device=device)
        return t.requires_grad_(requires_grad)

    return make(hq, lq), make(hkv, lk), make(hkv, lk)


def _sdpa64(q, k, v, grad, causal, scale=None):
    """Float64 oracle: output and (q, k, v) gradients of F.scaled_dot_product_attention."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q64, k64, v64, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    grads = torch.autograd.grad(out, (q64, k64, v64), grad.double())
    return out.detach(), grads


def _run(fn, q, k, v, grad, causal, scale=None):
    """Output and gradients of fn in q's dtype."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    grads = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), grads


def _check_against_torch(q, k, v, causal, grad=None, scale=None, grad_factor=3.0):
    if grad is None:
        grad = torch.randn_like(q)
    assert _fallback_reason(q, k, v, None, 0.0) is None, "this case must run the fused kernels"
    ref_out, ref_grads = _sdpa64(q, k, v, grad, causal, scale)
    out, grads = _run(fusedops.scaled_dot_product_attention, q, k, v, grad, causal, scale)
    torch_out, torch_grads = _run(F.scaled_dot_product_attention, q, k, v, grad, causal, scale)
    assert_close_to_reference(out, ref_out, torch_out, factor=2.0, atol=1e-5, name="out")
    for name, ours, ref, theirs in zip(("dq", "dk", "dv"), grads, ref_grads, torch_grads):
        assert ours.shape == ref.shape
        assert_close_to_reference(ours, ref, theirs, factor=grad_factor, atol=1e-4, name=name)
    return out, grads


# ---- CPU: API, argument errors, fallback, reference, opcheck, compile ------------------------


def test_argument_errors_name_the_argument():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match="query"):
        fusedops.scaled_dot_product_attention([1.0], q, q)
    with pytest.raises(TypeError, match="value"):
        fusedops.scaled_dot_product_attention(q, q, q.double())
    with pytest.raises(ValueError, match="dropout_p"):
        fusedops.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(TypeError, match="is_causal"):
        fusedops.scaled_dot_product_attention(q, q, q, is_causal=1)
    with pytest.raises(TypeError, match="scale"):
        fusedops.scaled_dot_product_attention(q, q, q, scale="0.5")
    with pytest.raises(ValueError, match="batch"):
        fusedops.scaled_dot_product_attention(q, torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    with pytest.raises(ValueError, match="enable_gqa"):
        kv = torch.randn(1, 1, 3, 8)
        fusedops.scaled_dot_product_attention(q, kv, kv)
    with pytest.raises(ValueError, match="value"):
        fusedops.scaled_dot_product_attention(q, q, torch.randn(1, 2, 4, 8))


def test_fallback_warns_once_per_reason(monkeypatch):
    from fusedops.ops import attention

    monkeypatch.setattr(attention, "_warned", set())
    q, k, v = _qkv(1, 2, 2, 5, 7, 16, torch.float32, device="cpu")
    mask = torch.rand(5, 7) > 0.3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fusedops.scaled_dot_product_attention(q, k, v)
        fusedops.scaled_dot_product_attention(q, k, v)
        masked = fusedops.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        fusedops.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "cpu" in messages[0] and "attn_mask" in messages[1]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(masked, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk", [(1, 1), (5, 9), (9, 5), (17, 17)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_reference_matches_sdpa_float64(causal, lq, lk, heads):
    """The reference (the CPU kernels and the GPU oracle) against PyTorch's math attention:
    top-left causal alignment, GQA, log-sum-exp, and the LSE-based backward."""
    hq, hkv = heads
    q, k, v = _qkv(2, hq, hkv, lq, lk, 16, torch.float64, device="cpu")
    grad = torch.randn_like(q)
    ref_out, ref_grads = _sdpa64(q, k, v, grad, causal, scale=0.3)
    out, lse = reference.attention_fwd(q, k, v, causal, 0.3)
    torch.testing.assert_close(out, ref_out)
    scores = q @ k.repeat_interleave(hq // hkv, 1).transpose(-1, -2) * 0.3
    if causal:
        scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    lse64 = torch.logsumexp(scores, -1)
    torch.testing.assert_close(lse, lse64.float())
    grads = reference.attention_bwd(grad, q, k, v, out, lse64, causal, 0.3)
    for ours, ref in zip(grads, ref_grads):
        torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("heads", [(2, 2), (4, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_cpu(heads, causal):
    hq, hkv = heads
    q, k, v = _qkv(1, hq, hkv, 5, 7, 16, torch.float32, device="cpu", requires_grad=True)
    torch.library.opcheck(ops.attention_fwd, (q, k, v, causal, 0.25))
    out, lse = ops.attention_fwd(q, k, v, causal, 0.25)
    grad = torch.randn_like(out)
    saved = (q.detach(), k.detach(), v.detach(), out.detach(), lse.detach())
    torch.library.opcheck(ops.attention_bwd, (grad, *saved, causal, 0.25))


def test_compile_fullgraph_cpu():
    q, k, v = _qkv(2, 4, 2, 6, 9, 16, torch.float32, device="cpu")

    def fn(q, k, v):
        return ops.attention_fwd(q, k, v, True, 0.25)[0] * 2

    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(q, k, v), fn(q, k, v))


@pytest.mark.parametrize(
    "archs, expected",
    [("9.0", "9.0a"), ("8.0;9.0", "8.0;9.0a"), ("8.0 9.0", "8.0;9.0a"), ("9.0a", "9.0a"), ("9.0+PTX", "9.0+PTX")],
)
def test_build_compiles_sm90_as_sm90a(archs, expected):
    """The Hopper wgmma forward needs an sm_90a cubin: a plain 9.0 is built as 9.0a."""
    from fusedops import _build

    assert _build.with_sm90a(archs) == expected


# ---- GPU: accuracy ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk", SEQ_LENS)
def test_matches_reference(dtype, head_dim, causal, lq, lk):
    q, k, v = _qkv(2, 3, 3, lq, lk, head_dim, dtype)
    _check_against_torch(q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_4224(head_dim, causal):
    q, k, v = _qkv(1, 2, 2, 4224, 4224, head_dim, torch.bfloat16)
    _check_against_torch(q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 2), (6, 1)])
def test_gqa(dtype, head_dim, causal, heads):
    hq, hkv = heads
    q, k, v = _qkv(2, hq, hkv, 177, 301, head_dim, dtype)
    _check_against_torch(q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_lse_matches_reference(head_dim):
    q, k, v = _qkv(2, 3, 3, 200, 333, head_dim, torch.bfloat16)
    out, lse = ops.attention_fwd(q, k, v, True, 0.1)
    _, ref_lse = reference.attention_fwd(q.double(), k.double(), v.double(), True, 0.1)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("lq, lk", [(1, 1), (3, 7), (17, 5), (64, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_large_scores_short_sequences_no_nan(head_dim, lq, lk, causal):
    """q scaled x5: peaked softmax rows, where a careless rescale gives inf - inf = NaN."""
    q, k, v = _qkv(2, 2, 2, lq, lk, head_dim, torch.bfloat16)
    _check_against_torch(q * 5, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [0.0, -0.2, 1.7])
def test_explicit_scale(scale):
    q, k, v = _qkv(1, 2, 2, 97, 131, 64, torch.bfloat16)
    # PyTorch's default CUDA backend returned NaN for scale=0.0 and scale=-0.2 on the H200
    # (torch 2.11): its math backend is the same-dtype baseline there.
    if scale <= 0.0:
        with sdpa_kernel(SDPBackend.MATH):
            _check_against_torch(q, k, v, True, scale=scale)
    else:
        _check_against_torch(q, k, v, True, scale=scale)


@pytest.mark.gpu
def test_batch_heads_above_grid_limit():
    """B * H = 65540 > 65535: the grid folds batch and heads into x."""
    q, k, v = _qkv(2, 32770, 32770, 5, 3, 64, torch.bfloat16)
    _check_against_torch(q, k, v, False)


# ---- GPU: layouts ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_seq_major_inputs_used_in_place(head_dim, causal):
    """[B, L, H, D] tensors transposed to [B, H, L, D]: read with their strides, and the output
    comes back in the same [B, L, H, D] memory layout."""
    q, k, v = _qkv(2, 4, 2, 150, 90, head_dim, torch.bfloat16, seq_major=True)
    out, _ = _check_against_torch(q, k, v, causal)
    assert out.stride() == q.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_non_contiguous_grad_output(head_dim):
    q, k, v = _qkv(2, 3, 3, 100, 70, head_dim, torch.bfloat16)
    seq_major = torch.randn(2, 100, 3, head_dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    _check_against_torch(q, k, v, True, grad=seq_major)
    expanded = torch.randn(1, 1, 1, head_dim, dtype=torch.bfloat16, device="cuda").expand_as(q)
    _check_against_torch(q, k, v, False, grad=expanded)


@pytest.mark.gpu
def test_offset_views():
    """Views with storage_offset 1 break 16-byte row alignment: they are copied (documented)."""
    base = torch.randn(3 * 2 * 2 * 77 * 64 + 1, dtype=torch.bfloat16, device="cuda")
    q, k, v = (base[1:].view(3, 2, 2, 77, 64)[i] for i in range(3))
    _check_against_torch(q, k, v, True)


# ---- GPU: determinism, fallback, opcheck, compile, sanitizer -----------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_backward_bitwise_deterministic(head_dim, heads):
    hq, hkv = heads
    q, k, v = _qkv(2, hq, hkv, 300, 400, head_dim, torch.bfloat16)
    grad = torch.randn_like(q)
    first = _run(fusedops.scaled_dot_product_attention, q, k, v, grad, True)
    for _ in range(50):
        again = _run(fusedops.scaled_dot_product_attention, q, k, v, grad, True)
        for a, b in zip((first[0], *first[1]), (again[0], *again[1])):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_fallbacks_match_sdpa(monkeypatch):
    from fusedops.ops import attention

    monkeypatch.setattr(attention, "_warned", set())
    q, k, v = _qkv(1, 2, 2, 33, 33, 80, torch.bfloat16)
    with pytest.warns(UserWarning, match="head dims"):
        out = fusedops.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    q, k, v = _qkv(1, 2, 2, 33, 33, 64, torch.float32)
    with pytest.warns(UserWarning, match="dtype"):
        fusedops.scaled_dot_product_attention(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)])
def test_opcheck_cuda(heads):
    hq, hkv = heads
    q, k, v = _qkv(1, hq, hkv, 70, 33, 64, torch.bfloat16, requires_grad=True)
    torch.library.opcheck(ops.attention_fwd, (q, k, v, True, 0.125))
    out, lse = ops.attention_fwd(q, k, v, True, 0.125)
    grad = torch.randn_like(out)
    saved = (q.detach(), k.detach(), v.detach(), out.detach(), lse.detach())
    torch.library.opcheck(ops.attention_bwd, (grad, *saved, True, 0.125))


@pytest.mark.gpu
def test_compile_fullgraph_cuda():
    q, k, v = _qkv(2, 4, 2, 129, 65, 128, torch.bfloat16)

    def fn(q, k, v):
        return fusedops.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(q, k, v), fn(q, k, v))


@pytest.mark.gpu
@pytest.mark.sanitizer
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk", [(1, 1), (70, 33), (33, 130)])
def test_sanitizer_small(head_dim, causal, lq, lk):
    q, k, v = _qkv(1, 4, 2, lq, lk, head_dim, torch.float16)
    _check_against_torch(q, k, v, causal)


# ---- GPU: Hopper wgmma forward (sm_90 devices, sm_90a builds) ----------------------------------
# On an sm_90 device the forward of head dims 64 and 128 runs attention_fwd_sm90_kernel; every
# accuracy test above then checks it. These tests prove that kernel runs, then localize a layout
# error: single-tile cases report O and LSE errors (LSE depends on S = Q K^T only) per warp row
# block and per 64-column block, for inputs chosen to isolate S, P V and row placement.

SM90_HEAD_DIMS = [64, 128]


def _on_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 (Hopper) GPU")


def _kernel_names(fn):
    """Names of the CUDA kernels fn launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA}


def _error_map(out, ref, row_block, col_block):
    """Max abs error per (row block, column block) of the last two dims, as a nested list."""
    err = (out.double() - ref).abs().amax(dim=tuple(range(out.dim() - 2)))
    rows, cols = err.shape
    return [
        [f"{err[r:r + row_block, c:c + col_block].max().item():.1e}" for c in range(0, cols, col_block)]
        for r in range(0, rows, row_block)
    ]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS + [96])
def test_sm90_forward_kernel_runs(dtype, head_dim):
    assert "9.0a" in fusedops.build_info()["arch_list"], "the build must compile sm_90a for the Hopper kernel"
    q, k, v = _qkv(1, 2, 2, 200, 300, head_dim, dtype)
    names = _kernel_names(lambda: ops.attention_fwd(q, k, v, True, 0.1))
    sm90 = any("attention_fwd_sm90_kernel" in name for name in names)
    mma_sync = any("attention_fwd_kernel" in name for name in names)
    if head_dim in SM90_HEAD_DIMS:
        assert sm90 and not mma_sync, f"expected the wgmma kernel, ran {sorted(names)}"
    else:
        assert mma_sync and not sm90, f"expected the mma.sync kernel, ran {sorted(names)}"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("length", [64, 128])
def test_sm90_single_tile_diagnostic(dtype, head_dim, length):
    """One query tile, one or two key tiles, non-causal, three inputs:
    random; q = 0 (S = 0, P uniform: O is the mean of V, so only the P V path and V's column
    layout matter); one-hot (q_i = k_i = e_(i mod D), scale 10: P is (near) one-hot on matching
    keys, so O picks rows of V and any row misplacement in S or in V shows)."""
    q, k, v = _qkv(1, 2, 2, length, length, head_dim, dtype)
    one_hot = torch.eye(head_dim, dtype=dtype, device="cuda")[torch.arange(length, device="cuda") % head_dim]
    one_hot = one_hot.expand(1, 2, length, head_dim)
    cases = {
        "random": (q, k, v, head_dim**-0.5),
        "q = 0 (P V only)": (torch.zeros_like(q), k, v, head_dim**-0.5),
        "one-hot (row placement)": (one_hot, one_hot, v, 10.0),
    }
    report, failures = [], []
    for name, (qc, kc, vc, scale) in cases.items():
        out, lse = ops.attention_fwd(qc, kc, vc, False, scale)
        ref_out, ref_lse = reference.attention_fwd(qc.double(), kc.double(), vc.double(), False, scale)
        torch_out = F.scaled_dot_product_attention(qc, kc, vc, scale=scale)
        budget = 2 * (torch_out.double() - ref_out).abs().max().item() + 1e-5
        out_err = (out.double() - ref_out).abs().max().item()
        lse_err = (lse.double() - ref_lse).abs().max().item()
        report.append(f"[{name}] out err {out_err:.3e} (budget {budget:.3e}), lse err {lse_err:.3e}")
        report.append(f"  out err per (16 rows, 64 cols): {_error_map(out, ref_out, 16, 64)}")
        report.append(f"  lse err per 16 rows: {_error_map(lse.unsqueeze(-1), ref_lse.unsqueeze(-1), 16, 1)}")
        if out_err > budget or lse_err > 1e-3:
            failures.append(name)
    assert not failures, f"failed: {failures}\n" + "\n".join(report)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk", [(64, 64), (128, 128), (129, 129), (200, 700), (700, 200), (4224, 4224)])
def test_sm90_no_worse_than_mma_sync_path(monkeypatch, head_dim, causal, lq, lk):
    """The wgmma forward against the mma.sync forward (FUSEDOPS_ATTENTION_SM90=0), both vs float64."""
    q, k, v = _qkv(2, 4, 2, lq, lk, head_dim, torch.bfloat16)
    ref_out, ref_lse = reference.attention_fwd(q.double(), k.double(), v.double(), causal, 0.1)
    out, lse = ops.attention_fwd(q, k, v, causal, 0.1)
    monkeypatch.setenv("FUSEDOPS_ATTENTION_SM90", "0")
    old_out, old_lse = ops.attention_fwd(q, k, v, causal, 0.1)
    err, old_err = ((o.double() - ref_out).abs().max().item() for o in (out, old_out))
    lse_err, old_lse_err = ((l.double() - ref_lse).abs().max().item() for l in (lse, old_lse))
    assert err <= 1.5 * old_err + 1e-5, f"out: wgmma {err:.3e} vs mma.sync {old_err:.3e}"
    assert lse_err <= 1.5 * old_lse_err + 1e-5, f"lse: wgmma {lse_err:.3e} vs mma.sync {old_lse_err:.3e}"


# ---- GPU: Hopper wgmma backward (sm_90 devices, sm_90a builds) ---------------------------------
# On an sm_90 device the backward of head dims 64 and 128 runs attention_bwd_dkdv_sm90_kernel and
# attention_bwd_dq_sm90_kernel, so every accuracy, GQA, stride, determinism and sanitizer test
# above checks them. These tests prove those kernels run, then localize an error: single-tile
# cases report dq (dQ kernel), dk and dv (dK/dV kernel) errors separately, with error maps.

SM90_BWD_KERNELS = {"attention_bwd_dkdv_sm90_kernel", "attention_bwd_dq_sm90_kernel"}
MMA_SYNC_BWD_KERNELS = {"attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"}


def _ran(kernels, names):
    return {kernel for kernel in kernels if any(kernel in name for name in names)}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS + [96])
def test_sm90_backward_kernel_runs(monkeypatch, dtype, head_dim):
    q, k, v = _qkv(1, 2, 2, 200, 300, head_dim, dtype)
    out, lse = ops.attention_fwd(q, k, v, True, 0.1)
    grad = torch.randn_like(out)

    def backward():
        ops.attention_bwd(grad, q, k, v, out, lse, True, 0.1)

    names = _kernel_names(backward)
    if head_dim in SM90_HEAD_DIMS:
        assert _ran(SM90_BWD_KERNELS, names) == SM90_BWD_KERNELS, f"expected the wgmma kernels, ran {sorted(names)}"
        assert not _ran(MMA_SYNC_BWD_KERNELS, names), f"mma.sync kernels ran too: {sorted(names)}"
    else:
        assert _ran(MMA_SYNC_BWD_KERNELS, names) == MMA_SYNC_BWD_KERNELS, f"ran {sorted(names)}"
        assert not _ran(SM90_BWD_KERNELS, names), f"ran {sorted(names)}"
    monkeypatch.setenv("FUSEDOPS_ATTENTION_SM90_BWD", "0")
    names = _kernel_names(backward)
    assert _ran(MMA_SYNC_BWD_KERNELS, names) == MMA_SYNC_BWD_KERNELS and not _ran(SM90_BWD_KERNELS, names), sorted(
        names
    )


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("length", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_backward_single_tile_diagnostic(dtype, head_dim, length, causal):
    """One dK/dV block (128 keys) and one dQ block (128 queries), three inputs:
    random; q = 0 (S = 0: P is uniform over the visible keys, so dv is a mean of dO rows and
    dk = 0: only the P^T dO path and dO's column layout matter); one-hot (q_i = k_i = e_(i mod D),
    scale 10: P is (near) one-hot on matching keys, so dv picks rows of dO and any row misplacement
    of S^T, P^T or dO shows). dq comes from the dQ kernel, dk and dv from the dK/dV kernel."""
    q, k, v = _qkv(1, 2, 2, length, length, head_dim, dtype)
    grad = torch.randn_like(q)
    one_hot = torch.eye(head_dim, dtype=dtype, device="cuda")[torch.arange(length, device="cuda") % head_dim]
    one_hot = one_hot.expand(1, 2, length, head_dim)
    cases = {
        "random": (q, k, v, head_dim**-0.5),
        "q = 0 (P^T dO only)": (torch.zeros_like(q), k, v, head_dim**-0.5),
        "one-hot (row placement)": (one_hot, one_hot, v, 10.0),
    }
    report, failures = [], []
    for name, (qc, kc, vc, scale) in cases.items():
        out, lse = ops.attention_fwd(qc, kc, vc, causal, scale)
        grads = ops.attention_bwd(grad, qc, kc, vc, out, lse, causal, scale)
        _, ref_grads = _sdpa64(qc, kc, vc, grad, causal, scale)
        _, torch_grads = _run(F.scaled_dot_product_attention, qc, kc, vc, grad, causal, scale)
        for grad_name, ours, ref, theirs in zip(("dq", "dk", "dv"), grads, ref_grads, torch_grads):
            budget = 3 * (theirs.double() - ref).abs().max().item() + 1e-4
            err = (ours.double() - ref).abs().max().item()
            report.append(f"[{name}] {grad_name} err {err:.3e} (budget {budget:.3e}, nan {ours.isnan().any().item()})")
            report.append(f"  {grad_name} err per (16 rows, 64 cols): {_error_map(ours, ref, 16, 64)}")
            if not err <= budget:
                failures.append(f"{name}: {grad_name}")
    assert not failures, f"failed: {failures}\n" + "\n".join(report)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("lq, lk", [(64, 64), (129, 129), (200, 700), (700, 200), (1000, 1000)])
def test_sm90_backward_no_worse_than_mma_sync_path(monkeypatch, head_dim, causal, heads, lq, lk):
    """The wgmma backward against the mma.sync backward (FUSEDOPS_ATTENTION_SM90_BWD=0) on the same
    forward output, both vs float64."""
    hq, hkv = heads
    q, k, v = _qkv(2, hq, hkv, lq, lk, head_dim, torch.bfloat16)
    grad = torch.randn_like(q)
    out, lse = ops.attention_fwd(q, k, v, causal, 0.1)
    _, ref_grads = _sdpa64(q, k, v, grad, causal, 0.1)
    grads = ops.attention_bwd(grad, q, k, v, out, lse, causal, 0.1)
    monkeypatch.setenv("FUSEDOPS_ATTENTION_SM90_BWD", "0")
    old_grads = ops.attention_bwd(grad, q, k, v, out, lse, causal, 0.1)
    failures = []
    for name, ours, old, ref in zip(("dq", "dk", "dv"), grads, old_grads, ref_grads):
        err, old_err = ((g.double() - ref).abs().max().item() for g in (ours, old))
        if not err <= 2.0 * old_err + 1e-4:
            failures.append(f"{name}: wgmma {err:.3e} vs mma.sync {old_err:.3e}")
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.sanitizer
@needs_sm90
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk", [(130, 257), (257, 130)])
def test_sm90_backward_sanitizer_multi_tile(head_dim, causal, lq, lk):
    """Several query and key tiles of both wgmma backward kernels, GQA (fp32 dK/dV partials)."""
    q, k, v = _qkv(1, 4, 2, lq, lk, head_dim, torch.bfloat16)
    _check_against_torch(q, k, v, causal)
