"""The backend interface (docs/design.md, "The backend API"): what every backend is and
shares, whether it executes graphs itself (``apir.backends.executor``) or forwards them
(``apir.backends.remote``).

A backend owns buffers (byte ranges on its device, named by opaque integer handles),
moves bytes in and out of them, and runs registered graphs.
"""

from __future__ import annotations

import enum
import os
import platform
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ApirError
from ..graph import DType, Graph, Op

ALIGNMENT = 32  # tensor offsets inside a buffer; GGUF aligns tensor data the same way


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

COMPILE_MODES = ("off", "decode", "all")


@dataclass(frozen=True)
class ExecutorConfig:
    """How the host executor runs graphs; the defaults are the built-in behaviour. A
    library caller gets exactly what it passes; the CLI, ``apir.load``, the host worker
    and bench resolve flags and environment once (``from_env``) and pass the result."""

    cuda_graphs: bool = True  # replay steps from captured CUDA graphs (CUDA devices only)
    # compile (Inductor) captured steps: "decode" steps (and fixed-shape graphs run twice: the
    # torch frontend's), "all" prefill chunks too, or "off"
    compile: str = "decode"
    # keep dequantized f32/f16 copies of quantized and 16-bit weights beside their buffer
    # bytes (up to 8x the weights' memory; on a CPU not of those that cpu_int4 takes). Off
    # (the default), a GPU computes from the blocks (fused kernels) and a CPU from compact
    # forms made once: Q4 types as torch's int4 weights, the other quantized types as int8
    # values with f32 scales (local.int8cpu, 1.125-1.5 bytes a weight, dequantized a cache-
    # sized tile at a time), 16-bit weights widened per product, a tile at a time. On a
    # 2-core CPU the f32 copies decode Gemma-3 270M about as fast as its int8 forms, in 8x
    # their memory (946 against 116 MiB)
    dequant_cache: bool = False
    # on a CPU device, compute Q4_0, Q4_1 and Q4_K weights through torch's int4 product
    # (bf16 activations): 0.625 bytes a weight and about twice the decode speed of the
    # dequantized f32 copy (local.int4cpu). Logits to bf16 precision: a decode step's
    # logprobs and a whole-prompt pass's differ by up to ~3e-2 on SmolLM2, which rounding x
    # and the products to bf16 reproduces (f32 products of bf16-rounded x: 2.3e-2; with the
    # output rounded too: 3.5e-2); llama.cpp's CPU path rounds activations to 8 bits
    cpu_int4: bool = True
    # compile decode steps on a CPU device too (no CUDA graph there); off by default:
    # Inductor's C++ build of a model's step takes minutes on a small CPU host
    compile_cpu: bool = False
    # where compiled programs outlive the session and the process (Inductor's on-disk
    # caches, in a subdirectory per torch and apir version); "": ~/.cache/apir/compile
    compile_cache: str = ""

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")

    @classmethod
    def from_env(cls) -> ExecutorConfig:
        """APIR_CUDA_GRAPHS, APIR_COMPILE, APIR_DEQUANT_CACHE and APIR_CPU_INT4
        (environment, then the user config file)."""
        from .. import env

        mode = env.COMPILE.get() or "1"
        cache = env.DEQUANT_CACHE.get()
        return cls(env.CUDA_GRAPHS.get() != "0", {"0": "off", "all": "all"}.get(mode, "decode"),
                   cache == "1", compile_cache=env.COMPILE_CACHE.get() or "",
                   cpu_int4=env.CPU_INT4.get() != "0")


DEFAULT_EXECUTOR = ExecutorConfig()


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

    @classmethod
    def host_cpu(cls) -> DeviceInfo:
        """This machine's CPU, with its memory free and total now."""
        page = os.sysconf("SC_PAGE_SIZE")
        return cls("cpu", "cpu", platform.processor() or platform.machine(),
                   page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES"))


Feed = Mapping[str, int]  # input name -> index of the output of the graph's previous compute


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

    def open_published(self, name: str, layout: bytes, size: int) -> int | None:
        """A buffer handle on the host's read-only copy of published model ``name``'s
        weights, laid out as ``layout`` says (``apir.models.layout``) in ``size`` bytes;
        None where this backend shares no weights; a remote one raises BackendError where
        its host refuses (no such model published, or laid out otherwise)."""
        return None

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for queued work; errors of earlier requests surface here at the latest."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
