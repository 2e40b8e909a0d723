"""GGUF block weights repacked for the GPU kernels: the same bits, moved so that a thread's
loads are 16-byte runs and a group of 32 elements is one thread's, in words that a byte-wise
integer dot product (dp4a) reads four elements at a time (see qkernels). ``pack`` and
``unpack`` are exact inverses, and the packed form takes exactly the bytes of the blocks, so
a weight is packed in place.

A weight W (N, K) of a block type becomes planes, one after another, each row-major over
the N rows:

    low   u32 words of the low LB bits of every element    (N, K * LB / 32) words
    high  u32 words of the extra HB bits (Q5_*, Q3_K: 1;  (N, K * HB / 32) words
          Q6_K: 2)
    scale planes, per type                                 f16 per 32 (the 32-element types),
                                                           or the block's header bytes

A plane of B bits an element holds 32 / B consecutive elements a word: element i of a word
sits in byte i % 4, at bit B * (i // 4) of it. So ``(word >> B * t) & (0x01010101 * (2**B -
1))`` is elements 4t .. 4t + 3 of the word, one a byte: four quants that a dp4a multiplies
with four int8 x values in one instruction, and a group of 32 elements is LB consecutive low
words (16 bytes for the 4-bit types, one vector load) and HB high words.

Scale planes: Q4_0, Q5_0, Q8_0: d (N, K/32) f16; Q4_1, Q5_1: d then m; Q2_K: the 16 scale
bytes (N, K/16), then d, dmin (N, K/256) f16; Q3_K: the 12 packed scale bytes (N, K/256, 12),
then d; Q4_K, Q5_K: the 16 header bytes d | dmin | scales[12] (N, K/256, 16); Q6_K: the 16
int8 scales (N, K/16), then d (N, K/256) f16.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

# (LB low bits, HB high bits, elements of a block) of each ggml block type
_BITS: dict[int, tuple[int, int, int]] = {
    2: (4, 0, 32), 3: (4, 0, 32), 6: (4, 1, 32), 7: (4, 1, 32), 8: (8, 0, 32),
    10: (2, 0, 256), 11: (2, 1, 256), 12: (4, 0, 256), 13: (4, 1, 256), 14: (4, 2, 256),
}
TYPES = frozenset(_BITS)


@dataclass(frozen=True)
class Geometry:
    """Where the planes of a packed (n, k) weight of ``qtype`` lie, in bytes."""

    qtype: int
    n: int
    k: int
    lb: int  # low bits per element
    hb: int  # high bits per element
    planes: tuple[tuple[int, int], ...]  # (offset, bytes per row) of low, [high], scales...

    @property
    def groups(self) -> int:
        """Groups of 32 elements a row."""
        return self.k // 32

    @property
    def nbytes(self) -> int:
        off, per_row = self.planes[-1]
        return off + per_row * self.n


def block_size(qtype: int) -> int:
    """Elements per GGUF block of ``qtype``."""
    return _BITS[qtype][2]


def low_bits(qtype: int) -> int:
    """LB, the bits an element of ``qtype`` has in the low plane."""
    return _BITS[qtype][0]


@cache
def geometry(qtype: int, n: int, k: int) -> Geometry:
    lb, hb, bs = _BITS[qtype]
    if k % bs or n <= 0:
        raise ValueError(f"a packed {qtype} weight needs K a multiple of {bs}, got ({n}, {k})")
    rows = [k * lb // 8]  # low
    if hb:
        rows.append(k * hb // 8)
    if bs == 32:
        rows += [k // 32 * 2] * (2 if qtype in (3, 7) else 1)
    elif qtype == 10:
        rows += [k // 16, k // 256 * 2, k // 256 * 2]
    elif qtype == 11:
        rows += [k // 256 * 12, k // 256 * 2]
    elif qtype in (12, 13):
        rows += [k // 256 * 16]
    else:  # Q6_K
        rows += [k // 16, k // 256 * 2]
    planes, off = [], 0
    for per_row in rows:
        planes.append((off, per_row))
        off += per_row * n
    return Geometry(qtype, n, k, lb, hb, tuple(planes))


def fields(blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """File blocks (nblk, TS) uint8 -> (low (nblk, BS), high (nblk, BS) or None, scale
    fields [(nblk, bytes)]), the quants in element order, as the block stores them."""
    def nib(qs):  # (b, 16) -> (b, 32): low nibbles then high
        return torch.cat([qs & 15, qs >> 4], dim=-1)

    def bits32(qh):  # (b, 4) bytes of a u32 -> (b, 32): bit j = element j
        return ((qh.unsqueeze(-1) >> torch.arange(8, device=qh.device, dtype=torch.uint8)) & 1).reshape(-1, 32)

    b = blocks
    if qtype == 2:
        return nib(b[:, 2:18]), None, [b[:, 0:2]]
    if qtype == 3:
        return nib(b[:, 4:20]), None, [b[:, 0:2], b[:, 2:4]]
    if qtype == 6:
        return nib(b[:, 6:22]), bits32(b[:, 2:6]), [b[:, 0:2]]
    if qtype == 7:
        return nib(b[:, 8:24]), bits32(b[:, 4:8]), [b[:, 0:2], b[:, 2:4]]
    if qtype == 8:
        return b[:, 2:34], None, [b[:, 0:2]]
    n = b.shape[0]
    sh2 = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
    if qtype in (10, 11):
        # element 128h + 32s + j: bits 2s.. of qs[32h + j]
        qs = b[:, 16:80] if qtype == 10 else b[:, 32:96]
        low = ((qs.reshape(n, 2, 1, 32) >> sh2) & 3).reshape(n, 256)
        if qtype == 10:
            return low, None, [b[:, 0:16], b[:, 80:82], b[:, 82:84]]
        # high bit of element 128h + 32s + j: bit 4h + s of hmask[j]
        hm = (b[:, 0:32].reshape(n, 1, 1, 32) >> torch.arange(8, device=b.device, dtype=torch.uint8)
              .view(1, 2, 4, 1)) & 1
        return low, hm.reshape(n, 256), [b[:, 96:108], b[:, 108:110]]
    if qtype in (12, 13):
        qs = b[:, 16:144] if qtype == 12 else b[:, 48:176]
        low = nib(qs.reshape(n * 4, 32)).reshape(n, 256)  # sub-blocks 2k, 2k+1 of qs[32k:]
        if qtype == 12:
            return low, None, [b[:, 0:16]]
        # 5th bit of element 32c + j: bit c of qh[j]
        hi = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 8, 1)) & 1
        return low, hi.reshape(n, 256), [b[:, 0:16]]
    # Q6_K: element 128h + 32r + j: low 4 = nibble r // 2 of ql[64h + 32(r % 2) + j], high 2 =
    # bits 2r.. of qh[32h + j]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)
    low = torch.stack([ql[:, :, 0] & 15, ql[:, :, 1] & 15, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> sh2) & 3
    return low.reshape(n, 256), high.reshape(n, 256), [b[:, 192:208], b[:, 208:210]]


def _shift(bits: int, i: int) -> int:
    """The bit of its word that element i of a word sits at, in a plane of ``bits`` bits."""
    return 8 * (i % 4) + bits * (i // 4)


# elements packed or unpacked at a time: the temporaries (an int64 per element while
# packing, a byte per bit while unpacking) stay a few hundred MiB for any weight
STEP_ELEMENTS = 16 << 20


def _steps(n: int, k: int) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) of at most STEP_ELEMENTS elements (one row at least)."""
    step = max(1, STEP_ELEMENTS // k)
    return [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]


def pack(raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """The GGUF bytes of W (n, k) (1-D uint8) -> its packed form, a new 1-D uint8 tensor of
    the same size on the same device."""
    g = geometry(qtype, n, k)
    out = torch.empty_like(raw)
    row_bytes = raw.numel() // n
    for r0, r1 in _steps(n, k):
        for (off, per), part in zip(g.planes, _pack_rows(raw[r0 * row_bytes : r1 * row_bytes], qtype, r1 - r0, k)):
            out[off + r0 * per : off + r1 * per] = part
    return out


def _pack_rows(raw: torch.Tensor, qtype: int, n: int, k: int) -> list[torch.Tensor]:
    """The planes of the packed (n, k) weight whose GGUF bytes are ``raw``, each 1-D."""
    lb, hb, bs = _BITS[qtype]
    low, high, scales = fields(raw.reshape(n * k // bs, -1), qtype)
    planes = [_words(low.reshape(n, k), lb)]
    if hb:
        planes.append(_words(high.reshape(n, k), hb))
    # scale fields: (blocks, bytes) in row-major block order, so (n, blocks a row * bytes)
    planes += [field.reshape(-1) for field in scales]
    return planes


def _words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(n, k) values of ``bits`` bits -> the plane's little-endian u32 words as bytes, 1-D:
    32 / bits consecutive elements a word, element i at ``_shift(bits, i)``."""
    per = 32 // bits
    v = values.reshape(values.shape[0], -1, per).to(torch.int64)
    words = torch.zeros(v.shape[:2], dtype=torch.int64, device=values.device)
    for i in range(per):
        words |= v[:, :, i] << _shift(bits, i)
    return words.to(torch.int32).contiguous().view(torch.uint8).reshape(-1)  # bit 31 wraps: the same bytes


def rows_of(packed: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """A packed (n, k) weight as (n, row bytes): each row's bytes of every plane, in plane
    order."""
    g = geometry(qtype, n, k)
    return torch.cat([packed[off : off + per * n].reshape(n, per) for off, per in g.planes], dim=1)


def gather_rows(packed: torch.Tensor, qtype: int, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (1-D) of a packed (n, k) weight as a packed (len(ids), k) weight: only
    those rows' bytes are read."""
    g = geometry(qtype, n, k)
    return torch.cat([packed[off : off + per * n].view(n, per)[ids].reshape(-1) for off, per in g.planes])


@cache
def _inverse(qtype: int, device: str) -> torch.Tensor:
    """For a (1, k0) weight of one block: the bit of ``rows_of(pack(...))`` that each of its
    GGUF bits comes from, found by packing one-hot rows (pack moves bits, one to one)."""
    k0 = block_size(qtype)
    g = geometry(qtype, 1, k0)
    nbits = g.nbytes * 8
    idx = torch.arange(nbits)
    eye = torch.zeros((nbits, g.nbytes), dtype=torch.uint8)
    eye[idx, idx // 8] = (1 << (idx % 8)).to(torch.uint8)
    packed = rows_of(pack(eye.reshape(-1), qtype, nbits, k0), qtype, nbits, k0)
    bits = ((packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(nbits, nbits)
    assert bool((bits.sum(dim=1) == 1).all())
    return bits.argmax(dim=1).to(device)


def unpack(packed: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """``pack``'s inverse: the GGUF bytes of W (n, k), 1-D uint8, a new tensor."""
    g = geometry(qtype, n, k)
    out = torch.empty_like(packed)
    row_bytes = packed.numel() // n
    for r0, r1 in _steps(n, k):
        rows = torch.cat([packed[off + r0 * per : off + r1 * per].reshape(r1 - r0, per)
                          for off, per in g.planes], dim=1)
        out[r0 * row_bytes : r1 * row_bytes] = _unpack_rows(rows, qtype, k)
    return out


def _unpack_rows(rows: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """(r, row bytes) of a packed weight, each row's planes in order -> its GGUF bytes."""
    g = geometry(qtype, rows.shape[0], k)
    nb = k // block_size(qtype)
    r = rows.shape[0]
    # every plane's row is its blocks' pieces, one after another
    per_block = [part.reshape(r * nb, -1) for part in rows.split([per for _, per in g.planes], dim=1)]
    blocks = torch.cat(per_block, dim=1)  # (r * blocks, packed bytes of a (1, k0) weight)
    src = _inverse(qtype, str(rows.device))
    shifts = torch.arange(8, dtype=torch.uint8, device=rows.device)
    bits = ((blocks.unsqueeze(-1) >> shifts) & 1).reshape(r * nb, -1)[:, src]
    weights = (1 << torch.arange(8, dtype=torch.int32, device=rows.device))
    return (bits.reshape(r * nb, -1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8).reshape(-1)
