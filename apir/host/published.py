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
sessions use it. A GPU session copies the mapping to its device (no upload from the
guest, but a device copy per session): CUDA memory cannot be made before the fork (CUDA
does not survive one), and a copy one process exports to the others by CUDA IPC must be
held by a process that runs no session, whose crash would otherwise take the copy, and
every session's graphs, with it; that holder is not built yet.

The daemon and a worker speak over the worker's socketpair (SOCK_SEQPACKET):

    worker -> daemon   b"want\\0" + name (UTF-8, at most NAME_MAX bytes)
    daemon -> worker   b"ok" + i64 size + 32-byte layout digest, with the memfd (SCM_RIGHTS)
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

from ..backends.base import BackendError
from ..errors import ApirError

log = logging.getLogger("apir.host")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
NAME_MAX = 128
WANT = b"want\0"
REQUEST_MAX = len(WANT) + NAME_MAX
_GRANT = struct.Struct("<q32s")  # after b"ok": size, layout digest
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
    users: set[int] = field(default_factory=set)  # sessions that opened it, until they end
    idle_since: float = 0.0  # when its last user ended


def load_copy(model: PublishedModel) -> SharedCopy:
    """Read ``model``'s GGUF into a sealed memfd, laid out as a guest's engine uploads it."""
    from ..models.gguf_file import GGUFFile
    from ..models.layout import layout_digest, weight_slots

    gguf = GGUFFile(model.path)
    slots, size = weight_slots(gguf.tensors.values())
    fd = os.memfd_create(f"apir-model-{model.name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        for t in gguf.tensors.values():
            data, offset = memoryview(t.data).cast("B"), slots[t.name].offset
            while data:  # pwrite may write less than asked
                n = os.pwrite(fd, data, offset)
                data, offset = data[n:], offset + n
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # nobody writes it again, nor resizes it
    except BaseException:
        os.close(fd)
        raise
    return SharedCopy(fd, size, layout_digest(slots))


class Shelf:
    """The daemon's published models and their resident copies."""

    def __init__(self, models: tuple[PublishedModel, ...], keep_alive: float) -> None:
        self.models = {p.name: p for p in models}
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
        return sum(c.size for c in self.copies.values())

    def fds(self) -> list[int]:
        return [c.fd for c in self.copies.values()]

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
        copy = self.copies[name] = load_copy(self.models[name])
        self.loads += 1
        log.info("published model %s loaded: %.1f MiB in %.1fs", name, copy.size / 2**20,
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
                os.close(copy.fd)
                del self.copies[name]
                log.info("published model %s unloaded: unused for %gs", name, self.keep_alive)

    def close(self) -> None:
        for copy in self.copies.values():
            os.close(copy.fd)
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
            reply, fds = b"ok" + _GRANT.pack(copy.size, copy.digest), [copy.fd]
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


def ask(pool: socket.socket, name: str, timeout: float) -> tuple[memoryview, bytes]:
    """In a worker: the daemon's copy of published model ``name``, mapped read-only, and
    its layout digest; a BackendError says why not."""
    raw = name.encode()
    if not NAME.fullmatch(name) or len(raw) > NAME_MAX:
        raise BackendError(f"{name[:NAME_MAX]!r} is not a model name (1 to {NAME_MAX} letters, "
                           "digits and . _ + -)")
    pool.settimeout(timeout)
    pool.send(WANT + raw)
    data, fds, _, _ = socket.recv_fds(pool, 4096, 1)
    if data.startswith(b"no"):
        for fd in fds:
            os.close(fd)
        raise BackendError(data[2:].decode(errors="replace"))
    if not data.startswith(b"ok") or len(data) != 2 + _GRANT.size or len(fds) != 1:
        raise ApirError("the daemon answered a published model request with nonsense")
    size, digest = _GRANT.unpack_from(data, 2)
    try:
        mapping = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fds[0])  # the mapping keeps the pages
    return memoryview(mapping), digest
