"""Attention that reads only the keys a query sees: each query's own slot, up to its own
position (and back to its window), split along the keys (flash-decoding) so a few queries
still fill the GPU.

    q (T, Hq, D) f32;  k (S, N, Hkv, D), v (S, N, Hkv, Dv) f16 or f32, a cache of S slots
    pos, seq (T,) i32: query t is at position pos[t] of slot seq[t]
    -> (T, Hq, Dv) f32, the softmax of the visible keys' scores (softcapped where asked)

The masked dense form (kernels.attention_seq) computes every query against every slot's
every row: a decode step of 64 streams with 257-token slots scores each query against
16k keys, and a one-stream step on a 64-slot cache ran at 0.21x of the single-sequence
path on an H200 (apir bench serve, 2026-12-01). Here a program (query t, kv head h, key
split s) walks only keys s*KEYS.. of slot seq[t] that are <= pos[t], keeping a running
maximum, denominator and weighted sum for its G query heads (online softmax); the last
split of a query's kv head to finish combines the splits' partials, in the same launch.
Shapes and launch grid depend on T and the cache only, so a step is recorded in a CUDA
graph once; the loop bounds are read on the device.

Triton comes with CUDA builds of PyTorch; without it ``usable`` is False.
"""

from __future__ import annotations

import functools

import torch

from .qmatmul import multiprocessors

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

