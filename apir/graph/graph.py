"""Graphs: a closed DAG of ops, built on the guest and registered once with a backend.

A ``Graph`` is plain data (frozen dataclasses of ints, floats and strings), so it can be
validated and sent over the wire as is. Nodes are stored in topological order: a node's
inputs are always earlier node ids, which rules out cycles by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .dtypes import COMPUTE_DTYPES, DType
from .ops import LEAVES, OPS, Alias, Attrs, GraphError, Op, fmt_shape, infer, leaf_spec_check


@dataclass(frozen=True)
class Node:
    op: Op
    inputs: tuple[int, ...]
    attrs: Attrs
    shape: tuple[int, ...]
    dtype: DType
    label: str = ""  # for error messages, e.g. "blk.3.attn_q"

    def describe(self, nid: int) -> str:
        name = f" '{self.label}'" if self.label else ""
        return f"node {nid} ({self.op.name}{name}, {fmt_shape(self.shape)} {self.dtype.name})"


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]

    def inputs(self) -> dict[str, Node]:
        return {n.attrs[0]: n for n in self.nodes if n.op is Op.INPUT}

    def validate(self, max_nodes: int = 1 << 20) -> None:
        """Re-check every node against the op table (what a host does on registration)."""
        if not self.nodes or len(self.nodes) > max_nodes:
            raise GraphError(f"a graph needs 1..{max_nodes} nodes, got {len(self.nodes)}")
        names: set[str] = set()
        # per node: the node whose memory its value may share (OpSpec.alias); one pass
        root: list[int] = []
        for nid, node in enumerate(self.nodes):
            if not isinstance(node.op, Op) or node.op not in OPS:
                raise GraphError(f"node {nid}: unknown op {node.op!r}")
            if any(not 0 <= i < nid for i in node.inputs):
                raise GraphError(f"node {nid} ({node.op.name}) uses an unknown or later node id")
            root.append(root[node.inputs[0]] if OPS[node.op].alias is not Alias.NONE and node.inputs else nid)
            if node.op is Op.SET_ROWS and node.inputs and self.nodes[root[nid]].op in (Op.WEIGHT, Op.INPUT):
                # writing a WEIGHT would change the executor's cached weights (or the
                # buffer itself, for F32/I32) behind its back; writing an INPUT would
                # change the caller's array. KV caches are STATEs.
                raise GraphError(
                    f"{node.describe(nid)} writes into {self.nodes[root[nid]].describe(root[nid])}: "
                    "SET_ROWS may only write a STATE (or a computed value)"
                )
            if node.op in LEAVES:
                leaf_spec_check(node.op, node.shape, node.dtype)
                if len(node.attrs) != len(OPS[node.op].attrs) or node.inputs:
                    raise GraphError(f"node {nid}: malformed {node.op.name} leaf")
                if node.op is Op.INPUT:
                    if node.attrs[0] in names:
                        raise GraphError(f"input name {node.attrs[0]!r} used twice")
                    names.add(node.attrs[0])
                continue
            ins = [(self.nodes[i].shape, self.nodes[i].dtype) for i in node.inputs]
            shape, dtype = infer(node.op, ins, node.attrs)
            if (tuple(shape), dtype) != (node.shape, node.dtype):
                raise GraphError(
                    f"{node.describe(nid)} claims a result its inputs do not give "
                    f"({fmt_shape(shape)} {dtype.name})"
                )
        if not self.outputs or any(not 0 <= o < len(self.nodes) for o in self.outputs):
            raise GraphError("graph outputs must name existing nodes")
        for o in self.outputs:
            if self.nodes[o].dtype not in COMPUTE_DTYPES:  # a quantized WEIGHT cannot be sent back
                raise GraphError(f"output {self.nodes[o].describe(o)} must be one of "
                                 f"{[d.name for d in COMPUTE_DTYPES]}")


@dataclass(frozen=True)
class Value:
    """A handle to a node while building; carries its shape and dtype."""

    id: int
    shape: tuple[int, ...]
    dtype: DType


class GraphBuilder:
    """Builds a Graph op by op; every call checks its shape rule immediately."""

    def __init__(self) -> None:
        self._nodes: list[Node] = []

    # -- leaves
    def input(self, name: str, shape: Sequence[int], dtype: DType = DType.F32) -> Value:
        return self._leaf(Op.INPUT, (name,), shape, dtype, name)

    def weight(
        self, buffer: int, offset: int, shape: Sequence[int], dtype: DType, label: str = ""
    ) -> Value:
        return self._leaf(Op.WEIGHT, (buffer, offset), shape, dtype, label)

    def state(
        self, buffer: int, offset: int, shape: Sequence[int], dtype: DType, label: str = ""
    ) -> Value:
        return self._leaf(Op.STATE, (buffer, offset), shape, dtype, label)

    def _leaf(self, op: Op, attrs: Attrs, shape: Sequence[int], dtype: DType, label: str) -> Value:
        shape = tuple(int(d) for d in shape)
        try:
            leaf_spec_check(op, shape, DType(dtype))
        except GraphError as e:
            raise GraphError(f"{label or op.name}: {e}") from None
        return self._push(Node(op, (), attrs, shape, DType(dtype), label))

    # -- ops
    def op(self, op: Op, *inputs: Value, attrs: Attrs = (), label: str = "") -> Value:
        try:
            shape, dtype = infer(op, [(v.shape, v.dtype) for v in inputs], attrs)
        except GraphError as e:
            raise GraphError(f"{label}: {e}" if label else str(e)) from None
        return self._push(Node(op, tuple(v.id for v in inputs), attrs, tuple(shape), dtype, label))

    def get_rows(self, table: Value, ids: Value) -> Value:
        return self.op(Op.GET_ROWS, table, ids)

    def set_rows(self, dst: Value, src: Value, ids: Value) -> Value:
        return self.op(Op.SET_ROWS, dst, src, ids)

    def matmul(self, x: Value, w: Value, label: str = "") -> Value:
        return self.op(Op.MATMUL, x, w, label=label)

    def add(self, a: Value, b: Value) -> Value:
        return self.op(Op.ADD, a, b)

    def mul(self, a: Value, b: Value) -> Value:
        return self.op(Op.MUL, a, b)

    def scale(self, x: Value, s: float) -> Value:
        return self.op(Op.SCALE, x, attrs=(float(s),))

    def silu(self, x: Value) -> Value:
        return self.op(Op.SILU, x)

    def gelu(self, x: Value) -> Value:
        return self.op(Op.GELU, x)

    def swiglu(self, gate: Value, up: Value) -> Value:
        return self.op(Op.SWIGLU, gate, up)

    def geglu(self, gate: Value, up: Value) -> Value:
        return self.op(Op.GEGLU, gate, up)

    def rms_norm(self, x: Value, eps: float) -> Value:
        return self.op(Op.RMS_NORM, x, attrs=(float(eps),))

    def softmax(self, x: Value) -> Value:
        return self.op(Op.SOFTMAX, x)

    def rope(
        self, x: Value, pos: Value, n_dims: int, base: float, neox: bool, freq_scale: float = 1.0
    ) -> Value:
        return self.op(Op.ROPE, x, pos, attrs=(int(n_dims), float(base), int(neox), float(freq_scale)))

    def attention(
        self, q: Value, k: Value, v: Value, pos: Value, scale: float,
        window: int = 0, softcap: float = 0.0, seq: Value | None = None,
    ) -> Value:
        """ATTENTION; with ``seq`` (each token's slot), ATTENTION_SEQ over a slotted cache."""
        attrs = (float(scale), int(window), float(softcap))
        if seq is not None:
            return self.op(Op.ATTENTION_SEQ, q, k, v, pos, seq, attrs=attrs)
        return self.op(Op.ATTENTION, q, k, v, pos, attrs=attrs)

    def reshape(self, x: Value, shape: Sequence[int]) -> Value:
        return self.op(Op.RESHAPE, x, attrs=(tuple(int(d) for d in shape),))

    def permute(self, x: Value, axes: Sequence[int]) -> Value:
        return self.op(Op.PERMUTE, x, attrs=(tuple(int(a) for a in axes),))

    def transpose(self, x: Value, a: int, b: int) -> Value:
        return self.op(Op.TRANSPOSE, x, attrs=(int(a), int(b)))

    def view(self, x: Value, axis: int, start: int, length: int) -> Value:
        return self.op(Op.VIEW, x, attrs=(int(axis), int(start), int(length)))

    def contiguous(self, x: Value) -> Value:
        return self.op(Op.CONTIGUOUS, x)

    def concat(self, a: Value, b: Value, axis: int) -> Value:
        return self.op(Op.CONCAT, a, b, attrs=(int(axis),))

    def argmax(self, x: Value) -> Value:
        return self.op(Op.ARGMAX, x)

    def sample(self, logits: Value, params: Value) -> Value:
        return self.op(Op.SAMPLE, logits, params)

    def _push(self, node: Node) -> Value:
        self._nodes.append(node)
        return Value(len(self._nodes) - 1, node.shape, node.dtype)

    def build(self, *outputs: Value) -> Graph:
        if not outputs:
            raise GraphError("a graph needs at least one output")
        return Graph(tuple(self._nodes), tuple(v.id for v in outputs))


def last_reads(graph: Graph) -> tuple[int, ...]:
    """Per node: the id of the last node that reads it (its own id if none does; one past
    the last node for an output, whose value the compute returns)."""
    last = list(range(len(graph.nodes)))
    for nid, node in enumerate(graph.nodes):
        for i in node.inputs:
            last[i] = nid
    for o in graph.outputs:
        last[o] = len(graph.nodes)
    return tuple(last)


def releases(graph: Graph) -> tuple[tuple[int, ...], ...]:
    """Per node: the nodes whose values an executor can drop once it has computed this
    one (their last reader), so a compute holds only what is still to be read, not every
    intermediate until it ends. Dropping a value frees its memory only when nothing else
    holds it: a view keeps its base alive (``Graph``'s alias rules need not be known here)."""
    out: list[list[int]] = [[] for _ in graph.nodes]
    for nid, last in enumerate(last_reads(graph)):
        if last < len(graph.nodes):
            out[last].append(nid)
    return tuple(tuple(ids) for ids in out)
