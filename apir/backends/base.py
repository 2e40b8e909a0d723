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


class BackendError(ApirError):
    """A request the backend refuses: bad handle, out-of-range bytes, bad inputs."""


class QuotaError(BackendError):
    """A request past one of the backend's limits (memory, handles, graph size)."""


@dataclass(frozen=True)
class Limits:
    """Caps an executor enforces; 0 means unlimited. The host sets them per session."""

    max_memory: int = 0  # bytes of live buffers
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
    def compute(self, gid: int, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Bind ``inputs`` by name and run graph ``gid``; returns its outputs."""

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
        if self.limits.max_memory and used + size > self.limits.max_memory:
            raise QuotaError(
                f"allocating {size} bytes would exceed this session's memory limit "
                f"({used} of {self.limits.max_memory} bytes in use)"
            )
        try:
            storage = self._alloc(size)
        except (MemoryError, RuntimeError) as e:
            raise QuotaError(f"the device cannot allocate {size} bytes: {str(e).splitlines()[0]}") from None
        self._buffers[handle] = Buffer(size, purpose, storage)
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
        return sum(b.size for b in self._buffers.values())

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
        for nid, node in enumerate(graph.nodes):
            if node.op in (Op.WEIGHT, Op.STATE):
                handle, offset = node.attrs
                what = node.describe(nid)
                if handle not in self._buffers:
                    raise BackendError(f"{what} refers to unknown buffer {handle}")
                if offset % ALIGNMENT:
                    raise BackendError(f"{what}: offset {offset} is not {ALIGNMENT}-byte aligned")
                self._check_range(handle, self._buffers[handle], offset, node.dtype.nbytes(node.shape))
        gid = self._new_handle(gid, self._graphs)
        inputs = {name: (n.shape, n.dtype) for name, n in graph.inputs().items()}
        self._graphs[gid] = Registered(graph, self._compile(graph), inputs)
        return gid

    def free_graph(self, gid: int) -> None:
        self._graph(gid)
        del self._graphs[gid]

    def compute(self, gid: int, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Bind ``inputs`` by name and run graph ``gid``; returns its outputs as numpy arrays."""
        reg = self._graph(gid)
        bound = self._bind(reg, inputs)
        for node in reg.graph.nodes:
            if node.op in (Op.WEIGHT, Op.STATE) and node.attrs[0] not in self._buffers:
                raise BackendError(f"graph {gid} uses buffer {node.attrs[0]}, which was freed")
        try:
            return self._run(reg, bound)
        except (BackendError, GraphError):
            raise
        except IndexError as e:
            raise BackendError(f"graph {gid}: {e}") from None

    def synchronize(self) -> None:
        """Wait for queued work. Executors here run synchronously, so this only checks state."""
        self._check_open()

    def close(self) -> None:
        for handle in list(self._buffers):
            self.free_buffer(handle)
        self._graphs.clear()
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
    def _bind(reg: Registered, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Check every input's name, dtype and shape; work out T. Returns the arrays."""
        missing = set(reg.inputs) - set(inputs)
        extra = set(inputs) - set(reg.inputs)
        if missing or extra:
            raise BackendError(
                f"graph inputs are {sorted(reg.inputs)}; missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        n_tokens = None
        out = {}
        for name, (shape, dtype) in reg.inputs.items():
            arr = np.asarray(inputs[name])
            if arr.dtype != NUMPY_DTYPES[dtype]:
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
            out[name] = np.ascontiguousarray(arr)
        return out

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
    def _run(self, reg: Registered, inputs: dict[str, np.ndarray]) -> list[np.ndarray]: ...
