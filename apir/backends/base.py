"""The backend interface (DESIGN.md, "The backend API") and what every executor shares.

A backend owns buffers (byte ranges on its device, named by opaque integer handles),
moves bytes in and out of them, and runs registered graphs. ``Backend`` does all the
bookkeeping and validation here, once, so the numpy and torch executors only implement
storage and op execution, and a remote daemon inherits the same checks.
"""

from __future__ import annotations

import enum
import itertools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import ApirError
from ..graph import DType, Graph, GraphError, Op, T
from ..graph.dtypes import NUMPY_DTYPES
from ..graph.ops import fmt_shape

ALIGNMENT = 32  # tensor offsets inside a buffer; GGUF aligns tensor data the same way
# Host memory one registered graph node costs (decoded Node + compiled step; measured
# ~450 B on CPython 3.11): charged to the session's memory limit while the graph lives.
GRAPH_NODE_BYTES = 512
# Ops whose result aliases their (first) input instead of allocating: no scratch charged.
_ALIASING = (Op.RESHAPE, Op.PERMUTE, Op.TRANSPOSE, Op.VIEW, Op.SET_ROWS)


class BackendError(ApirError):
    """A request the backend refuses: bad handle, out-of-range bytes, bad inputs."""


class QuotaError(BackendError):
    """A request past one of the backend's limits (memory, handles, graph size)."""


@dataclass(frozen=True)
class Limits:
    """Caps an executor enforces; 0 means unlimited. The host sets them per session.

    ``max_memory`` covers everything a guest can make the executor hold, not only its
    buffers: dequantized weight copies and graph metadata while they live, and each
    compute's intermediates (checked before the compute runs). Otherwise a guest within
    its buffer quota could still make the host allocate without bound (many WEIGHT views
    of one buffer, a broadcast ADD of two small inputs, a long chain of ops).
    """

    max_memory: int = 0  # bytes: buffers + derived weights + graph metadata + scratch
    max_handles: int = 0  # live buffers + graphs
    max_graph_nodes: int = 1 << 16

    def __post_init__(self) -> None:
        if min(self.max_memory, self.max_handles) < 0 or self.max_graph_nodes <= 0:
            raise ValueError(f"bad limits {self}")


NO_LIMITS = Limits()


class BufferPurpose(enum.IntEnum):
    WEIGHTS = 0
    KV = 1
    COMPUTE = 2


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # e.g. "cpu", "cuda:0"
    kind: str  # "cpu" | "cuda" | "mps"
    description: str  # e.g. "NVIDIA H200" or the CPU model
    memory_free: int  # bytes, read fresh on every call
    memory_total: int
    capabilities: frozenset[str] = frozenset()


@dataclass
class Buffer:
    size: int
    purpose: BufferPurpose
    storage: object  # executor-specific: bytearray, torch.Tensor, ...
    version: int = 0  # bumped on every write, so cached derived forms know to refresh


@dataclass
class Registered:
    graph: Graph
    program: object  # executor-specific compiled form
    inputs: dict[str, tuple[tuple[int, ...], DType]] = field(default_factory=dict)
    # the Buffer objects its WEIGHT/STATE leaves were checked against: a handle freed and
    # minted again (maybe smaller) is a different buffer, and compute refuses it
    buffers: dict[int, Buffer] = field(default_factory=dict)
    # intermediate bytes of one compute as a polynomial in T: {power: bytes}, plus the
    # largest transient a single op needs (attention scores), same form
    scratch: dict[int, int] = field(default_factory=dict)
    transient: tuple[dict[int, int], ...] = ()
    # the executor-native outputs of the last compute, for ``feed`` (None: none or it failed)
    last_outputs: list | None = None


Feed = Mapping[str, int]  # input name -> index of the output of the graph's previous compute
FEED_MAX_BYTES = 64 << 10  # outputs kept on the device for feeding (tokens, not logits)


class Pending:
    """A submitted compute: ``result()`` gives its outputs, or raises its error."""

    def __init__(self, outputs: list[np.ndarray] | None = None, error: ApirError | None = None) -> None:
        self._outputs, self._error = outputs, error

    def result(self) -> list[np.ndarray]:
        if self._error is not None:
            raise self._error
        return self._outputs

    def ready(self) -> bool:
        """Whether ``result()`` would return (or raise) without waiting."""
        return True


