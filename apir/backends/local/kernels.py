"""PyTorch implementations of the op table (the host executor's kernels).

Each kernel mirrors ``apir.backends.numpy_ref`` and is tested against it. Float values
are float32 unless a weight is kept in f16/bf16 on an accelerator, in which case MATMUL
casts its activation to the weight's dtype and returns float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...graph import Op
from ..base import BackendError


def check_index(ids: torch.Tensor, limit: int, what: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise BackendError(f"{what} index out of range: values must lie in [0, {limit})")


def get_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    check_index(ids, table.shape[0], "GET_ROWS row")
    return table[ids.long()].float()


def set_rows(dst: torch.Tensor, src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    check_index(ids, dst.shape[0], "SET_ROWS row")
    dst.index_copy_(0, ids.long(), src.to(dst.dtype))
    return dst


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x.to(w.dtype), w.T).float()


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)


def rope(x, pos, n_dims: int, base: float, neox: int, freq_scale: float) -> torch.Tensor:
    # x (T, H, D); only the first n_dims of D rotate. Angles in f64, as the reference does.
    half = n_dims // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / n_dims)
    theta = (pos.double()[:, None] * freq_scale * inv_freq[None, :]).float()
    cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]  # (T, 1, half)
    out = x.clone()
    if neox:
        a, b = x[..., :half], x[..., half:n_dims]
        out[..., :half], out[..., half:n_dims] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        out[..., 0:n_dims:2], out[..., 1:n_dims:2] = a * cos - b * sin, a * sin + b * cos
    return out


def attention(q, k, v, pos, scale: float, window: int, softcap: float) -> torch.Tensor:
    # q (T, Hq, D), k (S, Hkv, D), v (S, Hkv, Dv) -> (T, Hq, Dv)
    check_index(pos, k.shape[0], "ATTENTION position")
    n_kv = int(pos.max()) + 1
    j = torch.arange(n_kv, device=q.device)[None, :]
    p = pos.long()[:, None]
    mask = j <= p
    if window:
        mask &= p - j < window
    group = q.shape[1] // k.shape[1]
    qh = q.float().transpose(0, 1)  # (Hq, T, D)
    kh = k[:n_kv].float().transpose(0, 1).repeat_interleave(group, dim=0)  # (Hq, n_kv, D)
    vh = v[:n_kv].float().transpose(0, 1).repeat_interleave(group, dim=0)
    if softcap:
        scores = torch.matmul(qh, kh.transpose(1, 2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask[None], -math.inf)
        out = torch.matmul(torch.softmax(scores, dim=-1), vh)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[None], scale=scale)
    return out.transpose(0, 1)


def sample(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Op.SAMPLE without a host sync (capturable in a CUDA graph): every step of the
    reference is a tensor op, and the kept sets are always prefixes of the sorted order."""
    rows = logits.reshape(-1, logits.shape[-1]).float()
    temperature, top_k, top_p, min_p, u = params.float().unbind()
    vals, order = torch.sort(rows, dim=-1, descending=True, stable=True)
    rank = torch.arange(vals.shape[-1], device=rows.device)
    keep = (top_k <= 0) | (rank < top_k)
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))  # greedy: unused
    p = torch.softmax((vals / safe_t).masked_fill(~keep, -math.inf), dim=-1)
    # top-p: keep while the mass *before* a token is below top_p (the reference's
    # "shortest prefix reaching top_p"); an exclusive cumsum, not cum - p, for exactness
    before = torch.zeros_like(p)
    before[:, 1:] = torch.cumsum(p, dim=-1)[:, :-1]
    keep = keep & ((top_p >= 1.0) | (before < top_p)) & (p >= min_p * p[:, :1])
    kept = torch.where(keep, p, torch.zeros_like(p))
    cdf = torch.cumsum(kept, dim=-1)
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    pick = torch.minimum(pick, keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    token = torch.gather(order, -1, pick).squeeze(-1)
    greedy = rows.argmax(dim=-1)
    return torch.where(temperature <= 0, greedy, token).int().reshape(logits.shape[:-1])


def attention_full(q, k, v, pos, scale: float, window: int, softcap: float) -> torch.Tensor:
    """ATTENTION over the whole cache with a position mask: fixed shapes and no host sync,
    for accelerators (positions are bounds-checked on the host before the launch)."""
    j = torch.arange(k.shape[0], device=q.device)[None, :]
    p = pos.long()[:, None]
    mask = j <= p
    if window:
        mask &= p - j < window
    qh, kh, vh = q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1)
    if softcap:
        group = q.shape[1] // k.shape[1]
        kh, vh = kh.repeat_interleave(group, dim=0), vh.repeat_interleave(group, dim=0)
        scores = softcap * torch.tanh(torch.matmul(qh, kh.transpose(1, 2)) * scale / softcap)
        out = torch.matmul(torch.softmax(scores.masked_fill(~mask[None], -math.inf), dim=-1), vh)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[None], scale=scale,
                                             enable_gqa=True)
    return out.transpose(0, 1)


def view(x: torch.Tensor, axis: int, start: int, length: int) -> torch.Tensor:
    n = x.shape[axis]
    if not -n <= start < n:  # on the T axis only known now; must not wrap around
        raise BackendError(f"VIEW start {start} outside axis of size {n}")
    return x.narrow(axis, start % n, length)  # narrow refuses start + length > n


# op -> f(*inputs, *attrs)
KERNELS: dict = {
    Op.GET_ROWS: get_rows,
    Op.SET_ROWS: set_rows,
    Op.MATMUL: matmul,
    Op.ADD: lambda a, b: a.float() + b.float(),
    Op.MUL: lambda a, b: a.float() * b.float(),
    Op.SCALE: lambda x, s: x * s,
    Op.SILU: F.silu,
    Op.GELU: gelu,
    Op.SWIGLU: lambda g, u: F.silu(g) * u,
    Op.GEGLU: lambda g, u: gelu(g) * u,
    Op.RMS_NORM: rms_norm,
    Op.SOFTMAX: lambda x: torch.softmax(x, dim=-1),
    Op.ROPE: rope,
    Op.ATTENTION: attention,
    Op.RESHAPE: lambda x, shape: x.reshape(shape),
    Op.PERMUTE: lambda x, axes: x.permute(axes) if axes else x,  # torch refuses () on a 0-d tensor
    Op.TRANSPOSE: lambda x, a, b: x.transpose(a, b),
    Op.VIEW: view,
    Op.CONTIGUOUS: lambda x: x.contiguous(),
    Op.CONCAT: lambda a, b, axis: torch.cat([a, b], dim=axis),
    Op.ARGMAX: lambda x: x.argmax(dim=-1).int(),
    Op.SAMPLE: sample,
}

# Accelerators: no kernel may synchronise with the host. Index operands are checked on the
# host before launch (see Program.index_checks), so these skip the device-side checks.
DEVICE_KERNELS = {
    **KERNELS,
    Op.GET_ROWS: lambda table, ids: table[ids.long()].float(),
    Op.SET_ROWS: lambda dst, src, ids: dst.index_copy_(0, ids.long(), src.to(dst.dtype)),
    Op.ATTENTION: attention_full,
}
