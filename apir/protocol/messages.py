"""Every message of the apir protocol: frozen dataclasses with pinned opcodes.

Frame layout (little-endian), the same over every transport:

    offset  size  field
    0       4     magic       b"APIR"
    4       2     opcode      a value from OPCODES below
    6       2     flags       bit 0: WANT_REPLY (the sender waits for an answer)
    8       4     request id  echoed in the reply
    12      4     body length at most MAX_BODY
    16      n     body        the message's fields, in declaration order

Field encodings follow the annotations: int -> i64, float -> f64, bool -> u8, str -> u32
length + UTF-8, bytes -> u64 length + bytes, tuple[X, ...] -> u32 count + items, nested
dataclasses field by field, Graph by ``graph_codec``. Decoding is whitelist-driven: the
opcode picks the class, the class's fields say what to read, nothing else is possible.

Requests the guest does not wait for (no WANT_REPLY) get no answer at all; if one fails,
the host keeps the error and returns it from the next request that does want a reply.
The host serves requests one at a time, in order, and replies in that order, so a guest
may send several requests before it reads the first reply (a pipelined decode does).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import struct
import typing
from dataclasses import dataclass

from ..graph import OPS, Graph
from . import graph_codec
from .wire import MAX_ITEMS, BytesLike, ProtocolError, Reader, Writer

MAGIC = b"APIR"
# 2: Step (the fixed-layout compute of a decode step) and its Data reply
# 3: Step and Compute carry ``feed`` (inputs bound on the host to the previous outputs)
# 4: Step is the one compute (Compute and its Outputs reply retired): inputs off the
#    registered layout are an error, not a slower message
# 5: OpenPublished (a model the host's operator published, shared read-only); Status
#    lists the published models and the bytes their resident copies hold
# 6: Status lists each resident copy (where it is held, its bytes, its sessions)
PROTOCOL_VERSION = 6
HEADER = struct.Struct("<4sHHII")
MAX_BODY = 64 << 20  # one frame; bulk uploads are chunked below this
WANT_REPLY = 1
# What guest and host must agree on about where bytes lie:
INLINE_MAX = 4096  # blobs up to this size travel inline even when an arena exists
ALIGN = 16  # each tensor of a Step's or Data's payload starts at a multiple of this
ARENA_ALIGN = 64  # each arena range a request names starts at a multiple of this


def op_table_hash() -> bytes:
    """Digest of the op table (opcodes, arity, attributes): both ends must agree."""
    h = hashlib.sha256()
    for op, spec in sorted(OPS.items()):
        h.update(f"{int(op)}:{op.name}:{spec.arity}:{spec.attrs}\n".encode())
    return h.digest()


# ---------------------------------------------------------------- value types


@dataclass(frozen=True)
class Blob:
    """Bytes carried inline, or a range of the session's shared arena (inline is empty)."""

    inline: bytes = b""
    arena_offset: int = -1  # -1: inline
    size: int = 0


@dataclass(frozen=True)
class Feed:
    """An input the host binds itself, to an output of the graph's previous compute (kept
    on the device, never crossing the boundary): a decode step's sampled token feeds the
    next step, so the guest can send step n+1 before it reads token n. A Step names the
    input by its index in the graph's input order (that of its INPUT nodes)."""

    input: int
    output: int  # index in the graph's outputs


@dataclass(frozen=True)
class Device:
    name: str
    kind: str
    description: str
    memory_free: int
    memory_total: int
    capabilities: tuple[str, ...]


@dataclass(frozen=True)
class SessionInfo:
    session: int
    pid: int
    peer: str
    allocated: int
    peak: int


@dataclass(frozen=True)
class SharedInfo:
    """A published model's resident copy, as the host status shows it: once, whatever the
    number of sessions computing on it."""

    name: str
    where: str  # "host" (the daemon's read-only memfd) or the device a holder keeps it on
    nbytes: int  # the copy, plus its dequantized forms if the daemon made them
    sessions: int  # sessions using it now


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class Hello:
    version: int
    op_table: bytes
    token: str
    client: str
    arena_size: int  # bytes of shared arena wanted (0: none, e.g. over TCP)
    status_only: bool = False  # ask the daemon for its status instead of a session


