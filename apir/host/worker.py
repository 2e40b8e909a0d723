"""A session's worker process. The daemon forks it ahead of its guest (or for it, with no
idle worker left): it initialises the device (``warm_up``), says READY, and waits on its
socketpair with the daemon for a ``Bind``, the one message it ever reads from there, which
comes with the guest's socket (SCM_RIGHTS); only the daemon holds the other end. Then
``run_worker``: build the executor, put it under its OS memory limit, welcome the guest (a
Unix guest gets its shared region: see ``apir.transport.accept``), serve it, clean up.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import re
import resource
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from ..backends.base import ExecutorConfig
from ..errors import ApirError
from ..protocol import PROTOCOL_VERSION, ErrorCode, ProtocolError
from ..protocol import messages as m
from ..transport import Connection, ConnectionClosed, accept, spin_seconds
from .published import Asker
from .session import Session, SessionConfig, device_message, notify

log = logging.getLogger("apir.host")

READY = b"ready"  # a warm worker to the daemon: the device is initialised
# Bind := i64 session, i64 slot, u32 n, n bytes peer (UTF-8), then the guest's Hello as
# a whole frame (token blanked), read back by the protocol's own decoder.
_BIND = struct.Struct("<qqI")
BIND_MAX = 8192  # a Hello is at most HANDSHAKE_MAX (4 KiB) bytes
MAX_SLOTS = 1024  # sessions a daemon can account for at once (a Bind's slot indexes them)


@dataclass(frozen=True)
class Bind:
    """The daemon's hand-over of a session to a warm worker."""

    session: int
    slot: int
    peer: str
    hello: m.Hello

    def encode(self) -> bytes:
        peer = self.peer.encode()
        return _BIND.pack(self.session, self.slot, len(peer)) + peer + m.encode(self.hello)

    @staticmethod
    def decode(data: bytes) -> Bind:
        if len(data) < _BIND.size:
            raise ProtocolError("truncated Bind")
        session, slot, n = _BIND.unpack_from(data)
        if session <= 0 or not 0 <= slot < MAX_SLOTS or _BIND.size + n + m.HEADER.size > len(data):
            raise ProtocolError(f"bad Bind (session {session}, slot {slot}, peer of {n} bytes)")
        peer = data[_BIND.size : _BIND.size + n].decode(errors="replace")
        frame = data[_BIND.size + n :]
        header = m.decode_header(frame[: m.HEADER.size], BIND_MAX)
        hello = m.decode_body(header.opcode, frame[m.HEADER.size :])
        if not isinstance(hello, m.Hello) or header.length != len(frame) - m.HEADER.size:
            raise ProtocolError("a Bind must carry exactly one Hello")
        return Bind(session, slot, peer, hello)


def warm_up(device: str | None, executor: ExecutorConfig) -> None:
    """Pay now what a session's worker pays before its first request: the host backend's
    imports and, on a GPU, the device's context (~5 s on CUDA), the compiler's imports
    (inductor's: 2-4 s) when its decode step will be compiled or loaded compiled, and the
    first launch of each kind of kernel. Called after the fork: CUDA does not survive one."""
    import torch

    from ..backends.local.executor import pick_device

    dev = pick_device(device)
    if dev.type != "cpu":
        torch.zeros(1, device=dev)  # creates the context
    compiles = executor.compile != "off" and (dev.type == "cuda" and executor.cuda_graphs
                                              or dev.type == "cpu" and executor.compile_cpu)
    if compiles:
        # what tracing a step, and loading one compiled before, import (1-2 s); a torch
        # without one of them compiles nothing (the executor falls back), so none is required
        for module in ("torch._inductor.compile_fx", "torch._inductor.standalone_compile",
                       "torch._functorch._aot_autograd.aot_autograd_result", "torch.fx.experimental.proxy_tensor"):
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
    if dev.type == "cuda":  # the kernels' first launches (~1 s: see warm_device)
        from ..backends.local.warm import warm_device

        warm_device(dev, compiles)


def wait_for_bind(pool: socket.socket) -> tuple[Bind, socket.socket] | None:
    """Tell the daemon this worker is ready, then wait for its session: the ``Bind`` and
    the guest's socket. None: the daemon closed the pool (it is stopping)."""
    # The daemon may send the Bind and close its end before it reads our READY (a cold
    # worker, bound while starting); Linux then reports a reset once, to whichever call
    # comes first (this send, or the recv), and the Bind is still queued.
    try:
        pool.sendall(READY)
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        data, fds, _, _ = socket.recv_fds(pool, BIND_MAX, 1)
    except ConnectionResetError:
        data, fds, _, _ = socket.recv_fds(pool, BIND_MAX, 1)
    socks = [socket.socket(fileno=fd) for fd in fds]
    if not data:
        for s in socks:
            s.close()
        return None
    if len(socks) != 1:
        raise ApirError(f"a Bind came with {len(socks)} sockets, not the guest's one")
    socks[0].setblocking(True)
    return Bind.decode(data), socks[0]


# What a worker may hold beyond its --max-memory before the OS stops it: what accounting
# does not see (a frame being decoded, up to 3 times --max-message; Python objects; torch's
# threads, kernels' temporaries and allocator slack).
HEADROOM = 256 << 20
CGROUP = Path("/sys/fs/cgroup")  # the cgroup v2 hierarchy (a hybrid host's v1 controllers are not used)


