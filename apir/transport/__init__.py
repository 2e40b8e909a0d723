"""Moving protocol frames between guest and host: connections (channel, arena, liveness)
over unix, tcp, vsock and ivshmem; listening sockets; addresses."""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

from .address import Address, AddressError, default_socket_path, parse_address
from .arena import Arena, ArenaError, ArenaRing
from .channel import Channel, ConnectionClosed, Frame, SocketChannel, spin_seconds
from .connection import Connection, HostUnreachable, accept, connect


def listen(address: Address, group: int | None = None, backlog: int = 64) -> socket.socket:
    """A listening socket. Unix sockets are created owner-only (0600), or 0660 for ``group``,
    in a directory only the owner can enter; a stale socket file is replaced."""
    sock = socket.socket(address.family, socket.SOCK_STREAM)
    if address.scheme == "unix":
        path = Path(address.path)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise AddressError(f"{path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
                probe.close()
                raise AddressError(f"another apir host is already listening at {address}")
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink()
            finally:
                probe.close()
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        if group is not None:
            os.chown(path, -1, group)
            os.chmod(path, 0o660)
    else:
        if address.scheme == "tcp":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address.sockaddr)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise AddressError(f"{address} is already in use") from None
            raise AddressError(f"cannot listen on {address}: {e.strerror}") from None
    sock.listen(backlog)
    return sock


__all__ = [
    "Address", "AddressError", "Arena", "ArenaError", "ArenaRing", "Channel", "Connection", "ConnectionClosed",
    "Frame", "HostUnreachable", "SocketChannel", "accept", "connect", "default_socket_path", "listen",
    "parse_address", "spin_seconds",
]
