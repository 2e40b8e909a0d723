"""A whole graph run recorded as one CUDA graph and replayed per step.

Replaying costs one launch instead of a Python walk and a launch per kernel. Everything
the recorded kernels touch must keep its address: weights and KV-cache views do (they
live in backend buffers), and the inputs are copied into one fixed device buffer:

    pinned host staging --(one async copy)--> device staging --(views)--> graph inputs

so a step costs one host-to-device copy whatever the number of inputs, not one
synchronous copy from pageable memory per input. A large input (``DIRECT_MIN_BYTES``: a
batch of images, a model's KV cache passed back) is copied straight into its view
instead: staging it would cost a host memcpy of all its bytes (ResNet-18's batch of 32
took 4.2 ms in process on an H100 host, of which 1.5 ms was the GPU's; the memcpy was
most of the rest). From the
session's page-locked arena (pinned.py) that copy is DMA, queued like the staged one;
from pageable memory CUDA returns only once it has read the source, so the caller may
reuse it either way. A fed input (a device tensor, see Backend.compute) is copied device
to device into its view after those copies.

The host may stage step n+1 while step n's copy still waits behind step n-1 on the GPU
(see LocalBackend._pending), so there are two pinned staging buffers, used in turn.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ...graph import DType

# Staging views: BF16 travels as its 16 raw bits (numpy has no bfloat16)
STAGING_DTYPES = {DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.int16,
                  DType.I32: torch.int32}
ALIGN = 16
DIRECT_MIN_BYTES = 1 << 20  # inputs at least this large skip the pinned host staging


class CapturedStep:
    """One CUDA graph of a program for fixed input shapes. It stays valid until a weight
    buffer it reads is rewritten (``versions``)."""

    def __init__(self, run: Callable[[dict[str, torch.Tensor]], list[torch.Tensor]],
                 inputs: dict[str, np.ndarray | torch.Tensor], dtypes: dict[str, DType],
                 device: torch.device, versions: tuple[int, ...]) -> None:
        self.versions = versions
        # (name, byte offset, byte count) in the device staging; the staged ones first,
        # from byte 0 up to ``staged_bytes``, then those copied directly
        self.layout: list[tuple[str, int, int]] = []
        order = sorted(inputs, key=lambda name: inputs[name].nbytes >= DIRECT_MIN_BYTES)
        offset = self.staged_bytes = 0
        for name in order:
            n = inputs[name].nbytes
            if n < DIRECT_MIN_BYTES:
                self.staged_bytes = offset + n
            self.layout.append((name, offset, n))
            offset += -(-n // ALIGN) * ALIGN
        size = max(self.staged_bytes, ALIGN)
        self.hosts = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.host_bytes = [h.numpy() for h in self.hosts]
        self.copied: list[torch.cuda.Event | None] = [None, None]  # each host buffer's last copy
        self.turn = 0
        self.staging = torch.empty(max(offset, ALIGN), dtype=torch.uint8, device=device)
        self.inputs = {
            name: self.staging[off : off + n].view(STAGING_DTYPES[dtypes[name]]).view(tuple(inputs[name].shape))
            for name, off, n in self.layout
        }
        self._stage(inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture, as PyTorch requires
            run(self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = run(self.inputs)

    def _stage(self, inputs: dict[str, np.ndarray | torch.Tensor]) -> None:
        host, host_bytes, copied = self.hosts[self.turn], self.host_bytes[self.turn], self.copied[self.turn]
        if copied is not None:
            copied.synchronize()  # its copy of two steps ago has left it (not a wait, normally)
        direct = []
        for name, off, n in self.layout:
            value = inputs[name]
            if not isinstance(value, np.ndarray):
                continue
            if off + n <= self.staged_bytes:
                host_bytes[off : off + n] = value.reshape(-1).view(np.uint8)
            else:
                direct.append((self.staging[off : off + n], value))
        if self.staged_bytes:
            self.staging[: self.staged_bytes].copy_(host[: self.staged_bytes], non_blocking=True)
        if copied is None:
            copied = self.copied[self.turn] = torch.cuda.Event()
        copied.record()
        self.turn ^= 1
        for dst, value in direct:
            dst.copy_(torch.from_numpy(value.reshape(-1).view(np.uint8)), non_blocking=True)
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor):  # fed: I32 or F32, as its view
                self.inputs[name].copy_(value.reshape(self.inputs[name].shape))

    def __call__(self, inputs: dict[str, np.ndarray | torch.Tensor]) -> list[torch.Tensor]:
        self._stage(inputs)
        self.graph.replay()
        return self.outputs
