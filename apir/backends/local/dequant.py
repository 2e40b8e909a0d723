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


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # Q4_0 block (18 B): d f16 | qs[16] (low nibbles = elements 0..15, high = 16..31)
    # x = d * (q - 8)
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:18]).to(torch.int8) - 8
    return d * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # Q4_1 block (20 B): d f16 | m f16 | qs[16] (low nibbles = elements 0..15, high = 16..31)
    # x = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:20]).float()
    return d * q + m


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # Q5_0 block (22 B): d f16 | qh[4] (u32, bit j = 5th bit of element j) | qs[16] (as Q4_0)
    # x = d * (q - 16)
    d = _f16(blocks, 0)
    qh = _bits(blocks[:, 2:6]).transpose(-1, -2).reshape(-1, 32)  # bit 8*byte + i
    q = (_nibbles(blocks[:, 6:22]) | (qh << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # Q5_1 block (24 B): d f16 | m f16 | qh[4] (as Q5_0) | qs[16] (as Q4_0)
    # x = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    qh = _bits(blocks[:, 4:8]).transpose(-1, -2).reshape(-1, 32)
    q = (_nibbles(blocks[:, 8:24]) | (qh << 4)).float()
    return d * q + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # Q8_0 block (34 B): d f16 | qs[32] int8
    # x = q * d
    d = _f16(blocks, 0)
    q = _view(blocks[:, 2:34], torch.int8).float()
    return q * d


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


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # Q4_K block (144 B): d f16 | dmin f16 | scales[12] (8 x 6-bit scale/min, see _k_scales)
    #   | qs[128]: sub-blocks 2k and 2k+1 (32 elements each) are the low and high nibbles
    #     of qs[32k : 32k+32]
    # x = (d * sc) * q - (dmin * m), per sub-block of 32
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc.float()).view(n, 8, 1)
    dm = (_f16(blocks, 2) * mn.float()).view(n, 8, 1)
    q = _nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # Q5_K block (176 B): d f16 | dmin f16 | scales[12] (as Q4_K)
    #   | qh[32]: bit i of qh[j] = 5th bit of element j of sub-block i | qs[128] (as Q4_K)
    # x = (d * sc) * q - (dmin * m), per sub-block of 32
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc.float()).view(n, 8, 1)
    dm = (_f16(blocks, 2) * mn.float()).view(n, 8, 1)
    qh = _bits(blocks[:, 16:48])
    ql = _nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (d * q - dm).reshape(n, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
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
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, 256)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # Q2_K block (84 B): scales[16] (low nibble scale, high nibble min, per 16 elements) |
    #   qs[64] (element 128h + 32s + j: bits 2s.. of qs[32h + j]) | d f16 | dmin f16
    # x = (d * sc) * q - (dmin * m); the quants as qpack reads them
    n = blocks.shape[0]
    low, _, _ = qpack.fields(blocks, int(DType.Q2_K))
    sc = blocks[:, 0:16]
    dl = (_f16(blocks, 80) * (sc & 0xF).float()).view(n, 16, 1)
    ml = (_f16(blocks, 82) * (sc >> 4).float()).view(n, 16, 1)
    return (dl * low.reshape(n, 16, 16).float() - ml).reshape(n, 256)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
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
    q = ((low | (high << 2)).to(torch.int8) - 4).reshape(n, 16, 16).float()
    return (dl * q).reshape(n, 256)


_DECODERS: dict[DType, Callable[[torch.Tensor], torch.Tensor]] = {
    DType.F32: _f32,
    DType.F16: _f16_plain,
    DType.BF16: _bf16,
    DType.Q4_0: _q4_0,
    DType.Q4_1: _q4_1,
    DType.Q5_0: _q5_0,
    DType.Q5_1: _q5_1,
    DType.Q8_0: _q8_0,
    DType.Q2_K: _q2_k,
    DType.Q3_K: _q3_k,
    DType.Q4_K: _q4_k,
    DType.Q5_K: _q5_k,
    DType.Q6_K: _q6_k,
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
