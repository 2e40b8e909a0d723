"""Running lowered graphs: a ``Session`` per apir backend holds the weights uploaded to it,
a ``Compiled`` per FX graph holds its apir graphs, one per binding of input shapes.

A call binds each argument one of four ways: a tensor the session knows as static (a
parameter or buffer Dynamo passed; uploaded once, a WEIGHT leaf), the key of a tensor kept
on the host (``apir.torch.held``: a STATE leaf filled on the host before the step), any
other tensor (an INPUT, sent with each step), or a Python value (a concrete size). The
first call with a binding lowers the graph (``apir.torch.lower``) and registers it; later
calls with the same binding send only the inputs, run one step and read back only the
outputs, or, with ``keep_outputs``, those below ``held.KEEP_MIN_BYTES`` (the others stay
on the host: the step writes them to staging STATEs, copied there into a block per call).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx

from ..backends import Backend, BufferPurpose
from ..graph import DType, GraphBuilder, GraphError, Value
from . import held
from .lower import Known, Lowering, Unsupported, is_random, layout, op_name, supported

log = logging.getLogger("apir.torch")

# Registered graphs kept per FX graph, one per input-shape binding, least recently used
# dropped first. Each costs the host its metadata (~0.5 MB for SmolLM2's 30 layers) and
# the guest a lowering (~0.3 s on 2 busy cores); a transformers generate() is one binding
# per sequence length.
MAX_GRAPHS = 64
_warned: set[str] = set()


def warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"apir.torch: {message}", stacklevel=3)


def apir_dtype(t: torch.Tensor) -> DType:
    return DType.F32 if t.is_floating_point() else DType.I32


def to_numpy(t: torch.Tensor) -> tuple[np.ndarray, DType]:
    """A guest tensor as the bytes apir takes: floats as F32, integers and bools as I32."""
    t = t.detach().cpu()
    if t.is_floating_point():
        return t.to(torch.float32).contiguous().numpy(), DType.F32
    if t.numel() and (int(t.min()) < -(1 << 31) or int(t.max()) >= 1 << 31):
        raise Unsupported(f"an integer tensor with values beyond int32 ({t.dtype})")
    return t.to(torch.int32).contiguous().numpy(), DType.I32


class Session:
    """An apir backend and the static tensors (parameters, buffers) uploaded to it, once
    each: a weight is re-sent only when its tensor changed (``Tensor._version``)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.pool = held.Pool(backend)  # the blocks of outputs kept on the host (apir.torch.held)
        self._static: dict[tuple, torch.Tensor] = {}  # layout -> a parameter or buffer
        self._weights: dict[tuple, tuple[int, int]] = {}  # layout -> (buffer handle, version uploaded)
        self.uploaded = 0  # bytes sent as weights (what tests and the bench read)

    def mark_static(self, t: torch.Tensor) -> None:
        self._static[layout(t)] = t

    def is_static(self, t: torch.Tensor) -> bool:
        return self._static.get(layout(t)) is not None

    def weight(self, g: GraphBuilder, t: torch.Tensor) -> Value | None:
        """A WEIGHT leaf holding static tensor ``t`` (uploaded now if new or changed), or None
        where ``t`` is not a static tensor's layout."""
        key = layout(t)
        if key not in self._static:
            return None
        handle, version = self._weights.get(key, (0, -1))
        if version != t._version:
            arr, _ = to_numpy(t)
            if not handle:
                handle = self.backend.alloc_buffer(max(arr.nbytes, 1), BufferPurpose.WEIGHTS)
            self.backend.set_tensor(handle, 0, arr)
            self.uploaded += arr.nbytes
            self._weights[key] = (handle, t._version)
        return g.weight(handle, 0, tuple(t.shape), apir_dtype(t))


@dataclass
class Entry:
    """One registered specialisation of a Compiled graph."""

    gid: int | None  # None: every output was known on the guest
    inputs: tuple[tuple[int, str], ...]  # (argument index, apir input name)
    staged: tuple[tuple[int, int], ...]  # (argument index of a HostTensor's key, its staging buffer)
    outputs: object  # the FX output structure: _Out marks an apir output, Known and Python as is
    dtypes: tuple[torch.dtype | None, ...]  # per apir output: the dtype PyTorch gives it
    shapes: tuple[tuple[int, ...], ...]  # per apir output: its shape (a 0-d one comes back (1,))
    kept: tuple[int | None, ...]  # per apir output: the staging buffer it stays in on the host, or None
    buffers: tuple[int, ...]  # constants' buffers, freed with the graph
    stages: tuple[_Stage, ...]  # the staging buffers its STATE leaves are in, released with it


@dataclass(eq=False)
class _Stage:
    """A staging buffer that every specialisation of a Compiled graph uses for one role
    (its j-th HostTensor input, its k-th kept output): a step fills or empties it within
    its own call, so graphs run in turn can share it. It grows by doubling, so a generate()
    whose cache grows a token a call holds at most twice its largest size per role, not one
    buffer per cache length."""

    role: str  # "input" or "output"
    handle: int
    size: int
    users: int = 0  # registered graphs whose leaves are in it


