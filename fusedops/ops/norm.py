"""LayerNorm / RMSNorm and their residual-add variants: registrations (CPU reference, fake,
autograd) and public wrappers."""
import numbers

import torch

from .. import reference
from . import _checks

ops = torch.ops.fusedops

_CPU_KERNELS = {
    "layer_norm_fwd": reference.layer_norm,
    "rms_norm_fwd": reference.rms_norm,
    "add_layer_norm_fwd": reference.add_layer_norm,
    "add_rms_norm_fwd": reference.add_rms_norm,
    "layer_norm_bwd": reference.layer_norm_backward,
    "rms_norm_bwd": reference.rms_norm_backward,
}
for _name, _kernel in _CPU_KERNELS.items():
    torch.library.register_kernel(f"fusedops::{_name}", "cpu", _kernel)


# ---- fake kernels: shapes and dtypes only ----------------------------------------------------


def _like(t):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _stats(input, normalized_shape):
    return input.new_empty(input.shape[: input.dim() - len(normalized_shape)], dtype=torch.float32)


def _param_grad(param, input, normalized_shape):
    if param is None:
        return input.new_empty((0,))
    return param.new_empty(tuple(normalized_shape))


@torch.library.register_fake("fusedops::layer_norm_fwd")
def _(input, normalized_shape, weight, bias, eps):
    return _like(input), _stats(input, normalized_shape), _stats(input, normalized_shape)


@torch.library.register_fake("fusedops::rms_norm_fwd")
def _(input, normalized_shape, weight, eps):
    return _like(input), _stats(input, normalized_shape)


@torch.library.register_fake("fusedops::add_layer_norm_fwd")
def _(input, residual, normalized_shape, weight, bias, eps):
    return _like(input), _like(input), _stats(input, normalized_shape), _stats(input, normalized_shape)


@torch.library.register_fake("fusedops::add_rms_norm_fwd")
def _(input, residual, normalized_shape, weight, eps):
    return _like(input), _like(input), _stats(input, normalized_shape)


@torch.library.register_fake("fusedops::layer_norm_bwd")
def _(grad_out, grad_residual_out, input, mean, rstd, normalized_shape, weight, bias):
    return _like(input), _param_grad(weight, input, normalized_shape), _param_grad(bias, input, normalized_shape)


@torch.library.register_fake("fusedops::rms_norm_bwd")
def _(grad_out, grad_residual_out, input, rstd, normalized_shape, weight):
    return _like(input), _param_grad(weight, input, normalized_shape)


# ---- autograd --------------------------------------------------------------------------------
# The backward ops return empty dweight / dbias for an absent weight / bias; a bias is passed to
# them only when its gradient is needed (its values are never read).


def _param_or_none(grad, param, needed):
    return grad if param is not None and needed else None


def _layer_norm_setup(ctx, inputs, output):
    input, normalized_shape, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.normalized_shape = normalized_shape
    ctx.save_for_backward(input, weight, bias, mean, rstd)


def _layer_norm_backward(ctx, grad_out, _grad_mean, _grad_rstd):
    input, weight, bias, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dx, dweight, dbias = ops.layer_norm_bwd(
        grad_out, None, input, mean, rstd, ctx.normalized_shape, weight, bias if needs[3] else None
    )
    return dx, None, _param_or_none(dweight, weight, needs[2]), _param_or_none(dbias, bias, needs[3]), None


torch.library.register_autograd("fusedops::layer_norm_fwd", _layer_norm_backward, setup_context=_layer_norm_setup)


def _rms_norm_setup(ctx, inputs, output):
    input, normalized_shape, weight, eps = inputs
    ctx.normalized_shape = normalized_shape
    ctx.save_for_backward(input, weight, output[1])


def _rms_norm_backward(ctx, grad_out, _grad_rstd):
    input, weight, rstd = ctx.saved_tensors
    dx, dweight = ops.rms_norm_bwd(grad_out, None, input, rstd, ctx.normalized_shape, weight)
    return dx, None, _param_or_none(dweight, weight, ctx.needs_input_grad[2]), None


torch.library.register_autograd("fusedops::rms_norm_fwd", _rms_norm_backward, setup_context=_rms_norm_setup)


def _add_layer_norm_setup(ctx, inputs, output):
    input, residual, normalized_shape, weight, bias, eps = inputs
    _, residual_out, mean, rstd = output
    ctx.normalized_shape = normalized_shape
    ctx.save_for_backward(residual_out, weight, bias, mean, rstd)


def _add_layer_norm_backward(ctx, grad_out, grad_residual_out, _grad_mean, _grad_rstd):
    residual_out, weight, bias, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dx, dweight, dbias = ops.layer_norm_bwd(
        grad_out, grad_residual_out, residual_out, mean, rstd, ctx.normalized_shape, weight, bias if needs[4] else None
    )
    return dx, dx, None, _param_or_none(dweight, weight, needs[3]), _param_or_none(dbias, bias, needs[4]), None


