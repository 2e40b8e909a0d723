"""The wire protocol alone (no I/O): every message round-trips; malformed frames and
bodies are refused with a ProtocolError that says what is wrong."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from rawguest import body_of, frame

from apir.graph import DType, GraphBuilder, Op, T
from apir.protocol import ALIGN, ProtocolError, graph_codec
from apir.protocol import messages as m
from apir.protocol.step import MAX_TOKENS, LayoutError, StepLayout, pack
from apir.protocol.wire import MAX_ITEMS, MAX_RANK, MAX_STR, Reader, Writer


def _graph():
    g = GraphBuilder()
    x = g.input("x", (T, 8))
    w = g.weight(1, 0, (4, 8), DType.F16, "blk.0.w")
    y = g.rms_norm(g.matmul(x, w), 1e-5)
    y = g.rope(g.reshape(y, (T, 2, 2)), g.input("pos", (T,), DType.I32), 2, 10000.0, True, 0.5)
    y = g.permute(g.view(y, 0, -1, 1), (0, 2, 1))
    return g.build(g.argmax(g.reshape(y, (1, 4))), y)


DEV = m.Device("cpu", "cpu", "Some CPU", 1 << 30, 1 << 32, ("graph_cache", "async"))
BLOB = m.Blob(b"\x00\x01\xff" * 3, -1, 9)

# One instance of every message type; fields chosen to exercise each encoding
# (negative ints, non-ASCII text, empty and non-empty tuples, nested values, a graph).
SAMPLES: dict[type, object] = {
    m.Hello: m.Hello(m.PROTOCOL_VERSION, m.op_table_hash(), "s3cr3t-tökén", "apir test", 256 << 20, True),
    m.GetDevices: m.GetDevices(),
    m.Supports: m.Supports(int(Op.MATMUL), (int(DType.Q4_K), int(DType.F32))),
    m.AllocBuffer: m.AllocBuffer(7, 1 << 40, 1),
    m.FreeBuffer: m.FreeBuffer(7),
    m.ClearBuffer: m.ClearBuffer(7, 255),
    m.SetTensor: m.SetTensor(7, 64, BLOB),
    m.GetTensor: m.GetTensor(7, 64, 1 << 20, 4096),
    m.CopyTensor: m.CopyTensor(7, 0, 8, 32, 1024),
    m.RegisterGraph: m.RegisterGraph(9, _graph()),
    m.FreeGraph: m.FreeGraph(9),
    m.OpenPublished: m.OpenPublished(3, "smollm2-135m", b"\x01" * 32, 1 << 27),
    m.Step: m.Step(9, 1, 4096, 1 << 16, BLOB, (m.Feed(0, 0), m.Feed(-1, 2**62))),
    m.Synchronize: m.Synchronize(),
    m.Goodbye: m.Goodbye(),
    m.Welcome: m.Welcome(m.PROTOCOL_VERSION, 3, DEV, 0, 8 << 30),
    m.Ok: m.Ok(),
    m.Error: m.Error(m.ErrorCode.QUOTA, "too many live handles (–ünïcode)"),
    m.Devices: m.Devices((DEV, m.Device("cuda:0", "cuda", "", 0, 0, ()))),
    m.Flag: m.Flag(False),
    m.Data: m.Data(m.Blob(b"", 0, 1 << 20)),
    m.Notice: m.Notice("compiling decode graph (greedy step, first use in this session)"),
    m.Status: m.Status(1, DEV, (m.SessionInfo(1, 1234, "unix:local", 10, 20),), 16, 0, 1, 1, 5, 2,
                        ("smollm2-135m",), 1 << 27, 1),
}


def test_every_opcode_has_a_sample():
    assert set(SAMPLES) == set(m.OPCODES.values())
    assert len(set(m.OPCODES.values())) == len(m.OPCODES)  # one opcode per message type


@pytest.mark.parametrize("opcode", [42, 142])  # Compute and Outputs, retired in version 4
def test_retired_opcodes_are_unknown(opcode):
    assert m.PROTOCOL_VERSION >= 4
    with pytest.raises(ProtocolError, match=f"unknown opcode {opcode}"):
        m.decode_header(m.HEADER.pack(m.MAGIC, opcode, 0, 1, 0))


@pytest.mark.parametrize("cls", list(m.OPCODES.values()), ids=lambda c: c.__name__)
def test_round_trip(cls):
    msg = SAMPLES[cls]
    raw = m.encode(msg, 0xDEADBEEF, m.WANT_REPLY)
    header = m.decode_header(raw[: m.HEADER.size])
    assert (header.opcode, header.flags, header.request_id, header.length) == (
        m.OPCODE_OF[cls], m.WANT_REPLY, 0xDEADBEEF, len(raw) - m.HEADER.size)
    back = m.decode_body(header.opcode, raw[m.HEADER.size:])
    assert back == msg
    assert m.encode(back, 0xDEADBEEF, m.WANT_REPLY) == raw  # the encoding is canonical


def test_graph_round_trip_keeps_types():
    g = _graph()
    back = m.decode_body(m.OPCODE_OF[m.RegisterGraph], body_of(m.RegisterGraph(1, g))).graph
    assert back == g
    assert all(isinstance(n.op, Op) and isinstance(n.dtype, DType) for n in back.nodes)
    back.validate()


# ---------------------------------------------------------------- headers


@pytest.mark.parametrize("raw, message", [
    (b"APIR\x01\x00", "truncated frame header (6 of 16 bytes)"),
    (frame(1, magic=b"GGUF"), "bad magic b'GGUF'"),
    (frame(1, magic=b"\0\0\0\0"), "does not speak the apir protocol"),
    (frame(77), "unknown opcode 77"),
    (frame(0), "unknown opcode 0"),
    (frame(1, flags=0x8001), "unknown flags 0x8001"),
    (frame(1, length=m.MAX_BODY + 1), f"exceeds the limit of {m.MAX_BODY}"),
    (frame(1, length=0xFFFFFFFF), "frame body of 4294967295 bytes"),
])
def test_bad_headers(raw, message):
    with pytest.raises(ProtocolError) as e:
        m.decode_header(raw[:16] if len(raw) >= 16 else raw)
    assert message in str(e.value)


def test_header_limit_is_per_channel():
    m.decode_header(frame(1, length=4096), max_body=4096)
    with pytest.raises(ProtocolError, match="4097 bytes exceeds the limit of 4096"):
        m.decode_header(frame(1, length=4097), max_body=4096)


# ---------------------------------------------------------------- bodies


@pytest.mark.parametrize("cls", [c for c in m.OPCODES.values() if body_of(SAMPLES[c])],
                         ids=lambda c: c.__name__)
def test_every_truncation_is_refused(cls):
    body = body_of(SAMPLES[cls])
    for cut in range(len(body)):
        with pytest.raises(ProtocolError, match="truncated|exceeds the limit|not valid UTF-8|bad boolean"):
            m.decode_body(m.OPCODE_OF[cls], body[:cut])


@pytest.mark.parametrize("cls", list(m.OPCODES.values()), ids=lambda c: c.__name__)
def test_trailing_bytes_are_refused(cls):
    with pytest.raises(ProtocolError, match="3 unexpected bytes after the message"):
        m.decode_body(m.OPCODE_OF[cls], body_of(SAMPLES[cls]) + b"xyz")


def _hello_body(**fields) -> bytes:
    w = Writer()
    w.i64(fields.get("version", 1))
    w.parts.append(fields.get("op_table", struct.pack("<Q", 32) + bytes(32)))
    w.parts.append(fields.get("token", struct.pack("<I", 0)))
    w.parts.append(fields.get("client", struct.pack("<I", 4) + b"test"))
    w.i64(0)
    w.parts.append(fields.get("status", b"\x00"))
    return w.getvalue()


@pytest.mark.parametrize("fields, message", [
    ({"status": b"\x02"}, "bad boolean 2"),
    ({"client": struct.pack("<I", 2) + b"\xc3\x28"}, "string is not valid UTF-8"),
    ({"client": struct.pack("<I", MAX_STR + 1)}, f"list of {MAX_STR + 1} items exceeds the limit of {MAX_STR}"),
    ({"client": struct.pack("<I", 1000) + b"abc"}, "truncated message"),
    ({"op_table": struct.pack("<Q", 1 << 62)}, "bytes of data announced"),
    ({"op_table": struct.pack("<Q", 2**64 - 1)}, "bytes of data announced"),
])
def test_bad_fields(fields, message):
    with pytest.raises(ProtocolError) as e:
        m.decode_body(1, _hello_body(**fields))
    assert message in str(e.value)
    m.decode_body(1, _hello_body())  # the unmodified body is fine


def test_list_counts_are_capped_before_allocation():
    w = Writer()
    w.u32(MAX_ITEMS + 1)  # Devices with 2^20 + 1 devices announced, none present
    with pytest.raises(ProtocolError, match=f"exceeds the limit of {MAX_ITEMS}"):
        m.decode_body(m.OPCODE_OF[m.Devices], w.getvalue())
    w = Writer()
    w.u32(MAX_ITEMS)  # within the cap but absent: truncated, quickly
    with pytest.raises(ProtocolError, match="truncated"):
        m.decode_body(m.OPCODE_OF[m.Devices], w.getvalue())


def _graph_body(nodes: list[bytes], outputs=(0,), n_nodes: int | None = None) -> bytes:
    w = Writer()
    w.i64(1)  # graph id
    w.u32(len(nodes) if n_nodes is None else n_nodes)
    w.parts.extend(nodes)
    w.u32(len(outputs))
    for o in outputs:
        w.u32(o)
    return w.getvalue()


def _node(op: int = int(Op.INPUT), inputs=(), attrs: bytes | None = None, shape=(4,),
          dtype: int = int(DType.F32), rank: int | None = None, n_inputs: int | None = None) -> bytes:
    w = Writer()
    w.u16(op)
    w.u32(len(inputs) if n_inputs is None else n_inputs)
    for i in inputs:
        w.u32(i)
    if attrs is None:
        w.str("x")
    else:
        w.parts.append(attrs)
    w.u32(len(shape) if rank is None else rank)
    for d in shape:
        w.i64(d)
    w.u16(dtype)
    w.str("")
    return w.getvalue()


@pytest.mark.parametrize("body, message", [
    (_graph_body([_node(op=999)]), "node 0: unknown op 999"),
    (_graph_body([_node(), _node(op=0)]), "node 1: unknown op 0"),
    (_graph_body([_node(dtype=5)]), "node 0: unknown dtype 5"),
    (_graph_body([_node(dtype=0xFFFF)]), "unknown dtype 65535"),
    (_graph_body([_node(n_inputs=graph_codec.MAX_INPUTS + 1)]), f"exceeds the limit of {graph_codec.MAX_INPUTS}"),
    (_graph_body([_node(rank=MAX_RANK + 1)]), f"exceeds the limit of {MAX_RANK}"),
    (_graph_body([], n_nodes=graph_codec.MAX_NODES + 1), f"exceeds the limit of {graph_codec.MAX_NODES}"),
    (_graph_body([_node()], outputs=range(graph_codec.MAX_NODES + 1)), "exceeds the limit"),
    (_graph_body([_node(attrs=struct.pack("<I", 3) + b"\xff\xfe\xfd")]), "not valid UTF-8"),
])
def test_bad_graphs_fail_to_decode(body, message):
    with pytest.raises(ProtocolError) as e:
        m.decode_body(m.OPCODE_OF[m.RegisterGraph], body)
    assert message in str(e.value)


def test_structurally_valid_but_meaningless_graphs_decode_for_the_validator():
    """The codec checks structure only: forward references and bad shapes reach
    ``Graph.validate`` (tested with the host in test_hostile, and in test_fuzz)."""
    body = _graph_body([_node(op=int(Op.SCALE), inputs=(0,), attrs=struct.pack("<d", 1.0))])
    msg = m.decode_body(m.OPCODE_OF[m.RegisterGraph], body)
    assert msg.graph.nodes[0].inputs == (0,)


def test_oversized_messages_are_refused_when_encoded():
    with pytest.raises(ProtocolError, match="exceeds the 67108864-byte frame limit"):
        m.encode(m.Data(m.Blob(bytes(m.MAX_BODY), -1, m.MAX_BODY)))


def test_op_table_hash_is_pinned_to_the_table():
    assert len(m.op_table_hash()) == 32
    assert m.op_table_hash() == m.op_table_hash()


# ---------------------------------------------------------------- the Step fast path


def test_step_wire_layout_is_pinned():
    """Runs of fixed-size fields are packed in one call; the bytes are those of the
    field-by-field encoding (and the layout PROTOCOL_VERSION 3 promises)."""
    msg = m.Step(9, 1, -1, 0, m.Blob(b"abc", -1, 3), (m.Feed(0, 1), m.Feed(2, 0)))
    want = (struct.pack("<qqqqQ", 9, 1, -1, 0, 3) + b"abc" + struct.pack("<qqI", -1, 3, 2)
            + struct.pack("<qqqq", 0, 1, 2, 0))
    assert body_of(msg) == want
    assert m.decode_body(m.OPCODE_OF[m.Step], want) == msg
    assert m.parse_step(want)[-1] == ((0, 1), (2, 0))  # the host's hot path: plain pairs


def test_step_feed_counts_are_checked():
    """A feed count past what the frame holds, or past the list cap, is refused before
    anything is read or allocated for it."""
    head = struct.pack("<qqqqQ", 9, 1, -1, 0, 0) + struct.pack("<qq", -1, 0)
    for count, message in [(1, "truncated message: 1 feeds announced, 8 bytes present"),
                           (MAX_ITEMS + 1, f"list of {MAX_ITEMS + 1} items exceeds the limit"),
                           (2**32 - 1, "exceeds the limit")]:
        with pytest.raises(ProtocolError, match=message):
            m.decode_body(m.OPCODE_OF[m.Step], head + struct.pack("<I", count) + bytes(8))
    with pytest.raises(ProtocolError, match="8 unexpected bytes after the message"):
        m.decode_body(m.OPCODE_OF[m.Step], head + struct.pack("<I", 1) + bytes(24))


@pytest.mark.parametrize("msg", [
    SAMPLES[m.Step], SAMPLES[m.Data], m.Step(-(2**63), 2**63 - 1, -1, 0, m.Blob(b"", -1, 0)),
    m.Step(1, 1, -1, 0, m.Blob(b"x" * 20, -1, 20), tuple(m.Feed(i, -i) for i in range(5))),
    m.Data(m.Blob(bytes(range(256)) * 17, -1, 4352)), m.Data(m.Blob(b"", 2**40, 64)),
], ids=lambda msg: type(msg).__name__)
def test_hand_coded_layouts_agree_with_the_generic_codec(msg):
    """Step and Data are coded by hand for the hot path: the same bytes both ways."""
    w = Writer()
    m._writer(type(msg))(w, msg)
    generic = w.getvalue()
    assert body_of(msg) == generic
    r = Reader(generic)
    assert m._reader(type(msg))(r) == msg == m.decode_body(m.OPCODE_OF[type(msg)], generic)
    r.end()


def _step_graph():
    g = GraphBuilder()
    tokens = g.input("tokens", (T,), DType.I32)
    h = g.input("h", (T, 3), DType.F16)  # 6 bytes a token: the next tensor needs padding
    params = g.input("params", (5,), DType.F32)
    x = g.matmul(g.get_rows(g.weight(1, 0, (16, 3), DType.F32), tokens), g.weight(1, 256, (4, 3), DType.F32))
    return g.build(g.argmax(x), h, params)


def _step_inputs(n: int) -> dict:
    return {"tokens": np.arange(n, dtype=np.int32), "h": np.ones((n, 3), np.float16),
            "params": np.linspace(0, 1, 5, dtype=np.float32)}


def _payload(packed) -> tuple[int, bytes]:
    """(T, the inline payload) of packed inputs, checked equal to what ``into`` writes over
    a destination of stale bytes (the arena's case)."""
    dest = bytearray(b"\xee" * packed.size)
    packed.into(memoryview(dest))
    assert bytes(dest) == packed.bytes()
    return packed.n_tokens, packed.bytes()


def test_step_layout_round_trips_inputs_and_outputs():
    layout = StepLayout.of(_step_graph())
    for n in (1, 2, 7):
        inputs = _step_inputs(n)
        n_tokens, payload = _payload(layout.pack_inputs(inputs))
        assert n_tokens == n
        place = layout.placement(False, n)
        assert all(offset % ALIGN == 0 for offset, _ in place.places) and len(payload) == place.size
        back = layout.unpack_inputs(bytearray(payload), n)
        assert list(back) == ["tokens", "h", "params"]
        for name, a in back.items():
            assert a.dtype == inputs[name].dtype and np.array_equal(a, inputs[name]) and a.flags.writeable
        outs = [np.arange(n, dtype=np.int32), inputs["h"], inputs["params"]]
        out_place = layout.output_placement(outs, n)
        got = layout.unpack_outputs(pack(outs, out_place), n)
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, outs))


