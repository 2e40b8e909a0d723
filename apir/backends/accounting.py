"""What an executor charges against a session's memory limit (``Limits.max_memory``).

Everything a guest can make the host hold counts, not only its buffers: dequantized weight
copies and graph metadata while they live, and each compute's intermediates (estimated
from the graph and checked before the compute runs).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..graph import OPS, Alias, DType, Graph, Op, T
from .base import Limits, QuotaError

# Host memory one registered graph node costs (decoded Node + compiled step; measured
# ~450 B on CPython 3.11): charged to the session's memory limit while the graph lives.
GRAPH_NODE_BYTES = 512


def derived_nbytes(dtype: DType, shape: tuple[int, ...]) -> int:
    """Bytes an executor's cached form of a WEIGHT takes beyond its buffer bytes.
    F32 and I32 weights are used in place; others are widened, at most to f32."""
    return 0 if dtype in (DType.F32, DType.I32) else 4 * math.prod(shape)


class Ledger:
    """Running totals (O(1) per request even with 65536 handles) and the limit check."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.buffers = 0  # bytes of live buffers
        self.peak = 0  # the most ``buffers`` has been
        self.extra = 0  # derived weight forms + graph metadata
        self.derived: dict[tuple, int] = {}  # derived forms' bytes by weight (see graph_charge)
        self.derives = True  # the executor caches derived weight forms (False: reads them as stored)

    def check(self, extra: int, what: str) -> None:
        limit, used = self.limits.max_memory, self.buffers + self.extra
        if limit and used + extra > limit:
            raise QuotaError(
                f"{what} would exceed this session's memory limit "
                f"({used} of {limit} bytes in use, counting buffers, dequantized weights "
                "and graph metadata)"
            )

    def add_buffer(self, size: int) -> None:
        """After ``check``, once the device has allocated it."""
        self.buffers += size
        self.peak = max(self.peak, self.buffers)

    def free_buffer(self, handle: int, size: int) -> None:
        self.buffers -= size
        for key in [k for k in self.derived if k[0] == handle]:
            self.extra -= self.derived.pop(key)

    def graph_charge(self, graph: Graph) -> tuple[dict[tuple, int], int]:
        """Checks what registering ``graph`` would add: (its new derived weight forms, the
        total with its metadata), for ``add_graph`` once it is compiled."""
        # keyed as the executors key their cached forms: (handle, offset, dtype, shape)
        keys = {(*n.attrs, n.dtype, n.shape) for n in graph.nodes if n.op is Op.WEIGHT}
        derived = {k: derived_nbytes(k[2], k[3]) for k in keys - self.derived.keys() if self.derives}
        total = sum(derived.values()) + GRAPH_NODE_BYTES * len(graph.nodes)
        self.check(total, f"registering a graph of {len(graph.nodes)} nodes")
        return derived, total

    def add_graph(self, derived: dict[tuple, int], total: int) -> None:
        self.derived.update(derived)
        self.extra += total

    def free_graph(self, graph: Graph) -> None:
        self.extra -= GRAPH_NODE_BYTES * len(graph.nodes)

    def clear(self) -> None:
        self.derived.clear()
        self.extra = 0


# ---------------------------------------------------------------- scratch estimate

Poly = Counter  # bytes as a polynomial in T: {power: coefficient}; update() adds


def _term(shape: Sequence[int], factor: int = 4) -> Poly:
    """``factor`` * numel(shape) as {power of T: coefficient}."""
    return Counter({shape.count(T): factor * math.prod(d for d in shape if d != T)})


def _poly(poly: Mapping[int, int], t: int) -> int:
    return sum(c * t**p for p, c in poly.items())


@dataclass(frozen=True)
class Scratch:
    """Bytes one compute of a graph holds besides its leaves, as polynomials in T (upper
    bounds). The executors keep every node's value until the end of a compute, so the sum
    over nodes (4 bytes an element: values are held as f32 at most) is what a compute
    peaks at; ops that always return a view of their input (``Alias.ALWAYS``) add nothing.
    ``transient``: what single ops need besides their result (``OpSpec.scratch``); only
    the largest one is live at a time."""

    total: Poly
    transient: tuple[Poly, ...]

    @classmethod
    def of(cls, graph: Graph) -> Scratch:
        total: Poly = Counter()
        transient: dict[frozenset, Poly] = {}
        for node in graph.nodes:
            spec = OPS[node.op]
            if node.op in (Op.WEIGHT, Op.STATE) or spec.alias is Alias.ALWAYS:
                continue
            total.update(_term(node.shape))
            if spec.scratch is not None:
                extra: Poly = Counter()
                for shape, size in spec.scratch([graph.nodes[i].shape for i in node.inputs]):
                    extra.update(_term(shape, size))
                transient[frozenset(extra.items())] = extra
        return cls(total, tuple(transient.values()))

    def nbytes(self, n_tokens: int) -> int:
        return _poly(self.total, n_tokens) + max((_poly(p, n_tokens) for p in self.transient), default=0)