torch.library.register_autograd(
    "fusedops::add_layer_norm_fwd", _add_layer_norm_backward, setup_context=_add_layer_norm_setup
)


def _add_rms_norm_setup(ctx, inputs, output):
    input, residual, normalized_shape, weight, eps = inputs
    ctx.normalized_shape = normalized_shape
    ctx.save_for_backward(output[1], weight, output[2])


def _add_rms_norm_backward(ctx, grad_out, grad_residual_out, _grad_rstd):
    residual_out, weight, rstd = ctx.saved_tensors
    dx, dweight = ops.rms_norm_bwd(grad_out, grad_residual_out, residual_out, rstd, ctx.normalized_shape, weight)
    return dx, dx, None, _param_or_none(dweight, weight, ctx.needs_input_grad[3]), None


torch.library.register_autograd("fusedops::add_rms_norm_fwd", _add_rms_norm_backward, setup_context=_add_rms_norm_setup)


# ---- public wrappers -------------------------------------------------------------------------


def _normalized_shape(normalized_shape, input):
    """normalized_shape as a list of ints, checked against input's trailing dims."""
    if isinstance(normalized_shape, numbers.Integral):
        normalized_shape = (normalized_shape,)
    if not all(isinstance(d, numbers.Integral) for d in normalized_shape):
        raise TypeError(f"fusedops: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    shape = [int(d) for d in normalized_shape]
    if not shape or len(shape) > input.dim() or list(input.shape[input.dim() - len(shape) :]) != shape:
        raise ValueError(
            f"fusedops: normalized_shape {tuple(shape)} must equal the trailing dims of input, of shape "
            f"{tuple(input.shape)}"
        )
    return shape


def _check_affine(param, name, input, shape):
    """weight / bias: normalized_shape, on input's device, input's dtype or fp32 with fp16/bf16 input."""
    if param is None:
        return
    _checks.check_input(param, name)
    if param.device != input.device:
        raise ValueError(f"fusedops: {name} is on {param.device} but input is on {input.device}")
    mixed = param.dtype == torch.float32 and input.dtype in (torch.float16, torch.bfloat16)
    if param.dtype != input.dtype and not mixed:
        raise TypeError(
            f"fusedops: {name} has dtype {param.dtype} but must have input's dtype {input.dtype} "
            "(or float32 with float16/bfloat16 input)"
        )
    if list(param.shape) != shape:
        raise ValueError(f"fusedops: {name} must have shape normalized_shape = {tuple(shape)}, got {tuple(param.shape)}")


def _check_norm_args(input, normalized_shape, weight, bias, eps, residual=None):
    _checks.check_input(input, "input")
    if residual is not None:
        _checks.check_like(residual, input, "residual", "input")
    shape = _normalized_shape(normalized_shape, input)
    _check_affine(weight, "weight", input, shape)
    _check_affine(bias, "bias", input, shape)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(f"fusedops: bias has dtype {bias.dtype} but weight has dtype {weight.dtype}")
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"fusedops: eps must be a non-negative number, got {eps!r}")
    return shape


def _rms_eps(eps, input):
    return torch.finfo(input.dtype).eps if eps is None else eps


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """F.layer_norm in one pass over the input, fp32 statistics; weight / bias may be fp32 with
    fp16/bf16 input (the output keeps input's dtype)."""
    shape = _check_norm_args(input, normalized_shape, weight, bias, eps)
    return ops.layer_norm_fwd(input, shape, weight, bias, float(eps))[0]


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """F.rms_norm in one pass (eps=None means torch.finfo(input.dtype).eps)."""
    _checks.check_input(input, "input")
    eps = _rms_eps(eps, input)
    shape = _check_norm_args(input, normalized_shape, weight, None, eps)
    return ops.rms_norm_fwd(input, shape, weight, float(eps))[0]


def add_layer_norm(input, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    """(out, residual_out): residual_out = input + residual, out = layer_norm(residual_out), in
    one pass (the pre-norm transformer block). Gradients reach input and residual."""
    shape = _check_norm_args(input, normalized_shape, weight, bias, eps, residual)
    out, residual_out, _, _ = ops.add_layer_norm_fwd(input, residual, shape, weight, bias, float(eps))
    return out, residual_out


def add_rms_norm(input, residual, normalized_shape, weight=None, eps=None):
    """(out, residual_out): residual_out = input + residual, out = rms_norm(residual_out), in one
    pass. Gradients reach input and residual."""
    _checks.check_input(input, "input")
    eps = _rms_eps(eps, input)
    shape = _check_norm_args(input, normalized_shape, weight, None, eps, residual)
    out, residual_out, _ = ops.add_rms_norm_fwd(input, residual, shape, weight, float(eps))
    return out, residual_out
