"""A guest that speaks the wire protocol by hand, for hostile tests: it can send anything.

``RawGuest`` does the handshake itself (or not), sends messages with or without
WANT_REPLY, sends raw bytes, and reads replies with a timeout. Every Error it reads is
checked for leaks (host paths, hex addresses) before the test sees it.
"""

from __future__ import annotations

import array
import mmap
import os
import re
import socket
import struct
import time

from hosts import WAIT

from apir.protocol import messages as m

LEAK = re.compile(r"0x[0-9a-fA-F]{5,}|(?<![\w.:/])/(?:usr|home|work|tmp|proc|opt|root|var|etc|lib)\b"
                  r"|site-packages|\.py\b|\.so\b")


def assert_no_leak(text: str) -> None:
    assert not LEAK.search(text), f"reply leaks host details: {text!r}"


class Closed(Exception):
    """The host closed the connection."""


class RawGuest:
    def __init__(self, address: str, *, hello: bool = True, token: str = "", arena_size: int = 0,
                 timeout: float = WAIT) -> None:
        if address.startswith("unix://"):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(address.removeprefix("unix://"))
        else:
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)))
        self.sock.settimeout(timeout)
        self.timeout = timeout
        self.rid = 0
        self.welcome: m.Welcome | None = None
        self.arena: mmap.mmap | memoryview | None = None
        self.ring = None  # unix sessions with an arena switch to the shared rings after the Welcome
        if hello:
            reply, fds = self.call_fds(m.Hello(m.PROTOCOL_VERSION, m.op_table_hash(), token, "test",
                                               arena_size))
            assert isinstance(reply, m.Welcome), reply
            self.welcome = reply
            if len(fds) == 3:
                from apir.transport.doorbell import Doorbell
                from apir.transport.shm import Region, RingChannel

                self.region = Region.open_fd(fds[0])
                self.ring = RingChannel(self.region, "guest", timeout=timeout,
                                        doorbell=Doorbell(fds[1], fds[2], self.sock))
                self.arena = self.region.view[self.region.arena_offset:][: reply.arena_size]
            elif fds:
                self.arena = mmap.mmap(fds[0], reply.arena_size)
                for fd in fds:
                    os.close(fd)

    # ------------------------------------------------------------ sending
    def send(self, msg: object, want: bool = True) -> int:
        self.rid += 1
        self.send_raw(m.encode(msg, self.rid, m.WANT_REPLY if want else 0))
        return self.rid

    def send_raw(self, data: bytes, fds: tuple[int, ...] = ()) -> None:
        if self.ring is not None and not fds:
            self.ring._write(data)
        elif fds:
            self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
        else:
            self.sock.sendall(data)

    def post(self, msg: object) -> None:
        """Send without asking for a reply (the frontend's fire-and-forget requests)."""
        self.send(msg, want=False)

    # ------------------------------------------------------------ receiving
    def _exact(self, n: int, fds: list[int]) -> bytes:
        if self.ring is not None:
            from apir.transport import ConnectionClosed

            try:
                return self.ring._read(n, time.monotonic() + self.timeout, "test read")
            except ConnectionClosed:
                raise Closed("the host closed the shared rings") from None
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            size = socket.CMSG_SPACE(4 * array.array("i").itemsize)
            try:
                k, anc, _, _ = self.sock.recvmsg_into([view[got:]], size)
            except ConnectionResetError:
                k, anc = 0, []
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(raw[: len(raw) - len(raw) % a.itemsize])
                    fds.extend(a)
            if not k:
                raise Closed(f"connection closed after {got} of {n} bytes")
            got += k
        return bytes(buf)

    def recv_fds(self) -> tuple[object, tuple[int, ...], m.FrameHeader]:
        fds: list[int] = []
        header = m.decode_header(self._exact(m.HEADER.size, fds))
        body = self._exact(header.length, fds) if header.length else b""
        msg = m.decode_body(header.opcode, body)
        if isinstance(msg, m.Error):
            assert_no_leak(msg.message)
        return msg, tuple(fds), header

    def recv(self) -> object:
        msg, fds, _ = self.recv_fds()
        for fd in fds:
            os.close(fd)
        return msg

    def call_fds(self, msg: object) -> tuple[object, tuple[int, ...]]:
        self.send(msg)
        reply, fds, _ = self.recv_fds()
        return reply, fds

    def call(self, msg: object) -> object:
        self.send(msg)
        return self.recv()

    def error(self, msg: object) -> m.Error:
        """Send ``msg`` wanting a reply; the reply must be an Error."""
        reply = self.call(msg)
        assert isinstance(reply, m.Error), f"expected an Error for {msg!r:.200}, got {reply!r:.200}"
        return reply

    def ok(self, msg: object) -> object:
        reply = self.call(msg)
        assert not isinstance(reply, m.Error), f"{msg!r:.200} failed: {reply.message}"
        return reply

    def closed_by_host(self, timeout: float = WAIT) -> bool:
        """True once the host has closed the connection (reading past any last replies)."""
        if self.ring is not None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.ring._peer_gone():
                    return True
                time.sleep(0.01)
            return False
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.arena.release()
            self.arena = None
            self.ring.doorbell.close()
            self.region.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.sock.close()

    def __enter__(self) -> RawGuest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def frame(opcode: int, body: bytes = b"", rid: int = 1, flags: int = m.WANT_REPLY, *,
          magic: bytes = m.MAGIC, length: int | None = None) -> bytes:
    """A hand-made frame: any opcode, flags, length field and body."""
    return struct.pack("<4sHHII", magic, opcode, flags, rid, len(body) if length is None else length) + body


def body_of(msg: object) -> bytes:
    return m.encode(msg)[m.HEADER.size:]
