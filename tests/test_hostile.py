"""Hostile guests against a real daemon, over raw sockets: every class of bad input gets
an Error reply with the right code and a message that names the problem (and leaks no
host path or address), and the daemon keeps serving a well-behaved guest afterwards.

The daemon here runs with tight per-session limits so that quotas are quick to reach.
After every test, ``healthy`` checks that a real frontend still gets correct results and
that the host log shows no internal error and no crashed worker.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time

import numpy as np
import pytest
from hosts import WAIT, start_host
from rawguest import LEAK, Closed, RawGuest, frame

from apir.backends.remote import RemoteBackend
from apir.errors import ApirError
from apir.graph import DType, Graph, GraphBuilder, Node, Op, T
from apir.host.daemon import MAX_PENDING, HostConfig
from apir.host.session import scrub
from apir.protocol import ALIGN
from apir.protocol import messages as m
from apir.transport import parse_address
from apir.transport import shm as iv

E = m.ErrorCode
MAX_MEMORY = 64 << 20
MAX_HANDLES = 300
MAX_NODES = 4096
IO_TIMEOUT = 2.0
MAX_SESSIONS = 6


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    h = start_host(tmp_path_factory.mktemp("hostile"), "--max-memory", "64M", "--max-handles",
                   str(MAX_HANDLES), "--max-graph-nodes", str(MAX_NODES), "--io-timeout", str(IO_TIMEOUT),
                   "--handshake-timeout", "300", "--max-message", "16M", "--max-sessions", str(MAX_SESSIONS))
    yield h
    h.stop()


def well_behaved(host) -> None:
    """A real frontend session: upload, register, compute, check the numbers."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    with RemoteBackend(host.unix, timeout=WAIT) as be:
        h = be.alloc_buffer(w.nbytes)
        be.set_tensor(h, 0, w)
        g = GraphBuilder()
        y = g.matmul(g.input("x", (T, 32)), g.weight(h, 0, (16, 32), DType.F32))
        (out,) = be.compute(be.register_graph(g.build(y)), {"x": x})
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def healthy(host):
    """After each test: the daemon is alive, serves a good guest, logged no internal error."""
    seen = host.log.stat().st_size if host.log.exists() else 0
    yield
    assert host.proc.poll() is None, "the daemon died"
    assert host.wait_idle().sessions == ()  # this test's sessions are all released
    well_behaved(host)
    assert host.wait_idle().sessions == ()
    log = host.log.read_text()[seen:]
    for bad in ("Traceback", "internal error", "worker failed", "exited with status"):
        assert bad not in log, f"host log shows {bad!r}:\n{log}"


def guest(host, **kw) -> RawGuest:
    return RawGuest(host.unix, **kw)


def expect(err: m.Error, code: int, *parts: str) -> None:
    assert isinstance(err, m.Error), err
    assert err.code == code, f"code {err.code} (wanted {code}): {err.message}"
    for part in parts:
        assert part in err.message, f"{part!r} not in {err.message!r}"
    assert not LEAK.search(err.message)


def refused(host, data: bytes) -> m.Error:
    """Send raw bytes as a new connection's first frame; the daemon answers and hangs up."""
    with guest(host, hello=False) as g:
        g.send_raw(data)
        reply = g.recv()
        assert g.closed_by_host()
    return reply


def graph(*nodes: Node, outputs=None) -> Graph:
    return Graph(tuple(nodes), tuple(outputs if outputs is not None else (len(nodes) - 1,)))


def leaf(op: Op, attrs: tuple, shape: tuple, dtype: DType = DType.F32) -> Node:
    return Node(op, (), attrs, shape, dtype)


def x_input(shape=(T, 8), dtype=DType.F32, name="x") -> Node:
    return leaf(Op.INPUT, (name,), shape, dtype)


def step(gid: int, *xs: np.ndarray | bytes, n_tokens: int | None = None, out=(-1, 0), feed=()) -> m.Step:
    """A Step of ``xs`` (arrays, the graph's unfed inputs in order, each at a multiple of
    ALIGN as the layout puts them; or raw payload bytes); T from the first one's length."""
    raw = b""
    for x in xs:
        raw += x if isinstance(x, bytes) else bytes(-len(raw) % ALIGN) + x.tobytes()
    n = n_tokens if n_tokens is not None else len(xs[0]) if xs and not isinstance(xs[0], bytes) else 1
    return m.Step(gid, n, *out, m.Blob(raw, -1, len(raw)), feed)


# ================================================================ framing


def test_bad_magic_before_the_handshake(host):
    expect(refused(host, frame(1, b"x" * 8, magic=b"GET ")), E.PROTOCOL, "bad magic", "does not speak")


