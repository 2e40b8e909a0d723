"""A published model's one copy on a CUDA device, for real: a daemon with ``--device cuda
--model tiny.gguf`` (Q4_0) forks a holder that loads and packs the weights once and lends
them to every session's worker by CUDA IPC (``apir.host.holder``); the CUDA half of
tests/test_holder.py, which runs the same daemon on a CPU with a stand-in for CUDA IPC.
Compiling is off (``APIR_COMPILE=0``, natively too) so that it takes well under a minute.

    pytest -m gpu tests/test_gpu_holder.py
"""

from __future__ import annotations

import os
import shutil
import signal
import threading

import pytest
from hosts import WAIT, Host, running, until
from test_warm import PROMPT, _ids
from tiny_models import TinyConfig, write_tiny_gguf

import apir
from apir.backends.base import ExecutorConfig
from apir.backends.remote import HostGoneError, RemoteBackend, RemoteError
from apir.engine import SamplingParams
from apir.models.gguf_file import GGUFFile
from apir.models.layout import layout_digest, weight_slots
from apir.protocol import messages as m
from apir.spawn import free_port, start_host, write_token

pytestmark = pytest.mark.gpu
KEEP_ALIVE = 2.0
GUESTS = 8  # the goal: 8 guests of one model, one copy on the GPU


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinyConfig(context_length=256),
                               "Q4_0", seed=7))


@pytest.fixture(scope="module")
def layout(tiny) -> tuple[bytes, int]:
    slots, size = weight_slots(GGUFFile(tiny).tensors.values())
    return layout_digest(slots), size


@pytest.fixture(scope="module")
def expected(tiny) -> list[int]:
    """Greedy tokens of a native run on the GPU (its executor packs its own upload)."""
    from apir.backends.local import LocalBackend

    with apir.load(tiny, backend=LocalBackend("cuda", config=ExecutorConfig(compile="off"))) as native:
        return _ids(native)


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny):
    tmp = tmp_path_factory.mktemp("held-cuda")
    token = write_token(tmp / "token")
    unix, tcp = f"unix://{tmp / 'apir.sock'}", f"tcp://127.0.0.1:{free_port()}"
    with pytest.MonkeyPatch.context() as env:  # the daemon inherits it; restored after
        env.setenv("APIR_COMPILE", "0")
        daemon = start_host([unix, tcp], tmp / "host.log", device="cuda", token_file=token,
                            options=("--model", tiny, "--keep-alive", str(KEEP_ALIVE), "--warm-workers", "4",
                                     "--max-sessions", "16"))
    h = Host(daemon, unix, tcp, token, daemon.log)
    yield h
    h.stop()


def test_sessions_compute_on_the_holders_one_device_copy(host, tiny, layout, expected, tmp_path):
    host.until(lambda st: not st.sessions and not st.shared, "an idle host")
    loads = host.status().shared_loads
    own = shutil.copy(tiny, tmp_path / "unpublished.gguf")  # same tensors, a name not published
    with apir.load(tiny, backend="remote", remote=host.unix) as first, \
            apir.load(tiny, backend="remote", remote=host.unix) as second, \
            apir.load(own, backend="remote", remote=host.unix) as uploader:
        assert _ids(first) == _ids(second) == _ids(uploader) == expected
        st = host.status()
        assert st.shared == (m.SharedInfo("tiny", "cuda", layout[1], 2),)  # one copy, on the GPU, used twice
        assert st.shared_bytes == layout[1] and st.shared_loads == loads + 1
        # the sharing sessions are charged everything the uploader is but the weights
        assert host.allocated(uploader) - host.allocated(first) == layout[1]
        assert host.allocated(first) == host.allocated(second)
        pid = host.holders()[-1]
        assert running(pid) and pid not in {s.pid for s in st.sessions}  # it runs no session
    st = host.until(lambda st: not st.sessions, "sessions ended")
    assert st.shared in ((m.SharedInfo("tiny", "cuda", layout[1], 0),), ())  # kept alive, or gone already
    host.until(lambda st: not st.shared and st.shared_bytes == 0, "the copy unloaded after --keep-alive")
    until(lambda: not running(pid), "the holder ended (its device memory freed)")


