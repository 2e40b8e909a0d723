"""Quantized weights on a CPU that torch's int4 product does not take (Q8_0, Q5_0, Q5_1,
Q6_K, Q5_K, Q3_K, Q2_K, and Q4 shapes it cannot pack) as int8 values with f32 scales per
group along K, dequantized a cache-sized tile at a time for each product: 1.125-1.5 bytes
a weight where an f32 copy takes 4, at about the f32 copy's speed on a 2-core machine
(BENCHMARKS.md, "CPU: compact forms"), where decoding the GGUF blocks at each use is 4-9x slower.

Every one of these types is value = scale * q (+ bias) per group of G (32, or 16 for the
types with a scale per 16), q small enough for int8, with the f32 scale and bias exactly as
gguf-py computes them (``dequant.FIELDS``, from which its decoders make the values too):
    Q8_0: d * q            Q5_0: d * (q - 16)       Q5_1: d * q + m
    Q4_0: d * (q - 8)      Q4_1: d * q + m
    Q4_K, Q5_K: (d * sc) * q - (dmin * m)           Q6_K: (d * sc) * (q - 32)
    Q2_K: (d * sc) * q - (dmin * m)                 Q3_K: (d * (sc - 32)) * (q - 4)
A tile's values are the same f32 operations on the same operands (a - b is a + -b in IEEE
arithmetic), so they are gguf.quants.dequantize's to the bit.

    q      (N, K / G, G) int8; for Q8_0 a view of the blocks' own quants (no copy: the
           form adds only the scales, 0.125 bytes a weight)
    scale  (N, K / G) f32
    bias   (N, K / G) f32, or None for the types without a min
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ...graph import DType
from . import qmatmul, qpack
from .dequant import FIELDS, _f16

# types whose form groups 16 values (a scale per 16); the others group 32
_BY16 = (DType.Q6_K, DType.Q3_K, DType.Q2_K)
TYPES = (DType.Q8_0, DType.Q5_0, DType.Q5_1, DType.Q4_0, DType.Q4_1, DType.Q4_K, DType.Q5_K, *_BY16)
@dataclass(frozen=True)
class Int8:
    """A weight (N, K) as int8 values and f32 scales (see the module's doc)."""

    q: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    shape: tuple[int, int]
    own_q: bool  # q is the form's own (False: a view of Q8_0 blocks)

    @property
    def nbytes(self) -> int:
        """Bytes the form holds beyond the weight's blocks."""
        own = self.q.nbytes if self.own_q else 0
        return own + self.scale.nbytes + (0 if self.bias is None else self.bias.nbytes)


# a compiled step takes the tensors as inputs, the shape as fixed
pytree.register_pytree_node(Int8, lambda w: ([w.q, w.scale, w.bias], (w.shape, w.own_q)),
                            lambda children, context: Int8(*children, *context))


def group(dtype: DType) -> int:
    return 16 if dtype in _BY16 else 32


def usable(dtype: DType, shape: tuple[int, ...]) -> bool:
    """Whether a CPU weight of ``dtype`` and ``shape`` can take this form."""
    return dtype in TYPES and len(shape) == 2 and shape[1] % dtype.block_size == 0


def nbytes(dtype: DType, shape: tuple[int, ...]) -> int:
    """What ``pack`` makes for a weight of ``dtype`` and ``shape`` (beyond the blocks)."""
    n, k = shape
    groups = n * k // group(dtype)
    return (0 if dtype is DType.Q8_0 else n * k) + 4 * groups * (2 if _has_bias(dtype) else 1)


def _has_bias(dtype: DType) -> bool:
    return dtype in (DType.Q5_1, DType.Q4_1, DType.Q4_K, DType.Q5_K, DType.Q2_K)


def pack(raw: torch.Tensor, dtype: DType, shape: tuple[int, int]) -> Int8:
    """The GGUF bytes ``raw`` (uint8, on the CPU) of a weight as an ``Int8``, decoded a
    few rows at a time (bounded temporaries)."""
    n, k = shape
    per_row = dtype.nbytes((1, k))
    step = max(1, qpack.STEP_ELEMENTS // k)
    g = group(dtype)
    copy = dtype is not DType.Q8_0
    q = (torch.empty((n, k // g, g), dtype=torch.int8) if copy
         else raw.view(n, k // 32, 34)[:, :, 2:].view(torch.int8))
    scale = torch.empty((n, k // g), dtype=torch.float32)
    bias = torch.empty((n, k // g), dtype=torch.float32) if _has_bias(dtype) else None
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        blocks = raw[r0 * per_row : r1 * per_row].reshape(-1, dtype.type_size)
        if not copy:  # Q8_0: the scales alone
            scale[r0:r1] = _f16(blocks, 0).reshape(r1 - r0, k // g)
            continue
        fq, fs, fb = FIELDS[dtype](blocks)
        q[r0:r1] = fq.to(torch.int8).reshape(r1 - r0, k // g, g)
        scale[r0:r1] = fs.reshape(r1 - r0, k // g)
        if bias is not None:
            bias[r0:r1] = fb.reshape(r1 - r0, k // g)
    return Int8(q, scale, bias, (n, k), copy)


def _values(w: Int8, rows: slice | torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of the weight as f32 (R, K), gguf-py's values to the bit."""
    v = w.q[rows].float() * w.scale[rows].unsqueeze(-1)  # (R, K / G, G)
    if w.bias is not None:
        v = v + w.bias[rows].unsqueeze(-1)
    return v.view(v.shape[0], w.shape[1])


def product(x: torch.Tensor, w: Int8) -> torch.Tensor:
    """x (..., K) @ w.T in f32: (..., N), a cache-sized tile of dequantized rows at a time."""
    return qmatmul.cpu_tiles(x, *w.shape, lambda r0, r1: _values(w, slice(r0, r1)))


def rows(w: Int8, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the weight in f32: (*ids.shape, K)."""
    flat = ids.long().reshape(-1)
    return _values(w, flat).reshape(*ids.shape, w.shape[1])
