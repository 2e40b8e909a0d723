"""A session's worker process: after the daemon forks it for a guest, build the executor,
welcome the guest (a Unix guest gets its shared region: see ``apir.transport.accept``),
serve it, clean up."""

from __future__ import annotations

import logging
import time

from ..protocol import PROTOCOL_VERSION
from ..protocol import messages as m
from ..transport import Connection, ConnectionClosed, accept, spin_seconds
from .session import Session, SessionConfig, device_message

log = logging.getLogger("apir.host")


def run_worker(conn: Connection, hello: m.Hello, config: SessionConfig, publish) -> None:
    """Entry point of a session's worker process (after fork): build, welcome, serve.
    ``conn``: the guest's connection as the handshake left it (a socket, or a VM's rings
    and arena)."""
    started = time.monotonic()
    from ..backends.local import LocalBackend  # torch: only worker processes execute

    backend = LocalBackend(config.device, limits=config.limits, config=config.executor)
    device = device_message(backend)

    def welcome(arena_size: int) -> m.Welcome:
        return m.Welcome(PROTOCOL_VERSION, config.session, device, arena_size, config.limits.max_memory)

    try:
        try:
            conn = accept(conn, welcome, min(hello.arena_size, config.max_arena), config.io_timeout,
                          f"apir-session-{config.session}")
        except ConnectionClosed:
            return  # the guest went away during its handshake
        conn.channel.spin_seconds = spin_seconds(device.kind, config.spin_us)  # the next step is µs away on a GPU
        Session(conn.channel, backend, conn.arena, config, publish, liveness=conn.liveness).serve()
    finally:
        peak = backend.peak_bytes
        backend.close()
        conn.close()
        publish(0, peak)
        log.info("session %d end: peer %s, %.1fs, peak %.1f MiB", config.session, config.peer,
                 time.monotonic() - started, peak / 2**20)
