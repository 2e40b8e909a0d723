"""Triton kernels that compute from quantized weights packed by ``qpack`` (the GGUF bits,
moved into planes of words; the layout is described there).

    _qgemv_kernel    y (M, N) f32 = x (M, K) int8 @ W.T  for the few rows of a decode step
    _qmm_kernel      y (M, N) f32 = x (M, K) f16 @ W.T    for a batched decode step's rows
                     (both: W up to three weights of one type stacked along N, one launch)
    _dequant_kernel  out (R, K) f16/f32 = rows of W        for prefill and row lookups

All three walk W in groups of 32 elements: a group's quants are LB consecutive low words
(and HB high words), loaded by one thread as one run, and its scale is one per group (two,
a half each, for the types that scale per 16).

The decode kernel multiplies in integers, as llama.cpp's CUDA decode products do: x is
rounded to int8 per group of 32 once a product (_quantize_x_kernel: scale dx = max |x| /
127, as llama.cpp's q8_1), and a dp4a multiplies four quants with four x values in one
instruction, so a weight value costs about two instructions where a float dequantization
costs six (the step is then bound by memory, not by issue: an H200 reads 32 values a clock
per multiprocessor at full bandwidth). A type's offset (Q4_0's q - 8) and min (Q4_K's m)
multiply the sum of the group's int8 x: per group, y += dx * (d * (sum q x - OFF * sum x)
+ m * sum x). The rounding kernel can make x from the op before the product (ACT: a SwiGLU
of the gate and up halves, or an RMS norm times its weight), and the product kernel add a
residual or a bias as it writes y (ADD), so a decode step has no launches for those.

The other two dequantize to floats: the batched kernel a slot of every word of its tile at a
time (``_qmm_kernel``), the dequantize kernel a lane an element, each value rounded as
gguf-py rounds it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# PTX inline assembly (dp4a) is for NVIDIA GPUs: not under Triton's CPU interpreter, not on
# ROCm, where the same kernels take the plain shift-multiply-add route
ASM = os.environ.get("TRITON_INTERPRET") != "1" and torch.version.hip is None


@functools.cache
def dependent_launches(device: torch.device) -> bool:
    """Whether the decode kernels launch as programmatic dependents (PDL, sm_90 and later):
    a kernel's programs start while the kernel before it finishes, load what does not
    depend on it (the weights, their scales), and wait for it (gdc_wait) only before
    reading its results. A decode step is a chain of short launches, each of which
    otherwise starts its first DRAM reads only after the last one's final program exits.
    CUDA 12.3 is the first whose graphs record such launches (a step is replayed as one)."""
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return (ASM and device.type == "cuda" and cuda >= (12, 3)
            and torch.cuda.get_device_capability(device) >= (9, 0))

# ggml type id -> (LB low bits, HB high bits, OFF the offset taken off a quant, MIN: the
# values have a min, d * q + m)
TYPES: dict[int, tuple[int, int, int, bool]] = {
    2: (4, 0, 8, False),  # Q4_0   x = d (q - 8)
    3: (4, 0, 0, True),  # Q4_1    x = d q + m
    6: (4, 1, 16, False),  # Q5_0  x = d (q - 16)
    7: (4, 1, 0, True),  # Q5_1    x = d q + m
    8: (8, 0, 0, False),  # Q8_0   x = d q (q int8)
    10: (2, 0, 0, True),  # Q2_K   x = d sc q - dmin m, per 16
    11: (2, 1, 4, False),  # Q3_K  x = d (sc - 32) (q - 4), per 16
    12: (4, 0, 0, True),  # Q4_K   x = d sc q - dmin m, per 32
    13: (4, 1, 0, True),  # Q5_K   as Q4_K
    14: (4, 2, 32, False),  # Q6_K x = d sc (q - 32), per 16
}

# 1.5 * 2**23: t + MAGIC for |t| < 2**22 is a float whose low mantissa bits are round(t)
# in two's complement (the add rounds to nearest, and no int conversion is issued)
MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _f16(p):
    return tl.load(p).to(tl.float32)


@triton.jit
def _scales(p0, p1, p2, r, g, K, QT: tl.constexpr):
    """(d0, d1, m0, m1) f32, each of the shape r and g broadcast to: the scales and mins of
    the two halves of groups g of rows r, from the scale planes at p0, p1, p2; a half's
    value is d q + m (the offset taken off q first). The types that scale per 32 give both
    halves one d."""
    keep = g < K // 32
    if QT == 2 or QT == 3 or QT == 6 or QT == 7 or QT == 8:
        at = r * (K // 32) + g
        d0 = tl.load(p0 + at, mask=keep, other=0.0).to(tl.float32)
        if QT == 3 or QT == 7:
            m0 = tl.load(p1 + at, mask=keep, other=0.0).to(tl.float32)
        else:
            m0 = d0 * 0.0
        d1 = d0
        m1 = m0
    elif QT == 12 or QT == 13:  # header d | dmin | scales[12]: 8 six-bit scales and mins
        h = (p0 + (r * (K // 256) + g // 8) * 16).to(tl.pointer_type(tl.uint32))
        w0 = tl.load(h, mask=keep, other=0)
        w1 = tl.load(h + 1, mask=keep, other=0)
        w2 = tl.load(h + 2, mask=keep, other=0)
        w3 = tl.load(h + 3, mask=keep, other=0)
        s = (g % 8).to(tl.uint32)
        lo = 8 * (s % 4)
        hi = 8 * (s % 4) + 6
        sc = tl.where(s < 4, (w1 >> lo) & 63, ((w3 >> lo) & 0xF) | (((w1 >> hi) & 3) << 4))
        mn = tl.where(s < 4, (w2 >> lo) & 63, ((w3 >> (lo + 4)) & 0xF) | (((w2 >> hi) & 3) << 4))
        d = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (w0 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        d0 = d * sc.to(tl.float32)
        m0 = -(dmin * mn.to(tl.float32))
        d1 = d0
        m1 = m0
    else:  # per 16: half j = 2g + h of the row
        blk = r * (K // 256) + g // 8
        j0 = r * (K // 16) + 2 * g
        if QT == 10:  # scale byte: low nibble scale, high nibble min
            s0 = tl.load(p0 + j0, mask=keep, other=0).to(tl.int32)
            s1 = tl.load(p0 + j0 + 1, mask=keep, other=0).to(tl.int32)
            d = tl.load(p1 + blk, mask=keep, other=0.0).to(tl.float32)
            dmin = tl.load(p2 + blk, mask=keep, other=0.0).to(tl.float32)
            d0 = d * (s0 & 15).to(tl.float32)
            d1 = d * (s1 & 15).to(tl.float32)
            m0 = -(dmin * (s0 >> 4).to(tl.float32))
            m1 = -(dmin * (s1 >> 4).to(tl.float32))
        elif QT == 11:  # 16 six-bit scales in 12 bytes: low 4 bits in nibble j // 8 of byte
            # j % 8, high 2 at bits 2 (j // 4).. of byte 8 + j % 4
            h = p0 + blk * 12
            j = 2 * (g % 8)
            d = tl.load(p1 + blk, mask=keep, other=0.0).to(tl.float32)
            lo0 = (tl.load(h + j % 8, mask=keep, other=0).to(tl.int32) >> (4 * (j // 8))) & 15
            hi0 = (tl.load(h + 8 + j % 4, mask=keep, other=0).to(tl.int32) >> (2 * (j // 4))) & 3
            lo1 = (tl.load(h + (j + 1) % 8, mask=keep, other=0).to(tl.int32) >> (4 * ((j + 1) // 8))) & 15
            hi1 = (tl.load(h + 8 + (j + 1) % 4, mask=keep, other=0).to(tl.int32) >> (2 * ((j + 1) // 4))) & 3
            d0 = d * ((lo0 | (hi0 << 4)) - 32).to(tl.float32)
            d1 = d * ((lo1 | (hi1 << 4)) - 32).to(tl.float32)
            m0 = d0 * 0.0
            m1 = m0
        else:  # Q6_K: int8 scale per 16, times d
            d = tl.load(p1 + blk, mask=keep, other=0.0).to(tl.float32)
            d0 = d * tl.load(p0 + j0, mask=keep, other=0).to(tl.float32)
            d1 = d * tl.load(p0 + j0 + 1, mask=keep, other=0).to(tl.float32)
            m0 = d0 * 0.0
            m1 = m0
    return d0, d1, m0, m1


@triton.jit
def _group_values(low_ptr, high_ptr, p0, p1, p2, r, g, K, QT: tl.constexpr, LB: tl.constexpr,
                  HB: tl.constexpr, OFF: tl.constexpr, MIN: tl.constexpr):
    """(BN, NG, 32) f32: the values of groups g (NG,) of rows r (BN,), element i of a group
    at [.., i], each d * (q - OFF) + m as gguf-py rounds it (where the kernel runs without FP
    fusion); groups past the row end are 0. A lane an element: the 32 lanes of a group read
    its LB low words (and HB high words) together, one run."""
    G = K // 32
    S: tl.constexpr = 32 // LB  # elements a low word
    i = tl.arange(0, 32)[None, None, :]
    keep = (g < G)[None, :, None]
    row = r.to(tl.int64)[:, None, None]
    at = row * (G * LB) + (g * LB)[None, :, None] + i // S
    lw = tl.load(low_ptr + at, mask=keep, other=0, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    j = i % S  # the element in its word
    q = (lw >> (8 * (j % 4) + LB * (j // 4)).to(tl.uint32)) & ((1 << LB) - 1)
    if HB == 1:  # a word a group: element i at byte i % 4, bit i // 4
        h = tl.load(high_ptr + row * G + g[None, :, None], mask=keep, other=0).to(tl.uint32, bitcast=True)
        q = q | (((h >> (8 * (i % 4) + i // 4).to(tl.uint32)) & 1) << LB)
    elif HB == 2:  # two: 16 elements each, 2 bits at byte i % 4, bit 2 (i % 16 // 4)
        h = tl.load(high_ptr + row * (2 * G) + (2 * g)[None, :, None] + i // 16, mask=keep,
                    other=0).to(tl.uint32, bitcast=True)
        q = q | (((h >> (8 * (i % 4) + 2 * ((i % 16) // 4)).to(tl.uint32)) & 3) << LB)
    if QT == 8:
        qf = (q ^ 0x80).to(tl.float32) - 128.0  # int8 q, read as q + 128
    else:
        qf = q.to(tl.float32) - OFF
    d0, d1, m0, m1 = _scales(p0, p1, p2, r[:, None], g[None, :], K, QT)
    if QT == 10 or QT == 11 or QT == 14:  # a scale a half
        upper = i >= 16
        v = tl.where(upper, d1[:, :, None], d0[:, :, None]) * qf
        if MIN:
            v = v + tl.where(upper, m1[:, :, None], m0[:, :, None])
    else:
        v = d0[:, :, None] * qf
        if MIN:
            v = v + m0[:, :, None]
    return v


@triton.jit
def _dp4a(a, b, c, SIGNED: tl.constexpr, ASM: tl.constexpr):
    """c + the sum of the four byte products of a (uint32: unsigned bytes, or int8 where
    SIGNED) and b (int32: int8 bytes), as int32."""
    if ASM:
        if SIGNED:
            r = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = c
        for i in tl.static_range(4):
            ai = ((a >> (8 * i)) & 0xFF).to(tl.int32)
            if SIGNED:
                ai = ((ai ^ 0x80) - 0x80)
            bi = (((b >> (8 * i)) & 0xFF) ^ 0x80) - 0x80
            r += ai * bi
    return r


@triton.jit
def _high_words(high_ptr, r, g, G, HB: tl.constexpr):
    """The high words of groups g (NG,) of rows r (BN,), each (BN, NG, 1) uint32: the
    group's one or two (the first again where it has one)."""
    keep = (g < G)[None, :]
    base = r.to(tl.int64)[:, None] * (G * HB) + (g * HB)[None, :]
    h0 = tl.load(high_ptr + base, mask=keep, other=0).to(tl.uint32, bitcast=True)[:, :, None]
    h1 = h0
    if HB == 2:
        h1 = tl.load(high_ptr + base + 1, mask=keep, other=0).to(tl.uint32, bitcast=True)[:, :, None]
    return h0, h1


