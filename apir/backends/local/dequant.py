"""Dequantize GGUF tensor bytes to float32 with torch ops only.

Bit-exact with ``gguf.quants.dequantize``: every f16 scale is widened to f32 first and the
products and sums are evaluated in the same order as gguf-py, one rounding per op, so the
result matches to the last bit on any device (checked on cpu and cuda). F16/BF16 NaN
payloads are kept as numpy keeps them; only a NaN *scale* gives a NaN whose payload may
depend on the device. All blocks of a tensor are decoded at once, with no Python loops.

A row of ``n`` elements is ``n // block_size`` consecutive blocks, so a row-major tensor is
simply a flat run of blocks: each decoder below takes ``(n_blocks, type_size)`` uint8 and
returns ``(n_blocks, block_size)`` float32. Multi-byte fields are little-endian.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from apir.graph.dtypes import DType

from . import qpack

__all__ = ["SUPPORTED", "dequantize"]


def _view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes as ``dtype``, copying first if they are strided or misaligned."""
    if dtype.itemsize > 1 and (not t.is_contiguous() or t.storage_offset() % dtype.itemsize):
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(dtype)


def _widen_f16(b: torch.Tensor) -> torch.Tensor:
    """Bytes holding f16 values -> f32, keeping NaN payloads as numpy does (torch would
    turn every NaN into 0x7fffffff): sign | 0x7f800000 | mantissa << 13."""
    x = _view(b, torch.float16).float()
    h = _view(b, torch.int16).to(torch.int32)
    nan = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x03FF) << 13)
    return torch.where(torch.isnan(x), nan.view(torch.float32), x)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte ``offset`` of every block, widened to f32: shape (n_blocks, 1)."""
    return _widen_f16(blocks[:, offset : offset + 2])


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes -> (..., 2k): the k low nibbles, then the k high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes -> (..., 8, k): entry [i, j] is bit i of byte j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device).view(8, 1)
    return (qh.unsqueeze(-2) >> shifts) & 1


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    # F32 "block" (4 B): one little-endian f32
    return _view(blocks, torch.float32)


def _f16_plain(blocks: torch.Tensor) -> torch.Tensor:
    # F16 "block" (2 B): one little-endian f16
    return _widen_f16(blocks)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # BF16 "block" (2 B): the high half of an f32; widened by a shift, NaN payloads kept
    return (_view(blocks, torch.int16).to(torch.int32) << 16).view(torch.float32)


# A quantized type's value is scale * q (+ bias) per group of 32 or 16: its "fields" below
# give (q (nb, 32) or (nb, G, g) integers, scale f32 broadcastable to q, bias f32 or None),
# the scales and biases computed as gguf-py does; ``_combine`` makes the values with one
# multiply and one add (a - b is a + -b exactly, so a min subtracted is a bias added).
# local.int8cpu keeps the same fields as a weight's compact CPU form.
Fields = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _combine(fields: Fields) -> torch.Tensor:
    q, scale, bias = fields
    v = scale * q.float()
    return (v if bias is None else v + bias).reshape(q.shape[0], math.prod(q.shape[1:]))


def q4_0_fields(blocks: torch.Tensor) -> Fields:
    # Q4_0 block (18 B): d f16 | qs[16] (low nibbles = elements 0..15, high = 16..31)
    # x = d * (q - 8)
    return _nibbles(blocks[:, 2:18]).to(torch.int8) - 8, _f16(blocks, 0), None


def q4_1_fields(blocks: torch.Tensor) -> Fields:
    # Q4_1 block (20 B): d f16 | m f16 | qs[16] (low nibbles = elements 0..15, high = 16..31)
    # x = d * q + m
    return _nibbles(blocks[:, 4:20]), _f16(blocks, 0), _f16(blocks, 2)


def _q5_quants(blocks: torch.Tensor, o: int) -> torch.Tensor:
    # qh[4] at byte o (u32, bit j = 5th bit of element j), then qs[16] (as Q4_0)
    qh = _bits(blocks[:, o : o + 4]).transpose(-1, -2).reshape(-1, 32)  # bit 8*byte + i
    return _nibbles(blocks[:, o + 4 : o + 20]) | (qh << 4)


def q5_0_fields(blocks: torch.Tensor) -> Fields:
    # Q5_0 block (22 B): d f16 | qh[4] | qs[16]
    # x = d * (q - 16)
    return _q5_quants(blocks, 2).to(torch.int8) - 16, _f16(blocks, 0), None


def q5_1_fields(blocks: torch.Tensor) -> Fields:
    # Q5_1 block (24 B): d f16 | m f16 | qh[4] | qs[16]
    # x = d * q + m
    return _q5_quants(blocks, 4), _f16(blocks, 0), _f16(blocks, 2)


def q8_0_fields(blocks: torch.Tensor) -> Fields:
    # Q8_0 block (34 B): d f16 | qs[32] int8
    # x = d * q
    return _view(blocks[:, 2:34], torch.int8), _f16(blocks, 0), None


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte K-quant ``scales`` field into 8 six-bit scales and 8 six-bit mins.

    Bytes 0..3 hold scales 0..3 (low 6 bits) and the top 2 bits of scales 4..7; bytes 4..7
    hold mins 0..3 (low 6 bits) and the top 2 bits of mins 4..7; bytes 8..11 hold the low
    4 bits of scales 4..7 (low nibble) and of mins 4..7 (high nibble).
    """
    s, m, lo = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([s & 0x3F, (lo & 0x0F) | ((s >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (lo >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_fields(blocks: torch.Tensor, q: torch.Tensor) -> Fields:
    # Q4_K and Q5_K: d f16 | dmin f16 | scales[12] (8 x 6-bit scale/min, see _k_scales) at
    # the block's start; x = (d * sc) * q - (dmin * m), per sub-block of 32
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc.float()).view(n, 8, 1)
    dm = (_f16(blocks, 2) * mn.float()).view(n, 8, 1)
    return q, d, -dm


def q4_k_fields(blocks: torch.Tensor) -> Fields:
    # Q4_K block (144 B): d | dmin | scales[12] | qs[128]: sub-blocks 2k and 2k+1 (32
    #   elements each) are the low and high nibbles of qs[32k : 32k+32]
    n = blocks.shape[0]
    return _k_fields(blocks, _nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32))


def q5_k_fields(blocks: torch.Tensor) -> Fields:
    # Q5_K block (176 B): d | dmin | scales[12] | qh[32]: bit i of qh[j] = 5th bit of
    #   element j of sub-block i | qs[128] (as Q4_K)
    n = blocks.shape[0]
    qh = _bits(blocks[:, 16:48])
    ql = _nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    return _k_fields(blocks, ql | (qh << 4))


def q6_k_fields(blocks: torch.Tensor) -> Fields:
    # Q6_K block (210 B): ql[128] | qh[64] | scales[16] int8 | d f16
    #   Two halves of 128 elements; half h uses ql[64h : 64h+64] and qh[32h : 32h+32].
    #   Within a half, quarter r (32 elements): low 4 bits = nibble r // 2 (low, high) of
    #   ql[64h + 32(r % 2) + j]; high 2 bits = bits 2r..2r+1 of qh[32h + j].
    # x = (d * scale) * (q - 32), one int8 scale per 16 elements
    n = blocks.shape[0]
    d = (_f16(blocks, 208) * _view(blocks[:, 192:208], torch.int8).float()).view(n, 16, 1)
    ql = _nibbles(blocks[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(4, 1)
    qh = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    return ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16), d, None


def q2_k_fields(blocks: torch.Tensor) -> Fields:
    # Q2_K block (84 B): scales[16] (low nibble scale, high nibble min, per 16 elements) |
    #   qs[64] (element 128h + 32s + j: bits 2s.. of qs[32h + j]) | d f16 | dmin f16
    # x = (d * sc) * q - (dmin * m); the quants as qpack reads them
    n = blocks.shape[0]
    low, _, _ = qpack.fields(blocks, int(DType.Q2_K))
    sc = blocks[:, 0:16]
    dl = (_f16(blocks, 80) * (sc & 0xF).float()).view(n, 16, 1)
    ml = (_f16(blocks, 82) * (sc >> 4).float()).view(n, 16, 1)
    return low.reshape(n, 16, 16), dl, -ml


def q3_k_fields(blocks: torch.Tensor) -> Fields:
    # Q3_K block (110 B): hmask[32] | qs[64] (as Q2_K) | scales[12] (16 six-bit, low 4 bits
    #   in nibble s // 8 of byte s % 8, high 2 at bits 2 (s // 4) of byte 8 + s % 4) | d f16
    # x = (d * (sc - 32)) * (q - 4), q = the 2 bits | the hmask bit << 2
    n = blocks.shape[0]
    low, high, _ = qpack.fields(blocks, int(DType.Q3_K))
    lo = (blocks[:, 96:104].reshape(n, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8, device=blocks.device)
          .view(1, 2, 1)).reshape(n, 16) & 0xF
    hi = (blocks[:, 104:108].reshape(n, 1, 4) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)
          .view(1, 4, 1)).reshape(n, 16) & 3
    sc = ((lo | (hi << 4)).to(torch.int8) - 32).float()
    dl = (_f16(blocks, 108) * sc).view(n, 16, 1)
    return ((low | (high << 2)).to(torch.int8) - 4).reshape(n, 16, 16), dl, None


# quantized type -> its fields
FIELDS: dict[DType, Callable[[torch.Tensor], Fields]] = {
    DType.Q4_0: q4_0_fields,
    DType.Q4_1: q4_1_fields,
    DType.Q5_0: q5_0_fields,
    DType.Q5_1: q5_1_fields,
    DType.Q8_0: q8_0_fields,
    DType.Q2_K: q2_k_fields,
    DType.Q3_K: q3_k_fields,
    DType.Q4_K: q4_k_fields,
    DType.Q5_K: q5_k_fields,
    DType.Q6_K: q6_k_fields,
}


_DECODERS: dict[DType, Callable[[torch.Tensor], torch.Tensor]] = {
    DType.F32: _f32,
    DType.F16: _f16_plain,
    DType.BF16: _bf16,
    **{dtype: (lambda blocks, f=f: _combine(f(blocks))) for dtype, f in FIELDS.items()},
}

SUPPORTED: tuple[DType, ...] = tuple(_DECODERS)


def dequantize(raw: torch.Tensor, dtype: DType, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode ``raw`` (1-D uint8, exactly ``dtype.nbytes(shape)`` GGUF bytes) to float32.

    Returns a tensor of ``shape`` on ``raw``'s device. For F32 the result may share memory
    with ``raw`` (no copy is made when ``raw`` is suitably aligned).
    """
    dtype = DType(dtype)
    decode = _DECODERS.get(dtype)
    if decode is None:
        known = ", ".join(d.name for d in SUPPORTED)
        raise ValueError(f"cannot dequantize {dtype.name}: unsupported (supported: {known})")
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ValueError(
            f"{dtype.name} raw data must be a 1-D uint8 tensor, got {raw.dtype} "
            f"with shape {tuple(raw.shape)}"
        )
    shape = tuple(int(s) for s in shape)
    expected = dtype.nbytes(shape)
    if raw.numel() != expected:
        raise ValueError(
            f"{dtype.name} tensor of shape {shape} needs {expected} bytes, got {raw.numel()}"
        )
    blocks = raw.reshape(expected // dtype.type_size, dtype.type_size)
    return decode(blocks).reshape(shape)
