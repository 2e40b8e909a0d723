"""One guest session, served in its own worker process: a private executor, a private
arena, and the dispatcher — the single place where guest requests turn into calls.

Everything a guest sends is validated before use: the frame by the protocol decoder, the
request by the executor (handles, ranges, quotas, graph rules), arena ranges here. Errors
go back as data; nothing here asserts on guest input.
"""

from __future__ import annotations

import logging
import os
import re
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import numpy as np

from ..backends.base import (
    DEFAULT_EXECUTOR,
    BackendError,
    BufferPurpose,
    ExecutorConfig,
    Limits,
    Pending,
    QuotaError,
)
from ..backends.executor import Executor
from ..errors import ApirError
from ..graph import DType, GraphError, Op
from ..protocol import (
    INLINE_MAX,
    WANT_REPLY,
    ErrorCode,
    ProtocolError,
    decode_body,
    encode,
)
from ..protocol import messages as m
from ..protocol.step import Placement, StepLayout, pack, private_copy
from ..transport import Arena, ArenaError, Channel, ConnectionClosed
from .published import Asker, Grant, misfit

log = logging.getLogger("apir.host")

MAX_IN_FLIGHT = 2  # Steps queued on the device before the oldest one's reply must go out
# Polling for the guest's next frame while a step runs (to queue it before replying) is
# for steps whose next one comes while they run: decode-sized ones, and any fed step (its
# guest chains steps by construction: a batch of 16 or 64 sequences' decode tokens, each
# step fed from the last). A prefill chunk's guest waits for its reply, so a larger step
# is waited for in a synchronize and its reply goes out first: no polling for ~6 ms (on an
# H200, asking the CUDA event back to back cost a 1B pp512 ~6%, every 20 µs within the
# ±3% noise between runs). Replying first to a fed 16-row step left the device idle while
# the reply went out and the next step came in: 0.80 of native at 16 streams (H100).
PIPELINED_MAX_TOKENS = 8
READY_POLL_S = 20e-6  # while polling, whether the step is done is asked this often
MAX_ERROR = 2048  # characters of an error message sent back
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{5,}")
_OOM = re.compile(r"can't allocate memory|out of memory")  # torch's CPU and CUDA allocators
_PATH = re.compile(r"(?<![\w.:/])(?:/[\w.+@-]+){2,}/?")


class InFlight(NamedTuple):
    """A Step queued on the device: ``finish()`` waits for its outputs, returns the reply."""

    rid: int
    pending: Pending
    finish: Callable[[], object]
    pipelined: bool = False  # its guest may send the next step before reading this one


@dataclass(frozen=True)
class SessionConfig:
    device: str | None
    limits: Limits
    max_arena: int
    session: int
    peer: str
    io_timeout: float = 60.0  # a started frame must keep arriving, a reply must drain
    spin_us: int | None = None  # busy-poll for frames this long (None: by device, see transport.spin_seconds)
    executor: ExecutorConfig = DEFAULT_EXECUTOR  # how the session's graphs run
    max_compute_seconds: float = 0  # a request may run this long (0: no limit), see _watchdog
    os_memory: int = 0  # the worker's OS memory cap past its start (0: from limits.max_memory)


def device_message(backend: Executor) -> m.Device:
    d = backend.device()
    return m.Device(d.name, d.kind, d.description, d.memory_free, d.memory_total,
                    tuple(sorted(d.capabilities)))


def scrub(text: str) -> str:
    """An error message as a guest may see it: one line, no host paths, no addresses.

    Our own messages never contain either; this guards against text from torch or numpy
    carried inside them (C++ frames with "0x7f..." addresses, source paths)."""
    line = text.strip().splitlines()[0] if text.strip() else text
    line = _PATH.sub("<path>", _ADDRESS.sub("0x…", line))
    return line if len(line) <= MAX_ERROR else line[:MAX_ERROR] + "…"


