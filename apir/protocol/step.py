"""The fixed layout of a ``Step``: a compute whose tensors travel as bare bytes.

Registering a graph already fixed everything about its inputs and outputs but the token
count T: their names, order, dtypes and shapes. So a Step carries T and the bytes only,
and its ``Data`` reply the outputs' bytes only:

    payload := tensor 0, zero padding, tensor 1, zero padding, ..., tensor n-1

Inputs go in the graph's input order (the order of its INPUT nodes), less those the Step
feeds (the host binds them to the previous compute's outputs), outputs in its output
order; each tensor is C-contiguous with the shape the graph gives it (T substituted) and
starts at a multiple of ``ALIGN`` bytes, so every view of the payload is aligned for its
dtype. Both ends derive the layout from the same registered Graph. The
receiver checks the payload's size against the layout before slicing it; the host's
executor then checks the inputs as for any compute. Inputs or outputs off the layout are
refused with a ``LayoutError`` that says how (there is no other way to compute).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

import numpy as np
from numpy.typing import ArrayLike

from ..errors import ApirError
from ..graph import DType, Graph, T
from ..graph.dtypes import NUMPY_DTYPES
from ..graph.ops import fmt_shape
from .memcpy import copy_bytes
from .messages import ALIGN
from .wire import ProtocolError

MAX_TOKENS = 1 << 31  # T beyond this is refused before any size is worked out
_CACHED = 16  # placements remembered per layout (decode uses one T, prefill one or two)


class LayoutError(ApirError):
    """A compute that is not the form its graph was registered with (inputs, feed, or the
    executor's outputs); the message says what differs."""


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]  # may hold T
    kind: DType  # what ``dtype`` holds (BF16 travels as uint16)


class Sent(NamedTuple):
    """The inputs a Step carries, in payload order, for one set of fed inputs."""

    slots: tuple[Slot, ...]
    names: list[str]
    token_at: tuple[int, int] | None  # (index in slots, axis) where T shows first


@dataclass(frozen=True)
class Placement:
    """Where each tensor lies in the payload for one T."""

    places: tuple[tuple[int, tuple[int, ...]], ...]  # (offset, shape) per slot
    size: int
    # per slot, what slicing it out of the payload takes: (dtype, element count, offset,
    # the shape to give the 1-d slice, or None when it has it already)
    cuts: tuple[tuple[np.dtype, int, int, tuple[int, ...] | None], ...]


class Packed(NamedTuple):
    """A Step's inputs checked against its layout, not copied yet: ``bytes()`` builds the
    payload (inline), ``into(dest)`` writes it where it travels (the arena), one copy."""

    n_tokens: int
    arrays: list[np.ndarray]
    place: Placement

    @property
    def size(self) -> int:
        return self.place.size

    def bytes(self) -> bytes:
        return pack(self.arrays, self.place)

    def into(self, dest: memoryview) -> None:
        pack_into(self.arrays, self.place, dest)


class StepLayout:
    """The inputs and outputs of one registered graph, and how they pack for a given T.

    ``fed``, where a method takes it, is the sorted tuple of the indices of the inputs the
    host binds itself (a Step's ``feed``): they take no room in the payload."""

    def __init__(self, inputs: tuple[Slot, ...], outputs: tuple[Slot, ...]) -> None:
        self.inputs, self.outputs = inputs, outputs
        self.names = [slot.name for slot in inputs]
        self.has_tokens = any(T in s.shape for s in inputs)
        self.last_tokens = 0  # T of the last inputs packed (a feed may carry it on; guest)
        self._placements: dict[tuple[bool, int, tuple[int, ...]], Placement] = {}
        self._sent: dict[tuple[int, ...], Sent] = {}

    @classmethod
    def of(cls, graph: Graph) -> StepLayout:
        """The layout of a validated graph (whose inputs and outputs all have numpy dtypes)."""
        inputs = tuple((name, node) for name, node in graph.inputs().items())
        outputs = tuple((f"out{i}", graph.nodes[o]) for i, o in enumerate(graph.outputs))
        # A 0-d output comes back (1,): the host's executor returns it so, and remote
        # outputs are the local ones, shape included.
        return cls(tuple(Slot(name, NUMPY_DTYPES[node.dtype], node.shape, node.dtype) for name, node in inputs),
                   tuple(Slot(name, NUMPY_DTYPES[node.dtype], node.shape or (1,), node.dtype)
                         for name, node in outputs))

    def sent(self, fed: tuple[int, ...] = ()) -> Sent:
        """The inputs a Step carries when those at ``fed`` are fed."""
        sent = self._sent.get(fed)
        if sent is None:
            if len(self._sent) >= _CACHED:
                self._sent.clear()
            slots = tuple(slot for i, slot in enumerate(self.inputs) if i not in fed)
            # where T shows first: (index among the sent, axis); None when no sent input has it
            token_at = next(((i, s.shape.index(T)) for i, s in enumerate(slots) if T in s.shape), None)
            sent = self._sent[fed] = Sent(slots, [slot.name for slot in slots], token_at)
        return sent

    def placement(self, outputs: bool, n_tokens: int, fed: tuple[int, ...] = ()) -> Placement:
        key = (outputs, n_tokens, fed)
        place = self._placements.get(key)
        if place is None:
            if len(self._placements) >= _CACHED:
                self._placements.clear()
            place = self._placements[key] = _place(self.outputs if outputs else self.sent(fed).slots, n_tokens)
        return place

    def check_tokens(self, n_tokens: int) -> None:
        """Refuse a T this layout cannot take (before any size is worked out from it)."""
        if not (0 < n_tokens <= MAX_TOKENS if self.has_tokens else n_tokens == 0):
            want = f"1..{MAX_TOKENS}" if self.has_tokens else "0 (the graph has no token axis)"
            raise ProtocolError(f"step with T={n_tokens}: T must be {want}")

    # ------------------------------------------------------------ guest
    def feed_pairs(self, feed: Mapping[str, int], gid: int) -> tuple[list[tuple[int, int]], tuple[int, ...]]:
        """A feed by name as a Step carries it: ((input index, output index) pairs, the fed
        inputs' indices, sorted)."""
        if not feed:
            return [], ()
        names = self.names
        for name, k in feed.items():
            if name not in names:
                raise LayoutError(f"feed names {name!r}, which is not an input of graph {gid}")
            if not (isinstance(k, int) and 0 <= k < len(self.outputs)):
                raise LayoutError(f"feed of {name!r}: graph {gid} has no output {k!r}")
        pairs = [(names.index(name), k) for name, k in feed.items()]
        return pairs, tuple(sorted(i for i, _ in pairs))

    def pack_inputs(self, inputs: Mapping[str, ArrayLike], fed: tuple[int, ...] = (),
                    pairs: Sequence[tuple[int, int]] = ()) -> Packed:
        """The payload-to-be of ``inputs``, the graph's unfed inputs with their registered
        dtypes and shapes (``pairs``: the feed, from ``feed_pairs``); a LayoutError says
        what differs."""
        sent = self.sent(fed)
        if len(inputs) != len(sent.names):
            return self._repack(inputs, fed, pairs)
        arrays = [inputs.get(name) for name in sent.names]
        if sent.token_at is not None:  # T is what the first input with a token axis says
            i, axis = sent.token_at
            a = arrays[i]
            if not isinstance(a, np.ndarray) or a.ndim <= axis or a.shape[axis] == 0:
                return self._repack(inputs, fed, pairs)
            n_tokens = a.shape[axis]
        else:
            n_tokens = self._fed_tokens(pairs) if self.has_tokens else 0
        place = self.placement(False, n_tokens, fed)
        for a, slot, (_, shape) in zip(arrays, sent.slots, place.places):
            if not isinstance(a, np.ndarray) or a.dtype != slot.dtype or a.shape != shape:
                return self._repack(inputs, fed, pairs)
        self.last_tokens = n_tokens
        return Packed(n_tokens, cast("list[np.ndarray]", arrays), place)  # each checked above

    def _fed_tokens(self, pairs: Sequence[tuple[int, int]]) -> int:
        """T when it shows only in fed inputs: that of the output feeding the first of them
        in the previous compute (the last T packed, or a fixed length); 1 before any."""
        i, k = next((i, k) for i, k in sorted(pairs) if T in self.inputs[i].shape)
        axis, out = self.inputs[i].shape.index(T), self.outputs[k].shape
        n = out[axis] if axis < len(out) else T
        return max(self.last_tokens, 1) if n == T else n

    def _repack(self, inputs: Mapping[str, ArrayLike], fed: tuple[int, ...],
                pairs: Sequence[tuple[int, int]]) -> Packed:
        """Inputs off the layout: those that only are not numpy arrays yet (lists, scalars)
        pack as arrays, as the local executor takes them; otherwise a LayoutError says
        what differs, in the local executor's words for the same mistake."""
        sent = self.sent(fed)
        missing, extra = sorted(set(sent.names) - set(inputs)), sorted(set(inputs) - set(sent.names))
        if missing or extra:
            raise LayoutError(f"graph inputs are {sorted(self.names)}; missing {missing}, unexpected "
                              f"{extra} (an input is either sent or fed, not both)")
        arrays = {name: a for name, a in inputs.items() if isinstance(a, np.ndarray)}
        if len(arrays) < len(inputs):
            return self.pack_inputs({name: np.asarray(a) for name, a in inputs.items()}, fed, pairs)
        n_tokens = None
        for slot in sent.slots:
            a = arrays[slot.name]
            if a.dtype != slot.dtype:
                raise LayoutError(f"input {slot.name!r} must be {slot.kind.name}, got numpy {a.dtype}")
            if a.ndim != len(slot.shape):
                raise LayoutError(f"input {slot.name!r} must have shape {fmt_shape(slot.shape)}, got {a.shape}")
            for want, got in zip(slot.shape, a.shape):
                if want == T:
                    n_tokens = got if n_tokens is None else n_tokens
                    if got != n_tokens or got <= 0:
                        raise LayoutError(f"input {slot.name!r}: token dim {got} disagrees with T={n_tokens}")
                elif want != got:
                    raise LayoutError(f"input {slot.name!r} must have shape {fmt_shape(slot.shape)}, "
                                      f"got {a.shape}")
        raise LayoutError(f"inputs off graph layout {[s.name for s in sent.slots]}")

    def unpack_outputs(self, payload: bytearray | memoryview | np.ndarray, n_tokens: int) -> list[np.ndarray]:
        """The outputs of a ``Data`` reply, as views of ``payload`` (which the caller owns:
        private and writeable, so the arrays are the caller's to keep and change)."""
        return _views(self.placement(True, n_tokens), payload, "outputs")

    # ------------------------------------------------------------ host
    def unpack_inputs(self, payload: bytearray | memoryview | np.ndarray, n_tokens: int,
                      fed: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
        """The sent inputs of a Step, as views of ``payload`` (which the caller owns)."""
        self.check_tokens(n_tokens)
        return dict(zip(self.sent(fed).names, _views(self.placement(False, n_tokens, fed), payload, "inputs")))

    def output_placement(self, outputs: Sequence[np.ndarray], n_tokens: int) -> Placement:
        """Where ``outputs`` go in a Data reply. Only their bytes travel, so each must have
        its slot's dtype and element count; a LayoutError names the first that does not."""
        place = self.placement(True, n_tokens)
        if len(outputs) != len(self.outputs):
            raise LayoutError(f"the executor returned {len(outputs)} outputs, the graph has {len(self.outputs)}")
        for slot, a, (_, shape), cut in zip(self.outputs, outputs, place.places, place.cuts):
            if a.dtype != slot.dtype or (a.shape != shape and a.size != cut[1]):
                raise LayoutError(f"output {slot.name}: the executor returned {a.dtype} {a.shape}, the "
                                  f"graph's layout takes {slot.dtype} {shape}")
        return place


def pack(arrays: Sequence[np.ndarray], place: Placement) -> bytes:
    """The payload: each array's bytes (C order) at its offset, zeros between."""
    parts, end = [], 0
    for a, (offset, _) in zip(arrays, place.places):
        if offset > end:
            parts.append(bytes(offset - end))
        parts.append(a.tobytes())
        end = offset + a.nbytes
    return b"".join(parts)


def pack_into(arrays: Sequence[np.ndarray], place: Placement, dest: memoryview) -> None:
    """The payload written into ``dest`` (``place.size`` bytes): each array copied once."""
    out, end = np.frombuffer(dest, np.uint8, place.size), 0
    for a, (offset, _) in zip(arrays, place.places):
        out[end:offset] = 0
        if a.flags.c_contiguous:  # one byte copy, split across threads when large
            copy_bytes(out[offset : offset + a.nbytes], a.reshape(-1).view(np.uint8))
        else:
            np.copyto(out[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape), a)
        end = offset + a.nbytes
    out[end:] = 0


def private_copy(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A writeable copy of ``data``'s bytes that nobody else can change (a payload read out
    of shared memory before anything checks or uses it). numpy's copy, not bytearray's:
    for a 200 MB payload 24 ms against 90 ms on a 2-core machine (page faults included)."""
    src = np.frombuffer(data, np.uint8)
    out = np.empty(src.size, np.uint8)
    copy_bytes(out, src)
    return out


def _place(slots: tuple[Slot, ...], n_tokens: int) -> Placement:
    places, cuts, offset = [], [], 0
    for slot in slots:
        shape = tuple(n_tokens if d == T else d for d in slot.shape)
        offset = -(-offset // ALIGN) * ALIGN
        count = _count(shape)
        places.append((offset, shape))
        cuts.append((slot.dtype, count, offset, None if shape == (count,) else shape))
        offset += slot.dtype.itemsize * count
    return Placement(tuple(places), offset, tuple(cuts))


def _views(place: Placement, payload: bytearray | memoryview | np.ndarray, what: str) -> list[np.ndarray]:
    if len(payload) != place.size:
        raise ProtocolError(f"step {what} of {len(payload)} bytes; the graph's layout takes {place.size}")
    views = []
    for dtype, count, offset, shape in place.cuts:
        a = np.frombuffer(payload, dtype, count, offset)
        views.append(a if shape is None else a.reshape(shape))
    return views


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
