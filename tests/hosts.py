"""Real host daemons for tests: subprocesses listening on a unix socket and loopback TCP."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from apir.backends.base import BackendError
from apir.backends.remote import RemoteBackend, host_status
from apir.graph import DType, GraphBuilder
from apir.protocol import messages as m
from apir.spawn import HostProcess, free_port, write_token
from apir.spawn import start_host as spawn

# How long a test waits for something the daemon will do: only a bound on a hang, never a
# speed the test asserts (a 2-core CI machine running several daemons can be slow).
WAIT = 60.0


@dataclass
class Host:
    daemon: HostProcess
    unix: str
    tcp: str
    token_file: str
    log: Path

    @property
    def proc(self):
        return self.daemon.proc

    def status(self):
        return host_status(self.unix)

    def wait_idle(self, timeout: float = WAIT):
        """Until no session is left (their workers exited and were reaped); the status then,
        or at ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if not st.sessions or time.monotonic() > deadline:
                return st
            time.sleep(0.05)

    def until(self, cond, what: str, timeout: float = WAIT) -> m.Status:
        """Poll the status until ``cond(status)``: a wait on a state, not a timing."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if cond(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not reached in {timeout:g}s; status {st}")
            time.sleep(0.02)

    def holders(self) -> list[int]:
        """The pids of the holders the daemon's log says it started, in order."""
        return [int(p) for p in re.findall(r"holder pid (\d+) loading", self.log.read_text())]

    def allocated(self, model) -> int:
        """The bytes the host's status charges ``model``'s session."""
        return next(s.allocated for s in self.status().sessions if s.session == model.backend.session)

    def stop(self) -> None:
        self.daemon.stop()


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def until(cond, what: str, timeout: float = WAIT) -> None:
    """Poll ``cond()`` until it holds: a wait on a state, not a timing."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout:g}s")
        time.sleep(0.02)


def start_host(tmp: Path, *extra: str) -> Host:
    token_file = write_token(tmp / "token")
    unix, tcp = f"unix://{tmp / 'apir.sock'}", f"tcp://127.0.0.1:{free_port()}"
    daemon = spawn([unix, tcp], tmp / "host.log", device="cpu", token_file=token_file, options=extra)
    return Host(daemon, unix, tcp, token_file, daemon.log)


def check_published_read_only(host: Host, layout: tuple[bytes, int], nbytes: int) -> None:
    """A session can neither write published model ``tiny``'s shared copy (by a tensor
    write, a clear, a copy into it or a graph that uses it as state) nor change what
    another session reads of its first ``nbytes``."""
    with RemoteBackend(host.unix) as b:
        handle = b.open_published("tiny", *layout)
        before = b.get_tensor(handle, 0, nbytes)
        own = b.alloc_buffer(64)
        for write in (lambda: b.set_tensor(handle, 0, np.ones(16, np.float32)),
                      lambda: b.clear_buffer(handle, 7),
                      lambda: b.copy_tensor(own, 0, handle, 0, 64)):
            write()
            with pytest.raises(BackendError, match=f"buffer {handle} holds a published model's shared weights"):
                b.synchronize()
        g = GraphBuilder()  # a KV-style write into the weights: their leaf as a STATE
        state = g.state(handle, 0, (4, 4), DType.F32)
        rows = g.input("rows", (1, 4), DType.F32)
        with pytest.raises(BackendError, match="holds shared weights, which are read-only"):
            b.register_graph(g.build(g.set_rows(state, rows, g.input("ids", (1,), DType.I32))))
        assert b.get_tensor(handle, 0, nbytes) == before
        b.free_buffer(handle)  # drops this session's use only
        b.synchronize()
    with RemoteBackend(host.unix) as other:
        assert other.get_tensor(other.open_published("tiny", *layout), 0, nbytes) == before