def error_for(exc: BaseException) -> m.Error:
    """An exception raised while serving a request, as the Error the guest will re-raise."""
    if isinstance(exc, QuotaError):
        return m.Error(ErrorCode.QUOTA, scrub(str(exc)))
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and _OOM.search(str(exc))):
        # the worker's OS limit (see worker.os_memory_cap), or torch's allocator's
        return m.Error(ErrorCode.QUOTA, "the host ran out of memory for this request under the "
                       "session's OS memory limit (set from --max-memory)")
    if isinstance(exc, GraphError):
        return m.Error(ErrorCode.GRAPH, scrub(str(exc)))
    if isinstance(exc, (BackendError, ArenaError)):
        return m.Error(ErrorCode.INVALID, scrub(str(exc)))
    if isinstance(exc, ProtocolError):
        return m.Error(ErrorCode.PROTOCOL, scrub(str(exc)))
    if isinstance(exc, ApirError):
        return m.Error(ErrorCode.INVALID, scrub(str(exc)))
    # Our own bug, not the guest's: say so without leaking paths or addresses.
    log.exception("internal error while serving a request")
    return m.Error(ErrorCode.INTERNAL, f"internal host error ({type(exc).__name__}); see the host log")


class Session:
    def __init__(self, chan: Channel, backend: Executor, arena: Arena | None, config: SessionConfig,
                 publish=None, liveness: socket.socket | None = None,
                 published: Asker | None = None) -> None:
        self.chan, self.backend, self.arena, self.config = chan, backend, arena, config
        if arena is not None:
            backend.use_host_memory(arena.view)  # steps read and write there (_start_step)
        # a published model's read-only copy, by name and the guest's layout of it (the
        # daemon's; the callable may tell the guest it waits for the copy to be loaded)
        self.published = published
        self._holders: dict[int, str] = {}  # liveness fd -> published model (_watch_holder)
        # the guest's socket, watched for a hang-up (with rings, frames no longer use it)
        self.liveness = liveness
        self.deferred: m.Error | None = None  # first failure of a request nobody waited for
        self.publish = publish or (lambda allocated, peak: None)
        self.busy = False  # a request is being served (see _watch_hangup)
        self.requests = 0  # frames read, and whether a reply is being sent (see _watchdog)
        self.sending = False
        self.layouts: dict[int, StepLayout] = {}  # graph id -> its Step layout
        self._published: tuple[int, int] | None = None  # the memory figures last published

    # ------------------------------------------------------------ loop
    def serve(self) -> None:
        """Answer requests until the guest says goodbye or goes away."""
        # Idle between requests is fine (a chat waits on its user); once a frame has
        # started, every read must make progress within io_timeout, and every reply must
        # drain within it, so a stalled or non-reading guest ends its own session.
        self.chan.set_timeout(self.config.io_timeout)
        if self.liveness is not None:
            threading.Thread(target=self._watch_hangup, args=(self.liveness,), name="hangup",
                             daemon=True).start()
        if self.config.max_compute_seconds:
            threading.Thread(target=self._watchdog, args=(self.config.max_compute_seconds,),
                             name="watchdog", daemon=True).start()
        # Steps queued on the device, replies not sent yet, oldest first (see _next_frame_first)
        in_flight: deque[InFlight] = deque()
        while True:
            if in_flight and (len(in_flight) >= MAX_IN_FLIGHT or not self._next_frame_first(in_flight[0])):
                if not self._reply(in_flight.popleft()):
                    return
                continue
            try:
                self.busy = bool(in_flight)
                if not in_flight:  # wait with no timeout between frames
                    self.chan.wait_idle()
                header, body, fds = self.chan.recv_frame()
                self.busy = True
                self.requests += 1
                for fd in fds:  # guests never send descriptors
                    os.close(fd)
                self._check_holders()
                # a Step stays a tuple of fields: the hot path makes no message objects
                msg = m.parse_step(body) if header.opcode == m.STEP_OPCODE else decode_body(header.opcode, body)
            except ConnectionClosed:
                return
            except ProtocolError as e:
                # The stream can no longer be trusted to be in frame: report and end.
                self._send(m.Error(ErrorCode.PROTOCOL, scrub(str(e))), 0)
                return
            except TimeoutError:
                log.warning("session %d: a frame stalled for %.0fs; closing the session",
                            self.config.session, self.config.io_timeout)
                self._send(m.Error(ErrorCode.PROTOCOL, f"frame not completed within "
                                   f"{self.config.io_timeout:g}s; closing the session"), 0)
                return
            if isinstance(msg, m.Goodbye):
                return
            rid, wanted = header.request_id, header.flags & WANT_REPLY
            if wanted and header.opcode == m.STEP_OPCODE:  # a Step the guest waits for: queue it
                try:
                    in_flight.append(self.dispatch(msg, rid))
                except Exception as e:  # noqa: BLE001 - every failure becomes an Error reply
                    in_flight.append(InFlight(rid, _DONE, partial(error_for, e)))
                self._publish()  # a first step may have made a weight's derived form
                continue
            while in_flight:  # everything else runs after the queued steps, in order
                if not self._reply(in_flight.popleft()):
                    return
            try:
                reply = self.dispatch(msg, rid)
                if isinstance(reply, InFlight):  # a Step nobody waits for: run it now
                    reply = reply.finish()
            except Exception as e:  # noqa: BLE001 - every failure becomes an Error reply
                reply = error_for(e)
            self._publish()
            if wanted:
                if not self._send_first_failure(reply, rid):
                    return
            elif isinstance(reply, m.Error) and self.deferred is None:
                what = m.OPCODES[header.opcode].__name__
                self.deferred = m.Error(reply.code, f"an earlier {what} failed: {reply.message}")

    def _next_frame_first(self, oldest: InFlight) -> bool:
        """While the oldest queued step runs on the device, wait for the guest's next frame
        (True): a pipelining guest sends step n+1 before it reads token n, and queueing it
        before replying keeps the device busy while the reply travels. False, to reply
        first, once the oldest step is done or the channel's spin time has passed, and at
        once for a step that is not ``pipelined``."""
        if not oldest.pipelined:
            return False
        now = ask = time.perf_counter()
        end = now + self.chan.spin_seconds
        while True:
            if now >= ask:
                if oldest.pending.ready():
                    return False
                ask = now + READY_POLL_S
            if self.chan.frame_ready():
                return True
            now = time.perf_counter()
            if now >= end:
                return False

    def _reply(self, step: InFlight) -> bool:
        """Send a queued step's reply once its outputs are back; False: end the session."""
        try:
            reply = step.finish()
        except Exception as e:  # noqa: BLE001 - every failure becomes an Error reply
            reply = error_for(e)
        return self._send_first_failure(reply, step.rid)

    def _send_first_failure(self, reply: object, rid: int) -> bool:
        """Send ``reply``, or the failure of a request nobody waited for, the root cause."""
        if self.deferred is not None:
            reply, self.deferred = self.deferred, None
        return self._send(reply, rid)

    def _publish(self) -> None:
        """Report the session's memory to the daemon when it changed (not per decode step)."""
        usage = self.backend.memory()
        if usage != self._published:
            self._published = usage
            self.publish(*usage)

    def _watch_hangup(self, sock: socket.socket) -> None:
        """A guest that dies (or hangs up) while its request runs, or with requests still
        queued, ends this worker at once: its memory must not wait for a long compute or
        for leftovers nobody will read. Idle, the main loop sees EOF and ends cleanly.
        (A guest that only shuts down its sending side counts as gone.)"""
        watch = select.poll()
        watch.register(sock, select.POLLRDHUP)  # not POLLIN: no wake-up per frame
        watch.poll()
        # A guest that exits normally sends Goodbye (or reads its last reply) and hangs up at
        # once: give the main loop 100 ms to read that and end the session as an exit.
        for _ in range(10):
            try:
                pending = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                pending = b""
            except OSError:
                pending = b"x"  # reset: treat as gone
            if not (self.busy or pending):
                return  # idle: the main loop sees the end of the stream and ends cleanly
            time.sleep(0.01)
        log.info("session %d: the guest went away mid-request; ending its worker now",
                 self.config.session)
        os._exit(0)

    def _watch_holder(self, alive: int, name: str) -> None:
        """From now on, end this session when the holder of published model ``name``'s
        device copy ends (``alive``, a pipe only it writes, hangs up): the memory of a dead
        exporter is not to be read. The guest gets an Error that says so; the session's
        next request, or the one running, would otherwise fail in a way nobody can read.
        A thread waits for the hang-up during a request; the serving loop also looks
        before each request (``_check_holders``), so a request read after the holder's
        exit never runs on its memory, whichever thread the scheduler runs first."""
        if alive in self._holders:
            return
        self._holders[alive] = name

        def watch() -> None:
            poll = select.poll()
            poll.register(alive, select.POLLIN)  # POLLHUP is reported whatever is asked
            while not poll.poll():
                pass
            self._holder_gone(name)

        threading.Thread(target=watch, name="holder", daemon=True).start()

    def _check_holders(self) -> None:
        """Before a request: end the session if a watched holder has ended (see above)."""
        if not self._holders:
            return
        poll = select.poll()
        for fd in self._holders:
            poll.register(fd, select.POLLIN)
        for fd, _ in poll.poll(0):
            self._holder_gone(self._holders[fd])

    def _holder_gone(self, name: str) -> None:
        log.warning("session %d: the holder of published model %s ended; closing the session",
                    self.config.session, name)
        deadline = time.monotonic() + 1.0
        while self.sending and time.monotonic() < deadline:  # a reply going out: let it finish
            time.sleep(0.001)
        try:
            self.chan.send(m.Error(ErrorCode.INTERNAL, f"the host's copy of published model {name!r} "
                                   "on its GPU went away (the process holding it ended); this "
                                   "session is closed: start a new one"), 0)
        finally:
            os._exit(0)

    def _watchdog(self, limit: float) -> None:
        """``--max-compute-seconds``: a request still running ``limit`` seconds after its
        frame was read (a kernel cannot be interrupted) ends the worker, after an Error
        that says why. It looks every ``limit / 4`` seconds at what the serving loop
        already records, so a step costs nothing more. Time spent sending a reply to a
        slow reader is ``--io-timeout``'s, not counted here."""
        seen, since = None, time.monotonic()
        while True:
            time.sleep(limit / 4)
            now, state = time.monotonic(), (self.requests, self.busy and not self.sending)
            if state != seen:
                seen, since = state, now
            elif state[1] and now - since >= limit:
                log.warning("session %d: a request ran past --max-compute-seconds %g; ending "
                            "the session", self.config.session, limit)
                try:  # a guest that does not read its replies gets no message, and still ends
                    self.chan.send(m.Error(ErrorCode.QUOTA, f"a request ran longer than this session's "
                                           f"compute time limit ({limit:g} s, --max-compute-seconds); "
                                           "the session is closed"), 0)
                finally:
                    os._exit(0)

    def _send(self, msg: object, rid: int) -> bool:
        """Send a reply (a message, or the blob fields of a Data reply, which is encoded
        without message objects); False when the guest is gone or stopped reading
        (end the session)."""
        self.sending = True
        try:
            try:
                self.chan.send_frame(m.data_frame(rid, 0, *msg) if isinstance(msg, tuple) else encode(msg, rid))
            except ProtocolError as e:  # a reply too large for one frame (inline, no arena)
                self.chan.send(m.Error(ErrorCode.INVALID, f"the reply cannot be sent: {scrub(str(e))}; "
                                       "read in smaller pieces or through the shared arena"), rid)
        except ProtocolError as e:  # the guest corrupted the reply ring's counters
            log.warning("session %d: %s; closing the session", self.config.session, scrub(str(e)))
            return False
        except ConnectionClosed:
            return False
        except (TimeoutError, OSError):
            log.warning("session %d: the guest stopped reading replies; closing the session",
                        self.config.session)
            return False
        finally:
            self.sending = False
        return True

    # ------------------------------------------------------------ dispatch
    def dispatch(self, msg: object, rid: int = 0) -> object:
        """The one place a request becomes a backend call. Returns the reply: a message,
        the blob fields of a Data, or for a Step the InFlight that will make its Data."""
        b = self.backend
        match msg:
            case tuple():  # a Step, as m.parse_step leaves it: its fields
                return self._start_step(rid, *msg)
            case m.GetDevices():
                return m.Devices((device_message(b),))
            case m.Supports(op=op, dtypes=dtypes):
                return m.Flag(b.supports(_op(op), [_dtype(d) for d in dtypes]))
            case m.AllocBuffer(handle=h, size=size, purpose=purpose):
                b.alloc_buffer(size, _purpose(purpose), handle=h)
            case m.FreeBuffer(handle=h):
                b.free_buffer(h)
            case m.ClearBuffer(handle=h, value=v):
                b.clear_buffer(h, v)
            case m.SetTensor(handle=h, offset=off, data=blob):
                b.set_tensor(h, off, self._blob_range(blob.inline, blob.arena_offset, blob.size))
            case m.GetTensor(handle=h, offset=off, size=size, arena_offset=dest):
                data = np.frombuffer(b.get_tensor(h, off, size), np.uint8)
                return self._data((data,), Placement(((0, data.shape),), data.size, ()), dest, size)
            case m.CopyTensor(src=s, src_offset=so, dst=d, dst_offset=do, size=n):
                b.copy_tensor(s, so, d, do, n)
            case m.RegisterGraph(graph_id=gid, graph=graph):
                b.register_graph(graph, gid=gid)
                self.layouts[gid] = StepLayout.of(graph)
            case m.FreeGraph(graph_id=gid):
                b.free_graph(gid)
                self.layouts.pop(gid, None)
            case m.OpenPublished(handle=h, name=name, layout=layout, size=size):
                grant = self._published_weights(name, layout, size)
                if grant.device is not None:  # a holder's copy on the device: computed on in place
                    b.adopt_device_buffer(h, grant.device.weights, grant.device.packed)
                    self._watch_holder(grant.device.alive, name)
                elif grant.data is not None:  # the daemon's read-only memfd
                    b.adopt_buffer(h, grant.data, grant.forms)
            case m.Synchronize():
                b.synchronize()
            case m.Hello():
                raise ProtocolError("a second handshake in one session")
            case _:
                raise ProtocolError(f"{type(msg).__name__} is not a request")
        return m.Ok()

    def _published_weights(self, name: str, layout: bytes, size: int) -> Grant:
        """The daemon's copy of published model ``name``, if it is laid out as the guest's."""
        if self.published is None:
            raise BackendError("this host shares no weights; upload them")
        grant = self.published(name, size, layout, partial(notify, self.chan))
        if grant.digest != layout or grant.size != size:  # the file changed since the daemon read its header
            raise misfit(name)
        return grant

    def _start_step(self, rid: int, gid: int, n_tokens: int, out_offset: int, capacity: int,
                    inline: bytes | memoryview, arena_offset: int, size: int,
                    pairs: tuple[tuple[int, int], ...]) -> InFlight:
        """A Step (its fields, ``pairs`` its feed): bind the inputs' bytes in place and
        queue the run. Its ``finish`` places the outputs in the graph's layout and returns
        the Data reply's blob fields (inline, arena_offset, size)."""
        layout = self.layouts.get(gid)
        if layout is None:
            raise BackendError(f"unknown graph id {gid}")
        feed, fed = _step_feed(gid, layout, pairs)
        payload = self._blob_range(inline, arena_offset, size)
        if arena_offset < 0:
            # Inline bytes that arrive as a view of the frame's body are private and
            # writeable already; others get one copy.
            inputs = layout.unpack_inputs(payload if isinstance(payload, memoryview) else private_copy(payload),
                                          n_tokens, fed)
        else:
            # In the arena the guest may change them at any time: what the executor only
            # computes with is read where it lies, the rest (indices it checks, sampling
            # parameters it branches on) copied once, privately, before anything looks at it.
            in_place = self.backend.inputs_read_in_place(gid)
            inputs = {name: a if name in in_place else a.copy()
                      for name, a in layout.unpack_inputs(payload, n_tokens, fed).items()}
        out = self._reply_views(layout, n_tokens, out_offset, capacity, arena_offset, size)
        pending = self.backend.submit(gid, inputs, feed, out)

        def finish() -> tuple[bytes, int, int]:
            outs = pending.result()
            return self._data(outs, layout.output_placement(outs, n_tokens), out_offset, capacity, out or ())

        return InFlight(rid, pending, finish, bool(fed) or n_tokens <= PIPELINED_MAX_TOKENS)

    def _data(self, arrays: Sequence[np.ndarray], place: Placement, out_offset: int,
              capacity: int, placed: Sequence[np.ndarray] = ()) -> tuple[bytes, int, int]:
        """The one output encoder: a Data reply's blob fields for ``arrays`` placed as
        ``place`` says, in the arena range the guest gave (``out_offset``, ``capacity``)
        when there is one and the payload is over INLINE_MAX and fits, else inline.
        ``placed``: ``_reply_views``' views; an array that is one is in place already."""
        size = place.size
        if self.arena is not None and out_offset >= 0 and INLINE_MAX < size <= capacity:
            self.arena.check(out_offset, size)
            for i, (arr, (offset, _)) in enumerate(zip(arrays, place.places)):
                if i < len(placed) and arr is placed[i]:
                    continue  # the executor copied it into its place
                self.arena.write(out_offset + offset, memoryview(np.ascontiguousarray(arr)).cast("B"))
            return b"", out_offset, size
        if size > m.MAX_BODY:  # refused before it is built (a listing repeated, a huge read)
            raise BackendError(f"the reply cannot be sent: its {size} bytes exceed the {m.MAX_BODY}-byte "
                               "frame limit; read in smaller pieces or through the shared arena")
        return pack(arrays, place), -1, size

    def _reply_views(self, layout: StepLayout, n_tokens: int, out_offset: int, capacity: int,
                     in_offset: int, in_size: int) -> list[np.ndarray] | None:
        """Where a step's outputs go in the arena, as writeable views for the executor to
        copy them into (``Executor.submit``'s ``out``), when the reply will go there (as
        ``_data`` decides) and the range is clear of the step's own inputs; else None."""
        size = layout.placement(True, n_tokens).size
        if self.arena is None or out_offset < 0 or not INLINE_MAX < size <= capacity:
            return None
        if in_offset >= 0 and out_offset < in_offset + in_size and in_offset < out_offset + size:
            return None  # overlapping its inputs: written after the run, as any reply
        return layout.unpack_outputs(self.arena.window(out_offset, size), n_tokens)

    def _blob_range(self, inline: bytes | memoryview, arena_offset: int, size: int) -> bytes | memoryview:
        """A blob's bytes, every field checked. In the arena: a window, for opaque tensor
        bytes that are copied once, straight into their buffer or input, before anything
        uses them (nothing parses them)."""
        if arena_offset < 0:
            if size != len(inline):
                raise ProtocolError("inline data length disagrees with its size field")
            return inline
        if self.arena is None:
            raise ArenaError("this session has no shared arena (TCP?): send data inline")
        if len(inline):
            raise ProtocolError("a blob cannot be both inline and in the arena")
        return self.arena.window(arena_offset, size)


