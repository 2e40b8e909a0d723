"""Published models held by a holder process (``apir.host.holder``), what a CUDA host does:
one copy per model on the device, made by a process that runs no session and exported to
every session's worker. Here on a CPU: the daemon runs with a stand-in for CUDA IPC
(``fake_holder``, tests only: a memfd each worker maps read-only), so everything but the
device transport is the product's — the holder's process and lifetime, the daemon's books,
the grants and their refusals, the packed table, the liveness pipe. The packing the holder
does on a GPU is checked against the executor's own on CPU tensors; tests/test_gpu_holder.py
runs the whole on CUDA."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from types import SimpleNamespace

import fake_holder
import gguf
import numpy as np
import pytest
from hosts import WAIT, check_published_read_only, running, until
from test_warm import PROMPT, _ids
from tiny_models import TinyConfig, write_tiny_gguf

import apir
from apir.backends.base import BackendError
from apir.backends.remote import HostGoneError, RemoteBackend, RemoteError
from apir.cli import main
from apir.engine import SamplingParams
from apir.graph import DType
from apir.host import holder
from apir.host.published import WAIT as WAIT_REPLY
from apir.host.published import PublishedModel, Shelf, request
from apir.models.gguf_file import GGUFFile
from apir.models.layout import layout_digest, weight_slots
from apir.protocol import messages as m

KEEP_ALIVE = 1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinyConfig(context_length=256),
                               "Q8_0", seed=7))


@pytest.fixture(scope="module")
def layout(tiny) -> tuple[bytes, int]:
    slots, size = weight_slots(GGUFFile(tiny).tensors.values())
    return layout_digest(slots), size


@pytest.fixture(scope="module")
def expected(tiny) -> list[int]:
    with apir.load(tiny, backend="local", device="cpu") as local:
        return _ids(local)


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny):
    h = fake_holder.start(tmp_path_factory.mktemp("held"), "--model", tiny, "--keep-alive", str(KEEP_ALIVE))
    yield h
    h.stop()


# ---------------------------------------------------------------- through a daemon


def test_sessions_share_the_holders_one_copy_which_ends_after_keep_alive(host, tiny, layout, expected, tmp_path,
                                                                        capsys):
    host.until(lambda st: not st.sessions and not st.shared_bytes, "an idle host")
    loads, started = host.status().shared_loads, len(host.holders())
    own = shutil.copy(tiny, tmp_path / "unpublished.gguf")  # same tensors, a name not published
    with apir.load(tiny, backend="remote", remote=host.unix) as first, \
            apir.load(tiny, backend="remote", remote=host.unix) as second, \
            apir.load(own, backend="remote", remote=host.unix) as uploader:
        assert _ids(first) == _ids(second) == _ids(uploader) == expected
        st = host.status()
        assert st.shared_loads == loads + 1 and len(host.holders()) == started + 1  # one holder, once
        assert st.shared_bytes == layout[1]  # its one copy, counted once beside the sessions
        assert st.shared == (m.SharedInfo("tiny", "cpu", layout[1], 2),)  # held on the "device", used twice
        assert main(["host", "status", "--listen", host.unix]) == 0  # what the operator reads
        assert json.loads(capsys.readouterr().out)["published"]["copies"] == [
            {"model": "tiny", "where": "cpu", "bytes": layout[1], "sessions": 2}]
        # the sharing sessions hold what the uploader holds but the weights (each makes its
        # own int8 forms, as on any CPU host)
        assert host.allocated(uploader) - host.allocated(first) == layout[1]
        assert host.allocated(first) == host.allocated(second)
        pid = host.holders()[-1]
        assert running(pid) and pid not in {s.pid for s in st.sessions}  # it runs no session
    st = host.until(lambda st: not st.sessions, "sessions ended")
    assert running(pid)  # kept alive for --keep-alive seconds after the last session
    assert st.shared in ((m.SharedInfo("tiny", "cpu", layout[1], 0),), ())  # idle (or unloaded already)
    host.until(lambda st: st.shared_bytes == 0, "the copy unloaded after --keep-alive")
    until(lambda: not running(pid), "the holder ended")
    assert "published model tiny unloaded from cpu: unused for 1s" in host.log.read_text()
    with apir.load(tiny, backend="remote", remote=host.unix) as again:  # a new holder, loaded anew
        assert _ids(again) == expected
        assert host.status().shared_loads == loads + 2 and len(host.holders()) == started + 2


def test_a_held_copy_is_refused_clearly_where_it_does_not_fit(host, layout):
    with RemoteBackend(host.unix) as b:
        with pytest.raises(BackendError, match=r"publishes no model named 'secret' \(published: tiny\)"):
            b.open_published("secret", *layout)
        with pytest.raises(BackendError, match="not laid out as this guest's file"):
            b.open_published("tiny", b"\0" * 32, layout[1])
        with pytest.raises(BackendError, match="not laid out as this guest's file"):
            b.open_published("tiny", layout[0], layout[1] + 32)
        with pytest.raises(BackendError, match="not a model name"):
            b.open_published("../etc/passwd", *layout)
        handle = b.open_published("tiny", *layout)  # the session goes on after refusals
        assert len(b.get_tensor(handle, 0, 64)) == 64


def test_a_held_copy_is_read_only(host, layout):
    check_published_read_only(host, layout, 4096)


def test_a_killed_worker_leaves_the_holder_and_the_other_sessions(host, tiny, expected):
    """The victim is killed while the bystander's decode is half done, on the same copy."""
    with apir.load(tiny, backend="remote", remote=host.unix) as bystander, \
            apir.load(tiny, backend="remote", remote=host.unix) as victim:
        pid, resident = host.holders()[-1], host.status().shared_bytes
        steps = bystander.generate_ids(bystander.tokenize(PROMPT), SamplingParams(temperature=0, max_tokens=12))
        first = [next(steps) for _ in range(6)]
        workers = {s.session: s.pid for s in host.status().sessions}
        os.kill(workers[victim.backend.session], signal.SIGKILL)
        with pytest.raises(HostGoneError):
            _ids(victim)
        st = host.until(lambda st: [s.session for s in st.sessions] == [bystander.backend.session],
                        "only the bystander's session left")
        assert st.shared_bytes == resident and running(pid)  # the copy outlives the worker
        assert first + list(steps) == expected
        assert _ids(bystander) == expected
    assert host.proc.poll() is None


