"""PyTorch implementations of the op table (the host executor's kernels).

Each kernel mirrors ``apir.backends.numpy_ref`` and is tested against it. Float values
are float32. A weight is the buffer's own bytes: a quantized one as ``Blocks`` (MATMUL and
GET_ROWS, the ops that take one, compute from the blocks), a 16-bit one as an f16/bf16
view, which MATMUL multiplies in that dtype on an accelerator (the activation rounded to
it) and widens per use on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from ...graph import Op, SampleArgs
from ...graph.ops import Fn, Pool, Reduce
from ...graph.sampling import PARAMS_SIZE
from ..base import BackendError
from ..executor import check_positions
from . import cpu_attention, decode_attention, gemv, inductor, int4cpu, int8cpu, qmatmul


@dataclass(frozen=True)
class Blocks:
    """A quantized WEIGHT (N, K): ``data`` is the 1-D uint8 run of its bytes in the buffer,
    the only copy, as GGUF blocks or, where ``qmatmul.packs`` the device, packed (qpack)."""

    data: torch.Tensor
    qtype: int  # the DType's ggml id (a plain int: fixed in a compiled step)
    shape: tuple[int, int]


# a compiled step takes a weight's bytes as an input, its type and shape as fixed
pytree.register_pytree_node(Blocks, lambda b: ([b.data], (b.qtype, b.shape)),
                            lambda children, context: Blocks(children[0], *context))


# Values left for their one reader to make (program.deferred): a decode step's product
# makes its activation as its kernel rounds x, and adds the residual as it writes y, where
# each would be a launch of its own. Anywhere else ``made`` computes them with the kernels
# they stand for, in the same order: the same bits as without them.


@dataclass(frozen=True)
class Glu:
    """SWIGLU's value, silu(gate) * up, for the product that reads it."""

    gate: torch.Tensor
    up: torch.Tensor


@dataclass(frozen=True)
class Normed:
    """RMS_NORM's value, times ``weight`` (its one reader, a MUL: ``scaled``), for the
    product that reads that."""

    x: torch.Tensor
    eps: float
    weight: torch.Tensor | None = None


@dataclass(frozen=True)
class Product:
    """MATMUL's value, x @ w.T, for the ADD that reads it (``add_product``)."""

    x: object  # a tensor, or a value left to make (Glu, Normed)
    w: object


@dataclass(frozen=True)
class Roped:
    """ROPE's value, x (T, H, D) rotated by the angles ``cos``, ``sin`` (T, 1, n_dims/2) of
    its positions, for the ATTENTION that reads it as its queries (``roped``)."""

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    n_dims: int
    neox: int


def made(x: object) -> torch.Tensor:
    """A value left for its reader, made: the kernels it stands for (a tensor as it is)."""
    if isinstance(x, Roped):
        return rope_apply(x.x.float(), x.cos, x.sin, x.n_dims, x.neox)
    if isinstance(x, Glu):
        return KERNELS[Op.SWIGLU](x.gate, x.up)
    if isinstance(x, Normed):
        v = rms_norm(x.x, x.eps)
        return v if x.weight is None else KERNELS[Op.MUL](v, x.weight)
    if isinstance(x, Product):
        return matmul(x.x, x.w)
    return x


def scaled(a: object, b: object) -> Normed:
    """MUL of an RMS_NORM's value (deferred) by the norm's weight."""
    norm, weight = (a, b) if isinstance(a, Normed) else (b, a)
    return Normed(norm.x, norm.eps, weight)


def add_product(a: object, b: object) -> torch.Tensor:
    """ADD of a MATMUL's value (deferred) and another: the product with it added."""
    product, other = (a, b) if isinstance(a, Product) else (b, a)
    return matmul(product.x, product.w, residual=made(other))


