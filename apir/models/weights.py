"""Where a model's tensors live on a backend, and how graph builders refer to them.

``WeightTable`` and ``KVLayout`` are plain records of (buffer, offset, dtype, shape) made
once when a model is loaded; ``Weights`` and ``KVCache`` turn them into graph leaves for
one ``GraphBuilder`` (each graph gets its own leaf nodes, pointing at the same bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph import DType, GraphBuilder, Value
from .errors import ModelLoadError


@dataclass(frozen=True)
class TensorSlot:
    offset: int
    dtype: DType
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WeightTable:
    buffer: int
    slots: dict[str, TensorSlot]


class Weights:
    """Weight leaves for one graph, by GGUF tensor name."""

    def __init__(self, g: GraphBuilder, table: WeightTable) -> None:
        self.g, self.table = g, table
        self._values: dict[str, Value] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.table.slots

    def __getitem__(self, name: str) -> Value:
        if name not in self._values:
            slot = self.table.slots.get(name)
            if slot is None:
                raise ModelLoadError(f"the model has no tensor {name}")
            self._values[name] = self.g.weight(
                self.table.buffer, slot.offset, slot.shape, slot.dtype, label=name
            )
        return self._values[name]

    def output(self) -> Value:
        """The output projection; models without one tie it to the token embedding."""
        return self["output.weight" if "output.weight" in self else "token_embd.weight"]


# --cache-type: llama.cpp's -ctk/-ctv names of the KV cache dtypes apir keeps
KV_TYPES = {"f16": DType.F16, "f32": DType.F32}


def pick_kv_type(requested: DType | None) -> DType:
    """The KV cache's dtype: ``requested``, else F16, llama.cpp's default, on every device:
    decode attention reads half the bytes on a GPU; on a CPU the cached rows are widened
    to f32 per step, which cost SmolLM2-135M no decode speed at depth 0 and ~5% of a step's
    CPU time at depth 1024 (2 cores, 2026-12-01), for half the KV memory; logits still
    match the llama.cpp fixtures."""
    if requested is None:
        return DType.F16
    if requested not in KV_TYPES.values():
        raise ModelLoadError(f"the KV cache holds {' or '.join(KV_TYPES)}, not {requested.name}")
    return requested


@dataclass(frozen=True)
class KVLayout:
    """Per layer, a key and a value cache of (n_ctx, n_head_kv, head_dim) in one buffer."""

    buffer: int
    n_ctx: int
    dtype: DType
    layers: tuple[tuple[TensorSlot, TensorSlot], ...]

    @staticmethod
    def plan(n_ctx: int, heads: list[tuple[int, int, int]], dtype: DType, align: int) -> tuple[int, list]:
        """Offsets for layers of (n_head_kv, k_dim, v_dim); returns (total bytes, slots)."""
        offset, slots = 0, []
        for n_kv, k_dim, v_dim in heads:
            pair = []
            for dim in (k_dim, v_dim):
                shape = (n_ctx, n_kv, dim)
                pair.append(TensorSlot(offset, dtype, shape))
                offset += -(-dtype.nbytes(shape) // align) * align
            slots.append(tuple(pair))
        return offset, slots


class KVCache:
    """KV-cache leaves for one graph: writing this step's rows returns the whole cache."""

    def __init__(self, g: GraphBuilder, layout: KVLayout) -> None:
        self.g, self.layout = g, layout

    def write(self, g: GraphBuilder, il: int, k: Value, v: Value, pos: Value) -> tuple[Value, Value]:
        out = []
        for slot, rows, kind in zip(self.layout.layers[il], (k, v), "kv"):
            cache = g.state(self.layout.buffer, slot.offset, slot.shape, slot.dtype, f"cache_{kind}.{il}")
            out.append(g.set_rows(cache, rows, pos))
        return out[0], out[1]

    def attend(self, g: GraphBuilder, il: int, q: Value, k: Value, v: Value, pos: Value,
               scale: float, window: int) -> Value:
        """Write this step's k, v (T, Hkv, D) of layer ``il``; q's attention over the cache."""
        k_all, v_all = self.write(g, il, k, v, pos)
        return g.attention(q, k_all, v_all, pos, scale, window=window)  # (T, H, D)
