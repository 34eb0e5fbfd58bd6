"""fusedops: fused CUDA kernels for PyTorch, exposed as torch.ops.fusedops.* with autograd."""
from . import _ext
from ._ext import build_info

_ELEMENTWISE = ["scale_bias", "bias_gelu", "bias_dropout_add", "swiglu"]
_SOFTMAX = ["softmax", "log_softmax", "masked_softmax"]
_NORM = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]
_ATTENTION = ["scaled_dot_product_attention"]

__all__ = ["build_info"] + _ELEMENTWISE + _SOFTMAX + _NORM + _ATTENTION

if _ext.available():
    from .ops.elementwise import bias_dropout_add, bias_gelu, scale_bias, swiglu
    from .ops.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
    from . import nn
    from .ops.attention import scaled_dot_product_attention
    from .ops.softmax import log_softmax, masked_softmax, softmax
else:

    def _unavailable(*args, **kwargs):
        _ext.require()

    for _name in __all__[1:]:
        globals()[_name] = _unavailable
