"""Models the host's operator publishes (``apir host --model NAME=PATH``): their weights
are loaded by the host itself, once, and lent read-only to every session that asks for
them by name, instead of each guest uploading its own copy. SECURITY.md says why only
the operator's models are shared.

The copy is a sealed memfd the daemon fills from the GGUF (its tensors laid out as a
guest's engine lays out its own upload, ``apir.models.layout``), so no process can write
it again; a session's worker gets the fd from the daemon when its guest asks
(``OpenPublished``) and maps it read-only. Workers are separate processes: one that
crashes unmaps its view and nothing else; the pages live while the daemon or any worker
holds the fd or a mapping. The daemon counts which sessions use which copy and closes
its fd ``keep_alive`` seconds after the last one ended.

On a CPU the sessions compute on the mapping itself: one copy in memory however many
sessions use it. Where they would also keep dequantized f32 forms of the 16-bit and
quantized weights (a CPU host with ``ExecutorConfig.dequant_cache``, an opt-in: ~6x the file),
the daemon makes those once too, into a second sealed memfd that the sessions' workers map
beside the first (its layout: ``apir.backends.forms``). A GPU session copies the mapping
to its device (no upload from the guest, but a device copy per session): CUDA memory
cannot be made before the fork (CUDA does not survive one), and a copy one process
exports to the others by CUDA IPC must be held by a process that runs no session, whose
crash would otherwise take the copy, and every session's graphs, with it; that holder is
not built yet.

The daemon and a worker speak over the worker's socketpair (SOCK_SEQPACKET):

    worker -> daemon   b"want\\0" + name (UTF-8, at most NAME_MAX bytes)
    daemon -> worker   b"ok" + i64 size + 32-byte layout digest + i64 forms size (0: none),
                    with the memfd and the forms' memfd if any (SCM_RIGHTS)
                    or b"no" + a message for the guest (UTF-8)
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..backends.base import BackendError
from ..errors import ApirError

log = logging.getLogger("apir.host")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
NAME_MAX = 128
WANT = b"want\0"
REQUEST_MAX = len(WANT) + NAME_MAX
_GRANT = struct.Struct("<q32sq")  # after b"ok": size, layout digest, forms size
FORM_CHUNK = 1 << 22  # elements dequantized at a time: the daemon's scratch stays small
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
KEEP_ALIVE = 300.0  # seconds a copy outlives its last session (Ollama's keep_alive default)


@dataclass(frozen=True)
class PublishedModel:
    name: str
    path: Path

    @staticmethod
    def parse(spec: str) -> PublishedModel:
        """``NAME=PATH``, or a GGUF ``PATH`` whose file name (less ``.gguf``) is the name. A
        guest's engine asks for its own GGUF's file name, which ``PATH``'s also answers to."""
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).stem, spec
        if not NAME.fullmatch(name):
            raise ApirError(f"--model {spec!r}: a model's name is 1 to {NAME_MAX} letters, digits "
                            "and . _ + - (not starting with one of those four)")
        if not Path(path).is_file():
            raise ApirError(f"--model {spec!r}: no file {path}")
        return PublishedModel(name, Path(path))


@dataclass
class SharedCopy:
    fd: int  # the sealed memfd
    size: int
    digest: bytes  # apir.models.layout.layout_digest of its tensors
    forms_fd: int = -1  # the sealed memfd of its dequantized forms (-1: not made)
    forms_size: int = 0
    users: set[int] = field(default_factory=set)  # sessions that opened it, until they end
    idle_since: float = 0.0  # when its last user ended


def load_copy(model: PublishedModel, forms: bool = False, int4: bool = False) -> SharedCopy:
    """Read ``model``'s GGUF into a sealed memfd, laid out as a guest's engine uploads it;
    with ``forms``, its weights' dequantized f32 forms into a second one (see above), but
    with ``int4`` (``ExecutorConfig.cpu_int4``) none of the weights the sessions compute
    through torch's int4 product instead: they make, and are charged, that form themselves."""
    from ..models.gguf_file import GGUFFile
    from ..models.layout import layout_digest, weight_slots

    gguf = GGUFFile(model.path)
    slots, size = weight_slots(gguf.tensors.values())
    fd = _sealed(f"apir-model-{model.name}", size, (
        (slots[t.name].offset, memoryview(t.data).cast("B")) for t in gguf.tensors.values()))
    try:
        forms_fd, forms_size = _forms(model.name, gguf, slots, int4) if forms else (-1, 0)
    except BaseException:
        os.close(fd)
        raise
    return SharedCopy(fd, size, layout_digest(slots), forms_fd, forms_size)