class Backend(ABC):
    """The backend API every executor and the remote frontend implement.

    Handles (buffers, graphs) are small ints, never addresses. Tensor bytes live in buffers
    at offsets; quantized GGUF blocks travel as raw bytes with their dtype.
    """

    name: str = "abstract"

    @abstractmethod
    def device(self) -> DeviceInfo:
        """The device graphs execute on, with fresh memory figures."""

    def devices(self) -> list[DeviceInfo]:
        return [self.device()]

    @abstractmethod
    def supports(self, op: Op, dtypes: Sequence[DType] = ()) -> bool: ...

    @abstractmethod
    def alloc_buffer(self, size: int, purpose: BufferPurpose = BufferPurpose.COMPUTE) -> int: ...

    @abstractmethod
    def free_buffer(self, handle: int) -> None: ...

    @abstractmethod
    def clear_buffer(self, handle: int, value: int = 0) -> None: ...

    @abstractmethod
    def set_tensor(self, handle: int, offset: int, data: bytes | memoryview | np.ndarray) -> None: ...

    @abstractmethod
    def get_tensor(self, handle: int, offset: int, size: int) -> bytes: ...

    @abstractmethod
    def copy_tensor(self, src: int, src_offset: int, dst: int, dst_offset: int, size: int) -> None: ...

    @abstractmethod
    def register_graph(self, graph: Graph) -> int:
        """Validate and prepare ``graph`` once; returns its id for ``compute``."""

    @abstractmethod
    def free_graph(self, gid: int) -> None: ...

    @abstractmethod
    def compute(self, gid: int, inputs: Mapping[str, np.ndarray], feed: Feed | None = None) -> list[np.ndarray]:
        """Bind ``inputs`` by name and run graph ``gid``; returns its outputs.

        ``feed`` binds more inputs, on the device: ``{name: k}`` gives input ``name`` the
        value of output ``k`` of this graph's previous compute (I32 and F32 inputs only).
        A decode step fed its own last sampled token needs nothing from the caller first.
        """

    def submit(self, gid: int, inputs: Mapping[str, np.ndarray], feed: Feed | None = None) -> Pending:
        """``compute``, returning before it is done where the backend can (the remote one
        sends the request and does not wait; the local one on CUDA queues the step on the
        GPU). Computes run in submission order, so a ``feed`` refers to the compute
        submitted just before on this graph; errors surface at ``result()``."""
        try:
            return Pending(self.compute(gid, inputs, feed))
        except ApirError as e:
            return Pending(error=e)

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for queued work; errors of earlier requests surface here at the latest."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Executor(Backend):
    """A backend that executes graphs itself. Does all bookkeeping and validation here,
    once, so the numpy and torch executors only implement storage and ops, and the host
    daemon serving an untrusted guest inherits the same checks."""

    def __init__(self, limits: Limits = NO_LIMITS) -> None:
        self.limits = limits
        self._buffers: dict[int, Buffer] = {}
        self._graphs: dict[int, Registered] = {}
        self._ids = itertools.count(1)
        self.closed = False
        self.peak_bytes = 0
        # bytes charged besides buffers: dequantized weight forms by cache key
        # (handle, offset, dtype, shape), as the executors key their caches
        self._derived: dict[tuple, int] = {}
        # running totals, so accounting stays O(1) per request even with 65536 handles
        self._allocated = 0
        self._charged_extra = 0  # sum(self._derived.values()) + graph metadata bytes

    # ------------------------------------------------------------ devices
    def supports(self, op: Op, dtypes: Sequence[DType] = ()) -> bool:
        """Whether ``op`` runs here on inputs of ``dtypes`` (every op in the table does)."""
        quantized_ok = op in (Op.GET_ROWS, Op.MATMUL, Op.WEIGHT)
        return all(quantized_ok or not DType(d).is_quantized for d in dtypes)

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
        used = self.allocated_bytes()
        self._check_quota(size, f"allocating {size} bytes")
        try:
            storage = self._alloc(size)
        except (MemoryError, RuntimeError) as e:
            raise QuotaError(f"the device cannot allocate {size} bytes: {str(e).splitlines()[0]}") from None
        self._buffers[handle] = Buffer(size, purpose, storage)
        self._allocated += size
        self.peak_bytes = max(self.peak_bytes, used + size)
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

    def free_buffer(self, handle: int) -> None:
        buf = self._buffer(handle)
        del self._buffers[handle]
        self._allocated -= buf.size
        dropped = [k for k in self._derived if k[0] == handle]
        for k in dropped:
            self._charged_extra -= self._derived.pop(k)
        self._release(buf)

    def clear_buffer(self, handle: int, value: int = 0) -> None:
        buf = self._buffer(handle)
        if not 0 <= value <= 255:
            raise BackendError(f"clear value must be a byte, got {value}")
        self._fill(buf, value)
        buf.version += 1

    def buffer_size(self, handle: int) -> int:
        return self._buffer(handle).size

    def allocated_bytes(self) -> int:
        """Bytes of live buffers (what ``host status`` reports)."""
        return self._allocated

    def charged_bytes(self) -> int:
        """What counts against ``Limits.max_memory`` between computes: buffers, derived
        weight forms, and graph metadata."""
        return self._allocated + self._charged_extra

    def _check_quota(self, extra: int, what: str) -> None:
        limit = self.limits.max_memory
        if limit:
            used = self.charged_bytes()
            if used + extra > limit:
                raise QuotaError(
                    f"{what} would exceed this session's memory limit "
                    f"({used} of {limit} bytes in use, counting buffers, dequantized weights "
                    "and graph metadata)"
                )

    def _derived_nbytes(self, dtype: DType, shape: tuple[int, ...]) -> int:
        """Bytes an executor's cached form of a WEIGHT takes beyond its buffer bytes.
        F32 and I32 weights are used in place; others are widened, at most to f32."""
        if dtype in (DType.F32, DType.I32):
            return 0
        n = 1
        for d in shape:
            n *= d
        return 4 * n

    # ------------------------------------------------------------ tensor bytes
    def set_tensor(self, handle: int, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else None
        raw = np.frombuffer(view, np.uint8) if view is not None else data.reshape(-1).view(np.uint8)
        buf = self._buffer(handle)
        self._check_range(handle, buf, offset, raw.nbytes)
        self._write(buf, offset, raw)
        buf.version += 1

    def get_tensor(self, handle: int, offset: int, size: int) -> bytes:
        buf = self._buffer(handle)
        self._check_range(handle, buf, offset, size)
        return self._read(buf, offset, size)

    def copy_tensor(self, src: int, src_offset: int, dst: int, dst_offset: int, size: int) -> None:
        data = np.frombuffer(self.get_tensor(src, src_offset, size), np.uint8)
        self.set_tensor(dst, dst_offset, data)

    # ------------------------------------------------------------ graphs
    def register_graph(self, graph: Graph, gid: int | None = None) -> int:
        """Validate ``graph`` against the op table and this backend's buffers; compile it once."""
        self._check_open()
        if len(graph.nodes) > self.limits.max_graph_nodes:
            raise QuotaError(f"graph of {len(graph.nodes)} nodes exceeds the limit of {self.limits.max_graph_nodes}")
        graph.validate(self.limits.max_graph_nodes)
        used: dict[int, Buffer] = {}
        derived: dict[tuple, int] = {}
        for nid, node in enumerate(graph.nodes):
            if node.op in (Op.WEIGHT, Op.STATE):
                handle, offset = node.attrs
                what = node.describe(nid)
                if handle not in self._buffers:
                    raise BackendError(f"{what} refers to unknown buffer {handle}")
                if offset % ALIGNMENT:
                    raise BackendError(f"{what}: offset {offset} is not {ALIGNMENT}-byte aligned")
                self._check_range(handle, self._buffers[handle], offset, node.dtype.nbytes(node.shape))
                used[handle] = self._buffers[handle]
                key = (handle, offset, node.dtype, node.shape)
                if node.op is Op.WEIGHT and key not in self._derived:
                    derived[key] = self._derived_nbytes(node.dtype, node.shape)
        gid = self._new_handle(gid, self._graphs)
        # charged before compiling: compiling is what dequantizes the weights
        self._check_quota(sum(derived.values()) + GRAPH_NODE_BYTES * len(graph.nodes),
                          f"registering a graph of {len(graph.nodes)} nodes")
        inputs = {name: (n.shape, n.dtype) for name, n in graph.inputs().items()}
        scratch, transient = _scratch_of(graph)
        program = self._compile(graph)
        self._derived.update(derived)
        self._charged_extra += sum(derived.values()) + GRAPH_NODE_BYTES * len(graph.nodes)
        self._graphs[gid] = Registered(graph, program, inputs, used, scratch, transient)
        return gid

    def free_graph(self, gid: int) -> None:
        reg = self._graph(gid)
        del self._graphs[gid]
        self._charged_extra -= GRAPH_NODE_BYTES * len(reg.graph.nodes)

    def compute(self, gid: int, inputs: Mapping[str, np.ndarray], feed: Feed | None = None) -> list[np.ndarray]:
        """Bind ``inputs`` by name (and ``feed``, see Backend.compute) and run graph ``gid``;
        returns its outputs as numpy arrays."""
        reg, outputs = self._launch(gid, inputs, feed or {})
        return self._host_outputs(reg, outputs)

    def submit(self, gid: int, inputs: Mapping[str, np.ndarray], feed: Feed | None = None) -> Pending:
        try:
            reg, outputs = self._launch(gid, inputs, feed or {})
            return self._pending(reg, outputs)
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
            need = _poly(reg.scratch, t) + max((_poly(p, t) for p in reg.transient), default=0)
            self._check_quota(need, f"computing graph {gid} with T={t} (about {need} bytes of intermediates)")
        try:
            outputs = self._run(reg, bound, bounds)
        except (BackendError, GraphError):
            raise
        except IndexError as e:
            raise BackendError(f"graph {gid}: {e}") from None
        reg.last_outputs = [o if o.nbytes <= FEED_MAX_BYTES else None for o in outputs]
        return reg, outputs

    def synchronize(self) -> None:
        """Wait for queued work. Executors here run synchronously, so this only checks state."""
        self._check_open()

    def close(self) -> None:
        for handle in list(self._buffers):
            self.free_buffer(handle)
        self._graphs.clear()
        self._derived.clear()
        self._charged_extra = 0
        self.closed = True

    # ------------------------------------------------------------ checks
    def _check_open(self) -> None:
        if self.closed:
            raise BackendError("backend is closed")

    def _buffer(self, handle: int) -> Buffer:
        self._check_open()
        buf = self._buffers.get(handle) if isinstance(handle, int) else None
        if buf is None:
            raise BackendError(f"unknown buffer handle {handle!r}")
        return buf

    def _graph(self, gid: int) -> Registered:
        self._check_open()
        reg = self._graphs.get(gid) if isinstance(gid, int) else None
        if reg is None:
            raise BackendError(f"unknown graph id {gid!r}")
        return reg

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
            picks = node.op in (Op.ARGMAX, Op.SAMPLE)
            bounds[name] = nodes[node.inputs[0]].shape[-1] if picks else None
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
                raise BackendError(f"feed of {name!r}: output {k} of graph {gid} is larger than "
                                   f"{FEED_MAX_BYTES} bytes and is not kept for feeding")
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
    def _host_outputs(self, reg: Registered, outputs: list) -> list[np.ndarray]:
        """``_run``'s outputs as numpy arrays of their nodes' dtypes, owned by the caller."""

    def _pending(self, reg: Registered, outputs: list) -> Pending:
        """``submit``'s result: an executor whose device runs ahead of the host starts
        copying the outputs back here and lets ``result()`` wait for them."""
        return Pending(self._host_outputs(reg, outputs))


def _check_names(reg: Registered, inputs: Mapping[str, object], fed: Mapping[str, object]) -> None:
    """Every input of the graph either sent or fed, nothing else."""
    missing = set(reg.inputs) - set(inputs) - set(fed)
    extra = (set(inputs) - set(reg.inputs)) | (set(inputs) & set(fed))
    if missing or extra:
        raise BackendError(
            f"graph inputs are {sorted(reg.inputs)}; missing {sorted(missing)}, unexpected "
            f"{sorted(extra)} (an input is either sent or fed, not both)"
        )


# ---------------------------------------------------------------- scratch estimate


def _term(shape: Sequence[int], factor: int = 4) -> dict[int, int]:
    """``factor`` * numel(shape) as {power of T: coefficient}."""
    coef, power = factor, 0
    for d in shape:
        if d == T:
            power += 1
        else:
            coef *= d
    return {power: coef}


def _add(total: dict[int, int], term: dict[int, int]) -> None:
    for p, c in term.items():
        total[p] = total.get(p, 0) + c


def _poly(poly: Mapping[int, int], t: int) -> int:
    return sum(c * t**p for p, c in poly.items())


def _scratch_of(graph: Graph) -> tuple[dict[int, int], tuple[dict[int, int], ...]]:
    """Bytes one compute of ``graph`` holds, as polynomials in T (upper bounds).

    The executors keep every node's value until the end of a compute, so the sum over
    nodes (4 bytes an element: values are held as f32 at most) is what a compute peaks
    at; ops that return a view of their input add nothing. ``transient`` lists what a
    single op needs besides its result (attention scores, SAMPLE's sorted copies); only
    the largest one is live at a time.
    """
    total: dict[int, int] = {}
    transient: dict[frozenset, dict[int, int]] = {}
    for node in graph.nodes:
        if node.op in (Op.WEIGHT, Op.STATE) or node.op in _ALIASING:
            continue
        _add(total, _term(node.shape))
        extra: dict[int, int] = {}
        if node.op is Op.ATTENTION:
            q, k = (graph.nodes[i].shape for i in node.inputs[:2])
            # scores and probabilities (Hq, Tq, S), keys and values repeated to Hq heads
            _add(extra, _term((q[1], q[0], k[0]), 8))
            _add(extra, _term((k[0], q[1], max(q[2], graph.nodes[node.inputs[2]].shape[2])), 8))
        elif node.op is Op.SAMPLE:
            _add(extra, _term(graph.nodes[node.inputs[0]].shape, 32))  # sort, softmax, cumsums
        if extra:
            transient[frozenset(extra.items())] = extra
    return total, tuple(transient.values())
