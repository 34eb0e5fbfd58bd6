"""Fused elementwise ops: registrations (CPU reference, fake, autograd) and public wrappers."""
import torch

from .. import reference
from . import _checks

ops = torch.ops.fusedops


def _rows(t, cols):
    return t.reshape(-1, cols)


def _column_sum(t, cols, dtype):
    """Sum over every dim but the last, accumulated in fp32, as a gradient of a column vector."""
    return _rows(t, cols).sum(0, dtype=reference.acc_dtype(dtype)).to(dtype)


# ---- scale_bias: x * scale + bias ------------------------------------------------------------

torch.library.register_kernel("fusedops::scale_bias", "cpu", reference.scale_bias)


@torch.library.register_fake("fusedops::scale_bias")
def _(x, scale, bias, scale_value, bias_value):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _scale_bias_setup(ctx, inputs, output):
    x, scale, bias, scale_value, bias_value = inputs
    ctx.scale_value = scale_value
    ctx.save_for_backward(x if scale is not None else None, scale)
    ctx.has_bias_tensor = bias is not None


def _scale_bias_backward(ctx, grad):
    x, scale = ctx.saved_tensors
    cols = grad.shape[-1] if grad.dim() else 1
    grad_x = grad_scale = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = ops.scale_bias(grad, scale, None, ctx.scale_value, 0.0)
    if scale is not None and ctx.needs_input_grad[1]:
        grad_scale = _column_sum(grad.to(reference.acc_dtype(grad.dtype)) * x, cols, scale.dtype)
    if ctx.has_bias_tensor and ctx.needs_input_grad[2]:
        grad_bias = _column_sum(grad, cols, grad.dtype)
    return grad_x, grad_scale, grad_bias, None, None


torch.library.register_autograd("fusedops::scale_bias", _scale_bias_backward, setup_context=_scale_bias_setup)


def _scalar_or_column(value, x, name):
    """(tensor or None, float) for an argument that is a Python number or a column vector."""
    if isinstance(value, torch.Tensor):
        _checks.check_column(value, x, name)
        return value, 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None, float(value)
    raise TypeError(f"fusedops: {name} must be a Python number or a 1-D tensor, got {type(value).__name__}")


def scale_bias(x, scale=1.0, bias=0.0):
    """x * scale + bias in one pass; scale and bias are Python numbers or 1-D tensors of size
    x.shape[-1] (broadcast along the last dim)."""
    _checks.check_input(x, "x")
    scale_tensor, scale_value = _scalar_or_column(scale, x, "scale")
    bias_tensor, bias_value = _scalar_or_column(bias, x, "bias")
    return ops.scale_bias(x, scale_tensor, bias_tensor, scale_value, bias_value)


# ---- bias_gelu: gelu(x + bias) ---------------------------------------------------------------

torch.library.register_kernel("fusedops::bias_gelu_fwd", "cpu", reference.bias_gelu)
torch.library.register_kernel("fusedops::bias_gelu_bwd", "cpu", reference.bias_gelu_backward)


@torch.library.register_fake("fusedops::bias_gelu_fwd")
def _(x, bias, tanh):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("fusedops::bias_gelu_bwd")
def _(grad, x, bias, tanh):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _bias_gelu_setup(ctx, inputs, output):
    x, bias, tanh = inputs
    ctx.tanh = tanh
    ctx.save_for_backward(x, bias)


def _bias_gelu_backward(ctx, grad):
    x, bias = ctx.saved_tensors
    grad_x = ops.bias_gelu_bwd(grad, x, bias, ctx.tanh)
    grad_bias = None
    if bias is not None and ctx.needs_input_grad[1]:
        grad_bias = _column_sum(grad_x, x.shape[-1], bias.dtype)
    return grad_x, grad_bias, None


torch.library.register_autograd("fusedops::bias_gelu_fwd", _bias_gelu_backward, setup_context=_bias_gelu_setup)


def bias_gelu(x, bias=None, approximate="none"):
    """gelu(x + bias) in one pass, as F.gelu(x + bias, approximate=approximate)."""
    _checks.check_input(x, "x")
    if bias is not None:
        _checks.check_column(bias, x, "bias")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"fusedops: approximate must be 'none' or 'tanh', got {approximate!r}")
    return ops.bias_gelu_fwd(x, bias, approximate == "tanh")


# ---- bias_dropout_add: residual + dropout(x + bias) ------------------------------------------


def _bias_dropout_add_cpu(x, bias, residual, p, training):
    rng_state = reference.new_rng_state()
    return reference.bias_dropout_add(x, bias, residual, p, training, rng_state), rng_state


torch.library.register_kernel("fusedops::bias_dropout_add_fwd", "cpu", _bias_dropout_add_cpu)
torch.library.register_kernel("fusedops::dropout_bwd", "cpu", reference.dropout_backward)


@torch.library.register_fake("fusedops::bias_dropout_add_fwd")
def _(x, bias, residual, p, training):
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out, x.new_empty((2,), dtype=torch.int64)


@torch.library.register_fake("fusedops::dropout_bwd")
def _(grad, rng_state, p):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _bias_dropout_add_setup(ctx, inputs, output):
    x, bias, residual, p, training = inputs
    ctx.p = p
    ctx.dropout = training and p > 0
    ctx.has_bias = bias is not None
    ctx.save_for_backward(output[1])


def _bias_dropout_add_backward(ctx, grad, _grad_rng_state):
    (rng_state,) = ctx.saved_tensors
    grad_x = ops.dropout_bwd(grad, rng_state, ctx.p) if ctx.dropout else grad
    grad_bias = None
    if ctx.has_bias and ctx.needs_input_grad[1]:
        grad_bias = _column_sum(grad_x, grad.shape[-1], grad.dtype)
    return grad_x, grad_bias, grad, None, None


torch.library.register_autograd(
    "fusedops::bias_dropout_add_fwd", _bias_dropout_add_backward, setup_context=_bias_dropout_add_setup
)


def bias_dropout_add(x, bias, residual, p=0.0, training=True):
    """residual + dropout(x + bias, p, training) in one pass. bias may be None.

    The dropout mask comes from a counter-based Philox stream seeded by PyTorch's generator of
    x's device: reproducible under torch.manual_seed and replayable in CUDA graphs."""
    _checks.check_input(x, "x")
    if bias is not None:
        _checks.check_column(bias, x, "bias")
    _checks.check_like(residual, x, "residual", "x")
    _checks.check_probability(p, "p")
    return ops.bias_dropout_add_fwd(x, bias, residual, float(p), bool(training))[0]


# ---- swiglu: silu(gate) * up -----------------------------------------------------------------

torch.library.register_kernel("fusedops::swiglu_fwd", "cpu", reference.swiglu)
torch.library.register_kernel("fusedops::swiglu_bwd", "cpu", reference.swiglu_backward)


@torch.library.register_fake("fusedops::swiglu_fwd")
def _(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.register_fake("fusedops::swiglu_bwd")
def _(grad, gate, up):
    return (
        torch.empty_like(gate, memory_format=torch.contiguous_format),
        torch.empty_like(up, memory_format=torch.contiguous_format),
    )


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    return ops.swiglu_bwd(grad, gate, up)


torch.library.register_autograd("fusedops::swiglu_fwd", _swiglu_backward, setup_context=_swiglu_setup)


def swiglu(gate, up):
    """silu(gate) * up in one pass (the SwiGLU MLP activation)."""
    _checks.check_input(gate, "gate")
    _checks.check_like(up, gate, "up", "gate")
    return ops.swiglu_fwd(gate, up)
