"""The host daemon: accepts guests, checks their handshake, gives each session a worker.

The parent never executes guest work and never initialises a GPU (it only imports torch,
so forked workers start warm). It keeps ``warm_workers`` idle workers forked ahead, each
with its device initialised (CUDA must be set up after the fork); a guest whose handshake
succeeds is handed to one of them (see ``worker.Bind``) and the pool is refilled, or, with
none in the pool, a worker is forked for it. Either way one process serves one session:
it dies with the parent (PR_SET_PDEATHSIG) and its memory goes with it; the parent reaps
it and clears its accounting slot. A guest that crashes its worker, or misbehaves,
affects nobody else.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NoReturn

from ..backends.base import DEFAULT_EXECUTOR, ExecutorConfig, Limits
from ..errors import ApirError
from ..protocol import PROTOCOL_VERSION, ErrorCode, ProtocolError
from ..protocol import messages as m
from ..protocol.messages import HEADER, MAX_BODY, decode_body, decode_header, encode
from ..transport import Address, Connection, listen
from . import holder
from .handshake import HANDSHAKE_MAX, MAX_PENDING, Gate, RateLimitedLog, check_hello, peer_key
from .holder import Holder
from .published import KEEP_ALIVE, REQUEST_MAX, Grant, PublishedModel, Shelf, ask
from .session import SessionConfig
from .worker import (
    MAX_SLOTS,
    READY,
    Bind,
    release_cgroup,
    run_worker,
    session_cgroup,
    wait_for_bind,
    warm_up,
)

__all__ = ["MAX_PENDING", "Daemon", "HostConfig", "run"]  # MAX_PENDING: the hostile tests' flood size

log = logging.getLogger("apir.host")

MAX_WARM = 8  # idle workers kept ahead: each holds a device context (~500 MiB on CUDA)
POOL_RETRIES = 3  # warm workers failing to start in a row before the pool is given up


@dataclass(frozen=True)
class HostConfig:
    listen: tuple[Address, ...]
    device: str | None = None
    token: str | None = None  # required from guests on tcp/vsock listeners
    max_memory: int = 0  # per session, bytes (0: unlimited)
    max_sessions: int = 16
    max_handles: int = 65536
    max_graph_nodes: int = 1 << 16
    max_arena: int = 1 << 30
    max_message: int = MAX_BODY  # largest frame a session's guest may send, bytes
    io_timeout: float = 60.0  # a started frame must complete, a reply must drain (seconds)
    group: int | None = None
    handshake_timeout: float = 5.0
    spin_us: int | None = None  # sessions busy-poll this long for frames (None: by device)
    executor: ExecutorConfig = DEFAULT_EXECUTOR  # how sessions run graphs
    warm_workers: int = 0  # idle workers kept with the device initialised (see gpu_host)
    max_compute_seconds: float = 0  # a session's request may run this long (0: no limit)
    # a worker's OS memory cap past its start, bytes (0: --max-memory plus headroom, see
    # worker.os_memory_cap; none without --max-memory)
    os_memory: int = 0
    models: tuple[PublishedModel, ...] = ()  # published: their weights are shared (--model)
    keep_alive: float = KEEP_ALIVE  # seconds a shared copy outlives its last session (<0: forever)

    def __post_init__(self) -> None:
        if not self.listen:
            raise ApirError("apir host needs at least one --listen address")
        remote = [a for a in self.listen if a.scheme != "unix"]
        if remote and not self.token:
            raise ApirError(
                f"listening on {remote[0]} requires a token: pass --token-file FILE (the guest "
                "sets APIR_TOKEN or --token-file with the same secret)"
            )
        if not 0 < self.max_sessions <= MAX_SLOTS:
            raise ApirError(f"--max-sessions must be in 1..{MAX_SLOTS}")
        if self.max_graph_nodes <= 0:
            raise ApirError("--max-graph-nodes must be positive")
        if self.max_handles < 0 or self.max_arena < 0:
            raise ApirError("--max-handles and --max-arena must not be negative")
        if not 1 << 16 <= self.max_message <= MAX_BODY:
            raise ApirError(f"--max-message must be between 64K and {MAX_BODY >> 20}M")
        if not self.io_timeout > 0:
            raise ApirError("--io-timeout must be positive")
        if not self.handshake_timeout > 0:
            raise ApirError("--handshake-timeout must be positive")
        if not 0 <= self.warm_workers <= min(MAX_WARM, self.max_sessions):
            raise ApirError(f"--warm-workers must be in 0..{min(MAX_WARM, self.max_sessions)} "
                            "(at most 8, and at most --max-sessions)")
        names = [p.name for p in self.models]
        if len(set(names)) < len(names):
            raise ApirError(f"--model: two models are published as {next(n for n in names if names.count(n) > 1)!r}")
        if self.max_compute_seconds < 0:
            raise ApirError("--max-compute-seconds must not be negative")
        if self.os_memory < 0:
            raise ApirError("a worker's OS memory cap must not be negative")


def gpu_host(device: str | None) -> bool:
    """Whether sessions will run on a GPU. Asked through NVML, not the CUDA runtime: the
    daemon must not initialise CUDA, which does not survive the fork of its workers."""
    if device is not None:
        return device != "cpu"
    import torch

    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    return torch.cuda.is_available() or torch.backends.mps.is_available()


@dataclass
class Pending:
    sock: socket.socket
    address: Address
    peer: str
    key: str | None  # whom per-peer limits count (None: a Unix socket)
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


@dataclass
class Worker:
    session: int
    slot: int
    peer: str
    started: float
    # the guest's socket, kept where the worker may be killed at its cgroup's memory limit,
    # to tell the guest why (_reap); elsewhere closed at once, so a dead worker's guest
    # sees the hang-up without waiting for the reap
    sock: socket.socket | None = None
    pool: socket.socket | None = None  # its socketpair with the daemon: published model requests


@dataclass
class Idle:
    """A warm worker waiting for its session; ``sock``: the daemon's end of its socketpair."""

    sock: socket.socket
    ready: bool = False  # it has said READY: its device is initialised