def _sealed(name: str, size: int, pieces) -> int:
    """A memfd of ``size`` bytes holding ``pieces`` ((offset, bytes), ...), sealed: nobody
    writes it again, nor resizes it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        for offset, data in pieces:
            while data:  # pwrite may write less than asked
                n = os.pwrite(fd, data, offset)
                data, offset = data[n:], offset + n
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _forms(name: str, gguf, slots, int4: bool) -> tuple[int, int]:
    """The f32 forms of ``gguf``'s 16-bit and quantized weights (but, with ``int4``, those
    a session computes in int4) as a sealed memfd (fd, size; ``apir.backends.forms``),
    dequantized by the executor's own CPU decoder, so a session reads the very values it
    would have made itself."""
    import numpy as np
    import torch

    from ..backends import forms
    from ..backends.local import int4cpu
    from ..backends.local.dequant import dequantize
    from ..graph import DType

    tensors = [t for t in gguf.tensors.values() if t.dtype not in (DType.F32, DType.I32)
               and not (int4 and int4cpu.usable(t.dtype, tuple(t.shape)))]
    table, offsets, size = forms.plan([(slots[t.name].offset, int(t.dtype), int(np.prod(t.shape)))
                                       for t in tensors])

    def pieces():
        yield 0, table
        for t, offset in zip(tensors, offsets):
            k = t.shape[-1] if t.shape else 1
            per_row = t.dtype.nbytes((1, k))
            rows = t.data.size // per_row
            step = max(1, FORM_CHUNK // k)
            for r in range(0, rows, step):
                n = min(step, rows - r)
                raw = torch.from_numpy(t.data[r * per_row : (r + n) * per_row].copy())  # writable: torch asks
                values = dequantize(raw, t.dtype, (n, k)).to(torch.float32).numpy()
                yield offset + 4 * r * k, memoryview(np.ascontiguousarray(values)).cast("B")

    return _sealed(f"apir-forms-{name}", size, pieces()), size


class Shelf:
    """The daemon's published models and their resident copies."""

    def __init__(self, models: tuple[PublishedModel, ...], keep_alive: float, forms: bool = False,
                 int4: bool = False) -> None:
        """``forms``: the sessions keep dequantized forms of weights (a CPU host's dequant cache),
        so the daemon makes them once, with each copy; ``int4``: not of those the sessions
        compute in int4 (``load_copy``)."""
        self.models = {p.name: p for p in models}
        self.forms, self.int4 = forms, int4
        # a guest's engine asks by its file's name: NAME=PATH answers to PATH's file name too
        self.aliases = {**{p.path.stem: p.name for p in models}, **{n: n for n in self.models}}
        self.keep_alive = keep_alive  # negative: loaded at start, kept for the daemon's life
        self.copies: dict[str, SharedCopy] = {}
        self.loads = 0  # copies read from disk
        if keep_alive < 0:
            for name in self.models:
                self._load(name)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.models))

    def resident_bytes(self) -> int:
        return sum(c.size + c.forms_size for c in self.copies.values())

    def fds(self) -> list[int]:
        return [fd for c in self.copies.values() for fd in (c.fd, c.forms_fd) if fd >= 0]

    def acquire(self, name: str, session: int) -> SharedCopy:
        """Model ``name``'s copy, loaded if it is not resident, now used by ``session``."""
        name = self.aliases.get(name, name)
        if name not in self.models:
            listed = ", ".join(self.names()) or "none"
            raise BackendError(f"the host publishes no model named {name[:NAME_MAX]!r} (published: {listed}); "
                               "upload the weights instead")
        copy = self.copies.get(name) or self._load(name)
        copy.users.add(session)
        return copy

    def _load(self, name: str) -> SharedCopy:
        t0 = time.monotonic()
        copy = self.copies[name] = load_copy(self.models[name], self.forms, self.int4)
        self.loads += 1
        log.info("published model %s loaded: %.1f MiB%s in %.1fs", name, copy.size / 2**20,
                 f" and {copy.forms_size / 2**20:.1f} MiB of dequantized forms" if copy.forms_size else "",
                 time.monotonic() - t0)
        return copy

    def release(self, session: int, now: float) -> None:
        """``session`` ended: it uses no copy any more."""
        for copy in self.copies.values():
            if session in copy.users:
                copy.users.discard(session)
                if not copy.users:
                    copy.idle_since = now

    def expire(self, now: float) -> None:
        """Close the copies nobody has used for ``keep_alive`` seconds."""
        if self.keep_alive < 0:
            return
        for name, copy in list(self.copies.items()):
            if not copy.users and now - copy.idle_since >= self.keep_alive:
                _close(copy)
                del self.copies[name]
                log.info("published model %s unloaded: unused for %gs", name, self.keep_alive)

    def close(self) -> None:
        for copy in self.copies.values():
            _close(copy)
        self.copies.clear()

    def answer(self, pool: socket.socket, session: int, data: bytes) -> bool:
        """Answer a worker's request ``data`` on its socketpair ``pool``; False: it is not a
        request (the worker is not to be trusted: stop listening to it) or cannot be sent."""
        if not data.startswith(WANT) or len(data) > REQUEST_MAX:
            return False
        name = data[len(WANT) :].decode(errors="replace")
        fds: list[int] = []
        try:
            copy = self.acquire(name, session)
            reply = b"ok" + _GRANT.pack(copy.size, copy.digest, copy.forms_size)
            fds = [copy.fd] + ([copy.forms_fd] if copy.forms_fd >= 0 else [])
        except (BackendError, ApirError, OSError) as e:  # a missing or unreadable file too
            if not isinstance(e, BackendError):
                log.warning("published model %s cannot be loaded: %s", name, e)
                e = BackendError(f"the host cannot load its published model {name!r}")
            reply = b"no" + str(e).encode()
        try:  # one small message into an empty buffer (the worker waits for it): never blocks
            socket.send_fds(pool, [reply], fds, socket.MSG_DONTWAIT)
        except OSError:
            return False
        return True


