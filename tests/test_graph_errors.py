"""Bad graphs, bad handles and bad inputs give one clear exception naming the culprit.

Every case checks the exception type *and* a meaningful part of its message, and that it
was raised cleanly (no chained numpy/torch exception behind it).
"""

from __future__ import annotations

import numpy as np
import pytest

from apir.backends import BackendError, Limits, QuotaError, create_backend
from apir.errors import ApirError
from apir.graph import DType, Graph, GraphBuilder, GraphError, Node, Op, T

BACKENDS = [
    "numpy",
    pytest.param("local", marks=pytest.mark.skipif(
        __import__("importlib").util.find_spec("torch") is None, reason="torch not installed")),
]


def make(name: str):
    return create_backend("numpy") if name == "numpy" else create_backend("local", device="cpu")


def assert_clean(excinfo: pytest.ExceptionInfo) -> None:
    """The error stands alone: nothing from numpy or torch chained behind it."""
    e = excinfo.value
    assert e.__cause__ is None
    assert e.__context__ is None or e.__suppress_context__, repr(e.__context__)


def raises(exc: type[Exception], *parts: str):
    """pytest.raises that also checks each of ``parts`` is in the message."""

    class _Check:
        def __enter__(self):
            self.cm = pytest.raises(exc)
            self.info = self.cm.__enter__()
            return self.info

        def __exit__(self, *args):
            handled = self.cm.__exit__(*args)
            msg = str(self.info.value)
            for part in parts:
                assert part in msg, f"{part!r} not in message {msg!r}"
            assert_clean(self.info)
            return handled

    return _Check()


def test_error_types() -> None:
    assert issubclass(BackendError, ApirError)
    assert issubclass(GraphError, ValueError)


# ---------------------------------------------------------------- building graphs


def test_matmul_shape_mismatch() -> None:
    g = GraphBuilder()
    x, w = g.input("x", (T, 64)), g.input("w", (8, 32))
    with raises(GraphError, "MATMUL", "(T, 64)", "(8, 32)"):
        g.matmul(x, w)
    with raises(GraphError, "blk.0.attn_q", "MATMUL"):
        g.matmul(x, w, label="blk.0.attn_q")


def test_other_shape_rule_failures() -> None:
    g = GraphBuilder()
    x = g.input("x", (T, 4, 6))
    pos = g.input("pos", (T,), DType.I32)
    with raises(GraphError, "ADD", "do not broadcast"):
        g.add(x, g.input("y", (3,)))
    with raises(GraphError, "ROPE", "n_dims=5"):
        g.rope(x, pos, 5, 10000.0, False)
    with raises(GraphError, "ATTENTION", "multiple"):
        g.attention(x, g.input("k", (9, 3, 6)), g.input("v", (9, 3, 6)), pos, 1.0)
    with raises(GraphError, "RESHAPE", "changes the size"):
        g.reshape(x, (T, 25))
    with raises(GraphError, "VIEW", "token axis"):
        g.view(x, 0, 1, 1)
    with raises(GraphError, "GET_ROWS", "I32"):
        g.get_rows(g.input("table", (10, 4)), g.input("fids", (T,)))
    with raises(GraphError, "SAMPLE", "params"):
        g.sample(g.input("logits", (T, 10)), g.input("p4", (4,)))


def test_quantized_input_to_elementwise_op() -> None:
    be = create_backend("numpy")
    h = be.alloc_buffer(DType.Q8_0.nbytes((4, 32)))
    g = GraphBuilder()
    w = g.weight(h, 0, (4, 32), DType.Q8_0)
    with raises(GraphError, "ADD", "quantized", "Q8_0"):
        g.add(g.input("x", (4, 32)), w)


def test_unknown_dtype() -> None:
    with raises(ValueError, "Q9_9", "known", "Q4_K", "F32", "BF16"):
        DType.parse("Q9_9")
    with raises(ValueError, "99", "known"):
        DType.parse(99)
    assert DType.parse("q8_0") is DType.Q8_0 and DType.parse(1) is DType.F16


def test_quantized_weight_row_not_whole_blocks() -> None:
    g = GraphBuilder()
    with raises(GraphError, "token_embd.weight", "Q8_0", "32-element blocks"):
        g.weight(1, 0, (10, 48), DType.Q8_0, label="token_embd.weight")
    with raises(GraphError, "Q4_K", "256-element blocks"):
        g.weight(1, 0, (4, 128), DType.Q4_K)