_DONE = Pending(outputs=[])  # the Pending of a step that failed before it was queued


def notify(chan: Channel, text: str) -> None:
    """Tell the guest, whose reply is about to wait on ``text`` (see ``m.Notice``)."""
    try:
        chan.send(m.Notice(text))
    except (ConnectionClosed, TimeoutError, OSError, ProtocolError):
        pass  # the guest is gone or not reading: the reply's send finds out and ends the session


def _step_feed(gid: int, layout: StepLayout, pairs: list[tuple[int, int]] | tuple[tuple[int, int], ...]
               ) -> tuple[dict[str, int] | None, tuple[int, ...]]:
    """A Step's feed, (input index, output index) pairs, checked against its graph's
    layout: ({input name: output index} or None for none, the fed inputs' indices, sorted)."""
    if not pairs:
        return None, ()
    names, n_outputs = layout.names, len(layout.outputs)
    feed: dict[str, int] = {}
    for i, k in pairs:
        if not 0 <= i < len(names):
            raise BackendError(f"feed names input {i}, but graph {gid} has {len(names)} inputs")
        if not 0 <= k < n_outputs:
            raise BackendError(f"feed of input {names[i]!r} names output {k}, but graph {gid} "
                               f"has {n_outputs} outputs")
        if names[i] in feed:
            raise BackendError(f"input {names[i]!r} is fed twice")
        feed[names[i]] = k
    return feed, tuple(sorted(i for i, _ in pairs))


def _op(code: int) -> Op:
    try:
        return Op(code)
    except ValueError:
        raise BackendError(f"unknown op {code}") from None


def _dtype(code: int) -> DType:
    try:
        return DType(code)
    except ValueError:
        raise BackendError(f"unknown dtype {code}") from None


def _purpose(code: int) -> BufferPurpose:
    try:
        return BufferPurpose(code)
    except ValueError:
        raise BackendError(f"unknown buffer purpose {code}") from None
