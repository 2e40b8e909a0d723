"""Shared-memory rings: apir frames and the bulk arena in one region both sides map.

A Unix guest's session gets one as a sealed memfd, passed with the Welcome, and an
eventfd doorbell per direction (``unix_region``, ``attach_region``); a VM guest gets one
as an ivshmem PCI device (``apir.transport.ivshmem``). Either way frames travel through
the region's two rings (``RingChannel``) and bulk bytes lie in its arena.

Region layout (little-endian; S is a power of two, as a PCI BAR must be):

    offset     size   field                                   written by
    0x0000     8      magic b"APIRSHM1"                       host, at creation
    0x0008     8      layout version (2)                      host, at creation
    0x0010     8      region size S                           host, at creation
    0x0018     8      ring size R (each direction)            host, at creation
    0x0020     8      arena offset A                          host, at creation
    0x0028     8      arena size                              host, at creation
    0x0100     8      host closed (0 open, 1 closed)          host
    0x0140     8      guest closed                            guest
    0x0180     8      guest exit status + 1 (0: not yet)      guest (apir vm's init)
    0x01c0     8      host asleep (1: may wait on its eventfd) host
    0x0200     8      guest asleep                            guest
    0x1000     8      requests.head   bytes ever written      guest
    0x1040     8      requests.tail   bytes ever read         host
    0x1080     8      replies.head                            host
    0x10c0     8      replies.tail                            guest
    0x2000     R      requests data (guest -> host)
    0x2000+R   R      replies data (host -> guest)
    A          S-A    the session's bulk arena (Blob.arena_offset is relative to A)

Each ring is a single-producer single-consumer byte stream: ``head`` and ``tail`` are
monotonic u64 byte counts, the data of byte ``i`` lives at ``i % R``. Frames are the same
``apir.protocol`` frames as on a socket and may be larger than R: they stream through.
Every counter sits on its own cache line, so each side writes lines the other only reads.

Memory ordering. The producer copies the payload into the ring (one ``memoryview`` slice
assignment, a memcpy), then publishes the new ``head``; the consumer loads ``head``, then
copies the payload out, then publishes ``tail``. Counters are loaded and stored through
``ctypes.c_uint64`` views: one aligned 8-byte mov each, atomic on x86-64 (``struct``
would write byte by byte, and the peer could read a torn value). We rely on x86-64 TSO:
stores become visible in program order and loads are not reordered with older loads, so
a published head never overtakes its payload. The two stores happen in separate C calls
the compiler cannot merge or reorder. Guest and host on one x86-64 machine (KVM) share
coherent caches. Other architectures (arm64) would need explicit barriers.

Trust. The peer can write anything anywhere in the region at any time. Each side keeps
its own counters privately and never reads them back from shared memory; the peer's
counter is checked on every load (it must lie in ``[mine - R, mine + R]`` in the
direction the protocol allows, else ``ProtocolError``). Payload bytes are copied out
before they are decoded, and frame headers are checked by ``decode_header`` as on any
socket. Arena ranges are checked by ``Arena``.

Wake-ups: without a doorbell (a VM: ivshmem-plain has no interrupts) a waiting side
spins for ``spin_seconds`` and then sleeps with a doubling backoff (capped at
``MAX_SLEEP``); every wait has a deadline and notices the peer's "closed" flag.

Where there is a doorbell (an eventfd per direction, Unix guests), a side rings it only
when the other may be asleep on it: a spinning reader (a GPU host, a guest waiting for
its step) costs the writer no system call. The sleeper raises its "asleep" flag, then
checks the ring once more, then sleeps; the writer publishes its head, then reads the
flag. Each pair is a store followed by a load of another address, which x86-64 may
reorder, so each side puts a full fence between them (``_fence``): then either the writer
sees the flag and rings, or the sleeper sees the bytes and does not sleep. Neither side
trusts the other's flag: a wrong one can only cost its owner a wake-up (or a spurious one).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from ..errors import ApirError
from ..protocol import FrameHeader, ProtocolError, decode_body, decode_header, encode
from ..protocol.messages import HEADER, MAX_BODY
from .arena import SEALS, Arena, ArenaError, check_sealed
from .channel import ConnectionClosed, Frame
from .doorbell import Doorbell

MAGIC = b"APIRSHM1"
LAYOUT_VERSION = 2  # 2: the "asleep" flags
HEADER_SIZE = 0x1000
DATA = 0x2000
DEFAULT_RING = 1 << 20
ARENA_BOUNDARY = 1 << 20  # the arena starts on a MiB boundary, past the rings
MIN_SLEEP, MAX_SLEEP = 20e-6, 1e-3
MAX_DOORBELL_WAIT = 0.5  # a sleeping side re-checks the peer's liveness this often

# header fields (byte offsets)
_SIZE, _RING, _ARENA_OFF, _ARENA_SIZE = 0x10, 0x18, 0x20, 0x28
HOST_CLOSED, GUEST_CLOSED, GUEST_EXIT = 0x100, 0x140, 0x180
HOST_ASLEEP, GUEST_ASLEEP = 0x1C0, 0x200
_REQ_HEAD, _REQ_TAIL, _REP_HEAD, _REP_TAIL = 0x1000, 0x1040, 0x1080, 0x10C0


class RegionError(ApirError):
    """A shared-memory region that cannot be created, mapped or trusted."""


class Region:
    """A mapped shared-memory region with the layout above."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.map)
        self._words: dict[int, ctypes.c_uint64] = {}
        self.ring_size = self.arena_offset = self.arena_size = 0

    # ------------------------------------------------------------ creation / attach
    @classmethod
    def create(cls, path: str | Path, size: int, ring_size: int = DEFAULT_RING) -> Region:
        """Host side: a new region file (replacing any old one), laid out and zeroed."""
        path = Path(path)
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        return cls.create_fd(fd, size, ring_size)

    @classmethod
    def create_fd(cls, fd: int, size: int, ring_size: int = DEFAULT_RING) -> Region:
        """Lay a region out in an empty file descriptor (a file, or a memfd for Unix guests)."""
        if size <= 0 or size & (size - 1):
            raise RegionError(f"region size {size} must be a power of two (a PCI BAR's size)")
        if ring_size <= 0 or ring_size & (ring_size - 1):
            raise RegionError(f"ring size {ring_size} must be a power of two")
        arena_off = -(-(DATA + 2 * ring_size) // ARENA_BOUNDARY) * ARENA_BOUNDARY
        if arena_off + ARENA_BOUNDARY > size:
            raise RegionError(f"region of {size} bytes too small for two {ring_size}-byte rings and an arena")
        os.ftruncate(fd, size)
        r = cls(fd, size)
        r.view[:HEADER_SIZE + 0x1000] = bytes(HEADER_SIZE + 0x1000)
        r.view[:8] = MAGIC
        for off, value in ((8, LAYOUT_VERSION), (_SIZE, size), (_RING, ring_size),
                           (_ARENA_OFF, arena_off), (_ARENA_SIZE, size - arena_off)):
            r.store(off, value)
        r._layout()
        return r

    @classmethod
    def open(cls, path: str | Path) -> Region:
        """Map an existing region (the guest's BAR2, or a host file in tests) and check it."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise RegionError(f"cannot open shared memory {path}: {e.strerror}") from None
        return cls.open_fd(fd, str(path))

    @classmethod
    def open_fd(cls, fd: int, name: str = "the shared region") -> Region:
        """Map a region received as a descriptor and check its header (takes ``fd`` over)."""
        size = os.fstat(fd).st_size
        if size < HEADER_SIZE * 2:
            os.close(fd)
            raise RegionError(f"{name} is {size} bytes, too small to be an apir region")
        r = cls(fd, size)
        try:
            if bytes(r.view[:8]) != MAGIC:
                raise RegionError(f"{name} is not an apir region (bad magic)")
            if r.load(8) != LAYOUT_VERSION:
                raise RegionError(f"{name}: region layout {r.load(8)}, this apir knows {LAYOUT_VERSION}")
            if r.load(_SIZE) != size:
                raise RegionError(f"{name}: region says {r.load(_SIZE)} bytes, the mapping has {size}")
            r._layout()
        except BaseException:
            r.close()
            raise
        return r

    def _layout(self) -> None:
        """Read the layout once into private fields, checking it fits (never re-read)."""
        ring, a_off, a_size = self.load(_RING), self.load(_ARENA_OFF), self.load(_ARENA_SIZE)
        if not (ring > 0 and DATA + 2 * ring <= a_off and a_off % mmap.PAGESIZE == 0
                and a_off + a_size <= self.size and a_size > 0):
            raise RegionError("the region's layout does not fit inside it")
        self.ring_size, self.arena_offset, self.arena_size = ring, a_off, a_size

    # ------------------------------------------------------------ u64 words
    def word(self, off: int) -> ctypes.c_uint64:
        """The u64 at ``off``, live: reading or assigning its ``.value`` is one aligned
        8-byte load or store (atomic on x86-64). Hot loops keep the word, not the offset."""
        w = self._words.get(off)
        if w is None:
            w = self._words[off] = ctypes.c_uint64.from_buffer(self.map, off)
        return w

    def load(self, off: int) -> int:
        """One aligned 8-byte load (atomic on x86-64)."""
        return self.word(off).value

    def store(self, off: int, value: int) -> None:
        """One aligned 8-byte store (atomic on x86-64)."""
        self.word(off).value = value

    def arena(self) -> Arena:
        return Arena(self.view[self.arena_offset : self.arena_offset + self.arena_size])

    def close(self) -> None:
        """Unmap (close the channels on it first: their counter words pin the mapping)."""
        if self.map.closed:
            return
        self._words.clear()  # ctypes views pin the mapping
        self.view.release()
        self.map.close()
        os.close(self.fd)


def _fence(lock: threading.Lock) -> None:
    """A full memory fence: no later load is performed before an earlier store is visible.
    Taking a lock is an atomic read-modify-write (``lock cmpxchg`` or ``xadd``, whatever
    the lock's implementation), which x86-64 orders against every other memory access."""
    lock.acquire()
    lock.release()


class RingChannel:
    """A ``Channel`` over a region's two rings.

    ``side`` is "guest" (sends requests, reads replies) or "host". ``timeout`` bounds
    every wait: for the next frame (None: wait while ``alive()`` and the peer is open),
    and always for the rest of a started frame (``io_timeout``) and for ring space."""

    def __init__(self, region: Region, side: str, max_body: int = MAX_BODY, timeout: float | None = None,
                 io_timeout: float = 60.0, alive: Callable[[], bool] | None = None,
                 doorbell: Doorbell | None = None) -> None:
        if side not in ("guest", "host"):
            raise ValueError(f"side must be guest or host, not {side!r}")
        self.region, self.side, self.max_body = region, side, max_body
        self.timeout, self.io_timeout = timeout, io_timeout
        # Where both sides share a kernel (Unix guests), an eventfd doorbell replaces the
        # backoff sleeps: see apir.transport.doorbell.
        self.doorbell = doorbell
        self.alive = alive or (doorbell.alive if doorbell else (lambda: True))
        self.spin_seconds = 0.0
        self.R = region.ring_size
        req, rep = DATA, DATA + self.R
        if side == "guest":
            self._out, out_head, out_tail = req, _REQ_HEAD, _REQ_TAIL
            self._in, in_head, in_tail = rep, _REP_HEAD, _REP_TAIL
            mine, peer, asleep, peer_asleep = GUEST_CLOSED, HOST_CLOSED, GUEST_ASLEEP, HOST_ASLEEP
        else:
            self._out, out_head, out_tail = rep, _REP_HEAD, _REP_TAIL
            self._in, in_head, in_tail = req, _REQ_HEAD, _REQ_TAIL
            mine, peer, asleep, peer_asleep = HOST_CLOSED, GUEST_CLOSED, HOST_ASLEEP, GUEST_ASLEEP
        w = region.word
        self._out_head, self._out_tail, self._in_head, self._in_tail = w(out_head), w(out_tail), w(in_head), w(in_tail)
        self._mine, self._peer = w(mine), w(peer)
        self._asleep, self._peer_asleep = w(asleep), w(peer_asleep)
        self._fence_lock = threading.Lock()
        # Private copies of the counters this side owns; starting from whatever is there
        # lets a fresh channel pick up a region whose previous user left cleanly.
        self.head = self._out_head.value  # bytes this side has written
        self.tail = self._in_tail.value  # bytes this side has read
        self.closed = False

    # ------------------------------------------------------------ checks
    def _peer_gone(self) -> bool:
        return self._peer.value != 0 or not self.alive()

    def _readable(self) -> int:
        """Bytes the peer has published and we have not read; checks the peer's counter."""
        head = self._in_head.value
        n = head - self.tail
        if not 0 <= n <= self.R:
            raise ProtocolError(f"shared-memory ring: the peer's head {head} is out of range "
                                f"(tail {self.tail}, ring {self.R} bytes)")
        return n

    def _writable(self) -> int:
        tail = self._out_tail.value
        used = self.head - tail
        if not 0 <= used <= self.R:
            raise ProtocolError(f"shared-memory ring: the peer's tail {tail} is out of range "
                                f"(head {self.head}, ring {self.R} bytes)")
        return self.R - used

    def _wait(self, ready: Callable[[], int], deadline: float | None, what: str) -> int:
        n = ready()
        if not n and self.spin_seconds:
            n = self._spin(ready)
        sleep = MIN_SLEEP
        while not n:
            if self._peer_gone():
                n = ready()  # bytes published right before closing still count
                if n:
                    return n
                raise ConnectionClosed(f"the peer closed the shared-memory channel {what}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"shared-memory channel: timed out {what}")
            if self.doorbell is not None:
                self._sleep(ready)
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, MAX_SLEEP)
            n = ready()
        return n

    def _sleep(self, ready: Callable[[], int]) -> None:
        """Wait on the doorbell, having said so (see "Wake-ups" above)."""
        self._asleep.value = 1
        _fence(self._fence_lock)  # the flag is visible before the ring is checked again
        if not ready():
            cast("Doorbell", self.doorbell).wait(MAX_DOORBELL_WAIT)  # rung, or the socket spoke
        self._asleep.value = 0

    def _ring(self) -> None:
        """Wake the peer if it may be asleep (after a store that it must see)."""
        _fence(self._fence_lock)  # the store is visible before the flag is read
        if self._peer_asleep.value:
            cast("Doorbell", self.doorbell).ring()

    def _spin(self, ready: Callable[[], int]) -> int:
        """Busy-poll ``ready`` for up to ``spin_seconds``: a side asleep on its eventfd (or
        in a backoff sleep) is woken tens of microseconds late, a spinning one within one
        load. Only shared-memory loads here, no system call: one per iteration (a liveness
        select) would delay the detection, and what it evicts would slow the compute that
        follows. A peer that went away is noticed once the spin gives up."""
        end = time.perf_counter() + self.spin_seconds
        while True:
            n = ready()
            if n or time.perf_counter() >= end:
                return n

    # ------------------------------------------------------------ bytes
    def _write(self, data: bytes | memoryview) -> None:
        n, pos = len(data), self.head % self.R
        if n <= self._writable() and pos + n <= self.R:  # room for all of it, in one piece
            base = self._out + pos
            self.region.view[base : base + n] = data  # 1. payload
            self._published(n)
        else:
            self._write_chunks(memoryview(data))

    def _write_chunks(self, view: memoryview) -> None:
        """Stream ``view`` through the ring as room appears (a frame larger than the ring,
        or a reader that is behind)."""
        done, deadline = 0, time.monotonic() + self.io_timeout
        while done < len(view):
            free = self._wait(self._writable, deadline, "waiting for ring space (the peer stopped reading)")
            pos = self.head % self.R
            n = min(free, len(view) - done, self.R - pos)
            base = self._out + pos
            self.region.view[base : base + n] = view[done : done + n]  # 1. payload
            self._published(n)
            done += n

    def _published(self, n: int) -> None:
        self.head += n
        self._out_head.value = self.head  # 2. then publish it
        if self.doorbell is not None:
            self._ring()  # 3. and wake the reader if it sleeps

    def _read(self, n: int, deadline: float | None, what: str) -> bytearray:
        """``n`` bytes copied out of the ring (a private copy: decode it, not the ring)."""
        avail, pos = self._readable(), self.tail % self.R  # 1. the peer's head
        if n <= avail and pos + n <= self.R:  # all there, in one piece
            base = self._in + pos
            out = bytearray(self.region.view[base : base + n])  # 2. then its payload (a copy)
            self._consumed(n, avail)
            return out
        out, got = bytearray(n), 0
        while got < n:
            avail = self._wait(self._readable, deadline, what)
            pos = self.tail % self.R
            k = min(avail, n - got, self.R - pos)
            base = self._in + pos
            out[got : got + k] = self.region.view[base : base + k]
            self._consumed(k, avail)
            got += k
            deadline = time.monotonic() + self.io_timeout  # progress: the frame continues
        return out

    def _consumed(self, k: int, avail: int) -> None:
        self.tail += k
        self._in_tail.value = self.tail  # 3. then free the space
        if self.doorbell is not None and avail == self.R:
            self._ring()  # the ring was full: the writer may be waiting for space

    # ------------------------------------------------------------ frames
    def set_timeout(self, seconds: float) -> None:
        self.io_timeout = seconds

    def wait_idle(self) -> None:
        """Nothing to do: ``recv_frame`` waits for the next frame itself (until ``timeout``,
        or while the peer is there)."""

    def send(self, msg: object, request_id: int = 0, flags: int = 0, fds: tuple[int, ...] = ()) -> None:
        self.send_frame(encode(msg, request_id, flags), fds)

    def send_frame(self, frame: bytes, fds: tuple[int, ...] = ()) -> None:
        if fds:
            raise RegionError("file descriptors cannot cross a VM boundary")
        if self.closed:
            raise ConnectionClosed("the shared-memory channel is closed")
        self._write(frame)

    def recv(self) -> Frame:
        """One whole frame: ConnectionClosed when the peer is gone, TimeoutError when
        nothing (or only part of a frame) arrives in time, ProtocolError on garbage."""
        header, body, _ = self.recv_frame()
        return Frame(header, decode_body(header.opcode, body))

    def frame_ready(self) -> bool:
        """Whether the next frame has begun to arrive (or the peer left): never waits."""
        try:
            return self.closed or bool(self._readable()) or self._peer.value != 0
        except ProtocolError:
            return True  # recv_frame reports it

    def recv_frame(self) -> tuple[FrameHeader, bytearray, tuple[int, ...]]:
        if self.closed:
            raise ConnectionClosed("the shared-memory channel is closed")
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self._wait(self._readable, deadline, "waiting for a frame")  # then, mostly, all of it is there
        raw = self._read(HEADER.size, deadline, "waiting for a frame")
        header: FrameHeader = decode_header(raw, self.max_body)
        body = self._read(header.length, time.monotonic() + self.io_timeout,
                          "mid-frame (the peer stalled)") if header.length else bytearray()
        return header, body, ()

    def close(self) -> None:
        """Tell the peer we are gone (the region itself belongs to whoever opened it)."""
        if self.closed:
            return
        if not self.region.map.closed:
            self._mine.value = 1
            if self.doorbell is not None:
                self.doorbell.ring()
        self.closed = True
        # the counter words pin the mapping: drop them so that the region can be closed
        del self._out_head, self._out_tail, self._in_head, self._in_tail, self._mine, self._peer
        del self._asleep, self._peer_asleep


# ---------------------------------------------------------------- Unix guests: memfd + eventfds


def unix_region(arena_size: int, name: str) -> tuple[Region, tuple[int, int, int]]:
    """Host side: a sealed memfd laid out as a region of at least ``arena_size`` bytes of
    arena, and the two doorbell eventfds: (region, (region fd, guest->host, host->guest))."""
    size = 1 << (max(arena_size, 4 << 20) - 1).bit_length()  # a power of two; rings come off the top
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    region = Region.create_fd(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # the guest can never resize it under us
    to_host, to_guest = Doorbell.pair()
    return region, (fd, to_host, to_guest)


def attach_region(fds: tuple[int, int, int], arena_size: int, sock: socket.socket) -> tuple[Region, Doorbell]:
    """Guest side: map the region a Welcome brought (its descriptors, taken over) and check
    it holds the ``arena_size`` bytes of arena the host granted; ``sock``, the session's
    socket, tells the doorbell when the host is gone."""
    region_fd, to_host, to_guest = fds
    try:
        try:
            check_sealed(region_fd)
        except ArenaError:
            os.close(region_fd)
            raise
        region = Region.open_fd(region_fd, "the host's shared region")  # owns the fd
    except ApirError:
        for fd in (to_host, to_guest):
            os.close(fd)
        raise
    doorbell = Doorbell(notify_fd=to_host, wait_fd=to_guest, sock=sock)
    if region.arena_size != arena_size:
        region.close()
        doorbell.close()
        raise ProtocolError(f"the host granted a {arena_size}-byte arena, the region holds {region.arena_size}")
    return region, doorbell
