"""The GGUF header, parsed in one pass: metadata values and tensor records.

gguf-py's reader makes a numpy view per field part (a memmap slice per token of a
49,152-token vocabulary): 2 s to open SmolLM2 on a 2-core guest, the largest part of a
one-shot ``apir run``'s start. This reads the same layout (little-endian GGUF v2 and v3)
with ``struct`` and one numpy view per numeric array, in ~0.1 s; values come out as gguf-py's
``ReaderField.contents()`` gives them (tests compare the two on every file they have).

    file   := "GGUF" u32 version, u64 n_tensors, u64 n_kv, kv * n_kv, tensor * n_tensors,
              padding to ``general.alignment`` (default 32), tensor data
    kv     := string key, u32 type, value
    value  := scalar | string (u64 length, UTF-8 bytes) | array (u32 type, u64 count, values)
    tensor := string name, u32 n_dims, u64 ne[n_dims] (innermost first), u32 ggml type,
              u64 offset (from the start of the tensor data)

Every read is bounds-checked: a truncated or corrupt file raises ``ValueError`` saying
where, never reads past the end.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays: no model has any; a bound keeps a crafted file off the stack

STRING, ARRAY = 8, 9
# value type -> (struct format, numpy dtype) for the fixed-size types
SCALARS: dict[int, tuple[str, np.dtype]] = {
    0: ("<B", np.dtype("<u1")), 1: ("<b", np.dtype("<i1")), 2: ("<H", np.dtype("<u2")),
    3: ("<h", np.dtype("<i2")), 4: ("<I", np.dtype("<u4")), 5: ("<i", np.dtype("<i4")),
    6: ("<f", np.dtype("<f4")), 7: ("<?", np.dtype("?")), 10: ("<Q", np.dtype("<u8")),
    11: ("<q", np.dtype("<i8")), 12: ("<d", np.dtype("<f8")),
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class TensorRecord:
    name: str
    ggml_type: int
    ne: tuple[int, ...]  # GGUF order: innermost dimension first
    offset: int  # bytes from the start of the file


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]  # key -> value, as gguf-py's contents()
    types: dict[str, tuple[int, ...]]  # key -> value type, then element type(s) for arrays
    tensors: list[TensorRecord]
    data_offset: int


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def take(self, n: int, what: str) -> int:
        """The position of the next ``n`` bytes, which must lie in the file."""
        pos = self.pos
        if n < 0 or pos + n > self.size:
            raise ValueError(f"the file ends inside {what} (at byte {pos}, {n} more needed)")
        self.pos = pos + n
        return pos

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(what)
        pos = self.take(n, what)
        try:
            return str(self.buf[pos : pos + n], "utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{what} at byte {pos} is not UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> tuple[Any, tuple[int, ...]]:
        """(value, its types) of type ``vtype``; ``depth``: the arrays it is nested in."""
        if vtype in SCALARS:
            fmt, dtype = SCALARS[vtype]
            return struct.unpack_from(fmt, self.buf, self.take(dtype.itemsize, what))[0], (vtype,)
        if vtype == STRING:
            return self.string(what), (vtype,)
        if vtype != ARRAY:
            raise ValueError(f"{what} has unknown value type {vtype}")
        etype, count = self.u32(what), self.u64(what)
        if etype in SCALARS:
            dtype = SCALARS[etype][1]
            pos = self.take(count * dtype.itemsize, what)
            return np.frombuffer(self.buf, dtype, count, pos).tolist(), (ARRAY, etype)
        if etype == STRING:
            return [self.string(what) for _ in range(count)], (ARRAY, STRING)
        if depth >= MAX_NESTING:
            raise ValueError(f"{what} nests arrays more than {MAX_NESTING} deep")
        items, types = [], (ARRAY, etype)
        for _ in range(count):  # nested arrays (unused by models, allowed by the format)
            item, types = self.value(etype, what, depth + 1)
            items.append(item)
        return items, (ARRAY, *types)


def parse(buf: memoryview) -> Header:
    """The header of the GGUF file held in ``buf``; ValueError for anything off the format."""
    c = _Cursor(buf)
    if bytes(buf[c.take(4, "the magic") : 4]) != MAGIC:
        raise ValueError("GGUF magic invalid")
    version = c.u32("the version")
    if version & 0xFFFF == 0:
        raise ValueError("the file is a big-endian GGUF, which apir does not read")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (only {', '.join(map(str, VERSIONS))})")
    n_tensors, n_kv = c.u64("the tensor count"), c.u64("the metadata count")
    metadata: dict[str, Any] = {}
    types: dict[str, tuple[int, ...]] = {}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        if key in metadata:
            raise ValueError(f"metadata key {key} appears twice")
        metadata[key], types[key] = c.value(c.u32(f"the type of {key}"), f"the value of {key}")
    tensors: list[TensorRecord] = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = c.string(f"tensor name {i}")
        if name in names:
            raise ValueError(f"tensor {name} appears twice")
        names.add(name)
        n_dims = c.u32(f"tensor {name}")
        if n_dims > MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions (at most {MAX_DIMS})")
        ne = tuple(c.u64(f"tensor {name}") for _ in range(n_dims))
        tensors.append(TensorRecord(name, c.u32(f"tensor {name}"), ne, c.u64(f"tensor {name}")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and types["general.alignment"] != (4,):
        raise ValueError("general.alignment must be a uint32")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    data_offset = -(-c.pos // alignment) * alignment
    tensors = [TensorRecord(t.name, t.ggml_type, t.ne, data_offset + t.offset) for t in tensors]
    return Header(version, metadata, types, tensors, data_offset)
