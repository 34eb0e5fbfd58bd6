"""Fused attention: registrations (CPU reference, fake, autograd) and the public wrapper."""
import math
import warnings

import torch
import torch.nn.functional as F

from .. import reference

ops = torch.ops.fusedops

NATIVE_DTYPES = (torch.float16, torch.bfloat16)
NATIVE_HEAD_DIMS = (32, 64, 96, 128)


def _output_like(ref):
    """An output shaped like ref, in ref's memory layout when its last dim is contiguous, else
    contiguous: the rule attention_ops.cpp allocates by."""
    return torch.empty_like(ref) if ref.stride(-1) == 1 else ref.new_empty(ref.shape)


def _lse_like(q):
    return q.new_empty(q.shape[:3], dtype=torch.float32)


# ---- attention_fwd / attention_bwd -----------------------------------------------------------


@torch.library.register_kernel("fusedops::attention_fwd", "cpu")
def _(q, k, v, causal, scale):
    out, lse = reference.attention_fwd(q, k, v, causal, scale)
    return _output_like(q).copy_(out), lse


@torch.library.register_kernel("fusedops::attention_bwd", "cpu")
def _(grad_out, q, k, v, out, lse, causal, scale):
    dq, dk, dv = reference.attention_bwd(grad_out, q, k, v, out, lse, causal, scale)
    grouped = k.shape[1] != q.shape[1]
    if grouped:
        return _output_like(q).copy_(dq), dk.contiguous(), dv.contiguous()
    return _output_like(q).copy_(dq), _output_like(k).copy_(dk), _output_like(v).copy_(dv)


@torch.library.register_fake("fusedops::attention_fwd")
def _(q, k, v, causal, scale):
    return _output_like(q), _lse_like(q)


@torch.library.register_fake("fusedops::attention_bwd")
def _(grad_out, q, k, v, out, lse, causal, scale):
    if k.shape[1] != q.shape[1]:  # GQA: dK/dV are reduced over each group into new tensors
        return _output_like(q), k.new_empty(k.shape), v.new_empty(v.shape)
    return _output_like(q), _output_like(k), _output_like(v)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.causal, ctx.scale = causal, scale
    ctx.save_for_backward(q, k, v, out, lse)


def _attention_backward(ctx, grad_out, _grad_lse):
    """The lse output is a saved statistic, not differentiated: its gradient is ignored."""
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ops.attention_bwd(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


torch.library.register_autograd("fusedops::attention_fwd", _attention_backward, setup_context=_attention_setup)


# ---- public wrapper --------------------------------------------------------------------------

_warned = set()


def _check_arguments(query, key, value, dropout_p, is_causal, scale, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fusedops: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("key", key), ("value", value)):
        if t.device != query.device:
            raise ValueError(f"fusedops: {name} is on {t.device} but query is on {query.device}")
        if t.dtype != query.dtype:
            raise TypeError(f"fusedops: {name} has dtype {t.dtype} but query has dtype {query.dtype}")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"fusedops: dropout_p must be a number in [0, 1], got {dropout_p!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"fusedops: is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"fusedops: enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise TypeError(f"fusedops: scale must be None or a Python number, got {type(scale).__name__}")
    if query.dim() == 4 and key.dim() == 4 and value.dim() == 4:
        if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
            raise ValueError(
                f"fusedops: query, key and value must have the same batch size, got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        if key.shape[:3] != value.shape[:3]:
            raise ValueError(
                f"fusedops: value must have key's batch, heads and length, got key {tuple(key.shape)} "
                f"and value {tuple(value.shape)}"
            )
        if key.shape[-1] != query.shape[-1]:
            raise ValueError(
                f"fusedops: key head dim {key.shape[-1]} differs from query head dim {query.shape[-1]}"
            )
        hq, hkv = query.shape[1], key.shape[1]
        if hq != hkv and not (enable_gqa and hkv > 0 and hq % hkv == 0):
            raise ValueError(
                f"fusedops: key has {hkv} heads and query {hq}: different head counts need "
                f"enable_gqa=True and query heads a multiple of key heads"
            )


def _fallback_reason(query, key, value, attn_mask, dropout_p):
    """Why this call cannot run on the fused kernels, or None when it can."""
    if attn_mask is not None:
        return "attn_mask is not supported natively"
    if dropout_p > 0.0:
        return "dropout_p > 0 is not supported natively"
    if query.device.type != "cuda":
        return f"tensors on {query.device.type} run natively only on CUDA"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "only 4-D [batch, heads, seq, head_dim] inputs are native"
    if query.dtype not in NATIVE_DTYPES:
        return f"dtype {query.dtype} is not native (float16 and bfloat16 are)"
    if query.shape[-1] not in NATIVE_HEAD_DIMS or value.shape[-1] != query.shape[-1]:
        return f"head dims (query {query.shape[-1]}, value {value.shape[-1]}) are not native (32, 64, 96 and 128 are)"
    if key.shape[2] == 0 or query.numel() == 0:
        return "empty inputs are not native"
    return None


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """F.scaled_dot_product_attention on fused tensor-core kernels: same signature and
    semantics, [batch, heads, seq, head_dim] layout, top-left causal alignment when the query
    and key lengths differ, GQA/MQA with enable_gqa=True, default scale 1/sqrt(head_dim).

    Native: float16/bfloat16 CUDA tensors with head_dim 32, 64, 96 or 128, no attn_mask, no dropout.
    Anything else runs F.scaled_dot_product_attention, with a warning once per reason."""
    _check_arguments(query, key, value, dropout_p, is_causal, scale, enable_gqa)
    reason = _fallback_reason(query, key, value, attn_mask, dropout_p)
    if reason is not None:
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(
                f"fusedops.scaled_dot_product_attention: {reason}; using torch.nn.functional."
                "scaled_dot_product_attention",
                stacklevel=2,
            )
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return ops.attention_fwd(query, key, value, is_causal, scale)[0]
