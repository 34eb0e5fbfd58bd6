"""Argument checks run by the public wrappers before any kernel launches. Every message names
the offending argument."""
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_input(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fusedops: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"fusedops: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_like(t, ref, name, ref_name, same_shape=True):
    """t must be a tensor on ref's device with ref's dtype (and shape)."""
    check_input(t, name)
    if t.device != ref.device:
        raise ValueError(f"fusedops: {name} is on {t.device} but {ref_name} is on {ref.device}")
    if t.dtype != ref.dtype:
        raise TypeError(f"fusedops: {name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}")
    if same_shape and t.shape != ref.shape:
        raise ValueError(f"fusedops: {name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}")


def check_column(t, x, name):
    """A per-column vector broadcast along the last dim of x: 1-D of size x.shape[-1]."""
    check_like(t, x, name, "x", same_shape=False)
    if x.dim() == 0 or t.dim() != 1 or t.shape[0] != x.shape[-1]:
        expected = x.shape[-1] if x.dim() else "(x has no last dim)"
        raise ValueError(f"fusedops: {name} must be 1-D of size x.shape[-1] = {expected}, got shape {tuple(t.shape)}")


def check_probability(p, name):
    if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"fusedops: {name} must be a number in [0, 1), got {p!r}")