def test_bad_leaves() -> None:
    g = GraphBuilder()
    with raises(GraphError, "INPUT dtype"):
        g.input("x", (4, 32), DType.Q8_0)
    with raises(GraphError, "STATE", "quantized"):
        g.state(1, 0, (4, 32), DType.Q4_0)
    with raises(GraphError, "bad dimension"):
        g.weight(1, 0, (T, 32), DType.F32)
    with raises(GraphError, "at least one output"):
        g.build()


# ---------------------------------------------------------------- hand-made graphs

X = Node(Op.INPUT, (), ("x",), (4,), DType.F32, "x")


def test_validate_forward_reference() -> None:
    add = Node(Op.ADD, (0, 1), (), (4,), DType.F32)
    g = Graph((X, add), (1,))
    with raises(GraphError, "node 1", "ADD", "later node id"):
        g.validate()
    self_loop = Node(Op.SILU, (1,), (), (4,), DType.F32)
    with raises(GraphError, "node 1", "later node id"):
        Graph((X, self_loop), (1,)).validate()
    # a cycle attempt: two nodes reading each other
    a = Node(Op.ADD, (0, 2), (), (4,), DType.F32)
    b = Node(Op.ADD, (0, 1), (), (4,), DType.F32)
    with raises(GraphError, "node 1", "later node id"):
        Graph((X, a, b), (2,)).validate()


def test_validate_wrong_declared_shape() -> None:
    bad = Node(Op.ADD, (0, 0), (), (5,), DType.F32, "sum")
    with raises(GraphError, "node 1", "ADD", "'sum'", "claims a result", "(5) F32", "(4) F32"):
        Graph((X, bad), (1,)).validate()
    bad_dtype = Node(Op.ARGMAX, (0,), (), (), DType.F32)
    with raises(GraphError, "ARGMAX", "claims a result", "I32"):
        Graph((X, bad_dtype), (1,)).validate()


def test_validate_unknown_op() -> None:
    bad = Node(99, (0,), (), (4,), DType.F32)  # type: ignore[arg-type]
    with raises(GraphError, "node 1", "unknown op", "99"):
        Graph((X, bad), (1,)).validate()


def test_validate_other_structure() -> None:
    with raises(GraphError, "1.."):
        Graph((), ()).validate()
    with raises(GraphError, "outputs"):
        Graph((X,), (3,)).validate()
    with raises(GraphError, "'x'", "twice"):
        Graph((X, X), (1,)).validate()
    with raises(GraphError, "MATMUL", "takes 2 inputs"):
        Graph((X, Node(Op.MATMUL, (0,), (), (4,), DType.F32)), (1,)).validate()
    with raises(GraphError, "SCALE", "attribute scale"):
        Graph((X, Node(Op.SCALE, (0,), ("big",), (4,), DType.F32)), (1,)).validate()


@pytest.mark.parametrize("name", BACKENDS)
def test_writes_through_a_contiguous_weight_are_refused(name: str) -> None:
    """CONTIGUOUS of a (contiguous) WEIGHT is the weight itself in both executors, so a
    SET_ROWS into it would rewrite the cached weight: refused like a direct write."""
    be = make(name)
    g = GraphBuilder()
    w = g.weight(be.alloc_buffer(4 * 6 * 4), 0, (4, 6), DType.F32, label="token_embd")
    rows = g.set_rows(g.contiguous(w), g.input("src", (1, 6)), g.input("ids", (1,), DType.I32))
    with raises(GraphError, "SET_ROWS", "'token_embd'", "may only write a STATE"):
        be.register_graph(g.build(rows))


