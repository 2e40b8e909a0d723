"""Framed message channels: what every transport offers (``Channel``), and the one over
a connected stream socket (Unix, TCP or vsock).

Frames are ``apir.protocol`` frames. On Unix sockets a frame may carry file descriptors
(SCM_RIGHTS); the host uses that to hand the guest its shared region.
"""

from __future__ import annotations

import array
import select
import socket
import time
from typing import NamedTuple, Protocol

from ..errors import ApirError
from ..protocol import FrameHeader, ProtocolError, decode_body, decode_header, encode
from ..protocol.messages import HEADER, MAX_BODY

MAX_FDS = 4
RECV_BUFFER = 1 << 16  # one read takes in a small frame whole (header and body), often more
_CMSG_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def spin_seconds(device_kind: str, spin_us: int | None = None) -> float:
    """How long a channel busy-polls for a frame: ``spin_us`` when given (APIR_SPIN_US),
    else only where a GPU does the compute, long enough to cover a prefill chunk and the
    gap between a client's requests: a side asleep on its eventfd is woken late (on an
    H200, 135M pp512 through remote kept 0.90 of native with 2 ms on both sides and with
    50 ms on the guest alone, 0.965 with 50 ms on both)."""
    return (spin_us if spin_us is not None else 50000 if device_kind != "cpu" else 0) / 1e6


class ConnectionClosed(ApirError):
    """The peer closed the connection (or died)."""


class Frame(NamedTuple):  # a tuple: made once per frame, on the hot path
    header: FrameHeader
    message: object
    fds: tuple[int, ...] = ()


class Channel(Protocol):
    """Frames to and from the peer: a socket (``SocketChannel``) or shared-memory rings
    (``apir.transport.shm.RingChannel``)."""

    max_body: int  # the largest frame body accepted
    spin_seconds: float  # busy-poll this long for the next frame before sleeping

    def send(self, msg: object, request_id: int = 0, flags: int = 0, fds: tuple[int, ...] = ()) -> None: ...

    def send_frame(self, frame: bytes, fds: tuple[int, ...] = ()) -> None:
        """Send an encoded frame (the hot path builds its frames without message objects)."""

    def recv(self) -> Frame: ...

    def recv_frame(self) -> tuple[FrameHeader, bytearray, tuple[int, ...]]:
        """One whole frame, its header checked, its body not decoded yet (a private copy)."""

    def frame_ready(self) -> bool:
        """Whether the next frame (or the peer's going) has begun to arrive; never waits."""

    def wait_idle(self) -> None:
        """Wait, with no time limit, until the next frame starts to arrive."""

    def set_timeout(self, seconds: float) -> None:
        """How long a started frame may take to arrive, and a frame to be sent."""

    def close(self) -> None: ...


class SocketChannel:
    def __init__(self, sock: socket.socket, max_body: int = MAX_BODY) -> None:
        self.sock = sock
        self.max_body = max_body
        self.unix = sock.family == socket.AF_UNIX
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames, no batching
        self.spin_seconds = 0.0  # poll this long before sleeping in recv (see _spin)
        # Bytes read from the socket but not consumed yet: [_start, _end) of _buf. Reading
        # into a buffer takes a small frame in one system call instead of two.
        self._buf = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._fds: list[int] = []  # descriptors received with the frame being read
        self._arrived = False  # wait_idle saw the next frame arrive: recv_frame need not spin

    def buffered(self) -> bool:
        """Whether the next frame has begun to arrive already (a poll on the socket would
        not say so: its bytes were read with the previous frame's)."""
        return self._end > self._start

    def frame_ready(self) -> bool:
        """Whether the next frame (or EOF) has begun to arrive: a check that never waits.
        A select with a zero timeout, not a peeking recv: a socket with a timeout set would
        make recv wait for data instead of returning at once."""
        return self.buffered() or bool(select.select([self.sock], [], [], 0)[0])

    def _spin(self) -> bool:
        """Busy-poll for the next frame before blocking. A thread asleep in recv is woken
        by the scheduler tens to hundreds of microseconds late on an idle machine; a short
        spin on the hot path (a decode step's reply, the next step's request) avoids that.
        Costs one core while it spins; gives up after ``spin_seconds`` (returns False)."""
        deadline = time.perf_counter() + self.spin_seconds
        while time.perf_counter() < deadline:
            if self.frame_ready():
                return True  # data (or EOF) is there: the blocking read returns at once
        return False

    def wait_idle(self) -> None:
        """Block, with no timeout, until the next frame starts to arrive (after the short
        spin): a server's wait between requests, which may last as long as its user
        thinks. The frame's own reads then run under the socket's timeout."""
        if not self.buffered() and not self._spin():
            idle = select.poll()
            idle.register(self.sock, select.POLLIN)
            idle.poll()
        self._arrived = True

    def set_timeout(self, seconds: float) -> None:
        self.sock.settimeout(seconds)

    def send(self, msg: object, request_id: int = 0, flags: int = 0, fds: tuple[int, ...] = ()) -> None:
        self.send_frame(encode(msg, request_id, flags), fds)

    def send_frame(self, frame: bytes, fds: tuple[int, ...] = ()) -> None:
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
        if self.spin_seconds and not self._arrived and not self.buffered():
            self._spin()
        self._arrived = False
        try:
            header = decode_header(self._take(HEADER.size, frame_start=True), self.max_body)
            body = self._take(header.length) if header.length else bytearray()
        except (ProtocolError, ConnectionClosed, OSError):
            self._drop_fds()
            raise
        fds, self._fds = tuple(self._fds), []
        return header, body, fds

    def _take(self, n: int, frame_start: bool = False) -> bytearray:
        """The stream's next ``n`` bytes: from the buffer, refilled by reads as large as the
        socket allows; a body larger than the buffer is read straight into its place."""
        start, end = self._start, self._end
        if end - start >= n:
            self._start = start + n
            return self._buf[start : start + n]
        out, got = bytearray(n), end - start
        out[:got] = self._view[start:end]
        self._start = self._end = 0
        view = memoryview(out)
        while got < n:
            big = n - got >= RECV_BUFFER
            k = self._recv_into(view[got:] if big else self._view)
            if k == 0:
                where = "between messages" if frame_start and got == 0 else f"mid-frame ({got} of {n} bytes)"
                raise ConnectionClosed(f"the peer closed the connection {where}")
            if big:
                got += k
            else:
                used = min(k, n - got)
                out[got : got + used] = self._view[:used]
                self._start, self._end = used, k
                got += used
        return out

    def _recv_into(self, view: memoryview) -> int:
        """One read (with any descriptors, on Unix sockets); 0 at EOF."""
        try:
            if self.unix:
                k, anc, _, _ = self.sock.recvmsg_into([view], _CMSG_SPACE)
                for level, kind, data in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        a = array.array("i")
                        a.frombytes(data[: len(data) - len(data) % a.itemsize])
                        self._fds.extend(a)
            else:
                k = self.sock.recv_into(view)
        except (ConnectionResetError, BrokenPipeError):
            return 0
        return k

    def _drop_fds(self) -> None:
        for fd in self._fds:
            _close(fd)
        self._fds = []

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
