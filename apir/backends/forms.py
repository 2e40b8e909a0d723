"""Dequantized forms of a published model's weights, made once by the host's daemon and
mapped read-only by each of its CPU sessions (``apir.host.published``), so that N sessions
hold one set of f32 forms, not N (a CPU session with ``ExecutorConfig.dequant_cache``, an
opt-in, keeps one per 16-bit or quantized weight: ~6x the file). The mapping's layout:

    "APIRDQ1\\0", u64 count, count x (u64 weight offset, u64 ggml type, u64 form offset,
    u64 elements), then each weight's form, f32 in the weight's shape, at its form offset
    (ALIGN-aligned)

A weight offset is where the weight lies in the published copy, its type the one it was
dequantized as (a leaf reading those bytes as another type gets no form from here); the
form offsets count from the mapping's start.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

MAGIC = b"APIRDQ1\0"
_COUNT = struct.Struct("<Q")
_ENTRY = struct.Struct("<QQQQ")
ALIGN = 64


def plan(weights: Sequence[tuple[int, int, int]]) -> tuple[bytes, list[int], int]:
    """For weights (offset in the copy, ggml type, elements): the table's bytes, each
    form's offset, and the mapping's size."""
    at = -(-(len(MAGIC) + _COUNT.size + _ENTRY.size * len(weights)) // ALIGN) * ALIGN
    offsets = []
    for *_, count in weights:
        offsets.append(at)
        at += -(-4 * count // ALIGN) * ALIGN
    table = MAGIC + _COUNT.pack(len(weights)) + b"".join(
        _ENTRY.pack(w, t, f, n) for (w, t, n), f in zip(weights, offsets))
    return table, offsets, at


def read(data: memoryview) -> dict[int, tuple[int, int, int]]:
    """The table of a forms mapping: weight offset -> (ggml type, form offset, elements).
    The daemon wrote it (a guest never does); its entries are still checked against the
    mapping."""
    if bytes(data[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a table of dequantized forms")
    (count,) = _COUNT.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _COUNT.size
    if start + count * _ENTRY.size > len(data):
        raise ValueError("the table of dequantized forms runs past its mapping")
    table = {}
    for i in range(count):
        weight, kind, form, n = _ENTRY.unpack_from(data, start + i * _ENTRY.size)
        if form % ALIGN or form + 4 * n > len(data):
            raise ValueError(f"dequantized form {i} lies outside its mapping")
        table[weight] = (kind, form, n)
    return table