def test_http_request_is_refused(host):
    reply = refused(host, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    expect(reply, E.PROTOCOL, "bad magic b'GET '")


def test_any_message_before_the_handshake(host):
    for msg in (m.AllocBuffer(1, 64, 0), m.GetDevices(), m.Goodbye(), m.Welcome(1, 1, m.Device("", "", "", 0, 0, ()), 0, 0)):
        expect(refused(host, m.encode(msg, 1, m.WANT_REPLY)), E.PROTOCOL,
               f"expected a Hello handshake first, got {type(msg).__name__}")


def test_oversized_handshake(host):
    expect(refused(host, frame(1, length=5000)), E.PROTOCOL, "5000 bytes exceeds the limit of 4096")


def test_truncated_and_padded_handshakes(host):
    hello = m.encode(m.Hello(m.PROTOCOL_VERSION, m.op_table_hash(), "", "t", 0))
    short = frame(1, hello[16:-3], length=len(hello) - 16 - 3)
    expect(refused(host, short), E.PROTOCOL, "truncated message")
    expect(refused(host, hello + b"\0\0"), E.PROTOCOL, "data after the Hello before the Welcome")
    expect(refused(host, frame(1, hello[16:] + b"zz")), E.PROTOCOL, "2 unexpected bytes after the message")


def test_unknown_opcode_and_flags(host):
    expect(refused(host, frame(1234)), E.PROTOCOL, "unknown opcode 1234")
    expect(refused(host, frame(1, flags=6)), E.PROTOCOL, "unknown flags 0x6")
    with guest(host) as g:  # inside a session: the stream is out of step, so it ends
        g.send_raw(frame(4321, b"\0" * 8))
        expect(g.recv(), E.PROTOCOL, "unknown opcode 4321")
        assert g.closed_by_host()


def test_bad_version_and_op_table(host):
    reply = refused(host, m.encode(m.Hello(99, m.op_table_hash(), "", "t", 0), 1, 1))
    expect(reply, E.VERSION, "guest speaks version 99", f"host speaks version {m.PROTOCOL_VERSION}")
    reply = refused(host, m.encode(m.Hello(m.PROTOCOL_VERSION, b"\0" * 32, "", "t", 0), 1, 1))
    expect(reply, E.VERSION, "op tables differ")


def test_bad_frames_inside_a_session_end_it_with_an_error(host):
    cases = [
        (frame(20, b"\0" * 5), "truncated message"),  # AllocBuffer needs 24 bytes
        (frame(20, b"\0" * 30), "6 unexpected bytes after the message"),
        (frame(1, length=17 << 20), f"{17 << 20} bytes exceeds the limit of {16 << 20}"),  # --max-message
        (frame(20, b"\0" * 24, magic=b"APIS"), "bad magic b'APIS'"),
        (frame(11, struct.pack("<qI", 20, 2**20 + 5)), "exceeds the limit of 1048576"),
    ]
    for raw, message in cases:
        with guest(host) as g:
            sid = g.welcome.session
            g.send_raw(raw)
            expect(g.recv(), E.PROTOCOL, message)
            assert g.closed_by_host()
        session_gone(host, sid)


def test_second_handshake_and_replies_sent_as_requests(host):
    with guest(host) as g:
        hello = m.Hello(m.PROTOCOL_VERSION, m.op_table_hash(), "", "again", 0)
        expect(g.error(hello), E.PROTOCOL, "a second handshake in one session")
        expect(g.error(m.Ok()), E.PROTOCOL, "Ok is not a request")
        expect(g.error(m.Error(1, "x")), E.PROTOCOL, "Error is not a request")
        expect(g.error(m.Status(1, m.Device("", "", "", 0, 0, ()), (), 1, 0)), E.PROTOCOL, "Status is not a request")
        assert isinstance(g.ok(m.GetDevices()), m.Devices)  # the session goes on


def test_tcp_requires_the_token(host):
    for token in ("", "wrong", open(host.token_file).read().strip() + "x"):
        with pytest.raises(AssertionError, match="authentication failed"):
            RawGuest(host.tcp, token=token)
    with RawGuest(host.tcp, hello=False) as g:  # a status probe is no way around it
        reply = g.call(m.Hello(m.PROTOCOL_VERSION, m.op_table_hash(), "", "t", 0, True))
        expect(reply, E.AUTH, "authentication failed")
    with RawGuest(host.tcp, token=open(host.token_file).read().strip(), arena_size=1 << 20) as g:
        assert g.welcome.arena_size == 0 and g.arena is None  # no shared memory over tcp
        assert isinstance(g.ok(m.GetDevices()), m.Devices)


def test_listening_defaults_are_safe():
    assert parse_address("tcp://:7070").host == "127.0.0.1"  # loopback unless asked
    with pytest.raises(Exception, match="requires a token"):
        HostConfig(listen=(parse_address("tcp://127.0.0.1:7070"),))
    with pytest.raises(Exception, match="requires a token"):
        HostConfig(listen=(parse_address("unix:///tmp/x.sock"), parse_address("vsock://2:7070")))


def test_unix_socket_is_owner_only(host):
    path = host.unix.removeprefix("unix://")
    assert os.stat(path).st_mode & 0o777 == 0o600


# ================================================================ integer ranges


def test_buffer_sizes(host):
    with guest(host) as g:
        for size, message in ((0, "must be a positive integer, got 0"), (-1, "got -1"), (-(2**63), "got -9223372036854775808")):
            expect(g.error(m.AllocBuffer(1, size, 0)), E.INVALID, message)
        expect(g.error(m.AllocBuffer(1, 2**63 - 1, 0)), E.QUOTA, "would exceed this session's memory limit")
        expect(g.error(m.AllocBuffer(1, 64, 7)), E.INVALID, "unknown buffer purpose 7")


def test_handle_ranges(host):
    with guest(host) as g:
        for h in (0, -1, 2**31, 2**63 - 1, -(2**63)):
            expect(g.error(m.AllocBuffer(h, 64, 0)), E.INVALID, f"handle {h} must be an integer in [1, 2^31)")
        g.ok(m.AllocBuffer(2**31 - 1, 64, 0))
        expect(g.error(m.AllocBuffer(2**31 - 1, 64, 0)), E.INVALID, "handle 2147483647 is already in use")


def test_offsets_and_sizes_cannot_overflow(host):
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 4096, 0))
        blob = m.Blob(b"\1" * 16, -1, 16)
        for off in (2**63 - 1, 2**63 - 8, 4096 - 15, -1, -(2**63)):
            expect(g.error(m.SetTensor(1, off, blob)), E.INVALID, "lie outside buffer 1 of 4096 bytes")
        for off, size in ((0, 4097), (-16, 32), (4000, 2**63 - 1), (0, -1), (2**62, 2**62)):
            expect(g.error(m.GetTensor(1, off, size, -1)), E.INVALID, "lie outside buffer 1")
        for args in ((1, 4090, 1, 0, 16), (1, 0, 1, 2**63 - 1, 1), (1, 0, 1, 0, -5)):
            expect(g.error(m.CopyTensor(*args)), E.INVALID, "lie outside buffer 1")
        for v in (256, -1, 2**40):
            expect(g.error(m.ClearBuffer(1, v)), E.INVALID, f"clear value must be a byte, got {v}")
        assert g.ok(m.GetTensor(1, 4096, 0, -1)).data.size == 0  # an empty range at the end is fine


