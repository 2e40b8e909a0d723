"""What an executor charges against a session's memory limit (``Limits.max_memory``).

Everything a guest can make the host hold counts, not only its buffers: every cached
weight form (dequantized, or several concatenated for a fused product) and graph metadata
(strings by their size) while they live, and each compute's intermediates, materialised
views and outputs — the host copies and the reply they are packed into, per listing —
estimated from the graph and checked before the compute runs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..graph import OPS, Alias, DType, Graph, Node, Op, T, last_reads
from .base import Limits, QuotaError

# Host memory one registered graph node costs besides its strings (decoded Node + compiled
# step; measured ~450 B on CPython 3.11): charged while the graph lives.
GRAPH_NODE_BYTES = 512
# ... and per output listing: its slot in the graph's Step layout (~170 B) and its place in
# each of the up to 16 placements the layout caches, one per T computed (~230 B each)
GRAPH_OUTPUT_BYTES = 4096
# Host memory a live buffer costs besides its bytes (its tensor, storage and bookkeeping;
# measured ~650 B for a 1-byte buffer on the CPU): 65536 handles are 64 MiB
BUFFER_BYTES = 1024


def form_nbytes(nodes: Sequence[Node]) -> int:
    """Upper bound of the bytes an executor's cached form of WEIGHT leaves ``nodes`` takes
    beyond their buffers: one F32 or I32 weight is used in place, any other is widened (at
    most to f32); several are concatenated (a fused product's operand), which always copies,
    once per listing even when one weight is listed many times."""
    if len(nodes) == 1 and nodes[0].dtype in (DType.F32, DType.I32):
        return 0
    return sum(4 * math.prod(n.shape) for n in nodes)


# a graph's token picks (ARGMAX, SAMPLE outputs) kept on the device after a compute, to be
# fed into its next one: at most this many bytes a graph, charged when it is registered
FEED_MAX_BYTES = 64 << 10
PICKS = (Op.ARGMAX, Op.SAMPLE)


def graph_nbytes(graph: Graph) -> int:
    """Host memory a registered graph takes: per node and per output listing a fixed cost,
    plus the nodes' strings (labels, input names: up to 64 KiB each on the wire) by their
    size (4 bytes a character for a str CPython cannot store as one byte each), plus the
    room for its picks kept for feeding."""
    strings = sum(_str_nbytes(n.label) + sum(_str_nbytes(a) for a in n.attrs if isinstance(a, str))
                  for n in graph.nodes)
    picks = any(graph.nodes[o].op in PICKS for o in graph.outputs)
    return (GRAPH_NODE_BYTES * len(graph.nodes) + GRAPH_OUTPUT_BYTES * len(graph.outputs) + strings
            + FEED_MAX_BYTES * picks)


def _str_nbytes(s: str) -> int:
    return len(s) if s.isascii() else 4 * len(s)


class Ledger:
    """Running totals (O(1) per request even with 65536 handles) and the limit check."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.buffers = 0  # bytes of live buffers
        self.peak = 0  # the most ``buffers`` has been
        self.extra = 0  # cached weight forms + graph metadata + buffers' own overhead
        # cached weight forms' bytes, keyed as ``Executor._cached`` keys them: per leaf
        # (handle, offset, dtype, shape, form kind)
        self.forms: dict[tuple, int] = {}

    def check(self, extra: int, what: str) -> None:
        limit, used = self.limits.max_memory, self.buffers + self.extra
        if limit and used + extra > limit:
            raise QuotaError(
                f"{what} would exceed this session's memory limit "
                f"({used} of {limit} bytes in use, counting buffers, dequantized and fused weights "
                "and graph metadata)"
            )

    def check_buffer(self, size: int) -> None:
        self.check(size + BUFFER_BYTES, f"allocating {size} bytes")

    def add_buffer(self, size: int) -> None:
        """After ``check_buffer``, once the device has allocated it."""
        self.buffers += size
        self.extra += BUFFER_BYTES
        self.peak = max(self.peak, self.buffers)

    def free_buffer(self, handle: int, size: int) -> None:
        """Its bytes and every cached form made from it (``Executor._release`` drops those)."""
        self.buffers -= size
        self.extra -= BUFFER_BYTES
        for key in [k for k in self.forms if any(leaf[0] == handle for leaf in k)]:
            self.extra -= self.forms.pop(key)

    def check_form(self, key: tuple, nodes: Sequence[Node], nbytes: int | None = None) -> int:
        """Before making the cached form ``key`` of ``nodes`` (``nbytes``, else at most
        ``form_nbytes``): its bytes, if they fit."""
        size = form_nbytes(nodes) if nbytes is None else nbytes
        self.check(size - self.forms.get(key, 0),
                   f"a dequantized or fused form of {len(nodes)} weight(s), {size} bytes,")
        return size

    def add_form(self, key: tuple, size: int) -> None:
        self.extra += size - self.forms.get(key, 0)
        self.forms[key] = size

    def graph_charge(self, graph: Graph) -> int:
        """Checks that registering ``graph``'s metadata fits; its bytes, for ``add_graph``."""
        size = graph_nbytes(graph)
        self.check(size, f"registering a graph of {len(graph.nodes)} nodes ({size} bytes of metadata)")
        return size

    def add_graph(self, size: int) -> None:
        self.extra += size

    def free_graph(self, graph: Graph) -> None:
        self.extra -= graph_nbytes(graph)

    def clear(self) -> None:
        self.forms.clear()
        self.extra = 0


# ---------------------------------------------------------------- scratch estimate

Poly = Counter  # bytes as a polynomial in T: {power: coefficient}; update() adds


def _term(shape: Sequence[int], factor: int = 4) -> Poly:
    """``factor`` * numel(shape) as {power of T: coefficient}."""
    return Counter({shape.count(T): factor * math.prod(d for d in shape if d != T)})


def _poly(poly: Mapping[int, int], t: int) -> int:
    return sum(c * t**p for p, c in poly.items())


# a graph's peaks kept apart at most (beyond it, merged into one bound: see Scratch.of)
PEAKS_KEPT = 32


@dataclass(frozen=True)
class Scratch:
    """Bytes one compute of a graph holds besides its leaves, as polynomials in T (upper
    bounds). The executors drop each value after its last reader (``graph.releases``), so
    a compute peaks at the node where the values still to be read, with that op's own
    scratch beside them (``OpSpec.scratch``), are largest. A value (4 bytes an element:
    held as f32 at most) lives until the last read of anything that may view it: ops
    that always return a view of their input (``Alias.ALWAYS``) add no bytes, ones that
    may (``MAYBE``) are counted as copies and keep their input alive as well. ``peaks``:
    that sum at every node, less those another one bounds everywhere. Then the outputs:
    one host copy of each distinct output node, and the reply they are packed into,
    which holds an output once per listing and is built twice (the payload, then its
    frame)."""

    peaks: tuple[Poly, ...]
    outputs: Poly
    known: dict[int, int] = field(default_factory=dict, compare=False)  # T -> nbytes: decode asks one T

    @classmethod
    def of(cls, graph: Graph) -> Scratch:
        nodes = graph.nodes
        last = list(last_reads(graph))
        for nid in range(len(nodes) - 1, -1, -1):  # whatever views a value keeps it alive
            node = nodes[nid]
            if node.inputs and OPS[node.op].alias is not Alias.NONE:
                last[node.inputs[0]] = max(last[node.inputs[0]], last[nid])
        live: Poly = Counter()
        expiring: dict[int, Poly] = {}
        peaks: list[Poly] = []
        for nid, node in enumerate(nodes):
            spec = OPS[node.op]
            if node.op not in (Op.WEIGHT, Op.STATE) and spec.alias is not Alias.ALWAYS:
                term = _term(node.shape)
                live.update(term)
                expiring.setdefault(last[nid], Counter()).update(term)
            peak = live.copy()
            if spec.scratch is not None:
                for shape, size in spec.scratch([nodes[i].shape for i in node.inputs]):
                    peak.update(_term(shape, size))
            _keep_peak(peaks, peak)
            live.subtract(expiring.pop(nid, Counter()))
        outputs: Poly = Counter()
        for nid in set(graph.outputs):
            outputs.update(_term(nodes[nid].shape))
        for nid in graph.outputs:
            outputs.update(_term(nodes[nid].shape, 8))
        return cls(tuple(peaks), outputs)

    def nbytes(self, n_tokens: int) -> int:
        size = self.known.get(n_tokens)
        if size is None:
            size = _poly(self.outputs, n_tokens) + max((_poly(p, n_tokens) for p in self.peaks), default=0)
            if len(self.known) < 64:  # a few T at most; others are worked out each time
                self.known[n_tokens] = size
        return size


def _keep_peak(peaks: list[Poly], peak: Poly) -> None:
    """Adds ``peak`` to ``peaks`` unless one of them bounds it at every T >= 1 (no smaller
    coefficient), dropping those it bounds. Past PEAKS_KEPT (a graph whose live bytes keep
    changing form), all are merged into their coefficient-wise maximum: still a bound."""
    if any(all(p[k] >= c for k, c in peak.items()) for p in peaks):
        return
    peaks[:] = [p for p in peaks if not all(peak[k] >= c for k, c in p.items())]
    peaks.append(peak)
    if len(peaks) > PEAKS_KEPT:
        merged: Poly = Counter()
        for p in peaks:
            merged |= p
        peaks[:] = [merged]
