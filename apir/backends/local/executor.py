"""The host executor ("native"): PyTorch on cpu, cuda or mps.

Buffers are uint8 tensors on the device. A registered graph is compiled once into a
``Program``: a flat list of steps with their kernels and attributes resolved, and the
weights it reads dequantized into device tensors. Compute then only binds inputs and
walks the list.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass, field

import numpy as np
import torch

from ...graph import DType, Graph, Op
from ..base import NO_LIMITS, BackendError, Buffer, DeviceInfo, Executor, Limits, Registered
from .dequant import dequantize
from .kernels import DEVICE_KERNELS, KERNELS

log = logging.getLogger("apir.local")

TORCH_DTYPES = {
    DType.F32: torch.float32,
    DType.F16: torch.float16,
    DType.BF16: torch.bfloat16,
    DType.I32: torch.int32,
}


def pick_device(device: str | None) -> torch.device:
    """``None`` picks cuda, then mps, then cpu; an unavailable device is a clear error."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendError("device 'cuda' requested but torch sees no CUDA GPU")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise BackendError("device 'mps' requested but this torch has no MPS support")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise BackendError(f"unknown device {device!r}: use cpu, cuda or mps")
    return dev


@dataclass(frozen=True)
class Step:
    kernel: object
    inputs: tuple[int, ...]
    attrs: tuple


@dataclass
class Program:
    steps: list  # per node: a Step, or ("input", name, dtype) / ("leaf", node) markers
    outputs: tuple[int, ...]
    # (input name, exclusive limit, what): index operands checked on the host before launch
    index_checks: tuple[tuple[str, int, str], ...] = ()
    device_safe: bool = False  # every index operand is an input: no device-side checks needed
    weight_buffers: tuple[int, ...] = ()
    state_buffers: tuple[int, ...] = ()  # written by every run: their versions move on
    captured: dict = field(default_factory=dict)  # n_tokens -> CapturedStep (CUDA only)


# Operand positions that index into another operand: op -> ((index operand, indexed operand, what), ...)
INDEX_OPERANDS = {
    Op.GET_ROWS: ((1, 0, "GET_ROWS row"),),
    Op.SET_ROWS: ((2, 0, "SET_ROWS row"),),
    Op.ATTENTION: ((3, 1, "ATTENTION position"),),
}
CAPTURE_MAX_TOKENS = 8  # decode-sized steps are replayed from CUDA graphs; prefill runs eagerly