def test_fed_inputs_take_no_room_in_the_payload():
    """The inputs a Step feeds are left out of its payload; the others keep their order,
    and T comes from the first one sent that has a token axis."""
    layout = StepLayout.of(_step_graph())
    inputs = _step_inputs(3)
    sent = {k: v for k, v in inputs.items() if k != "tokens"}
    n_tokens, payload = _payload(layout.pack_inputs(sent, (0,)))
    assert n_tokens == 3 and len(payload) == layout.placement(False, 3, (0,)).size
    assert payload == pack([inputs["h"], inputs["params"]], layout.placement(False, 3, (0,)))
    back = layout.unpack_inputs(bytearray(payload), 3, (0,))
    assert list(back) == ["h", "params"] and all(np.array_equal(back[k], sent[k]) for k in back)
    with pytest.raises(LayoutError, match=r"missing \[\], unexpected \['tokens'\] \(an input is either sent or fed"):
        layout.pack_inputs(inputs, (0,))  # a fed input sent as well
    with pytest.raises(LayoutError, match=r"missing \['tokens'\], unexpected \[\]"):
        layout.pack_inputs(sent, ())  # an unfed input missing
    # T shows only in fed inputs: that of the output feeding the first of them last time
    assert _payload(layout.pack_inputs({"params": inputs["params"]}, (0, 1), [(1, 1), (0, 0)])) == (3, inputs["params"].tobytes())
    with pytest.raises(ProtocolError, match="step inputs of 16 bytes; the graph's layout takes 52"):
        layout.unpack_inputs(bytearray(payload[:16]), 3, (0,))