def test_eight_guests_share_one_copy(host, tiny, layout):
    """Eight sessions at once on the published copy: one holder, one copy, eight users;
    each reads the GGUF's bytes back through the packed copy."""
    first = next(iter(GGUFFile(tiny).tensors.values()))
    offset = weight_slots(GGUFFile(tiny).tensors.values())[0][first.name].offset
    want = first.data.tobytes()[:256]
    opened, errors = threading.Barrier(GUESTS + 1, timeout=WAIT), []

    def guest() -> None:
        try:
            with RemoteBackend(host.unix, on_notice=lambda text: None) as b:
                got = b.get_tensor(b.open_published("tiny", *layout), offset, len(want))
                assert got == want, "a session read other bytes than the GGUF's"
                opened.wait()  # all eight hold it while the test reads the status
                opened.wait()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            opened.abort()

    started = len(host.holders())
    threads = [threading.Thread(target=guest) for _ in range(GUESTS)]
    for t in threads:
        t.start()
    try:
        opened.wait()  # every guest has opened the copy and read it
        st = host.status()
        opened.wait()  # let them go
    except threading.BrokenBarrierError:
        st = None
    for t in threads:
        t.join(WAIT)
    assert not errors, errors
    assert st is not None and len(st.sessions) == GUESTS
    assert st.shared == (m.SharedInfo("tiny", "cuda", layout[1], GUESTS),) and st.shared_bytes == layout[1]
    assert len(host.holders()) <= started + 1  # one holder for all (a new one if the last had expired)


def test_a_killed_worker_leaves_the_holder_and_the_other_session(host, tiny, expected):
    with apir.load(tiny, backend="remote", remote=host.unix) as bystander, \
            apir.load(tiny, backend="remote", remote=host.unix) as victim:
        pid, resident = host.holders()[-1], host.status().shared_bytes
        steps = bystander.generate_ids(bystander.tokenize(PROMPT), SamplingParams(temperature=0, max_tokens=12))
        half = [next(steps) for _ in range(6)]
        workers = {s.session: s.pid for s in host.status().sessions}
        os.kill(workers[victim.backend.session], signal.SIGKILL)  # an importer of the copy dies
        with pytest.raises(HostGoneError):
            _ids(victim)
        st = host.until(lambda st: [s.session for s in st.sessions] == [bystander.backend.session],
                        "only the bystander's session left")
        assert st.shared_bytes == resident and running(pid)
        assert half + list(steps) == expected
        assert _ids(bystander) == expected
    assert host.proc.poll() is None


def test_a_dead_holder_ends_its_sessions_and_a_new_one_serves_the_next(host, tiny, expected):
    with apir.load(tiny, backend="remote", remote=host.unix) as a, \
            apir.load(tiny, backend="remote", remote=host.unix) as b:
        assert _ids(a) == expected
        loads, pid = host.status().shared_loads, host.holders()[-1]
        os.kill(pid, signal.SIGKILL)
        # Reaped, so its liveness pipe has hung up: a CUDA process takes a while to exit,
        # and a request read before that still finds the holder's memory mapped.
        until(lambda: f"holder pid {pid} was killed (signal 9)" in host.log.read_text(), "the holder reaped")
        for model in (a, b):
            with pytest.raises((RemoteError, HostGoneError), match="published model 'tiny' on its GPU went away"):
                _ids(model)
        host.until(lambda st: not st.sessions and not st.shared, "the sessions of the dead holder's copy ended")
        assert f"holder pid {pid} was killed (signal 9)" in host.log.read_text()
    with apir.load(tiny, backend="remote", remote=host.unix) as again:
        assert _ids(again) == expected
        assert host.status().shared_loads == loads + 1 and host.holders()[-1] != pid
    assert host.proc.poll() is None
