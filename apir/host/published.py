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
beside the first (its layout: ``apir.backends.forms``).

On a CUDA host there is no memfd: CUDA memory cannot be made before the fork (CUDA does not
survive one), and a copy one process exports to the others by CUDA IPC must outlive them
all, so it is held by a process of its own that runs no session, a *holder*
(``apir.host.holder``), forked when a session first asks for the model and ended
``keep_alive`` seconds after its last session. Here the daemon only keeps the books: which
holder serves which model, which sessions use it, who waits for one that is loading. (An
MPS host keeps the memfd; each of its sessions copies it to the device.)

The daemon and a worker speak over the worker's socketpair (SOCK_SEQPACKET):

    worker -> daemon   b"want\\0" + i64 size + 32-byte layout digest (the guest's file's) +
                       name (UTF-8, at most NAME_MAX bytes)
    daemon -> worker   b"ok" + i64 size + 32-byte layout digest + i64 forms size (0: none),
                    with the memfd and the forms' memfd if any (SCM_RIGHTS)
                    or holder.GRANT ... (a holder's device copy: see apir.host.holder)
                    or b"wait", then one of the others: a holder is loading the model
                    or b"no" + a message for the guest (UTF-8)
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import selectors
import signal
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..backends.base import BackendError
from ..errors import ApirError
from . import holder
from .holder import Holder
from .memfd import sealed

log = logging.getLogger("apir.host")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
NAME_MAX = 128
WANT = b"want\0"
WAIT = b"wait"
_LAYOUT = struct.Struct("<q32s")  # after WANT: the layout's size and digest the guest expects
REQUEST_MAX = len(WANT) + _LAYOUT.size + NAME_MAX
LOAD_WAIT = holder.LOAD_TIMEOUT + 60  # seconds a worker waits for a loading holder's copy
_GRANT = struct.Struct("<q32sq")  # after b"ok": size, layout digest, forms size
FORM_CHUNK = 1 << 22  # elements dequantized at a time: the daemon's scratch stays small
KEEP_ALIVE = 300.0  # seconds a copy outlives its last session (Ollama's keep_alive default)


@dataclass(frozen=True)
class PublishedModel:
    name: str
    path: Path
    size: int  # bytes of its tensors laid out as a guest's engine lays them out
    digest: bytes  # apir.models.layout.layout_digest of that layout (from the file's header)

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
        from ..models.gguf_file import GGUFFile
        from ..models.layout import layout_digest, weight_slots

        try:  # its header now: a file that is not GGUF, or not readable, fails the daemon's start
            gguf = GGUFFile(path)  # rather than each guest's load later, which would upload instead
        except (ApirError, OSError) as e:
            raise ApirError(f"--model {spec!r}: {getattr(e, 'strerror', None) or e}") from None
        slots, size = weight_slots(gguf.tensors.values())
        return PublishedModel(name, Path(path), size, layout_digest(slots))


def misfit(name: str) -> BackendError:
    """The refusal of a guest whose own file lays published model ``name`` out otherwise."""
    return BackendError(f"the host's published model {name!r} is not laid out as this guest's file "
                        "(another version or quantization of it?); upload the weights instead")


def request(name: str, size: int, digest: bytes) -> bytes:
    """A worker's request for published model ``name`` as its guest's file lays it out."""
    return WANT + _LAYOUT.pack(size, digest) + name.encode()


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
    fd = sealed(f"apir-model-{model.name}", size, (
        (slots[t.name].offset, memoryview(t.data).cast("B")) for t in gguf.tensors.values()))
    try:
        forms_fd, forms_size = _forms(model.name, gguf, slots, int4) if forms else (-1, 0)
    except BaseException:
        os.close(fd)
        raise
    return SharedCopy(fd, size, layout_digest(slots), forms_fd, forms_size)


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

    return sealed(f"apir-forms-{name}", size, pieces()), size


Spawn = Callable[[PublishedModel, str], Holder]  # forks a holder of a model on a device


class Shelf:
    """The daemon's published models and their resident copies: memfds it holds itself, or,
    on a CUDA host (``device``), the holder processes ``spawn`` forks."""

    def __init__(self, models: tuple[PublishedModel, ...], keep_alive: float, forms: bool = False,
                 int4: bool = False, device: str | None = None, spawn: Spawn | None = None,
                 selector: selectors.BaseSelector | None = None) -> None:
        """``forms``: the sessions keep dequantized forms of weights (a CPU host's dequant cache),
        so the daemon makes them once, with each copy; ``int4``: not of those the sessions
        compute in int4 (``load_copy``). ``device``: where holders put the copies (None: the
        daemon holds memfds); ``spawn`` forks one, and ``selector`` watches their sockets
        (the daemon calls ``holder_event`` for each that is readable)."""
        self.models = {p.name: p for p in models}
        self.forms, self.int4 = forms, int4
        # a guest's engine asks by its file's name: NAME=PATH answers to PATH's file name too
        self.aliases = {**{p.path.stem: p.name for p in models}, **{n: n for n in self.models}}
        self.keep_alive = keep_alive  # negative: loaded at start, kept for the daemon's life
        self.copies: dict[str, SharedCopy] = {}
        self.device, self.spawn, self.selector = device, spawn, selector
        self.holders: dict[str, Holder] = {}  # by model name: loading or ready
        self.children: dict[int, Holder] = {}  # holder processes not reaped yet, by pid
        self.loads = 0  # copies read from disk (by the daemon, or by a holder it started)
        if keep_alive < 0 and device is None:
            for name in self.models:
                self._load(name)

    def preload(self) -> None:
        """With ``keep_alive`` < 0 on a CUDA host: start every model's holder now."""
        if self.keep_alive < 0 and self.device is not None:
            for name in self.models:
                if name not in self.holders:
                    self._start(name)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.models))

    def resident_bytes(self) -> int:
        """Bytes of the copies held now (in host memory, or on the device), each once."""
        return (sum(c.size + c.forms_size for c in self.copies.values())
                + sum(h.size for h in self.holders.values() if h.ready))

    def resident(self) -> list[tuple[str, str, int, int]]:
        """Each copy held now, once: (model, where: "host" or the holder's device, bytes,
        sessions using it)."""
        return sorted([*((name, "host", c.size + c.forms_size, len(c.users)) for name, c in self.copies.items()),
                       *((name, h.device, h.size, len(h.users)) for name, h in self.holders.items() if h.ready)])

    def close_inherited(self) -> None:
        """In a child just forked from the daemon: close every copy's fd and every holder's
        socket and descriptors it inherited (a worker holds a copy only if its session asks;
        a holder's socket held anywhere else would keep that holder from seeing its EOF)."""
        for c in self.copies.values():
            for fd in (c.fd, c.forms_fd):
                if fd >= 0:
                    os.close(fd)
        for h in self.holders.values():
            h.close()

    def _name(self, name: str) -> str:
        """The published model ``name`` answers to; a BackendError when there is none."""
        name = self.aliases.get(name, name)
        if name not in self.models:
            listed = ", ".join(self.names()) or "none"
            raise BackendError(f"the host publishes no model named {name[:NAME_MAX]!r} (published: {listed}); "
                               "upload the weights instead")
        return name

    def acquire(self, name: str, session: int) -> SharedCopy:
        """Model ``name``'s copy, loaded if it is not resident, now used by ``session``."""
        name = self._name(name)
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
        """``session`` ended: it uses no copy any more, and waits for none."""
        users: list[SharedCopy | Holder] = [*self.copies.values(), *self.holders.values()]
        for user in users:
            if session in user.users:
                user.users.discard(session)
                if not user.users:
                    user.idle_since = now
        for h in self.holders.values():
            h.waiting = [(s, pool) for s, pool in h.waiting if s != session]

    def expire(self, now: float) -> None:
        """Close the copies nobody has used for ``keep_alive`` seconds; end a holder that
        has not loaded its copy within ``holder.LOAD_TIMEOUT``."""
        for name, h in list(self.holders.items()):
            if not h.ready and now - h.started > holder.LOAD_TIMEOUT:
                log.warning("published model %s: its holder (pid %d) did not load it within %gs; ending it",
                            name, h.pid, holder.LOAD_TIMEOUT)
                _kill(h.pid)
        if self.keep_alive < 0:
            return
        for name, copy in list(self.copies.items()):
            if not copy.users and now - copy.idle_since >= self.keep_alive:
                _close(copy)
                del self.copies[name]
                log.info("published model %s unloaded: unused for %gs", name, self.keep_alive)
        for name, h in list(self.holders.items()):
            if h.ready and not h.users and not h.waiting and now - h.idle_since >= self.keep_alive:
                self._drop(h)
                log.info("published model %s unloaded from %s: unused for %gs (its holder, pid %d, ends)",
                         name, h.device, self.keep_alive, h.pid)

    def close(self) -> list[int]:
        """Close every copy; returns the pids of the holders told to end (at their EOF)."""
        for copy in self.copies.values():
            _close(copy)
        self.copies.clear()
        pids = [h.pid for h in self.holders.values()]
        for h in list(self.holders.values()):
            self._drop(h)
        return pids

    def answer(self, pool: socket.socket, session: int, data: bytes) -> bool:
        """Answer a worker's request ``data`` on its socketpair ``pool``; False: it is not a
        request (the worker is not to be trusted: stop listening to it) or cannot be sent.
        A guest whose file lays the model out otherwise is refused before anything loads."""
        if not data.startswith(WANT) or not len(WANT) + _LAYOUT.size < len(data) <= REQUEST_MAX:
            return False
        size, digest = _LAYOUT.unpack_from(data, len(WANT))
        name = data[len(WANT) + _LAYOUT.size :].decode(errors="replace")
        try:
            model = self.models[self._name(name)]
        except BackendError as e:
            return _send(pool, b"no" + str(e).encode(), [])
        if (model.size, model.digest) != (size, digest):
            return _send(pool, b"no" + str(misfit(model.name)).encode(), [])
        if self.device is not None:
            return self._answer_held(pool, session, model.name)
        fds: list[int] = []
        try:
            copy = self.acquire(model.name, session)
            reply = b"ok" + _GRANT.pack(copy.size, copy.digest, copy.forms_size)
            fds = [copy.fd] + ([copy.forms_fd] if copy.forms_fd >= 0 else [])
        except (BackendError, ApirError, OSError) as e:  # a missing or unreadable file too
            if not isinstance(e, BackendError):
                log.warning("published model %s cannot be loaded: %s", name, e)
                e = BackendError(f"the host cannot load its published model {name!r}")
            reply = b"no" + str(e).encode()
        return _send(pool, reply, fds)

    # ------------------------------------------------------------ holders (a CUDA host)
    def _answer_held(self, pool: socket.socket, session: int, name: str) -> bool:
        # ``name``: a published model's own (``answer`` resolved it)
        try:
            h = self.holders.get(name) or self._start(name)
        except OSError as e:  # no holder could be forked
            log.warning("published model %s: no holder could be started: %s", name, e)
            return _send(pool, b"no" + f"the host cannot load its published model {name!r}".encode(), [])
        if h.ready:
            return self._grant(h, session, pool)
        h.waiting.append((session, pool))
        return _send(pool, WAIT, [])

    def _start(self, name: str) -> Holder:
        assert self.spawn is not None and self.device is not None
        h = self.spawn(self.models[name], self.device)
        self.holders[name] = self.children[h.pid] = h
        if self.selector is not None:
            self.selector.register(h.sock, selectors.EVENT_READ, h)
        self.loads += 1
        log.info("published model %s: holder pid %d loading it onto %s", name, h.pid, h.device)
        return h

    def _grant(self, h: Holder, session: int, pool: socket.socket) -> bool:
        reply, fds = h.grant()
        if not _send(pool, reply, fds):
            return False
        h.users.add(session)
        return True

    def holder_event(self, h: Holder) -> None:
        """Holder ``h``'s socket is readable: its READY or FAIL, or its end (EOF)."""
        try:
            data, fds, _, _ = socket.recv_fds(h.sock, holder.MESSAGE_MAX, holder.FDS_MAX)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        if self.holders.get(h.name) is not h:  # dropped already
            for fd in fds:
                os.close(fd)
            return
        if h.take_ready(data, fds, time.monotonic()):
            waiting, h.waiting = h.waiting, []
            for session, pool in waiting:
                self._grant(h, session, pool)
            return
        if data.startswith(holder.FAIL):
            why = "it could not load the model (see the host's log)"
        elif data:  # a holder says READY once and nothing else, ever
            why = "it sent nonsense"
            _kill(h.pid)
        elif h.ready:
            why = f"it ended while {len(h.users)} session(s) used the copy; they are closed"
        else:
            why = "it ended before it had loaded the model"
        log.warning("published model %s: its holder (pid %d) on %s is gone: %s", h.name, h.pid, h.device, why)
        for _, pool in h.waiting:
            _send(pool, b"no" + f"the host could not load its published model {h.name!r} onto its "
                  "GPU; upload the weights instead".encode(), [])
        self._drop(h)

    def _drop(self, h: Holder) -> None:
        """Forget holder ``h`` (it ends at the EOF of its socket, if it still runs)."""
        if self.holders.get(h.name) is h:
            del self.holders[h.name]
        if self.selector is not None:
            self.selector.unregister(h.sock)
        h.close()

    def reaped(self, pid: int, status: int) -> bool:
        """A child of the daemon was reaped: True if it was a holder (logged)."""
        h = self.children.pop(pid, None)
        if h is None:
            return False
        if os.WIFSIGNALED(status):
            log.warning("published model %s: holder pid %d was killed (signal %d)", h.name, pid, os.WTERMSIG(status))
        elif os.WEXITSTATUS(status):
            log.warning("published model %s: holder pid %d exited with status %d", h.name, pid, os.WEXITSTATUS(status))
        return True


