"""A registered graph compiled for the host executor: a flat list of steps, one per node.

Compiling resolves each node's kernel and attributes once, decides which index operands
the host checks before launch, and fuses sibling matrix products: MATMULs that read the
same activation with weights of one dtype and width (q/k/v, gate/up) become one product,
then split. On a GPU each small product costs a kernel launch whatever its width, so a
llama block goes from seven products to four. The weights stay where they are: quantized
ones are read from their blocks in one stacked call, 16-bit ones adjacent in their buffer
as one view spanning them (see LocalBackend._fused_weight).

Some values are left for their reader to make (``deferred``): a SwiGLU or a norm for the
product reading it, a product for the residual ADD reading it, the queries' RoPE for the
attention. A decode step's quantized product then makes them in its own kernels
(qmatmul.decode_product), its attention rotates q as it loads it (decode_attention);
elsewhere they are made with the kernels they stand for, the same bits as without.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...graph import OPS, DType, Graph, Op, T, releases
from . import kernels
from .kernels import DEVICE_KERNELS, KERNELS

# ops whose value may be their first operand's storage (a view, or the tensor itself)
VIEWS = frozenset({Op.RESHAPE, Op.VIEW, Op.PERMUTE, Op.TRANSPOSE, Op.CONTIGUOUS, Op.CAST})
# (op, operand): where a kernel takes a WEIGHT as stored (kernels.Blocks, a 16-bit view)
STORED_OPERANDS = frozenset({(Op.MATMUL, 1), (Op.GET_ROWS, 0)})


@dataclass(frozen=True)
class Step:
    """A kernel applied to earlier nodes' values (``inputs``) and the node's attributes."""

    op: Op
    kernel: object
    inputs: tuple[int, ...]
    attrs: tuple
    memo_key: int | None = None  # OpSpec.memo: the node id of the positions they share work on
    checks: tuple[tuple[int, int, str], ...] = ()  # OpSpec.index, where checked on the device's values


@dataclass(frozen=True)
class Input:
    name: str
    dtype: DType


@dataclass(frozen=True)
class Leaf:
    node: object  # graph.Node of a WEIGHT or STATE
    read: bool = True  # False: only fused products read it
    # some step reads it as a plain tensor, not as MATMUL's weight or GET_ROWS' table (the
    # operands whose kernels take a weight as stored: blocks, or 16-bit on a CPU)
    plain: bool = False


@dataclass(frozen=True)
class FusedMatmul:
    """Where the first of ``members`` stood: ``x @ stack(weights).T``, split by ``widths``.
    The first part is that node's value; the others wait for their nodes (``Part``)."""

    x: int
    members: tuple[int, ...]
    weights: tuple  # the members' WEIGHT nodes
    widths: tuple[int, ...]


@dataclass(frozen=True)
class Part:
    """A later member of a ``FusedMatmul``: its slice was computed already."""


@dataclass
class Program:
    steps: list  # one per node: Step, Input, Leaf, FusedMatmul or Part
    outputs: tuple[int, ...]
    # (input name, exclusive limit, what): index operands checked on the host before launch,
    # one per input and limit (a llama's pos indexes 90 caches: one check); a limit of T is
    # the step's token count (rows picked from a value of T rows)
    index_checks: tuple[tuple[str, int, str], ...] = ()
    device_safe: bool = False  # every index operand is an input: no device-side checks needed
    weight_buffers: tuple[int, ...] = ()
    sample_params: tuple[str, ...] = ()  # inputs holding SAMPLE's params (greedy when temperature <= 0)
    captured: dict = field(default_factory=dict)  # (n_tokens, greedy) -> CapturedStep (CUDA only)
    # no input has the token axis: every run has the same shapes (a torch frontend graph,
    # registered per shape), so a graph run again is worth compiling and recording once
    fixed: bool = False
    # the rows of the graph's one SAMPLE node where that count is fixed, else 0: a step of
    # that many tokens samples every one of them, a decode step of that many sequences
    sampled_rows: int = 0
    runs: int = 0  # computes so far (counted for fixed graphs)
    # per step: the values to drop once it ran (graph.releases): a walk holds what is still
    # to be read, not every intermediate (SmolLM2's batch-32 prompt: 20.9 GB until it ends)
    releases: tuple[tuple[int, ...], ...] = ()