class Compiled:
    """An FX graph (core ATen) run on the session's backend; a callable like the graph."""

    def __init__(self, session: Session, gm: torch.fx.GraphModule, keep_outputs: bool = False) -> None:
        self.session, self.gm = session, gm
        self.keep_outputs = keep_outputs  # large float outputs stay on the host (apir.torch.held)
        self._entries: OrderedDict[tuple, Entry | None] = OrderedDict()  # None: runs in PyTorch
        out = next(n for n in gm.graph.nodes if n.op == "output")
        self._out_dtypes = torch.fx.node.map_arg(
            out.args[0], lambda n: getattr(n.meta.get("val"), "dtype", None))
        # placeholders that are HostTensors' keys (read only through held nodes)
        self._held = {i for i, ph in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
                      if ph.users and all(u.target is held.HELD and u.args[0] is ph for u in ph.users)}
        self._stages: dict[tuple[str, int], _Stage] = {}  # (role, index) -> the current buffer

    def __call__(self, *args):
        key = tuple(("held", held.entry(a).shape) if i in self._held else self._binding(a)
                    for i, a in enumerate(args))
        if key not in self._entries:
            self._entries[key] = self._lower(args)
            if len(self._entries) > MAX_GRAPHS:
                self._free(self._entries.popitem(last=False)[1])
        self._entries.move_to_end(key)
        entry = self._entries[key]
        if entry is None:
            return self.gm(*args)
        results: list = []
        if entry.gid is not None:
            for i, staging in entry.staged:
                held.stage(self.session.pool, args[i], staging)
            feed = {name: to_numpy(args[i])[0] for i, name in entry.inputs}
            returned = iter(self.session.backend.compute(entry.gid, feed))
            kept = iter(held.keep(self.session.pool, [
                (staging, shape, dt) for staging, shape, dt in zip(entry.kept, entry.shapes, entry.dtypes)
                if staging is not None]))
            for staging, dt, shape in zip(entry.kept, entry.dtypes, entry.shapes):
                if staging is not None:
                    results.append(next(kept))
                    continue
                o = torch.from_numpy(next(returned)).reshape(shape)
                results.append(o if dt is None else o.to(dt))
        return _rebuild(entry.outputs, results)

    def _binding(self, a) -> tuple:
        if isinstance(a, torch.Tensor):
            if self.session.is_static(a):
                return ("weight", layout(a), a._version)
            return ("input", tuple(a.shape), a.dtype)  # an empty one binds as a constant of its shape
        return ("value", a)

    def _lower(self, args: tuple) -> Entry | None:
        consts: list[int] = []
        inputs: list[tuple[int, str]] = []
        staged: list[tuple[int, int]] = []
        stages: list[_Stage] = []

        def stage(role: str, nbytes: int) -> int:  # the next staging buffer of this role
            stages.append(self._stage((role, sum(s.role == role for s in stages)), nbytes))
            return stages[-1].handle

        def leaf(g: GraphBuilder, t: torch.Tensor) -> Value:
            w = self.session.weight(g, t)
            if w is not None:
                return w
            arr, dtype = to_numpy(t)  # a constant of this specialisation
            if arr.size == 0:
                raise Unsupported("an empty constant tensor")
            handle = self.session.backend.alloc_buffer(arr.nbytes, BufferPurpose.WEIGHTS)
            consts.append(handle)
            self.session.backend.set_tensor(handle, 0, arr)
            return g.weight(handle, 0, arr.shape, dtype)

        low = Lowering(leaf)

        def bind(i: int, node: torch.fx.Node):
            a = args[i]
            if i in self._held:  # filled on the host before each step (held.stage)
                shape = held.entry(a).shape
                handle = stage("input", DType.F32.nbytes(shape))
                staged.append((i, handle))
                return low.g.state(handle, 0, shape, DType.F32)
            if not isinstance(a, torch.Tensor):
                return a
            if self.session.is_static(a) or a.numel() == 0:  # an empty tensor is its shape
                return Known(a)
            name = f"x{i}"
            inputs.append((i, name))
            return low.g.input(name, tuple(a.shape), apir_dtype(a))

        try:
            outs = low.run(self.gm, bind)
            values: list[Value] = []
            dtypes: list[torch.dtype | None] = []
            structure = _index(outs, self._out_dtypes, values, dtypes)
            kept = self._kept(low, values, dtypes, stage)
            returned = [v for v, k in zip(values, kept) if k is None]
            if values and not returned:  # a step returns something: 4 bytes, ignored
                returned = [low.leaf(torch.zeros(1, dtype=torch.int32))]
            gid = self.session.backend.register_graph(low.g.build(*returned)) if values else None
        except (Unsupported, GraphError, TypeError, IndexError) as e:
            # what only the shapes or arguments of this call reveal (a lowering's own
            # TypeError or IndexError included): this binding runs eagerly, said once
            for h in consts:
                self.session.backend.free_buffer(h)
            self._release(stages)
            warn_once(str(e), f"cannot lower this graph for these inputs ({type(e).__name__}: {e}); "
                              "it runs in PyTorch on the guest")
            return None
        return Entry(gid, tuple(inputs), tuple(staged), structure, tuple(dtypes),
                     tuple(v.shape for v in values), kept, tuple(consts), tuple(stages))

    def _kept(self, low: Lowering, values: list[Value], dtypes: list[torch.dtype | None],
              stage: Callable[[str, int], int]) -> tuple[int | None, ...]:
        """Per output: the staging buffer the step writes it to where it stays on the host
        (float, at least KEEP_MIN_BYTES, with keep_outputs), else None."""
        kept: list[int | None] = []
        ids: dict[int, Value] = {}  # rows -> the 0..rows-1 leaf (a cache's 60 tensors share one)
        for v, dt in zip(values, dtypes):
            if not (self.keep_outputs and v.dtype is DType.F32 and dt is not None
                    and dt.is_floating_point and DType.F32.nbytes(v.shape) >= held.KEEP_MIN_BYTES):
                kept.append(None)
                continue
            # the value as rows of its last axis, written over a STATE of the same rows
            width = v.shape[-1] if v.shape else 1
            rows = math.prod(v.shape) // width
            handle = stage("output", DType.F32.nbytes(v.shape))
            if rows not in ids:
                ids[rows] = low.leaf(torch.arange(rows, dtype=torch.int32))
            low.g.set_rows(low.g.state(handle, 0, (rows, width), DType.F32),
                           low.g.reshape(v, (rows, width)), ids[rows])
            kept.append(handle)
        return tuple(kept)

    def _stage(self, role: tuple[str, int], nbytes: int) -> _Stage:
        current = self._stages.get(role)
        if current is None or current.size < nbytes:
            size = max(nbytes, 2 * current.size if current else 0, 1)
            self._stages[role] = _Stage(role[0], self.session.backend.alloc_buffer(size, BufferPurpose.KV), size)
            if current is not None and current.users == 0:
                self.session.backend.free_buffer(current.handle)
        self._stages[role].users += 1
        return self._stages[role]

    def _release(self, stages: list[_Stage] | tuple[_Stage, ...]) -> None:
        for st in stages:
            st.users -= 1
            if st.users == 0 and all(st is not cur for cur in self._stages.values()):  # outgrown, unused
                self.session.backend.free_buffer(st.handle)

    def _free(self, entry: Entry | None) -> None:
        if entry is None:
            return
        if entry.gid is not None:
            self.session.backend.free_graph(entry.gid)
        for h in entry.buffers:
            self.session.backend.free_buffer(h)
        self._release(entry.stages)