def run_worker(conn: Connection, hello: m.Hello, config: SessionConfig, publish,
               published: Asker | None = None) -> None:
    """Entry point of a session's worker process (after fork): build, welcome, serve.
    ``conn``: the guest's connection as the handshake left it (a socket, or a VM's rings
    and arena); ``published``: the daemon's published models, by name (see Session)."""
    started = time.monotonic()
    from ..backends.local import LocalBackend  # torch: only worker processes execute

    backend = LocalBackend(config.device, limits=config.limits, config=config.executor)
    device = device_message(backend)
    limit = config.os_memory or config.limits.max_memory and (config.limits.max_memory + HEADROOM
                                                              + 3 * conn.channel.max_body)
    cap = os_memory_cap(limit, device.kind, config.session) if limit else "none"

    def welcome(arena_size: int) -> m.Welcome:
        return m.Welcome(PROTOCOL_VERSION, config.session, device, arena_size, config.limits.max_memory)

    try:
        try:
            conn = accept(conn, welcome, min(hello.arena_size, config.max_arena), config.io_timeout,
                          f"apir-session-{config.session}")
        except ConnectionClosed:
            return  # the guest went away during its handshake
        conn.channel.spin_seconds = spin_seconds(device.kind, config.spin_us)  # the next step is µs away on a GPU
        backend.on_compile = functools.partial(notify, conn.channel)
        try:
            Session(conn.channel, backend, conn.arena, config, publish, liveness=conn.liveness,
                    published=published).serve()
        except MemoryError:  # outside any request (a frame being read): end with the reason
            log.warning("session %d ran out of memory under its OS limit (%s)", config.session, cap)
            with contextlib.suppress(ConnectionClosed, OSError):
                conn.channel.send(m.Error(ErrorCode.QUOTA, f"the session ran out of memory under "
                                          f"its OS limit ({cap}) and is closed"), 0)
    finally:
        peak = backend.peak_bytes
        backend.close()
        conn.close()
        publish(0, peak)
        log.info("session %d end: peer %s, %.1fs, peak %.1f MiB", config.session, config.peer,
                 time.monotonic() - started, peak / 2**20)


def os_memory_cap(limit: int, device_kind: str, session: int) -> str:
    """Hold this process to ``limit`` bytes more than it holds now, enforced by the OS, so
    that no accounting slip can take more of the host; returns what was set.

    A cgroup v2 of its own (``session_cgroup``) where the host lets us make one: its
    ``memory.max`` counts everything (page cache and shared pages it touches too) and the
    kernel kills the worker past it. On the CPU also RLIMIT_DATA (private writable
    mappings: the heap, torch's tensors, thread stacks), so that an allocation past it fails first
    (MemoryError, or torch's "can't allocate memory") and becomes a QUOTA error instead of
    a kill. On CUDA, where the driver maps huge private ranges, no data or address-space
    limit can be set: the caching allocator caps device memory instead
    (``set_per_process_memory_fraction``), and only a cgroup caps host memory."""
    import torch

    done = []
    group = session_cgroup(session)
    if group is not None:
        try:
            group.mkdir()
            (group / "memory.max").write_text(f"{limit}\n")
            (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
            done.append(f"cgroup memory.max {limit} bytes")
        except OSError:  # not ours to divide: the limits below alone
            with contextlib.suppress(OSError):
                group.rmdir()
    if device_kind == "cuda":
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
        return ", ".join([*done, f"{limit} bytes of device memory by the CUDA allocator"])
    # thread stacks are private writable mappings too: torch's pools start after the cap
    # (libgomp aborts the process when it cannot), so their stacks come on top
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = 32 << 20 if stack == resource.RLIM_INFINITY else stack  # glibc's default then
    threads = (torch.get_num_threads() + torch.get_num_interop_threads() + 8) * stack
    with contextlib.suppress(OSError):  # no /proc (macOS): accounting alone
        mapped = int(re.search(r"VmData:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10
        hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
        soft = mapped + threads + limit
        soft = soft if hard == resource.RLIM_INFINITY else min(soft, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        done.append(f"RLIMIT_DATA {limit} bytes past its start")
    return ", ".join(done) or "none"


def session_cgroup(session: int, daemon: int | None = None) -> Path | None:
    """Where session ``session``'s worker of daemon ``daemon`` (this process's parent by
    default) gets its cgroup: beside the daemon's own, in the cgroup v2 hierarchy; a
    cgroup can only be made there if the daemon's parent cgroup hands out the memory
    controller and is writable (root, or a delegated subtree whose parent is the daemon's
    own: run it in a leaf of it, e.g. systemd ``Delegate=yes`` plus a sub-group)."""
    own = own_cgroup()
    if own == "/" or not (CGROUP / "cgroup.controllers").exists():  # not v2, or its root
        return None
    return (CGROUP / own.lstrip("/")).parent / f"apir-{daemon or os.getppid()}-session-{session}"


def own_cgroup() -> str:
    """This process's cgroup v2 path ("/": none, or the root)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    return next((line[3:] for line in lines if line.startswith("0::")), "/")


def release_cgroup(session: int) -> bool:
    """The daemon, after reaping session ``session``'s worker: remove its cgroup, if it
    had one; True when the kernel killed it there for its memory limit."""
    group = session_cgroup(session, os.getpid())
    if group is None:
        return False
    try:
        killed = re.search(r"^oom_kill (\d+)", (group / "memory.events").read_text(), re.M)
    except OSError:  # it had none
        return False
    with contextlib.suppress(OSError):
        group.rmdir()
    return bool(killed and int(killed.group(1)))
