"""A published model's one copy on a CUDA device, held by a process that runs no session.

A GPU session cannot compute on the daemon's memfd of a published model in place: it would
copy it to its device, so N guests of one model held N device copies. A *holder* is a
process the daemon forks per (published model, CUDA device) when a GPU session first asks
for the model (or at start, with ``--keep-alive -1``). It reads the GGUF itself, uploads
its tensors to the device laid out as a guest's engine uploads them
(``apir.models.layout``), packs each quantized weight in place exactly as a session's
executor would at its first use (``qpack.pack``, what ``LocalBackend._packed_blocks``
does), and exports the allocation once by CUDA IPC. Every session's worker opens that
export and computes on it: one device copy, counted once.

Why a process of its own: the exporter of CUDA IPC memory must outlive every importer
(torch: "the sending process is required to keep the original tensor as long as the
receiving process retains a copy"), so no session's worker may be it (a guest that crashes
its worker would take every other session's weights with it). The holder reads nothing
from a guest or a worker: its only peer is the daemon, which sends it nothing; it exits at
EOF on that socket (the daemon closes it ``--keep-alive`` seconds after the last session)
or with the daemon (PR_SET_PDEATHSIG).

What crosses, and how (all on SOCK_SEQPACKET socketpairs with the daemon):

    holder -> daemon   READY + i64 size + 32-byte layout digest + the export (opaque),
                       with a sealed memfd of the packed table, then the export's fds
                       (CUDA IPC: none), or FAIL + a message for the log (UTF-8)
    daemon -> worker   GRANT + i64 size + 32-byte layout digest + the export, with the
                       table's memfd, the read end of the holder's liveness pipe, then the
                       export's fds (see ``published.ask``)

The packed table tells a worker's executor which spans are already packed, and as which
(qtype, n, k): "APIRPK1\\0", u64 count, count x (u64 offset, u64 ggml type, u64 n, u64 k),
sorted by offset. The liveness pipe's write end lives only in the holder: when the holder
dies, every worker holding the read end sees it hang up, and ends its session with an error
that says so (``Session._watch_holder``); the memory of a dead exporter is not to be read.

The export is CUDA IPC through torch (``UntypedStorage._share_cuda_`` in the holder,
``_new_shared_cuda`` in a worker): a cudaIpcMemHandle of the allocation, torch's IPC
reference counter and an IPC event that orders a worker's reads after the holder's writes.
The export is made once and opened by many workers, so that counter (which torch keeps to
free a sent storage only once its receivers let go) is counted once and let go of by each;
it decides nothing here, since the holder frees the copy only by exiting.
The allocation is made with torch's expandable segments off (their IPC handles are opened
through pidfd_getfd, which a sibling process may not be allowed). The mapping a worker gets
is writable as far as the driver is concerned: it is read-only by contract (the executor
refuses every write to a lent buffer, and never packs one), unlike the daemon's memfd,
which the kernel seals; SECURITY.md says what that means.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import socket
import struct
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ..backends.base import ALIGNMENT, BackendError
from ..errors import ApirError
from .memfd import sealed

if TYPE_CHECKING:
    import torch

log = logging.getLogger("apir.host")

READY = b"ready"
FAIL = b"fail"
GRANT = b"dev"
_COPY = struct.Struct("<q32s")  # after READY or GRANT: size, layout digest
MESSAGE_MAX = 4096  # a READY, FAIL or GRANT (the export is a few hundred bytes)
FDS_MAX = 8  # descriptors one of them carries
TABLE_MAGIC = b"APIRPK1\0"
_COUNT = struct.Struct("<Q")
_ENTRY = struct.Struct("<QQQQ")  # offset, ggml type, n, k
UPLOAD_CHUNK = 64 << 20  # bytes of the file copied to the device at a time
LOAD_TIMEOUT = 600.0  # seconds a holder may take to be ready before the daemon ends it

Packed = Mapping[int, tuple[int, int, int, int]]  # offset -> (ggml type, n, k, bytes)


class Transport:
    """How a holder's copy reaches the session workers: made on the device by the holder,
    exported once, opened by each worker. The product's one is ``CudaIpc``."""

    def device(self, configured: str | None) -> str | None:
        """The device holders put copies on for a daemon whose sessions run on
        ``configured`` (None: the best there is), or None where sessions compute on the
        daemon's mapping instead. Never initialises a device (the daemon forks after)."""
        raise NotImplementedError

    def allocate(self, size: int, device: str) -> torch.Tensor:
        """In the holder: ``size`` zeroed bytes on ``device`` (1-D uint8), to be exported."""
        raise NotImplementedError

    def export(self, weights: torch.Tensor) -> tuple[bytes, list[int]]:
        """In the holder, once the copy is written: what a worker needs to open it (bytes
        and descriptors), valid while the holder lives."""
        raise NotImplementedError

    def open(self, export: bytes, fds: list[int], size: int) -> torch.Tensor:
        """In a worker: the holder's copy (1-D uint8, ``size`` bytes, on its device). Takes
        ownership of ``fds``."""
        raise NotImplementedError


