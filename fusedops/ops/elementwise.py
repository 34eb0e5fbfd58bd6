"""Fused elementwise ops: CPU (reference) and fake kernels, and the public wrappers. Autograd is
registered in C++ (csrc/elementwise/elementwise_autograd.cpp) to keep host overhead low."""
import torch

from .. import reference
from . import _checks

ops = torch.ops.fusedops


# ---- scale_bias: x * scale + bias ------------------------------------------------------------

torch.library.register_kernel("fusedops::scale_bias", "cpu", reference.scale_bias)


@torch.library.register_fake("fusedops::scale_bias")
def _(x, scale, bias, scale_value, bias_value):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


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
    return ops.scale_bias.default(x, scale_tensor, bias_tensor, scale_value, bias_value)


# ---- bias_gelu: gelu(x + bias) ---------------------------------------------------------------

torch.library.register_kernel("fusedops::bias_gelu_fwd", "cpu", reference.bias_gelu)
torch.library.register_kernel("fusedops::bias_gelu_bwd", "cpu", reference.bias_gelu_backward)


@torch.library.register_fake("fusedops::bias_gelu_fwd")
def _(x, bias, tanh):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("fusedops::bias_gelu_bwd")
def _(grad, x, bias, tanh):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def bias_gelu(x, bias=None, approximate="none"):
    """gelu(x + bias) in one pass, as F.gelu(x + bias, approximate=approximate)."""
    _checks.check_input(x, "x")
    if bias is not None:
        _checks.check_column(bias, x, "bias")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"fusedops: approximate must be 'none' or 'tanh', got {approximate!r}")
    return ops.bias_gelu_fwd.default(x, bias, approximate == "tanh")


# ---- bias_dropout_add: residual + dropout(x + bias) ------------------------------------------


def _bias_dropout_add_cpu(x, bias, residual, p, training):
    rng_state = reference.new_rng_state() if training and p > 0 else torch.zeros(2, dtype=torch.int64)
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


def bias_dropout_add(x, bias, residual, p=0.0, training=True):
    """residual + dropout(x + bias, p, training) in one pass. bias may be None.

    The dropout mask comes from a counter-based Philox stream seeded by PyTorch's generator of
    x's device: reproducible under torch.manual_seed and replayable in CUDA graphs."""
    _checks.check_input(x, "x")
    if bias is not None:
        _checks.check_column(bias, x, "bias")
    _checks.check_like(residual, x, "residual", "x")
    _checks.check_probability(p, "p")
    return ops.bias_dropout_add_fwd.default(x, bias, residual, float(p), bool(training))[0]


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


def swiglu(gate, up):
    """silu(gate) * up in one pass (the SwiGLU MLP activation)."""
    _checks.check_input(gate, "gate")
    _checks.check_like(up, gate, "up", "gate")
    return ops.swiglu_fwd.default(gate, up)