@pytest.mark.parametrize("change, reason", [
    (lambda d: d.pop("h"), r"missing \['h'\], unexpected \[\]"),
    (lambda d: d.update(extra=np.zeros(1, np.int32)), r"missing \[\], unexpected \['extra'\]"),
    (lambda d: d.update(h=np.ones((2, 3), np.float32)), "input 'h' must be F16, got numpy float32"),
    (lambda d: d.update(h=np.ones((3, 3), np.float16)), "input 'h': token dim 3 disagrees with T=2"),
    (lambda d: d.update(h=np.ones((2, 4), np.float16)), r"input 'h' must have shape \(T, 3\), got \(2, 4\)"),
    (lambda d: d.update(params=np.zeros((1, 5), np.float32)), r"input 'params' must have shape \(5\), got \(1, 5\)"),
    (lambda d: d.update(params=[0, 0, 0, 0, 0]), "input 'params' must be F32, got numpy int64"),
    (lambda d: d.update(tokens=np.zeros(0, np.int32), h=np.ones((0, 3), np.float16)),
     "input 'tokens': token dim 0 disagrees with T=0"),
])
def test_inputs_off_the_registered_form_are_refused_with_the_reason(change, reason):
    """The executor's words for the same mistakes: the guest says them before sending."""
    inputs = _step_inputs(2)
    change(inputs)
    with pytest.raises(LayoutError, match=reason):
        StepLayout.of(_step_graph()).pack_inputs(inputs)