_IPC = struct.Struct("<qqqq?")  # device, size, offset, ref counter offset, event sync required


class CudaIpc(Transport):
    """CUDA IPC through torch's own sharing of CUDA storages (torch.multiprocessing's)."""

    def device(self, configured: str | None) -> str | None:
        if configured is None:
            import torch

            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # asks NVML, not the CUDA runtime
            return "cuda" if torch.cuda.is_available() else None
        return configured if configured.split(":")[0] == "cuda" else None

    def allocate(self, size: int, device: str) -> torch.Tensor:
        import torch

        try:  # an expandable segment's IPC handle needs pidfd_getfd of this process
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        except (AttributeError, RuntimeError):
            pass
        return torch.zeros(size, dtype=torch.uint8, device=device)

    def export(self, weights: torch.Tensor) -> tuple[bytes, list[int]]:
        import torch

        torch.cuda.synchronize(weights.device)
        dev, handle, size, offset, ref, ref_offset, event, sync = weights.untyped_storage()._share_cuda_()
        if handle is None or ref is None or event is None:
            raise ApirError("torch gave no CUDA IPC handle for the published copy")
        parts = b"".join(struct.pack("<H", len(b)) + b for b in (handle, ref, event))
        return _IPC.pack(dev, size, offset, ref_offset, bool(sync)) + parts, []

    def open(self, export: bytes, fds: list[int], size: int) -> torch.Tensor:
        import torch

        for fd in fds:
            os.close(fd)
        try:
            dev, nbytes, offset, ref_offset, sync = _IPC.unpack_from(export)
            at, strings = _IPC.size, []
            for _ in range(3):
                (n,) = struct.unpack_from("<H", export, at)
                strings.append(bytes(export[at + 2 : at + 2 + n]))
                at += 2 + n
        except struct.error:
            raise ApirError("the daemon sent a malformed CUDA IPC export") from None
        if at != len(export) or nbytes != size:
            raise ApirError("the daemon sent a malformed CUDA IPC export")
        handle, ref, event = strings
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(dev, handle, nbytes, offset, ref, ref_offset, event, sync)
        return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", dev)).set_(storage, 0, (nbytes,), (1,))


TRANSPORT: Transport = CudaIpc()


# ---------------------------------------------------------------- the holder process


class Copy(NamedTuple):
    """A published model's copy on its device, as the holder made it."""

    weights: torch.Tensor  # 1-D uint8, the layout's size
    digest: bytes  # apir.models.layout.layout_digest
    packed: dict[int, tuple[int, int, int, int]]  # offset -> (ggml type, n, k, bytes), packed in place


