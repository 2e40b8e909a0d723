"""A session's worker process: after the daemon forks it for a guest, build the executor
and (for a Unix guest) the shared ring region, welcome the guest, serve it, clean up."""

from __future__ import annotations

import fcntl
import logging
import os
import time

from ..protocol import PROTOCOL_VERSION
from ..protocol import messages as m
from ..transport import Arena, Channel, ConnectionClosed
from ..transport.arena import SEALS
from ..transport.doorbell import Doorbell
from ..transport.ivshmem import Region, RingChannel
from .session import Session, SessionConfig, device_message

log = logging.getLogger("apir.host")


def _unix_region(arena_size: int, session: int) -> tuple[Region, tuple[int, int, int]]:
    """A sealed memfd laid out as a ring region (control rings + bulk arena) and the two
    doorbell eventfds: (region fd, guest->host eventfd, host->guest eventfd)."""
    size = 1 << (max(arena_size, 4 << 20) - 1).bit_length()  # a power of two; rings come off the top
    fd = os.memfd_create(f"apir-session-{session}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    region = Region.create_fd(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # the guest can never resize it under us
    to_host, to_guest = Doorbell.pair()
    return region, (fd, to_host, to_guest)


def run_worker(chan: Channel, hello: m.Hello, config: SessionConfig, publish,
               arena: Arena | None = None) -> None:
    """Entry point of a session's worker process (after fork): build, welcome, serve.
    ``arena``: one the transport already shares with the guest (ivshmem), instead of a memfd."""
    started = time.monotonic()
    from ..backends.base import ExecutorConfig
    from ..backends.local import LocalBackend  # torch: only worker processes execute

    backend = LocalBackend(config.device, limits=config.limits, config=ExecutorConfig.from_env())
    fds: tuple[int, ...] = ()
    socket_chan, region, doorbell = chan, None, None
    if arena is None and chan.unix and hello.arena_size > 0:
        region, fds = _unix_region(min(hello.arena_size, config.max_arena), config.session)
        arena = region.arena()
    welcome = m.Welcome(PROTOCOL_VERSION, config.session, device_message(backend),
                        arena.size if arena else 0, config.limits.max_memory)
    from .. import env

    chan.spin_seconds = env.spin_seconds(backend.device().kind)  # the next step is µs away on a GPU
    if region is not None:
        # From here on frames travel through the region's rings; the socket stays open only
        # so each side notices when the other is gone.
        doorbell = Doorbell(notify_fd=fds[2], wait_fd=fds[1], sock=chan.sock)
        # the session's limits hold on the rings too: frame size, stalled frames
        chan = RingChannel(region, "host", max_body=socket_chan.max_body, io_timeout=config.io_timeout,
                           doorbell=doorbell)
        chan.spin_seconds = socket_chan.spin_seconds
    session = Session(chan, backend, arena, config, publish, liveness=getattr(socket_chan, "sock", None))
    try:
        if getattr(socket_chan, "sock", None) is not None:
            socket_chan.sock.settimeout(config.io_timeout)
        try:
            socket_chan.send(welcome, 0, fds=fds)
        except (ConnectionClosed, OSError):
            return  # the guest went away during its handshake
        session.serve()
    finally:
        peak = backend.peak_bytes
        backend.close()
        if arena:
            arena.close()
        chan.close()
        if region is not None:
            region.close()
            doorbell.close()
            socket_chan.close()
        publish(0, peak)
        log.info("session %d end: peer %s, %.1fs, peak %.1f MiB", config.session, config.peer,
                 time.monotonic() - started, peak / 2**20)
