"""A session's worker process. The daemon forks it ahead of its guest (or for it, with no
idle worker left): it initialises the device (``warm_up``), says READY, and waits on its
socketpair with the daemon for a ``Bind``, the one message it ever reads from there, which
comes with the guest's socket (SCM_RIGHTS); only the daemon holds the other end. Then
``run_worker``: build the executor, welcome the guest (a Unix guest gets its shared
region: see ``apir.transport.accept``), serve it, clean up.
"""

from __future__ import annotations

import functools
import logging
import socket
import struct
import time
from dataclasses import dataclass

from ..backends.base import ExecutorConfig
from ..errors import ApirError
from ..protocol import PROTOCOL_VERSION, ProtocolError
from ..protocol import messages as m
from ..transport import Channel, Connection, ConnectionClosed, accept, spin_seconds
from .session import Session, SessionConfig, device_message

log = logging.getLogger("apir.host")

READY = b"ready"  # a warm worker to the daemon: the device is initialised
# Bind := i64 session, i64 slot, u32 n, n bytes peer (UTF-8), then the guest's Hello as
# a whole frame (token blanked), read back by the protocol's own decoder.
_BIND = struct.Struct("<qqI")
BIND_MAX = 8192  # a Hello is at most HANDSHAKE_MAX (4 KiB) bytes
MAX_SLOTS = 1024  # sessions a daemon can account for at once (a Bind's slot indexes them)


@dataclass(frozen=True)
class Bind:
    """The daemon's hand-over of a session to a warm worker."""

    session: int
    slot: int
    peer: str
    hello: m.Hello

    def encode(self) -> bytes:
        peer = self.peer.encode()
        return _BIND.pack(self.session, self.slot, len(peer)) + peer + m.encode(self.hello)

    @staticmethod
    def decode(data: bytes) -> Bind:
        if len(data) < _BIND.size:
            raise ProtocolError("truncated Bind")
        session, slot, n = _BIND.unpack_from(data)
        if session <= 0 or not 0 <= slot < MAX_SLOTS or _BIND.size + n + m.HEADER.size > len(data):
            raise ProtocolError(f"bad Bind (session {session}, slot {slot}, peer of {n} bytes)")
        peer = data[_BIND.size : _BIND.size + n].decode(errors="replace")
        frame = data[_BIND.size + n :]
        header = m.decode_header(frame[: m.HEADER.size], BIND_MAX)
        hello = m.decode_body(header.opcode, frame[m.HEADER.size :])
        if not isinstance(hello, m.Hello) or header.length != len(frame) - m.HEADER.size:
            raise ProtocolError("a Bind must carry exactly one Hello")
        return Bind(session, slot, peer, hello)


def warm_up(device: str | None, executor: ExecutorConfig) -> None:
    """Pay now what a session's worker pays before its first request: the host backend's
    imports and, on a GPU, the device's context (~5 s on CUDA) and the compiler's imports
    (dynamo and inductor: 2-4 s) when its decode step will be compiled. Called after the
    fork: CUDA does not survive one."""
    import torch

    from ..backends.local.executor import pick_device

    dev = pick_device(device)
    if dev.type != "cpu":
        torch.zeros(1, device=dev)  # creates the context
    if dev.type == "cuda" and executor.cuda_graphs and executor.compile != "off":
        import torch._inductor.compile_fx  # noqa: F401


def wait_for_bind(pool: socket.socket) -> tuple[Bind, socket.socket] | None:
    """Tell the daemon this worker is ready, then wait for its session: the ``Bind`` and
    the guest's socket. None: the daemon closed the pool (it is stopping)."""
    try:
        pool.sendall(READY)
    except BrokenPipeError:  # bound while starting: the daemon has closed its end already
        pass
    data, fds, _, _ = socket.recv_fds(pool, BIND_MAX, 1)
    socks = [socket.socket(fileno=fd) for fd in fds]
    if not data:
        for s in socks:
            s.close()
        return None
    if len(socks) != 1:
        raise ApirError(f"a Bind came with {len(socks)} sockets, not the guest's one")
    socks[0].setblocking(True)
    return Bind.decode(data), socks[0]


def _notify(chan: Channel, text: str) -> None:
    """Tell the guest, whose reply is about to wait on ``text`` (see ``m.Notice``)."""
    try:
        chan.send(m.Notice(text))
    except (ConnectionClosed, TimeoutError, OSError, ProtocolError):
        pass  # the guest is gone or not reading: the reply's send finds out and ends the session


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
        backend.on_compile = functools.partial(_notify, conn.channel)
        Session(conn.channel, backend, conn.arena, config, publish, liveness=conn.liveness).serve()
    finally:
        peak = backend.peak_bytes
        backend.close()
        conn.close()
        publish(0, peak)
        log.info("session %d end: peer %s, %.1fs, peak %.1f MiB", config.session, config.peer,
                 time.monotonic() - started, peak / 2**20)
