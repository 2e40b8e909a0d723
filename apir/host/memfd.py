"""Sealed memfds: bytes the daemon or a holder writes once and hands to workers
(SCM_RIGHTS), which nobody can change or resize after (``F_SEAL_WRITE | SHRINK | GROW |
SEAL``): a published model's copy and its forms (``published``), a holder's table of
packed weights (``holder``)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def sealed(name: str, size: int, pieces: Iterable[tuple[int, memoryview]]) -> int:
    """A memfd of ``size`` bytes holding ``pieces`` ((offset, bytes), ...), sealed: nobody
    writes it again, nor resizes it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        for offset, data in pieces:
            while data:  # pwrite may write less than asked
                n = os.pwrite(fd, data, offset)
                data, offset = data[n:], offset + n
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd
