"""What every executor (numpy, torch) shares: handle bookkeeping and validation of every
request, done here once, so the executors only implement storage and op execution and
the host daemon serving an untrusted guest inherits the same checks. Memory charges are
``apir.backends.accounting``'s.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import ApirError
from ..graph import OPS, DType, Graph, Node, Op, T
from ..graph.dtypes import NUMPY_DTYPES
from ..graph.ops import fmt_shape
from .accounting import FEED_MAX_BYTES, PICKS, Ledger, Scratch
from .base import (
    ALIGNMENT,
    NO_LIMITS,
    Backend,
    BackendError,
    BufferPurpose,
    Feed,
    Limits,
    Pending,
    QuotaError,
)

ADOPT_CHUNK = 8 << 20  # a shared mapping is copied to a device in pieces of this size


@dataclass
class Buffer:
    size: int
    purpose: BufferPurpose
    storage: object  # executor-specific: bytearray, torch.Tensor, ...
    version: int = 0  # bumped on every write, so cached derived forms know to refresh
    read_only: bool = False  # a published model's weights (see adopt_buffer)
    lent: bool = False  # bytes the host holds once for every session: not charged to this one
    # a lent buffer's weights' dequantized forms, made by the host once for every session
    # (see apir.backends.forms): weight offset -> (its type, the executor's form), not
    # charged either
    forms: dict[int, object] = field(default_factory=dict)


@dataclass
class Registered:
    graph: Graph
    program: object  # executor-specific compiled form
    scratch: Scratch  # what one compute's intermediates take
    inputs: dict[str, tuple[tuple[int, ...], DType]] = field(default_factory=dict)
    # the Buffer objects its WEIGHT/STATE leaves were checked against: a handle freed and
    # minted again (maybe smaller) is a different buffer, and compute refuses it
    buffers: dict[int, Buffer] = field(default_factory=dict)
    states: frozenset[int] = frozenset()  # handles of the buffers its STATE leaves are in
    in_place: frozenset[str] = frozenset()  # see Executor.inputs_read_in_place
    # the executor-native outputs of the last compute, for ``feed`` (None: none or it failed)
    last_outputs: list | None = None


class Executor(Backend):
    """A backend that executes graphs itself (see the module's docstring)."""

    def __init__(self, limits: Limits = NO_LIMITS) -> None:
        self.limits = limits
        self.ledger = Ledger(limits)
        self._buffers: dict[int, Buffer] = {}
        self._graphs: dict[int, Registered] = {}
        self._ids = itertools.count(1)
        self.closed = False
        self._lends = True  # computes on a shared mapping in place (see adopt_buffer)
        # executor forms of WEIGHT leaves (dequantized, or several concatenated), keyed by
        # the leaves' (handle, offset, dtype, shape): (their buffers' versions, the form)
        self._weights: dict[tuple, tuple[tuple[int, ...], object]] = {}

    @property
    def peak_bytes(self) -> int:
        """The most bytes of buffers this executor has held at once."""
        return self.ledger.peak

    # ------------------------------------------------------------ devices
    def supports(self, op: Op, dtypes: Sequence[DType] = ()) -> bool:
        """Whether ``op`` runs here on inputs of ``dtypes`` (every op in the table does)."""
        return OPS[op].quantized or not any(DType(d).is_quantized for d in dtypes)

    # ------------------------------------------------------------ buffers
    def alloc_buffer(
        self, size: int, purpose: BufferPurpose = BufferPurpose.COMPUTE, handle: int | None = None
    ) -> int:
        """A zeroed buffer of ``size`` bytes. ``handle`` lets a remote guest mint the id."""
        self._check_open()
        if not isinstance(size, int) or size <= 0:
            raise BackendError(f"buffer size must be a positive integer, got {size!r}")
        try:
            purpose = BufferPurpose(purpose)
        except ValueError:
            raise BackendError(f"unknown buffer purpose {purpose!r}") from None
        handle = self._new_handle(handle, self._buffers)
        self.ledger.check_buffer(size)
        try:
            storage = self._alloc(size)
        except (MemoryError, RuntimeError) as e:
            raise QuotaError(f"the host cannot allocate {size} bytes for this session: its OS memory "
                             "limit (set from --max-memory) or the device's memory is exhausted "
                             f"({str(e).splitlines()[0]})") from None
        self._buffers[handle] = Buffer(size, purpose, storage)
        self.ledger.add_buffer(size)
        return handle

    def _new_handle(self, handle: int | None, table: dict) -> int:
        live = len(self._buffers) + len(self._graphs)
        if self.limits.max_handles and live >= self.limits.max_handles:
            raise QuotaError(f"too many live handles ({live}); free buffers or graphs first")
        if handle is None:
            return next(self._ids)
        if not isinstance(handle, int) or not 0 < handle < 1 << 31:
            raise BackendError(f"handle {handle!r} must be an integer in [1, 2^31)")
        if handle in table:
            raise BackendError(f"handle {handle} is already in use")
        return handle

    def adopt_buffer(self, handle: int, data: memoryview, forms: memoryview | None = None) -> None:
        """Give ``handle`` to ``data``, a published model's weights shared by every session
        that uses it (a read-only mapping): writes and STATE leaves on it are refused. An
        executor that computes on the mapping itself charges this session nothing (the host
        counts it once) and freeing it only forgets it; one that needs its own copy of it
        (a GPU's) makes and charges it like an upload. ``forms``: the weights' dequantized
        forms, shared the same way (``apir.backends.forms``), which such an executor reads
        instead of making its own."""
        self._check_open()
        if self._lends:
            handle = self._new_handle(handle, self._buffers)
            self._buffers[handle] = Buffer(len(data), BufferPurpose.WEIGHTS, self._share(data),
                                           read_only=True, lent=True,
                                           forms=self._shared_forms(forms) if forms is not None else {})
        else:
            handle = self.alloc_buffer(len(data), BufferPurpose.WEIGHTS, handle)
            buf = self._buffers[handle]
            for start in range(0, len(data), ADOPT_CHUNK):  # a read-only piece is copied once more
                self._write(buf, start, np.frombuffer(data[start : start + ADOPT_CHUNK], np.uint8))
            buf.read_only = True

    def adopt_device_buffer(self, handle: int, weights: object, packed: Mapping[int, tuple[int, int, int, int]]) -> None:
        """Give ``handle`` to ``weights``, a published model's copy on this executor's device
        that another process holds for every session (``apir.host.holder``): computed on in
        place, charged to no session, read-only (writes and STATE leaves refused, as for
        ``adopt_buffer``). ``packed``: the quantized weights already packed in it, offset ->
        (ggml type, n, k, bytes). An executor without such a device refuses it."""
        raise BackendError("this host's executor cannot compute on a device copy of shared weights")

    def free_buffer(self, handle: int) -> None:
        buf = self._buffer(handle)
        del self._buffers[handle]
        if not buf.lent:
            self.ledger.free_buffer(handle, buf.size)
        self._release(buf)

    def _writable(self, handle: int) -> Buffer:
        buf = self._buffer(handle)
        if buf.read_only:
            raise BackendError(f"buffer {handle} holds a published model's shared weights, which "
                               "are read-only")
        return buf

    def clear_buffer(self, handle: int, value: int = 0) -> None:
        buf = self._writable(handle)
        if not 0 <= value <= 255:
            raise BackendError(f"clear value must be a byte, got {value}")
        self._fill(buf, value)
        buf.version += 1

    def buffer_size(self, handle: int) -> int:
        return self._buffer(handle).size

    def allocated_bytes(self) -> int:
        """Bytes of live buffers."""
        return self.ledger.buffers

    def memory(self) -> tuple[int, int]:
        """(held, peak) bytes, what ``host status`` and the bench report: live buffers plus
        the weight forms made from them (the dequantized cache), and the buffers' peak plus
        those forms."""
        forms = sum(self.ledger.forms.values())
        return self.ledger.buffers + forms, self.ledger.peak + forms

    # ------------------------------------------------------------ tensor bytes
    def set_tensor(self, handle: int, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else None
        raw = np.frombuffer(view, np.uint8) if view is not None else data.reshape(-1).view(np.uint8)
        buf = self._writable(handle)
        self._check_range(handle, buf, offset, raw.nbytes)
        self._write(buf, offset, raw)
        buf.version += 1

    def get_tensor(self, handle: int, offset: int, size: int) -> bytes:
        buf = self._buffer(handle)
        self._check_range(handle, buf, offset, size)
        self.ledger.check(2 * size, f"reading {size} bytes")  # the copy read, then its reply
        return self._read(buf, offset, size)

    def copy_tensor(self, src: int, src_offset: int, dst: int, dst_offset: int, size: int) -> None:
        source, target = self._buffer(src), self._writable(dst)
        self._check_range(src, source, src_offset, size)
        self._check_range(dst, target, dst_offset, size)
        self._copy(source, src_offset, target, dst_offset, size)
        target.version += 1

    def _copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, size: int) -> None:
        """Bytes from one buffer to another, both ranges checked (an executor whose buffers
        live on a device copies there, without the round trip through host memory)."""
        self.ledger.check(2 * size, f"copying {size} bytes")  # the bytes read, then written
        self._write(dst, dst_offset, np.frombuffer(self._read(src, src_offset, size), np.uint8))

    # ------------------------------------------------------------ graphs
    def register_graph(self, graph: Graph, gid: int | None = None) -> int:
        """Validate ``graph`` against the op table and this backend's buffers; compile it once."""
        self._check_open()
        if len(graph.nodes) > self.limits.max_graph_nodes:
            raise QuotaError(f"graph of {len(graph.nodes)} nodes exceeds the limit of {self.limits.max_graph_nodes}")
        graph.validate(self.limits.max_graph_nodes)
        used: dict[int, Buffer] = {}
        for nid, node in enumerate(graph.nodes):
            if node.op in (Op.WEIGHT, Op.STATE):
                handle, offset = node.attrs
                what = node.describe(nid)
                if handle not in self._buffers:
                    raise BackendError(f"{what} refers to unknown buffer {handle}")
                if offset % ALIGNMENT:
                    raise BackendError(f"{what}: offset {offset} is not {ALIGNMENT}-byte aligned")
                self._check_range(handle, self._buffers[handle], offset, node.dtype.nbytes(node.shape))
                if node.op is Op.STATE and self._buffers[handle].read_only:
                    raise BackendError(f"{what}: buffer {handle} holds shared weights, which are "
                                       "read-only; state lives in a buffer of the session's own")
                used[handle] = self._buffers[handle]
        gid = self._new_handle(gid, self._graphs)
        charge = self.ledger.graph_charge(graph)
        inputs = {name: (n.shape, n.dtype) for name, n in graph.inputs().items()}
        try:
            program = self._compile(graph)  # the weight forms it makes are charged as they are made
        except QuotaError as e:
            raise QuotaError(f"registering a graph of {len(graph.nodes)} nodes: {e}") from None
        self.ledger.add_graph(charge)
        states = frozenset(n.attrs[0] for n in graph.nodes if n.op is Op.STATE)
        self._graphs[gid] = Registered(graph, program, Scratch.of(graph), inputs, used, states,
                                       _computed_only(graph))
        return gid

    def inputs_read_in_place(self, gid: int) -> frozenset[str]:
        """The inputs of graph ``gid`` that the executor only computes with (floats): it may
        read them where they arrived, in memory the guest shares, because a guest that
        changes them during the step changes nothing but its own results. The others (I32
        indices, which are bounds-checked before use, and SAMPLE's parameters, which the
        host branches on) must be private copies: checked and used as the same bytes."""
        return self._graph(gid).in_place

    def use_host_memory(self, view: memoryview) -> None:
        """``view`` (a session's shared arena) is where step inputs and outputs will live:
        an executor whose device copies faster from page-locked memory may lock it."""

    def free_graph(self, gid: int) -> None:
        reg = self._graph(gid)
        del self._graphs[gid]
        self.ledger.free_graph(reg.graph)

    def compute(self, gid: int, inputs: Mapping[str, np.ndarray], feed: Feed | None = None) -> list[np.ndarray]:
        """Bind ``inputs`` by name (and ``feed``, see Backend.compute) and run graph ``gid``;
        returns its outputs as numpy arrays."""
        reg, outputs = self._launch(gid, inputs, feed or {})
        return self._host_outputs(reg, outputs)

    def submit(self, gid: int, inputs: Mapping[str, np.ndarray], feed: Feed | None = None,
               out: Sequence[np.ndarray] | None = None) -> Pending:
        """``compute`` queued. ``out``: where the outputs should go (one writeable array per
        graph output, its dtype and shape: the session's views of the reply's place in the
        shared arena). An executor that copies its outputs back at once writes them there,
        saving a copy; ``result()`` then returns those arrays. Any other output (a size off
        the layout, outputs copied back behind the step) comes back as its own array."""
        try:
            reg, outputs = self._launch(gid, inputs, feed or {})
            return self._pending(reg, outputs, out)
        except ApirError as e:
            return Pending(error=e)

    def _launch(self, gid: int, inputs: Mapping[str, np.ndarray], feed: Feed) -> tuple[Registered, list]:
        """Check everything, then start the run; returns its executor-native outputs."""
        reg = self._graph(gid)
        last, reg.last_outputs = reg.last_outputs, None  # any failure leaves nothing to feed from
        bounds = self._feed_bounds(reg, gid, feed)
        _check_names(reg, inputs, feed)
        fed = self._fed(gid, feed, last)
        bound, n_tokens = self._bind(reg, inputs, fed)
        for handle, buf in reg.buffers.items():
            if self._buffers.get(handle) is not buf:
                raise BackendError(f"graph {gid} uses buffer {handle}, which was freed")
        if self.limits.max_memory:
            t = n_tokens or 1
            need = reg.scratch.nbytes(t)
            self.ledger.check(need, f"computing graph {gid} with T={t} (about {need} bytes of "
                                    "intermediates and outputs)")
        try:
            outputs = self._run(reg, bound, bounds)
        except IndexError as e:
            raise BackendError(f"graph {gid}: {e}") from None
        for handle in reg.states:  # written by the run: cached forms of them are stale
            self._buffers[handle].version += 1
        reg.last_outputs = _kept_for_feeding(reg.graph, outputs)
        return reg, outputs

    def synchronize(self) -> None:
        """Wait for queued work. Executors here run synchronously, so this only checks state."""
        self._check_open()

    def close(self) -> None:
        for handle in list(self._buffers):
            self.free_buffer(handle)
        self._graphs.clear()
        self.ledger.clear()
        self.closed = True

    # ------------------------------------------------------------ checks
    def _check_open(self) -> None:
        if self.closed:
            raise BackendError("backend is closed")

    def _buffer(self, handle: int) -> Buffer:
        return self._lookup(self._buffers, handle, "buffer handle")

    def _graph(self, gid: int) -> Registered:
        return self._lookup(self._graphs, gid, "graph id")

    def _lookup(self, table: dict, key: int, what: str):
        self._check_open()
        if not isinstance(key, int) or key not in table:
            raise BackendError(f"unknown {what} {key!r}")
        return table[key]

    @staticmethod
    def _check_range(handle: int, buf: Buffer, offset: int, size: int) -> None:
        if not (isinstance(offset, int) and isinstance(size, int)):
            raise BackendError("offset and size must be integers")
        if offset < 0 or size < 0 or offset + size > buf.size:
            raise BackendError(
                f"bytes [{offset}, {offset + size}) lie outside buffer {handle} of {buf.size} bytes"
            )

    @staticmethod
    def _feed_bounds(reg: Registered, gid: int, feed: Feed) -> dict[str, int | None]:
        """Check what ``feed`` asks for; returns per fed input an exclusive upper bound its
        values are known to respect (an ARGMAX or SAMPLE output lies in [0, vocabulary)),
        else None."""
        nodes, bounds = reg.graph.nodes, {}
        for name, k in feed.items():
            if name not in reg.inputs:
                raise BackendError(f"feed names {name!r}, which is not an input of graph {gid}")
            if not (isinstance(k, int) and 0 <= k < len(reg.graph.outputs)):
                raise BackendError(f"feed of {name!r}: graph {gid} has no output {k!r}")
            node, dtype = nodes[reg.graph.outputs[k]], reg.inputs[name][1]
            if dtype not in (DType.I32, DType.F32) or node.dtype is not dtype:
                raise BackendError(f"input {name!r} ({dtype.name}) cannot be fed from output {k} "
                                   f"({node.dtype.name}): only I32 and F32 inputs, of the same dtype")
            if node.op not in PICKS:
                raise BackendError(f"feed of {name!r}: output {k} of graph {gid} is not a token pick "
                                   "(ARGMAX or SAMPLE): only those are kept for feeding")
            # a pick's bound is its input's last dimension, when that is a known size (not
            # T, not a 0-d input): otherwise the values are checked like any input's
            shape = nodes[node.inputs[0]].shape
            bounds[name] = shape[-1] if shape and shape[-1] > 0 else None
        return bounds

    @staticmethod
    def _fed(gid: int, feed: Feed, last: list | None) -> dict[str, object]:
        """The values ``feed`` binds: outputs of the previous compute (``last``), kept on
        the device in executor-native form."""
        if not feed:
            return {}
        if last is None:
            raise BackendError(f"graph {gid} has no outputs to feed from: it has not been computed "
                               "yet, or its last compute failed")
        values = {name: last[k] for name, k in feed.items()}
        for name, k in feed.items():
            if values[name] is None:
                raise BackendError(f"feed of {name!r}: output {k} of graph {gid} is past the "
                                   f"{FEED_MAX_BYTES} bytes of picks kept for feeding")
        return values

    @staticmethod
    def _bind(reg: Registered, inputs: Mapping[str, np.ndarray],
              fed: Mapping[str, object]) -> tuple[dict[str, object], int | None]:
        """Check every input's dtype and shape (names: ``_check_names``); work out T.
        Returns the values (numpy arrays; fed ones executor-native) and T."""
        n_tokens = None
        out = {}
        for name, (shape, dtype) in reg.inputs.items():
            arr = fed[name] if name in fed else np.asarray(inputs[name])
            if name not in fed and arr.dtype != NUMPY_DTYPES[dtype]:
                raise BackendError(f"input {name!r} must be {dtype.name}, got numpy {arr.dtype}")
            if len(arr.shape) != len(shape):
                raise BackendError(f"input {name!r} must have shape {fmt_shape(shape)}, got {arr.shape}")
            for want, got in zip(shape, arr.shape):
                if want == T:
                    n_tokens = got if n_tokens is None else n_tokens
                    if got != n_tokens or got <= 0:
                        raise BackendError(f"input {name!r}: token dim {got} disagrees with T={n_tokens}")
                elif want != got:
                    raise BackendError(f"input {name!r} must have shape {fmt_shape(shape)}, got {arr.shape}")
            out[name] = arr if name in fed else np.ascontiguousarray(arr)
        return out, n_tokens

    # ------------------------------------------------------------ executor hooks
    @abstractmethod
    def _alloc(self, size: int) -> object: ...

    def _release(self, buf: Buffer) -> None:
        buf.storage = None
        self._weights = {k: v for k, v in self._weights.items() if all(m[0] in self._buffers for m in k)}

    def _cached(self, nodes: Sequence[Node], make: Callable[[], object], form: str = "",
                nbytes: int | None = None):
        """The executor's form of WEIGHT leaves ``nodes``: ``make()``, made again after a
        write to one of their buffers. The one place forms are made, so the one place they
        are charged: checked against the limit before ``make`` runs. ``form`` names a kind
        other than the dense one (which the host's shared forms are), ``nbytes`` its size."""
        key = tuple((*n.attrs, n.dtype, n.shape, form) for n in nodes)
        versions = tuple(self._buffers[n.attrs[0]].version for n in nodes)
        cached = self._weights.get(key)
        if cached is None or cached[0] != versions:
            shared = None if form else self._shared_form(nodes)
            if shared is not None:  # made by the host once for every session: not this one's to charge
                cached = self._weights[key] = (versions, shared)
            else:
                size = self.ledger.check_form(key, nodes, nbytes)
                cached = self._weights[key] = (versions, make())
                self.ledger.add_form(key, size)
        return cached[1]

    def _share(self, data: memoryview) -> object:
        """A lent buffer's storage (see adopt_buffer): ``data`` itself, as the executor reads it."""
        return data

    def _shared_forms(self, forms: memoryview) -> dict[int, object]:
        """A forms mapping (see adopt_buffer) as the executor's forms by weight offset; none
        where its forms are not those of the mapping (this one dequantizes its own way)."""
        return {}

    def _shared_form(self, nodes: Sequence[Node]) -> object | None:
        """The shared form of WEIGHT leaves ``nodes`` (see _shared_forms), or None."""
        return None

    @abstractmethod
    def _fill(self, buf: Buffer, value: int) -> None: ...

    @abstractmethod
    def _write(self, buf: Buffer, offset: int, data: np.ndarray) -> None: ...

    @abstractmethod
    def _read(self, buf: Buffer, offset: int, size: int) -> bytes: ...

    @abstractmethod
    def _compile(self, graph: Graph) -> object: ...

    @abstractmethod
    def _run(self, reg: Registered, inputs: dict[str, object], bounds: dict[str, int | None]) -> list:
        """Execute; returns the outputs in executor-native form. ``bounds``: see ``_fed``."""

    @abstractmethod
    def _host_outputs(self, reg: Registered, outputs: list,
                      out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """``_run``'s outputs as numpy arrays of their nodes' dtypes, owned by the caller;
        written into ``out`` where it is given and fits (see ``submit``)."""

    def _pending(self, reg: Registered, outputs: list, out: Sequence[np.ndarray] | None = None) -> Pending:
        """``submit``'s result: an executor whose device runs ahead of the host starts
        copying the outputs back here and lets ``result()`` wait for them."""
        return Pending(self._host_outputs(reg, outputs, out))


def _computed_only(graph: Graph) -> frozenset[str]:
    """The float inputs that no SAMPLE reads as its parameters (Executor.inputs_read_in_place)."""
    nodes = graph.nodes
    params = {n.inputs[1] for n in nodes if n.op is Op.SAMPLE}
    return frozenset(n.attrs[0] for nid, n in enumerate(nodes)
                     if n.op is Op.INPUT and n.dtype in (DType.F32, DType.F16, DType.BF16) and nid not in params)


def fits(dest: np.ndarray | None, dtype: np.dtype, size: int) -> bool:
    """Whether an output of ``dtype`` and ``size`` elements may be written into ``dest``."""
    return (dest is not None and dest.dtype == dtype and dest.size == size and dest.flags.writeable
            and dest.flags.c_contiguous)


def check_indices(index: Sequence[tuple[int, int, str]], args: Sequence) -> None:
    """``OpSpec.index`` on a kernel's operands (numpy arrays or torch tensors, where reading
    them syncs): index values must lie in [0, the indexed operand's first dim)."""
    for i, target, what in index:
        ids, limit = args[i], args[target].shape[0]
        if ids.reshape(-1).shape[0] and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            raise BackendError(f"{what} index out of range: values must lie in [0, {limit})")


def check_positions(pos, n: int) -> None:
    """ATTENTION_SEQ's positions (a numpy array or a CPU tensor) must lie in [0, n), a
    slot's rows. A device's kernel reads no row by position (it masks), so none checks there."""
    if len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= n):
        raise BackendError(f"ATTENTION_SEQ position index out of range: values must lie in [0, {n})")


def _check_names(reg: Registered, inputs: Mapping[str, object], fed: Mapping[str, object]) -> None:
    """Every input of the graph either sent or fed, nothing else."""
    missing = set(reg.inputs) - set(inputs) - set(fed)
    extra = (set(inputs) - set(reg.inputs)) | (set(inputs) & set(fed))
    if missing or extra:
        raise BackendError(
            f"graph inputs are {sorted(reg.inputs)}; missing {sorted(missing)}, unexpected "
            f"{sorted(extra)} (an input is either sent or fed, not both)"
        )


def _kept_for_feeding(graph: Graph, outputs: list) -> list:
    """The outputs a next compute may feed from: the token picks, in order, while their
    bytes fit FEED_MAX_BYTES (what registration charged); None for the rest."""
    kept, room = [], FEED_MAX_BYTES
    for o, out in zip(graph.outputs, outputs):
        keep = graph.nodes[o].op in PICKS and out.nbytes <= room
        room -= out.nbytes if keep else 0
        kept.append(out if keep else None)
    return kept
