"""The measurements, as llama-bench makes them.

``ppN``  one forward pass over N prompt tokens from an empty cache (the engine's prefill:
         chunks of PREFILL_CHUNK through the sample graph), N / seconds.
``tgN``  after a TG_PROMPT-token prompt (not timed), N single-token greedy decode steps,
         each feeding back the token sampled on the backend (no end-of-text check),
         N / seconds.
``@ dD`` (``-d D``, llama-bench's n_depth) either test with D prompt tokens already in the
         KV cache (prefilled, not timed): ppN then runs positions D..D+N-1, tgN decodes
         from position D. The test is named ``ppN@dD``.

Every backend runs the same model in the same process run. Per model and test: one
warm-up run on each backend, then repetition 1 on every backend, repetition 2 on every
backend, ... so slow drift (thermals, other load) hits all backends alike. The prompt is
the same random token ids for every backend and repetition.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import math
import os
import platform
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import __version__
from ..backends import Backend
from ..backends.executor import Executor
from ..backends.remote import RemoteBackend, host_status
from ..engine.model import Model
from ..errors import ApirError
from ..flags import RunConfig, model_path
from ..graph import DType
from ..models.gguf_file import GGUFFile
from ..models.resolve import DEFAULT_CACHE_DIR, KNOWN_MODELS
from .backends import BackendOptions, open_backend
from .errors import BenchError
from .report import fmt_size
from .synthetic import SyntheticFile, parse_spec

TG_PROMPT = 4  # tokens prefilled (untimed) before a tg test
SEED = 1234

Log = Callable[[str], None]


@dataclass(frozen=True)
class BenchTest:
    kind: str  # "pp" | "tg"
    n: int
    depth: int = 0  # tokens in the KV cache before the test

    @property
    def name(self) -> str:
        return f"{self.kind}{self.n}" + (f"@d{self.depth}" if self.depth else "")

    @property
    def start(self) -> int:
        """The position of the first timed token."""
        return self.depth if self.kind == "pp" else max(self.depth, TG_PROMPT)

    @property
    def n_ctx(self) -> int:
        return self.start + self.n

    @property
    def n_prompt(self) -> int:
        return self.n if self.kind == "pp" else 0

    @property
    def n_gen(self) -> int:
        return self.n if self.kind == "tg" else 0


@dataclass(frozen=True)
class Source:
    """A model to benchmark: ``spec`` is a model name/path, or a synthetic shape."""

    spec: str
    synthetic: bool = False

    def validate(self, cache_dir: Path = DEFAULT_CACHE_DIR) -> None:
        """Fail before any backend starts: unknown shape, model not installed, no such file."""
        if self.synthetic:
            parse_spec(self.spec)
        else:
            model_path(RunConfig(self.spec, cache_dir=cache_dir))

    def open(self, cache_dir: Path = DEFAULT_CACHE_DIR) -> GGUFFile | SyntheticFile:
        if self.synthetic:
            return SyntheticFile.from_spec(self.spec)
        return GGUFFile(model_path(RunConfig(self.spec, cache_dir=cache_dir)))

    def label(self, f: GGUFFile | SyntheticFile) -> str:
        if self.synthetic:
            return f.name
        return self.spec if self.spec in KNOWN_MODELS else f.path.name


@dataclass(frozen=True)
class BenchConfig:
    sources: tuple[Source, ...]
    backends: tuple[str, ...]
    n_prompt: tuple[int, ...] = (512,)
    n_gen: tuple[int, ...] = (128,)
    n_depth: tuple[int, ...] = (0,)
    reps: int = 5
    options: BackendOptions = BackendOptions()
    cache_dir: Path = DEFAULT_CACHE_DIR  # where packaged models are assembled
    cache_type: DType | None = None  # the KV cache's dtype; None: the engine's default

    def __post_init__(self) -> None:
        if self.reps < 1:
            raise BenchError(f"-r must be at least 1, got {self.reps}")
        if any(n < 0 for n in (*self.n_prompt, *self.n_gen, *self.n_depth)):
            raise BenchError("-p, -n and -d take token counts >= 0")
        if not self.tests:
            raise BenchError("nothing to measure: -p and -n are both 0")
        if not self.sources:
            raise BenchError("no model given: use -m MODEL or --synthetic SHAPE")

    @property
    def tests(self) -> list[BenchTest]:
        """Per depth (llama-bench's order): the pp tests, then the tg tests."""
        out = []
        for d in dict.fromkeys(self.n_depth or (0,)):
            out += [BenchTest("pp", n, d) for n in dict.fromkeys(self.n_prompt) if n > 0]
            out += [BenchTest("tg", n, d) for n in dict.fromkeys(self.n_gen) if n > 0]
        return out

    @property
    def n_ctx(self) -> int:
        """The smallest context every test fits in (it sizes the KV cache, as in llama-bench)."""
        return max(t.n_ctx for t in self.tests)


# ---------------------------------------------------------------- run metadata


def git_commit(tree: Path | None = None) -> str | None:
    """``git rev-parse HEAD`` of the apir source tree, with "-dirty" appended when tracked
    files differ from it (a result then says it did not come from that commit alone), or
    None (not a checkout, no git)."""
    tree = tree or Path(__file__).resolve().parents[2]

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                                  timeout=5, check=False)
        except (OSError, subprocess.SubprocessError):
            return None

    out = git("rev-parse", "HEAD")
    commit = out.stdout.strip() if out is not None and out.returncode == 0 else ""
    if len(commit) != 40:
        return None
    status = git("status", "--porcelain", "--untracked-files=no", "--", "apir")
    return commit + "-dirty" if status is None or status.returncode or status.stdout.strip() else commit


