"""A session's connection: its frame channel, its shared arena, and how each side learns
that the other is gone — made here for every transport, so backends and the host map the
API and never look at sockets, descriptors or doorbells.

    transport  frames                              arena                  liveness
    unix       socket, then the region's rings     memfd region (sealed)  the socket
    tcp/vsock  socket                              none: bytes inline     the socket
    ivshmem    the region's rings (polling)        the PCI BAR's region   the region's flags

On unix the region is the host's answer to the guest's Hello: its descriptors come with
the Welcome (``apir.transport.shm``), and both sides switch to its rings after it.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ApirError
from ..protocol import WANT_REPLY, ProtocolError
from ..protocol import messages as m
from .address import Address, default_socket_path, parse_address
from .arena import Arena
from .channel import Channel, ConnectionClosed, SocketChannel
from .doorbell import Doorbell
from .shm import Region, RingChannel, attach_region, unix_region

CONNECT_TIMEOUT = 10.0  # reaching the host's socket; the session's own timeout applies after


class HostUnreachable(ApirError):
    """Nobody answers at the address the guest was given."""


@dataclass(eq=False)
class Connection:
    """One session's link to its peer. ``liveness``: a socket whose hang-up means the peer
    is gone (None where the channel notices that itself)."""

    channel: Channel
    address: str
    arena: Arena | None = None
    liveness: socket.socket | None = None
    # closed after the channel and the arena, in this order (region, doorbell, socket)
    parts: list[Region | Doorbell | Channel] = field(default_factory=list)

    @classmethod
    def over(cls, sock: socket.socket, address: str, max_body: int = m.MAX_BODY) -> Connection:
        """A connection over a connected stream socket (it may switch to rings later)."""
        return cls(SocketChannel(sock, max_body), address, liveness=sock)

    def close(self) -> None:
        self.channel.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        for part in self.parts:
            part.close()
        self.parts = []


def connect(url: str | None, hello: m.Hello, timeout: float | None = None) -> tuple[Connection, object]:
    """Guest side: reach the host at ``url`` (unix, tcp, vsock, or ivshmem for a VM's
    shared memory), say ``hello`` and return the connection with the host's answer: a
    Welcome (the connection then has the session's arena, where the transport shares
    memory), a Status, or an Error. ``hello.arena_size`` is what the guest wants; over
    tcp and vsock it asks for none. ``timeout`` bounds every wait for the host."""
    if url is not None and url.split("://", 1)[0] == "ivshmem":
        from .ivshmem import guest_region

        region = guest_region(url)
        conn = Connection(RingChannel(region, "guest", timeout=timeout), url, region.arena(), parts=[region])
    else:
        address = parse_address(url)
        sock = _dial(address)
        sock.settimeout(timeout)
        conn = Connection.over(sock, str(address))
        if address.scheme != "unix":
            hello = dataclasses.replace(hello, arena_size=0)
    try:
        conn.channel.send(hello, 0, WANT_REPLY)
        frame = conn.channel.recv()
        if len(frame.fds) == 3 and isinstance(frame.message, m.Welcome) and conn.liveness is not None:
            _switch_to_region(conn, conn.liveness, frame.fds, frame.message.arena_size, timeout)
        else:
            for fd in frame.fds:
                os.close(fd)
        reply = frame.message
        if isinstance(reply, m.Welcome) and conn.arena is not None and reply.arena_size != conn.arena.size:
            raise ProtocolError(f"the host granted a {reply.arena_size}-byte arena, the shared region "
                                f"holds {conn.arena.size}")
    except BaseException:
        conn.close()
        raise
    return conn, reply


def _switch_to_region(conn: Connection, sock: socket.socket, fds: tuple[int, ...], arena_size: int,
                      timeout: float | None) -> None:
    """A unix session's Welcome brought its region: frames stop travelling on the socket."""
    sock_chan = conn.channel
    region, doorbell = attach_region((fds[0], fds[1], fds[2]), arena_size, sock)
    conn.channel = RingChannel(region, "guest", timeout=timeout, doorbell=doorbell)
    conn.arena = region.arena()
    conn.parts = [region, doorbell, sock_chan]


def accept(conn: Connection, welcome: Callable[[int], m.Welcome], arena_size: int, io_timeout: float,
           name: str) -> Connection:
    """Host side, after the guest's Hello: welcome it and return the connection the
    session serves on. A unix guest that wants ``arena_size`` > 0 bytes of arena gets a
    fresh region (``name`` names its memfd), sent with the Welcome; after it frames use
    the region's rings. ``welcome(granted)`` makes the Welcome for the arena granted.
    Raises ConnectionClosed when the guest went away during its handshake."""
    sock = conn.liveness
    conn.channel.set_timeout(io_timeout)
    if sock is None or sock.family != socket.AF_UNIX or conn.arena is not None or arena_size <= 0:
        reply = welcome(conn.arena.size if conn.arena is not None else 0)
        _send_welcome(conn, reply, ())
        return conn
    region, fds = unix_region(arena_size, name)
    # the session's limits hold on the rings too: frame size, stalled frames
    doorbell = Doorbell(notify_fd=fds[2], wait_fd=fds[1], sock=sock)
    rings = Connection(RingChannel(region, "host", max_body=conn.channel.max_body, io_timeout=io_timeout,
                                   doorbell=doorbell), conn.address, region.arena(), sock,
                       [region, doorbell, conn.channel])
    try:
        _send_welcome(conn, welcome(region.arena_size), fds)
    except BaseException:
        rings.close()
        raise
    return rings


def _send_welcome(conn: Connection, reply: m.Welcome, fds: tuple[int, ...]) -> None:
    try:
        conn.channel.send(reply, 0, fds=fds)
    except OSError as e:
        raise ConnectionClosed(f"the guest went away during its handshake ({e})") from None


def _dial(address: Address) -> socket.socket:
    """A socket connected to the host at ``address``; failures name it and what to do."""
    sock = socket.socket(address.family, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT)
    try:
        sock.connect(address.sockaddr)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        sock.close()
        command = "apir host" + (
            f" --listen {address}" if address.scheme != "unix" or Path(address.path) != default_socket_path() else ""
        ) + (" --token-file FILE" if address.scheme != "unix" else "")
        hint = f"start one with `{command}`" + (
            " (FILE: a secret the guest passes too)" if address.scheme != "unix" else "")
        what = "no socket there" if isinstance(e, FileNotFoundError) else "connection refused"
        raise HostUnreachable(f"no apir host is listening at {address} ({what}): {hint}") from None
    except (TimeoutError, OSError) as e:
        sock.close()
        raise HostUnreachable(f"cannot reach an apir host at {address}: {e.strerror or e}") from None
    return sock
