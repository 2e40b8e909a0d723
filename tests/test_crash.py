"""Crash behaviour: guests killed at every stage give all their memory back; a killed
worker costs only its own guest; eight guests soak one daemon.

Every test prints how long things took (run with ``-s`` to see it); none asserts a speed,
only that each release happens (a 2-core CI machine can be slow). Longer runs:
``APIR_CRASH_ITERATIONS=200`` (kills per point, default 20) and ``APIR_SOAK_SECONDS=600``
(default 20). The figures from such runs are recorded in SECURITY.md.
"""

from __future__ import annotations

import json
import os
import select
import signal
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hosts import WAIT, start_host
from tiny_models import TinyConfig, write_tiny_gguf

import apir
from apir.backends.remote import HostGoneError, RemoteBackend
from apir.engine import SamplingParams
from apir.graph import DType, GraphBuilder, T
from apir.protocol import messages as m

ITERATIONS = int(os.environ.get("APIR_CRASH_ITERATIONS", "20"))
SOAK_SECONDS = float(os.environ.get("APIR_SOAK_SECONDS", "20"))
MAX_MEMORY = 64 << 20


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    h = start_host(tmp_path_factory.mktemp("crash"), "--max-memory", "64M", "--max-sessions", "12")
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return str(write_tiny_gguf(path, TinyConfig(context_length=512), "F16", seed=3))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def gone(pid: int) -> bool:
    """Exited and reaped by the daemon: not even a zombie left."""
    return not os.path.exists(f"/proc/{pid}")


def released(host, seen: set[int], timeout: float = WAIT) -> float:
    """Seconds until the daemon lists no session and every worker pid seen is gone (a
    figure to print; ``timeout`` only bounds a hang)."""
    t0 = time.monotonic()
    while True:
        sessions = host.status().sessions
        seen.update(s.pid for s in sessions)
        if not sessions and all(gone(p) for p in seen):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not released after {timeout}s: {sessions}")
        time.sleep(0.005)


# ---------------------------------------------------------------- guests to kill


def at_handshake(host, ready, i: int) -> None:
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.connect(host.unix.removeprefix("unix://"))
    hello = m.encode(m.Hello(m.PROTOCOL_VERSION, m.op_table_hash(), "", "doomed", 1 << 20), 1, 1)
    s.sendall(hello if i % 2 else hello[:20])  # a whole Hello, or half of one
    ready()
    time.sleep(60)


def mid_upload(host, ready, i: int) -> None:
    be = RemoteBackend(host.unix)
    h = be.alloc_buffer(48 << 20, 0)
    chunk = np.full(4 << 20, i % 251, np.uint8)
    n = 0
    while True:
        be.set_tensor(h, (n % 12) * chunk.nbytes, chunk)
        n += 1
        if n == 2:
            be.synchronize()  # the session surely exists now
            ready()


def mid_compute(host, ready, i: int, tiny: str = "") -> None:
    model = apir.load(tiny, backend="remote", remote=host.unix)
    ids = model.tokenize("Once upon a time")
    first = True
    while True:
        model.logits(ids)
        if first:
            ready()
            first = False
        list(model.generate_ids(ids, SamplingParams(temperature=0, max_tokens=32)))


def holding_quota(host, ready, i: int) -> None:
    be = RemoteBackend(host.unix)
    h = be.alloc_buffer(MAX_MEMORY - (8 << 20), 0)  # most of the quota, every byte written
    be.set_tensor(h, 0, np.full(MAX_MEMORY - (8 << 20), 7, np.uint8))
    be.synchronize()
    ready()
    time.sleep(60)


