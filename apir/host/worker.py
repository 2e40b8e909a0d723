"""A session's worker process: after the daemon forks it for a guest, build the executor,
put it under its OS memory limit, welcome the guest (a Unix guest gets its shared region:
see ``apir.transport.accept``), serve it, clean up."""

from __future__ import annotations

import logging
import re
import resource
import time

from ..protocol import PROTOCOL_VERSION, ErrorCode
from ..protocol import messages as m
from ..transport import Connection, ConnectionClosed, accept, spin_seconds
from .session import Session, SessionConfig, device_message

log = logging.getLogger("apir.host")

# What a worker may hold beyond its --max-memory before the OS stops it: what accounting
# does not see (a frame being decoded, up to 3 times --max-message; Python objects; torch's
# threads, kernels' temporaries and allocator slack).
HEADROOM = 256 << 20


def run_worker(conn: Connection, hello: m.Hello, config: SessionConfig, publish) -> None:
    """Entry point of a session's worker process (after fork): build, welcome, serve.
    ``conn``: the guest's connection as the handshake left it (a socket, or a VM's rings
    and arena)."""
    started = time.monotonic()
    from ..backends.local import LocalBackend  # torch: only worker processes execute

    backend = LocalBackend(config.device, limits=config.limits, config=config.executor)
    device = device_message(backend)
    cap = os_memory_cap(config.os_memory or config.limits.max_memory + HEADROOM + 3 * conn.channel.max_body,
                        device.kind) if config.limits.max_memory or config.os_memory else ""

    def welcome(arena_size: int) -> m.Welcome:
        return m.Welcome(PROTOCOL_VERSION, config.session, device, arena_size, config.limits.max_memory)

    try:
        try:
            conn = accept(conn, welcome, min(hello.arena_size, config.max_arena), config.io_timeout,
                          f"apir-session-{config.session}")
        except ConnectionClosed:
            return  # the guest went away during its handshake
        conn.channel.spin_seconds = spin_seconds(device.kind, config.spin_us)  # the next step is µs away on a GPU
        try:
            Session(conn.channel, backend, conn.arena, config, publish, liveness=conn.liveness).serve()
        except MemoryError:  # outside any request (a frame being read): end with the reason
            log.warning("session %d ran out of memory under its OS limit (%s)", config.session, cap)
            conn.channel.send(m.Error(ErrorCode.QUOTA, f"the session ran out of memory under its "
                                      f"OS limit ({cap}) and is closed"), 0)
    finally:
        peak = backend.peak_bytes
        backend.close()
        conn.close()
        publish(0, peak)
        log.info("session %d end: peer %s, %.1fs, peak %.1f MiB", config.session, config.peer,
                 time.monotonic() - started, peak / 2**20)


def os_memory_cap(limit: int, device_kind: str) -> str:
    """Hold this process to ``limit`` bytes more than it has mapped now, enforced by the
    OS, so that no accounting slip can take more of the host; returns what was set.

    On the CPU: RLIMIT_DATA (private writable mappings: the heap, torch's tensors), so an
    allocation past it fails (MemoryError, or torch's "can't allocate memory") and becomes
    a QUOTA error instead of an OOM kill; shared mappings (the arena) are the guest's. On
    CUDA, where the driver maps huge private ranges, no address-space limit can be set:
    the caching allocator caps device memory (``set_per_process_memory_fraction``) and
    host memory stays uncapped (see SECURITY.md)."""
    if device_kind == "cuda":
        import torch

        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
        return f"{limit} bytes of device memory, by the CUDA allocator"
    try:
        mapped = int(re.search(r"VmData:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) << 10
    except OSError:  # no /proc (macOS): accounting alone
        return "none: this host has no /proc"
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    soft = mapped + limit if hard == resource.RLIM_INFINITY else min(mapped + limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    return f"{limit} bytes past its start, by RLIMIT_DATA"