@dataclass(frozen=True)
class GetDevices:
    pass


@dataclass(frozen=True)
class Supports:
    op: int
    dtypes: tuple[int, ...]


@dataclass(frozen=True)
class AllocBuffer:
    handle: int  # minted by the guest, so uploads never wait for a reply
    size: int
    purpose: int


@dataclass(frozen=True)
class FreeBuffer:
    handle: int


@dataclass(frozen=True)
class ClearBuffer:
    handle: int
    value: int


@dataclass(frozen=True)
class SetTensor:
    handle: int
    offset: int
    data: Blob


@dataclass(frozen=True)
class GetTensor:
    handle: int
    offset: int
    size: int
    arena_offset: int  # where the host may put the bytes; -1: inline


@dataclass(frozen=True)
class CopyTensor:
    src: int
    src_offset: int
    dst: int
    dst_offset: int
    size: int


@dataclass(frozen=True)
class RegisterGraph:
    graph_id: int  # minted by the guest
    graph: Graph


@dataclass(frozen=True)
class FreeGraph:
    graph_id: int


@dataclass(frozen=True)
class Step:
    """A compute of a registered graph, in the fixed layout its registration implies (see
    ``apir.protocol.step``): the inputs' bytes back to back, no names, dtypes or shapes.
    The reply is a ``Data`` holding the outputs the same way. Fed inputs send no bytes:
    the payload holds the others, in the same order."""

    graph_id: int
    n_tokens: int  # T (0 for a graph without a token axis)
    out_offset: int  # arena range for the outputs; -1: inline
    out_capacity: int
    inputs: Blob
    feed: tuple[Feed, ...] = ()


@dataclass(frozen=True)
class Synchronize:
    pass


@dataclass(frozen=True)
class OpenPublished:
    """Bind ``handle`` to the host's read-only copy of the weights of published model
    ``name`` instead of uploading them: its tensors laid out as the guest's own file's
    would be (``layout``: ``apir.models.layout.layout_digest``, ``size`` bytes). Graphs may
    read the buffer; writing it is refused, freeing it drops only this session's use."""

    handle: int
    name: str
    layout: bytes
    size: int


@dataclass(frozen=True)
class Goodbye:
    pass


# ---------------------------------------------------------------- replies


@dataclass(frozen=True)
class Welcome:
    version: int
    session: int
    device: Device
    arena_size: int  # granted (the arena's fd travels with this frame on unix sockets)
    max_memory: int


@dataclass(frozen=True)
class Ok:
    pass


@dataclass(frozen=True)
class Error:
    code: int
    message: str


@dataclass(frozen=True)
class Devices:
    devices: tuple[Device, ...]


@dataclass(frozen=True)
class Flag:
    value: bool


@dataclass(frozen=True)
class Data:
    data: Blob


@dataclass(frozen=True)
class Notice:
    """Host to guest, unasked, with request id 0: a line for the guest's user, sent where a
    reply will be long in coming (a graph being compiled). It answers no request; the
    reply it precedes follows."""

    message: str


@dataclass(frozen=True)
class Status:
    version: int
    device: Device
    sessions: tuple[SessionInfo, ...]
    max_sessions: int
    max_memory: int
    warm_workers: int = 0  # idle workers the daemon keeps started (--warm-workers)
    idle_ready: int = 0  # of those, ready now (device initialised)
    served_warm: int = 0  # sessions started on a ready idle worker
    served_cold: int = 0  # sessions that waited for their worker to start
    published: tuple[str, ...] = ()  # models the operator published (apir host --model)
    shared_bytes: int = 0  # bytes of their copies resident now, counted once for all sessions
    shared_loads: int = 0  # copies of them read from disk since the daemon started
    shared: tuple[SharedInfo, ...] = ()  # the resident copies, one each (shared_bytes is their sum)


