"""The guest VM's init (PID 1): mount, find the two ivshmem devices, run apir, power off.

The host (``apir vm``) gives the guest two ivshmem-plain PCI devices:
  - the session region (magic ``APIRSHM1``, see ``apir.transport.shm``): the channel
    and arena to the host daemon, and where this init reports the exit status;
  - the boot payload (magic ``APIRVMBT``), a private copy the guest cannot write back:

        offset  size  field
        0       8     magic b"APIRVMBT"
        8       8     config length C (JSON: {"argv": [...], "env": {...}})
        16      8     model offset M (page aligned; 0: no model)
        24      8     model size
        4096    C     config
        M       size  the GGUF file

Serial ports: ttyS0 carries the kernel console and the command's stderr, ttyS1 only the
command's stdout; both are put in raw mode so bytes pass unchanged.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import subprocess
import sys
import termios
import tty
from pathlib import Path

PAYLOAD_MAGIC = b"APIRVMBT"
PAYLOAD_HEADER = struct.Struct("<8sQQQ")
PAYLOAD_CONFIG = 4096
MODEL_PATH = "/tmp/model.gguf"
SITE = "/opt/apir/site"
EXIT_INTERNAL = 125
RB_POWER_OFF = 0x4321FEDC

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str) -> None:
    os.makedirs(target, exist_ok=True)
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), 0, None) != 0:
        err = ctypes.get_errno()
        if err != 16:  # EBUSY: already mounted (devtmpfs may be automounted)
            raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def _raw_tty(path: str) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_NOCTTY)
    try:
        tty.setraw(fd)
    except termios.error:
        pass
    return fd


def read_payload(bar: Path) -> tuple[dict, bytes | None]:
    """The config and the model bytes from the boot payload device (checked: the payload
    comes from our own host, but a bad one must fail cleanly, not crash init)."""
    with open(bar, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        m = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        magic, clen, moff, msize = PAYLOAD_HEADER.unpack_from(m, 0)
        if magic != PAYLOAD_MAGIC or PAYLOAD_CONFIG + clen > size or (moff and moff + msize > size):
            raise ValueError("malformed boot payload")
        config = json.loads(bytes(m[PAYLOAD_CONFIG : PAYLOAD_CONFIG + clen]))
        if moff:
            with open(MODEL_PATH, "wb") as out:
                out.write(memoryview(m)[moff : moff + msize])
        return config, None
    finally:
        m.close()


def _poweroff() -> None:
    _libc.sync()
    _libc.reboot(RB_POWER_OFF)
    os._exit(0)  # PID 1 exiting panics; panic=-1 + QEMU -no-reboot ends the VM anyway


def main() -> None:
    code = EXIT_INTERNAL
    err_fd = 2
    region = None
    try:
        _mount("proc", "/proc", "proc")
        _mount("sysfs", "/sys", "sysfs")
        _mount("devtmpfs", "/dev", "devtmpfs")
        _mount("tmpfs", "/tmp", "tmpfs")
        err_fd, out_fd = _raw_tty("/dev/ttyS0"), _raw_tty("/dev/ttyS1")
        os.dup2(err_fd, 2)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.path.insert(0, SITE)
        from apir.transport.ivshmem import find_devices
        from apir.transport.shm import MAGIC, Region

        config = None
        for bar in find_devices():
            with open(bar, "rb", buffering=0) as f:
                head = mmap.mmap(f.fileno(), mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)
                magic = head[:8]
                head.close()
            if magic == PAYLOAD_MAGIC:
                config, _ = read_payload(bar)
            elif magic == MAGIC:
                region = Region.open(bar)
        if config is None or region is None:
            raise RuntimeError("the boot payload or the session region is missing (start the VM with apir vm)")
        region.close()  # the command maps it itself; reopened below for the exit status
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": SITE, "PYTHONUTF8": "1",
               "PYTHONDONTWRITEBYTECODE": "1", **{str(k): str(v) for k, v in config.get("env", {}).items()}}
        argv = [sys.executable, "-m", "apir.cli", *[str(a) for a in config["argv"]]]
        code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out_fd, stderr=err_fd,
                              env=env, cwd="/tmp").returncode
        termios.tcdrain(out_fd)
        termios.tcdrain(err_fd)
    except BaseException as e:  # noqa: BLE001 - PID 1 must report and power off, never exit
        try:
            os.write(err_fd, f"apir vm guest: {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
    finally:
        try:
            from apir.transport.ivshmem import find_region
            from apir.transport.shm import GUEST_EXIT, Region

            region = Region.open(find_region())
            region.store(GUEST_EXIT, (code & 0xFF) + 1)
            region.close()
        except BaseException:  # noqa: BLE001
            pass
        _poweroff()
