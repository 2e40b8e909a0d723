"""``apir bench serve``: many streams at once through the continuous-batching scheduler,
as llama.cpp's ``llama-batched-bench`` and vLLM's serving benchmark report them.

Per backend and concurrency C: C requests of ``n_prompt`` random tokens (no shared prefix)
are submitted together, each generating ``n_gen`` tokens greedily (fewer where a real
model ends one). Reported: aggregate t/s (every generated token over the round's wall
time, prefill included), decode t/s (every stream's tokens while all of them decode: from
the last stream's first token to the first stream's last, as llama-batched-bench's S_TG
counts decode steps of every sequence, prefill apart), per-stream decode t/s (median over
streams, first token to last), time to first token p50/p99, and both aggregates against
``solo``: one stream on the single-sequence path (``Model.decode_steps``, what ``apir run``
uses).

``shared_prefix`` N adds prefix reuse (llama-server's ``cache_prompt``): a request of an
N-token prefix (a system prompt) and 16 tokens of its own, then, once it has ended, one
with the same prefix and 16 others. Reported: both times to first token, the second's
share of the first's, and the prompt tokens it found cached. A warm-up pair with another
prefix runs first, so neither request pays for recording its chunk lengths.
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
    decoding: float  # t/s of all streams while every one decodes (0: never all at once)


def all_decoding_rate(times: Sequence[Sequence[float]]) -> float:
    """Tokens per second of every stream together while all of them decode: the tokens
    (each stream's token times, ascending) after the last stream's first token and up to
    the first stream's last, over that span; 0 when the span is empty (a stream ended
    before another began, or a stream made fewer than two tokens)."""
    if not times or any(len(t) < 2 for t in times):
        return 0.0
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    if end <= start:
        return 0.0
    return sum(int(np.searchsorted(t, end, "right") - np.searchsorted(t, start, "right")) for t in times) / (end - start)


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
                 float(np.median(rates)) if rates else 0.0, tuple(t[0] - t0 for t in times if t),
                 all_decoding_rate(times))


@dataclass(frozen=True)
class PrefixReuse:
    backend: str
    prefix: int  # tokens shared by the two prompts
    ttft: tuple[float, float]  # seconds, first request and second
    cached: int  # prompt tokens the second found in a slot


SUFFIX = 16  # each prefix-reuse request's own tokens after the shared prefix


def first_token(scheduler: Scheduler, ids: Sequence[int], n_gen: int) -> tuple[float, int]:
    """One request alone: seconds to its first token, and its cached prompt tokens."""
    first: list[float] = []
    ended = threading.Event()
    t0 = time.perf_counter()
    request = scheduler.submit(Request(ids, SamplingParams(temperature=0, max_tokens=n_gen),
                                       lambda t: first.append(time.perf_counter()) or True,
                                       lambda reason: ended.set()))
    if not ended.wait(WAIT):
        raise BenchError(f"a request of {len(ids)} tokens did not end in {WAIT:.0f}s")
    if not first:
        raise BenchError(f"a request of {len(ids)} tokens ended without a token ({request.error})")
    return first[0] - t0, request.cached_tokens


def prefix_reuse(scheduler: Scheduler, rng: np.random.Generator, vocab: int, prefix: int, n_gen: int,
                 backend: str) -> PrefixReuse:
    for _warm_up_then_measured in range(2):
        shared = rng.integers(0, vocab, prefix).tolist()
        (t1, _), (t2, cached) = (first_token(scheduler, shared + rng.integers(0, vocab, SUFFIX).tolist(), n_gen)
                                 for _ in range(2))
    return PrefixReuse(backend, prefix, (t1, t2), cached)


def run(source: Source, backends: Sequence[str], options: BackendOptions, concurrency: Sequence[int],
        n_prompt: int, n_gen: int, log: Log, shared_prefix: int = 0) -> str:
    """Every round on every backend; the markdown table (and prefix reuse's)."""
    if not concurrency or min(concurrency) < 1 or n_prompt < 1 or n_gen < 2:
        raise BenchError("--concurrency takes stream counts >= 1, -p >= 1 and -n >= 2")
    f = source.open()
    rng = np.random.default_rng(SEED)
    if shared_prefix < 0:
        raise BenchError("--shared-prefix takes a token count >= 0")
    rows, reuse = [], []
    n_ctx = max(n_prompt, TG_PROMPT, shared_prefix + SUFFIX) + n_gen + 1
    with contextlib.ExitStack() as stack:
        for b in backends:
            model = Model(f, stack.enter_context(open_backend(b, options)), n_ctx=n_ctx)
            t0 = time.perf_counter()
            scheduler = Scheduler(model, max(concurrency), max_queue=0)
            stack.callback(scheduler.close)
            # a GPU host records, and compiles the decode steps of, every step length the
            # slots can meet before the first request: minutes the first time it serves a model
            log(f"{b}: {max(concurrency)} slots ready in {time.perf_counter() - t0:,.1f} s")

            def prompts(n: int) -> list[list[int]]:
                return rng.integers(0, model.vocab_size, (n, n_prompt)).tolist()  # noqa: B023

            solo_prompt = prompts(1)[0]
            measure(model, BenchTest("tg", n_gen), solo_prompt)  # warm-up
            solo = n_gen / measure(model, BenchTest("tg", n_gen), solo_prompt)
            log(f"{b} solo (single-sequence path, tg{n_gen}): {solo:,.1f} t/s")
            run_round(scheduler, prompts(1), n_gen, b)  # warm-up
            for c in concurrency:
                r = run_round(scheduler, prompts(c), n_gen, b)
                log(f"{b} {c} streams: {r.tokens / r.seconds:,.1f} t/s, {r.decoding:,.1f} while all decode")
                rows.append((r, solo))
            if shared_prefix:
                reuse.append(prefix_reuse(scheduler, rng, model.vocab_size, shared_prefix, n_gen, b))
                log(f"{b} shared prefix: TTFT {reuse[-1].ttft[0] * 1e3:,.0f} then {reuse[-1].ttft[1] * 1e3:,.0f} ms")
    head = ("| backend | streams | aggregate t/s | × solo | decode t/s | × solo | per-stream t/s | "
            "TTFT p50 ms | TTFT p99 ms |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [head]
    for r, solo in rows:
        p50, p99 = (np.percentile(r.ttft, q) * 1e3 for q in (50, 99))
        agg = r.tokens / r.seconds
        lines.append(f"| {r.backend} | {r.streams} | {agg:,.1f} | {agg / solo:.2f} | {r.decoding:,.1f} | "
                     f"{r.decoding / solo:.2f} | {r.per_stream:,.1f} | {p50:,.0f} | {p99:,.0f} |")
    lines.append(f"\nsolo (single-sequence path, tg{n_gen}): "
                 + ", ".join(f"{b} {s:,.1f} t/s" for b, s in dict((r.backend, s) for r, s in rows).items()))
    if reuse:
        lines += ["", "| backend | shared prefix | TTFT first ms | TTFT second ms | second ÷ first | cached tokens |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {p.backend} | {p.prefix} | {p.ttft[0] * 1e3:,.1f} | {p.ttft[1] * 1e3:,.1f} | "
                  f"{p.ttft[1] / p.ttft[0]:.3f} | {p.cached} |" for p in reuse]
    return "\n".join(lines)