@dataclass(frozen=True)
class _Out:
    index: int  # which apir output stands here in the FX output structure


def _index(tree, dtype_tree, values: list[Value], dtypes: list):
    """The output structure with each apir Value replaced by an ``_Out``; ``dtypes`` gets
    the dtype PyTorch gives each (from the FX graph's ``dtype_tree``)."""
    if isinstance(tree, Value):
        values.append(tree)
        dtypes.append(dtype_tree)
        return _Out(len(values) - 1)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_index(x, d, values, dtypes) for x, d in zip(tree, dtype_tree))
    return tree


def _rebuild(structure, results: list):
    if isinstance(structure, Known):
        return structure.tensor
    if isinstance(structure, _Out):
        return results[structure.index]
    if isinstance(structure, (list, tuple)):
        return type(structure)(_rebuild(x, results) for x in structure)
    return structure


# ---------------------------------------------------------------- graph breaks


class _Lowered(torch.nn.Module):
    """A partition of a split graph, run by apir."""

    def __init__(self, compiled: Compiled) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args):
        return self.compiled(*args)


def compile_graph(session: Session, gm: torch.fx.GraphModule, keep_outputs: bool = False) -> Callable:
    """``gm`` as one apir graph, or, where some node has no lowering, split around those
    nodes (each named once in a warning): they run in PyTorch on the guest, the parts
    between them on apir."""
    runtime: set[torch.fx.Node] = set()  # nodes that depend on a tensor input, or on a random draw
    bad: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            runtime.add(node)
        elif any(i in runtime for i in node.all_input_nodes) or is_random(node.target):
            # a random op with no input (torch.randn(3)) was folded while lowering: the
            # same draw came back at every call
            runtime.add(node)
            if not supported(node):
                bad.add(node)
    if not bad:
        return Compiled(session, gm, keep_outputs)
    for node in bad:
        name = op_name(node.target)
        warn_once(name, f"{name} has no apir lowering: it runs in PyTorch on the guest (a graph break)")
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    class Support(OperatorSupportBase):
        def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
            return node.op == "call_function" and node not in bad

    split = CapabilityBasedPartitioner(gm, Support(), allows_single_node_partition=True).partition_and_fuse()
    for name, sub in list(split.named_children()):
        setattr(split, name, _Lowered(Compiled(session, sub, keep_outputs)))
    log.info("apir.torch: graph split around %d nodes without a lowering", len(bad))
    return split