def _child(what: str, run: Callable[[], None]) -> NoReturn:
    """A forked child's whole life: ``run``, then exit (1 after logging a failure). It
    never returns into the parent's loop, whatever ``run`` raises."""
    code = 0
    try:
        run()
    except BaseException:  # noqa: BLE001
        log.exception("%s failed", what)
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Daemon:
    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self.listeners: dict[socket.socket, Address] = {}
        self.pending: dict[socket.socket, Pending] = {}
        self.workers: dict[int, Worker] = {}  # pid -> worker
        self.idle: dict[int, Idle] = {}  # pid -> warm worker with no session yet
        self.served = {"warm": 0, "cold": 0}  # sessions started on a ready warm worker, or not
        self.pool_failures = 0  # warm workers in a row that exited before they were ready
        # per slot: allocated bytes, peak bytes — written by workers, read by the parent
        self.stats = multiprocessing.RawArray("q", 2 * MAX_SLOTS)
        self.next_session = 1
        self.selector = selectors.DefaultSelector()
        self.stopping = False
        self.gate = Gate()
        self.refusals = RateLimitedLog(log)
        # sessions on a CPU told to keep dequantized f32 forms of weights: for a published
        # model the daemon makes them once, for all of them
        forms = bool(config.models) and config.executor.dequant_cache and not gpu_host(config.device)
        # on a CUDA host a published model's one copy lives on the device, in a holder
        # process per model (apir.host.holder), not in a memfd of the daemon's
        held = holder.TRANSPORT.device(config.device) if config.models else None
        self.shelf = Shelf(config.models, config.keep_alive, forms, config.executor.cpu_int4, held,
                           self._fork_holder, self.selector)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for addr in self.config.listen:
            sock = listen(addr, self.config.group)
            sock.setblocking(False)
            self.listeners[sock] = addr
            self.selector.register(sock, selectors.EVENT_READ)
            log.info("listening on %s", addr)
        self.shelf.preload()  # --keep-alive -1 on a CUDA host: every model's holder now
        self._fill_pool()

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        try:
            while not self.stopping:
                for key, _ in self.selector.select(timeout=0.2):
                    sock = key.fileobj
                    if sock in self.listeners:
                        self._accept(sock)
                    elif sock in self.pending:
                        self._read_handshake(self.pending[sock])
                    elif key.data in self.idle:
                        self._pool_event(key.data)
                    elif isinstance(key.data, Holder):
                        self.shelf.holder_event(key.data)
                    elif key.data in self.workers:
                        self._worker_request(key.data)
                self._expire_handshakes()
                self.shelf.expire(time.monotonic())
                self._reap()
        except KeyboardInterrupt:
            pass
        finally:
            self.shutdown()

    def stop(self) -> None:
        self.stopping = True

    def shutdown(self) -> None:
        for pid in list(self.idle):  # they hold nothing yet: told by EOF, or by PDEATHSIG
            self._drop_idle(pid).sock.close()
        for sock, addr in list(self.listeners.items()):
            self.selector.unregister(sock)
            sock.close()
            if addr.scheme == "unix":
                Path(addr.path).unlink(missing_ok=True)
        self.listeners.clear()
        for p in list(self.pending.values()):
            self._drop(p)
        for pid in list(self.workers):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3
        while self.workers and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        for pid in list(self.workers):
            os.kill(pid, signal.SIGKILL)
        self._reap(block=True)
        self._end_holders(self.shelf.close())

    def _end_holders(self, pids: list[int]) -> None:
        """Wait for the holders told to end (their sockets closed) so that their device
        memory is free when the daemon exits; those still there after 5 s are killed."""
        deadline = time.monotonic() + 5
        for pid in pids:
            while True:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    self.shelf.reaped(pid, status)
                    break
                if time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    deadline = float("inf")  # then wait for it
                time.sleep(0.02)

    # ------------------------------------------------------------ handshake
    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, peer = listener.accept()
        except BlockingIOError:
            return
        except OSError as e:  # EMFILE, ENFILE, ECONNABORTED...: never fatal to the daemon
            self.refusals.warning(time.monotonic(), "accept failed: %s", e.strerror or e)
            time.sleep(0.01)  # the listener stays readable; do not spin
            return
        addr, now = self.listeners[listener], time.monotonic()
        peer_s = f"{addr.scheme}:{peer}" if peer else f"{addr.scheme}:local"
        key = peer_key(addr, peer)
        why = self.gate.admit(addr, key, now)
        if why is not None:  # a flood of idle or failing connections: closed at once
            self.refusals.warning(now, "dropped %s: %s", peer_s, why.message)
            if why.code == ErrorCode.QUOTA:  # over its share: a failure like any other
                self.gate.failed(key, now)
            else:  # its budget is spent: a guest retrying a wrong token is told why
                try:  # one small frame into an empty socket buffer: never blocks
                    sock.send(encode(why), socket.MSG_DONTWAIT)
                except OSError:
                    pass
            sock.close()
            return
        sock.setblocking(False)
        self.pending[sock] = Pending(sock, addr, peer_s, key, now + self.config.handshake_timeout)
        self.selector.register(sock, selectors.EVENT_READ)

    def _read_handshake(self, p: Pending) -> None:
        try:
            data = p.sock.recv(HANDSHAKE_MAX + HEADER.size - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(p)
            return
        p.buf += data
        if len(p.buf) < HEADER.size:
            return
        try:
            header = decode_header(bytes(p.buf[: HEADER.size]), HANDSHAKE_MAX)
            if m.OPCODES[header.opcode] is not m.Hello:
                raise ProtocolError(f"expected a Hello handshake first, got {m.OPCODES[header.opcode].__name__}")
            if len(p.buf) < HEADER.size + header.length:
                return
            if len(p.buf) > HEADER.size + header.length:
                raise ProtocolError("data after the Hello before the Welcome")
            hello = decode_body(header.opcode, bytes(p.buf[HEADER.size :]))
        except ProtocolError as e:
            self._refuse(p, m.Error(ErrorCode.PROTOCOL, str(e)))
            return
        self._handle_hello(p, hello)

    def _handle_hello(self, p: Pending, hello: m.Hello) -> None:
        err = check_hello(hello, None if p.address.scheme == "unix" else self.config.token)
        if err is not None:
            self._refuse(p, err)
            return
        if hello.status_only:
            self._send_then_close(p, self.status())
            return
        if len(self.workers) >= self.config.max_sessions:
            self._refuse(p, m.Error(ErrorCode.QUOTA, f"the host is already serving {len(self.workers)} "
                                    "sessions (its --max-sessions limit); try again later"))
            return
        self._spawn(p, hello)

    def _refuse(self, p: Pending, err: m.Error) -> None:
        now = time.monotonic()
        if err.code in (ErrorCode.PROTOCOL, ErrorCode.AUTH):  # no valid token shown
            self.gate.failed(p.key, now)
        self.refusals.warning(now, "refused %s: %r", p.peer, err.message[:200])  # %r: no forged lines
        self._send_then_close(p, err)

    def _send_then_close(self, p: Pending, msg: object) -> None:
        try:
            p.sock.setblocking(True)
            p.sock.settimeout(1.0)
            p.sock.sendall(encode(msg))
        except OSError:
            pass
        self._drop(p)

    def _drop(self, p: Pending) -> None:
        if self.pending.pop(p.sock, None) is not None:
            self.gate.release(p.address, p.key)
        try:
            self.selector.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        p.sock.close()

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        for p in [p for p in self.pending.values() if p.deadline < now]:
            self.refusals.warning(now, "dropped %s: no handshake within %.0fs", p.peer,
                                  self.config.handshake_timeout)
            self.gate.failed(p.key, now)
            self._drop(p)
        self.refusals.tick(now)

    # ------------------------------------------------------------ workers
    def _spawn(self, p: Pending, hello: m.Hello) -> None:
        session = self.next_session
        self.next_session += 1
        used = {w.slot for w in self.workers.values()}
        slot = next(i for i in range(MAX_SLOTS) if i not in used)
        self.stats[2 * slot] = self.stats[2 * slot + 1] = 0
        self.pending.pop(p.sock)
        self.gate.release(p.address, p.key)
        self.selector.unregister(p.sock)
        bind = Bind(session, slot, p.peer, replace(hello, token="")).encode()
        keep = False
        for attempt in range(2):  # the idle workers, then (all dead, or none) a cold one
            if not self.idle or attempt:
                self._fork_worker()
            taken = self._hand_over(bind, p.sock)
            if taken is not None:
                pid, how, pool = taken
                self.served[how] += 1
                # the guest's socket stays open here only where the worker's cgroup can kill
                # it: then the daemon tells the guest why (see _reap)
                keep = session_cgroup(session, os.getpid()) is not None
                self.workers[pid] = Worker(session, slot, p.peer, time.monotonic(), p.sock if keep else None, pool)
                self.selector.register(pool, selectors.EVENT_READ, pid)  # its published model requests
                log.info("session %d start: peer %s, client %r (%s worker pid %d)", session, p.peer,
                         hello.client[:80], how, pid)  # %r: a guest's string never forges log lines
                break
        else:
            with contextlib.suppress(OSError):
                p.sock.send(encode(m.Error(ErrorCode.INTERNAL, "the host could not start a worker "
                                           "for this session (see its log); try again")), socket.MSG_DONTWAIT)
            log.warning("session %d: no worker could take the guest; closing", session)
        if not keep:
            p.sock.close()
        self._fill_pool()

    def _hand_over(self, bind: bytes, guest: socket.socket) -> tuple[int, str, socket.socket] | None:
        """Give the guest's socket and its Bind to an idle worker, ready ones first: the
        worker's pid, "warm" or "cold" (still starting) and its pool socket (kept open for
        its requests), or None when every idle worker has died."""
        for pid in sorted(self.idle, key=lambda pid: not self.idle[pid].ready):
            w = self._drop_idle(pid)
            try:  # a small message into an empty buffer: never blocks
                socket.send_fds(w.sock, [bind], [guest.fileno()])
            except OSError:  # it died since: its exit is reaped like any child's
                w.sock.close()
                continue
            return pid, "warm" if w.ready else "cold", w.sock
        return None

    def _fork_worker(self) -> None:
        """Fork a worker: it initialises the device, then waits idle for its session."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid:
            theirs.close()
            ours.setblocking(False)
            self.idle[pid] = Idle(ours)
            self.selector.register(ours, selectors.EVENT_READ, pid)
            return

        def work() -> None:  # keeps no listener, no pending handshake, no other worker's pool end
            self._forked(ours)
            self._work(theirs)
        _child("worker", work)

    def _forked(self, *also: socket.socket) -> None:
        """In a child just forked (a worker or a holder): keep nothing of the daemon's. No
        listener, no pending handshake, no other session's guest socket (that guest must see
        its worker's exit), no worker's pool end, no published copy or holder socket (see
        ``Shelf.close_inherited``), nor ``also``; die with the daemon."""
        _die_with_parent()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.selector.close()
        for sock in [*self.listeners, *self.pending, *(w.sock for w in self.idle.values()),
                     *(w.sock for w in self.workers.values() if w.sock is not None),
                     *(w.pool for w in self.workers.values() if w.pool), *also]:
            sock.close()
        self.shelf.close_inherited()

    def _fork_holder(self, model: PublishedModel, device: str) -> Holder:
        """Fork the holder of ``model``'s copy on ``device`` (see apir.host.holder). Its
        liveness pipe's write end stays in it alone: the daemon keeps the read end, and
        lends it to the workers it grants the copy to."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        alive, alive_w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for sock in (ours, theirs):
                sock.close()
            os.close(alive)
            os.close(alive_w)
            raise
        if pid:
            theirs.close()
            os.close(alive_w)
            ours.setblocking(False)
            return Holder(model.name, device, pid, ours, alive, time.monotonic())

        def hold() -> None:
            self._forked(ours)
            os.close(alive)
            holder.serve(model.name, model.path, device, theirs)
        _child("holder", hold)

    def _work(self, pool: socket.socket) -> None:
        """A worker's life, in the forked process: initialise, wait for the session, serve it."""
        warm_up(self.config.device, self.config.executor)
        got = wait_for_bind(pool)
        if got is None:
            return
        copies: dict[str, Grant] = {}

        def published(name: str, size: int, digest: bytes, notify) -> Grant:
            if name not in copies:
                copies[name] = ask(pool, name, size, digest, self.config.io_timeout, notify)
            return copies[name]
        bind, sock = got
        slot = bind.slot

        def publish(allocated: int, peak: int) -> None:
            self.stats[2 * slot], self.stats[2 * slot + 1] = allocated, peak

        limits = Limits(self.config.max_memory, self.config.max_handles, self.config.max_graph_nodes)
        cfg = SessionConfig(self.config.device, limits, self.config.max_arena, bind.session, bind.peer,
                            self.config.io_timeout, self.config.spin_us, self.config.executor,
                            self.config.max_compute_seconds, self.config.os_memory)
        run_worker(Connection.over(sock, bind.peer, self.config.max_message), bind.hello, cfg, publish,
                   published)

    # ------------------------------------------------------------ warm workers
    def _fill_pool(self) -> None:
        while len(self.idle) < self.config.warm_workers and self.pool_failures < POOL_RETRIES:
            self._fork_worker()

    def _pool_event(self, pid: int) -> None:
        """An idle worker said READY, or exited (its end of the socketpair closed)."""
        w = self.idle[pid]
        try:
            data = w.sock.recv(len(READY))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data == READY:
            w.ready, self.pool_failures = True, 0
            return
        self._drop_idle(pid).sock.close()
        if data:  # it says nothing else, ever: a worker that does is not to be trusted
            os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # reaped by _reap already
            pass
        if not w.ready:
            self.pool_failures += 1
        log.warning("warm worker %d exited %s%s", pid, "idle" if w.ready else "while starting",
                    "; sessions will start cold" if self.pool_failures >= POOL_RETRIES else "")
        self._fill_pool()

    def _worker_request(self, pid: int) -> None:
        """A session's worker asks for a published model (or exited: its pool end closed)."""
        w = self.workers[pid]
        try:
            data = w.pool.recv(REQUEST_MAX + 1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data == READY:  # a cold worker's, sent before it got its session
            return
        t0 = time.monotonic()
        if not data or not self.shelf.answer(w.pool, w.session, data):
            self._close_pool(w)
        busy = time.monotonic() - t0  # reading a model from disk: seconds the daemon was away,
        for p in self.pending.values():  # which no guest's handshake deadline may pay for
            p.deadline += busy

    def _close_pool(self, w: Worker) -> None:
        if w.pool is not None:
            self.selector.unregister(w.pool)
            w.pool.close()
            w.pool = None

    def _drop_idle(self, pid: int) -> Idle:
        w = self.idle.pop(pid)
        self.selector.unregister(w.sock)
        return w

    def _reap(self, block: bool = False) -> None:
        # not blocking: every exited child, idle workers that died included (no zombies)
        while self.workers or not block:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = self.workers.pop(pid, None)
            if w is None:
                self.shelf.reaped(pid, status)  # a holder's exit is logged
                continue
            self._close_pool(w)
            self.shelf.release(w.session, time.monotonic())
            killed = release_cgroup(w.session)
            if w.sock is not None:
                if killed:  # the guest's last frame: one small Error into its socket, never blocks
                    with contextlib.suppress(OSError):
                        w.sock.send(encode(m.Error(ErrorCode.QUOTA, f"session {w.session} was killed by "
                                                   "the host's kernel: its worker went past its memory "
                                                   f"limit (--max-memory {self.config.max_memory} bytes "
                                                   "plus headroom)")), socket.MSG_DONTWAIT)
                w.sock.close()
            if killed:
                log.warning("session %d worker was killed at its cgroup memory limit (set from "
                            "--max-memory); its memory is released", w.session)
            elif os.WIFSIGNALED(status):
                log.warning("session %d worker died (signal %d); its memory is released", w.session,
                            os.WTERMSIG(status))
            elif os.WEXITSTATUS(status):
                log.warning("session %d worker exited with status %d", w.session, os.WEXITSTATUS(status))
            self.stats[2 * w.slot] = self.stats[2 * w.slot + 1] = 0

    def status(self) -> m.Status:
        sessions = tuple(
            m.SessionInfo(w.session, pid, w.peer, self.stats[2 * w.slot], self.stats[2 * w.slot + 1])
            for pid, w in sorted(self.workers.items())
        )
        dev = self.config.device or "auto"
        ready = sum(w.ready for w in self.idle.values())
        return m.Status(PROTOCOL_VERSION, m.Device(dev, dev, "", 0, 0, ()), sessions,
                        self.config.max_sessions, self.config.max_memory, self.config.warm_workers,
                        ready, self.served["warm"], self.served["cold"], self.shelf.names(),
                        self.shelf.resident_bytes(), self.shelf.loads,
                        tuple(m.SharedInfo(*copy) for copy in self.shelf.resident()))


def run(config: HostConfig) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="apir host: %(message)s")
    try:  # import the executor (torch, dynamo: ~3.5 s) once; workers fork with it loaded
        from ..backends import local  # noqa: F401
    except ImportError:
        raise ApirError("apir host needs PyTorch: pip install 'apir[host]'") from None
    daemon = Daemon(config)
    daemon.start()
    daemon.serve_forever()