@pytest.mark.parametrize("name", BACKENDS)
def test_copying_layout_ops_are_charged_as_intermediates(name: str) -> None:
    """TRANSPOSE is a view (free); CONTIGUOUS or RESHAPE of it copies, and counts."""
    from apir.backends.accounting import Scratch

    g = GraphBuilder()
    x = g.input("x", (T, 64))
    t = g.transpose(x, 0, 1)
    assert Scratch.of(g.build(t)).peaks == ({1: 4 * 64},)  # the input alone
    dense, flat = g.contiguous(t), g.reshape(t, (T, 64))
    assert Scratch.of(g.build(dense, flat)).peaks == ({1: 3 * 4 * 64},)
    if name == "numpy":
        from apir.backends.numpy_ref import NumpyBackend as be_class
    else:
        from apir.backends.local import LocalBackend as be_class
    be = be_class(limits=Limits(max_memory=64 << 10))
    gid = be.register_graph(g.build(dense))  # all four nodes: 3 * 256 bytes per token, the
    # output's host copy 256 and its reply 2 * 256
    with raises(QuotaError, f"computing graph {gid} with T=100", "153600 bytes of intermediates and outputs"):
        be.compute(gid, {"x": np.zeros((100, 64), np.float32)})
    assert be.compute(gid, {"x": np.ones((4, 64), np.float32)})[0].shape == (64, 4)


@pytest.mark.parametrize("name", BACKENDS)
def test_register_rejects_invalid_graph(name: str) -> None:
    be = make(name)
    with raises(GraphError, "ADD", "later node id"):
        be.register_graph(Graph((X, Node(Op.ADD, (0, 2), (), (4,), DType.F32)), (1,)))


# ---------------------------------------------------------------- buffers and graphs


@pytest.mark.parametrize("name", BACKENDS)
def test_truncated_weight_buffer(name: str) -> None:
    be = make(name)
    shape = (8, 64)
    need = DType.Q4_0.nbytes(shape)  # 8 rows * 2 blocks * 18 bytes = 288
    h = be.alloc_buffer(need - 18)  # one block short
    g = GraphBuilder()
    w = g.weight(h, 0, shape, DType.Q4_0, label="blk.0.ffn_up.weight")
    graph = g.build(g.matmul(g.input("x", (T, 64)), w))
    with raises(BackendError, f"buffer {h}", f"[0, {need})", f"{need - 18} bytes"):
        be.register_graph(graph)
    # at an offset: still names the byte range
    h2 = be.alloc_buffer(need + 32)
    g = GraphBuilder()
    w = g.weight(h2, 64, shape, DType.Q4_0)
    with raises(BackendError, f"buffer {h2}", f"[64, {64 + need})"):
        be.register_graph(g.build(g.matmul(g.input("x", (T, 64)), w)))


@pytest.mark.parametrize("name", BACKENDS)
def test_weight_leaf_bad_buffer_or_alignment(name: str) -> None:
    be = make(name)
    g = GraphBuilder()
    w = g.weight(777, 0, (4, 4), DType.F32, label="output.weight")
    with raises(BackendError, "unknown buffer 777", "output.weight"):
        be.register_graph(g.build(g.matmul(g.input("x", (T, 4)), w)))
    h = be.alloc_buffer(256)
    g = GraphBuilder()
    w = g.weight(h, 4, (4, 4), DType.F32)
    with raises(BackendError, "offset 4", "aligned"):
        be.register_graph(g.build(g.matmul(g.input("x", (T, 4)), w)))


@pytest.mark.parametrize("name", BACKENDS)
def test_unknown_buffer_handle(name: str) -> None:
    be = make(name)
    with raises(BackendError, "unknown buffer handle 4242"):
        be.set_tensor(4242, 0, b"abcd")
    with raises(BackendError, "unknown buffer handle 4242"):
        be.get_tensor(4242, 0, 4)
    with raises(BackendError, "unknown buffer handle 4242"):
        be.clear_buffer(4242)
    with raises(BackendError, "unknown buffer handle 'x'"):
        be.buffer_size("x")  # type: ignore[arg-type]
    h = be.alloc_buffer(16)
    with raises(BackendError, "unknown buffer handle 4242"):
        be.copy_tensor(h, 0, 4242, 0, 4)


@pytest.mark.parametrize("name", BACKENDS)
def test_unknown_graph_id(name: str) -> None:
    be = make(name)
    with raises(BackendError, "unknown graph id 999"):
        be.compute(999, {})
    with raises(BackendError, "unknown graph id 999"):
        be.free_graph(999)
    g = GraphBuilder()
    gid = be.register_graph(g.build(g.silu(g.input("x", (4,)))))
    be.free_graph(gid)
    with raises(BackendError, f"unknown graph id {gid}"):
        be.compute(gid, {"x": np.zeros(4, np.float32)})