def test_blob_fields(host):
    with guest(host, arena_size=1 << 16) as g:
        a = g.welcome.arena_size  # what the host granted (the region's arena part)
        g.ok(m.AllocBuffer(1, 4096, 0))
        expect(g.error(m.SetTensor(1, 0, m.Blob(b"abc", -1, 4))), E.PROTOCOL, "inline data length disagrees")
        expect(g.error(m.SetTensor(1, 0, m.Blob(b"abc", 0, 3))), E.PROTOCOL, "both inline and in the arena")
        for off, size in ((a, 1), (a - 8, 64), (0, -1), (2**63 - 1, 2), (-(2**62), 4)):
            expect(g.error(m.SetTensor(1, 0, m.Blob(b"", off, size))), E.INVALID if off >= 0 else E.PROTOCOL,
                   f"outside the {a}-byte arena" if off >= 0 else "disagrees")
        expect(g.error(m.GetTensor(1, 0, 4096 + 64, -1)), E.INVALID, "outside buffer")
        g.ok(m.SetTensor(1, 0, m.Blob(b"", 0, 4096)))  # a good arena range still works
    with guest(host) as g:  # no arena at all (arena_size 0)
        g.ok(m.AllocBuffer(1, 4096, 0))
        expect(g.error(m.SetTensor(1, 0, m.Blob(b"", 0, 16))), E.INVALID, "no shared arena")


def test_arena_requests_are_capped(host):
    with guest(host, arena_size=2**62) as g:  # asks for 4 EiB: gets the host's --max-arena (1G)
        # a 1 GiB region, less the control rings at its start
        assert (1 << 30) - (4 << 20) < g.welcome.arena_size < 1 << 30
    with guest(host, arena_size=-5) as g:
        assert g.welcome.arena_size == 0


def test_zero_and_partial_blocks(host):
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 4096, 0))
        bad = [
            (leaf(Op.WEIGHT, (1, 0), (4, 0)), "bad dimension in (4, 0)"),
            (leaf(Op.WEIGHT, (1, 0), (4, -7)), "bad dimension"),
            (leaf(Op.WEIGHT, (1, 0), (2, 48), DType.Q8_0), "rows must be whole 32-element blocks"),
            (leaf(Op.WEIGHT, (1, 0), (), DType.Q4_K), "rows must be whole 256-element blocks"),
            (leaf(Op.STATE, (1, 0), (2, 32), DType.Q8_0), "STATE tensors cannot be quantized"),
            (x_input((T, 8), DType.Q4_0), "INPUT dtype must be one of"),
        ]
        for node, message in bad:
            expect(g.error(m.RegisterGraph(1, graph(node))), E.GRAPH, message)


# ================================================================ handles


def test_forged_freed_and_double_freed_handles(host):
    with guest(host) as g:
        expect(g.error(m.GetTensor(77, 0, 4, -1)), E.INVALID, "unknown buffer handle 77")
        expect(g.error(m.FreeBuffer(77)), E.INVALID, "unknown buffer handle 77")
        g.ok(m.AllocBuffer(5, 64, 0))
        g.ok(m.FreeBuffer(5))
        expect(g.error(m.FreeBuffer(5)), E.INVALID, "unknown buffer handle 5")  # double free
        for msg in (m.GetTensor(5, 0, 4, -1), m.SetTensor(5, 0, m.Blob(b"ab", -1, 2)), m.ClearBuffer(5, 0),
                    m.CopyTensor(5, 0, 5, 0, 1)):
            expect(g.error(msg), E.INVALID, "unknown buffer handle 5")
        expect(g.error(step(5)), E.INVALID, "unknown graph id 5")
        expect(g.error(m.FreeGraph(5)), E.INVALID, "unknown graph id 5")


def test_handles_are_typed(host):
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 256, 0))
        g.ok(m.RegisterGraph(2, _scale_graph()))
        expect(g.error(m.GetTensor(2, 0, 4, -1)), E.INVALID, "unknown buffer handle 2")  # a graph id
        expect(g.error(step(1)), E.INVALID, "unknown graph id 1")  # a buffer handle
        expect(g.error(m.FreeGraph(1)), E.INVALID, "unknown graph id 1")
        expect(g.error(m.RegisterGraph(2, _scale_graph())), E.INVALID, "handle 2 is already in use")


def _scale_graph(n: int = 1) -> Graph:
    nodes = [x_input()]
    for i in range(n):
        nodes.append(Node(Op.SCALE, (i,), (1.0,), (T, 8), DType.F32))
    return graph(*nodes)


def test_handles_of_another_session_do_not_exist_here(host):
    with guest(host) as a, guest(host) as b:
        a.ok(m.AllocBuffer(7, 64, 0))
        a.ok(m.SetTensor(7, 0, m.Blob(b"\xaa" * 64, -1, 64)))
        a.ok(m.RegisterGraph(8, _scale_graph()))
        expect(b.error(m.GetTensor(7, 0, 64, -1)), E.INVALID, "unknown buffer handle 7")
        expect(b.error(m.FreeBuffer(7)), E.INVALID, "unknown buffer handle 7")
        expect(b.error(step(8)), E.INVALID, "unknown graph id 8")
        b.ok(m.AllocBuffer(7, 64, 0))  # the same number is a different, fresh buffer here
        assert b.ok(m.GetTensor(7, 0, 64, -1)).data.inline == bytes(64)
        assert a.ok(m.GetTensor(7, 0, 64, -1)).data.inline == b"\xaa" * 64


def test_graph_refuses_a_freed_buffer_minted_again(host):
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 4096, 0))
        gr = graph(x_input((T, 32)), leaf(Op.WEIGHT, (1, 0), (32, 32)),
                   Node(Op.MATMUL, (0, 1), (), (T, 32), DType.F32))
        g.ok(m.RegisterGraph(2, gr))
        g.ok(m.FreeBuffer(1))
        g.ok(m.AllocBuffer(1, 64, 0))  # same handle, smaller: the graph must not read past it
        expect(g.error(step(2, np.ones((1, 32), np.float32))), E.INVALID, "graph 2 uses buffer 1, which was freed")


# ================================================================ ranges


def test_tensors_beyond_their_buffer(host):
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 1024, 0))
        for node, message in [
            (leaf(Op.WEIGHT, (1, 0), (16, 17)), "bytes [0, 1088) lie outside buffer 1 of 1024 bytes"),
            (leaf(Op.WEIGHT, (1, 992), (16,)), "bytes [992, 1056) lie outside"),
            (leaf(Op.STATE, (1, 2**62), (4,)), "lie outside"),
            (leaf(Op.STATE, (1, -32), (4,)), "lie outside"),
            (leaf(Op.WEIGHT, (1, 0), (2**40, 2**40)), "lie outside"),
            (leaf(Op.WEIGHT, (1, 16), (4,)), "offset 16 is not 32-byte aligned"),
            (leaf(Op.WEIGHT, (9, 0), (4,)), "refers to unknown buffer 9"),
        ]:
            expect(g.error(m.RegisterGraph(2, graph(node))), E.INVALID, message)


