"""The backstops behind accounting: each worker's OS memory limit and the per-request
compute time limit (``--max-compute-seconds``), against a real daemon.

The daemon here runs in a forked child with a HostConfig that sets the worker's OS cap
(``os_memory``) far below ``--max-memory``, standing in for an accounting slip: what
accounting lets through, the OS still stops, and the guest gets a QUOTA error while
other sessions keep working.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from rawguest import RawGuest
from test_hostile import expect, graph, leaf, step, x_input
from test_quota import released  # noqa: F401 - every session ends with its test

from apir.backends.remote import RemoteBackend, host_status
from apir.graph import DType, GraphBuilder, Node, Op, T
from apir.host import daemon
from apir.protocol import messages as m
from apir.transport import parse_address

E = m.ErrorCode


class Forked:
    """A daemon in a forked child, for HostConfig fields no flag sets."""

    def __init__(self, tmp, **config) -> None:
        self.unix = f"unix://{tmp / 'apir.sock'}"
        cfg = daemon.HostConfig((parse_address(self.unix),), device="cpu", **config)
        self.pid = os.fork()
        if self.pid == 0:
            try:
                daemon.run(cfg)
            finally:
                os._exit(0)
        deadline = time.monotonic() + 30
        while True:
            try:
                host_status(self.unix)
                return
            except Exception:  # noqa: BLE001 - not listening yet
                assert time.monotonic() < deadline, "the forked daemon did not come up"
                time.sleep(0.1)

    @property
    def proc(self):
        return self

    def poll(self):
        return None if os.waitpid(self.pid, os.WNOHANG) == (0, 0) else 1

    def wait_idle(self, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while (st := host_status(self.unix)).sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        return st

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGTERM)
        os.waitpid(self.pid, 0)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    h = Forked(tmp_path_factory.mktemp("oslimit"), max_memory=16 << 30, os_memory=64 << 20)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    h = Forked(tmp_path_factory.mktemp("timed"), max_memory=1 << 30, max_compute_seconds=0.25)
    yield h
    h.stop()


def computes_correctly(host) -> None:
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((16, 32)).astype(np.float32), rng.standard_normal((3, 32)).astype(np.float32)
    with RemoteBackend(host.unix, timeout=20) as be:
        h = be.alloc_buffer(w.nbytes)
        be.set_tensor(h, 0, w)
        g = GraphBuilder()
        (out,) = be.compute(be.register_graph(g.build(g.matmul(g.input("x", (T, 32)),
                                                               g.weight(h, 0, (16, 32), DType.F32)))), {"x": x})
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


def test_the_os_stops_what_accounting_lets_through(host):
    """2 GiB is within this session's 16 GiB --max-memory but not its 64 MiB OS cap (plus
    its threads' stacks, 8 MiB a thread): the allocation, and a compute's 2 GiB
    intermediate, fail as QUOTA errors naming the limit; the session and another one keep
    working."""
    with RawGuest(host.unix) as g, RawGuest(host.unix) as other:
        expect(g.error(m.AllocBuffer(1, 2 << 30, 0)), E.QUOTA, f"cannot allocate {2 << 30} bytes",
               "OS memory limit (set from --max-memory)")
        a, b = x_input((T, 1), name="a"), x_input((1, 65536), name="b")
        wide = Node(Op.ADD, (0, 1), (), (T, 65536), DType.F32)
        g.ok(m.RegisterGraph(1, graph(a, b, wide, Node(Op.ARGMAX, (2,), (), (T,), DType.I32))))
        ones = np.ones((1, 65536), np.float32)
        expect(g.error(step(1, np.ones((8192, 1), np.float32), ones)), E.QUOTA,
               "ran out of memory", "OS memory limit (set from --max-memory)")
        assert g.ok(step(1, np.ones((4, 1), np.float32), ones)).data.size == 16  # still serving
        other.ok(m.AllocBuffer(1, 1 << 20, 0))
        computes_correctly(host)


def test_a_compute_past_the_time_limit_ends_its_session_only(timed):
    """A chain of 100 1024x1024 products (200 GFLOP) runs for seconds; the limit is a
    quarter second."""
    host = timed
    x, w = x_input((1024, 1024)), leaf(Op.WEIGHT, (1, 0), (1024, 1024))
    nodes = [x, w] + [Node(Op.MATMUL, (i, 1), (), (1024, 1024), DType.F32) for i in [0, *range(2, 101)]]
    with RawGuest(host.unix) as g, RawGuest(host.unix) as other:
        other.ok(m.AllocBuffer(1, 64, 0))
        g.ok(m.AllocBuffer(1, 4 << 20, 0))
        g.ok(m.RegisterGraph(2, graph(*nodes)))
        expect(g.error(step(2, np.ones((1024, 1024), np.float32), n_tokens=0)), E.QUOTA,
               "compute time limit (0.25 s, --max-compute-seconds)", "the session is closed")
        assert g.closed_by_host()
        assert isinstance(other.ok(m.Synchronize()), m.Ok)
        computes_correctly(host)
    assert host.wait_idle().sessions == ()


def test_a_worker_gets_a_cgroup_where_the_host_has_one(tmp_path, monkeypatch):
    """On a cgroup v2 host whose daemon's parent cgroup is ours to divide, a worker moves
    into a cgroup of its own with memory.max set (here a directory standing in for the
    hierarchy, in a forked child: the cap is set on the calling process); the daemon reads
    whether the kernel killed it there, and removes it."""
    from apir.host import worker

    (tmp_path / "cgroup.controllers").write_text("memory\n")
    (tmp_path / "svc" / "apir").mkdir(parents=True)
    monkeypatch.setattr(worker, "CGROUP", tmp_path)
    monkeypatch.setattr(worker, "own_cgroup", lambda: "/svc/apir")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            cap = worker.os_memory_cap(300 << 20, "cpu", 7)
            code = 0 if cap == f"cgroup memory.max {300 << 20} bytes, RLIMIT_DATA {300 << 20} bytes past its start" else 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    group = tmp_path / "svc" / f"apir-{os.getpid()}-session-7"
    assert (group / "memory.max").read_text() == f"{300 << 20}\n"
    assert (group / "cgroup.procs").read_text() == f"{pid}\n"
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert worker.release_cgroup(7)
    (group / "memory.events").write_text("oom_kill 0\n")
    assert not worker.release_cgroup(7)
    assert not worker.release_cgroup(8)  # none made
    monkeypatch.setattr(worker, "own_cgroup", lambda: "/")
    assert worker.session_cgroup(7) is None  # the root (a container's, here): never divided


def test_max_memory_defaults_to_a_share_of_the_free_memory(tmp_path):
    """Without --max-memory a daemon caps each session at the free memory divided by
    --max-sessions (here 4), and says so in its help."""
    import subprocess
    import sys

    from hosts import start_host

    help_text = subprocess.run([sys.executable, "-m", "apir.cli", "host", "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "divided by --max-sessions" in " ".join(help_text.split())
    assert "--max-compute-seconds" in help_text
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    h = start_host(tmp_path, "--max-sessions", "4")
    try:
        assert 0 < h.status().max_memory <= total // 4
    finally:
        h.stop()


def test_the_cap_leaves_room_for_torchs_threads():
    """Thread stacks are private writable mappings, counted by RLIMIT_DATA: 32 intra-op
    threads' 8 MiB stacks are 256 MiB, four times this cap, and must still start (in a
    fresh interpreter: OpenMP's pool does not survive a fork)."""
    import subprocess
    import sys

    code = ("import torch; torch.set_num_threads(32)\n"
            "from apir.host.worker import os_memory_cap\n"
            "print(os_memory_cap(64 << 20, 'cpu', 1))\n"
            "a = torch.ones(1024, 1024); print(float((a @ a)[0, 0]))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:2] == [f"RLIMIT_DATA {64 << 20} bytes past its start", "1024.0"]


def test_a_worker_killed_at_its_cgroup_limit_tells_its_guest_why(tmp_path, monkeypatch):
    """Where workers have cgroups, the kernel kills one past its memory.max; the daemon
    sees the kill in the cgroup's memory.events and leaves the guest a QUOTA error on its
    socket, read as the reply (socket sessions) or when the rings go quiet (ring
    sessions). Here a stand-in cgroup that always reports a kill; another session goes on."""
    from apir.backends import QuotaError

    monkeypatch.setattr(daemon, "session_cgroup", lambda session, pid=None: tmp_path)
    monkeypatch.setattr(daemon, "release_cgroup", lambda session: True)
    h = Forked(tmp_path, max_memory=64 << 20)
    try:
        with RemoteBackend(h.unix, timeout=20) as rings, \
                RemoteBackend(h.unix, timeout=20, arena_size=0) as frames, RawGuest(h.unix) as other:
            assert rings.arena is not None and frames.arena is None
            pids = {s.session: s.pid for s in host_status(h.unix).sessions}
            for be in (rings, frames):
                os.kill(pids[be.session], signal.SIGKILL)
                with pytest.raises(QuotaError, match=f"session {be.session} was killed by the host's "
                                   r"kernel: .* \(--max-memory 67108864 bytes plus headroom\)"):
                    be.alloc_buffer(64)  # sent without a reply...
                    be.synchronize()  # ...so this one waits for the host
            assert isinstance(other.ok(m.Synchronize()), m.Ok)
        assert h.wait_idle().sessions == ()
    finally:
        h.stop()
