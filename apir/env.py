"""Every environment variable apir reads, declared once: name, type, default, meaning.

Precedence everywhere: command-line flag > environment variable > the user config file >
built-in default. The config file (``~/.config/apir/config.toml``, or ``$APIR_CONFIG``) is
TOML whose keys are the variables' names, lowercased, without the ``APIR_`` prefix::

    model = "gemma3-270m"
    remote = "auto"
    device = "cuda"
    ctx_size = 8192

Flags take their defaults from ``EnvVar.get()``, so every caller sees all three layers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ApirError
from .models.resolve import DEFAULT_CACHE_DIR

SECRET = "(set)"  # what describe() shows instead of a secret's value


class ConfigError(ApirError):
    """The user config file cannot be used: one line naming the file and what is wrong."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    help: str
    secret: bool = False  # never printed by `apir info --config`

    @property
    def key(self) -> str:
        """This variable's key in the config file: ``APIR_CTX_SIZE`` -> ``ctx_size``."""
        return self.name.lower().removeprefix("apir_")

    def get(self) -> str | None:
        return self.lookup()[0]

    def lookup(self) -> tuple[str | None, str]:
        """(value, where it came from: "env", "config" or "default")."""
        value = os.environ.get(self.name)
        if value not in (None, ""):
            return value, "env"
        if self.name != CONFIG.name:
            file = read_config()
            if self.key in file:
                return file[self.key], "config"
        return self.default, "default"


CACHE_DIR = EnvVar(
    "APIR_CACHE_DIR", str(DEFAULT_CACHE_DIR),
    "where models assembled from several packages (gemma3-270m) are cached",
)
MODEL = EnvVar("APIR_MODEL", None, "default model name or .gguf path for -m")
BACKEND = EnvVar("APIR_BACKEND", "local", "default backend: local (PyTorch) or numpy")
DEVICE = EnvVar("APIR_DEVICE", None, "default device for the local backend: cpu, cuda or mps")
CTX_SIZE = EnvVar("APIR_CTX_SIZE", None, "context window in tokens (default: min(4096, the model's))")