def fusable_groups(graph: Graph, weight_dtype) -> list[tuple[int, ...]]:
    """Node ids of MATMULs to fuse, per group (2 or more, in node order): same activation,
    2-D WEIGHT operands of the same width K whose dequantized dtype (``weight_dtype``) agrees."""
    nodes = graph.nodes
    groups: dict[tuple, list[int]] = {}
    for nid, node in enumerate(nodes):
        if node.op is not Op.MATMUL:
            continue
        w = nodes[node.inputs[1]]
        if w.op is not Op.WEIGHT or len(w.shape) != 2:
            continue
        groups.setdefault((node.inputs[0], w.shape[1], weight_dtype(w.dtype)), []).append(nid)
    return [tuple(ids) for ids in groups.values() if len(ids) > 1]


def deferred(graph: Graph, fused: dict) -> dict[int, object]:
    """node id -> the kernel of a node whose value is left for its reader to make
    (``kernels.Glu``, ``Normed``, ``Product``), and of the reader that makes it:

    - a SWIGLU whose readers are one product's activation (a MATMUL, or one fused group);
    - an RMS_NORM whose one reader is a MUL by a WEIGHT (K,), whose readers are one product;
    - a MATMUL not fused whose one reader is an ADD of its shape (a residual, a bias);
    - a ROPE whose one reader is an attention's queries (``kernels.Roped``).

    None is a graph output, and no SET_ROWS lies between a node and where it is made (the
    work moves there), but for a ROPE of a value that no STATE is seen through: the cache
    writes between a layer's ROPE of q and its attention cannot change what it reads.
    ``fused``: compile_program's fused groups, by node id."""
    nodes = graph.nodes
    readers: list[list[tuple[int, int]]] = [[] for _ in nodes]  # (reader, operand) per node
    for nid, node in enumerate(nodes):
        for j, i in enumerate(node.inputs):
            readers[i].append((nid, j))
    outputs = set(graph.outputs)
    groups = {m: set(f.members) for f in fused.values() if isinstance(f, FusedMatmul) for m in f.members}

    def quiet(a: int, b: int) -> bool:
        return a not in outputs and all(nodes[i].op is not Op.SET_ROWS for i in range(a + 1, b))

    def product_of(nid: int) -> int | None:
        # where the one product reading nid (as its activation) runs, or None
        rs = readers[nid]
        if not rs or any(nodes[r].op is not Op.MATMUL or j != 0 for r, j in rs):
            return None
        ids = {r for r, _ in rs}
        first = min(ids)
        return first if ids == groups.get(first, {first}) and len(rs) == len(ids) else None

    def fresh(nid: int) -> bool:
        # nid's value is no view of a STATE's (views share its storage; anything else is new)
        while nodes[nid].op in VIEWS:
            nid = nodes[nid].inputs[0]
        return nodes[nid].op not in (Op.STATE, Op.SET_ROWS)

    out: dict[int, object] = {}
    for nid, node in enumerate(nodes):
        if node.op is Op.ROPE and len(readers[nid]) == 1:
            at, j = readers[nid][0]
            if (nodes[at].op in (Op.ATTENTION, Op.ATTENTION_SEQ) and j == 0 and nid not in outputs
                    and fresh(node.inputs[0])):
                out[nid] = kernels.roped
        elif node.op is Op.SWIGLU:
            at = product_of(nid)
            if at is not None and quiet(nid, at):
                out[nid] = kernels.Glu
        elif node.op is Op.RMS_NORM and len(readers[nid]) == 1:
            mul, j = readers[nid][0]
            weight = nodes[nodes[mul].inputs[1 - j]] if nodes[mul].op is Op.MUL else None
            at = product_of(mul)
            if (weight is not None and weight.op is Op.WEIGHT and weight.shape == node.shape[-1:]
                    and at is not None and quiet(nid, mul) and quiet(mul, at)):
                out[nid], out[mul] = kernels.Normed, kernels.scaled
        elif node.op is Op.MATMUL and nid not in fused and len(readers[nid]) == 1:
            add, _ = readers[nid][0]
            if (nodes[add].op is Op.ADD and nodes[add].shape == node.shape
                    and nodes[add].inputs.count(nid) == 1 and quiet(nid, add)):
                out[nid], out[add] = kernels.Product, kernels.add_product
    return out