def test_arena_destinations_are_checked(host):
    with guest(host, arena_size=1 << 16) as g:
        size = g.welcome.arena_size  # what the host granted (the region's arena part)
        g.ok(m.AllocBuffer(1, 1 << 16, 0))
        for dest in (size - 100, 1 << 40, 2**63 - 1):
            expect(g.error(m.GetTensor(1, 0, 8192, dest)), E.INVALID, f"outside the {size}-byte arena")
        g.ok(m.RegisterGraph(2, _scale_graph()))
        x = np.ones((1024, 8), np.float32)  # a 32 KiB output
        expect(g.error(step(2, x, out=(size - 64, 2**62))), E.INVALID, f"outside the {size}-byte arena")
        out = g.ok(step(2, x, out=(0, 1 << 16)))  # a good range still works
        assert out.data.arena_offset == 0 and out.data.size == 32768


def test_oversized_inline_reply_is_an_error_not_a_crash(host):
    size = m.MAX_BODY - 4096  # within the quota, but its reply is not: refused before the read
    with guest(host) as g:  # no arena, so the bytes would have to travel inline
        g.ok(m.AllocBuffer(1, size, 0))
        expect(g.error(m.GetTensor(1, 0, size, -1)), E.QUOTA, f"reading {size} bytes would exceed")
        assert g.ok(m.GetTensor(1, 0, 8, -1)).data.inline == bytes(8)


# ================================================================ semantics


def test_shape_and_dtype_rules(host):
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 4096, 0))
        w = leaf(Op.WEIGHT, (1, 0), (4, 16))
        cases = [
            (graph(x_input(), w, Node(Op.MATMUL, (0, 1), (), (T, 4), DType.F32)), "MATMUL inner dims differ"),
            (graph(x_input(), Node(Op.SCALE, (0,), (1.0,), (T, 9), DType.F32)), "claims a result its inputs do not give"),
            (graph(x_input(), Node(Op.SCALE, (0,), (1.0,), (T, 8), DType.F16)), "claims a result"),
            (graph(x_input(dtype=DType.I32), Node(Op.SILU, (0,), (), (T, 8), DType.F32)), "must be a float tensor, got I32"),
            (graph(x_input(), Node(Op.ADD, (0,), (), (T, 8), DType.F32)), "ADD takes 2 inputs, got 1"),
            (graph(x_input(), Node(Op.RMS_NORM, (0,), (math.nan,), (T, 8), DType.F32)), "attribute eps must be float"),
            (graph(x_input(), Node(Op.RMS_NORM, (0,), (-1.0,), (T, 8), DType.F32)), "eps must be positive"),
            (graph(x_input(), Node(Op.SCALE, (0,), (math.inf,), (T, 8), DType.F32)), "attribute scale must be float"),
            (graph(x_input(), Node(Op.PERMUTE, (0,), ((0, 0),), (T, T), DType.F32)), "not a permutation"),
            (graph(x_input(), Node(Op.RESHAPE, (0,), ((T, 0),), (T, 0), DType.F32)), "has a bad dim"),
            (graph(x_input(), Node(Op.VIEW, (0,), (0, 0, 1), (1, 8), DType.F32)), "must count from the end"),
            (graph(x_input(), Node(Op.CONCAT, (0, 0), (0,), (T, 8), DType.F32)), "along the token axis"),
            (graph(x_input(), x_input(name="x")), "input name 'x' used twice"),
            (graph(leaf(Op.WEIGHT, (1, 0), ()), w, Node(Op.MATMUL, (0, 1), (), (4,), DType.F32)), "MATMUL"),
            (graph(x_input(), outputs=()), "graph outputs must name existing nodes"),
            (graph(x_input(), outputs=(1,)), "graph outputs must name existing nodes"),
            (graph(leaf(Op.WEIGHT, (1, 0), (4, 32), DType.Q8_0)), "must be one of"),  # quantized output
            (graph(outputs=(0,)), "a graph needs 1.."),
        ]
        for gr, message in cases:
            expect(g.error(m.RegisterGraph(2, gr)), E.GRAPH, message)


def test_unknown_node_ids_and_cycles(host):
    with guest(host) as g:
        for nodes, message in [
            ((Node(Op.SCALE, (0,), (1.0,), (4,), DType.F32),), "node 0 (SCALE) uses an unknown or later node id"),
            ((x_input(), Node(Op.ADD, (1, 2), (), (T, 8), DType.F32), Node(Op.ADD, (1, 0), (), (T, 8), DType.F32)),
             "node 1 (ADD) uses an unknown or later node id"),
            ((x_input(), Node(Op.SCALE, (2**32 - 1,), (1.0,), (T, 8), DType.F32)), "unknown or later node id"),
            ((Node(Op.INPUT, (0,), ("x",), (4,), DType.F32),), "unknown or later node id"),
        ]:
            expect(g.error(m.RegisterGraph(2, graph(*nodes))), E.GRAPH, message)


def test_huge_and_deep_graphs(host):
    with guest(host) as g:
        deep = _scale_graph(MAX_NODES - 1)  # the longest chain allowed: no recursion anywhere
        g.ok(m.RegisterGraph(1, deep))
        x = np.arange(16, dtype=np.float32).reshape(2, 8)
        out = g.ok(step(1, x))
        assert np.frombuffer(out.data.inline, np.float32).reshape(2, 8).tolist() == x.tolist()
        g.ok(m.FreeGraph(1))
        expect(g.error(m.RegisterGraph(2, _scale_graph(MAX_NODES))), E.QUOTA,
               f"graph of {MAX_NODES + 1} nodes exceeds the limit of {MAX_NODES}")
        # past the wire format's own cap: refused by the decoder, which ends the session
        g.send(m.RegisterGraph(3, _scale_graph(1 << 16)))
        expect(g.recv(), E.PROTOCOL, "list of 65537 items exceeds the limit of 65536")


