"""The host executor ("native"): PyTorch on cpu, cuda or mps.

Buffers are uint8 tensors on the device. A registered graph is compiled once into a
``Program``: a flat list of steps with their kernels and attributes resolved, and the
weights it reads dequantized into device tensors. Compute then only binds inputs and
walks the list.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import numpy as np
import torch

from ...graph import DType, Graph, Op
from ..base import NO_LIMITS, BackendError, Buffer, DeviceInfo, Executor, Limits, Registered
from .dequant import dequantize
from .kernels import KERNELS

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


class LocalBackend(Executor):
    name = "local"

    def __init__(self, device: str | None = None, limits: Limits = NO_LIMITS) -> None:
        super().__init__(limits)
        self.torch_device = pick_device(device)
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
        steps: list = []
        for node in graph.nodes:
            if node.op is Op.INPUT:
                steps.append(("input", node.attrs[0], node.dtype))
            elif node.op in (Op.WEIGHT, Op.STATE):
                steps.append(("leaf", node))
                if node.op is Op.WEIGHT:
                    self._leaf(node)  # dequantize now, not on the first compute
            else:
                steps.append(Step(KERNELS[node.op], node.inputs, node.attrs))
        return Program(steps, graph.outputs)

    def _run(self, reg: Registered, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        dev = self.torch_device
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
                arr = inputs[step[1]]
                t = torch.from_numpy(arr if arr.flags.writeable else arr.copy()).to(dev)
                if step[2] is DType.BF16:
                    t = t.view(torch.bfloat16)
                values.append(t.float() if step[2] in (DType.F16, DType.BF16) else t)
            else:
                values.append(self._leaf(step[1]))
        for node in reg.graph.nodes:
            if node.op is Op.STATE:
                self._buffers[node.attrs[0]].version += 1
        return [self._to_numpy(values[o], reg.graph.nodes[o].dtype) for o in reg.graph.outputs]

    @staticmethod
    def _to_numpy(t: torch.Tensor, dtype: DType) -> np.ndarray:
        if dtype is DType.BF16:
            return t.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
        want = TORCH_DTYPES[dtype]
        return t.detach().to(want).cpu().numpy().copy()
