"""The guest image: a Debian kernel and an initramfs with Python, numpy, the guest packages
and apir — no torch, no GPU userspace. Built once and cached under ~/.cache/apir/vm/.

The initramfs is assembled from this machine's own interpreter rather than a debootstrap:
the Python running apir (binary, standard library, the shared libraries ``ldd`` says they
need) and the guest's packages from its site-packages (numpy, gguf, tokenizers, jinja2,
markupsafe, yaml), each at the path it has here, so the guest runs exactly the code the
host tested with. That takes seconds and needs no network. The kernel is Debian's
``linux-image-amd64``: ``/boot/vmlinuz-*`` when readable, else the package's .deb fetched
with ``apt-get download`` and unpacked with ``dpkg-deb -x`` (no install, no hooks). The
archive is an uncompressed cpio (newc): the kernel unpacks it in well under a second, so
the guest needs no block or virtio drivers at all — its only devices are two ivshmem
BARs and two serial ports.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ApirError

FORMAT = 1  # bump when the image's layout changes
GUEST_PACKAGES = ("numpy", "gguf", "tokenizers", "jinja2", "markupsafe", "yaml")
SITE = "/opt/apir/site"  # the guest's PYTHONPATH: apir + GUEST_PACKAGES
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages",
               "dist-packages", "pydoc_data", "config-3.11-x86_64-linux-gnu"}


class VMBuildError(ApirError):
    """The guest image cannot be built; says which step failed."""

    def __init__(self, step: str, why: str) -> None:
        super().__init__(f"building the VM guest image failed at step '{step}': {why}")


def cache_dir() -> Path:
    return Path.home() / ".cache" / "apir" / "vm"


@dataclass(frozen=True)
class Image:
    kernel: Path
    initramfs: Path
    python: str  # the interpreter's path inside the guest


# ---------------------------------------------------------------- kernel


def find_kernel() -> Path:
    """Debian's kernel: /boot, else the cached one, else fetched as a .deb (not installed)."""
    boot = sorted(Path("/boot").glob("vmlinuz-*"), key=_version_key)
    for k in reversed(boot):
        if os.access(k, os.R_OK):
            return k
    cached = sorted((cache_dir() / "kernel").glob("vmlinuz-*"), key=_version_key)
    if cached:
        return cached[-1]
    return fetch_kernel()


def _version_key(p: Path) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", p.name)]


def fetch_kernel() -> Path:
    """``apt-get download`` linux-image-amd64's kernel package and extract its vmlinuz."""
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise VMBuildError("kernel", "no /boot/vmlinuz-* here and no apt-get/dpkg-deb to fetch Debian's "
                                     "linux-image-amd64; put a kernel in " + str(cache_dir() / "kernel"))
    dest = cache_dir() / "kernel"
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="apir-kernel-") as tmp:
        try:
            dep = _run("kernel", ["apt-cache", "depends", "linux-image-amd64"], tmp)
        except VMBuildError:
            if os.geteuid() != 0:
                raise
            _run("kernel", ["apt-get", "update", "-qq"], tmp)  # a fresh machine has no package lists
            dep = _run("kernel", ["apt-cache", "depends", "linux-image-amd64"], tmp)
        names = re.findall(r"Depends: (linux-image-\S+)", dep)
        if not names:
            raise VMBuildError("kernel", "apt-cache knows no linux-image-amd64 (run apt-get update first)")
        os.chmod(tmp, 0o755)  # apt's sandbox user must be able to write here
        _run("kernel", ["apt-get", "download", "-q", names[0]], tmp)
        debs = list(Path(tmp).glob("*.deb"))
        if not debs:
            raise VMBuildError("kernel", f"apt-get download {names[0]} produced no .deb")
        _run("kernel", ["dpkg-deb", "-x", str(debs[0]), str(Path(tmp) / "x")], tmp)
        found = sorted((Path(tmp) / "x" / "boot").glob("vmlinuz-*"))
        if not found:
            raise VMBuildError("kernel", f"{debs[0].name} holds no boot/vmlinuz-*")
        target = dest / found[0].name
        shutil.copyfile(found[0], target)
    return target


def _run(step: str, cmd: list[str], cwd: str) -> str:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VMBuildError(step, f"{' '.join(cmd)}: {e}") from None
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise VMBuildError(step, f"{' '.join(cmd)} exited with {r.returncode}: {last}")
    return r.stdout


# ---------------------------------------------------------------- what goes in


def _apir_dir() -> Path:
    return Path(__file__).resolve().parents[1]


def _package_paths() -> list[Path]:
    """Top-level dirs of the guest packages, their bundled libs (numpy.libs) and dist-info."""
    owners = importlib.metadata.packages_distributions()
    out: set[Path] = set()
    for name in GUEST_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise VMBuildError("packages", f"the guest package {name!r} is not installed here "
                                           "(pip install apir brings it)")
        loc = Path(next(iter(spec.submodule_search_locations or [spec.origin])))
        out.add(loc)
        wanted = {name.lower()} | {d.lower().replace("-", "_") for d in owners.get(name, ())}
        for p in loc.parent.iterdir():
            base = p.name.lower()
            if base == f"{name}.libs" or (base.endswith(".dist-info") and base.split("-")[0] in wanted):
                out.add(p)
    return sorted(out)


def _interpreter() -> tuple[Path, Path]:
    exe = Path(sys.executable).resolve()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    return exe, stdlib


