"""``apir bench transport``: what the transport itself costs, per transport, side by side.

Measures, against a real daemon (started here, or ``--remote`` ones): the null-call round
trip (a Synchronize: frame out, dispatch, frame back), a decode-shaped step (a tiny graph
with a decode step's inputs and output: token, position and sampling parameters in, one
token id out), the same step pipelined as the engine decodes (step n+1 submitted, its
token fed on the host from step n, before token n is read: the time per step is then what
the slower side takes, not the sum of both and the transport), the same graph with 512
tokens in and out (what a prefill chunk adds to the frames), and bulk upload bandwidth
(set_tensor of a large buffer, then a synchronize so the host has really consumed it).

When the bench starts its own daemon it also runs the same step natively, in this
process (the executor called directly), interleaving native and remote calls in short
rounds so that drift (frequency scaling, a noisy neighbour) hits both alike; the step's
"overhead" is remote p50 minus native p50: what remoting adds to every decode step
(natively on a CPU a submit computes at once, so the native pipelined step is the plain
one fed on the device; on CUDA it queues the step, as the host does for a remote guest).
Set ``APIR_SPIN_US=50000`` to measure as a GPU host behaves (both sides busy-poll for the
next frame); by default a CPU host sleeps on its eventfd and pays the scheduler's wake-up.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..backends.base import DEFAULT_EXECUTOR, Backend, BufferPurpose, ExecutorConfig
from ..graph import DType, GraphBuilder, T

if TYPE_CHECKING:
    from ..backends.remote import RemoteBackend

ROUND = 100  # step calls per backend per interleaved round
WARMUP = 200
VOCAB, DIM = 16, 8  # tiny tensors: the executor's own work is as small as it gets
PREFILL_TOKENS = 512  # the engine's prefill chunk


@dataclass(frozen=True)
class TransportResult:
    transport: str
    null_p50_us: float | None  # None: not measured (native has no round trip)
    null_p99_us: float | None
    step_p50_us: float
    step_p99_us: float
    step_overhead_us: float | None  # step p50 minus native step p50 (None: no native run)
    pipelined_p50_us: float  # per step, one step in flight ahead of the one read
    pipelined_p99_us: float
    pipelined_overhead_us: float | None  # pipelined p50 minus native pipelined p50
    prefill_p50_us: float  # a PREFILL_TOKENS-token step, as a prefill chunk is sent
    prefill_overhead_us: float | None
    upload_gbps: float | None


def _percentile(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def _us(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples) * 1e6, _percentile(samples, 0.99) * 1e6


def model_step(b: Backend, pipelined: bool = False, n_tokens: int = 1) -> Callable[[int], None]:
    """Register a model-shaped graph on ``b``; returns ``step(i)``, one compute call.

    Inputs as the engine's sample graph has them (tokens (T,) i32, pos (T,) i32, params (5,)
    f32, T = ``n_tokens``); two row lookups, a matmul and an argmax: T i32 token ids come back.
    ``pipelined``: as the engine decodes, ``step(i)`` submits step i+1, its token fed from
    step i on the backend, then reads token i (the last step submitted stays in flight
    until the next request that waits takes its reply)."""
    rng = np.random.default_rng(0)
    buf = b.alloc_buffer(2 * VOCAB * DIM * 4, BufferPurpose.WEIGHTS)
    b.set_tensor(buf, 0, rng.standard_normal(2 * VOCAB * DIM).astype(np.float32))
    g = GraphBuilder()
    tokens, pos = g.input("tokens", (T,), DType.I32), g.input("pos", (T,), DType.I32)
    g.input("params", (5,), DType.F32)  # bound and shipped like the engine's, not used here
    emb = g.weight(buf, 0, (VOCAB, DIM), DType.F32)
    out = g.weight(buf, VOCAB * DIM * 4, (VOCAB, DIM), DType.F32)  # (vocab, dim)
    x = g.add(g.get_rows(emb, tokens), g.get_rows(emb, pos))  # (T, dim)
    gid = b.register_graph(g.build(g.argmax(g.matmul(x, out))))
    params = np.array([0.8, 40, 0.95, 0.05, 0.5], np.float32)

    def step(i: int) -> None:
        ids = (np.arange(i, i + n_tokens) % VOCAB).astype(np.int32)
        b.compute(gid, {"tokens": ids, "pos": ids, "params": params})

    if not pipelined:
        return step
    ahead = [b.submit(gid, {"tokens": np.array([0], np.int32), "pos": np.array([0], np.int32), "params": params})]

    def step_ahead(i: int) -> None:
        following = b.submit(gid, {"pos": np.array([(i + 1) % VOCAB], np.int32), "params": params},
                             feed={"tokens": 0})
        current, ahead[0] = ahead[0], following
        current.result()

    return step_ahead


def _null_calls(b: RemoteBackend, calls: int) -> list[float]:
    for _ in range(WARMUP):
        b.ping()
    return [b.ping() for _ in range(calls)]


def _steps(steps: dict[tuple[str, bool], Callable[[int], None]], calls: int) -> dict[tuple[str, bool], list[float]]:
    """``calls`` timed steps of each, interleaved in rounds of ``ROUND``."""
    for step in steps.values():
        for i in range(WARMUP):
            step(i)
    samples: dict[tuple[str, bool], list[float]] = {name: [] for name in steps}
    for start in range(0, calls, ROUND):
        for name, step in steps.items():
            for i in range(start, min(start + ROUND, calls)):
                t = time.perf_counter()
                step(i)
                samples[name].append(time.perf_counter() - t)
    return samples


def _upload(b: Backend, upload_mb: int) -> float:
    data = np.random.default_rng(0).integers(0, 255, upload_mb << 20, dtype=np.uint8)
    buf = b.alloc_buffer(data.nbytes, BufferPurpose.WEIGHTS)
    b.set_tensor(buf, 0, data)  # first pass touches the host's fresh pages
    b.synchronize()
    t = time.perf_counter()
    b.set_tensor(buf, 0, data)
    b.synchronize()
    seconds = time.perf_counter() - t
    b.free_buffer(buf)
    return data.nbytes / seconds / 1e9


def _label(url: str) -> str:
    scheme = url.split("://")[0]
    return scheme + ("-shm" if scheme == "unix" else "")


def measure(urls: list[str], token: str, calls: int, upload_mb: int,
            native_device: str | None = None, spin_us: int | None = None,
            executor: ExecutorConfig = DEFAULT_EXECUTOR) -> list[TransportResult]:
    """Every figure for each daemon in ``urls``, plus a native row when ``native_device``
    names the device to run the step on in this process."""
    from ..backends.remote import RemoteBackend

    remotes: dict[str, Backend] = {}
    backends: dict[str, Backend] = {}
    try:
        for url in urls:
            remotes[_label(url)] = RemoteBackend(url, token=token, spin_us=spin_us)
        null = {name: _null_calls(b, calls) for name, b in remotes.items()}
        backends = dict(remotes)
        if native_device is not None:
            from ..backends.local import LocalBackend

            backends = {"native": LocalBackend(native_device, config=executor), **remotes}
        kinds = {"step": {}, "pipelined": {"pipelined": True}, "prefill": {"n_tokens": PREFILL_TOKENS}}
        steps = _steps({(name, kind): model_step(b, **kw) for name, b in backends.items()
                        for kind, kw in kinds.items()}, calls)
        upload = {name: _upload(b, upload_mb) for name, b in remotes.items()}
    finally:
        for b in {**backends, **remotes}.values():
            b.close()

    def p50(name: str, kind: str) -> float:
        return statistics.median(steps[name, kind]) * 1e6

    results = []
    for name in backends:
        null_us = _us(null[name]) if name in null else (None, None)
        over = {kind: None if native_device is None else p50(name, kind) - p50("native", kind) for kind in kinds}
        results.append(TransportResult(name, *null_us, *_us(steps[name, "step"]), over["step"],
                                       *_us(steps[name, "pipelined"]), over["pipelined"],
                                       p50(name, "prefill"), over["prefill"], upload.get(name)))
    return results


def run(remotes: list[str] | None, token: str, calls: int = 2000, upload_mb: int = 256,
        device: str | None = "cpu", spin_us: int | None = None,
        executor: ExecutorConfig = DEFAULT_EXECUTOR) -> list[TransportResult]:
    """Start a daemon on unix + tcp (unless ``remotes`` are given, with ``token``) and
    measure each, against the same step run natively on ``device``."""
    if remotes:
        return measure(remotes, token, calls, upload_mb, spin_us=spin_us)
    from ..spawn import free_port, start_host, write_token

    with tempfile.TemporaryDirectory(prefix="apir-bench-") as d:
        tmp = Path(d)
        urls = [f"unix://{tmp}/apir.sock", f"tcp://127.0.0.1:{free_port()}"]
        token_file = write_token(tmp / "token")
        with start_host(urls, tmp / "host.log", device=device, token_file=token_file):
            return measure(urls, Path(token_file).read_text().strip(), calls, upload_mb,
                           native_device=device or "cpu", spin_us=spin_us, executor=executor)


def _cell(value: float | None, fmt: str = ".1f") -> str:
    return "–" if value is None else format(value, fmt)


def markdown(results: list[TransportResult]) -> str:
    rows = ["| transport | null call p50 (µs) | p99 (µs) | decode step p50 (µs) | p99 (µs) | "
            "step overhead (µs) | pipelined step p50 (µs) | p99 (µs) | pipelined overhead (µs) | "
            f"{PREFILL_TOKENS}-token step p50 (µs) | overhead (µs) | upload (GB/s) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        rows.append(f"| {r.transport} | {_cell(r.null_p50_us)} | {_cell(r.null_p99_us)} | {r.step_p50_us:.1f} | "
                    f"{r.step_p99_us:.1f} | {_cell(r.step_overhead_us, '+.1f')} | {r.pipelined_p50_us:.1f} | "
                    f"{r.pipelined_p99_us:.1f} | {_cell(r.pipelined_overhead_us, '+.1f')} | "
                    f"{r.prefill_p50_us:.1f} | {_cell(r.prefill_overhead_us, '+.1f')} | "
                    f"{_cell(r.upload_gbps, '.2f')} |")
    return "\n".join(rows)
