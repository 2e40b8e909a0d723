"""Triton kernels that compute straight from GGUF quantized blocks, as stored in the file.

A weight W (N, K) of a block type is N rows of K / BS blocks of TS bytes, row-major: row r
starts at byte r * (K / BS) * TS. Two kernels read it:

    _qgemv_kernel    y (M, N) f32 = x (M, K) f32 @ W.T   for the few rows of a decode step
    _dequant_kernel  out (N, K) f16/bf16/f32 = W          a tile of rows, for prefill

Both walk the blocks of a (BLOCK_N rows, NB blocks) tile in "sub-chunks": a sub-chunk is a
part of every block that shares one scale, A words of 16 or 32 bits (blocks are only 2-byte
aligned for the 18/22/34/110/210-byte types) of B values each, taken word by word and slot
by slot as static steps, each giving a (BLOCK_N, NB) tile of values and the element E of the
block they are. The product then reads x at those elements (x is small and read by every
row tile, so it comes from L1 or L2) instead of moving the weights into element order.

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
def _word(blk, off: tl.constexpr, ty: tl.constexpr):
    # the ty word at byte ``off`` of every block: (BN, NB) uint32
    return _ld(blk, off, ty).to(tl.uint32)


@triton.jit
def _nib32(blk, qs: tl.constexpr, ty: tl.constexpr, W: tl.constexpr, a: tl.constexpr,
           s: tl.constexpr, ASM: tl.constexpr):
    # slot s (nibble s % 2 of byte s // 2) of word a (W bytes of type ty) of the 16 qs bytes
    # of a 32-element type from byte ``qs``: the quant as _byte bits and its element
    w = (_word(blk, qs + W * a, ty) >> (4 * (s % 2))) & 0x0F0F0F0F
    E: tl.constexpr = W * a + s // 2 + 16 * (s % 2)
    return _byte(w, s // 2, ASM), E


@triton.jit
def _q4_0(blk, a: tl.constexpr, s: tl.constexpr, ASM: tl.constexpr):
    q, E = _nib32(blk, 2, tl.uint16, 2, a, s, ASM)
    d = _f16(blk, 0)
    return _val(q, 8), E, d, d


@triton.jit
def _q4_1(blk, a: tl.constexpr, s: tl.constexpr, ASM: tl.constexpr):
    q, E = _nib32(blk, 4, tl.uint32, 4, a, s, ASM)
    return _val(q, 0), E, _f16(blk, 0), _f16(blk, 2)


@triton.jit
def _q5_0(blk, a: tl.constexpr, s: tl.constexpr, ASM: tl.constexpr):
    q, E = _nib32(blk, 6, tl.uint16, 2, a, s, ASM)
    # the 5th bit of element E: bit E of the u32 at byte 2 (two u16 halves)
    qh = _word(blk, 2 + 2 * (E // 16), tl.uint16)
    d = _f16(blk, 0)
    return _val(q | (((qh >> (E % 16)) & 1) << 4), 16), E, d, d


@triton.jit
def _q5_1(blk, a: tl.constexpr, s: tl.constexpr, ASM: tl.constexpr):
    q, E = _nib32(blk, 8, tl.uint32, 4, a, s, ASM)
    q = q | (((_word(blk, 4, tl.uint32) >> E) & 1) << 4)
    return _val(q, 0), E, _f16(blk, 0), _f16(blk, 2)


@triton.jit
def _q8_0(blk, a: tl.constexpr, t: tl.constexpr, ASM: tl.constexpr):
    # byte t of u16 word a of two int8; q ^ 0x80 is q + 128 as an unsigned byte
    w = _word(blk, 2 + 2 * a, tl.uint16) ^ 0x8080
    d = _f16(blk, 0)
    return _val(_byte(w, t, ASM), 128), 2 * a + t, d, d


@triton.jit
def _k_scale(blk, c: tl.constexpr):
    # Q4_K / Q5_K: d * scale and -dmin * min of sub-block c; the 6-bit scales and mins are
    # in the 12 bytes at 4 (3 u32 words)
    if c < 4:
        sc = (_word(blk, 4, tl.uint32) >> (8 * c)) & 63
        mn = (_word(blk, 8, tl.uint32) >> (8 * c)) & 63
    else:
        lo = _word(blk, 12, tl.uint32) >> (8 * (c - 4))
        sc = (lo & 0xF) | (((_word(blk, 4, tl.uint32) >> (8 * (c - 4) + 6)) & 3) << 4)
        mn = ((lo >> 4) & 0xF) | (((_word(blk, 8, tl.uint32) >> (8 * (c - 4) + 6)) & 3) << 4)
    d = _f16(blk, 0) * sc.to(tl.float32)
    m = -(_f16(blk, 2) * mn.to(tl.float32))
    return d, m


@triton.jit
def _q4_k(blk, c: tl.constexpr, a: tl.constexpr, t: tl.constexpr, ASM: tl.constexpr):
    # sub-block c = nibble c % 2 of qs[32 (c // 2) + j]: 8 u32 words x 4 bytes
    w = (_word(blk, 16 + 32 * (c // 2) + 4 * a, tl.uint32) >> (4 * (c % 2))) & 0x0F0F0F0F
    d, m = _k_scale(blk, c)
    return _val(_byte(w, t, ASM), 0), 32 * c + 4 * a + t, d, m


@triton.jit
def _q5_k(blk, c: tl.constexpr, a: tl.constexpr, t: tl.constexpr, ASM: tl.constexpr):
    w = (_word(blk, 48 + 32 * (c // 2) + 4 * a, tl.uint32) >> (4 * (c % 2))) & 0x0F0F0F0F
    h = (_word(blk, 16 + 4 * a, tl.uint32) >> c) & 0x01010101
    d, m = _k_scale(blk, c)
    return _val(_byte(w | (h << 4), t, ASM), 0), 32 * c + 4 * a + t, d, m


@triton.jit
def _q6_k(blk, c: tl.constexpr, a: tl.constexpr, t: tl.constexpr, ASM: tl.constexpr):
    # c = 8h + 2r + g: elements 128h + 32r + 16g + (0..15), one int8 scale (number c)
    h: tl.constexpr = c // 8
    r: tl.constexpr = (c // 2) % 4
    g: tl.constexpr = c % 2
    lo = _word(blk, 64 * h + 32 * (r % 2) + 16 * g + 2 * a, tl.uint16)
    hi = _word(blk, 128 + 32 * h + 16 * g + 2 * a, tl.uint16)
    w = ((lo >> (4 * (r // 2))) & 0x0F0F) | (((hi >> (2 * r)) & 0x0303) << 4)
    d = _f16(blk, 208) * _ld(blk, 192 + c, tl.int8).to(tl.float32)
    return _val(_byte(w, t, ASM), 32), 16 * c + 2 * a + t, d, d


@triton.jit
def _q2_k(blk, c: tl.constexpr, a: tl.constexpr, t: tl.constexpr, ASM: tl.constexpr):
    # c = 8h + 2s + g: elements 128h + 32s + 16g + (0..15) are bits 2s.. of qs[32h + 16g + j]
    # (qs from byte 16), with scale byte c
    qs: tl.constexpr = 16 + 32 * (c // 8) + 16 * (c % 2)
    w = (_word(blk, qs + 4 * a, tl.uint32) >> (2 * ((c // 2) % 4))) & 0x03030303
    sc = _ld(blk, c, tl.uint8).to(tl.uint32)
    d = _f16(blk, 80) * (sc & 0xF).to(tl.float32)
    m = -(_f16(blk, 82) * (sc >> 4).to(tl.float32))
    return _val(_byte(w, t, ASM), 0), 16 * c + 4 * a + t, d, m


@triton.jit
def _q3_k(blk, c: tl.constexpr, a: tl.constexpr, t: tl.constexpr, ASM: tl.constexpr):
    # c = 8h + 2s + g as Q2_K (qs from byte 32); the high bit = bit 4h + s = c // 2 of
    # hmask[16g + j]; scale c: low 4 bits = nibble c // 8 of scales[c % 8], high 2 = bits
    # 2 (c // 4).. of scales[8 + c % 4]
    qs: tl.constexpr = 32 + 32 * (c // 8) + 16 * (c % 2)
    w = (_word(blk, qs + 2 * a, tl.uint16) >> (2 * ((c // 2) % 4))) & 0x0303
    hm = (_word(blk, 16 * (c % 2) + 2 * a, tl.uint16) >> (c // 2)) & 0x0101
    lo = (_ld(blk, 96 + c % 8, tl.uint8).to(tl.int32) >> (4 * (c // 8))) & 0xF
    hi = (_ld(blk, 104 + c % 4, tl.uint8).to(tl.int32) >> (2 * (c // 4))) & 3
    d = _f16(blk, 108) * ((lo | (hi << 4)) - 32).to(tl.float32)
    return _val(_byte(w | (hm << 2), t, ASM), 4), 16 * c + 2 * a + t, d, d


@triton.jit
def _sub(QT: tl.constexpr, blk, c: tl.constexpr, a: tl.constexpr, s: tl.constexpr,
         ASM: tl.constexpr):
    """Slot s of word a of sub-chunk c of the (BN, NB) blocks at byte pointers ``blk``: the
    quants q (BN, NB) f32 (the type's offset taken off), their element E within the block
    (a constexpr), and the scale d and min m (BN, NB) of the sub-chunk: the values are
    d * q + m (m is meaningless for types without a min: MIN is False)."""
    if QT == 2:
        q, E, d, m = _q4_0(blk, a, s, ASM)
    elif QT == 3:
        q, E, d, m = _q4_1(blk, a, s, ASM)
    elif QT == 6:
        q, E, d, m = _q5_0(blk, a, s, ASM)
    elif QT == 7:
        q, E, d, m = _q5_1(blk, a, s, ASM)
    elif QT == 8:
        q, E, d, m = _q8_0(blk, a, s, ASM)
    elif QT == 10:
        q, E, d, m = _q2_k(blk, c, a, s, ASM)
    elif QT == 11:
        q, E, d, m = _q3_k(blk, c, a, s, ASM)
    elif QT == 12:
        q, E, d, m = _q4_k(blk, c, a, s, ASM)
    elif QT == 13:
        q, E, d, m = _q5_k(blk, c, a, s, ASM)
    else:
        q, E, d, m = _q6_k(blk, c, a, s, ASM)
    return q, E, d, m


@triton.jit
def _qgemv_kernel(x_ptr, w_ptr, y_ptr, N, K, LDY, QT: tl.constexpr, BS: tl.constexpr,
                  TS: tl.constexpr, NSUB: tl.constexpr, A: tl.constexpr, B: tl.constexpr,
                  MIN: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                  NB: tl.constexpr):
    # program (m, i): y[m, i*BLOCK_N : (i+1)*BLOCK_N] (y's rows LDY apart); the M programs
    # of one row tile run side by side, so the tile's bytes come from DRAM once and from L2
    # after. Every tensor is (BLOCK_N rows, NB blocks), words and slots being static steps:
    # whichever way a Triton version lays the threads out, a thread holds whole blocks (all
    # their words) and computes each scale once, and x is read in the same layout
    m = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nblk = K // BS
    # rows and blocks past the end re-read the last one (in bounds, no masks on the weight
    # stream); their x is 0 and their rows are not stored
    row_ptr = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * (nblk * TS)
    x_row = x_ptr + m * K
    # partial sums per (row, block) position, reduced once at the end: no cross-thread
    # traffic in the loop, and a summation order fixed by the shape
    acc = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
    for b0 in tl.range(0, nblk, NB):
        b = b0 + tl.arange(0, NB)
        blk = row_ptr[:, None] + tl.minimum(b, nblk - 1)[None, :] * TS
        xb = x_row + b[None, :] * BS + tl.zeros((BLOCK_N, 1), dtype=tl.int32)
        for c in tl.static_range(NSUB):
            # sum over a sub-chunk's values of q x (and of x, for the min), then one
            # scaling: sum (d q + m) x = d sum q x + m sum x
            qx = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            xs = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            for a in tl.static_range(A):
                for s in tl.static_range(B):
                    q, E, d, mn = _sub(QT, blk, c, a, s, ASM)
                    x = tl.load(xb + E, mask=(b < nblk)[None, :], other=0.0)
                    qx += q * x
                    if MIN:
                        xs += x
            if MIN:
                acc += d * qx + mn * xs
            else:
                acc += d * qx
    tl.store(y_ptr + m * LDY + rows, tl.sum(acc, axis=1), mask=rows < N)


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
           + tl.minimum(b, nblk - 1)[None, :] * TS)
    out = out_ptr + rows.to(tl.int64)[:, None] * K + b[None, :] * BS
    keep = (rows < N)[:, None] & (b < nblk)[None, :]
    for c in tl.static_range(NSUB):
        for a in tl.static_range(A):
            for s in tl.static_range(B):
                q, E, d, mn = _sub(QT, blk, c, a, s, ASM)
                v = d * q + mn if MIN else d * q
                tl.store(out + E, v.to(out_ptr.dtype.element_ty), mask=keep)
