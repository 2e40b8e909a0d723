"""Continuous batching (apir.engine.scheduler): many requests at once over a slotted KV
cache give each exactly what it gives alone; slots are freed, prefixes reused, the queue
bounded. Tiny random models (tests/tiny_models.py), local and remote backends."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from tiny_models import TinyConfig, write_tiny_gguf  # noqa: E402

import apir  # noqa: E402
from apir.engine import SamplingParams  # noqa: E402
from apir.engine.batch import Batch, Chunk  # noqa: E402
from apir.engine.scheduler import QueueFull, Request, Scheduler  # noqa: E402
from apir.graph.sampling import GREEDY  # noqa: E402
from apir.models.registry import ARCHITECTURES  # noqa: E402

WAIT = 60.0  # seconds: generous, for a loaded 2-core machine; never a bound on speed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "llama.gguf"
    return str(write_tiny_gguf(path, TinyConfig(context_length=1024), "F16"))


def run_all(scheduler: Scheduler, jobs: list[tuple[list[int], SamplingParams]]) -> list[str]:
    """Each job's text from its own thread, all submitted at once."""
    out: list[str | None] = [None] * len(jobs)

    def one(i: int) -> None:
        out[i] = "".join(scheduler.stream(*jobs[i]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    return out


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_steps_several_sequences(tmp_path, arch):
    """Three sequences in slots 2, 0 and 3 of a batched step (gemma3: prompts past its
    sliding window of 4), prefilled together, then decoded together: each sequence's
    greedy tokens are those of the single-sequence path."""
    cfg = TinyConfig(arch=arch, sliding_window=4, endless=True)
    with apir.load(str(write_tiny_gguf(tmp_path / "m.gguf", cfg, "F16")), backend="local", device="cpu") as model:
        prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(20, 31))]
        alone = [list(model.generate_ids(p, SamplingParams(temperature=0, max_tokens=6))) for p in prompts]
        batch, slots = Batch(model, 4), [2, 0, 3]
        outs = [[t] for t in batch.step([Chunk(s, p, 0, GREEDY) for s, p in zip(slots, prompts)])]
        for _ in range(5):
            tokens = batch.step([Chunk(s, [o[-1]], len(p) + len(o) - 1, GREEDY)
                                 for s, p, o in zip(slots, prompts, outs)])
            for o, t in zip(outs, tokens):
                o.append(t)
        assert outs == alone


def test_a_recording_host_runs_a_decode_step_of_its_sequences_not_of_every_slot(tiny):
    """On a recording host (forced here) a decode step of n sequences runs and samples B =
    n rounded up to a power of two (at most the slots: 6 here, not a power of two) rows; a
    step with a prompt chunk samples every slot's. The tokens are each sequence's own."""
    with apir.load(tiny, backend="local", device="cpu") as model:
        model._pad = True
        shapes: list[tuple[int, int]] = []  # (tokens, sampled rows) of each step
        submit = model.backend.submit

        def recording(gid, inputs, feed=None):
            shapes.append((len(inputs["pos"]), len(inputs["last"])))
            return submit(gid, inputs, feed)

        model.backend.submit = recording
        batch = Batch(model, slots=6)
        alone = [batch.step([Chunk(s, [3 + s], 0, GREEDY)])[0] for s in range(6)]
        for n, b in ((1, 1), (3, 4), (5, 6), (6, 6)):
            shapes.clear()
            assert batch.step([Chunk(s, [3 + s], 0, GREEDY) for s in range(n)]) == alone[:n]
            assert shapes == [(b, b)]
        shapes.clear()
        batch.step([Chunk(0, [1, 2, 3], 0, GREEDY), Chunk(1, [4], 0, GREEDY)])
        assert shapes == [(4, 6)]


