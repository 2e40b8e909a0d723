"""The shared-memory arena: one sealed memfd per session, mapped by host and guest.

The host creates it (so the guest can never shrink it under the host's feet: the file is
sealed against shrinking and growing, and a truncated mapping would SIGBUS the worker),
and sends its fd with the Welcome frame over the Unix socket. Bulk bytes (weight uploads,
large inputs and outputs) are written into it once, and messages carry (offset, size).

The guest allocates from it as a ring (``ArenaRing``). A region is reusable once the host
has processed the request that named it; the host handles requests in order, so after
any reply every earlier region is free. When the ring wraps, the guest first waits for a
reply (a synchronize) — the only time an upload stream waits.
"""

from __future__ import annotations

import fcntl
import mmap
import os

from ..errors import ApirError

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
ARENA_ALIGN = 64


class ArenaError(ApirError):
    """An arena that cannot be created, mapped or trusted."""


class Arena:
    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        # MAP_POPULATE: fault every page in now, not one 4 KiB page at a time mid-upload
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self.map = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.map)

    @classmethod
    def create(cls, size: int, name: str = "apir-arena") -> Arena:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return cls(fd, size)

    @classmethod
    def attach(cls, fd: int, size: int) -> Arena:
        """Map an arena received from the peer, after checking it cannot change size."""
        st = os.fstat(fd)
        if st.st_size != size:
            raise ArenaError(f"arena is {st.st_size} bytes, the handshake said {size}")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
            raise ArenaError("arena memfd is not sealed against resizing")
        return cls(fd, size)

    def check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ArenaError(f"arena range [{offset}, {offset + size}) outside the {self.size}-byte arena")

    def read(self, offset: int, size: int) -> bytes:
        """A private copy: the peer may change the arena at any moment (read once, then use)."""
        self.check(offset, size)
        return bytes(self.view[offset : offset + size])

    def window(self, offset: int, size: int) -> memoryview:
        """The bytes in place, no copy. Only for opaque payloads (tensor contents) whose
        value nothing checks: anything parsed or validated must use ``read``."""
        self.check(offset, size)
        return self.view[offset : offset + size]

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.check(offset, len(data))
        self.view[offset : offset + len(data)] = data

    def close(self) -> None:
        self.view.release()
        self.map.close()
        os.close(self.fd)


class ArenaRing:
    """Guest-side bump allocator over the arena. ``alloc`` returns None when the request
    would need to wrap; the caller then synchronizes and calls ``reset``."""

    def __init__(self, size: int) -> None:
        self.size, self.head = size, 0

    def alloc(self, n: int) -> int | None:
        start = -(-self.head // ARENA_ALIGN) * ARENA_ALIGN
        if start + n > self.size:
            return None
        self.head = start + n
        return start

    def reset(self) -> None:
        self.head = 0
