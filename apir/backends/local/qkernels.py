"""Triton kernels that compute straight from GGUF quantized blocks, as stored in the file.

A weight W (N, K) of a block type is N rows of K / BS blocks of TS bytes, row-major: row r
starts at byte r * (K / BS) * TS. Two kernels read it:

    _qgemv_kernel    y (M, N) f32 = x (M, K) f32 @ W.T   for the few rows of a decode step
    _dequant_kernel  out (N, K) f16/bf16/f32 = W          a tile of rows, for prefill

Both walk the blocks of a (BLOCK_N rows, NB blocks) tile in "sub-chunks": a sub-chunk is a
part of every block of the tile that shares one scale, read as 16- or 32-bit words (blocks
are only 2-byte aligned for the 18/22/34/110/210-byte types) and unpacked in registers to a
(BLOCK_N, NB, A, B) tile of values, with ``e`` (A, B) giving each value's element within its
block. The product then gathers x at those elements (x is small and shared by the BLOCK_N
rows, so it comes from L1) instead of moving the weights into element order.

Unsigned quants become f32 without an int->float convert (16 per clock per SM on Hopper, a
quarter of the weight rate): the f32 with bits 0x4B000000 | q is 2**23 + q exactly, and one
subtraction removes 2**23 and the type's offset together (``_u2f``).

Layouts (all little-endian; x = value of an element, q its quant):
    Q4_0  18 B  d f16 | qs[16]: element j<16 low nibble of qs[j], j>=16 high of qs[j-16];  x = d (q - 8)
    Q4_1  20 B  d | m | qs[16] as Q4_0;                                        x = d q + m
    Q5_0  22 B  d | qh u32 (bit j: 5th bit of element j) | qs[16] as Q4_0;      x = d (q - 16)
    Q5_1  24 B  d | m | qh u32 | qs[16];                                       x = d q + m
    Q8_0  34 B  d | qs[32] int8;                                               x = d q
    Q2_K  84 B  scales[16] (low nibble scale, high min, per 16 elements) | qs[64] | d | dmin
                element 128h + 32s + j: q = bits 2s..2s+1 of qs[32h + j]; x = d sc q - dmin m
    Q3_K 110 B  hmask[32] | qs[64] (as Q2_K) | scales[12] (16 x 6 bit) | d
                element 128h + 32s + j: high bit = bit 4h+s of hmask[j]; x = d (sc - 32) (q - 4)
    Q4_K 144 B  d | dmin | scales[12] (8 x 6-bit scale and min) | qs[128]: sub-block 2k, 2k+1 =
                low, high nibbles of qs[32k : 32k+32];                         x = d sc q - dmin m
    Q5_K 176 B  d | dmin | scales[12] | qh[32] (bit c of qh[j]: 5th bit of element j of
                sub-block c) | qs[128] as Q4_K
    Q6_K 210 B  ql[128] | qh[64] | scales[16] int8 | d: element 128h + 32r + j: low 4 bits =
                nibble r//2 of ql[64h + 32(r%2) + j], high 2 = bits 2r.. of qh[32h + j];
                x = d sc (q - 32), one scale per 16 elements
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# PTX inline assembly (``_byte``) is for NVIDIA GPUs: not under Triton's CPU interpreter,
# not on ROCm, where the same kernels take the plain shift-and-mask route
ASM = os.environ.get("TRITON_INTERPRET") != "1" and torch.version.hip is None

# ggml type id -> (elements per block BS, bytes per block TS, sub-chunks per block NSUB,
# words A and slots per word B of a sub-chunk)
LAYOUTS: dict[int, tuple[int, int, int, int, int]] = {
    2: (32, 18, 1, 8, 4),  # Q4_0
    3: (32, 20, 1, 4, 8),  # Q4_1
    6: (32, 22, 1, 8, 4),  # Q5_0
    7: (32, 24, 1, 4, 8),  # Q5_1
    8: (32, 34, 1, 16, 2),  # Q8_0
    10: (256, 84, 16, 4, 4),  # Q2_K
    11: (256, 110, 16, 8, 2),  # Q3_K
    12: (256, 144, 8, 8, 4),  # Q4_K
    13: (256, 176, 8, 8, 4),  # Q5_K
    14: (256, 210, 16, 8, 2),  # Q6_K
}

# types whose values have a min: d * q + m
MINS = frozenset({3, 7, 10, 12, 13})


@triton.jit
def _byte(w, t: tl.constexpr, ASM: tl.constexpr):
    # 0x4B0000XX, XX = byte t of the uint32 w: the bits of the f32 2**23 + XX. On a GPU a
    # byte permute (PRMT) per value, the four of a word in one asm block that the calls for
    # t = 0..3 share (it is pure, so it is emitted once); shift, mask and OR would cost three
    # integer ops a value, and those bound a 4-bit product (Hopper issues half as many
    # integer as f32 ops a clock)
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
def _val(bits, off: tl.constexpr):
    # 2**23 + q as f32 bits (from _byte, maybe with more bits ORed in) -> q - off, exactly
    return bits.to(tl.float32, bitcast=True) - (8388608.0 + off)


@triton.jit
def _ld(blk, off, ty: tl.constexpr):
    # the ``ty`` field at byte offset ``off`` (broadcast against blk) of every block
    return tl.load((blk + off).to(tl.pointer_type(ty)), eviction_policy="evict_first")


@triton.jit
def _f16(blk, off: tl.constexpr):
    return _ld(blk, off, tl.float16).to(tl.float32)


@triton.jit
def _words(blk, off: tl.constexpr, n: tl.constexpr, ty: tl.constexpr, W: tl.constexpr):
    # n consecutive W-byte words of type ty from byte ``off`` of the (1, BN, NB) blocks
    # ``blk``: (n, BN, NB) uint32
    # The words are adjacent, but at 2- or 4-byte alignment no wider load can take them, and
    # left known, some Triton versions (3.6) lay the threads along them, so that a thread
    # holds one word of many blocks (scales recomputed for each); stated unknown
    # (contiguity 1), every axis ties and the threads run along the blocks
    i = tl.max_contiguous(tl.arange(0, n)[:, None, None] * W + off, [1, 1, 1])
    return _ld(blk, i, ty).to(tl.uint32)


@triton.jit
def _nib32(blk, qs: tl.constexpr, ty: tl.constexpr, W: tl.constexpr, s: tl.constexpr,
           ASM: tl.constexpr):
    # slot s (nibble s % 2 of byte s // 2) of the 16/W words of ty holding the 16 qs bytes of
    # a 32-element type from byte ``qs``: the quants as _byte bits (16/W, BN, NB) and
    # their elements (16/W, 1, 1)
    w = (_words(blk, qs, 16 // W, ty, W) >> (4 * (s % 2))) & 0x0F0F0F0F
    e = tl.arange(0, 16 // W)[:, None, None] * W + s // 2 + 16 * (s % 2)
    return _byte(w, s // 2, ASM), e


@triton.jit
def _q4_0(blk, s: tl.constexpr, ASM: tl.constexpr):
    q, e = _nib32(blk, 2, tl.uint16, 2, s, ASM)
    d = _f16(blk, 0)
    return _val(q, 8), e, d, d


@triton.jit
def _q4_1(blk, s: tl.constexpr, ASM: tl.constexpr):
    q, e = _nib32(blk, 4, tl.uint32, 4, s, ASM)
    return _val(q, 0), e, _f16(blk, 0), _f16(blk, 2)


@triton.jit
def _q5_0(blk, s: tl.constexpr, ASM: tl.constexpr):
    q, e = _nib32(blk, 6, tl.uint16, 2, s, ASM)
    qh = _ld(blk, 2, tl.uint16).to(tl.uint32) | (_ld(blk, 4, tl.uint16).to(tl.uint32) << 16)
    d = _f16(blk, 0)
    return _val(q | (((qh >> e) & 1) << 4), 16), e, d, d


@triton.jit
def _q5_1(blk, s: tl.constexpr, ASM: tl.constexpr):
    q, e = _nib32(blk, 8, tl.uint32, 4, s, ASM)
    q = q | (((_ld(blk, 4, tl.uint32) >> e) & 1) << 4)
    return _val(q, 0), e, _f16(blk, 0), _f16(blk, 2)


@triton.jit
def _q8_0(blk, t: tl.constexpr, ASM: tl.constexpr):
    # byte t of 16 u16 words of two int8 each; q ^ 0x80 is q + 128 as an unsigned byte
    w = _words(blk, 2, 16, tl.uint16, 2) ^ 0x8080
    e = tl.arange(0, 16)[:, None, None] * 2 + t
    d = _f16(blk, 0)
    return _val(_byte(w, t, ASM), 128), e, d, d


@triton.jit
def _k_scale(blk, c: tl.constexpr):
    # Q4_K / Q5_K: d * scale and -dmin * min of sub-block c; the 6-bit scales and mins are
    # in the 12 bytes at 4 (3 u32 words)
    if c < 4:
        sc = (_ld(blk, 4, tl.uint32) >> (8 * c)) & 63
        mn = (_ld(blk, 8, tl.uint32) >> (8 * c)) & 63
    else:
        lo = _ld(blk, 12, tl.uint32) >> (8 * (c - 4))
        sc = (lo & 0xF) | (((_ld(blk, 4, tl.uint32) >> (8 * (c - 4) + 6)) & 3) << 4)
        mn = ((lo >> 4) & 0xF) | (((_ld(blk, 8, tl.uint32) >> (8 * (c - 4) + 6)) & 3) << 4)
    d = _f16(blk, 0) * sc.to(tl.float32)
    m = -(_f16(blk, 2) * mn.to(tl.float32))
    return d, m


@triton.jit
def _q4_k(blk, c: tl.constexpr, t: tl.constexpr, ASM: tl.constexpr):
    # sub-block c = nibble c % 2 of qs[32 (c // 2) + j]: 8 u32 words x 4 bytes
    w = (_words(blk, 16 + 32 * (c // 2), 8, tl.uint32, 4) >> (4 * (c % 2))) & 0x0F0F0F0F
    e = 32 * c + tl.arange(0, 8)[:, None, None] * 4 + t
    d, m = _k_scale(blk, c)
    return _val(_byte(w, t, ASM), 0), e, d, m


@triton.jit
def _q5_k(blk, c: tl.constexpr, t: tl.constexpr, ASM: tl.constexpr):
    w = (_words(blk, 48 + 32 * (c // 2), 8, tl.uint32, 4) >> (4 * (c % 2))) & 0x0F0F0F0F
    h = (_words(blk, 16, 8, tl.uint32, 4) >> c) & 0x01010101
    e = 32 * c + tl.arange(0, 8)[:, None, None] * 4 + t
    d, m = _k_scale(blk, c)
    return _val(_byte(w | (h << 4), t, ASM), 0), e, d, m


@triton.jit
def _q6_k(blk, c: tl.constexpr, t: tl.constexpr, ASM: tl.constexpr):
    # c = 8h + 2r + g: elements 128h + 32r + 16g + (0..15), one int8 scale (number c)
    h: tl.constexpr = c // 8
    r: tl.constexpr = (c // 2) % 4
    g: tl.constexpr = c % 2
    lo = _words(blk, 64 * h + 32 * (r % 2) + 16 * g, 8, tl.uint16, 2)
    hi = _words(blk, 128 + 32 * h + 16 * g, 8, tl.uint16, 2)
    w = ((lo >> (4 * (r // 2))) & 0x0F0F) | (((hi >> (2 * r)) & 0x0303) << 4)
    e = 16 * c + tl.arange(0, 8)[:, None, None] * 2 + t
    d = _f16(blk, 208) * _ld(blk, 192 + c, tl.int8).to(tl.float32)
    return _val(_byte(w, t, ASM), 32), e, d, d


@triton.jit
def _q2_k(blk, c: tl.constexpr, t: tl.constexpr, ASM: tl.constexpr):
    # c = 8h + 2s + g: elements 128h + 32s + 16g + (0..15) are bits 2s.. of qs[32h + 16g + j]
    # (qs from byte 16), with scale byte c
    qs: tl.constexpr = 16 + 32 * (c // 8) + 16 * (c % 2)
    w = (_words(blk, qs, 4, tl.uint32, 4) >> (2 * ((c // 2) % 4))) & 0x03030303
    e = 16 * c + tl.arange(0, 4)[:, None, None] * 4 + t
    sc = _ld(blk, c, tl.uint8).to(tl.uint32)
    d = _f16(blk, 80) * (sc & 0xF).to(tl.float32)
    m = -(_f16(blk, 82) * (sc >> 4).to(tl.float32))
    return _val(_byte(w, t, ASM), 0), e, d, m


@triton.jit
def _q3_k(blk, c: tl.constexpr, t: tl.constexpr, ASM: tl.constexpr):
    # c = 8h + 2s + g as Q2_K (qs from byte 32); the high bit = bit 4h + s = c // 2 of
    # hmask[16g + j]; scale c: low 4 bits = nibble c // 8 of scales[c % 8], high 2 = bits
    # 2 (c // 4).. of scales[8 + c % 4]
    qs: tl.constexpr = 32 + 32 * (c // 8) + 16 * (c % 2)
    w = (_words(blk, qs, 8, tl.uint16, 2) >> (2 * ((c // 2) % 4))) & 0x0303
    hm = (_words(blk, 16 * (c % 2), 8, tl.uint16, 2) >> (c // 2)) & 0x0101
    e = 16 * c + tl.arange(0, 8)[:, None, None] * 2 + t
    lo = (_ld(blk, 96 + c % 8, tl.uint8).to(tl.int32) >> (4 * (c // 8))) & 0xF
    hi = (_ld(blk, 104 + c % 4, tl.uint8).to(tl.int32) >> (2 * (c // 4))) & 3
    d = _f16(blk, 108) * ((lo | (hi << 4)) - 32).to(tl.float32)
    return _val(_byte(w | (hm << 2), t, ASM), 4), e, d, d


@triton.jit
def _sub(QT: tl.constexpr, blk, c: tl.constexpr, s: tl.constexpr, ASM: tl.constexpr):
    """Slot s of sub-chunk c of the (1, BN, NB) blocks at byte pointers ``blk``: quants q
    (A, BN, NB) f32 (the type's offset taken off), their elements within the block (A, 1, 1),
    and the scale d and min m (1, BN, NB) of the sub-chunk: the values are d * q + m
    (m is meaningless for types without a min: MIN is False)."""
    if QT == 2:
        q, e, d, m = _q4_0(blk, s, ASM)
    elif QT == 3:
        q, e, d, m = _q4_1(blk, s, ASM)
    elif QT == 6:
        q, e, d, m = _q5_0(blk, s, ASM)
    elif QT == 7:
        q, e, d, m = _q5_1(blk, s, ASM)
    elif QT == 8:
        q, e, d, m = _q8_0(blk, s, ASM)
    elif QT == 10:
        q, e, d, m = _q2_k(blk, c, s, ASM)
    elif QT == 11:
        q, e, d, m = _q3_k(blk, c, s, ASM)
    elif QT == 12:
        q, e, d, m = _q4_k(blk, c, s, ASM)
    elif QT == 13:
        q, e, d, m = _q5_k(blk, c, s, ASM)
    else:
        q, e, d, m = _q6_k(blk, c, s, ASM)
    return q, e, d, m


@triton.jit
def _qgemv_kernel(x_ptr, w_ptr, y_ptr, N, K, LDY, QT: tl.constexpr, BS: tl.constexpr,
                  TS: tl.constexpr, NSUB: tl.constexpr, A: tl.constexpr, B: tl.constexpr,
                  MIN: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                  NB: tl.constexpr, XROWS: tl.constexpr):
    # program (m, i): y[m, i*BLOCK_N : (i+1)*BLOCK_N] (y's rows LDY apart); the M programs of one row tile run
    # side by side, so the tile's bytes come from DRAM once and from L2 after.
    # Tiles are (A words, BLOCK_N rows, NB blocks): threads run along blocks, then rows, so a
    # thread holds all the words of its blocks and computes each scale once. Where rows
    # spread over threads too (XROWS), x is read as an (A, BLOCK_N, NB) tile, so that it
    # lands in the threads that use it rather than going through shared memory each time
    m = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nblk = K // BS
    # rows and blocks past the end re-read the last one (in bounds, no masks on the weight
    # stream); their x is 0 and their rows are not stored
    row_ptr = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * (nblk * TS)
    x_row = x_ptr + m * K
    # partial sums per position of the tile, reduced once at the end: no cross-thread
    # traffic in the loop, and a summation order fixed by the shape
    acc = tl.zeros((A, BLOCK_N, NB), dtype=tl.float32)
    for b0 in tl.range(0, nblk, NB):
        b = b0 + tl.arange(0, NB)
        blk = (row_ptr[:, None] + tl.minimum(b, nblk - 1)[None, :] * TS)[None, :, :]
        for c in tl.static_range(NSUB):
            # sum over a sub-chunk's slots of q x (and of x, for the min), then one scaling:
            # sum (d q + m) x = d sum q x + m sum x
            qx = tl.zeros((A, BLOCK_N, NB), dtype=tl.float32)
            xs = tl.zeros((A, BLOCK_N if XROWS else 1, NB), dtype=tl.float32)
            for s in tl.static_range(B):
                q, e, d, mn = _sub(QT, blk, c, s, ASM)
                xi = b[None, None, :] * BS + e
                if XROWS:
                    xi += tl.zeros((1, BLOCK_N, 1), dtype=tl.int32)
                x = tl.load(x_row + xi, mask=(b < nblk)[None, None, :], other=0.0)
                qx += q * x
                if MIN:
                    xs += x
            if MIN:
                acc += d * qx + mn * xs
            else:
                acc += d * qx
    y = tl.sum(tl.sum(acc, axis=0), axis=1)  # in-thread first
    tl.store(y_ptr + m * LDY + rows, y, mask=rows < N)


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, N, K, QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr,
                    NSUB: tl.constexpr, A: tl.constexpr, B: tl.constexpr, MIN: tl.constexpr,
                    ASM: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    # program (i, j): rows i*BLOCK_N.., blocks j*NB.. of W, written to out (N, K) row-major,
    # each value rounded as gguf-py rounds it (d * q, then + m; built without FP fusion)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1) * NB + tl.arange(0, NB)
    nblk = K // BS
    blk = (w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * (nblk * TS)
           + tl.minimum(b, nblk - 1)[None, :] * TS)[None, :, :]
    keep = (rows < N)[None, :, None] & (b < nblk)[None, None, :]
    for c in tl.static_range(NSUB):
        for s in tl.static_range(B):
            q, e, d, mn = _sub(QT, blk, c, s, ASM)
            v = d * q + mn if MIN else d * q
            out = out_ptr + rows.to(tl.int64)[None, :, None] * K + b[None, None, :] * BS + e
            tl.store(out, v.to(out_ptr.dtype.element_ty), mask=keep)
