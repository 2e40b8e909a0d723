"""Tensor element types.

Values are pinned to ggml's type ids (``gguf.GGMLQuantizationType``) so a GGUF tensor's
type travels unchanged from file to guest to host. Quantized types are *block* types: a
row of ``n`` elements is ``n // block_size`` blocks of ``type_size`` bytes each.
"""

from __future__ import annotations

import enum

import numpy as np


class DType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    I32 = 26
    BF16 = 30

    @property
    def is_quantized(self) -> bool:
        return self in _BLOCKS and _BLOCKS[self][0] > 1

    @property
    def block_size(self) -> int:
        """Elements per block (1 for plain types)."""
        return _BLOCKS[self][0]

    @property
    def type_size(self) -> int:
        """Bytes per block (the element size for plain types)."""
        return _BLOCKS[self][1]

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes needed for a tensor of ``shape``; the last dim must be whole blocks."""
        n = 1
        for d in shape:
            n *= d
        if shape and shape[-1] % self.block_size:
            raise ValueError(
                f"{self.name} rows must be a multiple of {self.block_size} elements, got {shape[-1]}"
            )
        return n // self.block_size * self.type_size

    @classmethod
    def parse(cls, value: int | str | DType) -> DType:
        """DType from an id or a name, with a clear error for anything else."""
        try:
            if isinstance(value, str):
                return cls[value.upper()]
            return cls(int(value))
        except (KeyError, ValueError):
            known = ", ".join(d.name for d in cls)
            raise ValueError(f"unknown dtype {value!r} (known: {known})") from None


# (elements per block, bytes per block), as in gguf.GGML_QUANT_SIZES.
_BLOCKS: dict[DType, tuple[int, int]] = {
    DType.F32: (1, 4),
    DType.F16: (1, 2),
    DType.BF16: (1, 2),
    DType.I32: (1, 4),
    DType.Q4_0: (32, 2 + 16),
    DType.Q4_1: (32, 2 + 2 + 16),
    DType.Q5_0: (32, 2 + 4 + 16),
    DType.Q5_1: (32, 2 + 2 + 4 + 16),
    DType.Q8_0: (32, 2 + 32),
    DType.Q2_K: (256, 16 + 64 + 2 + 2),
    DType.Q3_K: (256, 32 + 64 + 12 + 2),
    DType.Q4_K: (256, 2 + 2 + 12 + 128),
    DType.Q5_K: (256, 2 + 2 + 12 + 32 + 128),
    DType.Q6_K: (256, 128 + 64 + 16 + 2),
}

# Types that graph values (not stored weights) may have.
COMPUTE_DTYPES = (DType.F32, DType.F16, DType.BF16, DType.I32)

NUMPY_DTYPES: dict[DType, np.dtype] = {
    DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.I32: np.dtype(np.int32),
    # numpy has no bfloat16: BF16 travels as raw uint16 and is widened on use.
    DType.BF16: np.dtype(np.uint16),
}


def from_numpy(dtype: np.dtype) -> DType:
    for k, v in NUMPY_DTYPES.items():
        if v == dtype and k is not DType.BF16:
            return k
    raise ValueError(f"numpy dtype {dtype} has no apir equivalent (use float32, float16 or int32)")
