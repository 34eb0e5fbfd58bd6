"""Plain-PyTorch reference of every op: the CPU kernels and the tests' oracle.

Each function computes in float32 (float64 for float64 inputs) and returns the input dtype, as
the CUDA kernels do; called on float64 tensors it is the float64 oracle.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _acc(t, dtype):
    return None if t is None else t.to(dtype)


def scale_bias(x, scale, bias, scale_value, bias_value):
    acc = acc_dtype(x.dtype)
    s = scale_value if scale is None else _acc(scale, acc)
    b = bias_value if bias is None else _acc(bias, acc)
    return (x.to(acc) * s + b).to(x.dtype)


def bias_gelu(x, bias, tanh):
    acc = acc_dtype(x.dtype)
    y = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    return F.gelu(y, approximate="tanh" if tanh else "none").to(x.dtype)


def bias_gelu_backward(grad, x, bias, tanh):
    acc = acc_dtype(x.dtype)
    y = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    if tanh:
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (y + 0.044715 * y**3))
        derivative = 0.5 * (1 + t) + 0.5 * y * (1 - t * t) * k * (1 + 3 * 0.044715 * y * y)
    else:
        derivative = 0.5 * (1 + torch.erf(y / math.sqrt(2))) + y * torch.exp(-0.5 * y * y) / math.sqrt(2 * math.pi)
    return (grad.to(acc) * derivative).to(x.dtype)


# Philox4x32-10, bit-exact with csrc/common/philox.cuh.
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LOW32 = np.uint64(0xFFFFFFFF)


def philox_words(numel, seed, offset):
    """The uint32 word that element i of a dropout call draws, for i < numel."""
    groups = np.arange((numel + 3) // 4, dtype=np.uint64)
    seed, offset = np.uint64(seed % 2**64), np.uint64(offset % 2**64)
    c0, c1 = groups & _LOW32, groups >> np.uint64(32)
    c2 = np.full_like(groups, offset & _LOW32)
    c3 = np.full_like(groups, offset >> np.uint64(32))
    k0, k1 = seed & _LOW32, seed >> np.uint64(32)
    for _ in range(10):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _LOW32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _LOW32
        k0, k1 = (k0 + _W0) & _LOW32, (k1 + _W1) & _LOW32
    return np.stack([c0, c1, c2, c3], axis=1).reshape(-1)[:numel]


def dropout_keep_mask(shape, rng_state, p):
    """The keep mask a dropout call with recorded rng_state = (seed, offset) applied: element i
    draws the 16-bit half-word i % 8 (low half first) of Philox block i // 8."""
    seed, offset = (int(v) for v in rng_state.cpu().tolist())
    numel = int(np.prod(shape)) if len(shape) else 1
    words = philox_words(4 * ((numel + 7) // 8), seed, offset)
    draws = np.stack([words & np.uint64(0xFFFF), words >> np.uint64(16)], axis=1).reshape(-1)[:numel]
    keep = draws >= np.uint64(int(p * 65536.0))
    return torch.from_numpy(keep).reshape(shape)


def new_rng_state():
    """A fresh (seed, offset) from the CPU generator, for dropout on CPU tensors."""
    seed = torch.randint(0, 2**62, (), dtype=torch.int64).item()
    return torch.tensor([seed, 0], dtype=torch.int64)


def bias_dropout_add(x, bias, residual, p, training, rng_state):
    acc = acc_dtype(x.dtype)
    y = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    if training and p > 0:
        keep = dropout_keep_mask(x.shape, rng_state, p).to(x.device)
        y = torch.where(keep, y * (1.0 / (1.0 - p)), torch.zeros((), dtype=acc, device=x.device))
    return (residual.to(acc) + y).to(x.dtype)


def dropout_backward(grad, rng_state, p):
    acc = acc_dtype(grad.dtype)
    keep = dropout_keep_mask(grad.shape, rng_state, p).to(grad.device)
    return torch.where(keep, grad.to(acc) * (1.0 / (1.0 - p)), torch.zeros((), dtype=acc, device=grad.device)).to(
        grad.dtype
    )


def swiglu(gate, up):
    acc = acc_dtype(gate.dtype)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def swiglu_backward(grad, gate, up):
    acc = acc_dtype(gate.dtype)
    g, u, dy = gate.to(acc), up.to(acc), grad.to(acc)
    s = torch.sigmoid(g)
    return (dy * u * s * (1 + g * (1 - s))).to(gate.dtype), (dy * g * s).to(gate.dtype)