@pytest.mark.parametrize("backend", ["local", "remote-unix"])
def test_concurrent_greedy_requests_match_each_alone(tiny, backend_options, backend):
    """8 requests of different prompt lengths, max_tokens and stop strings over 4 slots
    (so some wait, and prefills join running decodes): each text equals its solo run."""
    with apir.load(tiny, **backend_options[backend]) as model:
        jobs = []
        for i in range(8):
            ids = model.tokenize("hello " * (1 + 3 * i) + str(i))
            params = SamplingParams(temperature=0, max_tokens=5 + 4 * i)
            if i % 3 == 1:  # a stop string from the middle of what it says alone
                alone = model.generate(ids, temperature=0, max_tokens=params.max_tokens)
                params = SamplingParams(temperature=0, max_tokens=params.max_tokens, stop=(alone[3:5],))
            jobs.append((ids, params))
        expected = ["".join(model.stream(ids, params)) for ids, params in jobs]
        assert any(len(e) < len(model.generate(j[0], temperature=0, max_tokens=j[1].max_tokens))
                   for e, j in zip(expected, jobs))  # a stop string did cut one
        scheduler = Scheduler(model, slots=4, max_queue=8)
        try:
            assert run_all(scheduler, jobs) == expected
            assert scheduler.busy == 0
        finally:
            scheduler.close()


def test_a_recording_host_gets_every_step_length_before_the_first_request(tiny):
    """Where steps are recorded per length (a GPU: "graph_cache", here forced on a CPU
    model), the scheduler runs, greedy and sampled, before any request: a decode step of B
    tokens sampling B rows for B in 1, 2, 4 (its slots), and a step of each padded length
    up to PREFILL_CHUNK through the sampling graph of every slot; the requests then meet
    no other (graph, length) and give what each gives alone (the warm-up's rows are never
    read)."""
    from apir.engine.model import PREFILL_CHUNK

    with apir.load(tiny, backend="local", device="cpu") as model:
        jobs = [(model.tokenize("hello " * (1 + 5 * i)), SamplingParams(temperature=0, max_tokens=6 + i))
                for i in range(3)]
        expected = ["".join(model.stream(ids, params)) for ids, params in jobs]
        model._pad = True  # as on a host with the "graph_cache" capability
        steps: list[tuple[int, int, int]] = []  # (graph, tokens, sampled rows)
        submit = model.backend.submit

        def recording(gid, inputs, feed=None):
            if "last" in inputs:  # a fed step's tokens come from the step before (feed)
                steps.append((gid, len(inputs["pos"]), len(inputs["last"])))
            return submit(gid, inputs, feed)

        model.backend.submit = recording
        scheduler = Scheduler(model, slots=4, max_queue=8)
        try:
            lengths = [1 << i for i in range(PREFILL_CHUNK.bit_length()) if 1 << i <= PREFILL_CHUNK]
            decodes = [(1, 1), (2, 2), (4, 4)]
            assert [(t, b) for _, t, b in steps] == [*decodes, *[(n, 4) for n in lengths],
                                                     *decodes, *[(n, 4) for n in lengths[1:]]]
            graphs = {b: g for g, _, b in steps}
            assert len(set(graphs.values())) == 3  # one sampling graph per B
            warm = len(steps)
            assert run_all(scheduler, jobs) == expected
            assert {(g, t) for g, t, _ in steps[warm:]} <= {(g, t) for g, t, _ in steps[:warm]}
        finally:
            scheduler.close()