@triton.jit
def _high_quad(h0, h1, t: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr):
    """(BN, NG, LB) uint32: the high bits of quad t of each low word of a group whose high
    words are h0, h1 (_high_words), one field a byte at bit 0."""
    QPW: tl.constexpr = 8 // LB
    j = tl.arange(0, LB)[None, None, :] * QPW + t  # the quad in its group
    if HB == 1:  # one word a group: quad j at bit j
        h = h0 >> j.to(tl.uint32)
    else:  # two: quads 0-3 in the first, 4-7 in the second, 2 bits each
        h = tl.where(j < 4, h0, h1) >> (2 * (j % 4)).to(tl.uint32)
    return h & (0x01010101 * ((1 << HB) - 1))


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
def _quantize_x_kernel(x_ptr, u_ptr, xq_ptr, xs_ptr, K, LDX, LDU, eps, LB: tl.constexpr,
                       ACT: tl.constexpr, BG: tl.constexpr, PDL: tl.constexpr):
    # program (m, j): groups j*BG.. of row m of the activation v (M, K), rounded to int8 per
    # group of 32 (dx = max |v| / 127): xq (M, K/32, 8) int32, four values a word, for a
    # weight type of LB low words a group (QPW = 8 / LB quads each): quad w * QPW + t of a
    # group (elements 4 (w QPW + t) ..) at word t * LB + w, so that the x of quad t of every
    # low word is one run; xs (M, K/32, 4) f32: dx, the sums of the int8 values of each
    # half, 0. v is made here from x (rows LDX apart) and u (rows LDU apart; 0: one row for
    # all), as the op before the product would have made it (ACT, see qmatmul):
    #   PLAIN v = x;  GLU v = silu(x) * u;  NORM v = x * rsqrt(mean(x^2) + eps) * u
    # With PDL the product that reads xq may start now, and waits for this kernel to end
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    m = tl.program_id(0)
    G = K // 32
    g = tl.program_id(1) * BG + tl.arange(0, BG)
    keep = g < G
    e = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    x_row = x_ptr + m.to(tl.int64) * LDX
    u_row = u_ptr + m.to(tl.int64) * LDU
    v = tl.load(x_row + e, mask=keep[:, None], other=0.0).to(tl.float32)
    if ACT == 1:
        v = v * tl.sigmoid(v) * tl.load(u_row + e, mask=keep[:, None], other=0.0).to(tl.float32)
    elif ACT == 2:
        # every program sums its whole row's squares (a row is a few KB, read from L2): no
        # second launch, and the same order, so the same bits, in each
        sq = tl.zeros((BG * 32,), dtype=tl.float32)
        for s in tl.range(0, K, BG * 32):
            at = s + tl.arange(0, BG * 32)
            xs = tl.load(x_row + at, mask=at < K, other=0.0).to(tl.float32)
            sq += xs * xs
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
        v = v * rstd * tl.load(u_row + e, mask=keep[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    t = v * inv[:, None] + MAGIC
    byte = (t.to(tl.int32, bitcast=True) & 0xFF) << (8 * (tl.arange(0, 32) % 4))[None, :]
    words = tl.sum(tl.reshape(byte, (BG, 8, 4)), axis=2)  # disjoint bytes: the sum is their OR
    at = (m.to(tl.int64) * G + g) * 8
    j = tl.arange(0, 8)
    QPW: tl.constexpr = 8 // LB
    tl.store(xq_ptr + at[:, None] + ((j % QPW) * LB + j // QPW)[None, :], words, mask=keep[:, None])
    halves = tl.sum(tl.reshape(t - MAGIC, (BG, 2, 16)), axis=2)  # exact: small integers
    at = (m.to(tl.int64) * G + g) * 4
    tl.store(xs_ptr + at, amax * (1.0 / 127.0), mask=keep)
    tl.store(xs_ptr + at + 1, tl.sum(tl.where(tl.arange(0, 2)[None, :] == 0, halves, 0.0), axis=1), mask=keep)
    tl.store(xs_ptr + at + 2, tl.sum(tl.where(tl.arange(0, 2)[None, :] == 1, halves, 0.0), axis=1), mask=keep)
    tl.store(xs_ptr + at + 3, amax * 0.0, mask=keep)


@triton.jit
def _qgemv_words(low_ptr, high_ptr, r, g, w, G, LB: tl.constexpr, HB: tl.constexpr):
    # groups g (NG,) of rows r (BN,): the low words (BN, NG, LB) uint32 and the high words
    # (_high_words; the low words again for a type without them)
    keep = g < G
    at = r.to(tl.int64)[:, None, None] * (G * LB) + (g * LB)[None, :, None] + w[None, None, :]
    lw = tl.load(low_ptr + at, mask=keep[None, :, None], other=0,
                 eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    h0 = lw
    h1 = lw
    if HB > 0:
        h0, h1 = _high_words(high_ptr, r, g, G, HB)
    return lw, h0, h1


@triton.jit
def _qgemv_kernel(xq_ptr, xs_ptr, L0, H0, A0, B0, C0, L1, H1, A1, B1, C1, L2, H2, A2, B2, C2, y_ptr,
                  r_ptr, N0, N1, N2, T0, T1, K, LDY, LDR, QT: tl.constexpr, LB: tl.constexpr,
                  HB: tl.constexpr, OFF: tl.constexpr, MIN: tl.constexpr, ASM: tl.constexpr,
                  P: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr, ADD: tl.constexpr,
                  PDL: tl.constexpr):
    # program (m, t): row tile t of the P stacked weights (L, H, A, B, C: each one's low,
    # high and scale planes; see _part) times row m of x, given as _quantize_x_kernel's xq
    # and xs, into y[m, its columns] (y's rows LDY apart), NG groups of 32 a step; with ADD,
    # plus r at the same place (r's rows LDR apart: 0 for a bias), as an ADD reading the
    # product would have added it, a.float() + b.float(), after the sum. The M
    # programs of one row tile run side by side, so the tile's bytes come from DRAM once and
    # from L2 after. One launch for q, k and v: an 8B's k and v have 1,024 rows, under one
    # wave of the GPU's multiprocessors alone
    m = tl.program_id(0)
    part, tile, N, col = _part(tl.program_id(1), T0, T1, N0, N1, N2, P)
    low_ptr, high_ptr = _pick(part, L0, L1, L2, P), _pick(part, H0, H1, H2, P)
    p0, p1, p2 = _pick(part, A0, A1, A2, P), _pick(part, B0, B1, B2, P), _pick(part, C0, C1, C2, P)
    # rows past the end re-read the last one (in bounds, no masks on the weight stream)
    r = tl.minimum(tile * BN + tl.arange(0, BN), N - 1)
    G = K // 32
    xq_row = xq_ptr + m.to(tl.int64) * G * 8
    xs_row = xs_ptr + m.to(tl.int64) * G * 4
    QPW: tl.constexpr = 8 // LB  # quads a low word
    w = tl.arange(0, LB)  # a group's low words
    first = (w < LB // 2)[None, None, :]  # ... of its first half (16 elements)
    # partial sums per (row, group), reduced once at the end: no cross-thread traffic in the
    # loop, and a summation order fixed by the shape
    acc = tl.zeros((BN, NG), dtype=tl.float32)
    # the next step's weight words and scales are loaded before this step's products, so
    # that its DRAM reads overlap this step's work (a step was a load, a wait, then work)
    g = tl.arange(0, NG)
    lw, h0, h1 = _qgemv_words(low_ptr, high_ptr, r, g, w, G, LB, HB)
    d0, d1, m0, m1 = _scales(p0, p1, p2, r[:, None], g[None, :], K, QT)
    if PDL:
        # the weights are the session's, written long before: only x (and r) come from the
        # kernels before this one, so the first step's weight loads run while they finish
        gdc_launch_dependents()
        gdc_wait()
    for _ in tl.range(0, G, NG):
        nxt = g + NG
        lw_n, h0_n, h1_n = _qgemv_words(low_ptr, high_ptr, r, nxt, w, G, LB, HB)
        d0_n, d1_n, m0_n, m1_n = _scales(p0, p1, p2, r[:, None], nxt[None, :], K, QT)
        keep = g < G
        dots = tl.zeros((BN, NG, LB), dtype=tl.int32)  # a word's dot product
        for t in tl.static_range(QPW):
            # x's quads for quad t of each low word (quad w * QPW + t of the group): LB in a run
            xw = tl.load(xq_row + g[:, None] * 8 + t * LB + w[None, :], mask=keep[:, None], other=0)
            q = lw >> (LB * t)
            if LB < 8:
                q = q & (0x01010101 * ((1 << LB) - 1))
            if HB > 0:
                q = q | (_high_quad(h0, h1, t, LB, HB) << LB)
            dots = _dp4a(q, xw[None, :, :], dots, QT == 8, ASM)
        dx = tl.load(xs_row + g * 4, mask=keep, other=0.0)[None, :]
        s0 = tl.load(xs_row + g * 4 + 1, mask=keep, other=0.0)[None, :]
        s1 = tl.load(xs_row + g * 4 + 2, mask=keep, other=0.0)[None, :]
        if QT == 10 or QT == 11 or QT == 14:  # a scale a half
            i0 = tl.sum(tl.where(first, dots, 0), axis=2).to(tl.float32)
            i1 = tl.sum(dots, axis=2).to(tl.float32) - i0
            c = d0 * (i0 - OFF * s0) + d1 * (i1 - OFF * s1)
            if MIN:
                c += m0 * s0 + m1 * s1
        else:
            s = s0 + s1
            c = d0 * (tl.sum(dots, axis=2).to(tl.float32) - OFF * s)
            if MIN:
                c += m0 * s
        acc += c * dx
        g = nxt
        lw, h0, h1 = lw_n, h0_n, h1_n
        d0, d1, m0, m1 = d0_n, d1_n, m0_n, m1_n
    rows = tile * BN + tl.arange(0, BN)
    out = tl.sum(acc, axis=1)
    if ADD:
        out += tl.load(r_ptr + m.to(tl.int64) * LDR + col + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * LDY + col + rows, out, mask=rows < N)


@triton.jit
def _byte(w, t: tl.constexpr, ASM: tl.constexpr):
    # 0x4B0000XX, XX = byte t of the uint32 w: the bits of the f32 2**23 + XX, so a quant
    # becomes a float without an int->float convert (a quarter of the f32 rate on Hopper).
    # On a GPU a byte permute (PRMT) a value, the four of a word in one asm block that the
    # calls for t = 0..3 share (it is pure, so it is emitted once)
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
def _slot(lw, hw, hs, s: tl.constexpr, QT: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr,
          OFF: tl.constexpr, ASM: tl.constexpr):
    """q - OFF as f32, exactly, for slot s of the low words lw (uint32): the quant at byte
    s % 4, bit LB (s // 4) of each word (element s of the word's S), with its high bits
    from hw, its group's high word, where the word's own start at bit hs (see _qmm_kernel)."""
    if LB == 8:
        bits = _byte(lw ^ 0x80808080, s, ASM)  # int8 q -> q + 128 as a byte
    else:
        bits = _byte((lw >> (LB * (s // 4))) & (0x01010101 * ((1 << LB) - 1)), s % 4, ASM)
    if HB > 0:
        bits = bits | (((hw >> (hs + (8 * (s % 4) + HB * (s // 4)))) & ((1 << HB) - 1)) << LB)
    f = bits.to(tl.float32, bitcast=True)
    if QT == 8:
        return f - 8388736.0  # 2**23 + 128
    return f - (8388608.0 + OFF)


@triton.jit
def _qmm_kernel(x_ptr, L0, H0, A0, B0, C0, L1, H1, A1, B1, C1, L2, H2, A2, B2, C2, y_ptr,
                M, N0, N1, N2, T0, T1, K, LDY, SPLIT_GROUPS, SPLIT_STRIDE,
                QT: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, OFF: tl.constexpr,
                MIN: tl.constexpr, ASM: tl.constexpr, P: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, NG: tl.constexpr, WT: tl.constexpr):
    # program (i, t, h): rows i*BM.. of x times row tile t of the P stacked weights (as
    # _qgemv_kernel), over groups h*SPLIT_GROUPS.. of K, written SPLIT_STRIDE * h further on
    # (the caller sums the splits). A step loads the tile's (BN, NG, LB) low words, each
    # row's one run, and their scales once, then walks the S = 32 / LB slots of a word as
    # static steps: slot s is a K-slice of the product, the elements g * 32 + w * S + s of
    # word w of group g, dequantized to f16 and multiplied with x's values at those
    # elements on the tensor cores. x is f16 (rounded as the prefill path rounds it) in
    # slot order, (M, S, G, LB): slot s of row m is the run at m * K + s * G * LB.
    # WT: the product is taken as W x.T, (BN, BM), so that the dequantized tile is the
    # dot's first operand, which Hopper's wgmma reads from registers (the second one it
    # reads from shared memory: as x.T that is x's few rows, not the tile's many)
    S: tl.constexpr = 32 // LB
    part, tile, N, col = _part(tl.program_id(1), T0, T1, N0, N1, N2, P)
    low_ptr, high_ptr = _pick(part, L0, L1, L2, P), _pick(part, H0, H1, H2, P)
    p0, p1, p2 = _pick(part, A0, A1, A2, P), _pick(part, B0, B1, B2, P), _pick(part, C0, C1, C2, P)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    xm = x_ptr + tl.minimum(m, M - 1).to(tl.int64)[:, None] * K
    r = tl.minimum(tile * BN + tl.arange(0, BN), N - 1)
    row = r.to(tl.int64)[:, None, None]
    G = K // 32
    w = tl.arange(0, LB)[None, None, :]  # a group's low words
    upper = w >= LB // 2  # ... of its second half (the types that scale per 16)
    if WT:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    first = tl.program_id(2) * SPLIT_GROUPS
    for g0 in tl.range(first, tl.minimum(first + SPLIT_GROUPS, G), NG):
        g = g0 + tl.arange(0, NG)
        keep = (g < G)[None, :, None]
        lw = tl.load(low_ptr + row * (G * LB) + (g * LB)[None, :, None] + w, mask=keep, other=0,
                     eviction_policy="evict_first").to(tl.uint32, bitcast=True)  # (BN, NG, LB)
        hw = lw
        hs = (w * 0).to(tl.uint32)  # where each word's high bits start in hw
        if HB == 1:  # one high word a group, held once (BN, NG, 1): the words shift it
            hw = tl.load(high_ptr + row * G + g[None, :, None], mask=keep, other=0).to(tl.uint32, bitcast=True)
            hs = (w * (S // 4)).to(tl.uint32)
        elif HB == 2:  # two a group, 16 elements each: each word's, shifted to its elements
            at = row * (2 * G) + (2 * g)[None, :, None] + (w * S) // 16
            hw = tl.load(high_ptr + at, mask=keep, other=0).to(tl.uint32, bitcast=True)
            hw = hw >> (2 * ((w * S) % 16 // 4)).to(tl.uint32)
        d0, d1, m0, m1 = _scales(p0, p1, p2, r[:, None], g[None, :], K, QT)
        if QT == 10 or QT == 11 or QT == 14:  # a scale a half
            d = tl.where(upper, d1[:, :, None], d0[:, :, None])
            mn = tl.where(upper, m1[:, :, None], m0[:, :, None])
        else:
            d = d0[:, :, None]
            mn = m0[:, :, None]
        # x's words of this step in a slot's run: one contiguous (BM, NG * LB) block, loaded
        # as such (as (BM, NG, LB) its last dim was too small for Triton's shared layouts
        # of a dot operand: "Illegal shared layout" for 32 or more rows)
        e = g0 * LB + tl.arange(0, NG * LB)
        x_keep = (m < M)[:, None] & (e < G * LB)[None, :]
        for s in tl.static_range(S):
            v = d * _slot(lw, hw, hs, s, QT, LB, HB, OFF, ASM)
            if MIN:
                v = v + mn
            wt = tl.reshape(v.to(tl.float16), (BN, NG * LB))
            x = tl.load(xm + s * (G * LB) + e[None, :], mask=x_keep, other=0.0)
            if WT:
                acc = tl.dot(wt, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(wt), acc)
    rows = tile * BN + tl.arange(0, BN)
    y = y_ptr + tl.program_id(2).to(tl.int64) * SPLIT_STRIDE + col
    if WT:
        tl.store(y + m[None, :] * LDY + rows[:, None], acc, mask=(m < M)[None, :] & (rows < N)[:, None])
    else:
        tl.store(y + m[:, None] * LDY + rows[None, :], acc, mask=(m < M)[:, None] & (rows < N)[None, :])


@triton.jit
def _dequant_kernel(low_ptr, high_ptr, p0, p1, p2, out_ptr, R0, R1, K, QT: tl.constexpr,
                    LB: tl.constexpr, HB: tl.constexpr, OFF: tl.constexpr, MIN: tl.constexpr,
                    BN: tl.constexpr, NG: tl.constexpr):
    # program (i, j): rows R0 + i*BN.., groups j*NG.. of W, written to out (R1 - R0, K)
    # row-major, each value rounded as gguf-py rounds it (launched without FP fusion)
    rows = R0 + tl.program_id(0) * BN + tl.arange(0, BN)
    r = tl.minimum(rows, R1 - 1)
    g = tl.program_id(1) * NG + tl.arange(0, NG)
    v = _group_values(low_ptr, high_ptr, p0, p1, p2, r, g, K, QT, LB, HB, OFF, MIN)
    e = g[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    keep = (rows < R1)[:, None, None] & (e < K)
    tl.store(out_ptr + (rows - R0).to(tl.int64)[:, None, None] * K + e, v.to(out_ptr.dtype.element_ty), mask=keep)
