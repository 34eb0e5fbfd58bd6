"""Softmax family: registrations (CPU reference, fake) and public wrappers. Autograd is
registered in C++ (csrc/softmax/softmax_autograd.cpp) to keep host overhead low.

The ops work along the last dim; `dim != -1` moves that dim last with an explicit copy."""
import torch

from .. import reference
from . import _checks

ops = torch.ops.fusedops


# ---- softmax / log_softmax -------------------------------------------------------------------

torch.library.register_kernel("fusedops::softmax_fwd", "cpu", reference.softmax)
torch.library.register_kernel("fusedops::softmax_bwd", "cpu", reference.softmax_backward)


@torch.library.register_fake("fusedops::softmax_fwd")
def _(x, scale, log):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("fusedops::softmax_bwd")
def _(grad, y, scale, log):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


# ---- masked_softmax --------------------------------------------------------------------------


def _masked_softmax_cpu(x, mask, scale, causal, p, training):
    dropout = training and p > 0
    rng_state = reference.new_rng_state() if dropout else torch.zeros(2, dtype=torch.int64)
    out, lse = reference.masked_softmax(x, mask, scale, causal, p if dropout else 0.0, rng_state)
    return out, lse, rng_state.to(x.device)


torch.library.register_kernel("fusedops::masked_softmax_fwd", "cpu", _masked_softmax_cpu)
torch.library.register_kernel("fusedops::masked_softmax_bwd", "cpu", reference.masked_softmax_backward)


@torch.library.register_fake("fusedops::masked_softmax_fwd")
def _(x, mask, scale, causal, p, training):
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    lse = x.new_empty(x.shape[:-1], dtype=reference.acc_dtype(x.dtype))
    return out, lse, x.new_empty((2,), dtype=torch.int64)


@torch.library.register_fake("fusedops::masked_softmax_bwd")
def _(grad, x, mask, lse, rng_state, scale, causal, p):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---- public wrappers -------------------------------------------------------------------------
# The checks run on every call, so the common cases take a short path.

_softmax_fwd = ops.softmax_fwd.default
_masked_softmax_fwd = ops.masked_softmax_fwd.default


def _check_scale(scale):
    if type(scale) is float:
        return scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"fusedops: scale must be a Python number, got {type(scale).__name__}")
    return float(scale)


def _check_dim(dim, input):
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"fusedops: dim must be an int, got {type(dim).__name__}")
    ndim = max(input.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"fusedops: dim {dim} is out of range for input with {input.dim()} dims")
    return dim % ndim


def _softmax_along_dim(input, dim, scale, log):
    """softmax_fwd over dim: another dim than the last is moved last with an explicit copy and
    moved back."""
    _checks.check_input(input, "input")
    scale = _check_scale(scale)
    if dim == -1 and type(dim) is int:  # the last dim of any input, 0-dim included
        return _softmax_fwd(input, scale, log)
    dim = _check_dim(dim, input)
    if input.dim() == 0 or dim == input.dim() - 1:
        return _softmax_fwd(input, scale, log)
    return _softmax_fwd(input.movedim(dim, -1).contiguous(), scale, log).movedim(-1, dim)


def softmax(input, dim=-1, *, scale=1.0):
    """softmax(scale * input) along dim, as torch.softmax; fp32 accumulation, output in input's dtype.
    A row whose logits are all -inf gives zeros (torch gives NaN)."""
    return _softmax_along_dim(input, dim, scale, False)


def log_softmax(input, dim=-1, *, scale=1.0):
    """log_softmax(scale * input) along dim, as torch.log_softmax."""
    return _softmax_along_dim(input, dim, scale, True)


def _check_mask(mask, input):
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"fusedops: mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.device != input.device:
        raise ValueError(f"fusedops: mask is on {mask.device} but input is on {input.device}")
    if mask.dtype not in (torch.bool, input.dtype):
        raise TypeError(f"fusedops: mask must be bool or have input's dtype {input.dtype}, got {mask.dtype}")
    # A plain loop: all() over a generator took 0.5 us more of every call's host time.
    mask_shape, input_shape = mask.shape, input.shape
    lead = len(input_shape) - len(mask_shape)
    broadcastable = lead >= 0
    if broadcastable:
        for m, n in zip(mask_shape, input_shape[lead:]):
            if m != 1 and m != n:
                broadcastable = False
                break
    if not broadcastable:
        raise ValueError(
            f"fusedops: mask of shape {tuple(mask_shape)} is not broadcastable to input of shape {tuple(input_shape)}"
        )


def masked_softmax(input, mask=None, *, scale=1.0, causal=False, dropout_p=0.0, training=True):
    """dropout(softmax(scale * input + mask)) over the last dim, in one pass.

    mask: bool (True = keep, as in F.scaled_dot_product_attention) or additive float of input's
    dtype, broadcastable to input (e.g. [B, 1, Lq, Lk] or [B, 1, 1, Lk]); read through its
    broadcast strides, never expanded. causal=True lets query i see keys j <= i (top-left
    aligned) over the last two dims (Lq, Lk) and combines with mask. A fully masked row gives
    zeros and a zero gradient. Dropout uses the Philox stream of PyTorch's generator of input's
    device. The mask gets no gradient."""
    _checks.check_input(input, "input")
    if input.dim() < (2 if causal else 1):
        wanted = "2 dims (..., Lq, Lk) with causal=True" if causal else "1 dim (the softmax's)"
        raise ValueError(f"fusedops: input must have at least {wanted}, got shape {tuple(input.shape)}")
    if mask is not None:
        _check_mask(mask, input)
    scale = _check_scale(scale)
    _checks.check_probability(dropout_p, "dropout_p")
    return _masked_softmax_fwd(input, mask, scale, bool(causal), float(dropout_p), bool(training))[0]
