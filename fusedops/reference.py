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


def philox_words(numel, seed, offset, first=0):
    """The uint32 words first ... first + numel - 1 of a dropout call's stream (first a multiple of 4)."""
    groups = np.arange(first // 4, (first + numel + 3) // 4, dtype=np.uint64)
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


def dropout_keep_mask(shape, rng_state, p, first=0):
    """The keep mask a dropout call with recorded rng_state = (seed, offset) applied to its
    elements first ... first + prod(shape) - 1 (first a multiple of 8): element i draws the 16-bit
    half-word i % 8 (low half first) of Philox block i // 8."""
    seed, offset = (int(v) for v in rng_state.cpu().tolist())
    numel = int(np.prod(shape)) if len(shape) else 1
    words = philox_words(4 * ((numel + 7) // 8), seed, offset, first // 2)
    draws = np.stack([words & np.uint64(0xFFFF), words >> np.uint64(16)], axis=1).reshape(-1)[:numel]
    keep = draws >= np.uint64(int(p * 65536.0))
    return torch.from_numpy(keep).reshape(shape)


def apply_dropout(t, rng_state, p):
    """t with the dropped elements zeroed and the kept ones scaled by 1 / (1 - p), as the
    dropout call that recorded rng_state did it."""
    keep = dropout_keep_mask(t.shape, rng_state, p).to(t.device)
    return torch.where(keep, t * (1.0 / (1.0 - p)), torch.zeros((), dtype=t.dtype, device=t.device))


def new_rng_state():
    """A fresh (seed, offset) from the CPU generator, for dropout on CPU tensors."""
    seed = torch.randint(0, 2**62, (), dtype=torch.int64).item()
    return torch.tensor([seed, 0], dtype=torch.int64)


def bias_dropout_add(x, bias, residual, p, training, rng_state):
    acc = acc_dtype(x.dtype)
    y = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    if training and p > 0:
        y = apply_dropout(y, rng_state, p)
    return (residual.to(acc) + y).to(x.dtype)


def dropout_backward(grad, rng_state, p):
    return apply_dropout(grad.to(acc_dtype(grad.dtype)), rng_state, p).to(grad.dtype)


def swiglu(gate, up):
    acc = acc_dtype(gate.dtype)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def swiglu_backward(grad, gate, up):
    acc = acc_dtype(gate.dtype)
    g, u, dy = gate.to(acc), up.to(acc), grad.to(acc)
    s = torch.sigmoid(g)
    return (dy * u * s * (1 + g * (1 - s))).to(gate.dtype), (dy * g * s).to(gate.dtype)


# ---- LayerNorm / RMSNorm ---------------------------------------------------------------------
# Statistics (mean, rstd) are float32 with the input's leading shape, as the CUDA kernels save them.


def _norm_dims(x, normalized_shape):
    return tuple(range(x.dim() - len(normalized_shape), x.dim()))


def _stats_shape(x, normalized_shape):
    return x.shape[: x.dim() - len(normalized_shape)]


def _expand_stats(stat, x, normalized_shape):
    return stat.to(acc_dtype(x.dtype)).reshape(tuple(_stats_shape(x, normalized_shape)) + (1,) * len(normalized_shape))


def _affine(y, weight, bias):
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def layer_norm(input, normalized_shape, weight, bias, eps):
    """(out, mean, rstd) of F.layer_norm."""
    x = input.to(acc_dtype(input.dtype))
    dims = _norm_dims(input, normalized_shape)
    mean = x.mean(dims, keepdim=True)
    rstd = torch.rsqrt((x - mean).square().mean(dims, keepdim=True) + eps)
    out = _affine((x - mean) * rstd, weight, bias).to(input.dtype)
    stats = _stats_shape(input, normalized_shape)
    return out, mean.reshape(stats).float(), rstd.reshape(stats).float()


def rms_norm(input, normalized_shape, weight, eps):
    """(out, rstd) of F.rms_norm; eps is a number (the public wrapper resolves None)."""
    x = input.to(acc_dtype(input.dtype))
    rstd = torch.rsqrt(x.square().mean(_norm_dims(input, normalized_shape), keepdim=True) + eps)
    out = _affine(x * rstd, weight, None).to(input.dtype)
    return out, rstd.reshape(_stats_shape(input, normalized_shape)).float()


def _residual_add(input, residual):
    acc = acc_dtype(input.dtype)
    return (input.to(acc) + residual.to(acc)).to(input.dtype)


def add_layer_norm(input, residual, normalized_shape, weight, bias, eps):
    """(out, residual_out, mean, rstd) with residual_out = input + residual, out = its layer_norm."""
    residual_out = _residual_add(input, residual)
    out, mean, rstd = layer_norm(residual_out, normalized_shape, weight, bias, eps)
    return out, residual_out, mean, rstd


def add_rms_norm(input, residual, normalized_shape, weight, eps):
    """(out, residual_out, rstd) with residual_out = input + residual, out = its rms_norm."""
    residual_out = _residual_add(input, residual)
    out, rstd = rms_norm(residual_out, normalized_shape, weight, eps)
    return out, residual_out, rstd


def _norm_backward(grad_out, grad_residual_out, input, mean, rstd, normalized_shape, weight, bias):
    acc = acc_dtype(input.dtype)
    dims = _norm_dims(input, normalized_shape)
    x, dy = input.to(acc), grad_out.to(acc)
    rstd = _expand_stats(rstd, input, normalized_shape)
    centered = x if mean is None else x - _expand_stats(mean, input, normalized_shape)
    xhat = centered * rstd
    g = dy if weight is None else dy * weight.to(acc)
    inner = g - xhat * (g * xhat).mean(dims, keepdim=True)
    if mean is not None:
        inner = inner - g.mean(dims, keepdim=True)
    dx = rstd * inner
    if grad_residual_out is not None:
        dx = dx + grad_residual_out.to(acc)
    rows = tuple(range(input.dim() - len(normalized_shape)))
    dweight = input.new_empty((0,)) if weight is None else (dy * xhat).sum(rows).to(weight.dtype)
    dbias = input.new_empty((0,)) if bias is None else dy.sum(rows).to(bias.dtype)
    return dx.to(input.dtype), dweight, dbias


def layer_norm_backward(grad_out, grad_residual_out, input, mean, rstd, normalized_shape, weight, bias):
    """(dx, dweight, dbias); dweight / dbias are empty when weight / bias is None (only bias's
    dtype is read). grad_residual_out, when given, is added to dx (the add_* variants)."""
    return _norm_backward(grad_out, grad_residual_out, input, mean, rstd, normalized_shape, weight, bias)


def rms_norm_backward(grad_out, grad_residual_out, input, rstd, normalized_shape, weight):
    """(dx, dweight); dweight is empty when weight is None."""
    dx, dweight, _ = _norm_backward(grad_out, grad_residual_out, input, None, rstd, normalized_shape, weight, None)
    return dx, dweight
# ---- attention ---------------------------------------------------------------------------------


def _attention_scores(q, k, causal, scale, acc):
    """Scaled scores [B, Hq, Lq, Lk] in acc, keys repeated over GQA groups, causal top-left."""
    group = q.shape[1] // k.shape[1]
    k = k.to(acc).repeat_interleave(group, dim=1)
    s = torch.matmul(q.to(acc), k.transpose(-1, -2)) * scale
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    return s


def attention_fwd(q, k, v, causal, scale):
    """(softmax(scale * q k^T) v, logsumexp of each scaled score row in float32)."""
    acc = acc_dtype(q.dtype)
    s = _attention_scores(q, k, causal, scale, acc)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    v = v.to(acc).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.matmul(p, v).to(q.dtype), lse.to(torch.float32)


def attention_bwd(grad_out, q, k, v, out, lse, causal, scale):
    """(dq, dk, dv) from P recomputed with the saved lse; GQA gradients summed over each group."""
    acc = acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    p = torch.exp(_attention_scores(q, k, causal, scale, acc) - lse.to(acc).unsqueeze(-1))
    do = grad_out.to(acc)
    v_rep = v.to(acc).repeat_interleave(group, dim=1)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v_rep.transpose(-1, -2))
    delta = (do * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, k.to(acc).repeat_interleave(group, dim=1)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale

    def per_kv_head(t):
        b, _, lk, d = t.shape
        return t.reshape(b, k.shape[1], group, lk, d).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)
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
        probs = apply_dropout(probs, rng_state, p)
    return probs.to(x.dtype).contiguous(), lse.contiguous()


def masked_softmax_backward(grad, x, mask, lse, rng_state, scale, causal, p):
    acc = acc_dtype(x.dtype)
    y = torch.exp(masked_logits(x, mask, scale, causal) - lse.to(acc).unsqueeze(-1))
    g = grad.to(acc)
    if p > 0:
        g = apply_dropout(g, rng_state, p)
    return (scale * y * (g - (g * y).sum(-1, keepdim=True))).to(x.dtype).contiguous()