def _close(copy: SharedCopy) -> None:
    for fd in (copy.fd, copy.forms_fd):
        if fd >= 0:
            os.close(fd)


class Grant(NamedTuple):
    """A published model as a worker maps it: its weights, read-only, their layout digest,
    and their dequantized forms (None: the daemon made none)."""

    data: memoryview
    digest: bytes
    forms: memoryview | None


def ask(pool: socket.socket, name: str, timeout: float) -> Grant:
    """In a worker: the daemon's copy of published model ``name``, mapped read-only; a
    BackendError says why not."""
    raw = name.encode()
    if not NAME.fullmatch(name) or len(raw) > NAME_MAX:
        raise BackendError(f"{name[:NAME_MAX]!r} is not a model name (1 to {NAME_MAX} letters, "
                           "digits and . _ + -)")
    pool.settimeout(timeout)
    pool.send(WANT + raw)
    data, fds, _, _ = socket.recv_fds(pool, 4096, 2)  # the copy, and its forms if any
    if data.startswith(b"no"):
        for fd in fds:
            os.close(fd)
        raise BackendError(data[2:].decode(errors="replace"))
    try:
        if not data.startswith(b"ok") or len(data) != 2 + _GRANT.size:
            raise ApirError("the daemon answered a published model request with nonsense")
        size, digest, forms_size = _GRANT.unpack_from(data, 2)
        if len(fds) != 1 + (forms_size > 0):
            raise ApirError("the daemon answered a published model request with nonsense")
        maps = [mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ) for fd, n in zip(fds, (size, forms_size))]
    finally:
        for fd in fds:
            os.close(fd)  # the mappings keep the pages
    return Grant(memoryview(maps[0]), digest, memoryview(maps[1]) if len(maps) > 1 else None)
