"""``apir bench serve``: many streams at once through the continuous-batching scheduler,
as llama.cpp's ``llama-batched-bench`` and vLLM's serving benchmark report them.

Per backend and concurrency C: C requests of ``n_prompt`` random tokens (no shared prefix)
are submitted together, each generating ``n_gen`` tokens greedily (fewer where a real
model ends one). Reported: aggregate t/s (every generated token over the round's wall
time, prefill included), per-stream decode t/s (median over streams, first token to
last), time to first token p50/p99, and the aggregate against ``solo``: one stream on the
single-sequence path (``Model.decode_steps``, what ``apir run`` uses).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..engine import Model, SamplingParams
from ..engine.scheduler import Request, Scheduler
from .backends import BackendOptions, open_backend
from .errors import BenchError
from .runner import SEED, TG_PROMPT, BenchTest, Log, Source, measure

WAIT = 3600.0  # seconds a round may take before the bench gives up on it


@dataclass(frozen=True)
class Round:
    backend: str
    streams: int
    tokens: int  # generated in all
    seconds: float  # wall time of the round
    per_stream: float  # median decode t/s of one stream
    ttft: tuple[float, ...]  # seconds from submission to each stream's first token


def run_round(scheduler: Scheduler, prompts: Sequence[Sequence[int]], n_gen: int, backend: str) -> Round:
    """Submit every prompt at once; wait for all to end."""
    params = SamplingParams(temperature=0, max_tokens=n_gen)
    times: list[list[float]] = [[] for _ in prompts]
    left = threading.Semaphore(0)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        scheduler.submit(Request(ids, params, lambda t, i=i: times[i].append(time.perf_counter()) or True,
                                 lambda reason: left.release()))
    for _ in prompts:
        if not left.acquire(timeout=WAIT):
            raise BenchError(f"a round of {len(prompts)} streams did not end in {WAIT:.0f}s")
    seconds = time.perf_counter() - t0
    rates = [(len(t) - 1) / (t[-1] - t[0]) for t in times if len(t) > 1 and t[-1] > t[0]]
    return Round(backend, len(prompts), sum(len(t) for t in times), seconds,
                 float(np.median(rates)) if rates else 0.0, tuple(t[0] - t0 for t in times if t))


def run(source: Source, backends: Sequence[str], options: BackendOptions, concurrency: Sequence[int],
        n_prompt: int, n_gen: int, log: Log) -> str:
    """Every round on every backend; the markdown table."""
    if not concurrency or min(concurrency) < 1 or n_prompt < 1 or n_gen < 2:
        raise BenchError("--concurrency takes stream counts >= 1, -p >= 1 and -n >= 2")
    f = source.open()
    rng = np.random.default_rng(SEED)
    rows = []
    with contextlib.ExitStack() as stack:
        for b in backends:
            model = Model(f, stack.enter_context(open_backend(b, options)), n_ctx=max(n_prompt, TG_PROMPT) + n_gen + 1)
            scheduler = Scheduler(model, max(concurrency), max_queue=0)
            stack.callback(scheduler.close)

            def prompts(n: int) -> list[list[int]]:
                return rng.integers(0, model.vocab_size, (n, n_prompt)).tolist()  # noqa: B023

            solo_prompt = prompts(1)[0]
            measure(model, BenchTest("tg", n_gen), solo_prompt)  # warm-up
            solo = n_gen / measure(model, BenchTest("tg", n_gen), solo_prompt)
            run_round(scheduler, prompts(1), n_gen, b)  # warm-up
            for c in concurrency:
                r = run_round(scheduler, prompts(c), n_gen, b)
                log(f"{b} {c} streams: {r.tokens / r.seconds:,.1f} t/s")
                rows.append((r, solo))
    head = ("| backend | streams | aggregate t/s | per-stream t/s | TTFT p50 ms | TTFT p99 ms | × solo |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [head]
    for r, solo in rows:
        p50, p99 = (np.percentile(r.ttft, q) * 1e3 for q in (50, 99))
        agg = r.tokens / r.seconds
        lines.append(f"| {r.backend} | {r.streams} | {agg:,.1f} | {r.per_stream:,.1f} | {p50:,.0f} | "
                     f"{p99:,.0f} | {agg / solo:.2f} |")
    lines.append(f"\nsolo (single-sequence path, tg{n_gen}): "
                 + ", ".join(f"{b} {s:,.1f} t/s" for b, s in dict((r.backend, s) for r, s in rows).items()))
    return "\n".join(lines)
