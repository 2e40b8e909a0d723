"""Published models (``apir host --model``): guests of one model share the host's one
read-only copy of its weights, counted once; a guest cannot write it, cannot claim a model
the host does not publish, and a worker's crash leaves the copy and the other sessions
alone; the copy goes ``--keep-alive`` seconds after its last session."""

from __future__ import annotations

import math
import os
import shutil
import signal

import numpy as np
import pytest
from hosts import check_published_read_only, start_host
from test_warm import PROMPT, _ids  # the same prompt
from tiny_models import TinyConfig, write_tiny_gguf

import apir
from apir.backends import forms
from apir.backends.base import BackendError
from apir.backends.remote import HostGoneError, RemoteBackend
from apir.engine import SamplingParams
from apir.errors import ApirError
from apir.graph import DType, GraphBuilder
from apir.host.daemon import HostConfig
from apir.host.published import PublishedModel, Shelf
from apir.models.gguf_file import GGUFFile
from apir.models.layout import layout_digest, weight_slots
from apir.protocol import messages as m
from apir.transport import parse_address

KEEP_ALIVE = 1.0  # seconds: long enough for back-to-back loads, short for the unload test


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinyConfig(context_length=256), seed=7))


@pytest.fixture(scope="module")
def layout(tiny) -> tuple[bytes, int]:
    slots, size = weight_slots(GGUFFile(tiny).tensors.values())
    return layout_digest(slots), size


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny):
    # a host told to keep dequantized f32 forms (APIR_DEQUANT_CACHE=1, read at its start):
    # for a published model its daemon makes them once, for every session
    with pytest.MonkeyPatch.context() as env:
        env.setenv("APIR_DEQUANT_CACHE", "1")
        h = start_host(tmp_path_factory.mktemp("shared"), "--model", tiny, "--keep-alive", str(KEEP_ALIVE))
    yield h
    h.stop()


@pytest.fixture(scope="module")
def expected(tiny) -> list[int]:
    with apir.load(tiny, backend="local", device="cpu") as local:
        return _ids(local)


def _dequantized(tiny, int4: bool = False) -> list:
    """The weights a CPU session keeps dequantized (16-bit and quantized), but with
    ``int4`` those it computes in int4."""
    from apir.backends.local import int4cpu

    return [t for t in GGUFFile(tiny).tensors.values() if t.dtype not in (DType.F32, DType.I32)
            and not (int4 and int4cpu.usable(t.dtype, t.shape))]


def _forms_size(tiny, int4: bool = False) -> int:
    """The bytes of the dequantized forms' mapping the daemon makes for ``tiny``."""
    slots, _ = weight_slots(GGUFFile(tiny).tensors.values())
    return forms.plan([(slots[t.name].offset, int(t.dtype), math.prod(t.shape)) for t in _dequantized(tiny, int4)])[2]


def _dequantized_elements(tiny) -> int:
    """The elements of the weights a CPU session keeps dequantized (16-bit and quantized)."""
    return sum(math.prod(t.shape) for t in _dequantized(tiny))


def test_sessions_share_one_copy_uploaded_by_nobody(host, tiny, layout, expected, tmp_path):
    host.until(lambda st: not st.sessions and not st.shared_bytes, "an idle host")
    loads = host.status().shared_loads
    own = shutil.copy(tiny, tmp_path / "unpublished.gguf")  # same tensors, a name not published
    with apir.load(tiny, backend="remote", remote=host.unix) as first, \
            apir.load(tiny, backend="remote", remote=host.unix) as second, \
            apir.load(own, backend="remote", remote=host.unix) as uploader:
        assert _ids(first) == _ids(second) == _ids(uploader) == expected
        st = host.status()
        assert st.published == ("tiny",)
        assert st.shared_loads == loads + 1  # read from disk once, for both sessions
        # counted once, beside the sessions: the weights and their dequantized f32 forms,
        # which a CPU session would otherwise make (and be charged) for itself
        assert st.shared_bytes == layout[1] + _forms_size(tiny)
        assert st.shared == (m.SharedInfo("tiny", "host", st.shared_bytes, 2),)  # one copy, two sessions
        # a sharing session holds what the uploader holds but its weights and their forms
        assert host.allocated(uploader) - host.allocated(first) == layout[1] + _dequantized_elements(tiny) * 4
        assert host.allocated(first) == host.allocated(second)
    # after the last session, the copy stays keep-alive seconds, then goes
    st = host.until(lambda st: not st.sessions, "sessions ended")
    host.until(lambda st: st.shared_bytes == 0, "the copy unloaded after --keep-alive")
    with apir.load(tiny, backend="remote", remote=host.unix) as again:
        assert _ids(again) == expected
        assert host.status().shared_loads == loads + 2  # loaded anew


