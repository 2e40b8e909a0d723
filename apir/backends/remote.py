"""The remote backend (the frontend): the backend API forwarded to a host daemon.

Handles are minted here, so allocations, uploads and graph frees are sent without waiting
(no reply is asked for); a failure among them is reported by the host at the next request
that waits — a compute, a read, a synchronize — like an asynchronous GPU API. Bulk bytes
go through the session's shared arena when there is one (Unix sockets), inline otherwise.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Mapping, Sequence

import numpy as np

from .. import __version__
from ..errors import ApirError
from ..graph import DType, Graph, GraphError, Op, T
from ..graph.dtypes import NUMPY_DTYPES, from_numpy
from ..protocol import (
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
from ..protocol.step import StepLayout
from ..transport import Arena, ArenaRing, Channel, ConnectionClosed, Frame, connect, parse_address
from ..transport.arena import check_sealed
from ..transport.doorbell import Doorbell
from ..transport.ivshmem import Region, RingChannel
from .base import Backend, BackendError, BufferPurpose, DeviceInfo, QuotaError

CHUNK = 8 << 20  # upload pieces: well under the frame limit, big enough to stream fast
INLINE_MAX = 4096  # inputs up to this size go inline even when an arena exists
DEFAULT_ARENA = 256 << 20


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


def raise_error(err: m.Error) -> None:
    raise _ERRORS.get(err.code, RemoteError)(f"host: {err.message}")


def _device(d: m.Device) -> DeviceInfo:
    return DeviceInfo(d.name, d.kind, d.description, d.memory_free, d.memory_total,
                      frozenset(d.capabilities))


def read_token(token_file: str | None = None) -> str:
    """The shared secret for tcp/vsock: --token-file, else $APIR_TOKEN, else empty."""
    from .. import env

    path = token_file or env.TOKEN_FILE.get()
    if path:
        try:
            return open(path).read().strip()
        except OSError as e:
            raise ApirError(f"cannot read token file {path}: {e.strerror}") from None
    return env.TOKEN.get() or ""


def handshake(chan: Channel, hello: m.Hello) -> Frame:
    chan.send(hello, 0, WANT_REPLY)
    frame = chan.recv()
    if isinstance(frame.message, m.Error):
        raise_error(frame.message)
    return frame


def host_status(url: str | None = None, token_file: str | None = None) -> m.Status:
    """Ask a daemon for its sessions and their memory (no session is created)."""
    addr = parse_address(url)
    chan = connect(addr)
    try:
        hello = m.Hello(PROTOCOL_VERSION, op_table_hash(), read_token(token_file), f"apir {__version__}", 0, True)
        frame = handshake(chan, hello)
        if not isinstance(frame.message, m.Status):
            raise ProtocolError(f"expected Status, got {type(frame.message).__name__}")
        return frame.message
    finally:
        chan.close()


class RemoteBackend(Backend):
    name = "remote"

    def __init__(self, url: str | None = None, device: str | None = None,
                 token_file: str | None = None, arena_size: int = DEFAULT_ARENA,
                 timeout: float | None = None) -> None:
        injected = None
        if url is not None and url.split("://", 1)[0] == "ivshmem":  # a VM's shared memory
            from ..transport.ivshmem import guest_connect

            injected = guest_connect(url, timeout)  # (channel, arena, region)
            self.address = url
            self.chan = injected[0]
        else:
            self.address = parse_address(url)
            self.chan = connect(self.address)
            self.chan.sock.settimeout(timeout)
        self._ids = itertools.count(1)
        self._rids = itertools.count(1)
        self._graphs: dict[int, Graph] = {}
        self._layouts: dict[int, StepLayout | None] = {}  # graph id -> its Step layout
        self.closed = False
        self.round_trip_seconds = 0.0  # of the last request that waited for the host
        want_arena = arena_size if injected or self.address.scheme == "unix" else 0
        hello = m.Hello(PROTOCOL_VERSION, op_table_hash(), read_token(token_file),
                        f"apir {__version__} pid {os.getpid()} on {socket.gethostname()}", want_arena)
        try:
            frame = handshake(self.chan, hello)
        except (ConnectionClosed, ApirError):
            self.chan.close()
            raise
        welcome = frame.message
        if not isinstance(welcome, m.Welcome):
            self.chan.close()
            raise ProtocolError(f"expected Welcome, got {type(welcome).__name__}")
        self.session = welcome.session
        self._device = _device(welcome.device)
        if device not in (None, self._device.kind):
            self.close()
            raise BackendError(f"the host executes on {self._device.kind}, not {device!r}; "
                               f"start it with `apir host --device {device}`")
        self.arena = None
        if len(frame.fds) == 3:  # a Unix session: ring region + doorbells (see host/session.py)
            self.arena = self._attach_region(frame.fds, welcome.arena_size)
        else:
            for fd in frame.fds:
                os.close(fd)
        if injected is not None:
            self.arena, self._region = injected[1], injected[2]
            if welcome.arena_size != self.arena.size:
                self.close()
                raise ProtocolError(f"the host granted a {welcome.arena_size}-byte arena, the "
                                    f"shared region holds {self.arena.size}")
        from .. import env

        self.chan.spin_seconds = env.spin_seconds(self._device.kind)
        self.ring = ArenaRing(self.arena.size) if self.arena else None

    def __repr__(self) -> str:
        return f"RemoteBackend({self.address}, session {self.session})"

    def _attach_region(self, fds: tuple[int, ...], arena_size: int) -> Arena:
        """Switch to the session's shared rings; frames stop travelling on the socket."""
        region_fd, to_host, to_guest = fds
        try:
            try:
                check_sealed(region_fd)
            except ApirError:
                os.close(region_fd)
                raise
            self._region = Region.open_fd(region_fd, "the host's shared region")  # owns the fd
        except ApirError:
            for fd in (to_host, to_guest):
                os.close(fd)
            self.chan.close()
            raise
        if self._region.arena_size != arena_size:
            raise ProtocolError(f"the host granted a {arena_size}-byte arena, the region holds "
                                f"{self._region.arena_size}")
        self._doorbell = Doorbell(notify_fd=to_host, wait_fd=to_guest, sock=self.chan.sock)
        self._socket_chan = self.chan
        self.chan = RingChannel(self._region, "guest", doorbell=self._doorbell)
        return self._region.arena()

    # ------------------------------------------------------------ plumbing
    def _post(self, msg: object) -> None:
        """Send without waiting; failures come back at the next ``_call``."""
        if self.closed:
            raise BackendError("remote backend is closed")
        try:
            self.chan.send(msg, next(self._rids))
        except ConnectionClosed:
            raise self._gone(type(msg).__name__) from None

    def _call(self, msg: object) -> object:
        rid = next(self._rids)
        return self._reply(*self._exchange(encode(msg, rid, WANT_REPLY), rid, type(msg).__name__), rid)

    def _exchange(self, frame: bytes, rid: int, what: str) -> tuple[FrameHeader, bytearray]:
        """One round trip: send a request's frame, read the reply's (its body undecoded)."""
        if self.closed:
            raise BackendError("remote backend is closed")
        t0 = time.perf_counter()
        try:
            self.chan.send_frame(frame)
            header, body, fds = self.chan.recv_frame()
        except (ConnectionClosed, TimeoutError, OSError) as e:
            raise self._gone(what, e) from None
        self.round_trip_seconds = time.perf_counter() - t0
        for fd in fds:
            os.close(fd)
        return header, body

    @staticmethod
    def _reply(header: FrameHeader, body: bytearray, rid: int) -> object:
        """The reply to request ``rid``, decoded; an Error is raised as its exception."""
        reply = decode_body(header.opcode, body)
        if isinstance(reply, m.Error):
            raise_error(reply)
        if header.request_id != rid:
            raise ProtocolError(f"reply to request {header.request_id}, expected {rid}")
        return reply

    def _gone(self, what: str, exc: BaseException | None = None) -> HostGoneError:
        self.closed = True
        self.chan.close()
        why = "timed out" if isinstance(exc, TimeoutError) else "connection closed"
        return HostGoneError(
            f"the apir host at {self.address} went away during {what} ({why}): "
            "the daemon or this session's worker stopped; its log says which (restart the daemon "
            "if it is gone, or reconnect)"
        )

    def _arena_slot(self, n: int) -> int | None:
        """An arena offset for ``n`` bytes, or None to send them inline."""
        if self.ring is None or n <= INLINE_MAX or n > self.ring.size:
            return None
        off = self.ring.alloc(n)
        if off is None:
            self._call(m.Synchronize())  # every earlier region has now been consumed
            self.ring.reset()
            off = self.ring.alloc(n)
        return off

    def _blob(self, data: bytes | memoryview) -> m.Blob:
        return m.Blob(*self._blob_fields(data))

    def _blob_fields(self, data: bytes | memoryview) -> tuple[bytes, int, int]:
        """(inline, arena_offset, size) of a blob holding ``data``: big ones in the arena."""
        off = self._arena_slot(len(data))
        if off is None:
            return bytes(data), -1, len(data)
        self.arena.write(off, data)
        return b"", off, len(data)

    def _read_blob(self, blob: m.Blob) -> bytes:
        """A private copy of the blob's bytes."""
        data = self._blob_view(blob)
        return data if isinstance(data, bytes) else bytes(data)

    def _blob_view(self, blob: m.Blob) -> bytes | memoryview:
        """The blob's bytes; in place when they lie in the arena (copy before keeping)."""
        return blob.inline if blob.arena_offset < 0 else self._arena_window(blob.arena_offset, blob.size)

    def _arena_window(self, offset: int, size: int) -> memoryview:
        if self.arena is None:
            raise ProtocolError("the host sent arena data but this session has no arena")
        return self.arena.window(offset, size)

    # ------------------------------------------------------------ the backend API
    def device(self) -> DeviceInfo:
        return _device(self._call(m.GetDevices()).devices[0])

    def devices(self) -> list[DeviceInfo]:
        return [_device(d) for d in self._call(m.GetDevices()).devices]

    def supports(self, op: Op, dtypes: Sequence[DType] = ()) -> bool:
        return self._call(m.Supports(int(op), tuple(int(d) for d in dtypes))).value

    def alloc_buffer(self, size: int, purpose: BufferPurpose = BufferPurpose.COMPUTE) -> int:
        handle = next(self._ids)
        self._post(m.AllocBuffer(handle, int(size), int(purpose)))
        return handle

    def free_buffer(self, handle: int) -> None:
        self._post(m.FreeBuffer(handle))

    def clear_buffer(self, handle: int, value: int = 0) -> None:
        self._post(m.ClearBuffer(handle, value))

    def set_tensor(self, handle: int, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        view = memoryview(data).cast("B")
        for start in range(0, max(len(view), 1), CHUNK):
            piece = view[start : start + CHUNK]
            self._post(m.SetTensor(handle, offset + start, self._blob(piece)))

    def get_tensor(self, handle: int, offset: int, size: int) -> bytes:
        dest = self._arena_slot(size)
        reply = self._call(m.GetTensor(handle, offset, size, -1 if dest is None else dest))
        return self._read_blob(reply.data)

    def copy_tensor(self, src: int, src_offset: int, dst: int, dst_offset: int, size: int) -> None:
        self._post(m.CopyTensor(src, src_offset, dst, dst_offset, size))

    def register_graph(self, graph: Graph) -> int:
        graph.validate()  # catch our own mistakes before the round trip
        gid = next(self._ids)
        self._call(m.RegisterGraph(gid, graph))  # waits: graph errors belong here
        self._graphs[gid] = graph
        self._layouts[gid] = StepLayout.of(graph)
        return gid

    def free_graph(self, gid: int) -> None:
        self._graphs.pop(gid, None)
        self._layouts.pop(gid, None)
        self._post(m.FreeGraph(gid))

    def compute(self, gid: int, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        layout = self._layouts.get(gid)
        packed = layout.pack_inputs(inputs) if layout is not None else None
        if packed is None:  # not the registered form: the host says exactly what is wrong
            return self._compute_named(gid, inputs)
        n_tokens, payload = packed
        size = layout.placement(True, n_tokens).size
        slot = self._arena_slot(size) if size > INLINE_MAX else None
        # (if placing the inputs wraps the arena, they may overlap the outputs' range:
        # harmless, the host copies its inputs out before it writes any output)
        out_offset, capacity = (-1, 0) if slot is None else (slot, size)
        rid = next(self._rids)
        frame = m.step_frame(rid, WANT_REPLY, gid, n_tokens, out_offset, capacity, *self._blob_fields(payload))
        header, body = self._exchange(frame, rid, "Compute")
        if header.opcode != m.DATA_OPCODE:  # an Error, or Outputs unlike the graph's
            reply = self._reply(header, body, rid)
            if not isinstance(reply, m.Outputs):
                raise ProtocolError(f"expected Data for a Step, got {type(reply).__name__}")
            return self._arrays(reply)
        if header.request_id != rid:
            raise ProtocolError(f"reply to request {header.request_id}, expected {rid}")
        inline, arena_offset, size = m.parse_data(body)
        if arena_offset < 0:  # a view of the reply's body: already private and writeable
            return layout.unpack_outputs(inline, n_tokens)
        return layout.unpack_outputs(bytearray(self._arena_window(arena_offset, size)), n_tokens)  # one copy

    def _compute_named(self, gid: int, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The general compute: every input with its name, dtype and shape."""
        tensors, n_tokens = [], None
        for name, arr in inputs.items():
            arr = np.ascontiguousarray(arr)
            try:
                dtype = DType.BF16 if arr.dtype == np.uint16 else from_numpy(arr.dtype)
            except ValueError as e:
                raise BackendError(f"input {name!r}: {e}") from None
            tensors.append(m.Tensor(name, int(dtype), tuple(arr.shape), self._blob(memoryview(arr).cast("B"))))
            n_tokens = n_tokens or (arr.shape[0] if arr.ndim else None)
        out_off, cap = -1, 0
        graph = self._graphs.get(gid)
        if graph is not None and self.ring is not None:
            need = sum(_nbytes(graph.nodes[o], n_tokens) + 64 for o in graph.outputs)
            if need > INLINE_MAX:
                slot = self._arena_slot(need)
                out_off, cap = (slot, need) if slot is not None else (-1, 0)
        return self._arrays(self._call(m.Compute(gid, tuple(tensors), out_off, cap)))

    def _arrays(self, reply: m.Outputs) -> list[np.ndarray]:
        outs = []
        for t in reply.outputs:
            dtype = DType.parse(t.dtype)
            outs.append(np.frombuffer(self._blob_view(t.data), NUMPY_DTYPES[dtype]).reshape(t.shape).copy())
        return outs

    def synchronize(self) -> None:
        self._call(m.Synchronize())

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.chan.send(m.Goodbye(), next(self._rids))
        except (ConnectionClosed, OSError):
            pass
        self.closed = True
        self.chan.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if getattr(self, "_region", None) is not None:
            self._region.close()
        if getattr(self, "_doorbell", None) is not None:
            self._doorbell.close()
            self._socket_chan.close()


def _nbytes(node, n_tokens: int | None) -> int:
    shape = tuple((n_tokens or 1) if d == T else d for d in node.shape)
    return node.dtype.nbytes(shape)