@pytest.mark.parametrize("backend", ["local", "remote-unix"])
def test_decode_steps_chained_ahead_give_what_each_request_gives_alone(tiny, backend_options, backend):
    """On a recording host (forced here), a step of decodes only is followed by the next
    one before its tokens are read, fed them on the backend. Greedy requests with stop
    strings and seeded sampled ones, more than the slots (so some end while a step runs
    ahead of them and others join): each gives exactly what it gives alone, and decode
    steps were fed."""
    with apir.load(tiny, **backend_options[backend]) as model:
        jobs = []
        for i in range(6):
            ids = model.tokenize("hello " * (1 + 2 * i) + str(i))
            if i % 2:
                params = SamplingParams(temperature=0.9, top_k=0, seed=40 + i, max_tokens=12 + 3 * i)
            else:
                params = SamplingParams(temperature=0, max_tokens=10 + 3 * i)
            if i == 2:  # a stop string from the middle of what it says alone
                alone = model.generate(ids, temperature=0, max_tokens=params.max_tokens)
                params = SamplingParams(temperature=0, max_tokens=params.max_tokens, stop=(alone[4:6],))
            jobs.append((ids, params))
        expected = [list(model.generate_ids(ids, params)) for ids, params in jobs]
        texts_alone = ["".join(model.stream(ids, params)) for ids, params in jobs]
        alone_penalized = SamplingParams(temperature=0, repeat_penalty=1.3, max_tokens=8)
        expected_penalized = list(model.generate_ids(jobs[0][0], alone_penalized))
        model._pad = True  # as on a host with the "graph_cache" capability
        fed: list[bool] = []
        submit = model.backend.submit

        def recording(gid, inputs, feed=None):
            if "last" in inputs:
                fed.append(bool(feed))
            return submit(gid, inputs, feed)

        model.backend.submit = recording
        scheduler = Scheduler(model, slots=4, max_queue=8)
        warm = len(fed)
        try:
            assert run_all(scheduler, [jobs[i] for i in (0, 2, 4)]) == [texts_alone[i] for i in (0, 2, 4)]
            out: list = [None] * len(jobs)
            threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, list(scheduler.generate(*jobs[i]))))
                       for i in range(len(jobs))]
            for t in threads:
                t.start()
            # work on the model's own cache (a penalized request, as the server runs one)
            # between chained steps: the step queued ahead is read first, nothing is mixed up
            time.sleep(0.05)
            penalized = scheduler.call(lambda: list(model.generate_ids(jobs[0][0], alone_penalized)))
            for t in threads:
                t.join(WAIT)
            assert out == expected
            assert penalized.result(WAIT) == expected_penalized
            assert scheduler.busy == 0
        finally:
            scheduler.close()
        assert not any(fed[:warm])
        # steps ran ahead (how many depends on when the threads' requests arrive; the
        # longest requests' last steps run alone, and those always chain)
        assert sum(fed[warm:]) >= 5


def test_seeded_sampling_matches_the_single_path(tiny):
    """Each request draws from its own seeded generator, as Model.generate_tokens does:
    sampled requests in one batch give what each gives alone (a 600-token prompt: two
    prefill chunks alone, shared steps here)."""
    with apir.load(tiny, backend="local", device="cpu") as model:
        jobs = [([1 + i] * (600 if i == 0 else 5 + i), SamplingParams(temperature=1.0, top_k=0, seed=10 + i,
                                                                     max_tokens=8)) for i in range(4)]
        alone = [list(model.generate_ids(*job)) for job in jobs]
        scheduler = Scheduler(model, slots=4, max_queue=4)
        try:
            out: list = [None] * 4
            threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, list(scheduler.generate(*jobs[i]))))
                       for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT)
            assert out == alone
        finally:
            scheduler.close()


def test_shared_prefix_is_reused(tiny):
    """A second prompt that starts with the first (a system prompt, earlier turns) takes
    the slot holding it: cached_tokens counts the reused rows and the backend computes
    only the rest, and the output is the same as computed from scratch."""
    with apir.load(tiny, backend="local", device="cpu") as model:
        first = model.tokenize("You are a helpful assistant. " * 3)
        second = first + model.tokenize("What now?", add_bos=False)
        params = SamplingParams(temperature=0, max_tokens=4)
        expected = list(model.generate_ids(second, params))
        scheduler = Scheduler(model, slots=2, max_queue=2)
        try:
            list(scheduler.generate(first, params))
            before = scheduler.computed_tokens
            done = threading.Event()
            got: list[int] = []
            request = Request(second, params, lambda t: got.append(t) or True, lambda r: done.set())
            scheduler.submit(request)
            assert done.wait(WAIT)
            assert got == expected
            assert request.cached_tokens == len(first)
            # the rest of the prompt, then one token per step but the last (never fed)
            assert scheduler.computed_tokens - before == len(second) - len(first) + len(got) - 1
        finally:
            scheduler.close()