def spawn(fn, *args) -> tuple[int, int]:
    """Fork a guest running ``fn``; returns (pid, fd that becomes readable when it is ready)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the guest: never returns into pytest
        code = 0
        try:
            os.close(r)
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            fn(*args[:1], lambda: os.write(w, b"!"), *args[1:])
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


POINTS = {"handshake": at_handshake, "upload": mid_upload, "compute": mid_compute, "quota": holding_quota}


def test_killed_guests_release_everything(host, tiny):
    host.wait_idle()
    released(host, set())
    rss0 = rss_kib(host.proc.pid)
    figures: dict[str, list[float]] = {}
    rng = np.random.default_rng(0)
    for name, fn in POINTS.items():
        times = figures.setdefault(name, [])
        for i in range(ITERATIONS):
            args = (host, i, tiny) if fn is mid_compute else (host, i)
            pid, ready = spawn(fn, *args)
            ok, _, _ = select.select([ready], [], [], 60)
            assert ok and os.read(ready, 1) == b"!", f"{name}: the guest never got ready"
            os.close(ready)
            seen = {s.pid for s in host.status().sessions}
            if name != "handshake":
                assert len(seen) == 1
                if name == "quota":
                    assert host.status().sessions[0].allocated == MAX_MEMORY - (8 << 20)
            time.sleep(float(rng.uniform(0, 0.05)))  # land at a different moment each time
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            times.append(released(host, seen))
    rss1 = rss_kib(host.proc.pid)
    print(f"\nkilled {ITERATIONS} guests at each of {len(POINTS)} points; release time (s):")
    for name, times in figures.items():
        print(f"  {name:9s} max {max(times):.3f}  median {statistics.median(times):.3f}")
    print(f"  daemon RSS {rss0 / 1024:.1f} MiB -> {rss1 / 1024:.1f} MiB over {ITERATIONS * len(POINTS)} kills")
    assert rss1 - rss0 < 8 * 1024, "the daemon's memory grows with every killed guest"
    assert host.proc.poll() is None


def _matmul_graph(be, n: int = 384, depth: int = 6):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    h = be.alloc_buffer(w.nbytes)
    be.set_tensor(h, 0, w)
    g = GraphBuilder()
    x = g.input("x", (T, n))
    y = x
    for _ in range(depth):
        y = g.matmul(y, g.weight(h, 0, (n, n), DType.F32))
    gid = be.register_graph(g.build(y))

    def want(x):
        for _ in range(depth):
            x = x @ w.T
        return x

    return gid, want


def _hammer(be, gid, x, started: threading.Event, failure: list) -> None:
    """Compute back to back until the host goes away; record when and how."""
    try:
        while True:
            be.compute(gid, {"x": x})
            started.set()
    except BaseException as e:  # noqa: BLE001
        failure.append((time.monotonic(), e))
        started.set()


def test_killed_worker_fails_only_its_guest(host):
    host.wait_idle()
    daemon_pid = host.proc.pid
    delays = []
    for round_ in range(5):
        victim, bystander = RemoteBackend(host.unix), RemoteBackend(host.unix)
        gid_v, _ = _matmul_graph(victim)
        gid_b, want = _matmul_graph(bystander)
        x = np.random.default_rng(round_).standard_normal((256, 384)).astype(np.float32)
        failure: list[tuple[float, BaseException]] = []
        started = threading.Event()

        t = threading.Thread(target=_hammer, args=(victim, gid_v, x, started, failure), daemon=True)
        t.start()
        assert started.wait(WAIT)
        worker = next(s.pid for s in host.status().sessions if s.session == victim.session)
        time.sleep(0.02)  # mid-request: the victim computes back to back
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        for _ in range(10):  # meanwhile the other guest carries on, with right answers
            (out,) = bystander.compute(gid_b, {"x": x})
            np.testing.assert_allclose(out, want(x), rtol=2e-4, atol=2e-4)
        t.join(WAIT)
        assert failure, "the victim's guest saw no error"
        when, exc = failure[0]
        assert isinstance(exc, HostGoneError) and "went away during Compute" in str(exc), exc
        delays.append(when - killed)
        # reaped, and nothing restarted in its place
        left = [bystander.session]
        host.until(lambda st, left=left: [s.session for s in st.sessions] == left, "the victim reaped")
        bystander.close()
        victim.close()
        assert host.proc.pid == daemon_pid and host.proc.poll() is None
    print(f"\nkilled worker -> guest error in max {max(delays) * 1000:.0f} ms "
          f"(median {statistics.median(delays) * 1000:.0f} ms) over {len(delays)} kills; bystanders unaffected")
    assert host.wait_idle().sessions == ()
    assert "worker died (signal 9)" in host.log.read_text()


PROMPTS = ["Hello, world!", "Once upon a time", "The quick brown fox", "apir runs graphs",
           "Tell me a story.", "1 2 3 4 5", "What is remoting?", "Goodbye!"]


def _soak_guest(host, tiny: str, expected: dict[str, str], up: int, stop: int, i: int) -> dict:
    """One guest process: says so on ``up`` once it has its first answer (or failed), then
    generates until ``stop`` is closed, checking every answer."""
    count, errors = 0, []
    try:
        with apir.load(tiny, backend="remote", remote=host.unix) as model:
            while count == 0 or not select.select([stop], [], [], 0)[0]:
                prompt = PROMPTS[(i + count) % len(PROMPTS)]
                got = model.generate(prompt, temperature=0, max_tokens=24)
                if got != expected[prompt]:
                    errors.append(f"guest {i}: {prompt!r} -> {got!r}, want {expected[prompt]!r}")
                count += 1
                if count == 1:
                    os.write(up, b"!")
    except Exception as e:  # noqa: BLE001
        errors.append(f"guest {i}: {type(e).__name__}: {e}")
        if count == 0:
            os.write(up, b"!")
    return {"count": count, "errors": errors[:5], "n_errors": len(errors)}


def test_soak_eight_guests(host, tiny):
    """Eight guest processes generate against one daemon, all at once for SOAK_SECONDS;
    every answer must equal the local backend's, and the daemon must end where it started."""
    host.wait_idle()
    with apir.load(tiny, backend="local", device="cpu") as local:
        expected = {p: local.generate(p, temperature=0, max_tokens=24) for p in PROMPTS}
    # one guest first so the daemon's lazily-built state exists before the baseline
    with apir.load(tiny, backend="remote", remote=host.unix) as warm:
        assert warm.generate(PROMPTS[0], temperature=0, max_tokens=24) == expected[PROMPTS[0]]
    host.wait_idle()
    rss0 = rss_kib(host.proc.pid)
    up_r, up_w = os.pipe()
    stop_r, stop_w = os.pipe()  # closed by the test: the guests stop
    guests = []
    for i in range(8):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a guest process: never returns into pytest
            try:
                os.close(r)
                os.close(stop_w)
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
                os.write(w, json.dumps(_soak_guest(host, tiny, expected, up_w, stop_r, i)).encode())
            finally:
                os._exit(0)
        os.close(w)
        guests.append((pid, r))
    os.close(up_w)
    try:
        up, deadline = 0, time.monotonic() + WAIT
        while up < 8:
            assert select.select([up_r], [], [], max(deadline - time.monotonic(), 0))[0], f"{up} of 8 guests up"
            up += len(os.read(up_r, 8))
        sessions = len(host.status().sessions)  # each guest holds its session until stopped
        t0 = time.monotonic()
        time.sleep(SOAK_SECONDS)
    finally:
        os.close(stop_w)
    results = []
    for pid, r in guests:
        os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            text = f.read()
        results.append(json.loads(text) if text else {"count": 0, "errors": ["died"], "n_errors": 1})
    elapsed = time.monotonic() - t0
    os.close(up_r)
    os.close(stop_r)
    after = host.wait_idle()
    rss1 = rss_kib(host.proc.pid)
    counts = [res["count"] for res in results]
    errors = [e for res in results for e in res["errors"]]
    n_errors = sum(res["n_errors"] for res in results)
    print(f"\nsoak: 8 guest processes x {SOAK_SECONDS:.0f}s: {sum(counts)} generations of 24 tokens "
          f"({sum(counts) * 24 / elapsed:.0f} tok/s total, per guest {counts}), {n_errors} errors, "
          f"{sessions} sessions at once; daemon RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB")
    assert n_errors == 0, errors
    assert min(counts) > 0 and sessions == 8
    assert after.sessions == ()  # every session's memory accounted back to zero
    assert rss1 - rss0 < 8 * 1024
