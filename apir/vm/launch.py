"""Boot the guest under QEMU/KVM and serve its one session over ivshmem.

The VM has no GPU, no network (``-nic none``, ``-nodefaults``), no disk: a kernel, the
cached initramfs, two ivshmem-plain devices (the session region, shared; the boot payload
with the config and the model, a private copy) and two serial ports (stderr, stdout).
This process serves the session while QEMU runs (``apir.vm.host.serve_region``), then
waits for the guest to power off and returns the guest command's exit status.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..backends.base import DEFAULT_EXECUTOR, ExecutorConfig
from ..errors import ApirError
from ..transport.shm import GUEST_EXIT, Region
from .guest import MODEL_PATH, PAYLOAD_CONFIG, PAYLOAD_HEADER, PAYLOAD_MAGIC
from .image import Image

QEMU = "qemu-system-x86_64"
REGION_SIZE = 128 << 20  # session region: rings + a ~125 MiB arena
SHUTDOWN_TIMEOUT = 60.0  # seconds for the guest to power off after its session ends


class QemuMissingError(ApirError):
    """qemu-system-x86_64 is not installed."""


class KvmUnavailableError(ApirError):
    """KVM was required and /dev/kvm cannot be used."""


class VMError(ApirError):
    """The VM failed to boot, to connect, or to finish."""


@dataclass(frozen=True)
class VMConfig:
    argv: tuple[str, ...]  # the apir command inside the guest (without "apir")
    model: Path | None = None  # shipped to the guest as MODEL_PATH
    device: str | None = None  # the host executor's device
    memory_mb: int = 1536
    cpus: int = 1
    require_kvm: bool = False
    accel: str = "auto"  # auto (KVM, else TCG) | kvm | tcg
    timeout: float = 1800.0  # the whole VM run, seconds
    env: dict = field(default_factory=dict)
    spin_us: int | None = None  # the host side's busy-polling (APIR_SPIN_US; None: by device)
    executor: ExecutorConfig = DEFAULT_EXECUTOR  # how the host side runs the guest's graphs

    def __post_init__(self) -> None:
        if self.accel not in ("auto", "kvm", "tcg"):
            raise ApirError(f"--accel must be auto, kvm or tcg, not {self.accel!r}")
        if self.memory_mb < 256 or self.cpus < 1 or self.timeout <= 0:
            raise ApirError("--memory must be at least 256 (MiB), --cpus at least 1, --timeout positive")


def qemu_binary() -> str:
    path = shutil.which(QEMU)
    if not path:
        raise QemuMissingError(f"apir vm needs QEMU ({QEMU}): apt-get install qemu-system-x86")
    return path


PROBE_SECONDS = 15.0


def kvm_boots(kernel: Path, kvm: list[str]) -> bool:
    """Whether KVM boots ``kernel`` to its first console line: /dev/kvm can exist and still
    not run a guest kernel (seen nested inside a Firecracker microVM). Asked once per
    kernel and machine; the answer is cached next to the image."""
    from .image import cache_dir

    mark = cache_dir() / f"kvm-{kernel.name}-{os.uname().release}"
    for answer in ("ok", "broken"):
        if Path(f"{mark}.{answer}").exists():
            return answer == "ok"
    cmd = [qemu_binary(), *kvm, "-m", "256", "-nodefaults", "-no-user-config", "-display", "none",
           "-no-reboot", "-kernel", str(kernel), "-append", "console=ttyS0 earlyprintk=serial panic=-1",
           "-serial", "stdio"]
    ok = False
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        seen, deadline = b"", time.monotonic() + PROBE_SECONDS
        while time.monotonic() < deadline and proc.poll() is None and not ok:
            time.sleep(0.1)
            seen += proc.stdout.read() or b""
            ok = b"Linux version" in seen
    finally:
        proc.kill()
        proc.wait()
    Path(f"{mark}.{'ok' if ok else 'broken'}").touch()
    return ok


def accelerator(require_kvm: bool, accel: str = "auto", kernel: Path | None = None) -> list[str]:
    """KVM when /dev/kvm is usable (and boots ``kernel``), else TCG (slow), said on stderr."""
    if accel == "tcg":
        if require_kvm:
            raise KvmUnavailableError("--require-kvm contradicts --accel tcg")
        print("apir vm: software emulation (-accel tcg) as asked; much slower than KVM",
              file=sys.stderr, flush=True)
        return ["-accel", "tcg", "-cpu", "max"]
    # arch-capabilities off: nested KVM (a CI VM) may refuse to set that MSR and abort
    kvm = ["-accel", "kvm", "-cpu", "host,-arch-capabilities"]
    if accel == "kvm":
        return kvm
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        why = "no /dev/kvm" if not os.path.exists("/dev/kvm") else "/dev/kvm is not accessible to this user"
    elif kernel is None or kvm_boots(kernel, kvm):
        return kvm
    else:
        why = f"KVM here does not boot a kernel within {PROBE_SECONDS:.0f}s (nested virtualization?)"
    if require_kvm:
        raise KvmUnavailableError(f"--require-kvm: {why} (enable virtualization, load kvm_intel/kvm_amd, "
                                  "or add this user to the kvm group)")
    print(f"apir vm: {why}; using software emulation (-accel tcg), which is much slower",
          file=sys.stderr, flush=True)
    return ["-accel", "tcg", "-cpu", "max"]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def write_payload(path: Path, config: dict, model: Path | None) -> None:
    """The boot payload (layout in ``apir.vm.guest``), sized to a power of two (a BAR)."""
    blob = json.dumps(config).encode()
    model_off = -(-(PAYLOAD_CONFIG + len(blob)) // 4096) * 4096 if model else 0
    model_size = model.stat().st_size if model else 0
    with open(path, "wb") as f:
        f.write(PAYLOAD_HEADER.pack(PAYLOAD_MAGIC, len(blob), model_off, model_size))
        f.seek(PAYLOAD_CONFIG)
        f.write(blob)
        if model:
            f.seek(model_off)
            with open(model, "rb") as src:
                shutil.copyfileobj(src, f, 8 << 20)
        f.truncate(_pow2(max(model_off + model_size, PAYLOAD_CONFIG + len(blob))))


def qemu_command(image: Image, region: Path, payload: Path, cfg: VMConfig) -> list[str]:
    def ivshmem(name: str, path: Path, share: str) -> list[str]:
        size = path.stat().st_size
        return ["-object", f"memory-backend-file,id={name},share={share},mem-path={path},size={size}",
                "-device", f"ivshmem-plain,memdev={name}"]

    cmdline = "console=ttyS0 quiet loglevel=0 panic=-1 rdinit=/init i8042.noaux i8042.nokbd tsc=reliable"
    return [
        qemu_binary(), *accelerator(cfg.require_kvm, cfg.accel, image.kernel),
        "-machine", "q35", "-m", str(cfg.memory_mb), "-smp", str(cfg.cpus),
        "-nodefaults", "-no-user-config", "-no-reboot", "-display", "none", "-vga", "none", "-nic", "none",
        "-kernel", str(image.kernel), "-initrd", str(image.initramfs), "-append", cmdline,
        "-chardev", "file,id=err,path=/proc/self/fd/2,append=on",
        "-chardev", "file,id=out,path=/proc/self/fd/1,append=on",
        "-serial", "chardev:err", "-serial", "chardev:out",
        *ivshmem("shm", region, "on"), *ivshmem("boot", payload, "off"),
    ]


def run_vm(image: Image, cfg: VMConfig, stdout=None) -> int:
    """Boot, serve the session, wait for power-off; the guest command's exit status.
    ``stdout``: where the guest's stdout goes (default: ours)."""
    from .host import serve_region

    workdir = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="apir-vm-", dir=workdir) as tmp:
        region_path, payload_path = Path(tmp) / "region", Path(tmp) / "payload"
        region = Region.create(region_path, REGION_SIZE)
        argv = list(cfg.argv)
        if cfg.model is not None:
            argv += ["-m", MODEL_PATH]
        write_payload(payload_path, {"argv": argv, "env": cfg.env}, cfg.model)
        cmd = qemu_command(image, region_path, payload_path, cfg)
        deadline = time.monotonic() + cfg.timeout
        for fd in (1, 2):  # QEMU appends to our stdout/stderr: make our own writes append too
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
            except OSError:
                pass
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout)
        try:
            served = serve_region(region, cfg.device,
                                  alive=lambda: proc.poll() is None and time.monotonic() < deadline,
                                  spin_us=cfg.spin_us, executor=cfg.executor)
            try:
                proc.wait(max(min(SHUTDOWN_TIMEOUT, deadline - time.monotonic()), 1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise VMError(f"the VM did not power off within {SHUTDOWN_TIMEOUT:.0f}s "
                              f"after its session (or the {cfg.timeout:.0f}s --timeout)") from None
            status = region.load(GUEST_EXIT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            region.close()
        if proc.returncode != 0:
            raise VMError(f"QEMU exited with status {proc.returncode} (its message is above)")
        if status == 0:
            why = "it never connected" if not served else "it did not report an exit status"
            raise VMError(f"the guest stopped without finishing its command ({why}); see its console "
                          "output above")
        return status - 1
