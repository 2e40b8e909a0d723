"""A framed message channel over a connected stream socket (Unix, TCP or vsock).

Frames are ``apir.protocol`` frames. On Unix sockets a frame may carry file descriptors
(SCM_RIGHTS); the host uses that to hand the guest its shared arena.
"""

from __future__ import annotations

import array
import select
import socket
import time
from typing import NamedTuple

from ..errors import ApirError
from ..protocol import FrameHeader, ProtocolError, decode_body, decode_header, encode
from ..protocol.messages import HEADER, MAX_BODY

MAX_FDS = 4


class ConnectionClosed(ApirError):
    """The peer closed the connection (or died)."""


class Frame(NamedTuple):  # a tuple: made once per frame, on the hot path
    header: FrameHeader
    message: object
    fds: tuple[int, ...] = ()


class Channel:
    def __init__(self, sock: socket.socket, max_body: int = MAX_BODY) -> None:
        self.sock = sock
        self.max_body = max_body
        self.unix = sock.family == socket.AF_UNIX
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames, no batching
        self.bytes_sent = 0
        self.bytes_received = 0
        self.spin_seconds = 0.0  # poll this long before sleeping in recv (see _spin)

    def _spin(self) -> None:
        """Busy-poll for the next frame before blocking. A thread asleep in recv is woken
        by the scheduler tens to hundreds of microseconds late on an idle machine; a short
        spin on the hot path (a decode step's reply, the next step's request) avoids that.
        Costs one core while it spins; gives up and blocks after ``spin_seconds``."""
        deadline = time.perf_counter() + self.spin_seconds
        while time.perf_counter() < deadline:
            # select with a zero timeout, not a peeking recv: a socket with a timeout set
            # would make recv wait for data instead of returning at once
            if select.select([self.sock], [], [], 0)[0]:
                return  # data (or EOF) is there: the blocking read returns at once

    def send(self, msg: object, request_id: int = 0, flags: int = 0, fds: tuple[int, ...] = ()) -> None:
        self.send_frame(encode(msg, request_id, flags), fds)

    def send_frame(self, frame: bytes, fds: tuple[int, ...] = ()) -> None:
        """Send an encoded frame (the hot path builds its frames without message objects)."""
        try:
            if fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
                sent = self.sock.sendmsg([frame], anc)
                if sent < len(frame):
                    self.sock.sendall(frame[sent:])
            else:
                self.sock.sendall(frame)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise ConnectionClosed(f"connection lost while sending ({e.strerror})") from None
        self.bytes_sent += len(frame)

    def recv(self) -> Frame:
        """Read one whole frame; raises ConnectionClosed on EOF, ProtocolError on garbage."""
        header, body, fds = self.recv_frame()
        try:
            return Frame(header, decode_body(header.opcode, body), fds)
        except ProtocolError:
            for fd in fds:
                _close(fd)
            raise

    def recv_frame(self) -> tuple[FrameHeader, bytearray, tuple[int, ...]]:
        """One whole frame, its header checked, its body not decoded yet (a private copy)."""
        if self.spin_seconds:
            self._spin()
        raw, fds = self._recv_exact(HEADER.size, want_fds=self.unix)
        try:
            header = decode_header(raw, self.max_body)
        except ProtocolError:
            for fd in fds:
                _close(fd)
            raise
        body = self._recv_exact(header.length)[0] if header.length else bytearray()
        self.bytes_received += HEADER.size + header.length
        return header, body, fds

    def _recv_exact(self, n: int, want_fds: bool = False) -> tuple[bytearray, tuple[int, ...]]:
        buf = bytearray(n)
        view = memoryview(buf)
        got, fds = 0, []
        while got < n:
            try:
                if want_fds and got == 0:
                    size = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
                    k, anc, _, _ = self.sock.recvmsg_into([view[got:]], size)
                    for level, kind, data in anc:
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            a = array.array("i")
                            a.frombytes(data[: len(data) - len(data) % a.itemsize])
                            fds.extend(a)
                else:
                    k = self.sock.recv_into(view[got:])
            except (ConnectionResetError, BrokenPipeError):
                k = 0
            if k == 0:
                for fd in fds:
                    _close(fd)
                where = "between messages" if got == 0 else f"mid-frame ({got} of {n} bytes)"
                raise ConnectionClosed(f"the peer closed the connection {where}")
            got += k
        return buf, tuple(fds)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _close(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
