"""fusedops: fused CUDA kernels for PyTorch, exposed as torch.ops.fusedops.* with autograd."""
from . import _ext
from ._ext import build_info

__all__ = ["build_info", "scale_bias", "bias_gelu", "bias_dropout_add", "swiglu"]

if _ext.available():
    from .ops.elementwise import bias_dropout_add, bias_gelu, scale_bias, swiglu
else:

    def _unavailable(*args, **kwargs):
        _ext.require()

    scale_bias = bias_gelu = bias_dropout_add = swiglu = _unavailable
