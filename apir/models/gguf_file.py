"""Opening a GGUF file: its header parsed (``gguf_parse``), its tensors memory-mapped,
clear errors and typed metadata.

Tensor shapes are given in numpy order (outermost first): GGUF's ``ne = [K, N]`` for a
weight becomes ``(N, K)``, one row per output feature.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..graph import DType
from .errors import ModelLoadError
from .gguf_parse import MAGIC, parse


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: DType
    shape: tuple[int, ...]  # numpy order
    data: np.ndarray  # raw bytes (uint8 view into the memory map)


class GGUFFile:
    """A GGUF model file: metadata by key, tensors by name (zero-copy)."""

    has_tokenizer = True  # its tokenizer.* metadata builds one (a synthetic source has none)

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        with open(self.path, "rb") as f:
            magic = f.read(4)
            if magic != MAGIC:
                raise ModelLoadError(f"{self.path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
            data = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
        try:
            header = parse(memoryview(data))
        except ValueError as e:
            raise ModelLoadError(f"{self.path} is truncated or corrupt and cannot be read as GGUF ({e})") from None
        self.metadata = header.metadata
        self.value_types = header.types  # key -> GGUF value type (then element types, for arrays)
        self.arch: str = self.get(gguf.Keys.General.ARCHITECTURE)
        if not isinstance(self.arch, str):
            raise ModelLoadError(f"{self.path} has no general.architecture in its metadata")
        self.tensors: dict[str, TensorInfo] = {}
        for t in header.tensors:
            try:
                dtype = DType(t.ggml_type)
            except ValueError:
                try:
                    kind = gguf.GGMLQuantizationType(t.ggml_type).name
                except ValueError:
                    kind = f"number {t.ggml_type}"
                raise ModelLoadError(f"tensor {t.name} has GGML type {kind}, which apir does not support") from None
            shape = tuple(reversed(t.ne))
            try:
                nbytes = dtype.nbytes(shape)
            except ValueError as e:
                raise ModelLoadError(f"{self.path}: tensor {t.name}: {e}") from None
            if t.offset + nbytes > data.size:
                raise ModelLoadError(f"{self.path}: tensor {t.name} is truncated")
            self.tensors[t.name] = TensorInfo(t.name, dtype, shape, data[t.offset : t.offset + nbytes])

    def get(self, key: str, default=None):
        """A metadata value; ``{arch}`` in the key is filled in."""
        if "{arch}" in key:
            key = key.format(arch=self.arch)
        return self.metadata.get(key, default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path.name}: metadata key {key.format(arch=self.arch)} is missing")
        return value

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path.name}: tensor {name} is missing") from None

    @property
    def nbytes(self) -> int:
        return sum(t.data.nbytes for t in self.tensors.values())

    def quantization(self) -> str:
        """The file type llama.cpp's quantizer wrote (``general.file_type``: 'Q4_K_M' for a
        mix of Q4_K and Q6_K), else the most common weight type, e.g. 'Q4_1'."""
        ftype = self.get(gguf.Keys.General.FILE_TYPE)
        if isinstance(ftype, int):
            try:  # bit 10 marks a type guessed by the converter; the type is the rest
                name = gguf.LlamaFileType(ftype & ~gguf.LlamaFileType.GUESSED).name
            except ValueError:
                name = None
            if name:
                return name.removeprefix("MOSTLY_").removeprefix("ALL_")
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) == 2:
                counts[t.dtype.name] = counts.get(t.dtype.name, 0) + t.data.nbytes
        return max(counts, key=counts.get) if counts else "F32"
