"""Transports below the session: the socket channel's buffered reads, and the Unix
transport's shared-memory rings and eventfd doorbells across real processes."""

from __future__ import annotations

import os
import select
import socket
import threading
import time

import pytest
from hosts import WAIT

from apir.protocol import messages as m
from apir.transport import ConnectionClosed, SocketChannel, shm
from apir.transport.channel import RECV_BUFFER
from apir.transport.doorbell import Doorbell
from apir.transport.shm import Region, RingChannel


def test_socket_frames_in_any_pieces():
    """Frames read through the channel's buffer: several in one read, one split across
    many, bodies larger than the buffer, and descriptors with the frame they came with."""
    a, b = socket.socketpair()
    reader = SocketChannel(b)
    frames = [m.encode(m.Synchronize(), 1), m.encode(m.Data(m.Blob(b"x" * 100, -1, 100)), 2),
              m.encode(m.Data(m.Blob(bytes(range(256)) * (RECV_BUFFER // 64), -1, RECV_BUFFER * 4)), 3)]
    a.sendall(b"".join(frames[:2]))  # two frames in one read
    assert reader.recv().message == m.Synchronize() and reader.buffered()
    assert reader.recv().message.data.size == 100 and not reader.buffered()

    def dribble(data: bytes) -> None:
        for i in range(0, len(data), 7000):
            a.sendall(data[i : i + 7000])
            time.sleep(0.001)

    t = threading.Thread(target=dribble, args=(frames[2] + frames[0],))
    t.start()
    big = reader.recv()
    assert big.header.request_id == 3 and big.message.data.inline == bytes(range(256)) * (RECV_BUFFER // 64)
    assert reader.recv().header.request_id == 1
    t.join()
    r, w = os.pipe()
    a.sendmsg([frames[0]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, r.to_bytes(4, "little"))])
    a.sendall(frames[1])
    first, second = reader.recv(), reader.recv()
    assert len(first.fds) == 1 and second.fds == ()
    for fd in (r, w, *first.fds):
        os.close(fd)
    a.sendall(frames[0][:5])
    a.close()
    with pytest.raises(ConnectionClosed, match=r"mid-frame \(5 of 16 bytes\)"):
        reader.recv()
    reader.close()


def test_socket_eof_between_frames():
    a, b = socket.socketpair()
    a.close()
    with pytest.raises(ConnectionClosed, match="between messages"):
        SocketChannel(b).recv()
    b.close()


def test_doorbells_lose_no_wake_up(monkeypatch):
    """Round trips between two processes that go to sleep on their eventfd between frames,
    after spins of every length up to about a round trip, so that frames keep arriving just
    as the reader goes to sleep. A side rings only when the other says it may be asleep; a
    lost wake-up would leave a side asleep until the doorbell's re-check, made a minute
    here: a sleep that lasts until then fails the test (the peer always sends next)."""
    real_wait = Doorbell.wait

    def wait(self, timeout: float) -> None:
        if not select.select([self.wait_fd, self.sock], [], [], timeout)[0]:
            raise AssertionError(f"asleep for {timeout:g}s with a live peer: a wake-up was lost")
        real_wait(self, 0)

    monkeypatch.setattr(Doorbell, "wait", wait)
    monkeypatch.setattr(shm, "MAX_DOORBELL_WAIT", WAIT)
    n = 4000
    fd = os.memfd_create("apir-test", os.MFD_CLOEXEC)
    region = Region.create_fd(fd, 4 << 20, ring_size=4096)
    to_host, to_guest = Doorbell.pair()
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the host: echo every request
        code = 1
        try:
            host = RingChannel(Region.open_fd(os.dup(fd)), "host", doorbell=Doorbell(to_guest, to_host, theirs))
            for i in range(n):
                host.spin_seconds = _spin(i)
                frame = host.recv()
                host.send(m.Ok(), frame.header.request_id)
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    guest = RingChannel(region, "guest", timeout=WAIT, doorbell=Doorbell(to_host, to_guest, mine))
    try:
        for i in range(n):
            guest.spin_seconds = _spin(i * 7)
            guest.send(m.Synchronize(), i, m.WANT_REPLY)
            assert guest.recv().header.request_id == i
    finally:
        guest.close()
        _, status = os.waitpid(pid, 0)
        guest.doorbell.close()
        mine.close()
        region.close()
    assert os.waitstatus_to_exitcode(status) == 0  # the host side lost no wake-up either


def _spin(i: int) -> float:
    return (i % 100) * 1e-6  # 0 to 99 us


class _Bell:
    """A doorbell that records what the channel does with it."""

    def __init__(self) -> None:
        self.rings = self.waits = 0

    def ring(self) -> None:
        self.rings += 1

    def wait(self, timeout: float) -> None:
        self.waits += 1

    def alive(self) -> bool:
        return True


def _pair_on(region: Region) -> tuple[RingChannel, RingChannel]:
    return (RingChannel(region, "guest", doorbell=_Bell(), timeout=1),
            RingChannel(region, "host", doorbell=_Bell(), timeout=1))


def test_a_writer_rings_only_a_reader_that_may_be_asleep():
    region = Region.create_fd(os.memfd_create("apir-test", os.MFD_CLOEXEC), 4 << 20, ring_size=4096)
    guest, host = _pair_on(region)
    guest.send(m.Ok())
    assert guest.doorbell.rings == 0  # the host is not asleep: no system call
    host._asleep.value = 1  # the host is going to sleep
    guest.send(m.Ok())
    assert guest.doorbell.rings == 1
    host.close()
    guest.close()
    region.close()


def test_a_reader_looks_once_more_after_saying_it_sleeps():
    """A frame published just before the flag went up (the writer saw no flag, so did not
    ring) is found by the last look, and the reader does not sleep through it."""
    region = Region.create_fd(os.memfd_create("apir-test", os.MFD_CLOEXEC), 4 << 20, ring_size=4096)
    guest, host = _pair_on(region)
    looks = []

    def ready() -> int:
        looks.append(host._asleep.value)
        return 16 if len(looks) == 1 else 0  # the frame is there at the look after the flag

    host._sleep(ready)
    assert looks == [1] and host.doorbell.waits == 0 and host._asleep.value == 0
    host._sleep(lambda: 0)  # nothing there: it sleeps, and lowers its flag on waking
    assert host.doorbell.waits == 1 and host._asleep.value == 0
    host.close()
    guest.close()
    region.close()


def test_connect_gives_each_transport_its_channel_and_arena(host):
    """A unix session switches to its region's rings and arena after the Welcome; a tcp
    one keeps its socket and asks for no arena, whatever the Hello said."""
    from pathlib import Path

    from apir.transport import HostUnreachable, connect

    token = Path(host.token_file).read_text().strip()
    hello = m.Hello(m.PROTOCOL_VERSION, m.op_table_hash(), token, "test", 1 << 20)
    conn, welcome = connect(host.unix, hello)
    try:
        assert isinstance(welcome, m.Welcome) and isinstance(conn.channel, RingChannel)
        assert conn.arena is not None and conn.arena.size == welcome.arena_size >= 1 << 20
        assert conn.liveness is not None and conn.address == host.unix
        conn.channel.send(m.GetDevices(), 1, m.WANT_REPLY)
        assert isinstance(conn.channel.recv().message, m.Devices)
    finally:
        conn.close()
    conn, welcome = connect(host.tcp, hello)
    try:
        assert isinstance(conn.channel, SocketChannel) and conn.arena is None and welcome.arena_size == 0
    finally:
        conn.close()
    with pytest.raises(HostUnreachable, match="no apir host is listening at unix:///nonexistent/apir.sock"):
        connect("unix:///nonexistent/apir.sock", hello)