SPLIT_KEYS = 128  # keys a split walks at least, where the queries alone would not fill the GPU
WAVES = 8  # programs a multiprocessor that the splits aim for: loads in flight, not arithmetic, bound it
MAX_SPLITS = 256


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``attend_visible`` applies: CUDA with Triton, a cache whose rows are
    contiguous (heads, then features)."""
    return (triton is not None and q.is_cuda and k.dim() == 4 and v.dim() == 4
            and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1]
            and v.stride(-1) == 1 and v.stride(-2) == v.shape[-1])


def splits(n_queries: int, heads_kv: int, n_keys: int, sms: int) -> tuple[int, int]:
    """(splits, KEYS a split): enough programs for WAVES a multiprocessor, each split at
    least SPLIT_KEYS keys; one split where the queries fill the GPU alone (a prefill chunk).
    On an H200 one decode query's 8 kv heads over 4,096 keys took 77 µs a layer in 16 splits
    of 16-key steps, a latency-bound walk (bench/probes/decode_attention.py)."""
    programs = n_queries * heads_kv
    if programs >= 2 * sms:
        return 1, n_keys
    want = min(-(-n_keys // SPLIT_KEYS), -(-WAVES * sms // programs), MAX_SPLITS)
    keys = -(-n_keys // max(want, 1))
    return -(-n_keys // keys), keys


def tiles(group: int, dim: int, dim_v: int) -> tuple[int, int, int, int, int]:
    """(GP: the group's heads, DP, DVP: the head widths, each a power of two of at least 16
    (a tensor-core tile's side), BLOCK keys a loop step, num_warps)."""
    gp, dp, dvp = (max(16, 1 << (x - 1).bit_length()) for x in (group, dim, dim_v))
    block = 64 if max(dp, dvp) <= 128 else 32
    return gp, dp, dvp, block, 4 if max(dp, dvp) <= 128 else 8


if triton is not None:

    @triton.jit
    def _attend_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, seq_ptr, m_ptr, l_ptr, o_ptr, out_ptr, done_ptr,
                       cos_ptr, sin_ptr, KEYS, HQ, HKV, K_SLOT, K_ROW, V_SLOT, V_ROW, scale, softcap,
                       window, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                       DV: tl.constexpr, DVP: tl.constexpr, BLOCK: tl.constexpr,
                       SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, F32: tl.constexpr,
                       SPLIT: tl.constexpr, ROPE: tl.constexpr, NEOX: tl.constexpr):
        # program (t, h, s): query t's heads h*G.. over keys s*KEYS.. of its slot, into out
        # (T, HQ, DV). One split (not SPLIT): its own result. Else it writes its running max
        # m, denominator l (T, HQ, splits) and weighted sum o (T, HQ, splits, DV), and the
        # last of (t, h)'s splits to finish (a count in done (T * HKV,), zero between launches:
        # that program sets it back) combines them: no second launch. Both products run on
        # the tensor cores: q (GP, DP) @ k.T (DP, BLOCK), then the probabilities (GP, BLOCK)
        # @ v (BLOCK, DVP), in the cache's type (an f16 cache: q and the probabilities
        # rounded to f16, as fused attention kernels do), accumulated in f32
        t = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        p = tl.load(pos_ptr + t)
        slot = tl.load(seq_ptr + t).to(tl.int64)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        dv = tl.arange(0, DVP)
        heads = t * HQ + h * G + g
        in_q = (g < G)[:, None] & (d < D)[None, :]
        q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=in_q, other=0.0)
        if ROPE:  # the first ROPE features turn by the angles of the query's position, in pairs
            # (d, d + ROPE/2) (NEOX) or (2i, 2i + 1): y_d = x_d cos - x_pair sin for the first
            # of a pair, x_d cos + x_pair sin for the second, as kernels.rope_apply computes it
            if NEOX:
                second = (d >= ROPE // 2) & (d < ROPE)
                pair = tl.where(second, d - ROPE // 2, d + ROPE // 2)
                angle = tl.where(second, d - ROPE // 2, d)
            else:
                second = d % 2 == 1
                pair = d ^ 1
                angle = d // 2
            turns = in_q & (d < ROPE)[None, :]
            qp = tl.load(q_ptr + heads[:, None] * D + pair[None, :], mask=turns, other=0.0)
            cs = tl.load(cos_ptr + t * (ROPE // 2) + angle, mask=d < ROPE, other=1.0)[None, :]
            sn = tl.load(sin_ptr + t * (ROPE // 2) + angle, mask=d < ROPE, other=0.0)[None, :]
            q = tl.where(turns, tl.where(second[None, :], q * cs + qp * sn, q * cs - qp * sn), q)
        q = q.to(k_ptr.dtype.element_ty)
        first = sp * KEYS
        end = tl.minimum(first + KEYS, p + 1)  # keys first..end-1: none past the query's position
        if WINDOW:
            first = tl.maximum(first, p - window + 1)
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, DVP), tl.float32)
        k_rows = k_ptr + slot * K_SLOT + h * D
        v_rows = v_ptr + slot * V_SLOT + h * DV
        for j0 in range(first, end, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            ok = j < end
            kb = tl.load(k_rows + j.to(tl.int64)[:, None] * K_ROW + d[None, :],
                         mask=ok[:, None] & (d < D)[None, :], other=0.0)
            if F32:
                sc = tl.dot(q, tl.trans(kb), input_precision="ieee")
            else:
                sc = tl.dot(q, tl.trans(kb))
            sc = sc * scale  # (GP, BLOCK)
            if SOFTCAP:  # softcap * tanh(sc / softcap), tanh(x) = 1 - 2 / (e^2x + 1)
                sc = softcap * (1.0 - 2.0 / (tl.exp(2.0 * sc / softcap) + 1.0))
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)  # 0 on the first block (m_i = -inf, m_new finite)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            vb = tl.load(v_rows + j.to(tl.int64)[:, None] * V_ROW + dv[None, :],
                         mask=ok[:, None] & (dv < DV)[None, :], other=0.0)
            if F32:
                acc = tl.dot(pr, vb, acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(pr.to(vb.dtype), vb, acc * alpha[:, None])
            m_i = m_new
        keep = (g < G)[:, None] & (dv < DV)[None, :]
        at = heads[:, None] * DV + dv[None, :]
        if not SPLIT:
            tl.store(out_ptr + at, acc / l_i[:, None], mask=keep)  # the query's own key is always seen: l > 0
        else:
            splits = tl.num_programs(2)
            row = heads * splits + sp
            tl.store(m_ptr + row, m_i, mask=g < G)
            tl.store(l_ptr + row, l_i, mask=g < G)
            tl.store(o_ptr + row[:, None] * DV + dv[None, :], acc, mask=keep)
            tl.debug_barrier()  # every thread's partials written before the count says so
            count = done_ptr + t * HKV + h
            if tl.atomic_add(count, 1, sem="acq_rel") == splits - 1:
                # the splits' partials, read past L1 (written by other multiprocessors); those
                # that saw no key have m = -inf, l = 0 and weigh exp(-inf) = 0
                top = tl.full((GP,), float("-inf"), tl.float32)
                for i in range(0, splits):
                    top = tl.maximum(top, tl.load(m_ptr + heads * splits + i, mask=g < G, other=0.0,
                                                  cache_modifier=".cg"))
                den = tl.zeros((GP,), tl.float32)
                num = tl.zeros((GP, DVP), tl.float32)
                for i in range(0, splits):
                    part = heads * splits + i
                    w = tl.exp(tl.load(m_ptr + part, mask=g < G, other=0.0, cache_modifier=".cg") - top)
                    den += w * tl.load(l_ptr + part, mask=g < G, other=0.0, cache_modifier=".cg")
                    num += w[:, None] * tl.load(o_ptr + part[:, None] * DV + dv[None, :], mask=keep, other=0.0,
                                                cache_modifier=".cg")
                tl.store(out_ptr + at, num / den[:, None], mask=keep)
                tl.atomic_xchg(count, 0)  # for the next launch (a CUDA graph replays this one)

    @functools.cache
    def _counts(device: torch.device) -> torch.Tensor:
        # the splits' finish counts, one a (query, kv head) of a launch that splits (fewer
        # than 2 * multiprocessors: see splits); zero between launches, so one buffer serves
        # every launch on the device (they run one after another on the step's stream)
        return torch.zeros(2 * multiprocessors(device), device=device, dtype=torch.int32)

    # Opaque to a step's tracer, as the quantized products are (see qmatmul): the launches
    # are recorded into a step's CUDA graph like any other kernel.
    @torch.library.custom_op("apir::attend_visible", mutates_args=())
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor,
                scale: float, window: int, softcap: float, cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None, n_dims: int = 0, neox: int = 0) -> torch.Tensor:
        n_tok, n_head, dim = q.shape
        n_slots, n_keys, heads_kv, dim_v = v.shape
        group = n_head // heads_kv
        n_split, keys = splits(n_tok, heads_kv, n_keys, multiprocessors(q.device))
        gp, dp, dvp, block, warps = tiles(group, dim, dim_v)
        out = torch.empty((n_tok, n_head, dim_v), device=q.device, dtype=torch.float32)
        m = l = o = done = out  # one split: no partials
        if n_split > 1:
            m = torch.empty((n_tok, n_head, n_split), device=q.device, dtype=torch.float32)
            l = torch.empty_like(m)
            o = torch.empty((n_tok, n_head, n_split, dim_v), device=q.device, dtype=torch.float32)
            done = _counts(q.device)
        _attend_kernel[(n_tok, heads_kv, n_split)](
            q.contiguous(), k, v, pos, seq, m, l, o, out, done, q if cos is None else cos,
            q if sin is None else sin, keys, n_head, heads_kv, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), scale, softcap or 1.0, window,
            G=group, GP=gp, D=dim, DP=dp, DV=dim_v, DVP=dvp, BLOCK=block, SOFTCAP=bool(softcap),
            WINDOW=bool(window), F32=k.dtype == torch.float32, SPLIT=n_split > 1, ROPE=n_dims,
            NEOX=bool(neox), num_warps=warps)
        return out

    @_attend.register_fake
    def _(q, k, v, pos, seq, scale, window, softcap, cos=None, sin=None, n_dims=0, neox=0):
        return q.new_empty((*q.shape[:2], v.shape[-1]), dtype=torch.float32)


def attend_visible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor,
                   scale: float, window: int, softcap: float,
                   rope: tuple[torch.Tensor, torch.Tensor, int, int] | None = None) -> torch.Tensor:
    """The module docstring's attention; ``usable`` must hold. Positions must lie in the
    cache (the executor checks them before the step). ``rope`` (cos, sin (T, 1, n_dims/2),
    n_dims, neox): q is rotated by those angles as the kernel loads it, as kernels.rope_apply
    rotates it (the ROPE of the queries, no launch of its own)."""
    cos = sin = None
    n_dims = neox = 0
    if rope is not None:
        cos, sin, n_dims, neox = rope
        cos, sin = cos.reshape(cos.shape[0], -1).contiguous(), sin.reshape(sin.shape[0], -1).contiguous()
    return _attend(q.float(), k, v, pos.int(), seq.int(), float(scale), int(window), float(softcap),
                   cos, sin, int(n_dims), int(neox))