def test_deep_set_rows_chain_on_a_state(host):
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 4 * 8 * 4, 1))
        nodes = [leaf(Op.STATE, (1, 0), (4, 8)), x_input(), x_input((T,), DType.I32, "ids")]
        for _ in range(2000):
            nodes.append(Node(Op.SET_ROWS, (len(nodes) - 1 if len(nodes) > 3 else 0, 1, 2), (), (4, 8), DType.F32))
        g.ok(m.RegisterGraph(2, graph(*nodes)))
        src = np.full((1, 8), 3.0, np.float32)
        ids = np.array([2], np.int32)
        out = g.ok(step(2, src, ids))
        assert np.frombuffer(out.data.inline, np.float32).reshape(4, 8)[2].tolist() == [3.0] * 8


def test_set_rows_cannot_write_weights_or_inputs(host):
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 4096, 0))
        ids = x_input((T,), DType.I32, "ids")
        src = x_input((T, 8), name="src")
        for dst, message in [
            ([leaf(Op.WEIGHT, (1, 0), (4, 8))], "writes into node 0 (WEIGHT"),
            ([leaf(Op.WEIGHT, (1, 0), (4, 8)),
              Node(Op.RESHAPE, (0,), ((2, 16),), (2, 16), DType.F32),
              Node(Op.RESHAPE, (1,), ((4, 8),), (4, 8), DType.F32)], "writes into node 0 (WEIGHT"),
            ([leaf(Op.WEIGHT, (1, 0), (4, 8)), Node(Op.CONTIGUOUS, (0,), (), (4, 8), DType.F32)], "WEIGHT"),
            ([x_input((4, 8), name="base")], "writes into node 0 (INPUT"),
        ]:
            n = len(dst)
            nodes = [*dst, src, ids, Node(Op.SET_ROWS, (n - 1, n, n + 1), (), (4, 8), DType.F32)]
            expect(g.error(m.RegisterGraph(2, graph(*nodes))), E.GRAPH, message, "SET_ROWS may only write a STATE")


def test_index_tensors_are_checked_at_execution(host):
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 4096, 0))
        table = leaf(Op.WEIGHT, (1, 0), (8, 4))
        ids = x_input((T,), DType.I32, "ids")
        g.ok(m.RegisterGraph(2, graph(table, ids, Node(Op.GET_ROWS, (0, 1), (), (T, 4), DType.F32))))
        for bad in ([0, 8], [-1], [2**31 - 1], [-(2**31)]):
            arr = np.array(bad, np.int32)
            expect(g.error(step(2, arr)), E.INVALID,
                   "GET_ROWS row index out of range", "must lie in [0, 8)")
        g.ok(m.AllocBuffer(3, 4 * 2 * 4 * 4, 1))
        state = leaf(Op.STATE, (3, 0), (4, 2, 4))
        src = x_input((T, 2, 4), name="src")
        g.ok(m.RegisterGraph(4, graph(state, src, ids, Node(Op.SET_ROWS, (0, 1, 2), (), (4, 2, 4), DType.F32))))
        expect(g.error(step(4, np.ones((1, 2, 4), np.float32), np.array([4], np.int32))),
               E.INVALID, "SET_ROWS row index out of range")
        q = x_input((T, 2, 4), name="q")
        pos = x_input((T,), DType.I32, "pos")
        att = Node(Op.ATTENTION, (1, 0, 0, 2), (0.5, 0, 0.0), (T, 2, 4), DType.F32)
        g.ok(m.RegisterGraph(5, graph(state, q, pos, att)))
        for p in ([4], [-1], [1 << 30]):
            expect(g.error(step(5, np.ones((1, 2, 4), np.float32), np.array(p, np.int32))), E.INVALID,
                   "ATTENTION position index out of range")


def test_view_from_the_end_of_the_token_axis_does_not_wrap(host):
    with guest(host) as g:
        view = Node(Op.VIEW, (0,), (0, -4, 1), (1, 8), DType.F32)
        g.ok(m.RegisterGraph(1, graph(x_input(), view)))
        x = np.arange(16, dtype=np.float32).reshape(2, 8)
        expect(g.error(step(1, x)), E.INVALID, "VIEW start -4 outside axis of size 2")
        x4 = np.arange(32, dtype=np.float32).reshape(4, 8)
        out = g.ok(step(1, x4))
        assert np.frombuffer(out.data.inline, np.float32).tolist() == x4[0].tolist()


def test_compute_inputs_are_only_bytes_of_the_layouts_size(host):
    """A Step names no input, dtype or shape (the guest checks those before sending): the
    host takes bytes of exactly the layout's size for T, whatever they hold, and refuses
    every other size."""
    with guest(host) as g:
        g.ok(m.RegisterGraph(1, _scale_graph()))
        nan = np.full((2, 8), 0x7FC00001, np.int32)  # NaN bit patterns where F32 goes
        out = g.ok(step(1, nan))
        assert out.data.inline == nan.tobytes()
        for payload, n, message in [
            (b"", 2, "step inputs of 0 bytes; the graph's layout takes 64"),
            (np.ones((2, 9), np.float32).tobytes(), 2, "step inputs of 72 bytes; the graph's layout takes 64"),
            (np.ones((2, 8), np.float64).tobytes(), 2, "step inputs of 128 bytes"),
            (np.ones((0, 8), np.float32).tobytes(), 0, "step with T=0"),
        ]:
            expect(g.error(step(1, payload, n_tokens=n)), E.PROTOCOL, message)