def default_threads() -> int:
    """The physical cores this process may run on, but one, at most 8 (at least 1).

    torch's default (every core) collapses when anything else wants a core: its OpenMP
    threads wait at a barrier after every op for one that is descheduled. On 2 cores with
    `yes >/dev/null` running, SmolLM2-135M decoded 2.5-3.7 t/s with 2 threads, 7.1-14 t/s
    with 1 (idle: 21-23 t/s either way). A free core keeps the guest, the server or a
    neighbour off the compute threads; past ~8 threads decode is bound by memory bandwidth.
    OMP_NUM_THREADS, when set, is taken as it is."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:  # hyperthreads of one core share its (package, core) ids
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:  # no sysfs (macOS): count logical CPUs
            cores.add(cpu)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:  # the OpenMP convention a user may already rely on
        return int(omp)
    return max(1, min(len(cores) - 1, 8))


THREADS = EnvVar(
    "APIR_THREADS", str(default_threads()),
    "CPU threads torch computes with, in apir run/serve (local backend) and apir host "
    "(default: the physical cores but one, at most 8; at least 1)",
)
API_KEY = EnvVar(
    "APIR_API_KEY", None,
    "apir serve: require 'Authorization: Bearer KEY' on /v1/* (default: no key needed)",
    secret=True,
)
HF_ENDPOINT = EnvVar(
    "HF_ENDPOINT", "https://huggingface.co",
    "apir pull hf://...: the Hugging Face Hub (or a mirror) to download from",
)
HF_TOKEN = EnvVar("HF_TOKEN", None, "apir pull hf://...: access token for gated or private repos",
                  secret=True)

REMOTE = EnvVar(
    "APIR_REMOTE", None,
    "guest: the host daemon's address (unix://PATH, tcp://HOST:PORT, vsock://CID:PORT, auto)",
)
TOKEN = EnvVar("APIR_TOKEN", None, "guest: the shared secret for tcp/vsock hosts", secret=True)
TOKEN_FILE = EnvVar("APIR_TOKEN_FILE", None, "guest: a file holding that secret (wins over APIR_TOKEN)")
HOST_LISTEN = EnvVar("APIR_HOST_LISTEN", None, "host: default --listen address (default: the user's unix socket)")
BENCH_HISTORY = EnvVar(
    "APIR_BENCH_HISTORY", str(Path.home() / ".local" / "share" / "apir" / "bench.jsonl"),
    "apir bench: the JSONL file every run's records are appended to (--history wins)",
)

CUDA_GRAPHS = EnvVar("APIR_CUDA_GRAPHS", "1", "host: replay decode steps from captured CUDA graphs (0 = eager)")
COMPILE = EnvVar(
    "APIR_COMPILE", "1",
    "host: compile decode steps with Inductor (and fixed-shape graphs from their second run) before "
    "capturing them (0 = capture eager kernels, "
    "all = prefill chunks too: ~1.5x faster prefill on an H200, a compile per chunk length "
    "and sampling mode, which apir serve does before it reports ready)",
)
COMPILE_CACHE = EnvVar(
    "APIR_COMPILE_CACHE", None,
    "host: the directory compiled programs are kept in, so a later session or process "
    "loads them instead of compiling again (default ~/.cache/apir/compile; apir host "
    "--compile-cache wins)",
)
DEQUANT_CACHE = EnvVar(
    "APIR_DEQUANT_CACHE", None,
    "host: 1 = keep dequantized f32/f16 copies of quantized and F16 weights (several times "
    "the memory); 0 (default) = a GPU computes from the GGUF blocks, a CPU from compact forms "
    "(int4 for Q4 types, int8 values with f32 scales for the other quantized types)",
)
CPU_INT4 = EnvVar(
    "APIR_CPU_INT4", "1",
    "host: 1 (default) = on a CPU device, compute Q4_0, Q4_1 and Q4_K weights through torch's "
    "int4 product with bf16 activations (0.625 bytes a weight, about twice the decode speed of "
    "a dequantized copy, logits to bf16 precision); 0 = as the other quantized types (int8 "
    "values with f32 scales, or f32 copies with APIR_DEQUANT_CACHE=1)",
)
SPIN_US = EnvVar(
    "APIR_SPIN_US", None,
    "guest and host: busy-poll this many microseconds for the next frame before sleeping "
    "(default: 50000 when the host executes on a GPU, 0 on a CPU host, whose cores do the work)",
)


def spin_us() -> int | None:
    """APIR_SPIN_US as a number; None when unset (each side then picks by the host's
    device: ``apir.transport.spin_seconds``)."""
    value = SPIN_US.get()
    return None if value is None else int(value)


def read_token(token_file: str | None = None) -> str:
    """The shared secret for tcp/vsock: --token-file, else $APIR_TOKEN_FILE, else
    $APIR_TOKEN, else empty."""
    path = token_file or TOKEN_FILE.get()
    if path:
        try:
            return open(path).read().strip()
        except OSError as e:
            raise ApirError(f"cannot read token file {path}: {e.strerror}") from None
    return TOKEN.get() or ""



CONFIG = EnvVar(
    "APIR_CONFIG",
    str(Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "apir" / "config.toml"),
    "the user config file (TOML; keys are these variables' names, lowercased, without APIR_)",
)

ALL = (
    CONFIG, MODEL, BACKEND, DEVICE, CTX_SIZE, THREADS, REMOTE, TOKEN, TOKEN_FILE, HOST_LISTEN, API_KEY,
    CACHE_DIR, HF_ENDPOINT, HF_TOKEN, BENCH_HISTORY, CUDA_GRAPHS, COMPILE, COMPILE_CACHE, DEQUANT_CACHE,
    CPU_INT4, SPIN_US,
)

_cached: tuple[tuple, dict[str, str]] = ((), {})  # (path, mtime, size) -> parsed values


def cache_dir() -> Path:
    """The directory models are cached in (not created here): $APIR_CACHE_DIR, the config
    file's cache_dir, or the default. Read at the edge and passed down as a parameter."""
    return Path(CACHE_DIR.get() or DEFAULT_CACHE_DIR).expanduser()


def config_path() -> Path:
    return Path(CONFIG.get() or CONFIG.default or "").expanduser()


def read_config() -> dict[str, str]:
    """The config file's values by key, as strings (booleans as "1"/"0"); {} when there is
    no file. Re-read only when the file changes. Raises ConfigError, one line."""
    global _cached
    path = config_path()
    try:
        st = path.stat()
    except FileNotFoundError:
        if os.environ.get(CONFIG.name):
            raise ConfigError(f"{path}: no such config file (named by {CONFIG.name})") from None
        return {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from None
    stamp = (str(path), st.st_mtime_ns, st.st_size)
    if _cached[0] == stamp:
        return _cached[1]
    try:
        import tomllib
    except ModuleNotFoundError:  # requires-python is >=3.10; tomllib arrived in 3.11
        raise ConfigError(f"{path}: reading the config file needs Python >= 3.11 (tomllib); "
                          f"remove it or set the APIR_* variables instead") from None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config file: {e}") from None
    known = {var.key for var in ALL if var is not CONFIG}
    values: dict[str, str] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{path}: unknown key {key!r}; known keys: {', '.join(sorted(known))}")
        if isinstance(value, bool):
            value = "1" if value else "0"
        elif isinstance(value, (int, float, str)):
            value = str(value)
        else:
            raise ConfigError(f"{path}: {key} must be a string, number or boolean, "
                              f"not a {type(value).__name__}")
        if value != "":
            values[key] = value
    _cached = (stamp, values)
    return values


def describe(flags: dict[str, object] | None = None) -> list[dict[str, str | None]]:
    """Every variable's effective value and where it came from: flag, env, config or
    default. ``flags`` maps config keys to the values of flags given on the command line.
    Secrets show as "(set)"."""
    rows = []
    for var in ALL:
        value, source = var.lookup()
        if flags and flags.get(var.key) is not None:
            value, source = str(flags[var.key]), "flag"
        if var.secret and value is not None:
            value = SECRET
        rows.append({"name": var.name, "key": var.key, "value": value, "source": source})
    return rows