# Pinned opcodes. Never renumber or reuse: add new messages with new values.
OPCODES: dict[int, type] = {
    1: Hello,
    10: GetDevices,
    11: Supports,
    20: AllocBuffer,
    21: FreeBuffer,
    22: ClearBuffer,
    30: SetTensor,
    31: GetTensor,
    32: CopyTensor,
    40: RegisterGraph,
    41: FreeGraph,
    # 42: Compute, retired in version 4
    43: Step,
    45: OpenPublished,
    50: Synchronize,
    99: Goodbye,
    101: Welcome,
    102: Ok,
    103: Error,
    110: Devices,
    111: Flag,
    120: Notice,
    131: Data,
    # 142: Outputs, retired in version 4
    160: Status,
}
OPCODE_OF: dict[type, int] = {cls: code for code, cls in OPCODES.items()}


class ErrorCode:
    """``Error.code`` values; the guest maps them to exception types."""

    INTERNAL = 1
    PROTOCOL = 2  # malformed frame or message
    VERSION = 3  # handshake: versions or op tables differ
    AUTH = 4  # handshake: bad token
    INVALID = 5  # a request the backend refuses (handle, range, input)
    GRAPH = 6  # a graph that breaks the op table's rules
    QUOTA = 7  # a session limit (memory, handles, nodes, sessions)


# ---------------------------------------------------------------- codec


def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls, {**globals(), "Graph": Graph})


_FIELDS: dict[type, list[tuple[str, object]]] = {}


def _fields(cls: type) -> list[tuple[str, object]]:
    if cls not in _FIELDS:
        hints = _hints(cls)
        _FIELDS[cls] = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
    return _FIELDS[cls]


# Codecs are compiled once per type into closures: the decode step runs for every request,
# so type dispatch happens here, not per field per message. Consecutive fixed-size fields
# (int, float, bool) are packed and unpacked by one struct call, and so are tuples of ints
# or floats: the bytes are exactly those of encoding the fields one by one.
_WRITERS: dict[object, typing.Callable[[Writer, typing.Any], None]] = {}
_READERS: dict[object, typing.Callable[[Reader], typing.Any]] = {}

# struct codes of the fixed-size types: (pack, unpack). A bool packs from any truth value
# but must read back as exactly 0 or 1.
_FIXED: dict[object, tuple[str, str]] = {int: ("q", "q"), float: ("d", "d"), bool: ("?", "B")}


def _bool(r: Reader) -> bool:
    v = r.u8()
    if v > 1:
        raise ProtocolError(f"bad boolean {v}")
    return bool(v)


@functools.lru_cache(maxsize=64)
def _array(code: str, n: int) -> struct.Struct:
    return struct.Struct(f"<{n}{code}")


def _groups(tp: type) -> list[list[tuple[str, object]]]:
    """The fields of dataclass ``tp`` in wire order: runs of two or more consecutive
    fixed-size fields, and every other field on its own."""
    groups: list[list[tuple[str, object]]] = []
    for name, ftp in _fields(tp):
        if ftp in _FIXED and groups and groups[-1][-1][1] in _FIXED:
            groups[-1].append((name, ftp))
        else:
            groups.append([(name, ftp)])
    return groups


def _run_writer(run: list[tuple[str, object]]) -> typing.Callable[[Writer, tuple[object, ...]], None]:
    st = struct.Struct("<" + "".join(_FIXED[t][0] for _, t in run))
    return lambda w, values: w.parts.append(st.pack(*values))


def _run_reader(run: list[tuple[str, object]]) -> typing.Callable[[Reader], tuple[typing.Any, ...]]:
    st = struct.Struct("<" + "".join(_FIXED[t][1] for _, t in run))
    bools = [i for i, (_, t) in enumerate(run) if t is bool]
    if not bools:
        return lambda r: r.unpack(st)

    def read(r: Reader) -> tuple[typing.Any, ...]:
        values = list(r.unpack(st))
        for i in bools:
            if values[i] > 1:
                raise ProtocolError(f"bad boolean {values[i]}")
            values[i] = bool(values[i])
        return tuple(values)

    return read


