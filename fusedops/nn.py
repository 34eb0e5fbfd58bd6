"""Drop-in modules: subclasses of torch.nn.LayerNorm / torch.nn.RMSNorm with the same
constructor, parameters and state_dict, whose forward runs the fused kernel. Where the fused op
does not take the operands (a dtype it has no kernel for, parameters of a dtype it cannot mix
with the input's), forward falls back to PyTorch's own implementation."""
import torch

from .ops import _checks
from .ops.norm import layer_norm, rms_norm


def _fusable(input, *params):
    if input.dtype not in _checks.FLOAT_DTYPES:
        return False
    for param in params:
        if param is None:
            continue
        if param.device != input.device:
            return False
        mixed = param.dtype == torch.float32 and input.dtype in (torch.float16, torch.bfloat16)
        if param.dtype != input.dtype and not mixed:
            return False
    return True


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
