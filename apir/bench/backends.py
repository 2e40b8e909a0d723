"""What each ``--backends`` name means: one table of factories, each a context manager
that yields a ready ``Backend`` and releases it (and any daemon it started) on exit.

  native      the host executor in-process: ``local`` (PyTorch) on ``--device``
  guest-cpu   what a guest without remoting gets: the ``numpy`` reference backend
  remote-shm  the remote frontend to a host daemon over a Unix socket + shared memory
  remote-tcp  the same over TCP (bytes inline)

A remote factory starts ``apir host --listen URL`` as a subprocess (on a private Unix
socket, or a free TCP port with a fresh token) and connects to it, or connects to
``--remote URL`` when one is given. Anything that goes wrong there (no remote
backend in this apir, a daemon that dies, nothing listening) is one ``BenchError``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from ..backends import Backend, ExecutorConfig, create_backend
from ..errors import ApirError
from .errors import BenchError

DAEMON_START_TIMEOUT = 60.0  # seconds for `apir host` to import torch and start listening


@dataclass(frozen=True)
class BackendOptions:
    device: str | None = None  # cpu | cuda | mps; None = the best available
    remote_url: str | None = None  # an existing daemon for remote-*; None = start one
    token_file: str | None = None  # its shared secret (tcp/vsock), else $APIR_TOKEN


Factory = Callable[[BackendOptions], AbstractContextManager[Backend]]


@contextlib.contextmanager
def _closing(backend: Backend) -> Iterator[Backend]:
    try:
        yield backend
    finally:
        backend.close()


def _native(opts: BackendOptions) -> AbstractContextManager[Backend]:
    return _closing(create_backend("local", opts.device, config=ExecutorConfig.from_env()))


def _guest_cpu(opts: BackendOptions) -> AbstractContextManager[Backend]:
    return _closing(create_backend("numpy"))


def _remote_shm(opts: BackendOptions) -> AbstractContextManager[Backend]:
    return _remote("remote-shm", "unix", opts)


def _remote_tcp(opts: BackendOptions) -> AbstractContextManager[Backend]:
    return _remote("remote-tcp", "tcp", opts)


BACKENDS: dict[str, Factory] = {
    "native": _native,
    "guest-cpu": _guest_cpu,
    "remote-shm": _remote_shm,
    "remote-tcp": _remote_tcp,
}


def parse_backends(spec: str) -> list[str]:
    """``native,remote-shm`` -> names, in order, without repeats; unknown names are an error."""
    names = list(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    for name in names:
        if name not in BACKENDS:
            raise BenchError(f"unknown backend {name!r}: choose from {', '.join(BACKENDS)}")
    if not names:
        raise BenchError("no backend given: --backends takes e.g. native,guest-cpu")
    return names


def open_backend(name: str, opts: BackendOptions) -> AbstractContextManager[Backend]:
    return BACKENDS[name](opts)


# ---------------------------------------------------------------- remote


def remote_available() -> bool:
    """Whether this apir has the remote frontend (``apir.backends.remote``)."""
    return importlib.util.find_spec("apir.backends.remote") is not None


def _connect(
    name: str, url: str, opts: BackendOptions, token_file: str | None, deadline: float = 0.0,
    daemon: subprocess.Popen | None = None, log: Path | None = None,
) -> Backend:
    """``create_backend("remote", ...)``, retried until ``deadline`` while a daemon starts."""
    from ..transport import HostUnreachable

    while True:
        try:
            return create_backend("remote", opts.device, remote=url, token_file=token_file)
        except HostUnreachable as e:  # nobody listening (yet)
            if daemon is not None and daemon.poll() is not None:
                raise BenchError(
                    f"{name}: the host daemon exited with status {daemon.returncode} "
                    f"({_last_line(log) if log else 'no output'}) before accepting a connection"
                ) from None
            if daemon is None or time.monotonic() > deadline:
                raise BenchError(f"{name}: {e}") from None
        except ApirError as e:  # refused: version, token, device
            raise BenchError(f"{name}: cannot use the host at {url}: {e}") from None
        except Exception as e:  # a frontend that is not finished (TypeError, ...): say so
            raise BenchError(f"{name}: create_backend('remote') failed: {type(e).__name__}: {e}") from None
        time.sleep(0.2)


def _last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return lines[-1].strip() if lines else "no output"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _remote(name: str, scheme: str, opts: BackendOptions) -> Iterator[Backend]:
    if not remote_available():
        raise BenchError(f"{name}: this apir has no remote backend (apir.backends.remote is missing)")
    if opts.remote_url:
        with _closing(_connect(name, opts.remote_url, opts, opts.token_file)) as be:
            yield be
        return
    with tempfile.TemporaryDirectory(prefix="apir-bench-") as tmp:
        cmd = [sys.executable, "-m", "apir.cli", "host"]
        token_file = None
        if scheme == "unix":
            url = f"unix://{Path(tmp) / 'apir.sock'}"
        else:  # tcp needs a shared secret: a fresh one, readable by this user only
            url = f"tcp://127.0.0.1:{_free_port()}"
            token_file = str(Path(tmp) / "token")
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(16))
            cmd += ["--token-file", token_file]
        cmd += ["--listen", url]
        if opts.device:
            cmd += ["--device", opts.device]
        log = Path(tmp) / "host.log"
        with log.open("wb") as err:  # a file, not a pipe: a chatty daemon never blocks on it
            daemon = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        try:
            deadline = time.monotonic() + DAEMON_START_TIMEOUT
            with _closing(_connect(name, url, opts, token_file, deadline, daemon, log)) as be:
                yield be
        finally:
            daemon.terminate()
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