def _writer(tp: object) -> typing.Callable[[Writer, typing.Any], None]:
    if tp in _WRITERS:
        return _WRITERS[tp]
    simple: dict[object, typing.Callable[[Writer, typing.Any], None]] = {
        int: Writer.i64, float: Writer.f64, str: Writer.str, bytes: Writer.bytes,
        bool: lambda w, v: w.u8(1 if v else 0), Graph: graph_codec.write_graph}
    if tp in simple:
        fn = simple[tp]
    elif typing.get_origin(tp) is tuple and typing.get_args(tp)[0] in (int, float):
        code = _FIXED[typing.get_args(tp)[0]][0]

        def fn(w: Writer, value: tuple[float, ...]) -> None:
            w.u32(len(value))
            w.parts.append(_array(code, len(value)).pack(*value))
    elif typing.get_origin(tp) is tuple:
        item = _writer(typing.get_args(tp)[0])

        def fn(w: Writer, value: tuple[object, ...]) -> None:
            w.u32(len(value))
            for v in value:
                item(w, v)
    else:
        # (getter, writer): a run's getter returns a tuple of its fields' values
        groups = _groups(typing.cast(type, tp))  # a message dataclass
        steps = [(operator.attrgetter(*[n for n, _ in g]), _run_writer(g)) if len(g) > 1
                 else (operator.attrgetter(g[0][0]), _writer(g[0][1])) for g in groups]

        def fn(w: Writer, value: object) -> None:
            for get, write in steps:
                write(w, get(value))
    _WRITERS[tp] = fn
    return fn


def _reader(tp: object) -> typing.Callable[[Reader], object]:
    if tp in _READERS:
        return _READERS[tp]
    simple: dict[object, typing.Callable[[Reader], typing.Any]] = {
        int: Reader.i64, float: Reader.f64, str: Reader.str, bytes: Reader.bytes,
        bool: _bool, Graph: graph_codec.read_graph}
    if tp in simple:
        fn = simple[tp]
    elif typing.get_origin(tp) is tuple and typing.get_args(tp)[0] in (int, float):
        code = _FIXED[typing.get_args(tp)[0]][1]

        def fn(r: Reader) -> object:
            return r.unpack(_array(code, r.count(MAX_ITEMS)))
    elif typing.get_origin(tp) is tuple:
        item = _reader(typing.get_args(tp)[0])

        def fn(r: Reader) -> object:
            return tuple([item(r) for _ in range(r.count(MAX_ITEMS))])
    else:
        # (True, reader of a run: a tuple of values) or (False, reader of one value)
        cls = typing.cast(type, tp)  # a message dataclass
        steps: list[tuple[bool, typing.Callable[[Reader], typing.Any]]] = [
            (True, _run_reader(g)) if len(g) > 1 else (False, _reader(g[0][1])) for g in _groups(cls)]

        def fn(r: Reader) -> object:
            values: list[object] = []
            for many, read in steps:
                if many:
                    values.extend(read(r))
                else:
                    values.append(read(r))
            return cls(*values)
    _READERS[tp] = fn
    return fn


def encode(msg: object, request_id: int = 0, flags: int = 0) -> bytes:
    """A whole frame: header + body."""
    if type(msg) in _FIXED_ENCODERS:
        return _FIXED_ENCODERS[type(msg)](msg, request_id, flags)
    w = Writer()
    _writer(type(msg))(w, msg)
    body = w.getvalue()
    if len(body) > MAX_BODY:
        raise ProtocolError(f"{type(msg).__name__} of {len(body)} bytes exceeds the {MAX_BODY}-byte frame limit")
    return HEADER.pack(MAGIC, OPCODE_OF[type(msg)], flags, request_id, len(body)) + body


