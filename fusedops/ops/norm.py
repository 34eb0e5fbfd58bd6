"""LayerNorm / RMSNorm and their residual-add variants: registrations (CPU reference, fake) and
public wrappers. Autograd is registered in C++ (csrc/norm/norm_autograd.cpp) and the wrappers'
checks take short paths for the common cases: the host time of a call matters for small (decode)
batches."""
import numbers
from collections.abc import Iterable

import torch

from .. import reference
from . import _checks

ops = torch.ops.fusedops

# Forwards: (reference, number of statistics it returns last).
_CPU_FORWARDS = {
    "layer_norm_fwd": (reference.layer_norm, 2),
    "rms_norm_fwd": (reference.rms_norm, 1),
    "add_layer_norm_fwd": (reference.add_layer_norm, 2),
    "add_rms_norm_fwd": (reference.add_rms_norm, 1),
}
_CPU_BACKWARDS = {
    "layer_norm_bwd": reference.layer_norm_backward,
    "rms_norm_bwd": reference.rms_norm_backward,
}


def _cpu_forward(forward, stats):
    """The reference forward with the op's return_stats (without it the statistics come back empty)."""

    def kernel(*args, return_stats=True):
        outs = forward(*args)
        if return_stats:
            return outs
        return (*outs[:-stats], *(s.new_empty((0,)) for s in outs[-stats:]))

    return kernel


for _name, (_forward, _stats_count) in _CPU_FORWARDS.items():
    torch.library.register_kernel(f"fusedops::{_name}", "cpu", _cpu_forward(_forward, _stats_count))
for _name, _kernel in _CPU_BACKWARDS.items():
    torch.library.register_kernel(f"fusedops::{_name}", "cpu", _kernel)


# ---- fake kernels: shapes and dtypes only ----------------------------------------------------


def _like(t):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _stats(input, normalized_shape, return_stats):
    shape = input.shape[: input.dim() - len(normalized_shape)] if return_stats else (0,)
    return input.new_empty(shape, dtype=torch.float32)


def _param_grad(param, input, normalized_shape):
    if param is None:
        return input.new_empty((0,))
    return param.new_empty(tuple(normalized_shape))


@torch.library.register_fake("fusedops::layer_norm_fwd")
def _(input, normalized_shape, weight, bias, eps, *, return_stats=True):
    stats = _stats(input, normalized_shape, return_stats)
    return _like(input), stats, torch.empty_like(stats)


@torch.library.register_fake("fusedops::rms_norm_fwd")
def _(input, normalized_shape, weight, eps, *, return_stats=True):
    return _like(input), _stats(input, normalized_shape, return_stats)


@torch.library.register_fake("fusedops::add_layer_norm_fwd")
def _(input, residual, normalized_shape, weight, bias, eps, *, return_stats=True):
    stats = _stats(input, normalized_shape, return_stats)
    return _like(input), _like(input), stats, torch.empty_like(stats)


@torch.library.register_fake("fusedops::add_rms_norm_fwd")
def _(input, residual, normalized_shape, weight, eps, *, return_stats=True):
    return _like(input), _like(input), _stats(input, normalized_shape, return_stats)


@torch.library.register_fake("fusedops::layer_norm_bwd")
def _(grad_out, grad_residual_out, input, mean, rstd, normalized_shape, weight, bias):
    return _like(input), _param_grad(weight, input, normalized_shape), _param_grad(bias, input, normalized_shape)


@torch.library.register_fake("fusedops::rms_norm_bwd")
def _(grad_out, grad_residual_out, input, rstd, normalized_shape, weight):
    return _like(input), _param_grad(weight, input, normalized_shape)


# ---- public wrappers -------------------------------------------------------------------------
# The checks run on every call, so the common cases (an int or a tuple of ints, a float eps)
# take a short path; anything else gets the generic checks.

_layer_norm_fwd = ops.layer_norm_fwd.default
_rms_norm_fwd = ops.rms_norm_fwd.default
_add_layer_norm_fwd = ops.add_layer_norm_fwd.default
_add_rms_norm_fwd = ops.add_rms_norm_fwd.default
_LOW_PRECISION = (torch.float16, torch.bfloat16)
# RMSNorm's eps=None: the machine epsilon of the type torch computes in (fp32 for fp16 / bf16
# input), as its rms_norm does, though its docs name the input's dtype (bf16's is 2^16 times
# larger and changes the output by up to 0.4% at unit mean square).
_DEFAULT_RMS_EPS = {dtype: torch.finfo(reference.acc_dtype(dtype)).eps for dtype in _checks.FLOAT_DTYPES}


