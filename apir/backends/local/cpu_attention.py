"""Attention on a CPU whose result for a query is the same bits however many queries,
sequences and keys the call carries: a greedy request then gives the same tokens batched
as alone, and after a reused prefix as when its whole prompt was computed in one chunk.

PyTorch's fused attention, and a matmul, softmax and matmul, are not: a row's result
changed with the rows beside it (MKL takes another kernel for 1 to 3 rows) and with the
count of masked keys after its own (where blocks and vector tails fall), and SmolLM2's top
two logits can lie a few ulps apart. Here every shape a value passes through is fixed or
a function of that value's own query. For n sequences at once (each its own slot's keys,
every sequence's queries padded to the longest, a multiple of 4 rows; keys in blocks of
BLOCK, zero-padded to the longest sequence's whole blocks):

    scores (n, Hkv, NB, R, BLOCK) = q (n, Hkv, 1, R, D) @ k (n, Hkv, NB, D, BLOCK)
                                    one product a block, of a fixed shape
    e = exp(scores - max over the row's keys)      masked keys -> exactly 0
    acc (n, Hkv, R, Dv + 1) = running sum over NB (cumsum: in order) of
                              e (.., R, BLOCK) @ [v | 1] (.., BLOCK, Dv + 1)
    out = acc[..., :Dv] / acc[..., Dv]             (the ones column sums e)

A block past a query's last visible key adds exact zeros, which leave a running sum as it
was, so neither the number of blocks nor the other sequences matter; BLOCK is a multiple
of every vector width and no value falls in a vectorised loop's scalar tail. The op count
is the same for one sequence or many: one call a step, where one call a sequence cost
SmolLM2's 4-stream decode step more than its products (2026-12-04).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .qmatmul import CPU_ROW_QUANTUM

BLOCK = 64  # keys a block
ROWS_A_PART = 1024  # query rows a part, bounding the (n, Hkv, NB, rows, BLOCK) scores
SHORT = 4  # tokens: runs up to this long (decode steps) share one call, longer ones go alone


def attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float) -> torch.Tensor:
    """qh (Hkv, R, D) over kh (Hkv, S, D), vh (Hkv, S', Dv) where ``mask`` (R, S) allows:
    (Hkv, R, Dv) f32. Every row of ``mask`` allows at least one key. v may stop short of k
    (S' <= S) where every query masks the keys after S': a cache past its filled part may
    hold anything, NaN included, and a masked key's 0 times a NaN value is NaN (its score
    is replaced by the mask, so k may be read past S')."""
    rows, s = qh.shape[1], kh.shape[1]
    n_blocks, pad = -(-s // BLOCK), -rows % CPU_ROW_QUANTUM
    kb = _blocks(kh[None].transpose(1, 2), (0,), (s,), n_blocks, 0)
    vb = _blocks(vh[None].transpose(1, 2), (0,), (vh.shape[1],), n_blocks, 1)
    q = F.pad(qh[None].float(), (0, 0, 0, pad))
    # keys past S are no keys; padding rows see every key (finite or not, they are dropped)
    visible = F.pad(F.pad(mask, (0, n_blocks * BLOCK - s)), (0, 0, 0, pad), value=True)
    hidden = ~visible.view(1, 1, rows + pad, n_blocks, BLOCK).transpose(2, 3)
    return _blocked(q, kb, vb, hidden, scale, softcap)[0, :, :rows]


def attend_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor | None,
                scale: float, window: int, softcap: float, memo: dict | None = None) -> torch.Tensor:
    """ATTENTION_SEQ (and, seq None, ATTENTION) on a CPU: q (T, Hq, D) the step's queries,
    k (S, N, Hkv, D) and v (S, N, Hkv, Dv) every slot's cache, pos and seq (T,) each
    query's position and slot (a sequence's queries one run; seq None: every query in slot
    0). A query sees its own
    slot's keys at positions up to its own (within ``window`` of it where that is set);
    only keys up to a run's highest position are read. -> (T, Hq, Dv) f32. ``memo`` keeps
    the plan (which tokens, slots, keys and masks) for the step's other layers of the same
    window and grouping, which read the very same pos and seq tensors."""
    group = q.shape[1] // k.shape[2]
    # layers of one step differ in their window (Gemma-3: five sliding, one global). The
    # entry holds pos and seq themselves: while it lives no other tensor can take their ids
    key = ("runs", id(pos), id(seq), group, window)
    entry = memo.get(key) if memo is not None else None
    if entry is not None and entry[0] is pos and entry[1] is seq:
        plans = entry[2]
    else:
        plans = _plans(pos, seq, group, window)
        if memo is not None:
            memo[key] = (pos, seq, plans)
    if len(plans) == 1 and plans[0].ids is None:  # one sequence, every token: no gather
        return _attend(plans[0], q, k, v, scale, softcap)[0, : q.shape[0]]
    out = q.new_empty((*q.shape[:2], v.shape[-1]), dtype=torch.float32)
    for plan in plans:
        res = _attend(plan, q, k, v, scale, softcap)
        for i, (s, e) in enumerate(plan.spans):
            out[s:e] = res[i, : e - s]
    return out


@dataclass(frozen=True)
class _Plan:
    """One padded call for some runs of a step's queries (every layer's the same)."""

    spans: tuple[tuple[int, int], ...]  # each run's [start, end) in the step
    ids: torch.Tensor | None  # (n, longest) token of each run's row, padded by its last; None: a lone run
    slots: tuple[int, ...]  # each run's slot
    filled: tuple[int, ...]  # each run's keys: up to its highest position
    hidden: torch.Tensor  # (n, 1, NB, R, BLOCK) bool: a row's masked keys
    pad: int  # query rows added for CPU_ROW_QUANTUM


def _plans(pos: torch.Tensor, seq: torch.Tensor | None, group: int, window: int) -> list[_Plan]:
    """The step's runs of one slot each, short ones (decode tokens) in one call, each
    longer one (a prompt chunk) alone: padding a decode token to a chunk's length would
    multiply its work by that length."""
    positions = pos.tolist()
    slots = seq.tolist() if seq is not None else [0] * len(positions)
    runs, start = [], 0
    for slot, run in itertools.groupby(slots):
        end = start + len(list(run))
        runs.append((start, end, slot, max(positions[start:end]) + 1))
        start = end
    short = [r for r in runs if r[1] - r[0] <= SHORT]
    groups = ([short] if short else []) + [[r] for r in runs if r[1] - r[0] > SHORT]
    return [_plan(pos, g, group, window, lone=len(runs) == 1) for g in groups]


def _plan(pos, runs, group: int, window: int, lone: bool) -> _Plan:
    longest = max(e - s for s, e, _, _ in runs)
    n_blocks = -(-max(f for _, _, _, f in runs) // BLOCK)
    if lone:
        ids, p = None, pos.long()[None]
    else:
        # token of row t of run i: its t-th, or its last (finite, with keys it may see)
        ids = torch.tensor([[s + min(t, e - s - 1) for t in range(longest)] for s, e, _, _ in runs])
        p = pos.long()[ids]
    pad = -(longest * group) % CPU_ROW_QUANTUM
    # rows t * G + g (token t, query head g of a kv head's group); padding rows see key 0
    p_rows = F.pad(p.repeat_interleave(group, dim=1), (0, pad))[:, None, None, :, None]  # (n, 1, 1, R, 1)
    key = torch.arange(n_blocks * BLOCK).view(n_blocks, 1, BLOCK)
    hidden = key > p_rows
    if window:
        hidden |= p_rows - key >= window
    return _Plan(tuple((s, e) for s, e, _, _ in runs), ids, tuple(slot for _, _, slot, _ in runs),
                 tuple(f for _, _, _, f in runs), hidden, pad)


def _attend(plan: _Plan, q, k, v, scale: float, softcap: float) -> torch.Tensor:
    """(n, longest, Hq, Dv): each run's rows, padding included."""
    n_heads, dim = q.shape[1:]
    n_kv_heads, dv = k.shape[2], v.shape[-1]
    group = n_heads // n_kv_heads
    qg = q[None] if plan.ids is None else q[plan.ids]  # (n, longest, Hq, D)
    n, longest = qg.shape[:2]
    qh = qg.float().view(n, longest, n_kv_heads, group, dim).transpose(1, 2).reshape(
        n, n_kv_heads, longest * group, dim)
    if plan.pad:
        qh = F.pad(qh, (0, 0, 0, plan.pad))
    n_blocks = plan.hidden.shape[2]
    kb = _blocks(k, plan.slots, plan.filled, n_blocks, 0)
    vb = _blocks(v, plan.slots, plan.filled, n_blocks, 1)
    res = _blocked(qh, kb, vb, plan.hidden, scale, softcap)[:, :, : longest * group]
    return res.view(n, n_kv_heads, longest, group, dv).transpose(1, 2).reshape(n, longest, n_heads, dv)


def _blocks(x: torch.Tensor, slots: Sequence[int], filled: Sequence[int], n_blocks: int,
            extra: int) -> torch.Tensor:
    """Rows :filled[i] of slot slots[i] of a cache x (S, N, H, D), any strides, as f32 (n,
    H, NB, BLOCK, D + extra), contiguous, zeros after (a cache past its filled part may hold
    anything, NaN included, and a masked key's 0 weight times NaN is NaN) and ones in the
    extra columns. One copy a slot straight from the cache (a gather of the slots first
    took 14 times as long on this CPU, 2026-12-04), into a layout whose blocks a batched
    product reads as they are (a transposed view made it copy every key a second time)."""
    h, d = x.shape[2:]
    out = x.new_empty((len(slots), h, n_blocks * BLOCK, d + extra), dtype=torch.float32)
    for i, (slot, rows) in enumerate(zip(slots, filled)):
        out[i, :, :rows, :d] = x[slot, :rows].transpose(0, 1)
        if rows < n_blocks * BLOCK:
            out[i, :, rows:, :d] = 0.0
    if extra:
        out[..., d:] = 1.0
    return out.view(len(slots), h, n_blocks, BLOCK, d + extra)


def _blocked(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, hidden: torch.Tensor, scale: float,
             softcap: float) -> torch.Tensor:
    """q (n, Hkv, R, D), R a multiple of CPU_ROW_QUANTUM, over kb (n, Hkv, NB, BLOCK, D) and
    vb (n, Hkv, NB, BLOCK, Dv + 1) but the keys ``hidden`` (n, 1, NB, R, BLOCK) hides:
    (n, Hkv, R, Dv), in parts of ROWS_A_PART rows."""
    parts = []
    for r0 in range(0, q.shape[2], ROWS_A_PART):
        qp = q[:, :, r0 : r0 + ROWS_A_PART]
        scores = torch.matmul(qp[:, :, None], kb.transpose(-1, -2)) * scale  # (n, Hkv, NB, R, BLOCK)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill_(hidden[:, :, :, r0 : r0 + ROWS_A_PART], -math.inf)
        e = torch.exp(scores - scores.amax(dim=(2, 4), keepdim=True))  # the max: exact in any order
        acc = torch.matmul(e, vb).cumsum(2)[:, :, -1]  # (n, Hkv, R, Dv + 1): sum e v, then sum e
        parts.append(acc[..., :-1] / acc[..., -1:])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
