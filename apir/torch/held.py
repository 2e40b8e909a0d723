"""Outputs that stay on the apir host until the guest reads them (``keep_outputs``).

A transformers forward returns its KV cache: at batch 32 x 128 tokens, SmolLM2's is 60
tensors, 180 MiB a call, and the next call sends it straight back. Inductor keeps those on
the GPU; so does apir with ``keep_outputs``: each float output of at least ``KEEP_MIN_BYTES``
comes back as a ``HostTensor``, a CPU tensor of the right shape and dtype whose bytes are
in a buffer on the host. Fed to a compiled graph again, it is copied there on the host's
device (``copy_tensor``); read by anything else (``y + 1``, ``y.tolist()``, printing), it
is downloaded once and computed on as a plain tensor.

How it fits Dynamo and AOTAutograd: ``HostTensor`` is a traceable wrapper subclass whose
only inner tensor is ``_key``, a 0-d int64 naming its entry in this module's registry. Its
``__torch_dispatch__`` replaces it by ``apir::held(key, shape, dtype)`` before running an
op, so a compiled graph that reads one sees a placeholder (the key) and a ``held`` node,
which ``apir.torch.runtime`` lowers to a STATE leaf it fills before each step; in PyTorch
(eager, or a graph that runs on the guest) ``held`` downloads the bytes.

Byte layout: the kept outputs of one call share one host buffer (a ``_Block``), each at a
multiple of ``ALIGN`` bytes, as float32 (the dtype apir computes in; the tensor converts on
download). When the last HostTensor in a block is collected, the block goes back to the
session's pool: reused by a later call's outputs of its size class, freed past
``POOL_BLOCKS`` idle ones.

Any op that may write a HostTensor's bytes or return a view of them (``add_``, ``view``,
``[0]``) makes the guest's downloaded copy the authoritative one: fed back, it is uploaded
rather than copied on the host.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils._pytree as pytree

from ..backends import Backend, BufferPurpose
from ..errors import ApirError
from ..graph import DType

KEEP_MIN_BYTES = 1 << 20  # smaller ones come back in the reply: cheaper than the calls that keep one
ALIGN = 256
POOL_BLOCKS = 4  # freed blocks a session keeps for reuse (a fixed-shape forward reuses one)


@dataclass
class _Block:
    """One host buffer holding the kept outputs of one call."""

    pool: Pool
    handle: int
    size: int
    live: int  # HostTensor entries still in it

    def release(self) -> None:
        self.live -= 1
        if self.live == 0:
            self.pool.returned.append(self)


def size_class(size: int) -> int:
    """``size`` rounded up to one of 8 sizes per doubling (at most 1/8 more): a cache that
    grows a token a call takes the block its call before last freed."""
    step = max(1 << max(size.bit_length() - 4, 0), ALIGN)
    return -(-size // step) * step


class Pool:
    """A session's blocks: allocated on its backend in size classes, reused by class, freed
    past ``POOL_BLOCKS``.

    A block comes back when its last HostTensor is collected, which may happen inside any
    allocation, a backend call's included (the garbage collector): it is only appended to
    ``returned`` then, and reused or freed at the next ``take``, never sent to the backend
    from there (a remote backend's frame would be cut by another)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.returned: collections.deque[_Block] = collections.deque()
        self._free: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # size -> handles
        self._count = 0
        self.allocated = 0  # blocks allocated on the backend (what tests read)

    def take(self, size: int, live: int) -> _Block:
        for block in self.returned:
            self._free.setdefault(block.size, []).append(block.handle)
        self._count += len(self.returned)
        self.returned.clear()
        size = size_class(size)
        handles = self._free.get(size)
        if handles:
            handle = handles.pop()
            self._count -= 1
            if not handles:
                del self._free[size]
        else:
            handle = self.backend.alloc_buffer(size, BufferPurpose.KV)
            self.allocated += 1
        while self._count > POOL_BLOCKS:  # the classes returned longest ago go first
            oldest, handles = next(iter(self._free.items()))
            self._release(handles.pop(0))
            if not handles:
                del self._free[oldest]
            self._count -= 1
        return _Block(self, handle, size, live)

    def _release(self, handle: int) -> None:
        try:
            self.backend.free_buffer(handle)
        except (ApirError, OSError):  # the backend is gone: so is the buffer
            pass

    def idle_bytes(self) -> int:
        """Bytes of the blocks the pool holds for reuse (none of them in use)."""
        return sum(size * len(h) for size, h in self._free.items()) + sum(b.size for b in self.returned)


@dataclass
class _Entry:
    """What a HostTensor's key names."""

    block: _Block
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    local: torch.Tensor | None = None  # the downloaded copy
    guest_owned: bool = False  # the guest may have written ``local``: it, not the host's bytes, is the value
    refs: int = 0  # HostTensor objects naming this entry

    @property
    def nbytes(self) -> int:
        return DType.F32.nbytes(self.shape)

    def materialize(self) -> torch.Tensor:
        if self.local is None:
            raw = self.block.pool.backend.get_tensor(self.block.handle, self.offset, self.nbytes)
            data = torch.from_numpy(np.frombuffer(raw, np.float32).copy()).reshape(self.shape)
            self.local = data if self.dtype is torch.float32 else data.to(self.dtype)
        return self.local


_entries: dict[int, _Entry] = {}
_keys = itertools.count(1)


def _drop(key: int) -> None:
    entry = _entries.get(key)
    if entry is None:
        return
    entry.refs -= 1
    if entry.refs == 0:
        del _entries[key]
        entry.block.release()


def entry(key: torch.Tensor) -> _Entry:
    """The entry a HostTensor's key (as a compiled graph receives it) names."""
    found = _entries.get(int(key))
    if found is None:
        raise ApirError("a tensor kept on the apir host was freed while still in use")
    return found


def live() -> int:
    """HostTensor entries alive in this process (what tests read)."""
    return len(_entries)


@torch.library.custom_op("apir::held", mutates_args=())
def held(key: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A HostTensor's value in PyTorch: its bytes, downloaded once."""
    return entry(key).materialize()


@held.register_fake
def _held_fake(key: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


HELD = torch.ops.apir.held.default


class HostTensor(torch.Tensor):
    """A CPU tensor whose bytes are on the apir host (see the module's doc)."""

    _key: torch.Tensor

    @staticmethod
    def __new__(cls, key: torch.Tensor, shape, dtype: torch.dtype) -> HostTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device="cpu")
        t._key = key
        if type(key) is torch.Tensor:  # a real key (not a fake one Dynamo traces with)
            k = int(key)
            if k in _entries:
                _entries[k].refs += 1
                weakref.finalize(t, _drop, k).atexit = False
        return t

    def __init__(self, key: torch.Tensor, shape, dtype: torch.dtype) -> None:
        pass

    def __tensor_flatten__(self):
        # no sizes in the context: Dynamo compares it exactly, so a cache growing by one
        # token a call would recompile every call instead of turning dynamic
        return ["_key"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride) -> HostTensor:
        return HostTensor(inner["_key"], outer_size, dtype)

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"HostTensor({self.materialize()!r})"

    def materialize(self) -> torch.Tensor:
        """The value as a plain tensor (downloaded the first time)."""
        return HELD(self._key, list(self.shape), self.dtype)

    def numpy(self, *, force: bool = False) -> np.ndarray:
        return self.materialize().numpy(force=force)

    def tolist(self):  # PyTorch refuses both for a subclass: they read its (absent) storage
        return self.materialize().tolist()

    def __reduce_ex__(self, protocol):  # torch.save, pickle: the value, as a plain tensor
        return self.materialize().__reduce_ex__(protocol)

    def data_ptr(self) -> int:
        raise RuntimeError("this tensor's bytes are on the apir host (keep_outputs): "
                           "t.materialize() gives a plain tensor to take the address of")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        schema = func._schema
        writes = schema.is_mutable or any(r.alias_info is not None for r in schema.returns)
        touched: list[HostTensor] = []

        def plain(a):
            if isinstance(a, HostTensor):
                touched.append(a)
                return HELD(a._key, list(a.shape), a.dtype)
            return a

        out = func(*pytree.tree_map(plain, args), **pytree.tree_map(plain, kwargs or {}))
        if writes:
            for a in touched:
                if type(a._key) is torch.Tensor and int(a._key) in _entries:
                    _entries[int(a._key)].guest_owned = True
        return out


def keep(pool: Pool, staged: list[tuple[int, tuple[int, ...], torch.dtype]]) -> list[HostTensor]:
    """HostTensors for one call's kept outputs, copied on the host from the staging buffers
    the step wrote them to: ``staged`` is (staging buffer, shape, dtype) per output."""
    if not staged:
        return []
    places, size = [], 0
    for _, shape, _ in staged:
        places.append(size)
        size += -(-DType.F32.nbytes(shape) // ALIGN) * ALIGN
    block = pool.take(size, len(staged))
    out = []
    for (staging, shape, dtype), at in zip(staged, places):
        e = _Entry(block, at, shape, dtype)
        pool.backend.copy_tensor(staging, 0, block.handle, at, e.nbytes)
        key = next(_keys)
        _entries[key] = e
        out.append(HostTensor(torch.tensor(key), shape, dtype))
    return out


def stage(pool: Pool, key: torch.Tensor, staging: int) -> None:
    """Fill a step's staging buffer with a HostTensor's value: a copy on the host, or an
    upload where the guest's copy is the value (written by the guest, or another session's)."""
    e = entry(key)
    if e.guest_owned or e.block.pool.backend is not pool.backend:
        pool.backend.set_tensor(staging, 0, e.materialize().detach().to(torch.float32).contiguous().numpy())
    else:
        pool.backend.copy_tensor(e.block.handle, e.offset, staging, 0, e.nbytes)
