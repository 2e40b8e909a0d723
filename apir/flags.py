"""What the subcommands share: the model and backend flags, the ``RunConfig`` they resolve
into (flag > environment > config file, read once here), the one model resolver and
loader of ``run``, ``serve`` and ``bench``, and the progress lines on stderr."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from . import env
from .backends import DEFAULT_EXECUTOR, ExecutorConfig
from .errors import ApirError
from .models.resolve import DEFAULT_CACHE_DIR, resolve_model
from .models.weights import KV_TYPES

AUTO_HOST = "starting an apir host for --remote auto (none answers at the default socket)"


def eprint(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=env.MODEL.get(),
                   help="model name (smollm2-135m, gemma3-270m), registered name (apir list) "
                        "or .gguf path (default: smollm2-135m)")


def add_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=env.BACKEND.get(), choices=("local", "numpy", "remote"),
                   help="where graphs execute (default: local = PyTorch in-process; remote with --remote)")
    p.add_argument("--remote", default=env.REMOTE.get(), metavar="URL",
                   help="execute on the host daemon at URL (unix:///PATH, tcp://HOST:PORT, "
                        "vsock://CID:PORT) or 'auto' (the default socket, starting a daemon if none)")
    p.add_argument("--token-file", default=env.TOKEN_FILE.get(),
                   help="the shared secret for tcp/vsock hosts (or set APIR_TOKEN)")
    p.add_argument("--device", default=env.DEVICE.get(), choices=("cpu", "cuda", "mps"),
                   help="device for the local backend (default: best available)")
    # string defaults from the environment or config file are checked as flag values are
    p.add_argument("-c", "--ctx-size", type=int, default=env.CTX_SIZE.get(),
                   help="context window in tokens (default: min(4096, the model's))")
    add_cache_type(p)
    add_threads(p, "the local backend computes with")


def add_cache_type(p: argparse.ArgumentParser) -> None:
    """--cache-type (llama.cpp's -ctk/-ctv, one for both)."""
    p.add_argument("--cache-type", choices=tuple(KV_TYPES),
                   help="dtype of the KV cache (default: f16, as llama.cpp's)")


def _count(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_threads(p: argparse.ArgumentParser, what: str) -> None:
    """-t/--threads, like llama.cpp's; its default comes from APIR_THREADS, the config file
    or the CPU's cores."""
    p.add_argument("-t", "--threads", type=_count, default=env.THREADS.get(), metavar="N",
                   help=f"CPU threads {what} (default: {env.THREADS.default} here, the physical "
                        f"cores but one, at most 8; env APIR_THREADS)")


@dataclass(frozen=True)
class RunConfig:
    """Which model runs where, as the flags, environment and config file say."""

    model: str | None = None  # a known name, a registered name, a .gguf path; None: the default
    backend: str = "local"
    device: str | None = None
    ctx_size: int | None = None
    remote: str | None = None  # a host daemon's address, or "auto"
    token: str = ""  # the shared secret of a tcp/vsock host (--token-file, APIR_TOKEN...)
    spin_us: int | None = None  # a remote guest's busy-polling (APIR_SPIN_US; None: by device)
    cache_dir: Path = DEFAULT_CACHE_DIR
    executor: ExecutorConfig = DEFAULT_EXECUTOR  # how a local backend runs graphs
    threads: int | None = None  # CPU threads of a local torch backend; None: torch's choice
    cache_type: str | None = None  # the KV cache's dtype, a KV_TYPES name; None: the default

    def __post_init__(self) -> None:
        if self.ctx_size is not None and self.ctx_size < 1:
            raise ValueError(f"--ctx-size must be >= 1, got {self.ctx_size}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.cache_type is not None and self.cache_type not in KV_TYPES:
            raise ValueError(f"--cache-type must be one of {', '.join(KV_TYPES)}, got {self.cache_type!r}")

    @property
    def target(self) -> str:
        """The backend that runs: an address makes it remote."""
        return "remote" if self.remote else self.backend


def run_config(args: argparse.Namespace) -> RunConfig:
    """The ``RunConfig`` of parsed ``add_model`` and ``add_backend`` flags (either or both)."""
    given = {f: getattr(args, f) for f in ("model", "backend", "device", "ctx_size", "remote",
                                           "threads", "cache_type") if hasattr(args, f)}
    # the token is read here, once, and only where a host may ask for it
    remote = given.get("remote") or given.get("backend") == "remote"
    token = env.read_token(getattr(args, "token_file", None)) if remote else ""
    return RunConfig(**given, token=token, spin_us=env.spin_us(), cache_dir=env.cache_dir(),
                     executor=ExecutorConfig.from_env())


@contextlib.contextmanager
def remote_ready(config: RunConfig) -> Iterator[RunConfig]:
    """``config`` with ``--remote auto`` made the address of the running daemon, or of one
    started for the block (a spinner on stderr while it comes up)."""
    from .spawn import auto_host

    spinner = Spinner()
    with auto_host(config.remote, config.device, spinner=spinner) as remote:
        spinner.done()
        yield dataclasses.replace(config, remote=remote)


def model_path(config: RunConfig) -> Path:
    """The GGUF file of ``config.model``: a name registered by ``apir pull`` first, then a
    packaged model or a path."""
    from .store import lookup

    registered = lookup(config.model) if config.model else None
    return registered or resolve_model(config.model, config.cache_dir)


def load(config: RunConfig, progress=None, say: Callable[[str], None] = eprint):
    """The model of ``config`` on its backend (``config.remote`` an address, not "auto"):
    ``run``'s, ``serve``'s. Says what was loaded where, and when it landed on the CPU unasked."""
    from .engine import load as load_model

    if config.target == "remote" and not config.remote:
        raise ApirError("--backend remote needs --remote URL (or APIR_REMOTE)")
    t0 = time.perf_counter()
    if config.target == "local" and config.threads:
        set_threads(config.threads)
    model = load_model(model_path(config), backend=config.target, device=config.device,
                       n_ctx=config.ctx_size, progress=progress, remote=config.remote,
                       token=config.token, spin_us=config.spin_us, executor=config.executor,
                       cache_type=KV_TYPES.get(config.cache_type or ""))
    dev = model.backend.device()
    where = f"{model.backend.name}:{dev.name}" + (f" via {config.remote}" if config.remote else "")
    if config.target == "local" and dev.kind == "cpu":
        import torch

        n = torch.get_num_threads()
        where += f" ({n} CPU thread{'s' if n > 1 else ''})"
    say(f"loaded {model.file.path.name} ({model.arch_name}, {model.file.quantization()}) "
           f"on {where} in {time.perf_counter() - t0:.1f}s")
    note = cpu_fallback_note(config.target, config.device, dev.kind, config.remote)
    if note:
        say(note)
    return model


def set_threads(n: int) -> None:
    """Make torch compute with ``n`` CPU threads in this process and in processes it forks
    from now on (the host's session workers). Nothing to do without torch."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(n)


def cpu_fallback_note(backend: str, requested: str | None, kind: str,
                      remote: str | None = None) -> str | None:
    """The note to print when a model landed on the CPU without anyone asking for it, or
    None. ``requested`` is the --device given (None: pick the best), ``kind`` the device
    the backend ended up on."""
    if requested is not None or kind != "cpu" or backend == "numpy":
        return None
    if remote or backend == "remote":
        return (f"note: the apir host at {remote or 'the remote address'} has no GPU (its torch "
                f"sees no CUDA/MPS device); graphs run on its CPU — pass --device cpu to "
                f"silence this, or point --remote at a host with a GPU")
    return ("note: no GPU found (torch sees no CUDA/MPS device); running on the CPU — pass "
            "--device cpu to silence this, or --remote URL to use a host's GPU")


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def progress_bar(label: str):
    """A progress callback drawing ``label: [####----] 41.2/98.1 MB  310 MB/s  ETA 0:01`` on
    stderr: redrawn in place (at most 10 times a second) on a terminal, else once at the end."""
    start = time.perf_counter()
    tty = sys.stderr.isatty()
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        finished = done >= total
        if not finished and (not tty or now - last[0] < 0.1):
            return
        last[0] = now
        elapsed = max(now - start, 1e-9)
        rate = done / elapsed
        filled = round(20 * done / total) if total else 20
        line = f"{label}: [{'#' * filled}{'-' * (20 - filled)}] {_size(done)}/{_size(total)}  {_size(rate)}/s"
        if finished:
            line += f"  in {elapsed:.1f}s"
        elif rate > 0:
            eta = int((total - done) / rate)
            line += f"  ETA {eta // 60}:{eta % 60:02d}"
        print(("\r" if tty else "") + line + ("\x1b[K" if tty else ""), end="\n" if finished else "",
              file=sys.stderr, flush=True)

    return report


class Spinner:
    """Passed to ``spawn.auto_host`` as its ``spinner``: called every ~0.1 s while an
    auto-started daemon comes up. Spins on a terminal; elsewhere says it once."""

    FRAMES = "|/-\\"

    def __init__(self, label: str = AUTO_HOST) -> None:
        self.label = label
        self.calls = 0
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self) -> None:
        if self.tty:
            frame = self.FRAMES[self.calls % len(self.FRAMES)]
            print(f"\r{frame} {self.label} ({time.perf_counter() - self.start:.0f}s)",
                  end="", file=sys.stderr, flush=True)
        elif self.calls == 0:
            eprint(f"{self.label}...")
        self.calls += 1

    def done(self) -> None:
        """Erase the spinner's line (call once the daemon answers)."""
        if self.tty and self.calls:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)
            self.calls = 0
