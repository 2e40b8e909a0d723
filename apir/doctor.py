"""``apir doctor``: what this machine can do, one line per check, with the fix for each gap.

Each check is ``ok``, ``missing`` or ``warn``; the last line says which path ``apir run``
would take with the flags, environment and config file as they are now. The exit status
is 1 only when that path cannot work (``apir run`` would fail), else 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

from .errors import ApirError
from .flags import RunConfig, add_backend, add_model, model_path, run_config

HOST_FIX = ("start one with `apir host` (or keep one running with the systemd user unit "
            "contrib/systemd/apir-host.service: see README, \"Running in a container\")")


@dataclass(frozen=True)
class Check:
    status: str  # "ok" | "missing" | "warn"
    name: str
    detail: str
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.status not in ("ok", "missing", "warn"):
            raise ValueError(f"bad check status {self.status!r}")


# ------------------------------------------------------------------ the checks
def _torch() -> ModuleType | None:
    try:
        import torch
    except ImportError:
        return None
    return torch


def check_python() -> Check:
    v = sys.version_info
    version = f"Python {platform.python_version()} ({sys.executable})"
    if v < (3, 10):
        return Check("missing", "python", version, "apir needs Python >= 3.10")
    if v < (3, 11):
        return Check("warn", "python", version + "; the config file needs Python >= 3.11 (tomllib)",
                     "use Python >= 3.11, or configure with APIR_* variables only")
    return Check("ok", "python", version)


def check_torch(torch: ModuleType | None) -> Check:
    if torch is None:
        return Check("warn", "torch", "not installed: guest-only (no local executor; run with "
                     "--remote URL)", "to execute here too: pip install 'apir[host]'")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    return Check("ok", "torch", f"torch {torch.__version__} ({build})")


def check_cuda(torch: ModuleType | None) -> Check:
    if torch is None:
        return Check("warn", "cuda", "not checked: no torch here (guest-only install)",
                     "a guest uses the host's GPU through --remote URL")
    if torch.cuda.is_available():
        gpus = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(f"cuda:{i} {props.name} {props.total_memory / 2**30:.0f} GiB")
        if importlib.util.find_spec("triton") is None:  # CUDA builds of torch bring it
            return Check("warn", "cuda", "; ".join(gpus) + "; no Triton: decode products run "
                         "through cuBLAS, 1.1-2.6x slower per product on an H200",
                         "install the triton version your torch build names (pip show torch)")
        return Check("ok", "cuda", "; ".join(gpus))
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU-only build"
        fix = ("on a machine with an NVIDIA GPU install a CUDA build of torch (pip install torch "
               "--index-url https://download.pytorch.org/whl/cu126) and check nvidia-smi; "
               "otherwise use a GPU host's daemon with --remote URL")
    else:
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
        fix = ("check the driver with nvidia-smi and CUDA_VISIBLE_DEVICES; otherwise use a GPU "
               "host's daemon with --remote URL")
    return Check("missing", "cuda", why, fix)


def check_mps(torch: ModuleType | None) -> Check:
    if torch is not None and torch.backends.mps.is_available():
        total = torch.mps.recommended_max_memory()
        return Check("ok", "mps", f"Apple GPU, {total / 2**30:.0f} GiB recommended maximum")
    return Check("missing", "mps", "no MPS device (Apple silicon, macOS >= 12.3, torch >= 2.0)",
                 "pip install --upgrade torch on an Apple silicon Mac")


def daemon_address(remote: str | None) -> str:
    """The address the daemon check asks: --remote / APIR_REMOTE when it is an address,
    else the default socket (what ``--remote auto`` and ``apir host`` use)."""
    from .transport import default_socket_path

    return remote if remote and remote != "auto" else f"unix://{default_socket_path()}"


def check_daemon(address: str, token: str) -> Check:
    from .backends.remote import host_status
    from .transport import HostUnreachable

    try:
        st = host_status(address, token)
    except HostUnreachable:
        return Check("missing", "daemon", f"no apir host answers at {address}", HOST_FIX)
    except ApirError as e:
        return Check("warn", "daemon", f"an apir host at {address} refused the status request: {e}")
    n = len(st.sessions)
    limit = f" of {st.max_sessions}" if st.max_sessions else ""
    return Check("ok", "daemon", f"running at {address}: {n}{limit} session{'s' * (n != 1)}, "
                 f"executing on {st.device.name} ({st.device.description})")


BWRAP_TRY = ("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
             "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
             "--die-with-parent", "true")  # what `apir run --sandbox` asks of it


def check_bwrap() -> Check:
    path = shutil.which("bwrap")
    if not path:
        return Check("missing", "sandbox", "bubblewrap (bwrap) is not installed; apir run "
                     "--sandbox needs it", "sudo apt-get install bubblewrap (or dnf install bubblewrap)")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=10).stdout.strip()
        done = subprocess.run([path, *BWRAP_TRY], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("warn", "sandbox", f"{path} could not be run: {e}")
    if done.returncode != 0:
        err = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return Check("warn", "sandbox", f"{path} is installed but cannot sandbox here: {err}",
                     "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; "
                     "Ubuntu >= 23.10: sysctl kernel.apparmor_restrict_unprivileged_userns=0), "
                     "or run the guest in a container (README)")
    return Check("ok", "sandbox", f"{version or 'bwrap'} at {path} works (read-only root, "
                 f"no network, own PID namespace)")


def check_vsock() -> Check:
    if not hasattr(socket, "AF_VSOCK"):
        return Check("missing", "vsock", "this Python has no AF_VSOCK (Linux only)",
                     "vsock:// addresses need Linux; use unix:// or tcp:// here")
    try:
        socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    except OSError as e:
        return Check("missing", "vsock", f"the kernel refuses AF_VSOCK sockets ({e.strerror})",
                     "sudo modprobe vsock (in a VM guest) or vhost_vsock (on a VM host)")
    nodes = {p: Path(p).exists() for p in ("/dev/vsock", "/dev/vhost-vsock")}
    detail = "AF_VSOCK sockets work; " + ", ".join(
        f"{p} {'present' if there else 'absent'}" for p, there in nodes.items())
    if not nodes["/dev/vhost-vsock"]:
        return Check("warn", "vsock", detail + " (QEMU guests cannot get a vsock device)",
                     "on a VM host: sudo modprobe vhost_vsock")
    return Check("ok", "vsock", detail)


def check_kvm() -> Check:
    kvm = Path("/dev/kvm")
    if not kvm.exists():
        return Check("missing", "kvm", "no /dev/kvm: VMs would run without hardware acceleration",
                     "enable virtualization in the firmware and sudo modprobe kvm_intel (or kvm_amd)")
    if not os.access(kvm, os.R_OK | os.W_OK):
        return Check("warn", "kvm", "/dev/kvm exists but you cannot open it",
                     "sudo usermod -aG kvm $USER, then log in again")
    return Check("ok", "kvm", "/dev/kvm is accessible")


def check_qemu() -> Check:
    arch = {"arm64": "aarch64", "amd64": "x86_64"}.get(platform.machine().lower(), platform.machine())
    name = f"qemu-system-{arch}"
    path = shutil.which(name)
    if not path:
        package = "qemu-system-x86" if arch == "x86_64" else "qemu-system-arm"
        return Check("missing", "qemu", f"{name} is not installed (needed only to run guests in "
                     f"VMs, over vsock)", f"sudo apt-get install {package}")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    first = out.strip().splitlines()[0] if out.strip() else name
    return Check("ok", "qemu", f"{first} at {path}")


def check_models(config: RunConfig) -> list[Check]:
    from .models.errors import ModelNotFoundError
    from .models.resolve import DEFAULT_MODEL, KNOWN_MODELS, resolve_model

    model, checks = config.model, []
    try:
        path = resolve_model(DEFAULT_MODEL, config.cache_dir)
        checks.append(Check("ok", "model", f"{DEFAULT_MODEL} (default) at {path}"))
    except ModelNotFoundError as e:
        checks.append(Check("missing", "model", f"{DEFAULT_MODEL} (default): {e}",
                            KNOWN_MODELS[DEFAULT_MODEL].install_hint))
    gemma = KNOWN_MODELS["gemma3-270m"]  # optional; checked without assembling it
    absent = [f.module for f in gemma.files if importlib.util.find_spec(f.module) is None]
    if absent:
        checks.append(Check("warn", "model", f"{gemma.name} (optional) is not installed",
                            gemma.install_hint))
    else:
        cached = config.cache_dir / gemma.filename
        where = f"assembled at {cached}" if cached.is_file() else f"assembled into {cached} on first use"
        checks.append(Check("ok", "model", f"{gemma.name} (optional) installed, {where}"))
    if model is not None and model not in (DEFAULT_MODEL, gemma.name):
        try:
            checks.append(Check("ok", "model", f"{model} (configured) at {model_path(config)}"))
        except ModelNotFoundError as e:
            checks.append(Check("missing", "model", f"{model} (configured): {e}"))
    return checks


def check_run(config: RunConfig, torch: ModuleType | None, daemon: Check) -> Check:
    """The path ``apir run`` would take with these flags, environment and config."""
    name, say = "run", "apir run would use: "
    if config.remote or config.backend == "remote":
        if not config.remote:
            return Check("missing", name, say + "nothing: --backend remote needs an address",
                         "pass --remote URL (or set APIR_REMOTE, or remote = \"...\" in the config)")
        if config.remote == "auto":
            if daemon.status == "ok":
                return Check("ok", name, say + f"remote auto -> {daemon_address(None)} (the running daemon)")
            if torch is None:
                return Check("missing", name, say + "remote auto, but no daemon answers and "
                             "none can start here without torch", HOST_FIX)
            return Check("ok", name, say + f"remote auto -> a private daemon started for the "
                         f"command at {daemon_address(None)} (none is running)")
        if daemon.status == "ok":
            return Check("ok", name, say + f"remote {config.remote}")
        return Check("missing", name, say + f"remote {config.remote}, which does not answer",
                     daemon.fix or daemon.detail)
    if config.backend == "numpy":
        return Check("ok", name, say + "numpy on the cpu (the reference executor: slow)")
    if torch is None:
        return Check("missing", name, say + "nothing: the local backend needs torch (guest-only install)",
                     "pass --remote URL (or auto) to use a host daemon, or pip install 'apir[host]'")
    gpu = ("cuda" if torch.cuda.is_available() else
           "mps" if torch.backends.mps.is_available() else None)
    if config.device is None:
        if gpu is None:
            return Check("warn", name, say + "local cpu (no GPU: torch sees no CUDA/MPS device)",
                         "pass --device cpu to make it explicit, or --remote URL to use a host's GPU")
        return Check("ok", name, say + f"local {gpu}")
    if config.device not in ("cpu", gpu):
        return Check("missing", name, say + f"local {config.device}, which torch cannot see here",
                     "pass --device cpu, or --remote URL to use a host's GPU")
    return Check("ok", name, say + f"local {config.device}")


def run_checks(config: RunConfig) -> list[Check]:
    torch = _torch()
    gpus = [check_cuda(torch)] + ([check_mps(torch)] if sys.platform == "darwin" else [])
    daemon = check_daemon(daemon_address(config.remote), config.token)
    return [
        check_python(), check_torch(torch), *gpus, daemon, check_bwrap(), check_vsock(),
        check_kvm(), check_qemu(), *check_models(config), check_run(config, torch, daemon),
    ]


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_checks(run_config(args))
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(f"{c.status:8} {c.name:8} {c.detail}")
            if c.fix and c.status != "ok":
                print(f"{'':17} fix: {c.fix}")
    return 1 if checks[-1].status == "missing" else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check what this machine can do (GPU, daemon, sandbox, "
                       "VMs, models) and which path `apir run` would take")
    add_model(p)
    add_backend(p)
    p.add_argument("--json", action="store_true", help="the checks as a JSON list")
    p.set_defaults(func=cmd_doctor)