def test_cancel_frees_the_slot_and_a_full_queue_refuses(tiny):
    with apir.load(tiny, backend="local", device="cpu") as model:
        scheduler = Scheduler(model, slots=1, max_queue=1)
        try:
            # hold the scheduler's thread, so what is queued stays queued
            release, held = threading.Event(), threading.Event()
            scheduler.call(lambda: held.set() or release.wait(WAIT))
            assert held.wait(WAIT)
            ends: list[str] = []
            ended = threading.Condition()

            def end(reason: str) -> None:
                with ended:
                    ends.append(reason)
                    ended.notify_all()

            params = SamplingParams(temperature=0, max_tokens=100)
            first, go = threading.Event(), threading.Event()
            # the running one holds the thread in its first token until cancelled
            running = Request(model.tokenize("a long one"), params,
                              lambda t: first.set() or go.wait(WAIT), end)
            queued = Request(model.tokenize("next"), params, lambda t: True, end)
            scheduler.submit(running)
            scheduler.submit(queued)
            with pytest.raises(QueueFull, match="all 1 slots are busy"):
                scheduler.submit(Request([1, 2], params, lambda t: True, end))
            queued.cancel()  # cancelled while waiting: ends without running
            release.set()
            assert first.wait(WAIT)
            assert scheduler.busy == 1
            running.cancel()
            go.set()
            with ended:
                assert ended.wait_for(lambda: len(ends) == 2, WAIT)
            assert ends == ["cancelled", "cancelled"]
            assert scheduler.busy == 0 and scheduler.queued == 0
        finally:
            scheduler.close()


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_many_requests_do_not_grow_memory(tiny):
    """200 requests, 8 at a time over 4 slots (some cancelled mid-way): the process's
    resident memory after them is within 5% of what it was after the first 40."""
    with apir.load(tiny, backend="local", device="cpu") as model:
        scheduler = Scheduler(model, slots=4, max_queue=8)
        try:
            def wave(seed: int) -> None:
                done = threading.Semaphore(0)
                requests = [Request([seed % 200 + 1, i + 1, 7], SamplingParams(temperature=0.8, seed=i, max_tokens=6),
                                    lambda t: True, lambda r: done.release()) for i in range(8)]
                for r in requests:
                    scheduler.submit(r)
                requests[seed % 8].cancel()
                for _ in requests:
                    assert done.acquire(timeout=WAIT)

            for i in range(5):
                wave(i)
            before = _rss()
            for i in range(5, 25):
                wave(i)
            assert _rss() <= before * 1.05
            assert scheduler.busy == 0
        finally:
            scheduler.close()


def test_bench_serve_reports_every_round():
    """``apir bench serve`` on a synthetic model (no tokenizer: no stream ends early)."""
    from apir.bench.backends import BackendOptions
    from apir.bench.runner import Source
    from apir.bench.serve import run as run_serve

    logged: list[str] = []
    table = run_serve(Source("llama-tiny", synthetic=True), ["native"], BackendOptions(device="cpu"),
                      [1, 3], n_prompt=8, n_gen=5, log=logged.append)
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:4]]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [("native", 1), ("native", 3)]
    assert all(float(r[i].replace(",", "")) > 0 for r in rows for i in (2, 3, 4, 5, 6))
    assert "solo (single-sequence path, tg5): native" in table and len(logged) == 4
    assert logged[0].startswith("native: 3 slots ready in ")


