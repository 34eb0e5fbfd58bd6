"""Plain-PyTorch reference of every op: the CPU kernels and the tests' oracle.

Each function computes in float32 (float64 for float64 inputs) and returns the input dtype, as
the CUDA kernels do; called on float64 tensors it is the float64 oracle.
"""
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
    y = (x.to(acc) if bias is None else x.to(acc) + bias.to(acc)).detach().requires_grad_(True)
    with torch.enable_grad():
        out = F.gelu(y, approximate="tanh" if tanh else "none")
    (dy,) = torch.autograd.grad(out, y, grad.to(acc))
    return dy.to(x.dtype)


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
    """The keep mask a dropout call with recorded rng_state = (seed, offset) applied."""
    seed, offset = (int(v) for v in rng_state.cpu().tolist())
    numel = int(np.prod(shape)) if len(shape) else 1
    threshold = np.uint64(int(p * 4294967296.0))
    keep = philox_words(numel, seed, offset) >= threshold
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


# ---- softmax family ----------------------------------------------------------------------------
# A row with no finite logit (fully masked) gives probabilities 0 (log-probabilities -inf) and a
# zero gradient, where torch.softmax gives NaN. Outputs are contiguous, as the CUDA kernels'.


def _no_finite_logit(z):
    return (z == float("-inf")).all(-1, keepdim=True)


def softmax(x, scale, log):
    acc = acc_dtype(x.dtype)
    z = x.to(acc) * scale
    if z.dim() == 0:
        z = z.reshape(1)
        return softmax(z, 1.0, log).reshape(())
    y = torch.log_softmax(z, -1) if log else torch.softmax(z, -1)
    fill = torch.full((), float("-inf") if log else 0.0, dtype=acc, device=x.device)
    return torch.where(_no_finite_logit(z), fill, y).to(x.dtype).contiguous()


def softmax_backward(grad, y, scale, log):
    acc = acc_dtype(y.dtype)
    g, yy = grad.to(acc), y.to(acc)
    if log:
        dx = g - torch.exp(yy) * g.sum(-1, keepdim=True)
    else:
        dx = yy * (g - (g * yy).sum(-1, keepdim=True))
    return (scale * dx).to(y.dtype).contiguous()


def masked_logits(x, mask, scale, causal):
    """scale * x with -inf where a bool mask is False or (causal) key j > query i, plus an additive mask."""
    acc = acc_dtype(x.dtype)
    z = x.to(acc) * scale
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else z + mask.to(acc)
    if causal:
        lq, lk = x.shape[-2], x.shape[-1]
        visible = torch.ones(lq, lk, dtype=torch.bool, device=x.device).tril()
        z = z.masked_fill(~visible, float("-inf"))
    return z


def masked_softmax(x, mask, scale, causal, p, rng_state):
    """(dropout(softmax(masked logits)), row log-sum-exp); p = 0 means no dropout. The
    log-sum-exp is +inf for a fully masked row."""
    acc = acc_dtype(x.dtype)
    z = masked_logits(x, mask, scale, causal)
    empty = _no_finite_logit(z)
    zero = torch.zeros((), dtype=acc, device=x.device)
    probs = torch.where(empty, zero, torch.softmax(z, -1))
    lse = torch.where(empty.squeeze(-1), torch.full((), float("inf"), dtype=acc, device=x.device), torch.logsumexp(z, -1))
    if p > 0:
        keep = dropout_keep_mask(x.shape, rng_state, p).to(x.device)
        probs = torch.where(keep, probs * (1.0 / (1.0 - p)), zero)
    return probs.to(x.dtype).contiguous(), lse.contiguous()


def masked_softmax_backward(grad, x, mask, lse, rng_state, scale, causal, p):
    acc = acc_dtype(x.dtype)
    y = torch.exp(masked_logits(x, mask, scale, causal) - lse.to(acc).unsqueeze(-1))
    g = grad.to(acc)
    if p > 0:
        keep = dropout_keep_mask(x.shape, rng_state, p).to(x.device)
        g = torch.where(keep, g * (1.0 / (1.0 - p)), torch.zeros((), dtype=acc, device=x.device))
    return (scale * y * (g - (g * y).sum(-1, keepdim=True))).to(x.dtype).contiguous()