def test_a_dead_holder_ends_its_sessions_with_an_error_that_says_so(host, tiny, expected, tmp_path):
    own = shutil.copy(tiny, tmp_path / "unpublished.gguf")
    with apir.load(tiny, backend="remote", remote=host.unix) as a, \
            apir.load(tiny, backend="remote", remote=host.unix) as b, \
            apir.load(own, backend="remote", remote=host.unix) as uploader:
        assert _ids(a) == expected
        loads, pid = host.status().shared_loads, host.holders()[-1]
        os.kill(pid, signal.SIGKILL)
        # Reaped, so its liveness pipe has hung up: a CUDA process takes a while to exit,
        # and a request read before that still finds the holder's memory mapped.
        until(lambda: f"holder pid {pid} was killed (signal 9)" in host.log.read_text(), "the holder reaped")
        for model in (a, b):  # idle when it died: told at their next request
            with pytest.raises((RemoteError, HostGoneError), match="published model 'tiny' on its GPU went away"):
                _ids(model)
        host.until(lambda st: [s.session for s in st.sessions] == [uploader.backend.session],
                   "the two sessions of the held copy ended")
        assert _ids(uploader) == expected  # a session of its own weights goes on
        assert host.status().shared_bytes == 0
        log = host.log.read_text()
        assert f"its holder (pid {pid}) on cpu is gone: it ended while 2 session(s) used the copy" in log
        assert f"holder pid {pid} was killed (signal 9)" in log
    with apir.load(tiny, backend="remote", remote=host.unix) as again:  # a new holder
        assert _ids(again) == expected
        assert host.status().shared_loads == loads + 1
    assert host.proc.poll() is None


def test_keep_alive_negative_starts_the_holder_with_the_daemon(tmp_path, tiny, layout, expected):
    h = fake_holder.start(tmp_path, "--model", tiny, "--keep-alive", "-1")
    try:  # before any guest
        h.until(lambda st: st.shared_bytes == layout[1] and st.shared_loads == 1, "the copy loaded at start")
        pid = h.holders()[0]
        with apir.load(tiny, backend="remote", remote=h.unix) as model:
            assert _ids(model) == expected
        h.until(lambda st: not st.sessions, "the session ended")
        time.sleep(1.0)
        assert h.status().shared_bytes == layout[1] and running(pid) and h.status().shared_loads == 1
    finally:
        h.stop()
    until(lambda: not running(pid), "the holder ended with its daemon")