@pytest.mark.parametrize("name", BACKENDS)
def test_bad_alloc_and_clear(name: str) -> None:
    be = make(name)
    for size in (0, -5, 2.5):
        with raises(BackendError, "buffer size", repr(size)):
            be.alloc_buffer(size)  # type: ignore[arg-type]
    h = be.alloc_buffer(8)
    with raises(BackendError, "clear value", "256"):
        be.clear_buffer(h, 256)


# ---------------------------------------------------------------- compute inputs


def _two_input_graph(be):
    g = GraphBuilder()
    x = g.input("x", (T, 4))
    ids = g.input("ids", (T,), DType.I32)
    return be.register_graph(g.build(g.add(x, g.reshape(g.scale(x, 2.0), (T, 4))), ids))


@pytest.mark.parametrize("name", BACKENDS)
def test_compute_bad_inputs(name: str) -> None:
    be = make(name)
    gid = _two_input_graph(be)
    x, ids = np.zeros((3, 4), np.float32), np.zeros(3, np.int32)
    be.compute(gid, {"x": x, "ids": ids})  # the good call works
    with raises(BackendError, "missing ['ids']"):
        be.compute(gid, {"x": x})
    with raises(BackendError, "unexpected ['y']"):
        be.compute(gid, {"x": x, "ids": ids, "y": x})
    with raises(BackendError, "input 'x'", "F32", "float64"):
        be.compute(gid, {"x": x.astype(np.float64), "ids": ids})
    with raises(BackendError, "input 'ids'", "I32", "int64"):
        be.compute(gid, {"x": x, "ids": ids.astype(np.int64)})
    with raises(BackendError, "input 'x'", "(T, 4)", "(3, 5)"):
        be.compute(gid, {"x": np.zeros((3, 5), np.float32), "ids": ids})
    with raises(BackendError, "input 'x'", "(T, 4)", "(12,)"):
        be.compute(gid, {"x": np.zeros(12, np.float32), "ids": ids})
    with raises(BackendError, "token dim", "T=3"):
        be.compute(gid, {"x": x, "ids": np.zeros(2, np.int32)})


# ---------------------------------------------------------------- execution-time checks


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("bad", [10, -1], ids=["past-end", "negative"])
def test_get_rows_out_of_range(name: str, bad: int) -> None:
    be = make(name)
    h = be.alloc_buffer(10 * 8 * 4)
    g = GraphBuilder()
    w = g.weight(h, 0, (10, 8), DType.F32, label="token_embd.weight")
    gid = be.register_graph(g.build(g.get_rows(w, g.input("ids", (T,), DType.I32))))
    with raises(BackendError, "GET_ROWS", "out of range", "[0, 10)"):
        be.compute(gid, {"ids": np.array([1, bad, 2], np.int32)})


@pytest.mark.parametrize("name", BACKENDS)
def test_set_rows_out_of_range(name: str) -> None:
    be = make(name)
    h = be.alloc_buffer(4 * 3 * 4)
    g = GraphBuilder()
    st = g.state(h, 0, (4, 3), DType.F32, label="cache")
    out = g.set_rows(st, g.input("src", (T, 3)), g.input("ids", (T,), DType.I32))
    gid = be.register_graph(g.build(out))
    with raises(BackendError, "SET_ROWS", "out of range", "[0, 4)"):
        be.compute(gid, {"src": np.ones((1, 3), np.float32), "ids": np.array([4], np.int32)})
    assert be.get_tensor(h, 0, 48) == bytes(48)  # nothing was written


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("bad", [8, 100, -1], ids=["at-end", "far", "negative"])
def test_attention_position_beyond_cache(name: str, bad: int) -> None:
    be = make(name)
    g = GraphBuilder()
    out = g.attention(
        g.input("q", (T, 2, 4)), g.input("k", (8, 1, 4)), g.input("v", (8, 1, 4)),
        g.input("pos", (T,), DType.I32), 0.5,
    )
    gid = be.register_graph(g.build(out))
    kv = np.zeros((8, 1, 4), np.float32)
    with raises(BackendError, "ATTENTION", "out of range", "[0, 8)"):
        be.compute(gid, {"q": np.zeros((2, 2, 4), np.float32), "k": kv, "v": kv,
                         "pos": np.array([3, bad], np.int32)})


