"""Triton kernels that compute from quantized weights packed by ``qpack`` (the GGUF bytes,
moved into planes; the layout is described there).

    _qgemv_kernel    y (M, N) f32 = x (M, K) f32 @ W.T   for the few rows of a decode step
    _qmm_kernel      y (M, N) f32 = x (M, K) @ W.T        for a batched decode step's rows
                     (both: W up to three weights of one type stacked along N, one launch)
    _dequant_kernel  out (R, K) f16/f32 = rows of W        for prefill and row lookups

All three take a tile of (BN rows, NC chunks, CW words) of the low plane, loaded as one
contiguous run per row (16-byte loads, a warp reading consecutive bytes), and walk the S
slots of a word as static steps: slot s of the tile is the elements c * S * CW + s * CW + w,
so the x values it multiplies are CW consecutive floats per chunk, and its scale is one per
(row, chunk) (Q6_K: two, by w < 16), loaded once for the tile's words.

Unsigned quants become f32 without an int->float convert (16 per clock per SM on Hopper, a
quarter of the f32 rate): the f32 with bits 0x4B000000 | q is 2**23 + q exactly, and one
subtraction removes 2**23 and the type's offset together (``_quant``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# PTX inline assembly (``_byte``) is for NVIDIA GPUs: not under Triton's CPU interpreter,
# not on ROCm, where the same kernels take the plain shift-and-mask route
ASM = os.environ.get("TRITON_INTERPRET") != "1" and torch.version.hip is None

# ggml type id -> (LB low bits, HB high bits, OFF the offset taken off a quant, MIN: the
# values have a min, d * q + m)
TYPES: dict[int, tuple[int, int, int, bool]] = {
    2: (4, 0, 8, False),  # Q4_0   x = d (q - 8)
    3: (4, 0, 0, True),  # Q4_1    x = d q + m
    6: (4, 1, 16, False),  # Q5_0  x = d (q - 16)
    7: (4, 1, 0, True),  # Q5_1    x = d q + m
    8: (8, 0, 128, False),  # Q8_0 x = d q (q int8, read as q + 128)
    10: (2, 0, 0, True),  # Q2_K   x = d sc q - dmin m, per 16
    11: (2, 1, 4, False),  # Q3_K  x = d (sc - 32) (q - 4), per 16
    12: (4, 0, 0, True),  # Q4_K   x = d sc q - dmin m, per 32
    13: (4, 1, 0, True),  # Q5_K   as Q4_K
    14: (4, 2, 32, False),  # Q6_K x = d sc (q - 32), per 16
}


@triton.jit
def _byte(w, t: tl.constexpr, ASM: tl.constexpr):
    # 0x4B0000XX, XX = byte t of the uint32 w: the bits of the f32 2**23 + XX. On a GPU a
    # byte permute (PRMT) per value, the four of a word in one asm block that the calls for
    # t = 0..3 share (it is pure, so it is emitted once); shift, mask and OR would cost three
    # integer ops a value (Hopper issues half as many integer as f32 ops a clock)
    if ASM:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(
            """{
            .reg .b32 m;
            mov.b32 m, 0x4B000000;
            prmt.b32 $0, $4, m, 0x7540;
            prmt.b32 $1, $4, m, 0x7541;
            prmt.b32 $2, $4, m, 0x7542;
            prmt.b32 $3, $4, m, 0x7543;
            }""", "=r,=r,=r,=r,r", [w], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
            is_pure=True, pack=1)
        if t == 0:
            r = r0
        elif t == 1:
            r = r1
        elif t == 2:
            r = r2
        else:
            r = r3
    else:
        r = ((w >> (8 * t)) & 0xFF) | 0x4B000000
    return r


@triton.jit
def _quant(lw, hw, s: tl.constexpr, QT: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr,
           OFF: tl.constexpr, ASM: tl.constexpr):
    # slot s of the low words lw (u32) and high bits hw: q - OFF as f32, exactly
    if LB == 8:
        bits = _byte(lw ^ 0x80808080, s, ASM)  # int8 q -> q + 128 as a byte
    elif LB == 4:
        bits = _byte((lw >> (4 * (s // 4))) & 0x0F0F0F0F, s % 4, ASM)
    else:
        bits = _byte((lw >> (2 * (s // 4))) & 0x03030303, s % 4, ASM)
    if HB > 0:
        bits = bits | (((hw >> (HB * s)) & ((1 << HB) - 1)) << LB)
    return bits.to(tl.float32, bitcast=True) - (8388608.0 + OFF)


@triton.jit
def _f16(p):
    return tl.load(p).to(tl.float32)


@triton.jit
def _scale(p0, p1, p2, r, c, w, K, s: tl.constexpr, QT: tl.constexpr, S: tl.constexpr,
           CW: tl.constexpr):
    """The scale d and min m of slot s for rows r (BN, 1, 1), chunks c (1, NC, 1) and words
    w (1, 1, CW) from the scale planes at p0, p1, p2: each (BN, NC, 1), or (BN, NC, CW)
    where it depends on w (Q6_K). m is d where the type has no min (unused)."""
    if QT == 2 or QT == 3 or QT == 6 or QT == 7 or QT == 8:
        g = r * (K // 32) + c * (S * CW // 32) + (s * CW) // 32  # its group of 32
        d = _f16(p0 + g)
        if QT == 3 or QT == 7:
            m = _f16(p1 + g)
        else:
            m = d
    elif QT == 10:  # scale byte s of the block: low nibble scale, high nibble min
        sc = tl.load(p0 + (r * (K // 256) + c) * 16 + s).to(tl.int32)
        blk = r * (K // 256) + c
        d = _f16(p1 + blk) * (sc & 15).to(tl.float32)
        m = -(_f16(p2 + blk) * (sc >> 4).to(tl.float32))
    elif QT == 11:  # 16 six-bit scales in 12 bytes: low 4 bits in nibble s // 8 of byte s % 8,
        # high 2 at bits 2 (s // 4).. of byte 8 + s % 4
        h = p0 + (r * (K // 256) + c) * 12
        lo = (tl.load(h + s % 8).to(tl.int32) >> (4 * (s // 8))) & 15
        hi = (tl.load(h + 8 + s % 4).to(tl.int32) >> (2 * (s // 4))) & 3
        d = _f16(p1 + r * (K // 256) + c) * ((lo | (hi << 4)) - 32).to(tl.float32)
        m = d
    elif QT == 12 or QT == 13:  # header d | dmin | scales[12]: 8 six-bit scales and mins
        h = p0 + (r * (K // 256) + c) * 16
        w1 = tl.load((h + 4).to(tl.pointer_type(tl.uint32)))
        w2 = tl.load((h + 8).to(tl.pointer_type(tl.uint32)))
        if s < 4:
            sc = (w1 >> (8 * s)) & 63
            mn = (w2 >> (8 * s)) & 63
        else:
            w3 = tl.load((h + 12).to(tl.pointer_type(tl.uint32))) >> (8 * (s - 4))
            sc = (w3 & 0xF) | (((w1 >> (8 * (s - 4) + 6)) & 3) << 4)
            mn = ((w3 >> 4) & 0xF) | (((w2 >> (8 * (s - 4) + 6)) & 3) << 4)
        d = _f16(h.to(tl.pointer_type(tl.float16))) * sc.to(tl.float32)
        m = -(_f16((h + 2).to(tl.pointer_type(tl.float16))) * mn.to(tl.float32))
    else:  # Q6_K: int8 scale 2s + (w >= 16) of the block, times d
        sc = tl.load(p0 + (r * (K // 256) + c) * 16 + 2 * s + (w >= 16).to(tl.int32))
        d = _f16(p1 + r * (K // 256) + c) * sc.to(tl.float32)
        m = d
    return d, m


@triton.jit
def _tile(low_ptr, high_ptr, r, c, w, WPR, LB: tl.constexpr, HB: tl.constexpr, CW: tl.constexpr):
    # the (BN, NC, CW) words of rows r, chunks c: one contiguous run of NC * CW words a row
    # (the planes are passed as int32, int16 and uint8 tensors: torch has no unsigned views)
    # (rows are 16-byte multiples: K * LB / 32 words is a multiple of 4 for every type; the
    # hint lets Triton load 4 words a thread at once)
    # Triton 3.6's coalescing pass fails an assertion on the hint where the chunk dimension
    # is 1 (K of one chunk or two, a small model's): the hint is given only where it is not
    if c.shape[1] > 1:
        at = tl.multiple_of(r.to(tl.int64) * WPR + c * CW, [4, 4, 4]) + w
    else:
        at = r.to(tl.int64) * WPR + c * CW + w
    lw = tl.load(low_ptr + at, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    if HB * 32 // LB == 16:
        hw = tl.load(high_ptr + at, eviction_policy="evict_first").to(tl.uint16, bitcast=True).to(tl.uint32)
    elif HB > 0:
        hw = tl.load(high_ptr + at, eviction_policy="evict_first").to(tl.uint32)
    else:
        hw = lw
    return lw, hw


@triton.jit
def _accumulate(acc, lw, hw, x_row, r, c, w, p0, p1, p2, K, QT: tl.constexpr, LB: tl.constexpr,
                HB: tl.constexpr, OFF: tl.constexpr, MIN: tl.constexpr, CW: tl.constexpr,
                ASM: tl.constexpr):
    # acc (BN, NC, CW) + the products of the tile's words with x, slot by slot
    S: tl.constexpr = 32 // LB
    for s in tl.static_range(S):
        q = _quant(lw, hw, s, QT, LB, HB, OFF, ASM)
        if c.shape[1] > 1:  # see _tile
            x = tl.load(x_row + tl.multiple_of(c * (S * CW) + s * CW, [4, 4, 4]) + w)
        else:
            x = tl.load(x_row + c * (S * CW) + s * CW + w)
        d, mn = _scale(p0, p1, p2, r, c, w, K, s, QT, S, CW)
        acc = tl.fma(d, q * x, acc)
        if MIN:
            acc = tl.fma(mn, x, acc)
    return acc


@triton.jit
def _part(t, T0, T1, N0, N1, N2, P: tl.constexpr):
    """Row tile ``t`` of a launch over P stacked weights (T0 row tiles of the first, T1 of
    the second, then the third's; N0, N1, N2 rows): (its weight, its tile in that weight,
    that weight's rows, its first column of y)."""
    part = t * 0
    if P > 1:
        part += (t >= T0).to(tl.int32)
    if P > 2:
        part += (t >= T0 + T1).to(tl.int32)
    first = tl.where(part == 0, 0, tl.where(part == 1, T0, T0 + T1))
    n = tl.where(part == 0, N0, tl.where(part == 1, N1, N2))
    col = tl.where(part == 0, 0, tl.where(part == 1, N0, N0 + N1))
    return part, t - first, n, col


@triton.jit
def _pick(part, a0, a1, a2, P: tl.constexpr):
    # plane a<part> of the P stacked weights (one type: the same pointer types)
    a = a0
    if P > 1:
        if part == 1:
            a = a1
    if P > 2:
        if part == 2:
            a = a2
    return a


@triton.jit
def _qgemv_kernel(x_ptr, L0, H0, A0, B0, C0, L1, H1, A1, B1, C1, L2, H2, A2, B2, C2, y_ptr,
                  N0, N1, N2, T0, T1, K, LDY, QT: tl.constexpr, LB: tl.constexpr,
                  HB: tl.constexpr, OFF: tl.constexpr, MIN: tl.constexpr, CW: tl.constexpr,
                  ASM: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, NC: tl.constexpr):
    # program (m, t): row tile t of the P stacked weights (L, H, A, B, C: each one's low,
    # high and scale planes; see _part) times row m of x, into y[m, its columns] (y's rows
    # LDY apart). The M programs of one row tile run side by side, so the tile's bytes come
    # from DRAM once and from L2 after. One launch for q, k and v: an 8B's k and v have
    # 1,024 rows, 128 programs alone, under one wave of the GPU's multiprocessors
    m = tl.program_id(0)
    part, tile, N, col = _part(tl.program_id(1), T0, T1, N0, N1, N2, P)
    low_ptr, high_ptr = _pick(part, L0, L1, L2, P), _pick(part, H0, H1, H2, P)
    p0, p1, p2 = _pick(part, A0, A1, A2, P), _pick(part, B0, B1, B2, P), _pick(part, C0, C1, C2, P)
    # rows past the end re-read the last one (in bounds, no masks on the weight stream)
    r = tl.minimum(tile * BN + tl.arange(0, BN), N - 1)[:, None, None]
    w = tl.arange(0, CW)[None, None, :]
    WPR = K * LB // 32  # low words per row
    chunks = WPR // CW
    x_row = x_ptr + m * K
    # partial sums per (row, chunk, word) position, reduced once at the end: no cross-thread
    # traffic in the loop, and a summation order fixed by the shape
    acc = tl.zeros((BN, NC, CW), dtype=tl.float32)
    step = tl.arange(0, NC)[None, :, None]
    for c0 in tl.range(0, chunks, NC):
        c = c0 + step
        lw, hw = _tile(low_ptr, high_ptr, r, c, w, WPR, LB, HB, CW)
        acc = _accumulate(acc, lw, hw, x_row, r, c, w, p0, p1, p2, K, QT, LB, HB, OFF, MIN, CW, ASM)
    rows = tile * BN + tl.arange(0, BN)
    tl.store(y_ptr + m * LDY + col + rows, tl.sum(tl.sum(acc, axis=2), axis=1), mask=rows < N)


@triton.jit
def _qmm_kernel(x_ptr, L0, H0, A0, B0, C0, L1, H1, A1, B1, C1, L2, H2, A2, B2, C2, y_ptr,
                M, N0, N1, N2, T0, T1, K, LDY, SPLIT_CHUNKS, SPLIT_STRIDE,
                QT: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, OFF: tl.constexpr,
                MIN: tl.constexpr, CW: tl.constexpr, ASM: tl.constexpr, P: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, NC: tl.constexpr):
    # program (i, t, h): rows i*BM.. of x times row tile t of the P stacked weights (as
    # _qgemv_kernel), over chunks h*SPLIT_CHUNKS.. of K, written SPLIT_STRIDE * h further on
    # (the caller sums the splits). Each weight tile is dequantized once, to f16, and
    # multiplied with every row on the tensor cores; slot s of a tile is a K-slice of the
    # product whose x values are the elements c * S * CW + s * CW + w. x is rounded to f16,
    # as the prefill path does
    S: tl.constexpr = 32 // LB
    part, tile, N, col = _part(tl.program_id(1), T0, T1, N0, N1, N2, P)
    low_ptr, high_ptr = _pick(part, L0, L1, L2, P), _pick(part, H0, H1, H2, P)
    p0, p1, p2 = _pick(part, A0, A1, A2, P), _pick(part, B0, B1, B2, P), _pick(part, C0, C1, C2, P)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    keep = (m < M)[:, None, None]
    xm = x_ptr + tl.minimum(m, M - 1).to(tl.int64)[:, None, None] * K
    r = tl.minimum(tile * BN + tl.arange(0, BN), N - 1)[:, None, None]
    w = tl.arange(0, CW)[None, None, :]
    WPR = K * LB // 32
    chunks = WPR // CW
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    step = tl.arange(0, NC)[None, :, None]
    first = tl.program_id(2) * SPLIT_CHUNKS
    for c0 in tl.range(first, tl.minimum(first + SPLIT_CHUNKS, chunks), NC):
        c = c0 + step
        lw, hw = _tile(low_ptr, high_ptr, r, c, w, WPR, LB, HB, CW)
        for s in tl.static_range(S):
            q = _quant(lw, hw, s, QT, LB, HB, OFF, ASM)
            d, mn = _scale(p0, p1, p2, r, c, w, K, s, QT, S, CW)
            v = d * q + mn if MIN else d * q
            wt = tl.reshape(v.to(tl.float16), (BN, NC * CW))
            x = tl.load(xm + (c * (S * CW) + s * CW) + w, mask=keep, other=0.0)  # masked: no hint
            acc = tl.dot(tl.reshape(x.to(tl.float16), (BM, NC * CW)), tl.trans(wt), acc)
    rows = tile * BN + tl.arange(0, BN)
    y = y_ptr + tl.program_id(2).to(tl.int64) * SPLIT_STRIDE + col
    tl.store(y + m[:, None] * LDY + rows[None, :], acc, mask=(m < M)[:, None] & (rows < N)[None, :])


@triton.jit
def _dequant_kernel(low_ptr, high_ptr, p0, p1, p2, out_ptr, R0, R1, K, QT: tl.constexpr,
                    LB: tl.constexpr, HB: tl.constexpr, OFF: tl.constexpr, MIN: tl.constexpr,
                    CW: tl.constexpr, ASM: tl.constexpr, BN: tl.constexpr, NC: tl.constexpr):
    # program (i, j): rows R0 + i*BN.., chunks j*NC.. of W, written to out (R1 - R0, K)
    # row-major, each value rounded as gguf-py rounds it (d * q, then + m; launched without
    # FP fusion)
    S: tl.constexpr = 32 // LB
    rows = R0 + tl.program_id(0) * BN + tl.arange(0, BN)
    r = tl.minimum(rows, R1 - 1)[:, None, None]
    c = (tl.program_id(1) * NC + tl.arange(0, NC))[None, :, None]
    w = tl.arange(0, CW)[None, None, :]
    lw, hw = _tile(low_ptr, high_ptr, r, c, w, K * LB // 32, LB, HB, CW)
    if NC > 1:  # see _tile
        out = out_ptr + tl.multiple_of((rows - R0).to(tl.int64)[:, None, None] * K + c * (S * CW), [4, 4, 4]) + w
    else:
        out = out_ptr + (rows - R0).to(tl.int64)[:, None, None] * K + c * (S * CW) + w
    keep = (rows < R1)[:, None, None] & (w >= 0)
    for s in tl.static_range(S):
        q = _quant(lw, hw, s, QT, LB, HB, OFF, ASM)
        d, mn = _scale(p0, p1, p2, r, c, w, K, s, QT, S, CW)
        v = d * q + mn if MIN else d * q
        tl.store(out + s * CW, v.to(out_ptr.dtype.element_ty), mask=keep)