def test_all_decoding_rate_counts_only_the_span_where_every_stream_decodes():
    from apir.bench.serve import all_decoding_rate

    # stream a decodes at 0, 1, .. 10 s; b starts at 4 s and ends at 8 s: the span is
    # (4, 8], where a makes 4 tokens (5, 6, 7, 8) and b 2 (6, 8)
    a, b = [float(t) for t in range(11)], [4.0, 6.0, 8.0]
    assert all_decoding_rate([a, b]) == 6 / 4
    assert all_decoding_rate([a]) == 10 / 10  # one stream: its own decode rate
    assert all_decoding_rate([[0.0, 1.0], [2.0, 3.0]]) == 0.0  # never both at once
    assert all_decoding_rate([a, [5.0]]) == 0.0  # a stream of one token decodes nothing


def test_bench_serve_shared_prefix_finds_the_prefix_cached():
    from apir.bench.backends import BackendOptions
    from apir.bench.runner import Source
    from apir.bench.serve import SUFFIX
    from apir.bench.serve import run as run_serve

    table = run_serve(Source("llama-tiny", synthetic=True), ["native"], BackendOptions(device="cpu"),
                      [1], n_prompt=8, n_gen=3, log=lambda line: None, shared_prefix=40)
    head, rule, row = table.splitlines()[-3:]
    assert head.startswith("| backend | shared prefix | TTFT first ms")
    cells = [c.strip() for c in row.split("|")[1:-1]]
    # the second prompt's own SUFFIX tokens (its first differs from the first prompt's with
    # probability 1 - 1/vocab) are computed; the 40 shared ones are found in the slot
    assert cells[0] == "native" and int(cells[1]) == 40 and int(cells[5]) >= 40
    assert int(cells[5]) < 40 + SUFFIX


# ---------------------------------------------------------------- apir serve --parallel


@pytest.fixture(scope="module")
def two_slot_server(tmp_path_factory):
    """``apir serve --parallel 2 --max-queue 0`` of a tiny model with room for long
    generations: two running requests fill it."""
    pytest.importorskip("uvicorn")
    tmp = tmp_path_factory.mktemp("serve")
    path = write_tiny_gguf(tmp / "tiny.gguf", TinyConfig(context_length=4096, endless=True), "F16")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("APIR_")}
    log = tmp / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "apir.cli", "serve", "-m", str(path), "--backend", "local",
             "--device", "cpu", "--port", str(port), "--parallel", "2", "--max-queue", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # a guard against a hang, not a bound on speed
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gauges(base: str) -> dict[str, float]:
    lines = httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and line[0] != "#")}


def _wait_for(base: str, want: Callable[[dict], bool]) -> dict:
    deadline = time.monotonic() + WAIT
    while not want(gauges := _gauges(base)):
        assert time.monotonic() < deadline, gauges
        time.sleep(0.05)
    return gauges


def test_full_server_says_429_and_a_hung_up_stream_frees_its_slot(two_slot_server):
    base = two_slot_server
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "stream": True}
    readers = []  # each stream's line iterator, kept: dropping one closes its connection
    with contextlib.ExitStack() as streams:
        for _ in range(2):
            r = streams.enter_context(httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=WAIT))
            assert r.status_code == 200
            readers.append(r.iter_lines())
            for line in readers[-1]:
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # it runs
        assert _gauges(base)["apir_slots_busy"] == 2
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=WAIT)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "all 2 slots are busy" in refused.json()["error"]["message"]
        readers.clear()
    # both hung up mid-stream (4,000 tokens take far longer than noticing that)
    gauges = _wait_for(base, lambda g: g["apir_slots_busy"] == 0)
    assert gauges["apir_generations_cancelled_total"] == 2 and gauges["apir_slots"] == 2


def test_served_prompt_reuses_a_cached_prefix(two_slot_server):
    base = two_slot_server
    first = "You are a terse assistant. Answer in one word. "
    a = httpx.post(f"{base}/v1/completions", json={"prompt": first, "max_tokens": 3, "temperature": 0},
                   timeout=WAIT).json()
    b = httpx.post(f"{base}/v1/completions", json={"prompt": first + "Sky color?", "max_tokens": 3,
                                                    "temperature": 0}, timeout=WAIT).json()
    cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert a["usage"]["prompt_tokens"] <= cached < b["usage"]["prompt_tokens"]