def torch_version() -> str | None:
    """The installed torch's version, read from its metadata (torch is not imported)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_info() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run_metadata() -> dict:
    """Fields every record of one run shares."""
    return {
        "run_id": uuid.uuid4().hex[:16],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "apir_version": __version__,
        "apir_commit": git_commit(),
        "torch_version": torch_version(),
        "python_version": platform.python_version(),
        "cpu_info": cpu_info(),
        "n_cpus": os.cpu_count(),
    }


# ---------------------------------------------------------------- measuring


def measure(model: Model, test: BenchTest, prompt: Sequence[int]) -> float:
    """Seconds of one run of ``test`` (only the timed part)."""
    start = test.start
    token = model.prefill(prompt[:start]) if start else 0
    model.backend.synchronize()
    if test.kind == "pp":
        t0 = time.perf_counter()
        model.prefill(prompt[start : start + test.n], start)
        model.backend.synchronize()
        return time.perf_counter() - t0
    t0 = time.perf_counter()
    model.decode_steps(token, start, test.n)
    model.backend.synchronize()
    return time.perf_counter() - t0


def resident_memory(be: Backend) -> dict | None:
    """What the backend's host holds for the model after the tests: {"allocated", "peak"}
    bytes (its buffers: weights, KV cache, compute; plus derived weight copies an executor
    charges), from the executor itself, or for a remote backend from the host's status of
    its session; None where that cannot be read (a tcp host wants its token)."""
    if isinstance(be, Executor):
        held, peak = be.memory()
        return {"allocated": held, "peak": peak}
    if isinstance(be, RemoteBackend):
        try:
            sessions = host_status(str(be.address)).sessions
        except (ApirError, OSError):
            return None
        mine = [s for s in sessions if s.session == be.session]
        return {"allocated": mine[0].allocated, "peak": mine[0].peak} if mine else None
    return None


def _record(meta: dict, model: str, f, backend: str, dev, test: BenchTest, n_ctx: int,
            kv_type: DType, seconds: list[float], memory: dict | None) -> dict:
    ts = [test.n / s for s in seconds]
    ns = [round(s * 1e9) for s in seconds]
    return {
        **meta,
        "model": model,
        "model_type": f"{f.arch} {f.quantization()}",
        "model_size": f.nbytes,
        "model_params": n_params(f),
        "synthetic": isinstance(f, SyntheticFile),
        "backend": backend,
        "device": dev.description or dev.name,
        "device_kind": dev.kind,
        "n_ctx": n_ctx,
        "n_prompt": test.n_prompt,
        "n_gen": test.n_gen,
        "n_depth": test.depth,
        "kv_type": kv_type.name.lower(),  # llama-bench's type_k / type_v
        "test": test.name,
        "n_reps": len(seconds),
        "avg_ns": round(statistics.fmean(ns)),
        "stddev_ns": round(statistics.stdev(ns)) if len(ns) > 1 else 0,
        "avg_ts": statistics.fmean(ts),
        "stddev_ts": statistics.stdev(ts) if len(ts) > 1 else 0.0,
        "samples_ns": ns,
        "samples_ts": ts,
        "pct_native": None,
        "gpu_memory": memory,  # resident_memory: {"allocated", "peak"} bytes, or None
    }


def n_params(f: GGUFFile | SyntheticFile) -> int:
    if isinstance(f, SyntheticFile):
        return f.n_params  # from the shapes, without making the tensors
    return sum(math.prod(t.shape) for t in f.tensors.values())


def _add_pct_native(records: list[dict]) -> None:
    native = {(r["model"], r["test"]): r["avg_ts"] for r in records if r["backend"] == "native"}
    for r in records:
        base = native.get((r["model"], r["test"]))
        r["pct_native"] = 100.0 * (r["avg_ts"] / base) if base else None


def run(config: BenchConfig, log: Log) -> list[dict]:
    """Run every test of ``config``; returns one record per (model, backend, test)."""
    for source in config.sources:
        source.validate(config.cache_dir)
    meta = run_metadata()
    records: list[dict] = []
    for source in config.sources:
        records += _run_source(config, source, meta, log)
    _add_pct_native(records)
    return records


def _run_source(config: BenchConfig, source: Source, meta: dict, log: Log) -> list[dict]:
    f = source.open(config.cache_dir)
    name = source.label(f)
    tests, n_ctx = config.tests, config.n_ctx
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()  # quietly: a backend that fails is the run's only stderr line
        backends: dict[str, Backend] = {
            b: stack.enter_context(open_backend(b, config.options)) for b in config.backends
        }
        log(f"backends ready in {time.perf_counter() - t0:.1f}s: {', '.join(backends)}")
        models, devices = {}, {}
        for b, be in backends.items():
            t0 = time.perf_counter()
            models[b] = Model(f, be, n_ctx=n_ctx, cache_type=config.cache_type)
            devices[b] = be.device()
            log(f"loaded {name} ({fmt_size(f.nbytes)}) on {b} ({devices[b].name}) "
                f"in {time.perf_counter() - t0:.1f}s")
        vocab = next(iter(models.values())).vocab_size
        prompt = np.random.default_rng(SEED).integers(0, vocab, n_ctx).tolist()
        seconds: dict[tuple[str, str], list[float]] = {}
        for test in tests:
            for b, m in models.items():
                log(f"{name} {test.name} {b}: warm-up")
                measure(m, test, prompt)
            for rep in range(config.reps):
                for b, m in models.items():
                    s = measure(m, test, prompt)
                    seconds.setdefault((b, test.name), []).append(s)
                    log(f"{name} {test.name} {b}: rep {rep + 1}/{config.reps} {test.n / s:,.2f} t/s")
        memory = {b: resident_memory(be) for b, be in backends.items()}
        return [
            _record(meta, name, f, b, devices[b], test, n_ctx, models[b].kv.dtype,
                    seconds[(b, test.name)], memory[b])
            for test in tests
            for b in models
        ]
