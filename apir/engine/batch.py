"""Steps that carry the tokens of several sequences: a model's slotted KV cache and its
batched sample graph.

The graph, over the symbolic token count T, the fixed slot count S and sampled rows B:
  tokens, pos, seq, rows (T,) I32   each token, its position, its slot, its cache row
                                    (seq * n_ctx + pos)
  last (B,) I32                     per sampled sequence, its last token's index in the step
  params (B, PARAMS_SIZE) F32       per sampled sequence, its packed SampleArgs
  -> (B,) I32                       one token per entry of ``last``; unused entries point
                                    at row 0 with greedy params, and their token is dropped
B is the sequences a step samples rounded up to a power of two (at most S), so the
projection to the vocabulary runs only for rows that are used; on a host that records a
graph per step length ("graph_cache": a GPU) only for a decode step (one sampled token a
sequence: T = B, both padded alike), and S for any other step. Each new (B, T) pair costs
a recording, and ``warm_up`` makes every one a scheduler's steps can meet (T = B in 1, 2,
4... S; B = S with T in 1, 2, 4... PREFILL_CHUNK) before the first request: with B = S
for every step, a decode step of one stream ran S rows (0.19x of the single-sequence path
on an H200 with 64 slots, 2026-12-02).
Only token ids come back; each sequence keeps its own sampling knobs and seed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..backends import BufferPurpose
from ..backends.base import ALIGNMENT, Pending
from ..graph import DType, GraphBuilder, SampleArgs, T
from ..graph.sampling import GREEDY, PARAMS_SIZE
from ..models.slots import SlotCache
from ..models.weights import KVLayout, Weights
from .model import PREFILL_CHUNK, Model


@dataclass(frozen=True)
class Chunk:
    """One sequence's part of a step: ``ids`` at positions ``start``... of ``slot``;
    ``draw`` the packed params of the token sampled after its last id, None for none
    (a prompt chunk that is not the prompt's last)."""

    slot: int
    ids: Sequence[int]
    start: int
    draw: SampleArgs | None


class Batch:
    """A KV cache of ``slots`` sequences of ``model.n_ctx`` tokens (its own buffer, beside
    the model's single-sequence cache) and the graph that steps them together."""

    def __init__(self, model: Model, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a batch needs at least one slot, got {slots}")
        self.model, self.slots, self.n_ctx = model, slots, model.n_ctx
        backend, heads = model.backend, model.arch.kv_heads(model.args)
        size, layers = KVLayout.plan(slots * model.n_ctx, heads, model.kv.dtype, ALIGNMENT)
        self.layout = KVLayout(backend.alloc_buffer(size, BufferPurpose.KV), slots * model.n_ctx,
                               model.kv.dtype, tuple(layers))
        self._graphs: dict[int, int] = {}  # sampled rows B -> the graph, registered on first use

    def _graph(self, n_sampled: int, decode: bool) -> tuple[int, int]:
        """(B, graph) for a step sampling ``n_sampled`` sequences: B the next power of two
        (at most ``slots``), so a lone stream projects one row to the vocabulary, not S;
        ``slots`` where steps are recorded per length, unless the step is a ``decode`` one
        (see the module docstring)."""
        b = min(self.slots, 1 << max(n_sampled - 1, 0).bit_length())
        if self.model._pad and not decode:
            b = self.slots
        if b not in self._graphs:
            model, g = self.model, GraphBuilder()
            tokens, pos, seq, rows = (g.input(n, (T,), DType.I32) for n in ("tokens", "pos", "seq", "rows"))
            last = g.input("last", (b,), DType.I32)
            params = g.input("params", (b, PARAMS_SIZE), DType.F32)
            kv = SlotCache(g, self.layout, self.slots, seq, rows)
            logits = model.arch.build(g, model.args, Weights(g, model.weights), tokens, pos, kv, last)
            self._graphs[b] = model.backend.register_graph(g.build(g.sample(logits, params)))
        return b, self._graphs[b]

    def warm_up(self) -> None:
        """On a host that records (or compiles) a graph per step length, run a step of
        every (B, T) a scheduler's step can have (see the module docstring), greedy and
        sampled, so it does that now rather than inside a request (see ``Model.warm_up``).
        The rows written are overwritten before anything reads them (no slot's cache is
        recorded as holding them)."""
        if not self.model._pad:
            return  # nothing is recorded per length: every step runs as it comes
        sampled = SampleArgs(1.0, 40, 0.95, 0.05, 0.5)
        for draw in (GREEDY, sampled):
            b = 1
            while b < 2 * self.slots:  # decode steps: a token in each of B slots
                self.step([Chunk(s, [0], 0, draw) for s in range(min(b, self.slots))])
                b *= 2
            n = 1 if draw is GREEDY else 2
            while n <= min(PREFILL_CHUNK, self.slots * self.n_ctx):  # any other step: B = S
                self.step(self._spread(n, draw))
                n *= 2

    def _spread(self, n: int, draw: SampleArgs) -> list[Chunk]:
        """Chunks of ``n`` tokens in all that are not a decode step: as few slots as the
        cache length allows, each chunk sampled (a lone token is a prompt's chunk that
        samples nothing)."""
        used = -(-n // self.n_ctx)
        sizes = [n // used + (i < n % used) for i in range(used)]
        return [Chunk(s, [0] * size, 0, draw if n > 1 else None) for s, size in enumerate(sizes)]

    @property
    def chains(self) -> bool:
        """Whether a decode step can be queued before the one it follows is read (``submit``
        with ``fed``): on a recording host, where a decode step's B tokens are one of the
        recorded lengths (``slots`` a power of two)."""
        return self.model._pad and self.slots & (self.slots - 1) == 0

    def step(self, chunks: Sequence[Chunk]) -> list[int]:
        """Run ``chunks`` (at most one per slot, at most ``slots`` of them) as one step; the
        token sampled for each chunk, in order (-1 where its ``draw`` is None)."""
        return self.submit(chunks).result()

    def submit(self, chunks: Sequence[Chunk], fed: bool = False) -> Step:
        """``step``, queued: the tokens come from ``result()``. With ``fed`` (see ``chains``)
        every chunk is one decode token whose id is not known yet: chunk i takes the token
        that the previous step on this batch sampled for its chunk i, on the device (the
        chunks in the same order as that step's, each one position further)."""
        if not chunks or len(chunks) > self.slots:
            raise ValueError(f"a step takes 1 to {self.slots} chunks, got {len(chunks)}")
        if fed and not (self.chains and all(len(c.ids) == 1 and c.draw is not None for c in chunks)):
            raise ValueError("a fed step takes one sampled token per chunk, on a batch that chains")
        # per chunk: its length, first position and slot; per token: the chunk's slot, and
        # the chunk's first position plus the token's index in it
        lens = np.fromiter((len(c.ids) for c in chunks), np.int32, len(chunks))
        ends = np.cumsum(lens)  # each chunk's end in the step
        n = int(ends[-1])
        tokens = np.fromiter(itertools.chain.from_iterable(c.ids for c in chunks), np.int32, n)
        starts = np.fromiter((c.start for c in chunks), np.int32, len(chunks))
        seq = np.repeat(np.fromiter((c.slot for c in chunks), np.int32, len(chunks)), lens)
        pos = (np.arange(n) + np.repeat(starts - (ends - lens), lens)).astype(np.int32)
        sampled = [i for i, c in enumerate(chunks) if c.draw is not None]
        decode = len(sampled) == n  # one sampled token a chunk
        b, graph = self._graph(len(sampled), decode)
        if self.model._pad and n > 1 or fed:
            # as Model._step: repeat the last token, which writes the same row again. Every
            # length is padded (a decode step of 3 sequences runs as 4): few graphs to record.
            # A decode step runs B tokens, one per sampled row: a step fed from it, the same
            # chunks one position on, takes those rows' tokens as its own
            size = b if decode else 1 << (n - 1).bit_length()
            tokens, pos, seq = (np.concatenate([a, np.full(size - n, a[-1], np.int32)]) for a in (tokens, pos, seq))
        end = ends - 1
        params = np.tile(GREEDY.pack(), (b, 1))
        last = np.zeros(b, np.int32)
        if sampled:
            # unused rows repeat the last sampled row, draw included, so they pick its very
            # token: a step fed from this one then writes that token's row again, as padding
            last[:] = end[sampled[-1]]
            params[:] = chunks[sampled[-1]].draw.values()
            last[: len(sampled)] = end[sampled]
            params[: len(sampled)] = [chunks[i].draw.values() for i in sampled]
        rows = seq * self.n_ctx + pos
        inputs = {"pos": pos, "seq": seq, "rows": rows, "last": last, "params": params}
        if fed:
            pending = self.model.backend.submit(graph, inputs, feed={"tokens": 0})
        else:
            pending = self.model.backend.submit(graph, {"tokens": tokens, **inputs})
        return Step(pending, len(chunks), sampled)


class Step:
    """A submitted batch step: ``result()`` gives the token sampled for each chunk, in
    order (-1 where its ``draw`` was None), or raises the step's error."""

    def __init__(self, pending: Pending, n_chunks: int, sampled: list[int]) -> None:
        self._pending, self._n, self._sampled = pending, n_chunks, sampled

    def result(self) -> list[int]:
        (out,) = self._pending.result()
        tokens_out = [-1] * self._n
        for row, i in enumerate(self._sampled):
            tokens_out[i] = int(out[row])
        return tokens_out