def _send(pool: socket.socket, reply: bytes, fds: list[int]) -> bool:
    try:  # one small message into an empty buffer (the worker waits for it): never blocks
        socket.send_fds(pool, [reply], fds, socket.MSG_DONTWAIT)
    except OSError:
        return False
    return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _close(copy: SharedCopy) -> None:
    for fd in (copy.fd, copy.forms_fd):
        if fd >= 0:
            os.close(fd)


class Grant(NamedTuple):
    """A published model as a worker opens it: the layout's size and digest, then either
    the daemon's memfd mapped read-only (``data``) and its dequantized forms (None: the
    daemon made none), or a holder's copy on the device (``device``: see
    ``holder.DeviceGrant``)."""

    size: int
    digest: bytes
    data: memoryview | None = None
    forms: memoryview | None = None
    device: holder.DeviceGrant | None = None


# a worker's way to the daemon's published models: (name, size, digest, notify) -> Grant
Asker = Callable[[str, int, bytes, Callable[[str], None]], Grant]


def ask(pool: socket.socket, name: str, size: int, digest: bytes, timeout: float,
        notify: Callable[[str], None] | None = None) -> Grant:
    """In a worker: the daemon's copy of published model ``name``, laid out in ``size``
    bytes as ``digest`` says (the guest's file's layout), mapped read-only, or a holder's
    device copy opened; a BackendError says why not. ``notify`` tells the guest when a
    holder is loading the model first (seconds)."""
    if not NAME.fullmatch(name) or len(name.encode()) > NAME_MAX:
        raise BackendError(f"{name[:NAME_MAX]!r} is not a model name (1 to {NAME_MAX} letters, "
                           "digits and . _ + -)")
    if len(digest) != _LAYOUT.size - 8 or not 0 <= size < 2**63:
        raise BackendError("a published model's layout is a 32-byte digest and a size")
    pool.settimeout(timeout)
    pool.send(request(name, size, digest))
    data, fds, _, _ = socket.recv_fds(pool, holder.MESSAGE_MAX, holder.FDS_MAX)
    if data == WAIT and not fds:
        if notify is not None:
            notify(f"loading published model {name} onto the host's GPU (its first session there)")
        pool.settimeout(LOAD_WAIT)
        data, fds, _, _ = socket.recv_fds(pool, holder.MESSAGE_MAX, holder.FDS_MAX)
    if data.startswith(b"no"):
        for fd in fds:
            os.close(fd)
        raise BackendError(data[2:].decode(errors="replace"))
    if data.startswith(holder.GRANT):
        g = holder.open_grant(data, fds)
        return Grant(g.size, g.digest, device=g)
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
    return Grant(size, digest, memoryview(maps[0]), memoryview(maps[1]) if len(maps) > 1 else None)
