"""Q4_0, Q4_1 and Q4_K weights on a CPU as torch's int4 weights, computed by its int4
product with bf16 activations: 4-15x faster than the f32 product of a dequantized copy on
a 2-core machine, in 0.625 bytes a weight instead of 4 (BENCHMARKS.md, "torch's int4
product"), at the precision of llama.cpp's own CPU path, which rounds activations to 8 bits.

torch's int4 weight is w = (q - 8) * scale + zero per group of 32 along K, with q in 0..15;
each of these types is exactly that, group for group:
    Q4_0: d * (q - 8)                scale d,        zero 0
    Q4_1: d * q + m                  scale d,        zero m + 8d
    Q4_K: (d * sc) * q - dmin * mn   scale d * sc,   zero 8 d sc - dmin mn   (per sub-block)
The scales and zeros are kept in bf16 (the product takes them in the activations' dtype).

    packed       torch's opaque int4 layout of the (N, K) values q
    scales_zeros (K / 32, N, 2) bf16
    blocks       the weight as uploaded (kernels.Blocks over its buffer's bytes, no copy),
                 for GET_ROWS, which reads a few rows
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ...graph import DType
from .dequant import _f16, _k_scales, _nibbles

GROUP = 32
TYPES = (DType.Q4_0, DType.Q4_1, DType.Q4_K)


@dataclass(frozen=True)
class Int4:
    """A weight (N, K) in torch's int4 form (see the module's doc)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    blocks: object  # kernels.Blocks
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


# a compiled step takes the tensors as inputs, the shape as fixed
pytree.register_pytree_node(Int4, lambda w: ([w.packed, w.scales_zeros, w.blocks], w.shape),
                            lambda children, shape: Int4(*children, shape))


def usable(dtype: DType, shape: tuple[int, ...]) -> bool:
    """Whether a CPU weight of ``dtype`` and ``shape`` goes through this module."""
    return (dtype in TYPES and len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % GROUP == 0
            and hasattr(torch, "_weight_int4pack_mm_for_cpu"))  # torch packs rows 16 at a time


def nbytes(shape: tuple[int, ...]) -> int:
    """What ``pack`` makes for a weight of ``shape``: K/2 bytes a row, 4 bytes a group."""
    n, k = shape
    return n * k // 2 + (k // GROUP) * n * 4


def pack(raw: torch.Tensor, dtype: DType, shape: tuple[int, int], blocks: object) -> Int4:
    """The GGUF bytes ``raw`` (uint8, on the CPU) of a weight as an ``Int4``; ``blocks``
    the same weight as stored."""
    n, k = shape
    q, scale, zero = _fields(raw.reshape(-1, dtype.type_size), dtype)  # per group: (G, 32), (G, 1), (G, 1)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).to(torch.int32), 1)
    sz = torch.cat([scale, zero], dim=-1).reshape(n, k // GROUP, 2).transpose(0, 1)
    return Int4(packed, sz.to(torch.bfloat16).contiguous(), blocks, (n, k))


def _fields(blocks: torch.Tensor, dtype: DType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 (G, 32), scale f32 (G, 1), zero f32 (G, 1)) for every group of 32."""
    if dtype is DType.Q4_0:
        d = _f16(blocks, 0)
        return _nibbles(blocks[:, 2:18]), d, torch.zeros_like(d)
    if dtype is DType.Q4_1:
        d, m = _f16(blocks, 0), _f16(blocks, 2)
        return _nibbles(blocks[:, 4:20]), d, m + 8 * d
    # Q4_K: 8 sub-blocks of 32 a block; sub-blocks 2j and 2j+1 are the low and high nibbles
    # of qs[32j : 32j+32]
    nb = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * sc.float()).reshape(nb * 8, 1)
    dm = (_f16(blocks, 2) * mn.float()).reshape(nb * 8, 1)
    q = _nibbles(blocks[:, 16:144].reshape(nb, 4, 32)).reshape(nb * 8, 32)
    return q, scale, 8 * scale - dm


def product(x: torch.Tensor, w: Int4) -> torch.Tensor:
    """x (..., K) @ w.T: (..., N) f32, x rounded to bf16 for the product."""
    n, k = w.shape
    y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, k).to(torch.bfloat16), w.packed, GROUP, w.scales_zeros)
    return y.float().reshape(*x.shape[:-1], n)