class CapturedStep:
    """One CUDA graph of a whole program for a fixed token count: static inputs are
    refilled, the graph replayed, static outputs read. Weights and KV-cache views have
    fixed addresses, so the capture stays valid until a weight buffer is rewritten."""

    def __init__(self, run, inputs: dict[str, torch.Tensor], versions: tuple[int, ...]) -> None:
        self.inputs, self.versions = inputs, versions
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture, as PyTorch requires
            run(self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = run(self.inputs)

    def __call__(self, inputs: dict[str, np.ndarray]) -> list[torch.Tensor]:
        for name, arr in inputs.items():
            self.inputs[name].copy_(torch.from_numpy(arr), non_blocking=False)
        self.graph.replay()
        return self.outputs


class LocalBackend(Executor):
    name = "local"

    def __init__(self, device: str | None = None, limits: Limits = NO_LIMITS,
                 cuda_graphs: bool | None = None) -> None:
        super().__init__(limits)
        self.torch_device = pick_device(device)
        from ... import env

        if cuda_graphs is None:
            cuda_graphs = env.CUDA_GRAPHS.get() != "0"
        self.cuda_graphs = cuda_graphs and self.torch_device.type == "cuda"
        self.compile = self.cuda_graphs and env.COMPILE.get() != "0"
        # Weights computed in f32 on the CPU; on accelerators they keep a 16-bit form.
        self._weights: dict[tuple, tuple[int, torch.Tensor]] = {}

    def device(self) -> DeviceInfo:
        dev = self.torch_device
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            name = torch.cuda.get_device_name(dev)
            return DeviceInfo(str(dev), "cuda", name, free, total, frozenset({"graph_cache"}))
        if dev.type == "mps":
            total = torch.mps.recommended_max_memory()
            used = torch.mps.current_allocated_memory()
            return DeviceInfo("mps", "mps", "Apple GPU", total - used, total)
        import os

        page = os.sysconf("SC_PAGE_SIZE")
        return DeviceInfo(
            "cpu", "cpu", platform.processor() or platform.machine(),
            page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES"),
        )

    # ------------------------------------------------------------ storage
    def _alloc(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.uint8, device=self.torch_device)

    def _fill(self, buf: Buffer, value: int) -> None:
        buf.storage.fill_(value)

    def _write(self, buf: Buffer, offset: int, data: np.ndarray) -> None:
        # torch refuses read-only arrays (e.g. a GGUF memory map) without a warning; copy those
        src = torch.from_numpy(data if data.flags.writeable else data.copy())
        buf.storage[offset : offset + data.nbytes].copy_(src)

    def _read(self, buf: Buffer, offset: int, size: int) -> bytes:
        return buf.storage[offset : offset + size].cpu().numpy().tobytes()

    def _release(self, buf: Buffer) -> None:
        super()._release(buf)
        self._weights = {k: v for k, v in self._weights.items() if k[0] in self._buffers}

    # ------------------------------------------------------------ graphs
    def _weight_dtype(self, dtype: DType) -> torch.dtype:
        if self.torch_device.type == "cpu" or dtype is DType.F32:
            return torch.float32
        return torch.bfloat16 if dtype is DType.BF16 else torch.float16

    def _leaf(self, node) -> torch.Tensor:
        handle, offset = node.attrs
        buf = self._buffers[handle]
        raw = buf.storage[offset : offset + node.dtype.nbytes(node.shape)]
        if node.op is Op.STATE:
            return raw.view(TORCH_DTYPES[node.dtype]).view(node.shape)  # live view
        key = (handle, offset, node.dtype, node.shape)
        cached = self._weights.get(key)
        if cached is None or cached[0] != buf.version:
            if node.dtype is DType.I32:
                value = raw.view(torch.int32).view(node.shape)
            else:
                value = dequantize(raw, node.dtype, node.shape).to(self._weight_dtype(node.dtype))
            cached = (buf.version, value)
            self._weights[key] = cached
        return cached[1]

    def _compile(self, graph: Graph) -> Program:
        nodes = graph.nodes
        checks, device_safe = [], True
        for node in nodes:
            for idx, target, what in INDEX_OPERANDS.get(node.op, ()):
                src = nodes[node.inputs[idx]]
                if src.op is Op.INPUT:
                    checks.append((src.attrs[0], nodes[node.inputs[target]].shape[0], what))
                else:
                    device_safe = False  # computed indices: keep the kernels' own checks
        accelerated = self.torch_device.type != "cpu" and device_safe
        table = DEVICE_KERNELS if accelerated else KERNELS
        steps: list = []
        for node in nodes:
            if node.op is Op.INPUT:
                steps.append(("input", node.attrs[0], node.dtype))
            elif node.op in (Op.WEIGHT, Op.STATE):
                steps.append(("leaf", node))
                if node.op is Op.WEIGHT:
                    self._leaf(node)  # dequantize now, not on the first compute
            else:
                steps.append(Step(table[node.op], node.inputs, node.attrs))
        weights = tuple(sorted({n.attrs[0] for n in nodes if n.op is Op.WEIGHT}))
        states = tuple(sorted({n.attrs[0] for n in nodes if n.op is Op.STATE}))
        return Program(steps, graph.outputs, tuple(checks), accelerated, weights, states)

    def _execute(self, reg: Registered, tensors: dict[str, torch.Tensor],
                 leaves: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Walk the program once; ``tensors`` are the inputs, already on the device.
        ``leaves`` (node id -> tensor) pre-resolves weights and states for tracing."""
        values: list[torch.Tensor] = []
        for nid, step in enumerate(reg.program.steps):
            if isinstance(step, Step):
                try:
                    values.append(step.kernel(*(values[i] for i in step.inputs), *step.attrs))
                except BackendError as e:
                    raise BackendError(f"{reg.graph.nodes[nid].describe(nid)}: {e}") from None
                except (RuntimeError, ValueError, IndexError) as e:
                    raise BackendError(f"{reg.graph.nodes[nid].describe(nid)} failed: {e}") from None
            elif step[0] == "input":
                t = tensors[step[1]]
                if step[2] is DType.BF16:
                    t = t.view(torch.bfloat16)
                values.append(t.float() if step[2] in (DType.F16, DType.BF16) else t)
            else:
                values.append(leaves[nid] if leaves is not None else self._leaf(step[1]))
        return [values[o] for o in reg.program.outputs]

    def _run(self, reg: Registered, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        prog = reg.program
        for name, limit, what in prog.index_checks:
            ids = inputs[name]
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limit):
                raise BackendError(f"{what} index out of range: input {name!r} must lie in [0, {limit})")
        n_tokens = next((a.shape[0] for a in inputs.values() if a.ndim), 0)
        if prog.device_safe and self.cuda_graphs and 0 < n_tokens <= CAPTURE_MAX_TOKENS:
            outs = self._replay(reg, inputs, n_tokens)
        else:
            dev = self.torch_device
            tensors = {
                name: torch.from_numpy(a if a.flags.writeable else a.copy()).to(dev)
                for name, a in inputs.items()
            }
            outs = self._execute(reg, tensors)
        for handle in prog.state_buffers:
            self._buffers[handle].version += 1
        return [self._to_numpy(t, reg.graph.nodes[o].dtype) for t, o in zip(outs, prog.outputs)]

    def _replay(self, reg: Registered, inputs: dict[str, np.ndarray], n_tokens: int) -> list[torch.Tensor]:
        prog = reg.program
        versions = tuple(self._buffers[h].version for h in prog.weight_buffers)
        step = prog.captured.get(n_tokens)
        if step is None or step.versions != versions:
            static = {name: torch.from_numpy(a.copy()).to(self.torch_device) for name, a in inputs.items()}
            leaves = {nid: self._leaf(s[1]) for nid, s in enumerate(prog.steps)
                      if isinstance(s, tuple) and s[0] == "leaf"}

            def run(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
                return self._execute(reg, t, leaves)

            step = None
            if self.compile:
                # Inductor fuses the elementwise chains (norms, RoPE, gates) into a few
                # kernels per layer; the CUDA graph then removes the launch overhead.
                try:
                    step = CapturedStep(torch.compile(run, dynamic=False), static, versions)
                except Exception as e:  # noqa: BLE001 - a compiler failure must not fail the step
                    log.warning("torch.compile failed (%s); capturing eager kernels instead",
                                str(e).splitlines()[0] if str(e) else type(e).__name__)
                    self.compile = False
            step = step or CapturedStep(run, static, versions)
            prog.captured[n_tokens] = step
        return step(inputs)

    @staticmethod
    def _to_numpy(t: torch.Tensor, dtype: DType) -> np.ndarray:
        if dtype is DType.BF16:
            return t.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
        want = TORCH_DTYPES[dtype]
        return t.detach().to(want).cpu().numpy().copy()
