"""Attention on a CPU whose result for a query is the same bits however many queries and
keys the call carries: a greedy request then gives the same tokens batched as alone, and
after a reused prefix as when its whole prompt was computed in one chunk.

PyTorch's fused attention, and a matmul, softmax and matmul, are not: a row's result
changed with the rows beside it (MKL takes another kernel for 1 to 3 rows) and with the
count of masked keys after its own (where blocks and vector tails fall), and SmolLM2's top
two logits can lie a few ulps apart. Here every shape a value passes through is fixed or
a function of that value's own query:

    keys in blocks of BLOCK (the cache zero-padded to whole blocks), queries padded to a
    multiple of 4 rows:
    scores (Hkv, NB, R, BLOCK) = q (Hkv, 1, R, D) @ k (Hkv, NB, D, BLOCK)   one product a block
    e = exp(scores - max over every key)          masked keys -> exactly 0
    acc (Hkv, R, Dv + 1) = running sum over NB (cumsum: in order) of
                           e (.., R, BLOCK) @ [v | 1] (.., BLOCK, Dv + 1)
    out = acc[..., :Dv] / acc[..., Dv]            (the ones column sums e)

A block past a query's last visible key adds exact zeros, which leave a running sum as it
was, so the number of blocks does not matter; BLOCK is a multiple of every vector width
and no value falls in a vectorised loop's scalar tail.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .qmatmul import CPU_ROW_QUANTUM

BLOCK = 64  # keys a block
ROWS_A_PART = 1024  # queries a part, bounding the (Hkv, NB, rows, BLOCK) scores


def attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float) -> torch.Tensor:
    """qh (Hkv, R, D) over kh (Hkv, S, D), vh (Hkv, S', Dv) where ``mask`` (R, S) allows:
    (Hkv, R, Dv) f32. Every row of ``mask`` allows at least one key. v may stop short of k
    (S' <= S) where every query masks the keys after S': a cache past its filled part may
    hold anything, NaN included, and a masked key's 0 times a NaN value is NaN (its score
    is replaced by the mask, so k may be read past S')."""
    rows, s, dv = qh.shape[1], kh.shape[1], vh.shape[2]
    pad_s = -s % BLOCK  # none where the caller read whole blocks of the cache (``keys``)
    kb = _f32(kh, pad_s, 0).unflatten(1, (-1, BLOCK))  # (Hkv, NB, BLOCK, D)
    # v with a column of ones after its Dv: the same products give each block's sum of e
    vb = _f32(vh, s + pad_s - vh.shape[1], 1).unflatten(1, (-1, BLOCK))  # (Hkv, NB, BLOCK, Dv + 1)
    vb[..., dv] = 1.0
    mask = F.pad(mask, (0, pad_s))
    parts = [_part(qh[:, r0 : r0 + ROWS_A_PART].float(), kb, vb, mask[r0 : r0 + ROWS_A_PART], scale, softcap)
             for r0 in range(0, rows, ROWS_A_PART)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def keys(n_kv: int, capacity: int) -> int:
    """How many of a cache's ``capacity`` keys to read for ``n_kv`` visible ones: whole
    blocks where the cache has them (the rest are masked), so ``attend`` pads none."""
    return min(capacity, -(-n_kv // BLOCK) * BLOCK)


def _f32(x: torch.Tensor, pad: int, extra: int) -> torch.Tensor:
    """x (H, S, D) as f32 (H, S + pad, D + extra), zeros after: one copy."""
    if not (pad or extra):
        return x.float()
    out = x.new_zeros((x.shape[0], x.shape[1] + pad, x.shape[2] + extra), dtype=torch.float32)
    out[:, : x.shape[1], : x.shape[2]] = x
    return out


def _part(q, kb, vb, mask, scale: float, softcap: float) -> torch.Tensor:
    rows = q.shape[1]
    pad = -rows % CPU_ROW_QUANTUM  # queries, padded as a product's rows are
    if pad:  # padding rows see every key: finite, and dropped
        q = F.pad(q, (0, 0, 0, pad))
        mask = torch.cat([mask, mask.new_ones((pad, mask.shape[1]))])
    blocks = mask.unflatten(1, (-1, BLOCK)).transpose(0, 1)  # (NB, R, BLOCK)
    scores = torch.matmul(q[:, None], kb.transpose(-1, -2)) * scale  # (Hkv, NB, R, BLOCK)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill_(~blocks, -math.inf)
    e = torch.exp(scores - scores.amax(dim=(1, 3), keepdim=True))  # the max: exact in any order
    acc = torch.matmul(e, vb).cumsum(1)[:, -1, :rows]  # (Hkv, R, Dv + 1): sum e v, then sum e
    return acc[..., :-1] / acc[..., -1:]
