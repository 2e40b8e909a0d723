"""The host end of a VM's shared-memory region: one session, the daemon's rules.

``serve_region`` waits for the guest's Hello in the region's request ring, checks it with
the daemon's own check (``host.handshake.check_hello``: size, message type, protocol
version, op table), and then runs the same session worker (``run_worker``: dispatcher,
executor, quotas) with the region's arena in place of a memfd. Who may talk to this
region is decided by who can map it: the file is 0600 and handed to exactly one QEMU, so
there is no token to check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..backends.base import DEFAULT_EXECUTOR, ExecutorConfig, Limits
from ..host.handshake import HANDSHAKE_MAX, check_hello
from ..protocol import ErrorCode, ProtocolError
from ..protocol import messages as m
from ..transport import Connection, ConnectionClosed
from ..transport.shm import Region, RingChannel

log = logging.getLogger("apir.host")


def serve_region(region: Region, device: str | None = None, alive: Callable[[], bool] | None = None,
                 handshake_timeout: float = 300.0, io_timeout: float = 60.0,
                 limits: Limits | None = None, spin_us: int | None = None,
                 executor: ExecutorConfig = DEFAULT_EXECUTOR) -> bool:
    """Serve the one session of ``region``; False when no valid handshake came (the guest
    never connected in time, died, or sent something else first)."""
    from ..host.session import SessionConfig  # torch is imported by the worker
    from ..host.worker import run_worker

    chan = RingChannel(region, "host", max_body=HANDSHAKE_MAX, timeout=handshake_timeout,
                       io_timeout=io_timeout, alive=alive)
    try:
        frame = chan.recv()
    except (ConnectionClosed, TimeoutError) as e:
        log.warning("no guest handshake on the shared region: %s", e)
        chan.close()
        return False
    except ProtocolError as e:
        _refuse(chan, m.Error(ErrorCode.PROTOCOL, str(e)))
        return False
    err = check_hello(frame.message, None)
    if err is None and frame.message.status_only:
        err = m.Error(ErrorCode.INVALID, "a VM's shared-memory channel serves one session, no status")
    if err is not None:
        _refuse(chan, err)
        return False
    chan.max_body, chan.timeout = m.MAX_BODY, None  # idle waits end when the guest or VM does
    config = SessionConfig(device, limits or Limits(), region.arena_size, 1, "ivshmem:vm", io_timeout,
                           spin_us, executor)
    log.info("session 1 start: peer ivshmem:vm, client %r", frame.message.client[:80])
    run_worker(Connection(chan, "ivshmem:vm", region.arena()), frame.message, config, lambda allocated, peak: None)
    return True


def _refuse(chan: RingChannel, err: m.Error) -> None:
    log.warning("refused the guest: %s", err.message)
    try:
        chan.send(err)
    except (ConnectionClosed, TimeoutError, ProtocolError):
        pass
    chan.close()