def test_by_default_sessions_share_the_weights_and_make_their_own_compact_forms(tmp_path):
    """A default CPU host keeps no f32 forms: a published Q8_0 model's sessions share its
    weights, counted once, and each makes (and is charged for) its own int8 forms, as an
    uploading session does."""
    from apir.backends.local import int8cpu

    path = str(write_tiny_gguf(tmp_path / "q8.gguf", TinyConfig(context_length=256), "Q8_0", seed=7))
    tensors = GGUFFile(path).tensors.values()
    slots, size = weight_slots(tensors)
    own_forms = sum(int8cpu.nbytes(t.dtype, t.shape) for t in tensors if t.dtype is DType.Q8_0)
    (tmp_path / "host").mkdir()
    h = start_host(tmp_path / "host", "--model", path)
    try:
        own = shutil.copy(path, tmp_path / "unpublished.gguf")
        with apir.load(path, backend="remote", remote=h.unix) as first, \
                apir.load(own, backend="remote", remote=h.unix) as uploader:
            assert _ids(first) == _ids(uploader)
            assert h.status().shared_bytes == size  # the weights alone
            assert h.allocated(uploader) - h.allocated(first) == size
            assert own_forms > 0 and h.allocated(first) > own_forms
    finally:
        h.stop()


def test_a_model_not_published_is_refused_clearly(host, layout):
    with RemoteBackend(host.unix) as b:
        with pytest.raises(BackendError, match=r"publishes no model named 'secret' \(published: tiny\)"):
            b.open_published("secret", *layout)
        with pytest.raises(BackendError, match="not laid out as this guest's file"):
            b.open_published("tiny", b"\0" * 32, layout[1])
        with pytest.raises(BackendError, match="not a model name"):
            b.open_published("../etc/passwd", *layout)


def test_shared_weights_are_read_only(host, layout):
    check_published_read_only(host, layout, 64)


def test_a_killed_worker_leaves_the_copy_and_other_sessions(host, tiny, expected):
    """The victim is killed while the bystander's decode is half done, on the same copy."""
    with apir.load(tiny, backend="remote", remote=host.unix) as bystander, \
            apir.load(tiny, backend="remote", remote=host.unix) as victim:
        steps = bystander.generate_ids(bystander.tokenize(PROMPT), SamplingParams(temperature=0, max_tokens=12))
        first = [next(steps) for _ in range(6)]
        workers = {s.session: s.pid for s in host.status().sessions}
        os.kill(workers[victim.backend.session], signal.SIGKILL)
        with pytest.raises(HostGoneError):
            _ids(victim)
        st = host.until(lambda st: [s.session for s in st.sessions] == [bystander.backend.session],
                   "only the bystander's session left")
        assert st.shared_bytes > 0  # the copy outlives the worker that mapped it
        assert first + list(steps) == expected
    assert host.proc.poll() is None


def test_keep_alive_negative_loads_at_start_and_keeps(tiny, layout):
    shelf = Shelf((PublishedModel.parse(tiny),), keep_alive=-1)
    try:
        assert shelf.loads == 1 and shelf.resident_bytes() == layout[1]  # before any guest
        assert shelf.acquire("tiny", 1).digest == layout[0]
        shelf.release(1, now=0.0)
        shelf.expire(now=1e12)
        assert shelf.resident_bytes() == layout[1] and shelf.loads == 1
    finally:
        shelf.close()


def test_published_model_flags_are_checked(tiny, layout):
    named = PublishedModel.parse(f"small={tiny}")
    assert named.name == "small"
    shelf = Shelf((named,), keep_alive=0)
    try:  # asked for by its file's name, as a guest's engine asks, it is the same copy
        assert shelf.acquire("tiny", 1) is shelf.acquire("small", 2) and shelf.loads == 1
    finally:
        shelf.close()
    with pytest.raises(ApirError, match="two models are published as 'small'"):
        HostConfig((parse_address("unix:///tmp/x.sock"),), models=(named, named))
    with pytest.raises(ApirError, match="a model's name is"):
        PublishedModel.parse(f"../x={tiny}")
    with pytest.raises(ApirError, match="no file"):
        PublishedModel.parse("small=/nonexistent/model.gguf")


