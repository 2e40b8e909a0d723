"""Real host daemons for tests: subprocesses listening on a unix socket and loopback TCP."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from apir.backends.remote import host_status
from apir.spawn import HostProcess, free_port, write_token
from apir.spawn import start_host as spawn


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

    def wait_idle(self, timeout: float = 10.0):
        """Until no session is left (their workers exited and were reaped)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if not st.sessions or time.monotonic() > deadline:
                return st
            time.sleep(0.05)

    def stop(self) -> None:
        self.daemon.stop()


def start_host(tmp: Path, *extra: str) -> Host:
    token_file = write_token(tmp / "token")
    unix, tcp = f"unix://{tmp / 'apir.sock'}", f"tcp://127.0.0.1:{free_port()}"
    daemon = spawn([unix, tcp], tmp / "host.log", device="cpu", token_file=token_file, options=extra)
    return Host(daemon, unix, tcp, token_file, daemon.log)