def load(path: str | Path, device: str, pack: bool | None = None) -> Copy:
    """``path``'s tensors on ``device`` at their slots, each quantized one packed in place
    as a session's executor packs it at first use (``pack``: whether to, by default where
    the executor does, ``qmatmul.packs``): the same bytes, the same (qtype, n, k)."""
    import torch

    from ..backends.local import qmatmul, qpack
    from ..models.gguf_file import GGUFFile
    from ..models.layout import layout_digest, weight_slots

    gguf = GGUFFile(path)
    tensors = list(gguf.tensors.values())
    slots, size = weight_slots(tensors)
    weights = TRANSPORT.allocate(size, device)
    with warnings.catch_warnings():  # torch warns that the file's mapping is not writable
        warnings.simplefilter("ignore", UserWarning)
        for t in tensors:
            raw, at = memoryview(t.data).cast("B"), slots[t.name].offset
            for start in range(0, len(raw), UPLOAD_CHUNK):
                piece = raw[start : start + UPLOAD_CHUNK]
                weights[at + start : at + start + len(piece)].copy_(torch.frombuffer(piece, dtype=torch.uint8))
    packed = {}
    if qmatmul.packs(weights.device) if pack is None else pack:
        for t in tensors:
            if t.dtype.is_quantized:
                offset, rec = slots[t.name].offset, (int(t.dtype), math.prod(t.shape[:-1]), t.shape[-1],
                                                     t.dtype.nbytes(t.shape))
                span = weights[offset : offset + rec[3]]
                span.copy_(qpack.pack(span, *rec[:3]))
                packed[offset] = rec
    return Copy(weights, layout_digest(slots), packed)


def table(packed: Packed) -> bytes:
    """The packed table's bytes (see the module's docstring)."""
    return TABLE_MAGIC + _COUNT.pack(len(packed)) + b"".join(
        _ENTRY.pack(offset, qtype, n, k) for offset, (qtype, n, k, _) in sorted(packed.items()))


def read_table(data: bytes | memoryview | mmap.mmap, size: int) -> dict[int, tuple[int, int, int, int]]:
    """A packed table, checked against a copy of ``size`` bytes: entries aligned, of known
    block types, whole blocks, inside the copy, in order and not overlapping."""
    from ..graph import DType

    if bytes(data[: len(TABLE_MAGIC)]) != TABLE_MAGIC or len(data) < len(TABLE_MAGIC) + _COUNT.size:
        raise ApirError("not a table of packed weights")
    (count,) = _COUNT.unpack_from(data, len(TABLE_MAGIC))
    start = len(TABLE_MAGIC) + _COUNT.size
    if start + count * _ENTRY.size != len(data):
        raise ApirError("the table of packed weights does not match its length")
    out, end = {}, 0
    for i in range(count):
        offset, qtype, n, k = _ENTRY.unpack_from(data, start + i * _ENTRY.size)
        try:
            dtype = DType(qtype)
            nbytes = dtype.nbytes((n, k)) if dtype.is_quantized and n > 0 and k > 0 else -1
        except ValueError:
            nbytes = -1
        if nbytes <= 0 or offset % ALIGNMENT or offset < end or offset + nbytes > size:
            raise ApirError(f"packed weight {i} of the table is not a quantized span inside the copy")
        out[offset], end = (qtype, n, k, nbytes), offset + nbytes
    return out