def qproduct(x: object, parts: tuple[Blocks, ...], residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ concat(parts).T in f32: (..., sum N_i), each part read from its blocks;
    plus ``residual`` (broadcast to the result) where given. A decode step's x left to make
    (Glu, Normed) is made by the product's own kernel, as is the addition."""
    k = parts[0].shape[1]
    stacked = [(p.data, p.qtype, p.shape[0]) for p in parts]
    base = x.gate if isinstance(x, Glu) else x.x if isinstance(x, Normed) else x
    fusing = isinstance(x, (Glu, Normed)) or residual is not None
    if fusing and qmatmul.fuses(base, k) and (residual is None or _broadcasts(residual, base.numel() // k, sum(n for *_, n in stacked))):
        act, u, eps = ((qmatmul.GLU, x.up, 0.0) if isinstance(x, Glu)
                       else (qmatmul.NORM, x.weight, x.eps) if isinstance(x, Normed)
                       else (qmatmul.PLAIN, None, 0.0))
        y = qmatmul.decode_product(base, stacked, k, act, u, eps, residual)
        return y.reshape(*base.shape[:-1], y.shape[-1])
    x = made(x)
    x2 = x.reshape(-1, k)
    # qmatmul_stacked without its argument checks (buffer offsets are 32-byte aligned, so
    # they hold by construction; they read data pointers, which a traced step has not)
    y = qmatmul.stacked_product(x2, stacked, k)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if residual is None else KERNELS[Op.ADD](y, residual)


def _broadcasts(r: torch.Tensor, m: int, n: int) -> bool:
    # r is a bias (.., N) of one row or (.., N) of the result's m rows: what the fused
    # kernel adds by rows (anything else broadcast, e.g. a column, is added after)
    return r.shape[-1] == n and r.numel() in (n, m * n)


def matmul(x: object, w: torch.Tensor | Blocks, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T in f32 (plus ``residual``, see ``add_product``). A 16-bit weight on an
    accelerator: x rounded to its dtype first (as llama.cpp's CUDA path does), one row
    through the streaming kernel of ``gemv``; on a CPU widened to f32 for this product
    only, a cache-sized tile at a time."""
    if isinstance(w, Blocks):
        return qproduct(x, (w,), residual)
    y = _dense_matmul(made(x), w)
    return y if residual is None else KERNELS[Op.ADD](y, residual)


def _dense_matmul(x: torch.Tensor, w) -> torch.Tensor:
    if isinstance(w, int4cpu.Int4):
        return int4cpu.product(x, w)
    if isinstance(w, int8cpu.Int8):
        return int8cpu.product(x, w)
    if gemv.usable(x, w):
        return gemv.gemv(x, w)
    if w.device.type == "cpu" and w.dim() == 2:
        return qmatmul.cpu_tiles(x, *w.shape, lambda r0, r1: w[r0:r1].float())
    if w.device.type == "cpu":
        w = w.float()
    return torch.matmul(x.to(w.dtype), w.T).float()


def fused_matmul(x: torch.Tensor, w: torch.Tensor | tuple, widths: tuple[int, ...]) -> list[torch.Tensor]:
    """Products with several weights: ``w`` one tensor holding them stacked (rows split by
    ``widths``), or a tuple of them, each where it is (all ``Blocks``: one stacked call)."""
    if isinstance(w, tuple):
        if not all(isinstance(p, Blocks) for p in w):
            x = made(x)
            return [matmul(x, p) for p in w]
        y = qproduct(x, w)
    else:
        y = matmul(x, w)
    return list(y.split(widths, dim=-1))  # f32 already


def get_rows(table: torch.Tensor | Blocks | int4cpu.Int4 | int8cpu.Int8, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] in f32; from ``Blocks`` only the gathered rows' blocks are decoded."""
    if isinstance(table, int8cpu.Int8):
        return int8cpu.rows(table, ids)
    if isinstance(table, int4cpu.Int4):
        table = table.blocks
    if isinstance(table, Blocks):
        return qmatmul.get_rows(table.data, table.qtype, *table.shape, ids)
    return table[ids.long()].float()


# Attention of up to this many query rows, in a step traced for Inductor, is written as products
# and sums, which Inductor fuses into a few kernels; cuBLAS picked a 22 µs kernel (H200)
# for the value product of a few rows against the strided cache.
SMALL_ROWS = 8


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)


def rope_angles(pos: torch.Tensor, n_dims: int, base: float, freq_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, 1, n_dims/2) of theta = pos * freq_scale * base^(-2i/n_dims); the
    angles in f64, as the reference computes them, then f32."""
    half = n_dims // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64, device=pos.device) * 2 / n_dims)
    theta = (pos.double()[:, None] * freq_scale * inv_freq[None, :]).float()
    return theta.cos()[:, None, :], theta.sin()[:, None, :]


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_dims: int, neox: int) -> torch.Tensor:
    # x (T, H, D); only the first n_dims of D rotate
    half = n_dims // 2
    if neox:
        a, b = x[..., :half], x[..., half:n_dims]
        rotated = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    else:  # pairs (2i, 2i+1): rotate, then interleave them back
        a, b = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return rotated if n_dims == x.shape[-1] else torch.cat([rotated, x[..., n_dims:]], dim=-1)


def rope(x, pos, n_dims: int, base: float, neox: int, freq_scale: float, *, memo=None, key=None) -> torch.Tensor:
    """ROPE. ``memo`` (a dict living for one graph run) shares the angles between every
    ROPE of the run that reads the same position node ``key``: one computation per step."""
    return made(roped(x, pos, n_dims, base, neox, freq_scale, memo=memo, key=key))


def roped(x, pos, n_dims: int, base: float, neox: int, freq_scale: float, *, memo=None, key=None) -> Roped:
    """ROPE of the queries of an ATTENTION (program.deferred): its angles, the rotation
    left for the attention, which on a decode step rotates q as its kernel loads it."""
    if memo is None:
        return Roped(x, *rope_angles(pos, n_dims, base, freq_scale), n_dims, neox)
    k = ("rope", key, n_dims, base, freq_scale)
    if k not in memo:
        memo[k] = rope_angles(pos, n_dims, base, freq_scale)
    return Roped(x, *memo[k], n_dims, neox)


def attention_mask(pos: torch.Tensor, n_kv: int, window: int, group: int) -> torch.Tensor:
    """(T*group, n_kv) bool: row t*group+g (query t, head g of its group) sees key j iff
    j <= pos[t] and, with a window, pos[t] - j < window."""
    p = pos.long().repeat_interleave(group)[:, None]
    j = torch.arange(n_kv, device=pos.device)[None, :]
    mask = j <= p
    if window:
        mask &= p - j < window
    return mask


def attention(q, k, v, pos, scale: float, window: int, softcap: float, *, memo=None, key=None) -> torch.Tensor:
    """ATTENTION over the keys k[:n_kv] (n_kv = the cache length; on the CPU only the
    filled part). A decode step on CUDA reads only the keys up to each query's position
    (decode_attention: one launch, where Inductor's masked form over the whole cache took
    three, 6.9 us a layer of an 8B's step on an H100). Elsewhere the mask is shared
    (``memo``) by every layer of a run that reads position node ``key``."""
    base = _unrotated(q)
    n_kv, group = k.shape[0], base.shape[1] // k.shape[1]
    if base.shape[0] <= SMALL_ROWS and decode_attention.usable(base, k[None], v[None]):
        return _visible(q, k[None], v[None], pos, torch.zeros_like(pos), scale, window, softcap)
    q = made(q)
    mk = ("mask", key, n_kv, window, group)
    mask = memo.get(mk) if memo is not None else None
    if mask is None:
        mask = attention_mask(pos, n_kv, window, group)
        if memo is not None:
            memo[mk] = mask
    return attend(q, k, v, mask, scale, softcap)


def _unrotated(q) -> torch.Tensor:
    # the queries' tensor: q, or the one a Roped rotates (its shape and device are q's)
    return q.x if isinstance(q, Roped) else q


def _visible(q, k, v, pos, seq, scale: float, window: int, softcap: float) -> torch.Tensor:
    # decode_attention, rotating the queries as it loads them where their ROPE was left to it
    if isinstance(q, Roped):
        return decode_attention.attend_visible(q.x, k, v, pos, seq, scale, window, softcap,
                                               (q.cos, q.sin, q.n_dims, q.neox))
    return decode_attention.attend_visible(q, k, v, pos, seq, scale, window, softcap)


def attend(q, k, v, mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Attention of q (T, Hq, D) over k (S, Hkv, D), v (S, Hkv, Dv) where ``mask`` (T*G,
    S) allows. Grouped-query heads without copying k or v per query head: for each kv
    head one batched matmul of its group's queries, all positions at once:
        q (T, Hq, D) -> (Hkv, T*G, D);  k (S, Hkv, D) -> (Hkv, D, S);  scores (Hkv, T*G, S)
    (on a CPU ``cpu_attention``'s fixed-order form; decode steps traced for Inductor: the
    same as products and sums, see SMALL_ROWS; elsewhere without a softcap, PyTorch's fused
    attention)."""
    n_tok, n_head, dim = q.shape
    n_head_kv = k.shape[1]
    group = n_head // n_head_kv
    qh = q.float().reshape(n_tok, n_head_kv, group, dim).permute(1, 0, 2, 3).reshape(n_head_kv, n_tok * group, dim)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # (Hkv, S, D), (Hkv, S, Dv), as cached (F16 or F32)
    if q.device.type == "cpu" and not inductor.tracing():
        out = cpu_attention.attend(qh, kh, vh, mask, scale, softcap)  # the same bits batched or alone
    elif inductor.tracing() and n_tok <= SMALL_ROWS:
        kh, vh = kh.float(), vh.float()  # fused into the kernels that read the cache
        scores = (qh[:, :, None, :] * kh[:, None, :, :]).sum(-1) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
        out = (probs[..., None] * vh[:, None, :, :]).sum(-2)
    elif not softcap:
        # one fused kernel (memory-efficient attention on CUDA): no (Hkv, T*G, S) scores
        # in memory, which for a prefill chunk cost more than the projections around it
        # (on CUDA an F16 cache is read as stored, half the bytes: the kernel accumulates in f32)
        dt = torch.float16 if kh.dtype == torch.float16 and kh.is_cuda else torch.float32
        out = F.scaled_dot_product_attention(qh[None].to(dt), kh[None].to(dt), vh[None].to(dt),
                                             attn_mask=mask, scale=scale)[0].float()
    else:
        kh, vh = kh.float(), vh.float()
        scores = softcap * torch.tanh(torch.bmm(qh, kh.transpose(1, 2)) * scale / softcap)
        out = torch.bmm(torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1), vh)  # (Hkv, T*G, Dv)
    return out.reshape(n_head_kv, n_tok, group, -1).permute(1, 0, 2, 3).reshape(n_tok, n_head, -1)


def attention_filled(q, k, v, pos, scale: float, window: int, softcap: float, *, memo=None, key=None):
    """ATTENTION where the positions are on the host's side (a CPU, or a graph whose index
    operands a device cannot check): only keys up to the highest position. On a CPU
    ``cpu_attention``'s form, whose bits do not depend on the call's other queries."""
    q = made(q)
    if q.device.type == "cpu":
        return cpu_attention.attend_runs(q, k[None], v[None], pos, None, scale, window, softcap, memo)
    n_kv = int(pos.max()) + 1
    return attention(q, k[:n_kv], v[:n_kv], pos, scale, window, softcap, memo=memo, key=key)


def attention_seq(q, k, v, pos, seq, scale: float, window: int, softcap: float, *, memo=None,
                  key=None) -> torch.Tensor:
    """ATTENTION_SEQ: k (S, N, Hkv, D) laid end to end, one mask (T*G, S*N) keeping each
    query to its own slot (``seq``) at positions up to its own. Fixed shapes on a device;
    on CUDA with Triton each query reads only its own slot's visible keys instead."""
    if decode_attention.usable(_unrotated(q), k, v):
        return _visible(q, k, v, pos, seq, scale, window, softcap)
    q = made(q)
    n_slots, n_kv = k.shape[:2]
    group = q.shape[1] // k.shape[2]
    # key row j is position j % n_kv of slot j // n_kv: ATTENTION's mask in every slot,
    # and only the query's own slot
    slot = torch.arange(n_slots, device=pos.device).repeat_interleave(n_kv)[None, :]
    mask = (attention_mask(pos, n_kv, window, group).repeat(1, n_slots)
            & (slot == seq.long().repeat_interleave(group)[:, None]))
    flat = (n_slots * n_kv, *k.shape[2:])
    return attend(q, k.reshape(flat), v.reshape(*flat[:2], v.shape[-1]), mask, scale, softcap)


def attention_seq_filled(q, k, v, pos, seq, scale: float, window: int, softcap: float, *, memo=None,
                         key=None) -> torch.Tensor:
    """ATTENTION_SEQ where the positions are on the host's side: only keys up to the highest
    position are read. On a CPU one call of ``cpu_attention`` for the step's sequences, each
    over its own slot's keys, whose result for a query is then the same bits whatever else
    the step carries: over every slot's keys under one mask, the keys of the slots before
    its own shifted where the fused kernel's blocks fall, and a greedy request gave other
    tokens batched than alone (tests/test_batch_invariance.py)."""
    check_positions(pos, k.shape[1])  # the slots were checked before the step (OpSpec.index)
    q = made(q)
    if q.device.type == "cpu":
        return cpu_attention.attend_runs(q, k, v, pos, seq, scale, window, softcap, memo)
    n_kv = int(pos.max()) + 1  # elsewhere every slot up to the step's highest position, one call
    return attention_seq(q, k[:, :n_kv], v[:, :n_kv], pos, seq, scale, window, softcap)


ARGMAX_CHUNK = 1024


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum over the last axis, as int32. Long rows (a vocabulary)
    are reduced in two stages, chunk maxima then the best chunk: on a GPU one serial
    reduction over 128k logits takes ~30 µs, the two stages a few."""
    n = x.shape[-1]
    if n <= ARGMAX_CHUNK:
        return x.argmax(dim=-1).int()
    rows = x.reshape(-1, n)
    n_chunks = -(-n // ARGMAX_CHUNK)
    padded = F.pad(rows, (0, n_chunks * ARGMAX_CHUNK - n), value=-math.inf)
    best, where = padded.view(rows.shape[0], n_chunks, ARGMAX_CHUNK).max(dim=-1)  # first max per chunk
    chunk = best.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    index = chunk * ARGMAX_CHUNK + where.gather(-1, chunk)
    return index.squeeze(-1).int().reshape(x.shape[:-1])


def sample(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Op.SAMPLE without a host sync (capturable in a CUDA graph). Several rows (a batched
    step) stay out of a compiled step, as one opaque op: Inductor (torch 2.11, CUDA) failed
    to generate code for the softmax of 64 x 128,256 logits, and the rows' sort costs more
    than the fusion saves."""
    if inductor.tracing() and logits.numel() > logits.shape[-1]:
        return _sample_rows(logits, params)
    return _sample(logits, params)


def _sample(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Every step of the reference is a tensor op, and the kept sets are always prefixes
    of the sorted order."""
    rows = logits.reshape(-1, logits.shape[-1]).float()
    # fields (1, 1), or (rows, 1) with a draw per row: tensors, no host sync
    a = SampleArgs.unpack(params.float().reshape(-1, 1, PARAMS_SIZE))
    vals, order = torch.sort(rows, dim=-1, descending=True, stable=True)
    rank = torch.arange(vals.shape[-1], device=rows.device)
    keep = (a.top_k <= 0) | (rank < a.top_k)
    safe_t = torch.where(a.temperature > 0, a.temperature, torch.ones_like(a.temperature))  # greedy: unused
    p = torch.softmax((vals / safe_t).masked_fill(~keep, -math.inf), dim=-1)
    # top-p: keep while the mass *before* a token is below top_p (the reference's
    # "shortest prefix reaching top_p"); an exclusive cumsum, not cum - p, for exactness
    before = torch.zeros_like(p)
    before[:, 1:] = torch.cumsum(p, dim=-1)[:, :-1]
    keep = keep & ((a.top_p >= 1.0) | (before < a.top_p)) & (p >= a.min_p * p[:, :1])
    kept = torch.where(keep, p, torch.zeros_like(p))
    cdf = torch.cumsum(kept, dim=-1)
    pick = torch.searchsorted(cdf, a.u * cdf[:, -1:], right=True)
    pick = torch.minimum(pick, keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    token = torch.gather(order, -1, pick).squeeze(-1)
    greedy = argmax(rows)
    return torch.where(a.temperature.reshape(-1) <= 0, greedy, token).int().reshape(logits.shape[:-1])


@torch.library.custom_op("apir::sample_rows", mutates_args=())
def _sample_rows(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    return _sample(logits, params)


@_sample_rows.register_fake
def _(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[:-1], dtype=torch.int32)


def sample_greedy(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Op.SAMPLE when the host has seen temperature <= 0 in ``params``: the argmax alone."""
    return argmax(logits.float())


def penalize(logits: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
    """Op.PENALIZE: the repetition penalty, the bias, then the bitmask (no host sync)."""
    x = logits.float()
    x = torch.where(x > 0, x / scale, x * scale) + bias
    v = torch.arange(x.shape[-1], device=x.device)
    allowed = (mask[v // 32] >> (v % 32).int()) & 1
    return x.masked_fill(allowed == 0, -math.inf)


def logprobs(logits: torch.Tensor, token: torch.Tensor, k: int) -> torch.Tensor:
    """Op.LOGPROBS: the sampled token's log-softmax and the k best, as (logprob, id) rows."""
    v = logits.shape[-1]
    rows = logits.reshape(-1, v).float()
    lp = torch.log_softmax(rows, dim=-1)
    tok = token.reshape(-1, 1).long().clamp(0, v - 1)
    top = torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, :k]
    ids = torch.cat([tok, top], dim=-1)
    out = torch.stack([lp.gather(-1, ids), ids.float()], dim=-1)
    return out.reshape(*logits.shape[:-1], k + 1, 2)


def safe_softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax, 0 on a row of all -inf (as the reference's)."""
    dead = x.amax(dim=-1, keepdim=True) == -math.inf
    return torch.softmax(x.float(), dim=-1).masked_fill(dead, 0.0)


def view(x: torch.Tensor, axis: int, start: int, length: int) -> torch.Tensor:
    n = x.shape[axis]
    if not -n <= start < n:  # on the T axis only known now; must not wrap around
        raise BackendError(f"VIEW start {start} outside axis of size {n}")
    return x.narrow(axis, start % n, length)  # narrow refuses start + length > n


# op -> f(*inputs, *attrs). Index operands (OpSpec.index) are checked before the kernel
# runs, on the device's values (Step.checks) or on the host's inputs (Program.index_checks).
KERNELS: dict = {
    Op.GET_ROWS: get_rows,
    Op.SET_ROWS: lambda dst, src, ids: dst.index_copy_(0, ids.long(), src.to(dst.dtype)),
    Op.MATMUL: matmul,
    Op.ADD: lambda a, b: a.float() + b.float(),
    Op.MUL: lambda a, b: a.float() * b.float(),
    Op.SCALE: lambda x, s: x * s,
    Op.SILU: F.silu,
    Op.GELU: gelu,
    Op.SWIGLU: lambda g, u: F.silu(g) * u,
    Op.GEGLU: lambda g, u: gelu(g) * u,
    Op.RMS_NORM: rms_norm,
    Op.SOFTMAX: safe_softmax,
    Op.ROPE: rope,
    Op.ATTENTION: attention_filled,
    Op.ATTENTION_SEQ: attention_seq_filled,
    Op.RESHAPE: lambda x, shape: x.reshape(shape),
    Op.PERMUTE: lambda x, axes: x.permute(axes) if axes else x,  # torch refuses () on a 0-d tensor
    Op.TRANSPOSE: lambda x, a, b: x.transpose(a, b),
    Op.VIEW: view,
    Op.CONTIGUOUS: lambda x: x.contiguous(),
    Op.CONCAT: lambda a, b, axis: torch.cat([a, b], dim=axis),
    Op.ARGMAX: argmax,
    Op.SAMPLE: sample,
    Op.PENALIZE: penalize,
    Op.LOGPROBS: logprobs,
}

# ---------------------------------------------------------------- general programs (apir.torch)


UNARY = {
    Fn.EXP: torch.exp,
    Fn.LOG: torch.log,
    Fn.SQRT: torch.sqrt,
    Fn.RSQRT: torch.rsqrt,
    Fn.SIN: torch.sin,
    Fn.COS: torch.cos,
    Fn.TANH: torch.tanh,
    Fn.SIGMOID: torch.sigmoid,
    Fn.RELU: torch.relu,
    Fn.ABS: torch.abs,
}
REDUCE = {
    Reduce.SUM: lambda x: x.sum(dim=-1, keepdim=True),
    Reduce.MEAN: lambda x: x.mean(dim=-1, keepdim=True),
    Reduce.MAX: lambda x: x.amax(dim=-1, keepdim=True),
}


def pool2d(x: torch.Tensor, fn: int, kernel, stride, padding) -> torch.Tensor:
    if Pool(fn) is Pool.MAX:
        return F.max_pool2d(x.float(), kernel, stride, padding)
    return F.avg_pool2d(x.float(), kernel, stride, padding, count_include_pad=True)


KERNELS.update({
    Op.CONV2D: lambda x, w, stride, padding, dilation, groups: F.conv2d(
        x.float(), w.float(), None, stride, padding, dilation, groups),
    Op.POOL2D: pool2d,
    Op.SUB: lambda a, b: a.float() - b.float(),
    Op.DIV: lambda a, b: a.float() / b.float(),
    Op.UNARY: lambda x, fn: UNARY[Fn(fn)](x.float()),
    Op.REDUCE: lambda x, fn: REDUCE[Reduce(fn)](x.float()),
    Op.BMM: lambda a, b: torch.bmm(a.float(), b.float()),
    Op.CAST: lambda x: x.float(),
})

# Accelerators: no kernel may synchronise with the host.
# fixed shapes: over the whole cache, masked, or (CUDA) reading the visible keys only
DEVICE_KERNELS = {**KERNELS, Op.ATTENTION: attention, Op.ATTENTION_SEQ: attention_seq}