def test_inputs_that_only_are_not_arrays_yet_pack_as_arrays():
    """A numpy scalar, or a list of the right dtype, as the local executor takes them."""
    g = GraphBuilder()
    layout = StepLayout.of(g.build(g.scale(g.input("s", (), DType.F32), 2.0), g.input("ids", (2,), DType.I32)))
    want = _payload(layout.pack_inputs({"s": np.full((), 3, np.float32), "ids": np.array([1, 2], np.int32)}))
    assert _payload(layout.pack_inputs({"s": np.float32(3), "ids": np.array([1, 2], np.int32)})) == want
    with pytest.raises(LayoutError, match="input 's' must be F32, got numpy float64"):
        layout.pack_inputs({"s": 3.0, "ids": np.array([1, 2], np.int32)})


def test_a_feed_by_name_becomes_index_pairs_or_is_refused():
    layout = StepLayout.of(_step_graph())
    assert layout.feed_pairs({"h": 1, "tokens": 0}, 9) == ([(1, 1), (0, 0)], (0, 1))
    assert layout.feed_pairs({}, 9) == ([], ())
    with pytest.raises(LayoutError, match="feed names 'nope', which is not an input of graph 9"):
        layout.feed_pairs({"nope": 0}, 9)
    with pytest.raises(LayoutError, match="feed of 'h': graph 9 has no output 3"):
        layout.feed_pairs({"h": 3}, 9)