def serve(name: str, path: Path, device: str, sock: socket.socket) -> None:
    """A holder's life, in its forked process: make the copy, tell the daemon, hold it
    until the daemon closes ``sock`` (or dies: PR_SET_PDEATHSIG)."""
    t0 = time.monotonic()
    try:
        copy = load(path, device)
        export, fds = TRANSPORT.export(copy.weights)
        rows = table(copy.packed)
        table_fd = sealed(f"apir-packed-{name}", len(rows), [(0, memoryview(rows))])
        try:
            socket.send_fds(sock, [READY + _COPY.pack(copy.weights.numel(), copy.digest) + export],
                            [table_fd, *fds])
        finally:
            os.close(table_fd)
            for fd in fds:
                os.close(fd)
    except Exception as e:  # noqa: BLE001 - any failure is the daemon's to report, not a crash
        log.warning("published model %s could not be loaded onto %s: %s", name, device,
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        try:
            sock.send(FAIL + str(e).encode()[: MESSAGE_MAX - len(FAIL)])
        except OSError:
            pass
        return
    log.info("published model %s held on %s by pid %d: %.1f MiB, %d quantized weights packed, in %.1fs",
             name, device, os.getpid(), copy.weights.numel() / 2**20, len(copy.packed), time.monotonic() - t0)
    while True:  # the daemon sends nothing: the end of the stream is the end of the copy
        try:
            if not sock.recv(64):
                return
        except InterruptedError:
            continue
        except OSError:
            return


# ---------------------------------------------------------------- the daemon's record


@dataclass(eq=False)
class Holder:
    """The daemon's record of one holder process."""

    name: str
    device: str
    pid: int
    sock: socket.socket  # the daemon's end: the holder's READY or FAIL; closing it ends the holder
    alive: int  # the read end of the holder's liveness pipe, lent to each worker it serves
    started: float
    size: int = 0
    digest: bytes = b""
    export: bytes = b""
    fds: list[int] = field(default_factory=list)  # the packed table's memfd, then the export's
    ready: bool = False
    users: set[int] = field(default_factory=set)  # sessions granted the copy, until they end
    waiting: list[tuple[int, socket.socket]] = field(default_factory=list)  # (session, pool) asking
    idle_since: float = 0.0

    def take_ready(self, data: bytes, fds: list[int], now: float) -> bool:
        """The holder's READY (its fds owned from here on); False: it is not one."""
        if self.ready or not data.startswith(READY) or len(data) < len(READY) + _COPY.size or not fds:
            for fd in fds:
                os.close(fd)
            return False
        self.size, self.digest = _COPY.unpack_from(data, len(READY))
        self.export, self.fds, self.ready, self.idle_since = bytes(data[len(READY) + _COPY.size :]), fds, True, now
        return True

    def grant(self) -> tuple[bytes, list[int]]:
        """A worker's GRANT and its descriptors (see the module's docstring)."""
        return GRANT + _COPY.pack(self.size, self.digest) + self.export, [self.fds[0], self.alive, *self.fds[1:]]

    def close(self) -> None:
        """Forget it: its socket (the holder exits at the EOF), its descriptors."""
        self.sock.close()
        for fd in (*self.fds, self.alive):
            os.close(fd)
        self.fds, self.alive, self.ready = [], -1, False


# ---------------------------------------------------------------- in a worker


class DeviceGrant(NamedTuple):
    size: int
    digest: bytes
    weights: torch.Tensor  # the holder's copy, opened on this worker's device
    packed: dict[int, tuple[int, int, int, int]]  # its packed spans (read_table)
    alive: int  # hangs up when the holder ends


def open_grant(data: bytes, fds: list[int]) -> DeviceGrant:
    """In a worker: the daemon's GRANT of a holder's copy, opened (takes ``fds``)."""
    try:
        if not data.startswith(GRANT) or len(data) < len(GRANT) + _COPY.size or len(fds) < 2:
            raise ApirError("the daemon answered a published model request with nonsense")
        size, digest = _COPY.unpack_from(data, len(GRANT))
        with mmap.mmap(fds[0], 0, mmap.MAP_SHARED, mmap.PROT_READ) as rows:
            packed = read_table(rows, size)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    os.close(fds[0])
    try:
        weights = TRANSPORT.open(data[len(GRANT) + _COPY.size :], fds[2:], size)
    except Exception as e:
        os.close(fds[1])
        if isinstance(e, ApirError):
            raise
        raise BackendError(f"the host's copy of this published model could not be opened on its device "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return DeviceGrant(size, digest, weights, packed, fds[1])
