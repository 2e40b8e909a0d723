"""Graph <-> bytes. Structure is checked here; meaning (shape rules) by ``Graph.validate``.

    graph  := u32 n_nodes, node * n_nodes, u32 n_outputs, u32 output * n_outputs
    node   := u16 op, u32 n_inputs, u32 input * n_inputs, attrs, u32 rank, i64 dim * rank,
              u16 dtype, str label
    attrs  := the op's attributes in table order: int -> i64, float -> f64,
              ints -> u32 count + i64 * count, str -> u32 length + UTF-8
"""

from __future__ import annotations

from ..graph import OPS, DType, Graph, Node, Op
from ..graph.ops import FLOAT, INT, INTS, STR
from .wire import MAX_RANK, ProtocolError, Reader, Writer

MAX_NODES = 1 << 16
MAX_INPUTS = 8


def write_graph(w: Writer, g: Graph) -> None:
    w.u32(len(g.nodes))
    for node in g.nodes:
        w.u16(int(node.op))
        w.u32(len(node.inputs))
        for i in node.inputs:
            w.u32(i)
        for value, (_, kind) in zip(node.attrs, OPS[node.op].attrs):
            if kind == INT:
                w.i64(value)
            elif kind == FLOAT:
                w.f64(value)
            elif kind == INTS:
                w.u32(len(value))
                for v in value:
                    w.i64(v)
            else:
                w.str(value)
        w.u32(len(node.shape))
        for d in node.shape:
            w.i64(d)
        w.u16(int(node.dtype))
        w.str(node.label)
    w.u32(len(g.outputs))
    for o in g.outputs:
        w.u32(o)


def read_graph(r: Reader) -> Graph:
    nodes = []
    for nid in range(r.count(MAX_NODES)):
        code = r.u16()
        try:
            op = Op(code)
        except ValueError:
            raise ProtocolError(f"node {nid}: unknown op {code}") from None
        inputs = tuple(r.u32() for _ in range(r.count(MAX_INPUTS)))
        attrs: list[int | float | tuple[int, ...] | str] = []
        for _, kind in OPS[op].attrs:
            if kind == INT:
                attrs.append(r.i64())
            elif kind == FLOAT:
                attrs.append(r.f64())
            elif kind == INTS:
                attrs.append(tuple(r.i64() for _ in range(r.count(MAX_RANK))))
            elif kind == STR:
                attrs.append(r.str())
        shape = tuple(r.i64() for _ in range(r.count(MAX_RANK)))
        code = r.u16()
        try:
            dtype = DType(code)
        except ValueError:
            raise ProtocolError(f"node {nid}: unknown dtype {code}") from None
        nodes.append(Node(op, inputs, tuple(attrs), shape, dtype, r.str()))
    outputs = tuple(r.u32() for _ in range(r.count(MAX_NODES)))
    return Graph(tuple(nodes), outputs)