@pytest.mark.parametrize("name", BACKENDS)
def test_view_beyond_token_count(name: str) -> None:
    be = make(name)
    g = GraphBuilder()
    gid = be.register_graph(g.build(g.view(g.input("x", (T, 4)), 0, -3, 2)))
    be.compute(gid, {"x": np.zeros((3, 4), np.float32)})
    with raises(BackendError, "VIEW"):
        be.compute(gid, {"x": np.zeros((2, 4), np.float32)})


# ---------------------------------------------------------------- tensor bytes


@pytest.mark.parametrize("name", BACKENDS)
def test_tensor_bytes_out_of_range(name: str) -> None:
    be = make(name)
    h = be.alloc_buffer(64)
    with raises(BackendError, f"buffer {h}", "[60, 68)", "64 bytes"):
        be.set_tensor(h, 60, np.zeros(8, np.uint8))
    with raises(BackendError, f"buffer {h}", "[0, 65)"):
        be.get_tensor(h, 0, 65)
    with raises(BackendError, "[-4, 0)"):
        be.set_tensor(h, -4, b"abcd")
    with raises(BackendError, "[-1, 3)"):
        be.get_tensor(h, -1, 4)
    with raises(BackendError, "[0, -1)"):
        be.get_tensor(h, 0, -1)
    with raises(BackendError, "integers"):
        be.get_tensor(h, 1.0, 4)  # type: ignore[arg-type]
    with raises(BackendError, f"buffer {h}", "[60, 68)"):
        be.copy_tensor(h, 60, h, 0, 8)
    be.set_tensor(h, 60, b"abcd")  # exactly up to the end is fine
    assert be.get_tensor(h, 60, 4) == b"abcd"


@pytest.mark.parametrize("name", BACKENDS)
def test_copy_tensor_copies_between_and_within_buffers(name: str) -> None:
    """On the backend's device (the local one copies there, not through host memory), both
    ranges checked; an overlapping copy inside one buffer reads the bytes as they were."""
    be = make(name)
    a, b = be.alloc_buffer(64), be.alloc_buffer(32)
    be.set_tensor(a, 0, bytes(range(64)))
    be.copy_tensor(a, 8, b, 4, 16)
    assert be.get_tensor(b, 0, 24) == bytes(4) + bytes(range(8, 24)) + bytes(4)
    be.copy_tensor(a, 0, a, 4, 16)  # overlapping, forwards
    assert be.get_tensor(a, 0, 24) == bytes(range(4)) + bytes(range(16)) + bytes(range(20, 24))
    with raises(BackendError, f"buffer {b}", "[24, 40)"):
        be.copy_tensor(a, 0, b, 24, 16)
    assert be.get_tensor(b, 24, 8) == bytes(8)  # a refused copy wrote nothing


@pytest.mark.parametrize("name", BACKENDS)
def test_use_after_free_and_double_free(name: str) -> None:
    be = make(name)
    h = be.alloc_buffer(64)
    g = GraphBuilder()
    w = g.weight(h, 0, (4, 4), DType.F32)
    gid = be.register_graph(g.build(g.matmul(g.input("x", (T, 4)), w)))
    be.free_buffer(h)
    with raises(BackendError, f"unknown buffer handle {h}"):
        be.set_tensor(h, 0, b"abcd")
    with raises(BackendError, f"unknown buffer handle {h}"):
        be.get_tensor(h, 0, 4)
    with raises(BackendError, f"buffer {h}", "freed"):
        be.compute(gid, {"x": np.zeros((1, 4), np.float32)})
    with raises(BackendError, f"unknown buffer handle {h}"):
        be.free_buffer(h)
    assert be.allocated_bytes() == 0


@pytest.mark.parametrize("name", BACKENDS)
def test_use_after_close(name: str) -> None:
    be = make(name)
    h = be.alloc_buffer(16)
    be.close()
    with raises(BackendError, "closed"):
        be.alloc_buffer(16)
    with raises(BackendError, "closed"):
        be.get_tensor(h, 0, 4)


def test_unknown_backend_and_device() -> None:
    with raises(BackendError, "unknown backend 'tpu'", "local", "numpy"):
        create_backend("tpu")
    with raises(BackendError, "numpy", "cpu only", "cuda"):
        create_backend("numpy", device="cuda")
