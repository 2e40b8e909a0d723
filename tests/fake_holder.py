"""A stand-in for CUDA IPC, for tests on a CPU host only (the product has no such path):
a holder's "device copy" is a memfd it maps read-write, which each worker maps read-only
(so a write the executor let through would fault, ending that worker). Everything else a
holder does is the product's: its process, the daemon's books, the grants, the packed
table, the liveness pipe, keep-alive.

As a script it is ``apir`` with this transport installed, for a daemon the tests start:

    python tests/fake_holder.py host --device cpu --model PATH ...

``FAKE_HOLDER_DELAY`` (seconds) makes a holder take that long to load; ``FAKE_HOLDER_FAIL``
makes it fail to.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # apir, run as a script

from apir.host import holder  # noqa: E402


class MemfdTransport(holder.Transport):
    def __init__(self) -> None:
        self.fd = -1

    def device(self, configured: str | None) -> str | None:
        return "cpu" if configured == "cpu" else None

    def allocate(self, size: int, device: str) -> torch.Tensor:
        time.sleep(float(os.environ.get("FAKE_HOLDER_DELAY", "0")))
        if os.environ.get("FAKE_HOLDER_FAIL"):
            raise RuntimeError("out of device memory (FAKE_HOLDER_FAIL)")
        self.fd = os.memfd_create("fake-device-copy", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        return torch.frombuffer(self.map, dtype=torch.uint8)

    def export(self, weights: torch.Tensor) -> tuple[bytes, list[int]]:
        return b"memfd", [os.dup(self.fd)]

    def open(self, export: bytes, fds: list[int], size: int) -> torch.Tensor:
        try:
            if export != b"memfd" or len(fds) != 1:
                raise ValueError("not a fake export")
            view = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            for fd in fds:
                os.close(fd)
        with warnings.catch_warnings():  # torch warns that the mapping is not writable
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view, dtype=torch.uint8)


def start(tmp: Path, *extra: str, env: dict[str, str] | None = None):
    """A daemon (unix + tcp, ``--device cpu``) whose published models are held by holders
    over this transport; a ``hosts.Host``."""
    from hosts import Host

    from apir.spawn import HostProcess, _answers, free_port, write_token

    token_file = write_token(tmp / "token")
    unix, tcp = f"unix://{tmp / 'apir.sock'}", f"tcp://127.0.0.1:{free_port()}"
    log = tmp / "host.log"
    cmd = [sys.executable, __file__, "host", "--listen", unix, "--listen", tcp, "--device", "cpu",
           "--token-file", token_file, *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                env={**os.environ, **(env or {})})
    daemon = HostProcess(proc, (unix, tcp), token_file, log)
    deadline = time.monotonic() + 60
    while not _answers(unix, token_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            daemon.stop()
            raise RuntimeError(f"the fake-holder host did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    return Host(daemon, unix, tcp, token_file, log)


if __name__ == "__main__":
    holder.TRANSPORT = MemfdTransport()
    from apir.cli import main

    sys.exit(main())
