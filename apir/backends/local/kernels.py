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
    temperature, top_k, top_p, min_p, u = (float(p) for p in params.cpu())
    if temperature <= 0:
        return logits.argmax(dim=-1).int()
    rows = logits.reshape(-1, logits.shape[-1]).float()
    out = torch.empty(rows.shape[0], dtype=torch.int32, device=logits.device)
    for r in range(rows.shape[0]):
        vals, order = torch.sort(rows[r], descending=True, stable=True)
        keep = vals.numel() if top_k <= 0 else min(int(top_k), vals.numel())
        p = torch.softmax(vals[:keep] / torch.tensor(temperature, dtype=torch.float32), dim=-1)
        if top_p < 1.0:
            cum = torch.cumsum(p, 0)
            keep = min(keep, int(torch.searchsorted(cum, torch.tensor([top_p], device=p.device))) + 1)
        if min_p > 0.0:
            keep = min(keep, int((p >= min_p * p[0]).sum()))
        cdf = torch.cumsum(p[:keep], 0)
        target = torch.tensor([u], dtype=torch.float32, device=p.device) * cdf[-1]
        idx = min(int(torch.searchsorted(cdf, target, right=True)), keep - 1)
        out[r] = order[idx]
    return out.reshape(logits.shape[:-1])


def view(x: torch.Tensor, axis: int, start: int, length: int) -> torch.Tensor:
    start = start % x.shape[axis]
    return x.narrow(axis, start, length)


# op -> f(*inputs, *attrs)
KERNELS = {
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
    Op.PERMUTE: lambda x, axes: x.permute(axes),
    Op.TRANSPOSE: lambda x, a, b: x.transpose(a, b),
    Op.VIEW: view,
    Op.CONTIGUOUS: lambda x: x.contiguous(),
    Op.CONCAT: lambda a, b, axis: torch.cat([a, b], dim=axis),
    Op.ARGMAX: lambda x: x.argmax(dim=-1).int(),
    Op.SAMPLE: sample,
}
