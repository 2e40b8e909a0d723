"""Real host daemons for tests: subprocesses listening on a unix socket and loopback TCP."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from apir.backends.remote import host_status
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

    def stop(self) -> None:
        self.daemon.stop()


def start_host(tmp: Path, *extra: str) -> Host:
    token_file = write_token(tmp / "token")
    unix, tcp = f"unix://{tmp / 'apir.sock'}", f"tcp://127.0.0.1:{free_port()}"
    daemon = spawn([unix, tcp], tmp / "host.log", device="cpu", token_file=token_file, options=extra)
    return Host(daemon, unix, tcp, token_file, daemon.log)