def test_step_payloads_are_checked(host):
    """The fixed-layout compute: the payload's size, T and blob are checked before use."""
    with guest(host, arena_size=1 << 16) as g:
        a = g.welcome.arena_size
        g.ok(m.RegisterGraph(1, _scale_graph()))
        x = np.arange(16, dtype=np.float32).reshape(2, 8)
        out = g.ok(step(1, x))
        assert np.frombuffer(out.data.inline, np.float32).tolist() == x.ravel().tolist()
        for request, code, message in [
            (step(1, x.tobytes()[:-4], n_tokens=2), E.PROTOCOL, "step inputs of 60 bytes; the graph's layout takes 64"),
            (step(1, x.tobytes() + b"\0" * 4, n_tokens=2), E.PROTOCOL, "step inputs of 68 bytes"),
            (step(1, x, n_tokens=3), E.PROTOCOL, "step inputs of 64 bytes; the graph's layout takes 96"),
            (step(1, b"", n_tokens=0), E.PROTOCOL, "step with T=0"),
            (step(1, x, n_tokens=-1), E.PROTOCOL, "step with T=-1"),
            (step(1, x, n_tokens=2**62), E.PROTOCOL, f"step with T={2**62}"),
            (step(7, x), E.INVALID, "unknown graph id 7"),
            (m.Step(1, 2, -1, 0, m.Blob(x.tobytes(), -1, 65)), E.PROTOCOL, "inline data length disagrees"),
            (m.Step(1, 2, -1, 0, m.Blob(b"ab", 0, 2)), E.PROTOCOL, "both inline and in the arena"),
            (m.Step(1, 2, -1, 0, m.Blob(b"", a - 32, 64)), E.INVALID, f"outside the {a}-byte arena"),
            (m.Step(1, 2, -1, 0, m.Blob(b"", 2**63 - 1, 64)), E.INVALID, f"outside the {a}-byte arena"),
            (m.Step(1, 2, -1, 0, m.Blob(b"", 0, -64)), E.INVALID, f"outside the {a}-byte arena"),
        ]:
            expect(g.error(request), code, message)
        big = np.ones((1024, 8), np.float32)  # a 32 KiB output: through the arena when given a range
        for dest in ((a - 64, 1 << 16), (2**62, 1 << 16), (-(2**62), 1 << 16)):
            reply = g.call(step(1, big, out=dest))
            if dest[0] >= 0:
                expect(reply, E.INVALID, f"outside the {a}-byte arena")
            else:  # a negative offset means inline
                assert reply.data.size == big.nbytes and reply.data.arena_offset == -1
        assert g.ok(step(1, big, out=(0, 1 << 16))).data.arena_offset == 0
        assert g.ok(step(1, big, out=(0, 100))).data.arena_offset == -1  # too small a range: inline
        g.ok(m.FreeGraph(1))
        expect(g.error(step(1, x)), E.INVALID, "unknown graph id 1")
        g.ok(m.AllocBuffer(2, 256, 0))
        expect(g.error(step(2, x)), E.INVALID, "unknown graph id 2")  # a buffer handle


def _fed_graph() -> Graph:
    """ids (T,) I32 and x (T, 8) F32 in; out: argmax of x per row (I32, the pick a feed
    takes), x doubled (F32), ids (I32, what was sent or fed)."""
    ids = x_input((T,), DType.I32, "ids")
    return graph(ids, x_input(), Node(Op.SCALE, (1,), (2.0,), (T, 8), DType.F32),
                 Node(Op.ARGMAX, (1,), (), (T,), DType.I32), outputs=(3, 2, 0))


def test_feeds_are_checked(host):
    """A feed names an input and an output of the graph, each input once, never an input
    also sent; and there must be a previous compute whose output it takes."""
    with guest(host) as g:
        g.ok(m.RegisterGraph(1, _fed_graph()))
        ids, x = np.array([5, 6], np.int32), np.eye(8, dtype=np.float32)[[3, 1]]  # picks 3, 1
        both = ids.tobytes() + bytes(8) + x.tobytes()  # ids padded to 16 bytes, then x
        fed = (m.Feed(0, 0),)  # ids from output 0
        expect(g.error(m.Step(1, 2, -1, 0, m.Blob(x.tobytes(), -1, 64), fed)), E.INVALID,
               "graph 1 has no outputs to feed from")
        out = g.ok(m.Step(1, 2, -1, 0, m.Blob(both, -1, len(both))))
        assert np.frombuffer(out.data.inline[:8], np.int32).tolist() == [3, 1]
        for feed, message in [
            ((m.Feed(2, 0),), "feed names input 2, but graph 1 has 2 inputs"),
            ((m.Feed(-1, 0),), "feed names input -1"),
            ((m.Feed(0, 3),), "feed of input 'ids' names output 3, but graph 1 has 3 outputs"),
            ((m.Feed(0, -(2**63)),), "names output -9223372036854775808"),
            ((m.Feed(0, 0), m.Feed(0, 0)), "input 'ids' is fed twice"),
            ((m.Feed(0, 1),), "input 'ids' (I32) cannot be fed from output 1 (F32)"),
            ((m.Feed(0, 2),), "output 2 of graph 1 is not a token pick"),  # an I32, but no pick
        ]:
            expect(g.error(m.Step(1, 2, -1, 0, m.Blob(x.tobytes(), -1, 64), feed)), E.INVALID, message)
        # the fed input's bytes sent as well: the payload is not the layout's
        expect(g.error(m.Step(1, 2, -1, 0, m.Blob(both, -1, len(both)), fed)), E.PROTOCOL,
               "step inputs of 80 bytes; the graph's layout takes 64")
        g.ok(m.Step(1, 2, -1, 0, m.Blob(both, -1, len(both))))
        out = g.ok(m.Step(1, 2, -1, 0, m.Blob(x.tobytes(), -1, 64), fed))  # the last compute's picks
        assert np.frombuffer(out.data.inline[-8:], np.int32).tolist() == [3, 1]  # ids, as fed


def test_unknown_ops_and_dtypes_in_queries(host):
    with guest(host) as g:
        expect(g.error(m.Supports(9999, ())), E.INVALID, "unknown op 9999")
        expect(g.error(m.Supports(int(Op.ADD), (77,))), E.INVALID, "unknown dtype 77")
        assert g.ok(m.Supports(int(Op.MATMUL), (int(DType.Q4_K),))).value is True


# ================================================================ lifecycle


def test_requests_after_goodbye_find_the_session_gone(host):
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 64, 0))
        g.post(m.Goodbye())
        try:
            g.send(m.GetTensor(1, 0, 8, -1))
            g.recv()
            raise AssertionError("a reply after Goodbye")
        except (Closed, BrokenPipeError, ConnectionResetError):
            pass
    assert host.wait_idle().sessions == ()


def test_disconnect_mid_transfer_releases_the_session(host):
    for cut in (3, 16, 16 + 4096):
        g = guest(host)
        g.ok(m.AllocBuffer(1, 8 << 20, 0))
        data = m.encode(m.SetTensor(1, 0, m.Blob(bytes(8 << 20), -1, 8 << 20)), 9, 0)
        g.send_raw(data[:cut])
        g.close()
        assert host.wait_idle().sessions == ()