def test_a_published_file_that_is_not_gguf_fails_the_start(tmp_path):
    """Found in QA: a --model file that is not GGUF (or cut short) started the daemon, and
    every guest of it was refused and uploaded its own weights, the reason only in the log."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"garbage\n")
    with pytest.raises(ApirError, match=r"--model .*bad.gguf.*is not a GGUF file"):
        PublishedModel.parse(str(bad))
    bad.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ApirError, match="truncated or corrupt"):
        PublishedModel.parse(f"small={bad}")


@pytest.mark.parametrize("lends", [True, False], ids=["in-place", "device-copy"])
def test_an_adopted_buffer_is_read_only_and_charged_only_when_copied(lends):
    """In place (a CPU) the mapping is computed on and charged to nobody; a device that
    needs its own copy (a GPU: ``_lends`` False) charges it like an upload."""
    from apir.backends.local import LocalBackend

    data = memoryview(bytes(range(256)) * (3 << 15))  # 24 MiB: more than one copy piece
    with LocalBackend("cpu") as b:
        b._lends = lends
        b.adopt_buffer(5, data)
        assert b.allocated_bytes() == (0 if lends else len(data))
        assert b.get_tensor(5, len(data) - 256, 256) == bytes(range(256))
        with pytest.raises(BackendError, match="read-only"):
            b.set_tensor(5, 0, b"\0")
        b.free_buffer(5)
        assert b.allocated_bytes() == 0


@pytest.mark.parametrize(("weight_type", "int4"), [("Q8_0", False), ("Q4_0", False), ("F16", False),
                                                   ("Q4_0", True)])
def test_the_hosts_forms_are_the_values_a_session_makes(tmp_path, weight_type, int4):
    """The daemon's dequantized forms of a published model are bit for bit what a CPU
    session's executor makes of each weight, and the table maps each weight to its own;
    with int4 (a CPU host's default) none of a weight the sessions compute in int4."""
    import mmap

    import torch

    from apir.backends.local.dequant import dequantize
    from apir.host.published import load_copy

    path = write_tiny_gguf(tmp_path / "m.gguf", TinyConfig(context_length=64), seed=3, weight_type=weight_type)
    copy = load_copy(PublishedModel.parse(str(path)), forms=True, int4=int4)
    try:
        assert copy.forms_size == _forms_size(path, int4)
        data = memoryview(mmap.mmap(copy.forms_fd, copy.forms_size, mmap.MAP_SHARED, mmap.PROT_READ))
        table = forms.read(data)
        slots, _ = weight_slots(GGUFFile(path).tensors.values())
        dequantized = _dequantized(path, int4)
        if int4:  # the Q4_0 matrices are left to the sessions; the rest keep their f32 forms
            from apir.backends.local import int4cpu

            assert 0 < len(dequantized) < len(_dequantized(path))
            assert not any(int4cpu.usable(t.dtype, t.shape) for t in dequantized)
        else:
            assert {t.dtype.name for t in dequantized} >= {weight_type}
        assert sorted(table) == sorted(slots[t.name].offset for t in dequantized)
        for t in dequantized:
            kind, at, n = table[slots[t.name].offset]
            assert kind == int(t.dtype)
            want = dequantize(torch.from_numpy(t.data.copy()), t.dtype, t.shape).to(torch.float32).numpy()
            got = np.frombuffer(data, np.float32, n, at).reshape(t.shape)
            assert np.array_equal(got, want), t.name
    finally:
        os.close(copy.fd)
        os.close(copy.forms_fd)


def test_a_leaf_reading_shared_bytes_as_another_type_computes_as_local(host, tiny, layout):
    """The host's forms are keyed by the type they were made as: a graph that reads an F16
    weight's bytes as BF16 gets no F16 form from them, but what a local backend computes
    from the same bytes."""
    from apir.backends.local import LocalBackend

    tensors = GGUFFile(tiny).tensors
    slots, _ = weight_slots(tensors.values())
    name = next(n for n, t in tensors.items() if t.dtype is DType.F16 and len(t.shape) == 2)
    rows, k = tensors[name].shape
    x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)

    def run(b, handle, offset):
        outs = []
        for dtype in (DType.F16, DType.BF16):
            g = GraphBuilder()
            gid = b.register_graph(g.build(g.matmul(g.input("x", (3, k)), g.weight(handle, offset, (rows, k), dtype))))
            outs.append(b.compute(gid, {"x": x})[0])
        return outs

    with RemoteBackend(host.unix) as remote, LocalBackend("cpu") as local:
        shared = run(remote, remote.open_published("tiny", *layout), slots[name].offset)
        own = local.alloc_buffer(tensors[name].data.nbytes)
        local.set_tensor(own, 0, tensors[name].data)
        mine = run(local, own, 0)
    # equal up to the summation order of the products (the host computes on 1 thread)
    np.testing.assert_allclose(shared[0], mine[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(shared[1], mine[1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(mine[0], mine[1], rtol=1e-2)  # the two readings differ: the test tells them apart
