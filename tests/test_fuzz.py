"""Structured fuzzing of what a hostile guest controls: the frame decoder, the graph
validator and the host's dispatcher with its executor. Bounded for CI (about 30 s on two
cores); raise APIR_FUZZ_EXAMPLES for a longer campaign, e.g. ``APIR_FUZZ_EXAMPLES=20``
multiplies every budget by 20. The coverage-guided counterpart is fuzz/fuzz_protocol.py.

The property everywhere: bad input is refused with the error type the protocol promises
(ProtocolError from the decoder, GraphError from the validator, an Error reply that is
not INTERNAL from the dispatcher), never with anything else, and valid input round-trips.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apir.errors import ApirError
from apir.graph import OPS, DType, Graph, GraphError, Node, Op, T
from apir.graph.dtypes import NUMPY_DTYPES
from apir.graph.ops import FLOAT, INT, INTS, LEAVES, infer
from apir.protocol import ProtocolError
from apir.protocol import messages as m
from apir.protocol.step import LayoutError, StepLayout
from apir.protocol.wire import Reader

torch = pytest.importorskip("torch")
from held import uncharged  # noqa: E402

from apir.backends.base import Limits  # noqa: E402
from apir.backends.local import LocalBackend  # noqa: E402
from apir.host.session import InFlight, Session, SessionConfig, error_for  # noqa: E402

SCALE = float(os.environ.get("APIR_FUZZ_EXAMPLES", "1"))
LIMITS = Limits(max_memory=32 << 20, max_handles=64, max_graph_nodes=256)


def budget(n: int):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------- values

I64 = st.one_of(st.integers(-4, 70), st.sampled_from([2**63 - 1, -(2**63), 2**31, 2**32, -1, 4096]),
                st.integers(-(2**63), 2**63 - 1))
U32ISH = st.integers(0, 2**31 - 1)
TEXT = st.text(max_size=12)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-5, 0.5, 1.0, 1e4]))
DTYPES = st.sampled_from(list(DType))
DIMS = st.sampled_from([T, 1, 2, 3, 4, 8, 32, 0, -2, 256])
SHAPES = st.lists(DIMS, max_size=4).map(tuple)
NAMES = st.sampled_from(["x", "y", "ids", "pos"])
# labels and input names: empty, short, and as long as the wire allows (64 KiB of UTF-8)
LABELS = st.one_of(st.just(""), TEXT, st.sampled_from(["n" * 65535, "é" * 32767, "🦙" * 16383]))
NAME_TAILS = st.one_of(st.just(""), TEXT, st.sampled_from(["n" * 65000, "é" * 32000, "🦙" * 16000]))


def attr_value(kind: str):
    if kind == INT:
        return st.one_of(st.integers(-3, 8), st.sampled_from([0, 32, 2**40, -(2**63)]))
    if kind == FLOAT:
        return FLOATS
    if kind == INTS:
        return st.lists(st.integers(-3, 4), max_size=4).map(tuple)
    return NAMES


@st.composite
def graphs(draw) -> Graph:
    """Mostly well-formed graphs (each op's shape rule gives the result), then, sometimes,
    one field corrupted: the validator and the executor see both sides of the line."""
    nodes: list[Node] = []
    good_dims = st.sampled_from([1, 2, 3, 4, 8, 32])
    for _ in range(draw(st.integers(1, 24))):
        if draw(st.integers(0, 3)) == 0:
            _template(draw, nodes)
            continue
        op = draw(st.sampled_from(list(Op)))
        spec = OPS[op]
        attrs = tuple(draw(attr_value(kind)) for _, kind in spec.attrs)
        if op in LEAVES or not nodes:
            op = op if op in LEAVES else Op.INPUT
            dims = st.one_of(good_dims, st.just(T)) if op is Op.INPUT else good_dims
            shape = tuple(draw(st.lists(dims, max_size=3)))
            dtype = draw(st.sampled_from([DType.F32, DType.F32, DType.F32, DType.I32, DType.F16, DType.Q8_0]))
            if op is Op.INPUT:
                attrs = (f"in{len(nodes)}{draw(NAME_TAILS)}",)
            else:
                attrs = (draw(st.sampled_from([1, 1, 1, 2])), draw(st.sampled_from([0, 0, 32, 64])))
            nodes.append(Node(op, (), attrs, shape, dtype, draw(LABELS)))
            continue
        inputs = tuple(draw(st.integers(0, len(nodes) - 1)) for _ in range(spec.arity))
        try:
            shape, dtype = infer(op, [(nodes[i].shape, nodes[i].dtype) for i in inputs], attrs)
        except GraphError:
            continue  # try another op: keep the graph valid so far
        nodes.append(Node(op, inputs, attrs, tuple(shape), dtype, draw(LABELS)))
    if not nodes:
        nodes.append(Node(Op.INPUT, (), ("x",), (T, 4), DType.F32))
    node_ids = st.integers(0, len(nodes) - 1)
    outputs = tuple(draw(st.one_of(  # a few, or one listed many times
        st.lists(node_ids, min_size=1, max_size=3),
        st.tuples(node_ids, st.integers(1, 300)).map(lambda nk: [nk[0]] * nk[1]))))
    corrupt = draw(st.integers(0, 9))
    if corrupt == 0:  # one bad field somewhere
        i = draw(st.integers(0, len(nodes) - 1))
        n = nodes[i]
        field = draw(st.sampled_from(["shape", "dtype", "inputs", "attrs", "outputs"]))
        if field == "shape":
            n = Node(n.op, n.inputs, n.attrs, draw(SHAPES), n.dtype)
        elif field == "dtype":
            n = Node(n.op, n.inputs, n.attrs, n.shape, draw(DTYPES))
        elif field == "inputs":
            n = Node(n.op, tuple(draw(st.integers(0, len(nodes) + 2)) for _ in n.inputs) or (i,), n.attrs, n.shape, n.dtype)
        elif field == "attrs":
            n = Node(n.op, n.inputs, tuple(draw(attr_value(k)) for _, k in OPS[n.op].attrs), n.shape, n.dtype)
        else:
            outputs = (len(nodes) + draw(st.integers(0, 3)),)
        nodes[i] = n
    return Graph(tuple(nodes), outputs)


def _template(draw, nodes: list[Node]) -> None:
    """The leaves an op with strict input rules needs, then the op (attributes drawn near
    their valid ranges, index inputs unchecked until compute time)."""
    def add(op, inputs, attrs, shape, dtype=DType.F32) -> int:
        nodes.append(Node(op, inputs, attrs, shape, dtype))
        return len(nodes) - 1

    def inp(shape, dtype=DType.F32) -> int:
        return add(Op.INPUT, (), (f"in{len(nodes)}",), shape, dtype)

    kind = draw(st.sampled_from(["get_rows", "set_rows", "rope", "attention", "sample", "matmul", "view",
                                 "conv2d", "pool2d", "bmm"]))
    wdtype = draw(st.sampled_from([DType.F32, DType.F16, DType.Q8_0, DType.BF16]))
    if kind == "get_rows":
        ins = (add(Op.WEIGHT, (), (1, 0), (8, 32), wdtype), inp((T,), DType.I32))
        attrs = ()
    elif kind == "set_rows":
        ins = (add(Op.STATE, (), (2, 0), (8, 4), draw(st.sampled_from([DType.F32, DType.F16]))),
               inp((T, 4)), inp((T,), DType.I32))
        attrs = ()
    elif kind == "rope":
        ins = (inp((T, 2, 8)), inp((T,), DType.I32))
        attrs = (draw(st.sampled_from([2, 4, 8, 6, 0, 10])), draw(st.sampled_from([10000.0, 1e6, 0.5])),
                 draw(st.sampled_from([0, 1])), draw(st.sampled_from([1.0, 0.25])))
    elif kind == "attention":
        ins = (inp((T, 4, 8)), add(Op.STATE, (), (2, 0), (16, 2, 8)), add(Op.STATE, (), (2, 1024), (16, 2, 8)),
               inp((T,), DType.I32))
        attrs = (draw(st.sampled_from([0.35, 1.0])), draw(st.integers(0, 3)), draw(st.sampled_from([0.0, 20.0])))
    elif kind == "sample":
        ins = (inp((T, 16)), inp((5,)))
        attrs = ()
    elif kind == "matmul":
        ins = (inp((T, 32)), add(Op.WEIGHT, (), (1, 64), (8, 32), wdtype))
        attrs = ()
    elif kind in ("conv2d", "pool2d"):  # the general ops' windows (apir.torch)
        pairs = st.tuples(st.integers(-1, 3), st.integers(-1, 3))
        ins = (inp((2, 4, draw(st.sampled_from([1, 5, 8])), 6)),)
        if kind == "conv2d":
            ins += (add(Op.WEIGHT, (), (1, 0), (4, draw(st.sampled_from([1, 2, 4])), 3, 2), DType.F32),)
            attrs = (draw(pairs), draw(pairs), draw(pairs), draw(st.integers(0, 5)))
        else:
            attrs = (draw(st.integers(-1, 2)), draw(pairs), draw(pairs), draw(pairs))
    elif kind == "bmm":
        ins = (inp((2, T, 4)), add(Op.WEIGHT, (), (1, 0), (draw(st.sampled_from([1, 2])), 4, 3), DType.F32))
        attrs = ()
    else:
        if not nodes:
            return
        src = draw(st.integers(0, len(nodes) - 1))
        ins = (src,)
        attrs = (draw(st.integers(-1, 2)), draw(st.integers(-3, 3)), draw(st.integers(1, 3)))
    op = {"get_rows": Op.GET_ROWS, "set_rows": Op.SET_ROWS, "rope": Op.ROPE, "attention": Op.ATTENTION,
          "sample": Op.SAMPLE, "matmul": Op.MATMUL, "view": Op.VIEW, "conv2d": Op.CONV2D,
          "pool2d": Op.POOL2D, "bmm": Op.BMM}[kind]
    try:
        shape, dtype = infer(op, [(nodes[i].shape, nodes[i].dtype) for i in ins], attrs)
    except GraphError:
        return
    add(op, ins, attrs, tuple(shape), dtype)


def value_of(tp) -> st.SearchStrategy:
    """Any value of a message field's type (for round trips)."""
    import typing

    if tp is int:
        return I64
    if tp is float:
        return FLOATS
    if tp is bool:
        return st.booleans()
    if tp is str:
        return TEXT
    if tp is bytes:
        return st.binary(max_size=40)
    if tp is Graph:
        return graphs()
    if typing.get_origin(tp) is tuple:
        return st.lists(value_of(typing.get_args(tp)[0]), max_size=3).map(tuple)
    fields = m._fields(tp)
    return st.tuples(*(value_of(f) for _, f in fields)).map(lambda vals: tp(*vals))


MESSAGES = st.sampled_from(list(m.OPCODES.values())).flatmap(value_of)


# ---------------------------------------------------------------- decoder


@budget(4000)
@given(st.sampled_from(sorted(m.OPCODES)), st.binary(max_size=300))
def test_random_bodies_decode_or_raise_protocol_error(opcode, body):
    try:
        msg = m.decode_body(opcode, body)
    except ProtocolError:
        return
    assert isinstance(msg, m.OPCODES[opcode])
    assert m.encode(msg)[m.HEADER.size:] == body  # accepted bytes are canonical


def _generic(cls: type, body: bytes) -> object:
    r = Reader(body)
    msg = m._reader(cls)(r)
    r.end()
    return msg


@budget(1500)
@given(st.sampled_from([m.Step, m.Data]), st.one_of(
    st.binary(max_size=120),
    st.builds(lambda msg, cut, junk: m.encode(msg)[m.HEADER.size:][:cut] + junk,
              st.one_of(value_of(m.Step), value_of(m.Data)), st.integers(0, 200), st.binary(max_size=3))))
def test_hand_coded_decoders_agree_with_the_generic_one(cls, body):
    """Step and Data bodies are parsed by hand on the hot path: they accept and refuse
    exactly what the generic, field-by-field decoder does."""
    try:
        want = _generic(cls, body)
    except ProtocolError:
        with pytest.raises(ProtocolError):
            m.decode_body(m.OPCODE_OF[cls], body)
        return
    assert m.decode_body(m.OPCODE_OF[cls], body) == want


@budget(1500)
@given(st.binary(min_size=16, max_size=16))
def test_random_headers(raw):
    try:
        h = m.decode_header(raw)
    except ProtocolError:
        return
    assert h.opcode in m.OPCODES and h.length <= m.MAX_BODY and not h.flags & ~m.WANT_REPLY


def _same(a, b) -> bool:
    """Equality with NaN equal to itself (floats travel bit for bit)."""
    return m.encode(a) == m.encode(b)


@budget(1000)
@given(MESSAGES)
def test_every_message_round_trips(msg):
    raw = m.encode(msg, 7, m.WANT_REPLY)
    back = m.decode_body(m.decode_header(raw[:16]).opcode, raw[16:])
    assert type(back) is type(msg) and _same(back, msg)


@budget(2000)
@given(MESSAGES, st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete", "cut", "count"]),
                                    st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_messages_decode_or_raise_protocol_error(msg, edits):
    body = bytearray(m.encode(msg)[16:])
    for kind, pos, byte in edits:
        pos = pos % (len(body) + 1)
        if kind == "flip" and body:
            body[pos % len(body)] ^= 1 << (byte % 8)
        elif kind == "insert":
            body[pos:pos] = bytes([byte])
        elif kind == "delete" and body:
            del body[pos % len(body)]
        elif kind == "cut":
            del body[pos:]
        elif kind == "count":  # a length or count field made huge
            body[pos:pos + 4] = (0xFFFFFFF0 + byte % 16).to_bytes(4, "little")
    try:
        back = m.decode_body(m.OPCODE_OF[type(msg)], bytes(body))
    except ProtocolError:
        return
    assert m.encode(back)[16:] == bytes(body)


# ---------------------------------------------------------------- validator + executor


def _inputs_for(graph: Graph, n_tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for name, node in graph.inputs().items():
        shape = tuple(n_tokens if d == T else max(d, 0) for d in node.shape)
        npt = NUMPY_DTYPES[node.dtype]
        if npt.kind == "f":
            out[name] = rng.standard_normal(shape).astype(npt)
        else:
            out[name] = rng.integers(-2, 12, shape).astype(npt)
    return out


def _session() -> Session:
    backend = LocalBackend("cpu", limits=LIMITS)
    cfg = SessionConfig("cpu", LIMITS, 0, 1, "fuzz")
    session = Session(None, backend, None, cfg)
    for msg in (m.AllocBuffer(1, 1 << 16, 0), m.SetTensor(1, 0, m.Blob(bytes(range(256)) * 256, -1, 1 << 16)),
                m.AllocBuffer(2, 4096, 1)):
        session.dispatch(msg)
    return session


def _dispatch(session: Session, msg: object) -> object:
    """The reply ``msg`` gets, as Session.serve makes it (a Step parsed off its frame, run
    to completion; a Data's blob fields as the message)."""
    if isinstance(msg, m.Step):
        msg = m.parse_step(m.encode(msg)[m.HEADER.size:])
    try:
        reply = session.dispatch(msg)
        if isinstance(reply, InFlight):
            reply = reply.finish()
        return m.Data(m.Blob(bytes(reply[0]), *reply[1:])) if isinstance(reply, tuple) else reply
    except Exception as e:  # noqa: BLE001 - exactly what Session.serve does
        err = error_for(e)
        assert err.code != m.ErrorCode.INTERNAL, f"{type(msg).__name__} -> {type(e).__name__}: {e}"
        return err


@budget(700)
@given(graphs(), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_graphs_are_refused_cleanly_or_run(graph, n_tokens, seed):
    try:
        graph.validate()
        valid = True
    except GraphError:
        valid = False
    session = _session()
    reply = _dispatch(session, m.RegisterGraph(9, graph))
    if not valid:
        assert isinstance(reply, m.Error) and reply.code == m.ErrorCode.GRAPH
        return
    if isinstance(reply, m.Error):
        return
    rng = np.random.default_rng(seed)
    arrays = _inputs_for(graph, n_tokens, rng)
    layout = StepLayout.of(graph)
    try:
        packed = layout.pack_inputs(arrays)
        n, payload = packed.n_tokens, packed.bytes()
    except LayoutError:  # a registered dim of 0 or less, sent as 0: T cannot be read off it
        return
    reply = _dispatch(session, m.Step(9, n, -1, 0, m.Blob(payload, -1, len(payload))))
    # the executor, given the same inputs directly, computes the same outputs or fails
    # too (in a session of its own: a graph may change its STATE buffers)
    fresh = _session()
    _dispatch(fresh, m.RegisterGraph(9, graph))
    try:
        want = fresh.backend.compute(9, arrays)
    except ApirError:
        assert isinstance(reply, m.Error)
        return
    if isinstance(reply, m.Data):
        outs = layout.unpack_outputs(bytearray(reply.data.inline), n)
        assert [o.tobytes() for o in outs] == [w.tobytes() for w in want]
    assert uncharged(session.backend) is None


REQUESTS = st.one_of(
    st.builds(m.AllocBuffer, st.integers(-1, 6), st.one_of(st.integers(-2, 1 << 16), I64), st.integers(-1, 3)),
    st.builds(m.FreeBuffer, st.integers(-1, 6)),
    st.builds(m.ClearBuffer, st.integers(0, 6), st.integers(-2, 300)),
    st.builds(m.SetTensor, st.integers(0, 6), I64, st.builds(m.Blob, st.binary(max_size=64), st.just(-1), st.integers(0, 64))),
    st.builds(m.GetTensor, st.integers(0, 6), I64, st.one_of(st.integers(-2, 70000), I64), st.integers(-1, 8)),
    st.builds(m.CopyTensor, st.integers(0, 6), I64, st.integers(0, 6), I64, st.one_of(st.integers(-1, 70000), I64)),
    st.builds(m.FreeGraph, st.integers(0, 10)),
    st.builds(m.Supports, I64, st.lists(I64, max_size=3).map(tuple)),
    st.builds(m.Step, st.integers(0, 10), st.one_of(st.integers(-2, 8), I64), I64, I64,
              st.builds(m.Blob, st.binary(max_size=64), st.just(-1), st.integers(0, 64))),
    st.sampled_from([m.Synchronize(), m.GetDevices(), m.Ok(), m.Goodbye()]),
)


@budget(300)
@given(st.lists(REQUESTS, max_size=25))
def test_request_sequences_keep_the_session_consistent(requests):
    session = _session()
    for msg in requests:
        _dispatch(session, msg)
        be = session.backend
        assert uncharged(be) is None
        assert len(be._buffers) + len(be._graphs) <= LIMITS.max_handles
    session.backend.close()


def _scales(n: int) -> Graph:
    nodes = [Node(Op.INPUT, (), ("x",), (T, 4), DType.F32)]
    nodes += [Node(Op.SCALE, (i,), (1.0,), (T, 4), DType.F32) for i in range(n)]
    return Graph(tuple(nodes), (n,))


def _set_rows(n: int) -> Graph:
    """A chain of SET_ROWS, each writing the last one's result (aliases of one STATE)."""
    chain = [Node(Op.STATE, (), (1, 0), (4, 4), DType.F32), Node(Op.INPUT, (), ("x",), (T, 4), DType.F32),
             Node(Op.INPUT, (), ("i",), (T,), DType.I32)]
    chain += [Node(Op.SET_ROWS, (i + 2 if i else 0, 1, 2), (), (4, 4), DType.F32) for i in range(n)]
    return Graph(tuple(chain), (len(chain) - 1,))


def _lines_run(graph: Graph) -> int:
    """Python lines executed validating ``graph``: a count of work that load cannot change."""
    lines = 0

    def trace(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return trace

    sys.settrace(trace)
    try:
        graph.validate()
    finally:
        sys.settrace(None)
    return lines


def test_deep_graphs_validate_without_recursion_in_linear_time():
    _scales(65535).validate()  # no RecursionError
    _set_rows(65533).validate()
    for make in (_scales, _set_rows):  # twice the nodes, twice the work: not n squared
        assert _lines_run(make(2000)) <= 2 * _lines_run(make(1000)), make.__name__


def test_errors_from_malformed_python_graphs_are_graph_errors():
    """Wrong Python types can only come from a local caller, never from the wire; they
    must still be GraphErrors, not crashes."""
    x = Node(Op.INPUT, (), ("x",), (), DType.F32)
    for node in (Node(Op.MATMUL, (0, 0), (), (), DType.F32), Node(Op.SET_ROWS, (0, 0, 0), (), (), DType.F32)):
        with pytest.raises(GraphError):
            Graph((x, node), (1,)).validate()
    assert isinstance(ApirError("x"), Exception)