def cache_key() -> str:
    """Changes whenever anything that goes into the image changes."""
    h = hashlib.sha256(f"format {FORMAT}\n{sys.version}\n".encode())
    exe, stdlib = _interpreter()
    h.update(f"{exe} {stdlib}\n".encode())
    for p in _package_paths():
        h.update(f"{p} {p.stat().st_mtime_ns}\n".encode())
    for f in sorted(_apir_dir().rglob("*.py")):
        h.update(f.relative_to(_apir_dir()).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- the cpio archive


class Cpio:
    """A newc ("070701") cpio writer: what the kernel's initramfs unpacker reads."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "wb")
        self.ino = 1
        self.seen: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"", mtime: int = 0) -> None:
        name = name.lstrip("/")
        if name in self.seen:
            return
        self.seen.add(name)
        fields = (self.ino, mode, 0, 0, 1, mtime, len(data), 0, 0, 0, 0, len(name) + 1, 0)
        hdr = b"070701" + b"".join(b"%08X" % v for v in fields)
        self.ino += 1
        self.f.write(hdr + name.encode() + b"\0")
        self.f.write(b"\0" * (-(len(hdr) + len(name) + 1) % 4))
        self.f.write(data)
        self.f.write(b"\0" * (-len(data) % 4))

    def dirs(self, path: str) -> None:
        parts = Path(path.lstrip("/")).parts
        for i in range(1, len(parts) + 1):
            self._entry("/".join(parts[:i]), stat.S_IFDIR | 0o755)

    def file(self, dest: str, src: Path | None = None, data: bytes | None = None, mode: int = 0o644) -> None:
        self.dirs(str(Path(dest).parent))
        if src is not None:
            data = src.read_bytes()
            mode = stat.S_IMODE(src.stat().st_mode)
            mtime = int(src.stat().st_mtime)  # keeps __pycache__ valid for the copied sources
        else:
            mtime = 0
        self._entry(dest, stat.S_IFREG | mode, data or b"", mtime)

    def symlink(self, dest: str, target: str) -> None:
        self.dirs(str(Path(dest).parent))
        self._entry(dest, stat.S_IFLNK | 0o777, target.encode())

    def tree(self, src: Path, dest: str, skip: set[str] = frozenset()) -> None:
        for root, dirnames, files in os.walk(src):
            dirnames[:] = sorted(d for d in dirnames if d not in skip)
            rel = Path(root).relative_to(src)
            self.dirs(str(Path(dest) / rel))
            for name in sorted(files):
                p = Path(root) / name
                if p.is_symlink() and not p.exists():
                    continue
                self.file(str(Path(dest) / rel / name), p)

    def close(self) -> None:
        self._entry("TRAILER!!!", 0)
        self.f.close()


def _libraries(files: list[Path]) -> set[Path]:
    """Shared libraries (and the loader) that ``files`` need, per ``ldd``."""
    libs: set[Path] = set()
    for f in files:
        try:
            r = subprocess.run(["ldd", str(f)], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise VMBuildError("libraries", f"ldd {f}: {e}") from None
        for m in re.finditer(r"(?:=>\s*)?(/\S+)\s+\(0x", r.stdout):
            libs.add(Path(m.group(1)))
    return libs


INIT = """#!{python}
import sys
sys.path.insert(0, "{site}")
from apir.vm.guest import main
main()
"""


def build(dest: Path, log=lambda s: None) -> None:
    """Write the initramfs to ``dest``."""
    exe, stdlib = _interpreter()
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.partial")  # concurrent builders never share one
    cpio = Cpio(tmp)
    try:
        log("interpreter and standard library")
        cpio.file(str(exe), exe)
        cpio.tree(stdlib, str(stdlib), STDLIB_SKIP)
        log("guest packages: " + ", ".join(GUEST_PACKAGES))
        for p in _package_paths():
            if p.is_dir():
                cpio.tree(p, f"{SITE}/{p.name}")
            else:
                cpio.file(f"{SITE}/{p.name}", p)
        cpio.tree(_apir_dir(), f"{SITE}/apir")
        log("shared libraries (ldd)")
        elves = [exe, *sorted(stdlib.glob("lib-dynload/*.so"))]
        for p in _package_paths():
            elves += sorted(p.rglob("*.so*")) if p.is_dir() else []
        for lib in sorted(_libraries(elves)):
            cpio.file(str(lib), lib.resolve())
        for d in ("proc", "sys", "dev", "tmp", "root"):
            cpio.dirs(d)
        cpio.symlink("/usr/bin/python3", str(exe))
        cpio.file("/init", data=INIT.format(python=exe, site=SITE).encode(), mode=0o755)
    except VMBuildError:
        raise
    except OSError as e:
        raise VMBuildError("initramfs", f"{e.filename or ''}: {e.strerror or e}") from None
    finally:
        cpio.close()
    os.replace(tmp, dest)


def ensure_image(rebuild: bool = False, log=lambda s: None) -> Image:
    """The cached image, building what is missing or stale."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    kernel = find_kernel()
    try:
        key = cache_key()
    except OSError as e:
        raise VMBuildError("inputs", str(e)) from None
    # Several checkouts (or venvs) on one machine share the cache: each replaces only its
    # own stale images, never another's, which may be booting right now.
    owner = hashlib.sha256(f"{_apir_dir()}\n{_interpreter()[0]}".encode()).hexdigest()[:8]
    initramfs = root / f"initramfs-{owner}-{key}.cpio"
    if rebuild or not initramfs.exists():
        log(f"building the guest image into {initramfs} (once; cached)")
        build(initramfs, lambda s: log(f"  {s}"))
        for old in root.glob(f"initramfs-{owner}-*.cpio"):
            if old != initramfs:
                old.unlink(missing_ok=True)
    return Image(kernel, initramfs, str(_interpreter()[0]))


def versions() -> dict[str, str]:
    """Versions of what the image carries (for reports)."""
    out = {"python": sys.version.split()[0]}
    for d in ("numpy", "gguf", "tokenizers", "Jinja2"):
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out
