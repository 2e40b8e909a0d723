"""VM shared memory: a session's region (see ``apir.transport.shm``) as a QEMU guest sees it.

A VM shares no kernel with its host, so neither memfd nor eventfd can cross; what can is
a file mapped on the host and exposed to the guest as an ``ivshmem-plain`` PCI device
(BAR2). The host creates the file (``Region.create``) and hands it to QEMU:

    -object memory-backend-file,id=shm,share=on,mem-path=FILE,size=S
    -device ivshmem-plain,memdev=shm

and the guest maps the BAR from sysfs (``find_region`` + ``Region.open``). With no
doorbell, each side's ring polls (see "Wake-ups" in ``apir.transport.shm``).
"""

from __future__ import annotations

import mmap
from pathlib import Path

from .shm import MAGIC, Region, RegionError

PCI_VENDOR, PCI_DEVICE = 0x1AF4, 0x1110  # Red Hat, Inc. Inter-VM shared memory

# ---------------------------------------------------------------- guest: the PCI device

SYSFS_PCI = Path("/sys/bus/pci/devices")


def find_devices(root: Path = SYSFS_PCI) -> list[Path]:
    """The BAR2 files of every ivshmem PCI device, in bus order."""
    found = []
    for dev in sorted(root.glob("*")):
        try:
            vendor = int((dev / "vendor").read_text(), 16)
            device = int((dev / "device").read_text(), 16)
        except (OSError, ValueError):
            continue
        if (vendor, device) == (PCI_VENDOR, PCI_DEVICE) and (dev / "resource2").exists():
            enable = dev / "enable"
            try:  # memory decoding on, so the BAR is backed (best effort: usually on already)
                if enable.read_text().strip() == "0":
                    enable.write_text("1")
            except OSError:
                pass
            found.append(dev / "resource2")
    return found


def find_region(root: Path = SYSFS_PCI) -> Path:
    """The ivshmem device whose BAR2 holds an apir region (magic ``APIRSHM1``)."""
    devices = find_devices(root)
    for bar in devices:
        try:
            with open(bar, "rb", buffering=0) as f:
                m = mmap.mmap(f.fileno(), mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)
                magic = m[:8]
                m.close()
        except OSError:
            continue
        if magic == MAGIC:
            return bar
    if not devices:
        raise RegionError("no ivshmem PCI device (1af4:1110) in this machine: start the VM with "
                           "-device ivshmem-plain,memdev=... (apir vm run does)")
    raise RegionError(f"none of the {len(devices)} ivshmem devices holds an apir region")


def guest_region(url: str) -> Region:
    """``ivshmem`` / ``ivshmem://`` (find the PCI device) or ``ivshmem:///PATH`` (a region
    file or BAR2 path): the guest's mapped region."""
    _, _, rest = url.partition("://")
    path = rest.split("?", 1)[0] if rest else ""
    return Region.open(path or find_region())
