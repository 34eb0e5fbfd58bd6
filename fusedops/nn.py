"""Drop-in modules: subclasses of torch.nn.LayerNorm / torch.nn.RMSNorm with the same
constructor, parameters and state_dict, whose forward runs the fused kernel. Where the fused op
does not take the operands (a dtype it has no kernel for, parameters of a dtype it cannot mix
with the input's), forward falls back to PyTorch's own implementation."""
import torch

from .ops import _checks
from .ops.norm import affine_dtype_supported, layer_norm, rms_norm


def _fusable(input, *params):
    if input.dtype not in _checks.FLOAT_DTYPES:
        return False
    return all(
        param is None or (param.device == input.device and affine_dtype_supported(param.dtype, input.dtype))
        for param in params
    )


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm running fusedops.layer_norm."""

    def forward(self, input):
        if not _fusable(input, self.weight, self.bias):
            return super().forward(input)
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm running fusedops.rms_norm."""

    def forward(self, input):
        if not _fusable(input, self.weight):
            return super().forward(input)
        return rms_norm(input, self.normalized_shape, self.weight, self.eps)
