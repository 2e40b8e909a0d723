"""``apir run --sandbox``: the guest inside a bubblewrap sandbox, the container case.

The sandbox has a read-only view of the root file system, a private /tmp, its own PID,
IPC, UTS and network namespaces (no network at all, not even the host's loopback), a
minimal /dev with no GPU device nodes, and exactly one way out: the host daemon's Unix
socket, bound in at the same path. The shared arena arrives over that socket as a file
descriptor, so bulk data still moves through shared memory.

The equivalent container, for reference (README "Running in a container"):
    podman run --rm --network none --read-only -v "$XDG_RUNTIME_DIR/apir:/run/apir" \\
        apir-guest run -p "Hello"   # entrypoint apir; APIR_REMOTE set in the image
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .errors import ApirError

INSIDE_ENV = "APIR_IN_SANDBOX"  # set inside, so the guest does not try to nest


class SandboxError(ApirError):
    """The sandbox cannot be set up here."""


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if not path:
        raise SandboxError("--sandbox needs bubblewrap: sudo apt-get install bubblewrap "
                           "(or dnf install bubblewrap)")
    return path


def sandbox_command(socket_path: str, argv: list[str], read_only: tuple[str, ...] = ()) -> list[str]:
    """The bwrap command line running ``argv`` with only ``socket_path`` reachable, and
    ``read_only`` files (the model) visible even where the sandbox hides their directory."""
    sock = Path(socket_path)
    if not sock.exists():
        raise SandboxError(f"no host socket at {sock} to bind into the sandbox")
    cmd = [
        bwrap_path(),
        "--ro-bind", "/", "/",
        "--dev", "/dev",  # a fresh minimal /dev: null, zero, random, tty... no GPUs
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        "--tmpfs", "/run",
        "--bind", str(sock), str(sock),
        # the interpreter, its packages and apir itself stay visible even when they live
        # under a directory the sandbox replaces (a clone in /tmp, a venv under /run)
        *(arg for path in (*_runtime_paths(), *read_only) for arg in ("--ro-bind", path, path)),
        "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
        "--die-with-parent", "--new-session",
        "--setenv", INSIDE_ENV, "1",
        "--setenv", "APIR_REMOTE", f"unix://{sock}",
        "--chdir", "/",
    ]
    home = os.environ.get("HOME")
    if home and Path(home).is_dir():
        cmd += ["--setenv", "HOME", home]
    return [*cmd, "--", *argv]


def _runtime_paths() -> tuple[str, ...]:
    import apir

    paths = {sys.prefix, sys.base_prefix, str(Path(apir.__file__).resolve().parent.parent)}
    return tuple(sorted(p for p in paths if Path(p).exists()))


def inside() -> bool:
    return os.environ.get(INSIDE_ENV) == "1"


def guest_argv(args: list[str]) -> list[str]:
    """This same apir command, for running inside the sandbox."""
    return [sys.executable, "-m", "apir.cli", *args]