def _normalized_shape(normalized_shape, input):
    """normalized_shape as a tuple of ints, checked against input's trailing dims."""
    if type(normalized_shape) is int:
        shape = (normalized_shape,)
    elif type(normalized_shape) is tuple and all(type(d) is int for d in normalized_shape):
        shape = normalized_shape
    else:
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        if not isinstance(normalized_shape, Iterable) or not all(isinstance(d, numbers.Integral) for d in normalized_shape):
            raise TypeError(f"fusedops: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
        shape = tuple(int(d) for d in normalized_shape)
    sizes = input.shape
    if not shape or len(shape) > len(sizes) or sizes[len(sizes) - len(shape) :] != shape:
        raise ValueError(f"fusedops: normalized_shape {shape} must equal the trailing dims of input, of shape {tuple(sizes)}")
    return shape


def affine_dtype_supported(param_dtype, input_dtype):
    """A weight / bias dtype the kernels take with this input dtype: the input's, or fp32 with
    fp16/bf16 input (mixed precision)."""
    return param_dtype == input_dtype or (param_dtype == torch.float32 and input_dtype in _LOW_PRECISION)


def _check_affine(param, name, input, shape):
    """weight / bias: normalized_shape, on input's device, input's dtype or fp32 with fp16/bf16 input."""
    _checks.check_input(param, name)
    if param.device != input.device:
        raise ValueError(f"fusedops: {name} is on {param.device} but input is on {input.device}")
    dtype = param.dtype
    if not affine_dtype_supported(dtype, input.dtype):
        raise TypeError(
            f"fusedops: {name} has dtype {dtype} but must have input's dtype {input.dtype} "
            "(or float32 with float16/bfloat16 input)"
        )
    if param.shape != shape:
        raise ValueError(f"fusedops: {name} must have shape normalized_shape = {shape}, got {tuple(param.shape)}")


def _check_norm_args(input, normalized_shape, weight, bias, eps, residual=None, rms=False):
    """normalized_shape as a tuple of ints and eps as a float, after checking every argument
    (RMSNorm's eps=None: _DEFAULT_RMS_EPS)."""
    _checks.check_input(input, "input")
    if residual is not None:
        _checks.check_like(residual, input, "residual", "input")
    shape = _normalized_shape(normalized_shape, input)
    if weight is not None:
        _check_affine(weight, "weight", input, shape)
    if bias is not None:
        _check_affine(bias, "bias", input, shape)
        if weight is not None and weight.dtype != bias.dtype:
            raise TypeError(f"fusedops: bias has dtype {bias.dtype} but weight has dtype {weight.dtype}")
    if eps is None and rms:
        return shape, _DEFAULT_RMS_EPS[input.dtype]
    if (type(eps) is not float and (not isinstance(eps, numbers.Real) or isinstance(eps, bool))) or not eps >= 0:
        raise ValueError(f"fusedops: eps must be a non-negative number, got {eps!r}")
    return shape, float(eps)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """F.layer_norm in one pass over the input, fp32 statistics; weight / bias may be fp32 with
    fp16/bf16 input (the output keeps input's dtype)."""
    shape, eps = _check_norm_args(input, normalized_shape, weight, bias, eps)
    return _layer_norm_fwd(input, shape, weight, bias, eps, return_stats=False)[0]


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """F.rms_norm in one pass (eps=None means the float32 epsilon for float16 / bfloat16 / float32
    input and the float64 one for float64, the values F.rms_norm takes)."""
    shape, eps = _check_norm_args(input, normalized_shape, weight, None, eps, rms=True)
    return _rms_norm_fwd(input, shape, weight, eps, return_stats=False)[0]


def add_layer_norm(input, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    """(out, residual_out): residual_out = input + residual, out = layer_norm(residual_out), in
    one pass (the pre-norm transformer block). Gradients reach input and residual."""
    shape, eps = _check_norm_args(input, normalized_shape, weight, bias, eps, residual)
    out, residual_out, _, _ = _add_layer_norm_fwd(input, residual, shape, weight, bias, eps, return_stats=False)
    return out, residual_out


def add_rms_norm(input, residual, normalized_shape, weight=None, eps=None):
    """(out, residual_out): residual_out = input + residual, out = rms_norm(residual_out), in one
    pass. Gradients reach input and residual."""
    shape, eps = _check_norm_args(input, normalized_shape, weight, None, eps, residual, rms=True)
    out, residual_out, _ = _add_rms_norm_fwd(input, residual, shape, weight, eps, return_stats=False)
    return out, residual_out
