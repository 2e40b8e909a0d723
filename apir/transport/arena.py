"""The shared-memory arena: the bulk part of a session's shared region.

The host creates the region (a sealed memfd for Unix guests, so the guest can never
shrink it under the host's feet — a truncated mapping would SIGBUS the worker — or an
ivshmem file for VMs; see ``apir.transport.shm``). Bulk bytes (weight uploads, large
inputs and outputs) are written into the arena once, and messages carry (offset, size).

The guest allocates from it as a ring (``ArenaRing``). A region is reusable once the host
has processed the request that named it; the host handles requests in order, so after
any reply every earlier region is free. When the ring wraps, the guest first waits for a
reply (a synchronize) — the only time an upload stream waits.
"""

from __future__ import annotations

import fcntl

from ..errors import ApirError
from ..protocol import ARENA_ALIGN

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class ArenaError(ApirError):
    """An arena that cannot be created, mapped or trusted."""


def check_sealed(fd: int) -> None:
    """Refuse shared memory the peer could still shrink (a mapping past EOF is a SIGBUS)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if seals & want != want:
        raise ArenaError("shared memory is not sealed against resizing")


class Arena:
    """Bounds-checked access to the bulk part of a session's shared region."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.size = view, len(view)

    def check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ArenaError(f"arena range [{offset}, {offset + size}) outside the {self.size}-byte arena")

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
