"""The shared arena's pages, page-locked for the GPU's copy engines as far as steps use them.

A step's inputs and outputs live in the arena (host/session.py reads them in place and
writes replies straight there). From pageable memory the CUDA driver stages every copy
through its own pinned bounce buffer, at a fraction of the bus's speed; registered pages
(``cudaHostRegister``) are read and written by DMA directly. Registering the whole arena at
once would lock up to a GiB the session may never touch, so only the prefix ``[0, n)``
that steps have reached is registered, ``n`` a power of two (at least ``MIN_PINNED``):
growing it unregisters and registers again, at most log2(arena / MIN_PINNED) times a
session. Steps are placed from the arena's bottom when nothing is in flight
(backends/remote.py), so the prefix stays small.

CUDA refuses a copy whose host range is registered in part ("memory regions spanning
over allocations that are both registered and not registered ... return
CUDA_ERROR_INVALID_VALUE"), so a copy of arena bytes that no step covered (a weight
upload's piece, laid wherever the arena's ring had reached) is split at the prefix's end
(``split``): one part by DMA, the rest pageable.

A guest that writes its pages during a copy changes only its own results, as with any
read in place (SECURITY.md, Compute inputs).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)

MIN_PINNED = 4 << 20


class PinnedPrefix:
    def __init__(self, view: memoryview, device: torch.device) -> None:
        self.device = device  # whose queued copies may read or write the registered pages
        # only the address is kept: holding an export of the view would stop its owner
        # from releasing it
        self.base = np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0
        self.size = len(view)
        self.pinned = 0  # bytes from base that are registered
        self.failed = False  # registering failed once: copies stay pageable, nothing else changes

    def cover(self, a: np.ndarray) -> None:
        """Make sure ``a``'s bytes are registered if ``a`` lies in the arena."""
        if self.failed or not a.nbytes:
            return
        start = a.ctypes.data - self.base
        end = start + a.nbytes
        if start < 0 or end > self.size or end <= self.pinned:
            return
        want = min(self.size, max(MIN_PINNED, 1 << (end - 1).bit_length()))
        rt = torch.cuda.cudart()
        if self.pinned:
            torch.cuda.synchronize(self.device)  # no queued copy may still use the old registration
            rt.cudaHostUnregister(self.base)
            self.pinned = 0
        err = rt.cudaHostRegister(self.base, want, 0)
        if int(err):
            self.failed = True
            if hasattr(rt, "cudaGetLastError"):
                rt.cudaGetLastError()  # clear it: the next CUDA call must not report it
            log.warning("could not page-lock %d MiB of the shared arena (cuda error %d): "
                        "step inputs and outputs are copied from pageable memory", want >> 20, int(err))
            return
        self.pinned = want

    def split(self, a: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``a`` (flat bytes) as (byte offset in ``a``, part) runs that each lie wholly
        inside the registered prefix or wholly outside it: a copy of each one CUDA takes."""
        start = a.ctypes.data - self.base
        cut = self.pinned - start
        if 0 <= start < self.pinned and cut < a.nbytes:  # starts inside, ends beyond
            return [(0, a[:cut]), (cut, a[cut:])]
        return [(0, a)]

    def close(self) -> None:
        if self.pinned:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = 0
