"""Wake-ups for the shared-memory rings when guest and host share a kernel (Unix guests).

Each direction has an eventfd: a side that published bytes rings the other's; a side with
nothing to read (after its short spin) sleeps in select() on its own eventfd *and* the
session's Unix socket. After the handshake nothing travels on that socket any more, so
it becoming readable means the peer closed it or died — that is how either side notices
the other is gone without a timeout. (A VM guest has neither eventfd nor the socket; its
ring polls instead, see ``apir.transport.shm``.)

Lost wake-ups cannot happen: an eventfd is a counter, so a ring between the sleeper's
last check and its select() leaves the counter non-zero and select() returns at once.
"""

from __future__ import annotations

import os
import select
import socket


class Doorbell:
    def __init__(self, notify_fd: int, wait_fd: int, sock: socket.socket) -> None:
        self.notify_fd, self.wait_fd, self.sock = notify_fd, wait_fd, sock
        self._gone = False

    @staticmethod
    def pair() -> tuple[int, int]:
        """Two fresh eventfds: (guest -> host, host -> guest)."""
        flags = os.EFD_CLOEXEC | os.EFD_NONBLOCK
        return os.eventfd(0, flags), os.eventfd(0, flags)

    def ring(self) -> None:
        try:
            os.eventfd_write(self.notify_fd, 1)
        except OSError:
            pass  # a full counter (2^64-2 rings pending) already wakes the peer

    def wait(self, timeout: float) -> None:
        """Sleep until rung, until the socket speaks (the peer went away), or ``timeout``."""
        if self._gone:
            return
        watch: list[int | socket.socket] = [self.wait_fd, self.sock]
        ready, _, _ = select.select(watch, [], [], timeout)
        if self.wait_fd in ready:
            try:
                os.eventfd_read(self.wait_fd)  # reset the counter
            except BlockingIOError:
                pass
        if self.sock in ready:
            self._gone = True  # EOF, or bytes nobody may send after the handshake

    def alive(self) -> bool:
        """False once the socket is readable: EOF, or bytes nobody may send any more.
        (select, not a peeking recv: a socket with a timeout would make recv wait.)"""
        if not self._gone and select.select([self.sock], [], [], 0)[0]:
            self._gone = True
        return not self._gone

    def close(self) -> None:
        for fd in (self.notify_fd, self.wait_fd):
            try:
                os.close(fd)
            except OSError:
                pass