def test_step_payloads_are_checked_before_use():
    layout = StepLayout.of(_step_graph())
    _, payload = _payload(layout.pack_inputs(_step_inputs(2)))
    for bad in (payload[:-1], payload + b"\0", b""):
        with pytest.raises(ProtocolError, match="step inputs of .* bytes; the graph's layout takes"):
            layout.unpack_inputs(bytearray(bad), 2)
    for n in (0, -1, MAX_TOKENS + 1):
        with pytest.raises(ProtocolError, match=f"step with T={n}: T must be 1.."):
            layout.unpack_inputs(bytearray(payload), n)
    with pytest.raises(ProtocolError, match="step outputs of 3 bytes"):
        layout.unpack_outputs(b"abc", 2)
    g = GraphBuilder()
    fixed = StepLayout.of(g.build(g.argmax(g.input("x", (2, 4)))))  # no token axis
    with pytest.raises(ProtocolError, match=r"T must be 0 \(the graph has no token axis\)"):
        fixed.unpack_inputs(bytearray(32), 1)
    assert fixed.unpack_inputs(bytearray(32), 0)["x"].shape == (2, 4)


def test_executor_outputs_off_the_layout_are_refused_with_the_reason():
    """Only bytes travel: each output needs its slot's dtype and element count."""
    layout = StepLayout.of(_step_graph())
    good = [np.zeros(2, np.int32), np.ones((2, 3), np.float16), np.zeros(5, np.float32)]
    assert layout.output_placement(good, 2).size == layout.placement(True, 2).size
    assert layout.output_placement([np.zeros((1, 2), np.int32), *good[1:]], 2).size == layout.placement(True, 2).size
    for outs, reason in (
        (good[:2], "the executor returned 2 outputs, the graph has 3"),
        ([np.zeros(2, np.int64), *good[1:]], r"output out0: the executor returned int64 \(2,\), the graph's "
                                             r"layout takes int32 \(2,\)"),
        ([good[0], np.ones((3, 3), np.float16), good[2]], r"output out1: the executor returned float16 \(3, 3\)"),
    ):
        with pytest.raises(LayoutError, match=reason):
            layout.output_placement(outs, 2)



