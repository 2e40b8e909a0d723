"""The remote backend (the frontend): the backend API forwarded to a host daemon.

Handles are minted here, so allocations, uploads and graph frees are sent without waiting
(no reply is asked for); a failure among them is reported by the host at the next request
that waits — a compute, a read, a synchronize — like an asynchronous GPU API. Bulk bytes
go through the session's shared arena when there is one (Unix sockets), inline otherwise.

Requests that do want a reply need not wait for it either: ``submit`` sends a compute and
returns a Pending, and the host answers in request order, so whichever request reads
replies takes them in that order and keeps each for its own request (see ``Awaited``).

One channel carries every request, so the API is serialized: a call from a second thread
waits for the first one's (``_serialized``), instead of both reading one reply stream.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .. import __version__
from ..errors import ApirError
from ..graph import DType, Graph, GraphError, Op
from ..protocol import (
    ARENA_ALIGN,
    INLINE_MAX,
    PROTOCOL_VERSION,
    WANT_REPLY,
    ErrorCode,
    FrameHeader,
    ProtocolError,
    decode_body,
    encode,
    op_table_hash,
)
from ..protocol import messages as m
from ..protocol.step import LayoutError, StepLayout, private_copy
from ..transport import ArenaRing, Connection, ConnectionClosed, connect, spin_seconds
from .base import Backend, BackendError, BufferPurpose, DeviceInfo, Feed, Pending, QuotaError

CHUNK = 8 << 20  # upload pieces: well under the frame limit, big enough to stream fast
# Bytes sent while replies are awaited before the guest first takes them (see _send):
# well under what a socket's buffers or a ring hold, so the host can always read them.
PIPELINE_BYTES = 64 << 10
DEFAULT_ARENA = 256 << 20
CLOSE_WAIT = 5.0  # seconds close() waits for a call in another thread (see close)


class RemoteError(ApirError):
    """The host reported a failure of its own (not a problem with the request)."""


class HostGoneError(ApirError):
    """The host daemon (or this session's worker) went away."""


class VersionMismatchError(ApirError):
    """Guest and host speak different protocol versions."""


class AuthError(ApirError):
    """The host refused the guest's token."""


_ERRORS = {
    ErrorCode.INVALID: BackendError,
    ErrorCode.GRAPH: GraphError,
    ErrorCode.QUOTA: QuotaError,
    ErrorCode.PROTOCOL: ProtocolError,
    ErrorCode.VERSION: VersionMismatchError,
    ErrorCode.AUTH: AuthError,
}


NOTICE_OPCODE = m.OPCODE_OF[m.Notice]


def _print_notice(text: str) -> None:
    """A host's notice on stderr: "host compiling decode graph (...)…"."""
    line = "".join(c for c in text if c.isprintable())[:200]  # one line, whatever the host sent
    print(f"host {line}…", file=sys.stderr, flush=True)


def _serialized(method: Callable) -> Callable:
    """Hold the backend's lock for ``method``: two threads sending at once would interleave
    their frames, and two reading would each take the other's reply and wait forever."""
    @functools.wraps(method)
    def locked(self: RemoteBackend, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


def raise_error(err: m.Error) -> None:
    raise _ERRORS.get(err.code, RemoteError)(f"host: {err.message}")


def _device(d: m.Device) -> DeviceInfo:
    return DeviceInfo(d.name, d.kind, d.description, d.memory_free, d.memory_total,
                      frozenset(d.capabilities))


def handshake(url: str | None, hello: m.Hello, timeout: float | None, want: type) -> tuple[Connection, object]:
    """Connect, say ``hello``, and return the connection with the host's answer, which
    must be a ``want``; an Error is raised as its exception."""
    conn, reply = connect(url, hello, timeout)
    if not isinstance(reply, want):
        conn.close()
        if isinstance(reply, m.Error):
            raise_error(reply)
        raise ProtocolError(f"expected {want.__name__}, got {type(reply).__name__}")
    return conn, reply


def host_status(url: str | None = None, token: str = "") -> m.Status:
    """Ask a daemon for its sessions and their memory (no session is created); ``token``:
    the host's secret (tcp, vsock)."""
    hello = m.Hello(PROTOCOL_VERSION, op_table_hash(), token, f"apir {__version__}", 0, True)
    conn, status = handshake(url, hello, None, m.Status)
    conn.close()
    return status


class RemoteBackend(Backend):
    name = "remote"

    def __init__(self, url: str | None = None, device: str | None = None, token: str = "",
                 arena_size: int = DEFAULT_ARENA, timeout: float | None = None,
                 spin_us: int | None = None, on_notice: Callable[[str], None] | None = None) -> None:
        """Open a session on the host at ``url`` (unix, tcp, vsock, ivshmem; None: the
        default unix socket). ``token``: the host's secret (tcp, vsock); ``timeout``: how
        long any wait for the host may last (None: no limit); ``spin_us``: how long to
        busy-poll for a reply (None: by the host's device, see ``transport.spin_seconds``);
        ``on_notice``: gets the host's notices (None: one line each on stderr)."""
        hello = m.Hello(PROTOCOL_VERSION, op_table_hash(), token,
                        f"apir {__version__} pid {os.getpid()} on {socket.gethostname()}", arena_size)
        self.conn, welcome = handshake(url, hello, timeout, m.Welcome)
        self._lock = threading.RLock()  # see _serialized
        self.chan, self.arena, self.address = self.conn.channel, self.conn.arena, self.conn.address
        self._ids = itertools.count(1)
        self._rids = itertools.count(1)
        self._layouts: dict[int, StepLayout] = {}  # graph id -> its Step layout
        self._awaited: collections.deque[Awaited] = collections.deque()  # sent, reply not read yet
        self._unread = 0  # bytes sent while replies were awaited (see _send)
        self._posted = False  # a request without a reply sent since the last one with (see synchronize)
        self.closed = False
        self.round_trip_seconds = 0.0  # of the last request that waited for the host
        self.session = welcome.session
        self._device = _device(welcome.device)
        if device not in (None, self._device.kind):
            self.close()
            raise BackendError(f"the host executes on {self._device.kind}, not {device!r}; "
                               f"start it with `apir host --device {device}`")
        self.chan.spin_seconds = spin_seconds(self._device.kind, spin_us)
        self.ring = ArenaRing(self.arena.size) if self.arena else None
        self.on_notice = on_notice or _print_notice

    def __repr__(self) -> str:
        return f"RemoteBackend({self.address}, session {self.session})"

    # ------------------------------------------------------------ plumbing
    def _send(self, frame: bytes, what: str) -> None:
        """Send a frame. While replies are awaited the host may be blocked sending one and
        reading nothing; so once PIPELINE_BYTES have gone out since, first take every
        awaited reply, lest both sides wait forever on a full socket or ring."""
        if self._awaited and self._unread + len(frame) > PIPELINE_BYTES:
            while self._awaited:
                self._take()
        if self.closed:
            raise BackendError("remote backend is closed")
        try:
            self.chan.send_frame(frame)
        except (ConnectionClosed, TimeoutError, OSError) as e:
            raise self._gone(what, e) from None
        if self._awaited:
            self._unread += len(frame)

    def _post(self, msg: object) -> None:
        """Send without waiting; failures come back at the next request that waits."""
        self._send(encode(msg, next(self._rids)), type(msg).__name__)
        self._posted = True

    def _request(self, frame: bytes, rid: int, what: str, decode: Decoder) -> Awaited:
        """Send request ``rid`` (its frame asks for a reply) and return without waiting."""
        self._send(frame, what)
        self._posted = False  # the host answers in order, and with a posted request's failure first
        awaited = Awaited(self, rid, what, decode)
        if not self._awaited:
            self._unread = len(frame)
        self._awaited.append(awaited)
        return awaited

    def _call(self, msg: object) -> object:
        """A request and its reply (after those of every request sent before it)."""
        rid = next(self._rids)
        return self._request(encode(msg, rid, WANT_REPLY), rid, type(msg).__name__, self._reply).result()

    @_serialized
    def _wait(self, awaited: Awaited) -> None:
        """Take replies, in order, until ``awaited``'s has come."""
        while not awaited.done:
            self._take()

    def _take(self) -> None:
        """Read the next reply: the host answers in request order, so it is the oldest
        awaited request's. Decode it now (copying anything in the arena, which a later
        request may reuse once the host has read it) and keep the result, or the error,
        for that request's ``result()``."""
        try:
            header, body, fds = self.chan.recv_frame()
        except (ConnectionClosed, TimeoutError, OSError) as e:
            self._gone(self._awaited[0].what, e)
            return
        for fd in fds:
            os.close(fd)
        if header.opcode == NOTICE_OPCODE:  # not a reply: a line for the user, before one
            self.on_notice(decode_body(header.opcode, body).message)
            return
        awaited = self._awaited.popleft()
        self.round_trip_seconds = time.perf_counter() - awaited.sent
        try:
            awaited.finish(awaited.decode(header, body, awaited.rid))
        except Exception as e:  # noqa: BLE001 - raised at the request's own result()
            awaited.fail(e)

    @staticmethod
    def _reply(header: FrameHeader, body: bytearray, rid: int) -> object:
        """The reply to request ``rid``, decoded; an Error is raised as its exception."""
        reply = decode_body(header.opcode, body)
        if isinstance(reply, m.Error):
            raise_error(reply)
        if header.request_id != rid:
            raise ProtocolError(f"reply to request {header.request_id}, expected {rid}")
        return reply

    def _gone(self, what: str, exc: BaseException | None = None) -> ApirError:
        """The host went away: close, fail every awaited request, and return the error for
        ``what`` (the request that found out)."""
        self.closed = True
        last = self._last_word()
        self.chan.close()
        why = "timed out" if isinstance(exc, TimeoutError) else "connection closed"

        def error(request: str) -> ApirError:
            if last is not None:
                return last
            return HostGoneError(
                f"the apir host at {self.address} went away during {request} ({why}): "
                "the daemon or this session's worker stopped; its log says which (restart the "
                "daemon if it is gone, or reconnect)"
            )

        while self._awaited:
            awaited = self._awaited.popleft()
            awaited.fail(error(awaited.what))
        return error(what)

    def _last_word(self) -> ApirError | None:
        """Why a session over the shared rings ended, where the daemon said so: an Error
        it wrote on the socket after the worker was killed (at its memory limit)."""
        sock = self.conn.liveness
        if self.ring is None or sock is None:  # on a socket session, that Error is the reply
            return None
        try:
            data = sock.recv(m.HEADER.size + 4096, socket.MSG_DONTWAIT)
            err = decode_body(m.decode_header(data[:m.HEADER.size]).opcode, data[m.HEADER.size:])
        except (OSError, ProtocolError):
            return None
        return _ERRORS.get(err.code, RemoteError)(f"host: {err.message}") if isinstance(err, m.Error) else None

    def _arena_slot(self, n: int) -> int | None:
        """An arena offset for ``n`` bytes, or None (no arena, or not room enough)."""
        if self.ring is None or n > self.ring.size:
            return None
        if not self._awaited and not self._posted:
            # the host has consumed every request (their replies came, in order): start at
            # the arena's bottom again, so a session touches only the pages its largest
            # request needs. Walking the whole arena first faults in every page of it,
            # ~10 us each on a VM: 100 ms a 32 MB step for a 1 GiB arena's first pass.
            self.ring.reset()
        off = self.ring.alloc(n)
        if off is None:
            self._call(m.Synchronize())  # every earlier region has now been consumed
            self.ring.reset()
            off = self.ring.alloc(n)
        return off

    def _place(self, sizes: Sequence[int]) -> list[int]:
        """Where each of a request's byte runs of ``sizes`` goes: an arena offset for those
        over INLINE_MAX, -1 (inline) for the rest. The arena ones share one allocation, so
        a wrap (which waits until the host has consumed every earlier request) comes before
        any of them is written, and no two requests in flight share a byte."""
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total if n > INLINE_MAX else -1)
            if n > INLINE_MAX:
                total += -(-n // ARENA_ALIGN) * ARENA_ALIGN
        base = self._arena_slot(total) if total else None
        return [-1 if base is None or o < 0 else base + o for o in offsets]

    def _blob_fields(self, data: bytes | memoryview, offset: int) -> tuple[bytes, int, int]:
        """(inline, arena_offset, size) of a blob holding ``data``, at ``offset`` of the
        arena (from ``_place``), or inline for -1."""
        if offset < 0:
            return bytes(data), -1, len(data)
        self.arena.write(offset, data)
        return b"", offset, len(data)

    def _read_blob(self, blob: m.Blob) -> bytes:
        """A private copy of the blob's bytes."""
        return blob.inline if blob.arena_offset < 0 else bytes(self._arena_window(blob.arena_offset, blob.size))

    def _arena_window(self, offset: int, size: int) -> memoryview:
        if self.arena is None:
            raise ProtocolError("the host sent arena data but this session has no arena")
        return self.arena.window(offset, size)

    # ------------------------------------------------------------ the backend API
    @_serialized
    def device(self) -> DeviceInfo:
        return _device(self._call(m.GetDevices()).devices[0])

    @_serialized
    def devices(self) -> list[DeviceInfo]:
        return [_device(d) for d in self._call(m.GetDevices()).devices]

    @_serialized
    def supports(self, op: Op, dtypes: Sequence[DType] = ()) -> bool:
        return self._call(m.Supports(int(op), tuple(int(d) for d in dtypes))).value

    @_serialized
    def alloc_buffer(self, size: int, purpose: BufferPurpose = BufferPurpose.COMPUTE) -> int:
        handle = next(self._ids)
        self._post(m.AllocBuffer(handle, int(size), int(purpose)))
        return handle

    @_serialized
    def free_buffer(self, handle: int) -> None:
        self._post(m.FreeBuffer(handle))

    @_serialized
    def clear_buffer(self, handle: int, value: int = 0) -> None:
        self._post(m.ClearBuffer(handle, value))

    @_serialized
    def set_tensor(self, handle: int, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        view = memoryview(data).cast("B")
        for start in range(0, max(len(view), 1), CHUNK):
            piece = view[start : start + CHUNK]
            self._post(m.SetTensor(handle, offset + start, m.Blob(*self._blob_fields(piece, self._place([len(piece)])[0]))))

    @_serialized
    def get_tensor(self, handle: int, offset: int, size: int) -> bytes:
        reply = self._call(m.GetTensor(handle, offset, size, self._place([size])[0]))
        return self._read_blob(reply.data)

    @_serialized
    def copy_tensor(self, src: int, src_offset: int, dst: int, dst_offset: int, size: int) -> None:
        self._post(m.CopyTensor(src, src_offset, dst, dst_offset, size))

    @_serialized
    def register_graph(self, graph: Graph) -> int:
        graph.validate()  # catch our own mistakes before the round trip
        gid = next(self._ids)
        self._call(m.RegisterGraph(gid, graph))  # waits: graph errors belong here
        self._layouts[gid] = StepLayout.of(graph)
        return gid

    @_serialized
    def open_published(self, name: str, layout: bytes, size: int) -> int:
        """The host's copy of published model ``name``; a BackendError says why not (the
        host publishes no such model, or lays it out otherwise than this guest's file)."""
        handle = next(self._ids)
        self._call(m.OpenPublished(handle, name, layout, size))
        return handle

    @_serialized
    def free_graph(self, gid: int) -> None:
        self._layouts.pop(gid, None)
        self._post(m.FreeGraph(gid))

    def compute(self, gid: int, inputs: Mapping[str, np.ndarray], feed: Feed | None = None) -> list[np.ndarray]:
        return self.submit(gid, inputs, feed).result()

    @_serialized
    def submit(self, gid: int, inputs: Mapping[str, np.ndarray], feed: Feed | None = None) -> Pending:
        """Send the compute and return without waiting for it: its ``result()`` reads the
        reply (and those of the requests sent before it). Decode pipelines this way:
        submit step n+1, fed step n's token on the host, then read token n."""
        try:
            return self._submit(gid, inputs, feed or {})
        except ApirError as e:
            return Pending(error=e)

    def _submit(self, gid: int, inputs: Mapping[str, np.ndarray], feed: Feed) -> Awaited:
        layout = self._layouts.get(gid)
        if layout is None:
            raise BackendError(f"unknown graph id {gid!r}")
        try:
            pairs, fed = layout.feed_pairs(feed, gid)
            packed = layout.pack_inputs(inputs, fed, pairs)
        except LayoutError as e:
            raise BackendError(str(e)) from None
        n_tokens = packed.n_tokens
        out_size = layout.placement(True, n_tokens).size
        in_at, out_at = self._place([packed.size, out_size])
        self._check_fits(packed.size, in_at, out_size, out_at)
        if in_at >= 0:  # straight into the arena: the inputs' one copy
            packed.into(self._arena_window(in_at, packed.size))
            blob: tuple[bytes, int, int] = (b"", in_at, packed.size)
        else:
            blob = (packed.bytes(), -1, packed.size)
        rid = next(self._rids)
        frame = m.step_frame(rid, WANT_REPLY, gid, n_tokens, out_at, out_size if out_at >= 0 else 0,
                             *blob, pairs)
        return self._request(frame, rid, "Compute", functools.partial(self._step_reply, layout, n_tokens))

    def _check_fits(self, in_size: int, in_at: int, out_size: int, out_at: int) -> None:
        """A step's inputs or outputs left out of the arena travel in one message, which
        carries at most MAX_BODY bytes: say so, and what to do, before sending."""
        for size, at, what in ((in_size, in_at, "inputs"), (out_size, out_at, "outputs")):
            if at < 0 and size > m.MAX_BODY - m.INLINE_MAX:
                where = (f"with the rest of the step, more than this session's shared arena "
                         f"({self.arena.size >> 20} MiB)" if self.arena else "and this connection has "
                         "no shared arena (TCP)")
                raise BackendError(
                    f"this step's {what} are {size / 2**20:,.0f} MiB: more than a message carries "
                    f"({m.MAX_BODY >> 20} MiB), {where}. Connect over a Unix socket with a larger "
                    "arena_size (RemoteBackend, create_backend, or apir.torch's options; the host "
                    "allows up to its --max-arena, 1 GiB by default), or compute in smaller batches")

    def _step_reply(self, layout: StepLayout, n_tokens: int, header: FrameHeader, body: bytearray,
                    rid: int) -> list[np.ndarray]:
        """The outputs a Step's reply holds."""
        if header.opcode != m.DATA_OPCODE:  # an Error
            reply = self._reply(header, body, rid)
            raise ProtocolError(f"expected Data for a Step, got {type(reply).__name__}")
        if header.request_id != rid:
            raise ProtocolError(f"reply to request {header.request_id}, expected {rid}")
        inline, arena_offset, size = m.parse_data(body)
        if arena_offset < 0:  # a view of the reply's body: already private and writeable
            return layout.unpack_outputs(inline, n_tokens)
        return layout.unpack_outputs(private_copy(self._arena_window(arena_offset, size)), n_tokens)  # one copy

    @_serialized
    def ping(self) -> float:
        """Seconds of one round trip to the host (a Synchronize, sent even with nothing
        in flight): what the transport and the host's dispatch cost a request."""
        t = time.perf_counter()
        self._call(m.Synchronize())
        return time.perf_counter() - t

    @_serialized
    def synchronize(self) -> None:
        """Wait until the host has done every request sent. When the last one sent waits
        for a reply, that reply says so (the host answers in order, after the work, and a
        failure of a request posted before it comes back in its place): reading the
        awaited replies is enough, and a prefill followed by a synchronize, as a benchmark
        times it, costs no extra round trip (~200 µs on an H200 host, 3% of a pp512)."""
        if self._posted or self.closed:
            self._call(m.Synchronize())
        elif self._awaited:
            last = self._awaited[-1]
            self._wait(last)  # a reply's own error is for its result(); the host going away is ours
            if isinstance(last._error, HostGoneError):
                raise last._error

    def close(self) -> None:
        """End the session. A call that another thread still waits in (a host that stopped
        answering) keeps the session: closing would unmap the region under that thread's
        reads. After CLOSE_WAIT seconds this returns without closing, and the session ends
        with the process (the host sees its socket close)."""
        if not self._lock.acquire(timeout=CLOSE_WAIT):
            self.closed = True  # no new requests; the waiting call ends as the host answers
            return
        try:
            self._close()
        finally:
            self._lock.release()

    def _close(self) -> None:
        try:
            if not self.closed:
                self.closed = True
                try:
                    self.chan.send(m.Goodbye(), next(self._rids))
                except (ConnectionClosed, OSError, ProtocolError):  # gone, or its rings are broken
                    pass
                while self._awaited:
                    self._awaited.popleft().fail(BackendError("the remote backend was closed before this reply came"))
        finally:
            self.conn.close()  # also after the host went away: the arena and region go too
            self.arena = None


Decoder = Callable[[FrameHeader, bytearray, int], object]  # (header, body, request id) -> value


class Awaited(Pending):
    """A request sent, its reply not read yet. ``result()`` reads replies, in order, until
    this one's has come; then returns its value or raises its error."""

    def __init__(self, backend: RemoteBackend, rid: int, what: str, decode: Decoder) -> None:
        super().__init__()
        self._backend, self.rid, self.what, self.decode = backend, rid, what, decode
        self.sent = time.perf_counter()
        self.done = False

    def finish(self, value: object) -> None:
        self._outputs, self.done = value, True

    def fail(self, error: Exception) -> None:
        self._error, self.done = error, True

    def result(self) -> object:
        if not self.done:
            self._backend._wait(self)
        return super().result()


