"""What each ``--backends`` name means: one table of factories, each a context manager
that yields a ready ``Backend`` and releases it (and any daemon it started) on exit.

  native      the host executor in-process: ``local`` (PyTorch) on ``--device``
  guest-cpu   what a guest without remoting gets: the ``numpy`` reference backend
  remote-shm  the remote frontend to a host daemon over a Unix socket + shared memory
  remote-tcp  the same over TCP (bytes inline)

A remote factory starts ``apir host --listen URL`` (``apir.spawn``: on a private Unix
socket, or a free TCP port with a fresh token) and connects to it, or connects to
``--remote URL`` when one is given. Anything that goes wrong there (a daemon that
dies, nothing listening, a refused handshake) is one ``BenchError``.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, closing
from dataclasses import dataclass
from pathlib import Path

from ..backends import DEFAULT_EXECUTOR, Backend, ExecutorConfig, create_backend
from ..errors import ApirError
from ..spawn import free_port, start_host, write_token
from .errors import BenchError


@dataclass(frozen=True)
class BackendOptions:
    device: str | None = None  # cpu | cuda | mps; None = the best available
    remote_url: str | None = None  # an existing daemon for remote-*; None = start one
    token: str = ""  # its shared secret (tcp/vsock)
    spin_us: int | None = None  # remote guests' busy-polling (None: by the host's device)
    executor: ExecutorConfig = DEFAULT_EXECUTOR  # how native runs graphs


Factory = Callable[[BackendOptions], AbstractContextManager[Backend]]


def _native(opts: BackendOptions) -> AbstractContextManager[Backend]:
    return closing(create_backend("local", opts.device, config=opts.executor))


def _guest_cpu(opts: BackendOptions) -> AbstractContextManager[Backend]:
    return closing(create_backend("numpy"))


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


def _connect(name: str, url: str, opts: BackendOptions, token: str) -> Backend:
    try:
        return create_backend("remote", opts.device, remote=url, token=token, spin_us=opts.spin_us)
    except ApirError as e:  # nobody listening, or refused: version, token, device
        raise BenchError(f"{name}: cannot use the host at {url}: {e}") from None


@contextlib.contextmanager
def _remote(name: str, scheme: str, opts: BackendOptions) -> Iterator[Backend]:
    if opts.remote_url:
        with closing(_connect(name, opts.remote_url, opts, opts.token)) as be:
            yield be
        return
    with tempfile.TemporaryDirectory(prefix="apir-bench-") as tmp:
        token_file = None
        if scheme == "unix":
            url = f"unix://{Path(tmp) / 'apir.sock'}"
        else:  # tcp needs a shared secret: a fresh one
            url = f"tcp://127.0.0.1:{free_port()}"
            token_file = write_token(Path(tmp) / "token")
        try:
            # one session, so the default per-session memory cap (free memory / --max-sessions)
            # is the whole device's: an 8B F16 model fits as it does natively
            daemon = start_host([url], Path(tmp) / "host.log", device=opts.device, token_file=token_file,
                                options=("--max-sessions", "1"))
        except ApirError as e:
            raise BenchError(f"{name}: {e}") from None
        token = Path(token_file).read_text().strip() if token_file else ""
        with daemon, closing(_connect(name, url, opts, token)) as be:
            yield be