def test_deferred_errors_come_back_at_the_next_wait(host):
    with guest(host) as g:
        g.post(m.AllocBuffer(1, 64, 0))
        g.post(m.FreeBuffer(99))  # fails, nobody waits
        g.post(m.FreeBuffer(98))  # fails too: only the first is kept
        expect(g.error(m.Synchronize()), E.INVALID, "an earlier FreeBuffer failed: unknown buffer handle 99")
        assert isinstance(g.ok(m.Synchronize()), m.Ok)  # reported once


# ================================================================ resource exhaustion


def test_allocation_past_the_memory_quota(host):
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 48 << 20, 0))
        expect(g.error(m.AllocBuffer(2, 32 << 20, 0)), E.QUOTA,
               "allocating 33554432 bytes would exceed this session's memory limit", f"of {MAX_MEMORY} bytes")
        g.ok(m.FreeBuffer(1))
        g.ok(m.AllocBuffer(2, 32 << 20, 0))  # freed memory is available again


def test_dequantized_copies_count_against_the_quota(host):
    """Many WEIGHT views of one small F16 buffer would each be widened to f32 on the host,
    for the compute that reads them (the default: no f32 copy is kept; with the dequant
    cache, an opt-in, test_quota's host, they are charged when made)."""
    with guest(host) as g:
        g.ok(m.AllocBuffer(1, 1 << 20, 0))  # 1 MiB
        nodes = [leaf(Op.WEIGHT, (1, 32 * i), (1000, 512), DType.F16) for i in range(40)]  # 40 x 2 MB
        g.ok(m.RegisterGraph(2, graph(*nodes, outputs=range(40))))
        expect(g.error(step(2, n_tokens=0)), E.QUOTA, "computing graph 2", "would exceed this session's memory limit")
        g.ok(m.RegisterGraph(3, graph(*nodes[:4], outputs=range(4))))  # a few are fine


def test_compute_intermediates_count_against_the_quota(host):
    """A broadcast of two 16 KiB inputs would make a 64 MiB result."""
    with guest(host) as g:
        a, b = x_input((T, 1), name="a"), x_input((1, 4096), name="b")
        g.ok(m.RegisterGraph(1, graph(a, b, Node(Op.ADD, (0, 1), (), (T, 4096), DType.F32))))
        b = np.ones((1, 4096), np.float32)
        expect(g.error(step(1, np.ones((4096, 1), np.float32), b)), E.QUOTA, "computing graph 1 with T=4096",
               "would exceed this session's memory limit")
        assert g.ok(step(1, np.ones((4, 1), np.float32), b)).data.size == 4 * 4096 * 4


def test_millions_of_tiny_allocations_hit_the_handle_cap(host):
    n = int(os.environ.get("APIR_TINY_ALLOCS", "100000"))
    with guest(host) as g:
        t0 = time.monotonic()
        for h in range(1, n + 1):
            g.post(m.AllocBuffer(h, 1, 2))
        expect(g.error(m.Synchronize()), E.QUOTA, f"an earlier AllocBuffer failed: too many live handles ({MAX_HANDLES})")
        elapsed = time.monotonic() - t0
        st = [s for s in host.status().sessions if s.session == g.welcome.session][0]
        assert st.allocated == MAX_HANDLES  # 300 one-byte buffers, nothing more
        print(f"\n{n} tiny allocations in {elapsed:.1f}s ({elapsed / n * 1e6:.0f} us each); {MAX_HANDLES} live")


def test_stalled_frames_end_the_session(host):
    with guest(host) as g:
        t0 = time.monotonic()
        g.send_raw(m.encode(m.AllocBuffer(1, 64, 0), 1, 1)[:10])  # a header, cut short
        expect(g.recv(), E.PROTOCOL, f"frame not completed within {IO_TIMEOUT:g}s")
        assert time.monotonic() - t0 >= IO_TIMEOUT  # not before --io-timeout
        assert g.closed_by_host()


def test_a_slow_handshake_blocks_nobody(host):
    slow = guest(host, hello=False)
    slow.send_raw(m.encode(m.Hello(m.PROTOCOL_VERSION, m.op_table_hash(), "", "slow", 0))[:20])
    with guest(host) as quick:  # served while the slow one dawdles
        assert isinstance(quick.ok(m.GetDevices()), m.Devices)
    slow.sock.setblocking(False)
    with pytest.raises(BlockingIOError):  # still pending: this --handshake-timeout is far off
        slow.sock.recv(1)
    slow.close()  # test_handshake.py sees one dropped at a short --handshake-timeout


def test_a_guest_that_never_reads_its_replies(host):
    g = guest(host)
    sid = g.welcome.session
    g.sock.settimeout(0.2)
    request = m.encode(m.GetDevices(), 1, m.WANT_REPLY)
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            g.sock.sendall(request * 64)
        except TimeoutError:
            continue  # both socket buffers are full: the worker is stuck sending to us
        except (BrokenPipeError, ConnectionResetError):
            break  # the host gave up on us
        if not any(s.session == sid for s in host.status().sessions):
            break
    else:
        raise AssertionError("the worker never gave up on a guest that does not read")
    g.close()


def test_session_count_is_capped(host):
    guests = [guest(host) for _ in range(MAX_SESSIONS)]
    try:
        with pytest.raises(AssertionError, match=f"already serving {MAX_SESSIONS} sessions"):
            guest(host)
        guests.pop().close()
        host.until(lambda st: len(st.sessions) < MAX_SESSIONS, "the closed session released")
        guests.append(guest(host))
    finally:
        for g in guests:
            g.close()


