"""Real host daemons for tests: subprocesses listening on a unix socket and loopback TCP."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from apir.backends.remote import host_status
from apir.transport import HostUnreachable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Host:
    proc: subprocess.Popen
    unix: str
    tcp: str
    token_file: str
    log: Path

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
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_host(tmp: Path, *extra: str) -> Host:
    token_file = tmp / "token"
    token_file.write_text(secrets.token_hex(16))
    os.chmod(token_file, 0o600)
    sock = tmp / "apir.sock"
    unix, tcp = f"unix://{sock}", f"tcp://127.0.0.1:{free_port()}"
    log = tmp / "host.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "apir.cli", "host", "--listen", unix, "--listen", tcp,
         "--device", "cpu", "--token-file", str(token_file), *extra],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
    )
    host = Host(proc, unix, tcp, str(token_file), log)
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                host_status(unix)
                return host
            except HostUnreachable:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"host did not start: {log.read_text()}") from None
                time.sleep(0.1)
    except BaseException:  # whatever went wrong, no daemon outlives the test that started it
        host.stop()
        raise