def test_sessions_wait_for_a_loading_holder_and_are_told(tmp_path, tiny, layout, expected):
    """Two guests arrive while the holder loads (2 s): one holder serves both, and each
    guest's stderr says what it waits for."""
    h = fake_holder.start(tmp_path, "--model", tiny, env={"FAKE_HOLDER_DELAY": "2"})
    notices: list[str] = []
    try:
        def open_one() -> None:
            with RemoteBackend(h.unix, on_notice=notices.append) as b:
                b.open_published("tiny", *layout)
                b.synchronize()

        threads = [threading.Thread(target=open_one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert notices == ["loading published model tiny onto the host's GPU (its first session there)"] * 2
        assert h.status().shared_loads == 1 and len(h.holders()) == 1
        with apir.load(tiny, backend="remote", remote=h.unix) as model:  # resident now: no wait
            assert _ids(model) == expected
        assert len(notices) == 2
    finally:
        h.stop()


def test_a_holder_that_cannot_load_is_a_clear_refusal_and_the_guest_uploads(tmp_path, tiny, layout, expected):
    h = fake_holder.start(tmp_path, "--model", tiny, env={"FAKE_HOLDER_FAIL": "1"})
    try:
        with RemoteBackend(h.unix, on_notice=lambda text: None) as b:
            with pytest.raises(BackendError, match="could not load its published model 'tiny' onto its GPU; "
                                                   "upload the weights instead"):
                b.open_published("tiny", *layout)
        with apir.load(tiny, backend="remote", remote=h.unix) as model:  # the engine uploads its own
            assert _ids(model) == expected
        log = h.log.read_text()
        assert "published model tiny could not be loaded onto cpu: out of device memory" in log
        assert "is gone: it could not load the model" in log
        assert h.proc.poll() is None and h.status().shared_bytes == 0
    finally:
        h.stop()


# ---------------------------------------------------------------- the daemon's books


class ScriptedHolder:
    """The test plays a holder: its end of the socketpair, and a process to own the pid."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["sleep", "60"])
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.spawned: list[holder.Holder] = []

    def spawn(self, model: PublishedModel, device: str) -> holder.Holder:
        alive, self.alive_w = os.pipe()
        self.ours.setblocking(False)
        h = holder.Holder(model.name, device, self.proc.pid, self.ours, alive, time.monotonic())
        self.spawned.append(h)
        return h

    def ready(self, size: int, digest: bytes) -> None:
        table = os.memfd_create("t")
        os.write(table, holder.table({}))
        extra = os.memfd_create("x")
        socket.send_fds(self.theirs, [holder.READY + holder._COPY.pack(size, digest) + b"export"], [table, extra])
        os.close(table)
        os.close(extra)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.theirs.close()


def _worker() -> tuple[socket.socket, socket.socket]:
    """(the daemon's end, the worker's end) of a worker's socketpair."""
    daemon, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    daemon.setblocking(False)
    worker.settimeout(5)
    return daemon, worker


def _reply(worker: socket.socket) -> tuple[bytes, list[int]]:
    data, fds, _, _ = socket.recv_fds(worker, 4096, 8)
    return data, fds


def test_the_books_of_a_holder(tiny, layout):
    """Who waits for a loading holder, who uses it, when it is told to end."""
    script = ScriptedHolder()
    shelf = Shelf((PublishedModel.parse(tiny),), keep_alive=10, device="cuda:0", spawn=script.spawn)
    want = request("tiny", layout[1], layout[0])
    try:
        d0, w0 = _worker()  # a guest whose file lays the model out otherwise: no holder is started
        assert shelf.answer(d0, 0, request("tiny", layout[1], b"\0" * 32))
        assert b"is not laid out as this guest's file" in _reply(w0)[0]
        assert shelf.answer(d0, 0, request("tiny", layout[1] + 32, layout[0]))
        assert b"is not laid out as this guest's file" in _reply(w0)[0]
        assert not script.spawned and shelf.loads == 0
        d1, w1 = _worker()
        d2, w2 = _worker()
        d3, w3 = _worker()
        assert shelf.answer(d1, 1, want) and _reply(w1) == (WAIT_REPLY, [])
        assert shelf.answer(d2, 2, want) and _reply(w2) == (WAIT_REPLY, [])
        assert shelf.answer(d3, 3, want) and _reply(w3) == (WAIT_REPLY, [])
        assert len(script.spawned) == 1 and shelf.loads == 1  # one holder for every waiter
        h = script.spawned[0]
        assert shelf.resident_bytes() == 0  # loading: nothing resident yet
        shelf.release(3, now=0.0)  # session 3's worker died while it waited
        script.ready(4096, b"d" * 32)
        shelf.holder_event(h)
        for w in (w1, w2):  # the waiters are granted: the table, the liveness pipe, the export's fd
            data, fds = _reply(w)
            assert data == holder.GRANT + holder._COPY.pack(4096, b"d" * 32) + b"export" and len(fds) == 3
            assert holder.read_table(os.pread(fds[0], 4096, 0), 4096) == {}
            for fd in fds:
                os.close(fd)
        w3.settimeout(0.2)
        with pytest.raises(TimeoutError):
            _reply(w3)  # nothing for a session that ended
        assert h.users == {1, 2} and shelf.resident_bytes() == 4096
        d4, w4 = _worker()  # a later session is granted at once
        assert shelf.answer(d4, 4, want) and _reply(w4)[0].startswith(holder.GRANT)
        for s in (1, 2, 4):
            shelf.release(s, now=100.0)
        shelf.expire(now=105.0)
        assert shelf.resident_bytes() == 4096  # within --keep-alive
        shelf.expire(now=110.0)
        assert shelf.resident_bytes() == 0 and not shelf.holders
        script.theirs.settimeout(5)
        assert script.theirs.recv(64) == b""  # the holder's EOF: it ends
        assert not shelf.answer(d1, 1, b"nonsense")  # not a request: not answered
        assert not shelf.answer(d1, 1, want[:40])  # cut short
        assert shelf.answer(d1, 1, request("other", *layout[::-1]))
        assert b"publishes no model named 'other' (published: tiny)" in _reply(w1)[0]
    finally:
        shelf.close()
        script.close()


def test_a_failing_or_dying_holder_in_the_books(tiny, layout):
    script = ScriptedHolder()
    shelf = Shelf((PublishedModel.parse(tiny),), keep_alive=10, device="cuda:0", spawn=script.spawn)
    want = request("tiny", layout[1], layout[0])
    try:
        d1, w1 = _worker()
        shelf.answer(d1, 1, want)
        assert _reply(w1) == (WAIT_REPLY, [])
        script.theirs.send(holder.FAIL + b"CUDA out of memory")
        shelf.holder_event(script.spawned[0])
        assert b"could not load its published model 'tiny' onto its GPU" in _reply(w1)[0]
        assert not shelf.holders and shelf.resident_bytes() == 0
        script.ours, script.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        shelf.answer(d1, 1, want)  # asked again: a new holder
        assert _reply(w1) == (WAIT_REPLY, []) and len(script.spawned) == 2 and shelf.loads == 2
        script.ready(4096, b"d" * 32)
        shelf.holder_event(script.spawned[1])
        for fd in _reply(w1)[1]:
            os.close(fd)
        script.theirs.close()  # the holder dies while session 1 uses it
        shelf.holder_event(script.spawned[1])
        assert not shelf.holders and shelf.resident_bytes() == 0
        assert shelf.reaped(script.proc.pid, 9) and not shelf.reaped(script.proc.pid, 9)
    finally:
        shelf.close()
        script.proc.kill()
        script.proc.wait()


# ---------------------------------------------------------------- the copy and the executor


def _all_block_types(path) -> str:
    """A GGUF of one (4, 256) weight of every block type the GPU kernels pack, random bytes
    (packing moves bits: their values never matter), between F32 and F16 tensors."""
    from apir.backends.local import qpack

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("first.f32", np.arange(96, dtype=np.float32))
    for qtype in sorted(qpack.TYPES):
        dtype = DType(qtype)
        rows = rng.integers(0, 256, (4, dtype.nbytes((1, 256))), np.uint8)
        w.add_tensor(f"w.{dtype.name}", rows, raw_dtype=gguf.GGMLQuantizationType(qtype))
        w.add_tensor(f"after.{dtype.name}", np.ones(3, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture
def cpu_transport(monkeypatch):
    monkeypatch.setattr(holder, "TRANSPORT", fake_holder.MemfdTransport())


def _node(handle: int, offset: int, t) -> SimpleNamespace:
    return SimpleNamespace(attrs=(handle, offset), dtype=t.dtype, shape=tuple(t.shape))


def test_the_holder_packs_every_weight_as_a_sessions_executor_would(tmp_path, cpu_transport):
    """The bytes the holder makes are what a GPU session's executor makes of its own
    upload, weight by weight (qpack is torch code: here on CPU tensors), and the table
    names each packed weight as the executor's bookkeeping does."""
    from apir.backends.local import LocalBackend

    path = _all_block_types(tmp_path / "all.gguf")
    tensors = GGUFFile(path).tensors
    slots, size = weight_slots(tensors.values())
    copy = holder.load(path, "cpu", pack=True)
    assert copy.digest == layout_digest(slots) and copy.weights.numel() == size
    with LocalBackend("cpu") as b:
        b._packs = True  # as on a GPU: quantized weights packed in place at first use
        own = b.alloc_buffer(size)
        for t in tensors.values():
            b.set_tensor(own, slots[t.name].offset, t.data)
        for t in tensors.values():
            if t.dtype.is_quantized:
                b._packed_blocks(_node(own, slots[t.name].offset, t))
        assert b._packed[id(b._buffers[own])] == copy.packed
        assert bytes(b._buffers[own].storage.numpy()) == bytes(copy.weights.numpy())
    assert len(copy.packed) == len([t for t in tensors.values() if t.dtype.is_quantized]) == 10
    assert holder.read_table(holder.table(copy.packed), size) == copy.packed
    assert bytes(copy.weights[slots["first.f32"].offset :][:384].numpy()) == tensors["first.f32"].data.tobytes()


def test_a_sessions_executor_computes_on_the_packed_copy_without_packing_it(tmp_path, cpu_transport, monkeypatch):
    """Adopted with its table, the copy is read as packed and never packed again (a write),
    reads give the GGUF bytes, and views that would need packing are refused."""
    from apir.backends.local import LocalBackend, qpack

    path = _all_block_types(tmp_path / "all.gguf")
    tensors = GGUFFile(path).tensors
    slots, size = weight_slots(tensors.values())
    copy = holder.load(path, "cpu", pack=True)
    export, fds = holder.TRANSPORT.export(copy.weights)
    shared = holder.TRANSPORT.open(export, fds, size)  # mapped read-only: a write would fault
    with LocalBackend("cpu") as b:
        with pytest.raises(BackendError, match="packed for GPU kernels this session's executor does not use"):
            b.adopt_device_buffer(4, shared, copy.packed)
        b._packs = True
        wrong = dict(copy.packed)
        offset = min(wrong)
        wrong[offset] = (wrong[offset][0], 3, 256, wrong[offset][3])
        with pytest.raises(BackendError, match="table of packed weights is wrong"):
            b.adopt_device_buffer(4, shared, wrong)
        pack, lo = qpack.pack, shared.data_ptr()

        def spy(raw, *rest):  # qpack packs its own tables too (unpack's inverse): those are fine
            if lo <= raw.data_ptr() < lo + size:
                pytest.fail("a shared copy was packed again")
            return pack(raw, *rest)

        monkeypatch.setattr(qpack, "pack", spy)
        b.adopt_device_buffer(5, shared, copy.packed)
        assert b.allocated_bytes() == 0  # lent: charged to nobody
        for t in tensors.values():
            offset = slots[t.name].offset
            if t.dtype.is_quantized:
                assert b._stored(_node(5, offset, t)).data.data_ptr() == shared[offset:].data_ptr()
            assert b.get_tensor(5, offset, t.data.nbytes) == t.data.tobytes()  # the GGUF bytes
        t = tensors["w.Q4_0"]
        other = SimpleNamespace(attrs=(5, slots[t.name].offset), dtype=DType.Q4_0, shape=(8, 128))
        with pytest.raises(BackendError, match=r"packed by the host as the model's own tensors; "
                                               r"Q4_0 \(8, 128\) at offset \d+ is not one of them"):
            b._stored(other)
        f32 = SimpleNamespace(attrs=(5, slots["first.f32"].offset), dtype=DType.Q8_0, shape=(1, 32))
        with pytest.raises(BackendError, match="is not one of them"):
            b._stored(f32)
        with pytest.raises(BackendError, match="read-only"):
            b.set_tensor(5, 0, b"\0")
        held = id(b._buffers[5])
        b.free_buffer(5)
        assert held not in b._packed
    assert math.prod(shared.shape) == size  # the copy outlives the session's use of it


def test_a_packed_table_that_does_not_fit_its_copy_is_refused():
    good = {64: (int(DType.Q4_0), 2, 32, 36)}
    assert holder.read_table(holder.table(good), 128) == good
    for bad, size in (({64: (int(DType.Q4_0), 2, 32, 36)}, 64),  # past the copy
                      ({65: (int(DType.Q4_0), 2, 32, 36)}, 128),  # not aligned
                      ({0: (int(DType.F16), 2, 32, 128)}, 256),  # not a block type
                      ({0: (int(DType.Q8_0), 2, 32, 68), 32: (int(DType.Q8_0), 1, 32, 34)}, 256)):  # overlap
        with pytest.raises(Exception, match="packed weight"):
            holder.read_table(holder.table(bad), size)
    with pytest.raises(Exception, match="not a table"):
        holder.read_table(b"APIRDQ1\0" + bytes(8), 128)
    with pytest.raises(Exception, match="does not match its length"):
        holder.read_table(holder.table(good) + b"\0", 128)
