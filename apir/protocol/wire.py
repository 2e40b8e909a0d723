"""Primitive little-endian encoding with bounds checks on every read.

A ``Reader`` never trusts a length it reads: each one is checked against what is left of
the frame and against a cap before anything is allocated.
"""

from __future__ import annotations

import builtins
import struct
from typing import Any

from ..errors import ApirError

MAX_STR = 1 << 16  # names, labels, messages
MAX_ITEMS = 1 << 20  # list lengths (graph nodes, dims, ...)
MAX_RANK = 8

_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_F64 = struct.Struct("<d")

# What a frame body may be: the transports read into bytearrays, the arena hands out views.
BytesLike = bytes | bytearray | memoryview


class ProtocolError(ApirError):
    """A frame that breaks the wire format: truncated, oversized, unknown, out of order."""


class Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u8(self, v: int) -> None:
        self.parts.append(bytes((v,)))

    def u16(self, v: int) -> None:
        self.parts.append(_U16.pack(v))

    def u32(self, v: int) -> None:
        self.parts.append(_U32.pack(v))

    def u64(self, v: int) -> None:
        self.parts.append(_U64.pack(v))

    def i64(self, v: int) -> None:
        self.parts.append(_I64.pack(v))

    def f64(self, v: float) -> None:
        self.parts.append(_F64.pack(v))

    def str(self, v: str) -> None:
        b = v.encode()
        self.u32(len(b))
        self.parts.append(b)

    def bytes(self, v: bytes | memoryview) -> None:
        self.u64(len(v))
        self.parts.append(bytes(v))

    def getvalue(self) -> builtins.bytes:
        return b"".join(self.parts)


class Reader:
    def __init__(self, data: BytesLike) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def _take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ProtocolError(f"truncated message: wanted {n} bytes at {self.pos}, frame has {len(self.data)}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        """Several fixed-size fields at once, bounds-checked like every other read."""
        pos = self.pos
        if pos + st.size > len(self.data):
            raise ProtocolError(f"truncated message: wanted {st.size} bytes at {pos}, frame has {len(self.data)}")
        self.pos = pos + st.size
        return st.unpack_from(self.data, pos)

    def u8(self) -> int:
        return self._take(1)[0]

    def u16(self) -> int:
        v: int = _U16.unpack(self._take(2))[0]
        return v

    def u32(self) -> int:
        v: int = _U32.unpack(self._take(4))[0]
        return v

    def u64(self) -> int:
        v: int = _U64.unpack(self._take(8))[0]
        return v

    def i64(self) -> int:
        v: int = _I64.unpack(self._take(8))[0]
        return v

    def f64(self) -> float:
        v: float = _F64.unpack(self._take(8))[0]
        return v

    def count(self, cap: int = MAX_ITEMS) -> int:
        n = self.u32()
        if n > cap:
            raise ProtocolError(f"list of {n} items exceeds the limit of {cap}")
        return n

    def str(self) -> str:
        n = self.count(MAX_STR)
        try:
            return bytes(self._take(n)).decode()
        except UnicodeDecodeError:
            raise ProtocolError("string is not valid UTF-8") from None

    def bytes(self) -> bytes:
        n = self.u64()
        if n > len(self.data) - self.pos:
            raise ProtocolError(f"truncated message: {n} bytes of data announced, {len(self.data) - self.pos} present")
        return bytes(self._take(n))

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{len(self.data) - self.pos} unexpected bytes after the message")