class FrameHeader(typing.NamedTuple):  # a tuple: made once per frame, on the hot path
    opcode: int
    flags: int
    request_id: int
    length: int


def decode_header(raw: BytesLike, max_body: int = MAX_BODY) -> FrameHeader:
    if len(raw) != HEADER.size:
        raise ProtocolError(f"truncated frame header ({len(raw)} of {HEADER.size} bytes)")
    magic, opcode, flags, rid, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: the peer does not speak the apir protocol")
    if opcode not in OPCODES:
        raise ProtocolError(f"unknown opcode {opcode}")
    if flags & ~WANT_REPLY:
        raise ProtocolError(f"unknown flags {flags:#x}")
    if length > max_body:
        raise ProtocolError(f"frame body of {length} bytes exceeds the limit of {max_body}")
    return FrameHeader(opcode, flags, rid, length)


def decode_body(opcode: int, body: BytesLike) -> object:
    if opcode in _FIXED_DECODERS:
        return _FIXED_DECODERS[opcode](body)
    r = Reader(body)
    msg = _reader(OPCODES[opcode])(r)
    r.end()
    return msg


# ---------------------------------------------------------------- fixed layouts
#
# Step and its Data reply carry every decode step, so they are coded by hand: one struct
# call for the header and the fixed fields, one for the blob's tail. The bytes are exactly
# those of the field-by-field rules above (a test holds them to it):
#
#   Step body := i64 graph_id, i64 n_tokens, i64 out_offset, i64 out_capacity,
#                u64 n, n inline bytes, i64 arena_offset, i64 size,       (Blob inputs)
#                u32 m, m x (i64 input, i64 output)                        (Feed feed)
#   Data body := u64 n, n inline bytes, i64 arena_offset, i64 size        (Blob data)

_STEP_FIELDS = struct.Struct("<qqqqQ")  # ... u64 n: the inline length
_DATA_FIELDS = struct.Struct("<Q")
_STEP_HEAD = struct.Struct(HEADER.format + _STEP_FIELDS.format[1:])
_DATA_HEAD = struct.Struct(HEADER.format + _DATA_FIELDS.format[1:])
_BLOB_TAIL = struct.Struct("<qq")  # arena_offset, size
_STEP_TAIL = struct.Struct("<qqI")  # arena_offset, size, then the feed's count
_FEED = struct.Struct("<qq")  # input, output
STEP_OPCODE, DATA_OPCODE = OPCODE_OF[Step], OPCODE_OF[Data]


def step_frame(request_id: int, flags: int, graph_id: int, n_tokens: int, out_offset: int, out_capacity: int,
               inline: bytes, arena_offset: int, size: int, feed: typing.Sequence[tuple[int, int]] = ()) -> bytes:
    """The frame of ``Step(graph_id, n_tokens, out_offset, out_capacity, Blob(inline,
    arena_offset, size), feed)``, built without message objects; ``feed`` as (input,
    output) pairs."""
    length = _STEP_FIELDS.size + len(inline) + _STEP_TAIL.size + _FEED.size * len(feed)
    if length > MAX_BODY:
        raise ProtocolError(f"Step of {length} bytes exceeds the {MAX_BODY}-byte frame limit")
    head = _STEP_HEAD.pack(MAGIC, STEP_OPCODE, flags, request_id, length, graph_id, n_tokens, out_offset,
                           out_capacity, len(inline))
    tail = _STEP_TAIL.pack(arena_offset, size, len(feed))
    return b"".join((head, inline, tail, *(_FEED.pack(*pair) for pair in feed)))