def test_a_flood_of_idle_connections(host):
    """Connections past MAX_PENDING pending handshakes are closed at accept; the pending
    ones wait for their Hello (this daemon's --handshake-timeout is far off)."""
    path = host.unix.removeprefix("unix://")
    flood = []
    try:
        for _ in range(MAX_PENDING + 100):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            flood.append(s)
        for s in flood[MAX_PENDING:]:  # accepted in order: the last 100 are past the cap
            s.settimeout(WAIT)
            assert s.recv(1) == b""
        assert host.proc.poll() is None
        for s in flood[:MAX_PENDING]:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):  # still pending, still open
                s.recv(1)
    finally:
        for s in flood:
            s.close()
    # the daemon frees a hung-up connection's pending slot once it reads the hang-up: until
    # then a new connection (the next check's) may still find the pool full and be closed
    deadline = time.monotonic() + WAIT
    while True:
        try:
            host.status()
            break
        except ApirError:
            assert time.monotonic() < deadline, "the flood's pending slots were never released"
            time.sleep(0.05)


def test_descriptors_sent_by_a_guest_are_closed(host):
    with guest(host) as g:
        pid = next(s.pid for s in host.status().sessions if s.session == g.welcome.session)
        before = len(os.listdir(f"/proc/{pid}/fd"))
        null = os.open(os.devnull, os.O_RDONLY)
        for i in range(200):
            g.send_raw(m.encode(m.GetDevices(), i, 0), fds=(null, null, null, null))
        g.ok(m.Synchronize())
        os.close(null)
        assert len(os.listdir(f"/proc/{pid}/fd")) <= before


# ================================================================ shared-memory rings
# A Unix session with an arena moves its frames into rings in the shared region; the
# guest can write the ring counters (and everything else there) at any moment.


def ring_guest(host) -> RawGuest:
    g = guest(host, arena_size=1 << 20)
    assert g.ring is not None, "the host did not switch this session to shared rings"
    return g


def session_gone(host, sid: int) -> None:
    host.until(lambda st: all(s.session != sid for s in st.sessions), f"session {sid} released")


def test_ring_head_out_of_range(host):
    for bad in ("huge", "past the ring", "backwards"):
        with ring_guest(host) as g:
            g.ok(m.GetDevices())
            tail = g.region.load(iv._REQ_TAIL)  # what the host has read so far
            head = {"huge": 2**64 - 1, "past the ring": tail + g.region.ring_size + 1, "backwards": tail - 1}[bad]
            g.region.store(iv._REQ_HEAD, head)  # claims bytes the ring cannot hold
            g.ring.doorbell.ring()
            expect(g.recv(), E.PROTOCOL, "shared-memory ring", "out of range")
            assert g.closed_by_host()
            session_gone(host, g.welcome.session)


def test_ring_tail_out_of_range(host):
    with ring_guest(host) as g:
        g.region.store(iv._REP_TAIL, 2**63)  # the host cannot trust how much room it has
        g.send(m.GetDevices())
        assert g.closed_by_host()  # nothing can be sent back safely: the session ends
        session_gone(host, g.welcome.session)


def test_ring_stalled_frame(host):
    with ring_guest(host) as g:
        t0 = time.monotonic()
        g.send_raw(m.encode(m.AllocBuffer(1, 64, 0), 1, 1)[:10])
        expect(g.recv(), E.PROTOCOL, f"frame not completed within {IO_TIMEOUT:g}s")  # --io-timeout
        assert time.monotonic() - t0 >= IO_TIMEOUT


def test_ring_frames_obey_max_message(host):
    with ring_guest(host) as g:
        g.send_raw(frame(20, length=17 << 20))
        expect(g.recv(), E.PROTOCOL, f"exceeds the limit of {16 << 20}")  # --max-message


def test_ring_guest_that_never_reads(host):
    with ring_guest(host) as g:
        sid = g.welcome.session
        request = m.encode(m.GetDevices(), 1, m.WANT_REPLY)
        for _ in range(20000):  # ~2 MB of replies for a 1 MiB reply ring
            g.send_raw(request)
        session_gone(host, sid)


def test_ring_bytes_on_the_socket_mean_goodbye(host):
    with ring_guest(host) as g:
        g.sock.sendall(m.encode(m.GetDevices(), 1, 1))  # frames no longer belong on the socket
        session_gone(host, g.welcome.session)


def test_ring_header_scribbles_change_nothing(host):
    with ring_guest(host) as g:
        for off in (0, 8, iv._SIZE, iv._RING, iv._ARENA_OFF, iv._ARENA_SIZE):
            g.region.store(off, 2**64 - 1)  # the host read its layout once, at creation
        g.ok(m.AllocBuffer(1, 4096, 0))
        g.ok(m.SetTensor(1, 0, m.Blob(b"", 0, 4096)))
        assert isinstance(g.ok(m.GetDevices()), m.Devices)


# ================================================================ information leaks


def test_fresh_buffers_and_arenas_are_zeroed(host):
    with guest(host, arena_size=1 << 20) as g:
        assert g.arena[:] == bytes(1 << 20)
        g.ok(m.AllocBuffer(1, 1 << 20, 0))
        g.ok(m.ClearBuffer(1, 0xAB))
        g.ok(m.FreeBuffer(1))
        g.ok(m.AllocBuffer(1, 1 << 20, 0))  # same handle, same size: must not see 0xAB
        data = g.ok(m.GetTensor(1, 0, 1 << 20, 0)).data
        assert data.arena_offset == 0 and g.arena[: 1 << 20] == bytes(1 << 20)
    with guest(host) as g:  # nor may a later session see this one's bytes
        g.ok(m.AllocBuffer(1, 1 << 20, 0))
        assert g.ok(m.GetTensor(1, 0, 4096, -1)).data.inline == bytes(4096)


def test_replies_carry_no_paths_or_addresses(host):
    with guest(host) as g:
        assert not LEAK.search(repr(g.welcome))
        assert not LEAK.search(repr(g.ok(m.GetDevices())))


def test_scrub():
    torch_like = ("CUDA error at /opt/pytorch/aten/src/ATen/native/Foo.cpp:123\n"
                  "frame #0: c10::Error::Error() + 0x96 (0x7f3a2b1c4d5e in /usr/lib/libc10.so)")
    out = scrub(torch_like)
    assert out == "CUDA error at <path>:123"
    assert scrub("bytes [0, 16) lie outside buffer 1 of 8 bytes") == "bytes [0, 16) lie outside buffer 1 of 8 bytes"
    assert scrub("pointer 0x7ffd1234abcd") == "pointer 0x…"
    assert scrub("blk.0/attn_q and 1/temperature") == "blk.0/attn_q and 1/temperature"
    assert len(scrub("x" * 10000)) < 2100
