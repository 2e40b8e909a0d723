"""``--remote auto``: use the daemon at the default socket, or start one for this command."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

from ..errors import ApirError
from ..transport import HostUnreachable, default_socket_path


@contextlib.contextmanager
def remote_host(url: str | None, device: str | None = None, spinner=None) -> Iterator[str | None]:
    """Yield the address to connect to. For ``auto``, start a private daemon when none
    answers at the default socket, and stop it when the block ends."""
    if url != "auto":
        yield url
        return
    from ..backends.remote import host_status

    address = f"unix://{default_socket_path()}"
    try:
        host_status(address)
        yield address
        return
    except HostUnreachable:
        pass
    cmd = [sys.executable, "-m", "apir.cli", "host", "--listen", address]
    if device:
        cmd += ["--device", device]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if spinner:
                spinner()
            try:
                host_status(address)
                break
            except HostUnreachable:
                if proc.poll() is not None:
                    err = (proc.stderr.read() or "").strip().splitlines()
                    raise ApirError(f"the auto-started host exited: {err[-1] if err else proc.returncode}") from None
                if time.monotonic() > deadline:
                    raise ApirError("the auto-started host did not come up within 60 s") from None
                time.sleep(0.1)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