def data_frame(request_id: int, flags: int, inline: bytes, arena_offset: int, size: int) -> bytes:
    """The frame of ``Data(Blob(inline, arena_offset, size))``."""
    length = _DATA_FIELDS.size + len(inline) + _BLOB_TAIL.size
    if length > MAX_BODY:
        raise ProtocolError(f"Data of {length} bytes exceeds the {MAX_BODY}-byte frame limit")
    head = _DATA_HEAD.pack(MAGIC, DATA_OPCODE, flags, request_id, length, len(inline))
    return b"".join((head, inline, _BLOB_TAIL.pack(arena_offset, size)))


def _parse_fixed(fields: struct.Struct, tail: struct.Struct, body: BytesLike) -> tuple[tuple[typing.Any, ...], int]:
    """A body of ``fields`` ending in a blob's inline length, then the blob, then ``tail``:
    ((*fields, inline, *tail), where the tail ends), ``inline`` a view of ``body``.
    Checked like any decode."""
    fixed, total = fields.size, len(body)
    if total < fixed:
        raise ProtocolError(f"truncated message: wanted {fixed} bytes at 0, frame has {total}")
    values = fields.unpack_from(body)
    n = values[-1]
    if n > total - fixed:
        raise ProtocolError(f"truncated message: {n} bytes of data announced, {total - fixed} present")
    end = fixed + n
    if end + tail.size > total:
        raise ProtocolError(f"truncated message: wanted {tail.size} bytes at {end}, frame has {total}")
    return (*values[:-1], memoryview(body)[fixed:end], *tail.unpack_from(body, end)), end + tail.size


def _end(body: BytesLike, at: int) -> None:
    if at < len(body):
        raise ProtocolError(f"{len(body) - at} unexpected bytes after the message")


def parse_step(body: BytesLike) -> tuple[int, int, int, int, memoryview, int, int, tuple[tuple[int, int], ...]]:
    """A Step body as the host's hot path takes it, a plain tuple (no message objects):
    (graph_id, n_tokens, out_offset, out_capacity, inline, arena_offset, size, feed),
    ``inline`` a view of ``body``, ``feed`` as (input, output) pairs, not checked against
    any graph yet."""
    (*fields, count), at = _parse_fixed(_STEP_FIELDS, _STEP_TAIL, body)
    if count > MAX_ITEMS:
        raise ProtocolError(f"list of {count} items exceeds the limit of {MAX_ITEMS}")
    end = at + _FEED.size * count
    if end > len(body):
        raise ProtocolError(f"truncated message: {count} feeds announced, {len(body) - at} bytes present")
    _end(body, end)
    flat = _array("q", 2 * count).unpack_from(body, at) if count else ()
    return (*fields, tuple(zip(flat[0::2], flat[1::2])))


def parse_data(body: BytesLike) -> tuple[memoryview, int, int]:
    """A Data body: (inline, arena_offset, size)."""
    fields, end = _parse_fixed(_DATA_FIELDS, _BLOB_TAIL, body)
    _end(body, end)
    return fields


def _decode_step(body: BytesLike) -> Step:
    gid, n_tokens, out_offset, capacity, inline, arena_offset, size, feed = parse_step(body)
    return Step(gid, n_tokens, out_offset, capacity, Blob(bytes(inline), arena_offset, size),
                tuple(Feed(i, k) for i, k in feed))


def _decode_data(body: BytesLike) -> Data:
    inline, arena_offset, size = parse_data(body)
    return Data(Blob(bytes(inline), arena_offset, size))


_FIXED_ENCODERS: dict[type, typing.Callable[[typing.Any, int, int], bytes]] = {
    Step: lambda s, rid, flags: step_frame(rid, flags, s.graph_id, s.n_tokens, s.out_offset, s.out_capacity,
                                           s.inputs.inline, s.inputs.arena_offset, s.inputs.size,
                                           [(f.input, f.output) for f in s.feed]),
    Data: lambda d, rid, flags: data_frame(rid, flags, d.data.inline, d.data.arena_offset, d.data.size),
}
_FIXED_DECODERS: dict[int, typing.Callable[[BytesLike], object]] = {
    STEP_OPCODE: _decode_step,
    DATA_OPCODE: _decode_data,
}
