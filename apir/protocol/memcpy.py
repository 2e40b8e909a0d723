"""Large byte copies split across threads: a step's payload into the shared arena, and a
reply out of it, are the copies a guest makes per step, on the step's critical path, and
one thread's copy stops well short of the memory's bandwidth. numpy's copy releases the
GIL, so threads copy at once: on a 2-core machine a 16 MiB payload's pack took 1.5 ms in
two threads against 2.2-2.7 in one (19 MiB alone: 1.11 against 1.93 ms). There the whole
step was no faster (its host worker, on the same two cores, lost what the guest gained),
so threads are a quarter of the cores, at most 4: none on a 2-core machine, 4 on the
16-core GPU hosts, where ResNet-18's batch of 19 MB cost a remote guest 2.25 ms over its
in-process run.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SPLIT_BYTES = 4 << 20  # copies from this size on are split; smaller ones are not worth a handoff
THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): a forked child makes its own


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool[0] != os.getpid():  # a pool from before a fork has no threads here
        _pool = (os.getpid(), ThreadPoolExecutor(THREADS, thread_name_prefix="apir-copy"))
    return _pool[1]


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for two 1-d uint8 arrays of one size, in THREADS parts when large."""
    n = src.size
    if n < SPLIT_BYTES or THREADS == 1:
        np.copyto(dst, src)
        return
    step = -(-n // THREADS)
    parts = [(dst[i : i + step], src[i : i + step]) for i in range(0, n, step)]
    for done in [_threads().submit(np.copyto, d, s) for d, s in parts]:
        done.result()