def compile_program(graph: Graph, accelerated: bool, weight_dtype) -> Program:
    """``accelerated``: a GPU, where kernels must not sync with the host, so index operands
    that are inputs are checked on the host instead (if one is computed, the graph keeps
    the kernels' own checks)."""
    nodes = graph.nodes
    checks: dict[tuple[str, int], str] = {}  # (input name, limit: T for the step's tokens) -> what
    device_safe = True
    for node in nodes:
        for idx, target, what in OPS[node.op].index:
            src = nodes[node.inputs[idx]]
            if src.op is Op.INPUT:
                checks.setdefault((src.attrs[0], nodes[node.inputs[target]].shape[0]), what)
            else:
                device_safe = False
    accelerated = accelerated and device_safe
    table = DEVICE_KERNELS if accelerated else KERNELS
    fused = {}
    for group in fusable_groups(graph, weight_dtype):
        weights = tuple(nodes[nodes[i].inputs[1]] for i in group)
        fused[group[0]] = FusedMatmul(nodes[group[0]].inputs[0], group, weights,
                                      tuple(w.shape[0] for w in weights))
        fused.update((i, Part()) for i in group[1:])
    steps: list = []
    for nid, node in enumerate(nodes):
        if nid in fused:
            steps.append(fused[nid])
        elif node.op is Op.INPUT:
            steps.append(Input(node.attrs[0], node.dtype))
        elif node.op in (Op.WEIGHT, Op.STATE):
            steps.append(Leaf(node))
        else:
            key = node.inputs[-1] if OPS[node.op].memo else None  # pos (or seq) is the last operand
            on_device = () if accelerated else OPS[node.op].index  # else: index_checks do
            steps.append(Step(node.op, table[node.op], node.inputs, node.attrs, key, on_device))
    for nid, kernel in deferred(graph, fused).items():
        steps[nid] = replace(steps[nid], kernel=kernel)
    plain, stored = set(graph.outputs), set()
    for s in steps:
        if isinstance(s, FusedMatmul):
            plain.add(s.x)  # the shared activation may be a leaf
        elif isinstance(s, Step):
            for j, i in enumerate(s.inputs):
                (stored if (s.op, j) in STORED_OPERANDS else plain).add(i)
    steps = [Leaf(s.node, nid in plain or nid in stored, nid in plain) if isinstance(s, Leaf) else s
             for nid, s in enumerate(steps)]
    sample_params = tuple(
        nodes[n.inputs[1]].attrs[0] for n in nodes
        if n.op is Op.SAMPLE and nodes[n.inputs[1]].op is Op.INPUT
    )
    if len(sample_params) != sum(n.op is Op.SAMPLE for n in nodes):
        sample_params = ()  # a computed params tensor: the host cannot know it is greedy
    shapes = [n.shape for n in nodes if n.op is Op.SAMPLE]  # () for one draw, (B,) for B rows
    sampled_rows = shapes[0][0] if len(shapes) == 1 and len(shapes[0]) == 1 and isinstance(shapes[0][0], int) else 0
    return Program(
        steps, graph.outputs, tuple((*key, what) for key, what in checks.items()), accelerated,
        tuple(sorted({n.attrs[0] for n in nodes if n.op is Op.WEIGHT})),
        sample_params,
        fixed=not any(T in n.shape for n in nodes if n.op is Op.INPUT),
        sampled_rows=sampled_rows,
        releases=releases(graph),
    )