def test_large_copies_split_across_threads_give_the_same_bytes(monkeypatch) -> None:
    """copy_bytes in parts (as on a many-core machine), in this process and in a forked
    child (whose pool is its own: the parent's threads are not there), and a step payload
    packed through it equals the one packed in one copy."""
    import os

    from apir.protocol import memcpy
    from apir.protocol.step import pack_into

    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 1_000_003, dtype=np.uint8)
    g = GraphBuilder()
    layout = StepLayout.of(g.build(g.add(g.input("a", (T, 300)), g.input("b", (T, 300)))))
    a = rng.standard_normal((1001, 300), dtype=np.float32)
    b = rng.standard_normal((300, 1001), dtype=np.float32).T  # not contiguous: one copy
    packed = layout.pack_inputs({"a": a, "b": b})
    want = packed.bytes()
    monkeypatch.setattr(memcpy, "SPLIT_BYTES", 1 << 10)
    monkeypatch.setattr(memcpy, "THREADS", 3)
    dst = np.zeros_like(src)
    memcpy.copy_bytes(dst, src)
    assert np.array_equal(dst, src)
    arena = bytearray(packed.size + 64)
    pack_into(packed.arrays, packed.place, memoryview(arena))
    assert bytes(arena[: packed.size]) == want
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its split copy is right
        out = np.zeros_like(src)
        memcpy.copy_bytes(out, src)
        os._exit(0 if np.array_equal(out, src) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
