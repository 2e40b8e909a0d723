"""Start ``apir host`` as a subprocess, wait until it answers, stop it.

The one daemon spawner, for ``apir run --remote auto``, the bench's remote backends and
the tests. Guest side: it imports no torch (the daemon imports it in its own process).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import ApirError
from .transport import HostUnreachable, default_socket_path

START_TIMEOUT = 60.0  # seconds for `apir host` to import torch and start listening


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_token(path: Path) -> str:
    """Write a fresh shared secret to ``path`` (a new file, readable by this user only)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16))
    return str(path)


def _last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def _answers(address: str, token_file: str | None = None) -> bool:
    """Whether an apir host answers a status request at ``address``."""
    from .backends.remote import host_status

    try:
        host_status(address, Path(token_file).read_text().strip() if token_file else "")
    except HostUnreachable:
        return False
    return True


@dataclass
class HostProcess:
    """A running ``apir host``: ``listen`` its addresses (the first one answers status
    requests), ``log`` its stdout and stderr. Stops the daemon on ``stop`` or on leaving
    a ``with`` block."""

    proc: subprocess.Popen
    listen: tuple[str, ...]
    token_file: str | None
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> HostProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_host(
    listen: Sequence[str], log: Path, *, device: str | None = None, token_file: str | None = None,
    options: Sequence[str] = (), timeout: float = START_TIMEOUT,
    spinner: Callable[[], None] | None = None,
) -> HostProcess:
    """Start ``apir host --listen URL...`` and return once it answers a status request at
    ``listen[0]``. ``options`` are more ``apir host`` flags; ``spinner`` is called every
    ~0.1 s while it comes up. A daemon that exits or stays silent is an ``ApirError``
    naming the last line of its log; it never outlives a failed start."""
    cmd = [sys.executable, "-m", "apir.cli", "host"]
    for url in listen:
        cmd += ["--listen", url]
    if device:
        cmd += ["--device", device]
    if token_file:
        cmd += ["--token-file", token_file]
    with log.open("wb") as out:  # a file, not a pipe: a chatty daemon never blocks on it
        proc = subprocess.Popen([*cmd, *options], stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    host = HostProcess(proc, tuple(listen), token_file, log)
    deadline = time.monotonic() + timeout
    try:
        while not _answers(host.listen[0], token_file):
            if proc.poll() is not None:
                raise ApirError(f"the apir host exited with status {proc.returncode} "
                                f"before it answered: {_last_line(log)}")
            if time.monotonic() > deadline:
                raise ApirError(f"the apir host did not answer at {host.listen[0]} within "
                                f"{timeout:g} s: {_last_line(log)}")
            if spinner:
                spinner()
            time.sleep(0.1)
    except BaseException:
        host.stop()
        raise
    return host


@contextlib.contextmanager
def auto_host(url: str | None, device: str | None = None,
              spinner: Callable[[], None] | None = None) -> Iterator[str | None]:
    """Yield the address to connect to for ``--remote url``. For ``auto``: the daemon at
    the default socket, or, when none answers there, a private one started for the block."""
    address = f"unix://{default_socket_path()}"
    if url != "auto" or _answers(address):
        yield address if url == "auto" else url
        return
    with tempfile.TemporaryDirectory(prefix="apir-host-") as tmp, \
            start_host([address], Path(tmp) / "host.log", device=device, spinner=spinner):
        yield address
