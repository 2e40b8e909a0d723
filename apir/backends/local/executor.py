"""The host executor ("native"): PyTorch on cpu, cuda or mps.

Buffers are uint8 tensors on the device. A registered graph is compiled once into a
``Program``: a flat list of steps with their kernels and attributes resolved. Compute then
only binds inputs and walks the list.

Every weight is held once, in the buffer the guest uploaded it to: a quantized one is read
by MATMUL and GET_ROWS straight from its GGUF blocks (``kernels.Blocks``, qmatmul), on a
GPU packed in place at first use for the Triton kernels (qpack: the same bytes, moved), a
16-bit or f32 one is a view of its bytes. On a CPU a quantized weight also gets a compact
form when a graph that reads it is registered: torch's int4 weights for Q4 types
(``int4cpu``), int8 values with f32 scales for the others (``int8cpu``). Only a step that
needs a weight as a plain tensor gets a dense copy, made per compute and freed after it
(on a CPU that includes 16-bit weights, which are computed in f32).
``ExecutorConfig.dequant_cache`` brings back cached dequantized f32 copies instead (an
opt-in: several times the memory, about the speed of the CPU's compact forms).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import os
import platform
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ...graph import DType, Graph, Node, Op, SampleArgs, T
from ...graph.dtypes import NUMPY_DTYPES
from .. import forms as shared_forms
from ..base import (
    ALIGNMENT,
    DEFAULT_EXECUTOR,
    NO_LIMITS,
    BackendError,
    BufferPurpose,
    DeviceInfo,
    ExecutorConfig,
    Limits,
    Pending,
)
from ..executor import Buffer, Executor, Registered, check_indices, fits
from . import inductor, int4cpu, int8cpu, kernels, qmatmul, qpack
from .capture import CapturedStep
from .dequant import dequantize
from .pinned import PinnedPrefix
from .program import FusedMatmul, Input, Leaf, Part, Program, Step, compile_program

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


# Step sizes replayed from CUDA graphs: decode steps (up to 8 tokens), and prefill chunks
# whose length is a power of two (the engine pads its chunks to one on devices that say
# "graph_cache"). Any other length runs eagerly, so a guest cannot make the host record
# a graph per length.
CAPTURE_MAX_DECODE = 8
CAPTURE_MAX_TOKENS = 1024
_OUT_OF_MEMORY = "can't allocate memory"  # torch's CPU allocator failing (CUDA's: OutOfMemoryError)
ASYNC_MAX_BYTES = 1 << 20  # outputs up to this size are copied back behind the step (_pending)


def capturable(n_tokens: int) -> bool:
    """Whether a step of ``n_tokens`` (> 0: a graph with the token axis) is recorded."""
    return 0 < n_tokens and (n_tokens <= CAPTURE_MAX_DECODE or (
        n_tokens <= CAPTURE_MAX_TOKENS and n_tokens & (n_tokens - 1) == 0))


class LocalBackend(Executor):
    name = "local"

    def __init__(self, device: str | None = None, limits: Limits = NO_LIMITS,
                 config: ExecutorConfig = DEFAULT_EXECUTOR) -> None:
        super().__init__(limits)
        self.torch_device = pick_device(device)
        self.dequant_cache = config.dequant_cache
        self.cuda_graphs = config.cuda_graphs and self.torch_device.type == "cuda"
        self.compile = config.compile != "off" and (self.cuda_graphs or config.compile_cpu and
                                                    self.torch_device.type == "cpu")
        # compiled steps saved for later sessions (see inductor.StepStore)
        self._steps = (inductor.StepStore(use_compile_cache(config.compile_cache or DEFAULT_COMPILE_CACHE)
                                          / "steps") if self.compile else None)
        self.compile_prefill = config.compile == "all"
        self._uncompiled: set[tuple[int, bool]] = set()  # (step tokens, greedy): kinds that failed to compile
        # a shared weights mapping is computed on in place on the CPU; a GPU copies it
        self._lends = self.torch_device.type == "cpu"
        self.cpu_int4 = config.cpu_int4 and self.torch_device.type == "cpu"
        # quantized weights packed in place for the GPU kernels (qpack), per buffer (by id):
        # offset -> (qtype, rows, K, bytes); reads and writes of the buffer see GGUF bytes
        self._packs = qmatmul.packs(self.torch_device)
        self._packed: dict[int, dict[int, tuple[int, int, int, int]]] = {}
        self._pinned: PinnedPrefix | None = None  # the shared arena, as far as steps reach it
        # told before a graph is compiled (tens of seconds); a host session tells its guest
        self.on_compile: Callable[[str], None] = lambda what: None

    def device(self) -> DeviceInfo:
        dev = self.torch_device
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            name = torch.cuda.get_device_name(dev)
            capabilities = {"graph_cache"} | ({"compiled_prefill"} if self.compile and self.compile_prefill else set())
            return DeviceInfo(str(dev), "cuda", name, free, total, frozenset(capabilities))
        if dev.type == "mps":
            total = torch.mps.recommended_max_memory()
            used = torch.mps.current_allocated_memory()
            return DeviceInfo("mps", "mps", "Apple GPU", total - used, total)
        return DeviceInfo.host_cpu()

    def synchronize(self) -> None:
        """Wait for the steps ``submit`` left queued on the GPU."""
        super().synchronize()
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)

    def free_graph(self, gid: int) -> None:
        self.synchronize()  # its recorded CUDA graphs' memory must not be reused while they run
        super().free_graph(gid)

    def use_host_memory(self, view: memoryview) -> None:
        if self.torch_device.type == "cuda":
            self._pinned = PinnedPrefix(view, self.torch_device)

    def close(self) -> None:
        if self.torch_device.type == "cuda" and not self.closed:
            torch.cuda.synchronize(self.torch_device)  # as free_graph, for every graph at once
        if self._pinned is not None:
            self._pinned.close()
        super().close()

    # ------------------------------------------------------------ storage
    def _alloc(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.uint8, device=self.torch_device)

    def _share(self, data: memoryview) -> torch.Tensor:
        """A view of the read-only pages every session maps (a write would fault; the
        executor refuses writes before that)."""
        with warnings.catch_warnings():  # torch warns that the mapping is not writable
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(data, dtype=torch.uint8)

    def adopt_device_buffer(self, handle: int, weights: torch.Tensor,
                            packed: Mapping[int, tuple[int, int, int, int]]) -> None:
        """See ``Executor.adopt_device_buffer``: the spans in ``packed`` are taken as this
        executor would have packed them at first use (qpack), so no graph packs them again;
        a graph that reads them otherwise, or reads other bytes of the copy as a quantized
        weight (which would need packing, a write), is refused."""
        self._check_open()
        dev = self.torch_device
        if (not isinstance(weights, torch.Tensor) or weights.dtype != torch.uint8 or weights.dim() != 1
                or weights.device.type != dev.type or dev.index is not None and weights.device.index != dev.index):
            raise BackendError(f"the host's device copy of shared weights is not 1-D bytes on {dev}")
        if packed and not self._packs:
            raise BackendError("the host's device copy of shared weights is packed for GPU kernels this "
                               "session's executor does not use")
        for offset, (qtype, n, k, nbytes) in packed.items():
            if (qtype not in qpack.TYPES or offset % ALIGNMENT or offset + nbytes > weights.numel()
                    or qpack.geometry(qtype, n, k).nbytes != nbytes):
                raise BackendError(f"the host's table of packed weights is wrong at offset {offset}")
        handle = self._new_handle(handle, self._buffers)
        buf = self._buffers[handle] = Buffer(weights.numel(), BufferPurpose.WEIGHTS, weights,
                                             read_only=True, lent=True)
        if packed:
            self._packed[id(buf)] = dict(packed)

    def _shared_forms(self, forms: memoryview) -> dict[int, object]:
        """f32 views of the mapping, where this executor's forms are f32 (a CPU's)."""
        if self.torch_device.type != "cpu":
            return {}
        try:
            table = shared_forms.read(forms)
        except ValueError as e:
            raise BackendError(f"the host's dequantized forms are unreadable: {e}") from None
        with warnings.catch_warnings():  # torch warns that the mapping is not writable
            warnings.simplefilter("ignore", UserWarning)
            values = torch.frombuffer(forms, dtype=torch.float32)
        return {weight: (kind, values[at // 4 : at // 4 + n]) for weight, (kind, at, n) in table.items()}

    def _shared_form(self, nodes) -> torch.Tensor | None:
        """One weight's shared form in its shape; several (a fused product's) as one view
        where they lie one after another, as q, k, v do; else None (made and charged here)."""
        views = []
        for n in nodes:
            kind, view = self._buffers[n.attrs[0]].forms.get(n.attrs[1], (None, None))
            if view is None or kind != int(n.dtype) or view.numel() != math.prod(n.shape):
                return None  # no form here, or the leaf reads the bytes as another type or size
            views.append(view)
        first, k = views[0], nodes[0].shape[-1]
        end, storage = first.storage_offset(), first.untyped_storage().data_ptr()
        for v in views:  # one run of one mapping, else no view spans them
            if v.storage_offset() != end or v.untyped_storage().data_ptr() != storage:
                return None
            end += v.numel()
        whole = first.as_strided((end - first.storage_offset(),), (1,))
        return whole.view(nodes[0].shape) if len(nodes) == 1 else whole.view(-1, k)

    def _fill(self, buf: Buffer, value: int) -> None:
        self._packed.pop(id(buf), None)
        buf.storage.fill_(value)

    def _write(self, buf: Buffer, offset: int, data: np.ndarray) -> None:
        # a packed weight the write covers only in part goes back to its GGUF bytes first
        spans = self._packed.get(id(buf), {})
        for start, (qtype, n, k, size) in self._overlapping(buf, offset, data.nbytes):
            if not (offset <= start and start + size <= offset + data.nbytes):
                span = buf.storage[start : start + size]
                span.copy_(qpack.unpack(span, qtype, n, k))
            del spans[start]
        # from the arena, a part registered and a part not is two copies (pinned.py)
        for at, part in self._pinned.split(data) if self._pinned is not None else [(0, data)]:
            # torch refuses read-only arrays (e.g. a GGUF memory map) without a warning; copy those
            src = torch.from_numpy(part if part.flags.writeable else part.copy())
            buf.storage[offset + at : offset + at + part.nbytes].copy_(src)

    def _read(self, buf: Buffer, offset: int, size: int) -> bytes:
        out = buf.storage[offset : offset + size].clone()
        for start, (qtype, n, k, nbytes) in self._overlapping(buf, offset, size):
            gguf = qpack.unpack(buf.storage[start : start + nbytes], qtype, n, k)
            lo, hi = max(start, offset), min(start + nbytes, offset + size)
            out[lo - offset : hi - offset] = gguf[lo - start : hi - start]
        return out.cpu().numpy().tobytes()

    def _copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, size: int) -> None:
        if self._overlapping(src, src_offset, size) or self._overlapping(dst, dst_offset, size):
            super()._copy(src, src_offset, dst, dst_offset, size)  # repacked weights: their GGUF bytes
            return
        data = src.storage[src_offset : src_offset + size]
        if src is dst and abs(src_offset - dst_offset) < size:  # torch refuses overlapping copies
            self.ledger.check(size, f"copying {size} bytes")
            data = data.clone()
        dst.storage[dst_offset : dst_offset + size].copy_(data)

    def _release(self, buf: Buffer) -> None:
        self._packed.pop(id(buf), None)
        super()._release(buf)

    def _overlapping(self, buf: Buffer, offset: int, size: int) -> list[tuple[int, tuple[int, int, int, int]]]:
        """The packed weights of ``buf`` that bytes [offset, offset + size) touch."""
        return [(start, rec) for start, rec in self._packed.get(id(buf), {}).items()
                if start < offset + size and offset < start + rec[3]]

    def _packed_blocks(self, node) -> torch.Tensor:
        """A quantized WEIGHT's bytes, packed in place the first time a graph reads it (the
        packed form takes the same bytes). A second view of them as another shape or type
        is refused: it would read the packed bytes as GGUF blocks."""
        handle, offset = node.attrs
        buf = self._buffers[handle]
        want = (int(node.dtype), math.prod(node.shape[:-1]), node.shape[-1], node.dtype.nbytes(node.shape))
        spans = self._packed.setdefault(id(buf), {})
        if spans.get(offset) != want:
            if buf.lent:  # a holder's copy: the host packed it, once, for every session; never here
                raise BackendError(
                    f"buffer {handle} holds a published model's shared weights, packed by the host "
                    f"as the model's own tensors; {node.dtype.name} {node.shape} at offset {offset} "
                    "is not one of them")
            if self._overlapping(buf, offset, want[3]):
                raise BackendError(
                    f"the bytes at buffer {handle} offset {offset} are already in use as another "
                    f"quantized weight; a second view of them as {node.dtype.name} {node.shape} "
                    "is not supported on this device")
            span = buf.storage[offset : offset + want[3]]
            span.copy_(qpack.pack(span, *want[:3]))
            spans[offset] = want
        return self._raw(node)

    # ------------------------------------------------------------ graphs
    def _weight_dtype(self, dtype: DType) -> torch.dtype:
        """Weights are computed in f32 on the CPU; on accelerators they keep a 16-bit form."""
        if self.torch_device.type == "cpu" or dtype is DType.F32:
            return torch.float32
        return torch.bfloat16 if dtype is DType.BF16 else torch.float16

    def _raw(self, node) -> torch.Tensor:
        """The bytes of a WEIGHT or STATE leaf in its buffer."""
        handle, offset = node.attrs
        return self._buffers[handle].storage[offset : offset + node.dtype.nbytes(node.shape)]

    def _leaf(self, node, plain: bool = True):
        """The value a WEIGHT or STATE leaf gives its readers; ``plain``: some reader needs a
        dense tensor (see ``Leaf.plain``), else MATMUL and GET_ROWS take it as stored."""
        if node.op is Op.STATE:
            return self._raw(node).view(TORCH_DTYPES[node.dtype]).view(node.shape)  # live view
        if node.dtype in (DType.F32, DType.I32):
            return self._stored(node)
        if not plain and self._int4(node):
            return self._cached((node,), lambda: int4cpu.pack(self._raw(node), node.dtype, node.shape,
                                                              self._stored(node)),
                                "int4", int4cpu.nbytes(node.shape))
        if not plain and self._int8(node):
            return self._cached((node,), lambda: int8cpu.pack(self._raw(node), node.dtype, node.shape),
                                "int8", int8cpu.nbytes(node.dtype, node.shape))
        if self.dequant_cache:
            return self._cached((node,), lambda: self._dequantized(node))
        if plain and (node.dtype.is_quantized or self.torch_device.type == "cpu"):
            return self._dequantized(node)  # for this compute only
        return self._stored(node)

    def _stored(self, node) -> torch.Tensor | kernels.Blocks:
        """A WEIGHT as uploaded, no copy: its blocks, or a view of its bytes (offsets are
        ALIGNMENT-aligned, so every view is aligned)."""
        if node.dtype.is_quantized:
            data = self._packed_blocks(node) if self._packs else self._raw(node)
            return kernels.Blocks(data, int(node.dtype), node.shape)
        return self._raw(node).view(TORCH_DTYPES[node.dtype]).view(node.shape)

    def _fused_weight(self, step: FusedMatmul) -> torch.Tensor | tuple:
        """The members' weights for ``kernels.fused_matmul``: one view where they lie one
        after another in a buffer in one plain dtype (q, k, v uploaded in order), else each
        as stored; with the dequant cache, dequantized and concatenated."""
        ws = step.weights
        if all(self._compact(w) for w in ws):
            return tuple(self._leaf(w, plain=False) for w in ws)
        if self.dequant_cache and any(w.dtype not in (DType.F32, DType.I32) for w in ws):
            return self._cached(ws, lambda: torch.cat([self._dequantized(n) for n in ws]))
        (handle, start), dtype = ws[0].attrs, ws[0].dtype
        end = start
        for w in ws:
            if w.attrs != (handle, end) or w.dtype is not dtype:
                break
            end += dtype.nbytes(w.shape)
        else:
            if not dtype.is_quantized:
                span = self._buffers[handle].storage[start:end]
                return span.view(TORCH_DTYPES[dtype]).view(sum(step.widths), ws[0].shape[1])
        return tuple(self._stored(w) for w in ws)

    def _int4(self, node) -> bool:
        """Whether a quantized weight is computed through torch's int4 CPU product."""
        return self.cpu_int4 and not self._packs and int4cpu.usable(node.dtype, node.shape)

    def _compact(self, node) -> bool:
        """Whether a CPU holds a quantized weight in a compact form (int4 or int8)."""
        return self._int4(node) or self._int8(node)

    def _int8(self, node) -> bool:
        """Whether a quantized weight is held as int8 values and f32 scales (a CPU host's
        form for the types the int4 product does not take, unless the dequant cache is on)."""
        return (self.torch_device.type == "cpu" and not self._packs and not self.dequant_cache
                and not self._int4(node) and int8cpu.usable(node.dtype, node.shape))

    def _dequantized(self, node) -> torch.Tensor:
        if self._packs and node.dtype.is_quantized:
            w = qmatmul.dequantize(self._packed_blocks(node), int(node.dtype),
                                   math.prod(node.shape[:-1]), node.shape[-1])
            return w.reshape(node.shape).to(self._weight_dtype(node.dtype))
        return dequantize(self._raw(node), node.dtype, node.shape).to(self._weight_dtype(node.dtype))

    def _compile(self, graph: Graph) -> Program:
        # a compiled step on a CPU takes the GPU's form too: index operands checked on the
        # host before launch, fixed-shape attention, so the walk traces as one graph
        prog = compile_program(graph, self.torch_device.type != "cpu" or self.compile, self._weight_dtype)
        if self.dequant_cache:
            self._constants(prog)  # dequantize now, not on the first compute
        else:  # a CPU's compact forms now too (SmolLM2's int4 forms: 0.25 s of a first prompt)
            for step in prog.steps:
                if isinstance(step, Leaf) and step.read and not step.plain and self._compact(step.node):
                    self._leaf(step.node, plain=False)
                elif isinstance(step, FusedMatmul) and all(self._compact(w) for w in step.weights):
                    self._fused_weight(step)
        return prog

    def _constants(self, prog: Program) -> dict[int, object]:
        """node id -> the weight or state each leaf or fused product reads (eagerly: per
        compute, so per-use dense copies are freed with it; on CUDA per captured step)."""
        out = {}
        for nid, step in enumerate(prog.steps):
            if isinstance(step, Leaf) and step.read:
                out[nid] = self._leaf(step.node, step.plain)
            elif isinstance(step, FusedMatmul):
                out[nid] = self._fused_weight(step)
        return out

    def _execute(self, reg: Registered, tensors: dict[str, torch.Tensor],
                 constants: dict[int, torch.Tensor], greedy: bool = False) -> list[torch.Tensor]:
        """Walk the program once; ``tensors`` are the inputs, already on the device, and
        ``constants`` the weights and states (see ``_constants``)."""
        values: list = []
        parts: dict[int, torch.Tensor] = {}  # later members of fused products, by node id
        memo: dict = {}  # work shared by the run's kernels (see OpSpec.memo)
        for nid, step in enumerate(reg.program.steps):
            if isinstance(step, Step):
                args = [values[i] for i in step.inputs]
                kernel = kernels.sample_greedy if greedy and step.op is Op.SAMPLE else step.kernel
                try:
                    check_indices(step.checks, args)
                    if step.memo_key is None:
                        values.append(kernel(*args, *step.attrs))
                    else:
                        values.append(kernel(*args, *step.attrs, memo=memo, key=step.memo_key))
                except BackendError as e:
                    raise BackendError(f"{reg.graph.nodes[nid].describe(nid)}: {e}") from None
                except (RuntimeError, ValueError, IndexError) as e:
                    if isinstance(e, torch.OutOfMemoryError) or _OUT_OF_MEMORY in str(e):
                        raise  # the OS limit: the host reports it as such (session.error_for)
                    raise BackendError(f"{reg.graph.nodes[nid].describe(nid)} failed: {e}") from None
            elif isinstance(step, FusedMatmul):
                y = kernels.fused_matmul(values[step.x], constants[nid], step.widths)
                parts.update(zip(step.members[1:], y[1:]))
                values.append(y[0])
            elif isinstance(step, Part):
                values.append(parts.pop(nid))
            elif isinstance(step, Input):
                t = tensors[step.name]
                if step.dtype is DType.BF16:
                    t = t.view(torch.bfloat16)
                values.append(t.float() if step.dtype in (DType.F16, DType.BF16) else t)
            else:
                values.append(constants.get(nid))  # None: a weight only fused products read
            for i in reg.program.releases[nid]:
                values[i] = None
        return [values[o] for o in reg.program.outputs]

    def _run(self, reg: Registered, inputs: dict[str, object], bounds: dict[str, int | None]) -> list[torch.Tensor]:
        """``inputs``: numpy arrays, or device tensors where fed (see Backend.compute)."""
        prog = reg.program
        if self._pinned is not None:
            for a in inputs.values():
                if isinstance(a, np.ndarray):
                    self._pinned.cover(a)
        n_tokens = next((inputs[name].shape[shape.index(T)] for name, (shape, _) in reg.inputs.items()
                         if T in shape), 0)  # as _bind checked it
        for name, limit, what in prog.index_checks:
            limit = n_tokens if limit == T else limit
            ids = inputs[name]
            if isinstance(ids, torch.Tensor):  # fed: safe by construction, or checked here
                if bounds.get(name) is not None and bounds[name] <= limit:
                    continue
                ids = ids.cpu().numpy()
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limit):
                raise BackendError(f"{what} index out of range: input {name!r} must lie in [0, {limit})")
        # the host sees the sampling params: a greedy step needs no sort of the vocabulary
        greedy = bool(prog.sample_params) and all(SampleArgs.unpack(inputs[n]).greedy
                                                  for n in prog.sample_params)
        prog.runs += 1
        # a fixed-shape graph is recorded (and compiled) from its second run on: one that
        # runs once (a transformers generate() registers one per cache length) costs no
        # capture and no compile
        replays = prog.device_safe and self.cuda_graphs  # its compiled steps live in CapturedSteps
        if replays and (prog.runs > 1 if prog.fixed else capturable(n_tokens)):
            outs = self._replay(reg, inputs, n_tokens, greedy)
        else:
            dev = self.torch_device
            tensors = {
                name: a if isinstance(a, torch.Tensor)
                else torch.from_numpy(a if a.flags.writeable else a.copy()).to(dev)
                for name, a in inputs.items()
            }
            constants = self._constants(prog)
            key = (n_tokens, greedy)
            # compile_cpu, or a GPU graph that is never recorded (a fixed-shape one's first
            # run is eager: _replay compiles it from the second)
            if self.compile and not replays and self._decode(prog, n_tokens) and key not in self._uncompiled:
                step = prog.captured.get(key) or self._compiled(reg, n_tokens, greedy)
                try:
                    outs = step(reg, tensors, constants, greedy)
                    prog.captured[key] = step
                    return outs
                except Exception as e:  # noqa: BLE001 - a compiler failure must not fail the step
                    self._compile_failed(key, e)
            outs = self._execute(reg, tensors, constants, greedy)
        return outs

    def _host_outputs(self, reg: Registered, outputs: list[torch.Tensor],
                      out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """One copy per output node, however often the graph lists it (see Scratch), made
        straight into ``out[i]`` where it fits (from a GPU: the device's copy lands there,
        no host copy after it). Otherwise on a CPU that copy is made here (the tensor may be
        the executor's own: a cache view, an input); from a GPU, ``cpu()`` is that copy."""
        host: dict[int, np.ndarray] = {}
        result = []
        for i, (t, o) in enumerate(zip(outputs, reg.program.outputs)):
            dtype = reg.graph.nodes[o].dtype
            dest = out[i] if out is not None else None
            if o in host:  # the node listed again: its own slot gets the bytes too
                if fits(dest, host[o].dtype, host[o].size):
                    np.copyto(dest.reshape(host[o].shape), host[o])
                    result.append(dest)
                else:
                    result.append(host[o])
                continue
            wire = _wire(t, dtype)
            if fits(dest, NUMPY_DTYPES[dtype], wire.numel()):
                if self._pinned is not None:
                    self._pinned.cover(dest)
                sink = torch.from_numpy(dest.view(np.int16) if dtype is DType.BF16 else dest)
                sink.view(-1).copy_(wire.reshape(-1))
                arr = dest
            else:
                arr = _numpy(wire.cpu(), dtype)
                arr = arr.copy() if wire.device.type == "cpu" else np.ascontiguousarray(arr)
            host[o] = arr
            result.append(arr)
        return result

    def _pending(self, reg: Registered, outputs: list[torch.Tensor],
                 out: Sequence[np.ndarray] | None = None) -> Pending:
        """On CUDA the host returns as soon as the step is queued: the outputs are copied
        into pinned memory behind it, so the next step can be queued before they are read
        and the GPU never waits for the host between steps. Large outputs (logits of a
        chunk, a model's returned KV cache) are read back at once, into ``out`` where it
        is given: their copy is the step's cost anyway, and pinned memory is kept for
        small ones (which go inline, so ``out`` has nothing to save there)."""
        if self.torch_device.type != "cuda" or sum(t.nbytes for t in outputs) > ASYNC_MAX_BYTES:
            return super()._pending(reg, outputs, out)
        copies = []
        for t, o in zip(outputs, reg.program.outputs):
            dtype = reg.graph.nodes[o].dtype
            src = _wire(t.detach(), dtype)
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            host.copy_(src, non_blocking=True)  # queued before any later step overwrites src
            copies.append((host, dtype))
        done = torch.cuda.Event()
        done.record()
        return CopyingBack(done, copies)

    def _compiled(self, reg: Registered, n_tokens: int, greedy: bool) -> Callable:
        """The walk (``_execute``) over ``reg``'s program compiled on its first call: loaded
        from the step store when a session compiled it before, else compiled there and then,
        the guest told first (minutes on a CPU, tens of seconds on a GPU)."""
        if n_tokens == 0:
            what = "compiling a fixed-shape graph (its second run in this session)"
        else:
            kind = ("decode" if n_tokens == 1 else f"{n_tokens}-sequence decode"
                    if self._decode(reg.program, n_tokens) else f"{n_tokens}-token prefill")
            what = (f"compiling {kind} graph ({'greedy' if greedy else 'sampling'} step, "
                    "first use of this model on this host)")
        return inductor.Compiled(self._execute, self._steps, self._step_description(reg, n_tokens, greedy),
                                 lambda: self.on_compile(what))

    @staticmethod
    def _decode(prog: Program, n_tokens: int) -> bool:
        """Whether a step of ``n_tokens`` is a decode step: one token, or one sampled token
        for each of ``n_tokens`` sequences (a batched graph's decode step)."""
        return n_tokens == 1 or n_tokens == prog.sampled_rows

    def _step_description(self, reg: Registered, n_tokens: int, greedy: bool) -> str:
        """What the walk traced for a step depends on beyond its arguments' shapes and
        types (inductor.Compiled's digest): the graph, the step, this executor's settings
        and device, and the code that walks and compiles it."""
        dev = self.torch_device
        hardware = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else platform.machine()
        return repr((_numbered_by_use(reg.graph.nodes), reg.graph.outputs, n_tokens, greedy,
                     self.dequant_cache, self.cpu_int4, self._packs, dev.type, hardware, _code_version()))

    def _compile_failed(self, key: tuple[int, bool], e: Exception) -> None:
        """Compiling a step failed (no C++ compiler, an op Inductor cannot take): said once,
        and steps of this kind run their kernels as they are (on CUDA still recorded) from
        now on. Only this kind: another (the one-sequence decode) may compile fine."""
        n_tokens, greedy = key
        log.warning("compiling a %d-token %s step failed (%s); running its kernels as they are "
                    "instead", n_tokens, "greedy" if greedy else "sampling",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        self._uncompiled.add(key)

    def _replay(self, reg: Registered, inputs: dict[str, object], n_tokens: int,
                greedy: bool) -> list[torch.Tensor]:
        prog = reg.program
        versions = tuple(self._buffers[h].version for h in prog.weight_buffers)
        key = (n_tokens, greedy)
        step = prog.captured.get(key)
        if step is None or step.versions != versions:
            constants = self._constants(prog)
            dtypes = {name: dtype for name, (_, dtype) in reg.inputs.items()}

            def run(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
                return self._execute(reg, t, constants, greedy)

            step = None
            # Inductor fuses the elementwise chains (norms, RoPE, gates) into a few kernels
            # per layer; the CUDA graph then removes the launch overhead. Compiled: decode
            # steps (one token, or one sampled token for each of B sequences: a batched
            # decode, where the eager kernels took half of a 16-row step of a 1B on an
            # H200), and with compile="all" the padded prefill chunks (the engine warms
            # those up). Steps of 2..8 tokens (short prompts, unpadded) are recorded
            # eagerly: their one run costs far less than a compile per length. A
            # fixed-shape graph run twice (a torch frontend model's forward) is compiled too.
            if self.compile and key not in self._uncompiled and (
                    self._decode(prog, n_tokens) or prog.fixed
                    or self.compile_prefill and n_tokens > CAPTURE_MAX_DECODE):
                try:
                    compiled = self._compiled(reg, n_tokens, greedy)
                    step = CapturedStep(lambda t: compiled(reg, t, constants, greedy), inputs, dtypes,
                                        self.torch_device, versions)
                except Exception as e:  # noqa: BLE001 - a compiler failure must not fail the step
                    self._compile_failed(key, e)
            step = step or CapturedStep(run, inputs, dtypes, self.torch_device, versions)
            prog.captured[key] = step
        return step(inputs)


DEFAULT_COMPILE_CACHE = "~/.cache/apir/compile"


def use_compile_cache(directory: str) -> Path:
    """Keep Inductor's compiled programs (FX graphs, kernels, AOTAutograd) under
    ``directory``, in a subdirectory per torch and apir version, made private (0700): a
    later session or process with the same graph, shapes, dtypes and device loads them
    instead of compiling. Inductor reads the variable at each use, so it holds from now on."""
    from ... import __version__

    path = Path(directory).expanduser() / f"torch-{torch.__version__}-apir-{__version__}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


@functools.cache
def _code_version() -> str:
    """A digest of apir's own source and torch's and Triton's versions: a compiled step
    saved by other code is never loaded."""
    try:
        import triton
    except ImportError:
        triton = None
    h = hashlib.sha256(f"{torch.__version__} {getattr(triton, '__version__', None)}".encode())
    root = Path(__file__).resolve().parents[2]  # the apir package
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def _numbered_by_use(nodes: tuple[Node, ...]) -> tuple[Node, ...]:
    """``nodes`` with each buffer handle of a WEIGHT or STATE leaf replaced by the order of
    its first use. A handle is the session's count of its allocations, not the graph's: a
    remote guest's weights were buffer 2 where a native process's were buffer 1 (the same
    model, the same graph), and every step compiled again instead of loading the other's."""
    first: dict[int, int] = {}
    return tuple(dataclasses.replace(n, attrs=(first.setdefault(n.attrs[0], len(first)), *n.attrs[1:]))
                 if n.op in (Op.WEIGHT, Op.STATE) else n for n in nodes)


def _wire(t: torch.Tensor, dtype: DType) -> torch.Tensor:
    """``t`` (on its device) in the form its node's dtype travels in: BF16 as raw bits."""
    if dtype is DType.BF16:
        return t.to(torch.bfloat16).view(torch.int16)
    return t.to(TORCH_DTYPES[dtype])


def _numpy(host: torch.Tensor, dtype: DType) -> np.ndarray:
    return host.numpy().view(np.uint16) if dtype is DType.BF16 else host.numpy()


class CopyingBack(Pending):
    """Outputs being copied into pinned host memory; ``result()`` waits for the copy."""

    def __init__(self, done: torch.cuda.Event, copies: list[tuple[torch.Tensor, DType]]) -> None:
        super().__init__()
        self._done, self._copies = done, copies

    def ready(self) -> bool:
        return self._copies is None or self._done.query()

    def result(self) -> list[np.ndarray]:
        if self._copies is not None:
            try:
                self._done.synchronize()
            except RuntimeError as e:  # a kernel of the step failed on the device
                self._error = BackendError(f"the step failed on the GPU: {str(e).splitlines()[0]}")
            else:
                self._outputs = [_numpy(host, dtype) for host, dtype in self._copies]
            self._copies = None
        return super().result()
