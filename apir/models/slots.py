"""A KV cache of sequence slots, for steps that carry the tokens of several sequences.

Per layer, a key and a value cache of (S * n_ctx, n_head_kv, head_dim) rows in one buffer
(planned by ``KVLayout.plan`` with S * n_ctx rows): slot s holds its sequence's position p
at row s * n_ctx + p. A step's token t writes its row at ``rows[t]`` (the guest computes
seq[t] * n_ctx + pos[t]; SET_ROWS bounds-checks it) and attends, through ATTENTION_SEQ,
to its own slot's rows at positions up to ``pos[t]``.
"""

from __future__ import annotations

from ..graph import GraphBuilder, Value
from .weights import KVLayout


class SlotCache:
    """Slotted KV-cache leaves for one graph (``KVCache``'s interface to the builders):
    ``layout`` holds ``slots`` slots of ``layout.n_ctx // slots`` rows each."""

    def __init__(self, g: GraphBuilder, layout: KVLayout, slots: int, seq: Value, rows: Value) -> None:
        self.g, self.layout, self.slots = g, layout, slots
        self.seq, self.rows = seq, rows  # (T,) I32 each

    def attend(self, g: GraphBuilder, il: int, q: Value, k: Value, v: Value, pos: Value,
               scale: float, window: int) -> Value:
        """Write k, v (T, Hkv, D) of layer ``il`` at ``rows``; q's attention per slot."""
        n_ctx = self.layout.n_ctx // self.slots
        caches = []
        for slot, new, kind in zip(self.layout.layers[il], (k, v), "kv"):
            cache = g.state(self.layout.buffer, slot.offset, slot.shape, slot.dtype, f"cache_{kind}.{il}")
            cache = g.set_rows(cache, new, self.rows)
            caches.append(g.reshape(cache, (self.slots, n_ctx, *slot.shape[1:])))  # (S, n_ctx, Hkv, D)
        return g.attention(q, caches[0], caches[1], pos, scale, window=window, seq=self.seq)
