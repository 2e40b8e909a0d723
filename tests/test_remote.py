"""Remoting end to end with real processes: crashes on either side, handshake failures,
the sandboxed guest, vsock."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hosts import WAIT, start_host
from tiny_models import TinyConfig, write_tiny_gguf

import apir
from apir.backends.remote import AuthError, HostGoneError, VersionMismatchError
from apir.protocol import messages as m
from apir.spawn import start_host as spawn_host
from apir.transport import HostUnreachable

PROMPT = "Hello, world! Tell me a long story."


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A tiny model with room for thousands of tokens, so generation runs for a while."""
    path = tmp_path_factory.mktemp("long") / "long.gguf"
    return str(write_tiny_gguf(path, TinyConfig(context_length=8192), "F16", seed=5))


def apir_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "apir.cli", *args]


def wait_for_output(proc: subprocess.Popen, timeout: float = WAIT) -> None:
    """Block until the guest has printed generated text (so it is mid-generation)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.stdout.read(1):
            return
        assert proc.poll() is None, proc.stderr.read()
    raise AssertionError("guest produced no output")


def test_killed_guest_frees_its_session_and_the_next_guest_is_served(host, long_model, backend_options):
    baseline = host.wait_idle()
    assert baseline.sessions == ()
    guest = subprocess.Popen(
        apir_cmd("run", "-m", long_model, "-p", PROMPT, "-n", "6000", "--temp", "0", "-c", "8192",
                 "--remote", host.unix),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    wait_for_output(guest)
    busy = host.status()
    assert len(busy.sessions) == 1 and busy.sessions[0].allocated > 0
    guest.send_signal(signal.SIGKILL)
    guest.wait()
    after = host.wait_idle()
    assert after.sessions == ()  # the daemon's accounting is back at its baseline
    with apir.load(long_model, backend="local") as local, \
            apir.load(long_model, **backend_options["remote-unix"]) as remote:
        ids = local.tokenize(PROMPT)
        np.testing.assert_array_equal(remote.logits(ids), local.logits(ids))


def test_daemon_killed_mid_request_gives_a_clear_error(tmp_path, long_model):
    host = start_host(tmp_path)
    guest = subprocess.Popen(
        apir_cmd("run", "-m", long_model, "-p", PROMPT, "-n", "6000", "--temp", "0", "-c", "8192",
                 "--remote", host.unix),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for_output(guest)
        host.proc.send_signal(signal.SIGKILL)
        code = guest.wait(timeout=WAIT)  # the guest notices, and exits: no hang
    finally:
        guest.kill()
        host.stop()
    err = guest.stderr.read().strip().splitlines()
    assert code != 0
    assert err[-1].startswith("error: the apir host at") and "went away" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_host_gone_raises_typed_error_in_python(tmp_path, long_model):
    host = start_host(tmp_path)
    model = apir.load(long_model, backend="remote", remote=host.unix)
    host.proc.send_signal(signal.SIGKILL)
    host.proc.wait()
    with pytest.raises(HostGoneError, match="went away during Compute"):
        model.prefill([1, 2, 3])
    host.stop()


def test_other_protocol_version_is_refused_with_both_versions_named(host):
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(host.unix.removeprefix("unix://"))
    sock.sendall(m.encode(m.Hello(99, m.op_table_hash(), "", "future", 0), 1, 1))
    data = sock.recv(4096)
    header = m.decode_header(data[:16])
    reply = m.decode_body(header.opcode, data[16 : 16 + header.length])
    assert isinstance(reply, m.Error)
    assert "version 99" in reply.message and f"version {m.PROTOCOL_VERSION}" in reply.message


# 1: a guest from before the Step message; 3: one from before Step was the only compute
@pytest.mark.parametrize("version", [1, 3, 42])
def test_other_protocol_version_raises_typed_error(host, monkeypatch, version):
    import apir.backends.remote as remote

    monkeypatch.setattr(remote, "PROTOCOL_VERSION", version)
    with pytest.raises(VersionMismatchError, match=f"guest speaks version {version}, this host speaks "
                                                   f"version {m.PROTOCOL_VERSION}"):
        remote.RemoteBackend(host.unix)


def _step_graphs(b, w: np.ndarray) -> tuple[int, int]:
    """On ``b``: a decode-like graph (token ids and an F16 input in; argmax, logits and that
    input out) and one that returns a 0-d input (the executor gives it back 1-d)."""
    from apir.backends import BufferPurpose
    from apir.graph import DType, GraphBuilder, T

    buf = b.alloc_buffer(w.nbytes, BufferPurpose.WEIGHTS)
    b.set_tensor(buf, 0, w)
    g = GraphBuilder()
    x, ids = g.input("x", (T, 8), DType.F16), g.input("ids", (T,), DType.I32)
    table = g.weight(buf, 0, (16, 8), DType.F32)
    logits = g.matmul(g.scale(g.get_rows(table, ids), 0.5), table)  # (T, 16)
    main = b.register_graph(g.build(g.argmax(logits), logits, x))
    g = GraphBuilder()
    return main, b.register_graph(g.build(g.input("s", (), DType.F32)))


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_steps_give_exactly_the_local_outputs(host, transport):
    """Computes travel as fixed-layout Steps (small and large, inline and through the
    arena), with exactly the local backend's outputs, dtype and shape; inputs off the
    registered form are refused before anything is sent, in the local backend's words."""
    from apir.backends.base import BackendError
    from apir.backends.local import LocalBackend
    from apir.backends.remote import RemoteBackend

    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    url = host.unix if transport == "unix" else host.tcp
    with LocalBackend("cpu") as local, RemoteBackend(url, token=Path(host.token_file).read_text().strip()) as remote:
        sent = []  # the message type of every frame the guest sends
        send = remote.chan.send_frame
        remote.chan.send_frame = lambda frame, *a: (sent.append(m.OPCODES[m.decode_header(frame[:16]).opcode]),
                                                    send(frame, *a))[1]
        graphs = _step_graphs(local, w), _step_graphs(remote, w)
        for n in (1, 3, 700):  # 700 tokens: 45 KB of logits, through the arena on unix
            main = {"x": rng.standard_normal((n, 8)).astype(np.float16), "ids": rng.integers(0, 16, n).astype(np.int32)}
            for i, inputs in enumerate((main, {"s": np.full((), n, np.float32)})):
                want = local.compute(graphs[0][i], inputs)
                got = remote.compute(graphs[1][i], inputs)
                assert [(a.dtype, a.shape) for a in got] == [(a.dtype, a.shape) for a in want]
                assert all(np.array_equal(a, b) and a.flags.writeable for a, b in zip(got, want))
        assert sent.count(m.Step) == 6
        n_sent = len(sent)
        bad = {"x": np.ones((1, 8), np.float32), "ids": np.zeros(1, np.int32)}
        for b, gid in ((local, graphs[0][0]), (remote, graphs[1][0])):
            with pytest.raises(BackendError, match="input 'x' must be F16, got numpy float32"):
                b.compute(gid, bad)
        assert len(sent) == n_sent


def test_steps_with_nothing_in_flight_reuse_the_bottom_of_the_arena(host):
    """A step placed once every earlier request is answered starts at the arena's bottom:
    a session touches only the pages its largest step needs. Bumping through a fresh
    arena first faulted in every page of it (100 ms a 32 MB step on a VM). A step queued
    behind one in flight still goes above it (no two in flight share a byte)."""
    from apir.backends.remote import RemoteBackend
    from apir.graph import GraphBuilder

    n = 256 << 10  # floats: 1 MiB in, 1 MiB out
    with RemoteBackend(host.unix, arena_size=64 << 20) as remote:
        g = GraphBuilder()
        gid = remote.register_graph(g.build(g.scale(g.input("x", (n,)), 2.0)))
        x = np.arange(n, dtype=np.float32)
        for _ in range(8):
            assert np.array_equal(remote.compute(gid, {"x": x})[0], 2 * x)
            assert remote.ring.head <= 2 * (n * 4) + (64 << 10)  # one step's in + out, no more
        first = remote.submit(gid, {"x": x})
        top = remote.ring.head
        second = remote.submit(gid, {"x": x + 1})
        assert remote.ring.head > top  # queued above the first, which is still in flight
        assert np.array_equal(first.result()[0], 2 * x)
        assert np.array_equal(second.result()[0], 2 * (x + 1))


def test_a_compute_off_the_layout_is_an_error_naming_the_reason(host):
    """No fallback message exists: inputs or a feed off the registered form fail at their
    own result with the reason, nothing is sent, and the session goes on."""
    from apir.backends.base import BackendError
    from apir.backends.remote import RemoteBackend
    from apir.graph import GraphBuilder

    with RemoteBackend(host.unix) as remote:
        g = GraphBuilder()
        gid = remote.register_graph(g.build(g.scale(g.input("x", (2,)), 2.0)))
        with pytest.raises(BackendError, match=f"feed names 'nope', which is not an input of graph {gid}"):
            remote.submit(gid, {"x": np.ones(2, np.float32)}, feed={"nope": 0}).result()
        with pytest.raises(BackendError, match=r"must have shape \(2\), got \(3,\)"):
            remote.submit(gid, {"x": np.ones(3, np.float32)}).result()
        with pytest.raises(BackendError, match="unknown graph id 99"):
            remote.compute(99, {})
        assert remote.compute(gid, {"x": np.ones(2, np.float32)})[0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_two_threads_sharing_a_remote_backend_each_get_their_own_replies(host, transport):
    """``apir serve`` once asked for the device on its loading thread while the scheduler's
    first request waited for its reply: each thread read the other's reply and both waited
    forever. The API is serialized, so threads may share a backend: every reply reaches its
    own request."""
    import threading

    from apir.backends.remote import RemoteBackend
    from apir.graph import GraphBuilder

    url = host.unix if transport == "unix" else host.tcp
    with RemoteBackend(url, token=Path(host.token_file).read_text().strip()) as remote:
        results: dict[str, list] = {"graphs": [], "devices": []}
        errors: list[BaseException] = []

        def graphs() -> None:
            for k in range(1, 41):
                g = GraphBuilder()
                gid = remote.register_graph(g.build(g.scale(g.input("x", (3,)), float(k))))
                results["graphs"].append(remote.compute(gid, {"x": np.ones(3, np.float32)})[0].tolist())

        def devices() -> None:
            for _ in range(200):
                results["devices"].append(remote.device().kind)

        def guarded(fn):
            def run() -> None:
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - reported by the test thread
                    errors.append(e)
            return threading.Thread(target=run, daemon=True)

        threads = [guarded(graphs), guarded(devices)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert not any(t.is_alive() for t in threads), "a thread still waits for its reply"
        assert errors == []
        assert results["graphs"] == [[float(k)] * 3 for k in range(1, 41)]
        assert results["devices"] == ["cpu"] * 200


def test_close_while_another_thread_waits_keeps_that_call_whole(host, monkeypatch):
    """close() from one thread while another waits for a long compute: it waits up to
    CLOSE_WAIT for that call, then returns without unmapping the region the call still
    reads; the call gets its right result, and the backend takes no new request."""
    import threading

    from apir.backends import remote as remote_module
    from apir.backends.base import BackendError, BufferPurpose
    from apir.backends.remote import RemoteBackend
    from apir.graph import DType, GraphBuilder

    monkeypatch.setattr(remote_module, "CLOSE_WAIT", 0.05)
    n = 1024
    w = np.eye(n, dtype=np.float32)
    remote = RemoteBackend(host.unix)
    buf = remote.alloc_buffer(w.nbytes, BufferPurpose.WEIGHTS)
    remote.set_tensor(buf, 0, w)
    g = GraphBuilder()
    x = g.input("x", (n, n))
    y = x
    for _ in range(24):  # seconds of products on the host's one thread
        y = g.matmul(y, g.weight(buf, 0, (n, n), DType.F32))
    gid = remote.register_graph(g.build(y))
    x_in = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    got: list = []
    worker = threading.Thread(target=lambda: got.append(remote.compute(gid, {"x": x_in})[0]), daemon=True)
    worker.start()
    while not remote._awaited:  # the compute is sent and waited for
        time.sleep(0.01)
    remote.close()
    assert worker.is_alive(), "close returned only after the compute (make the graph slower)"
    worker.join(WAIT)
    np.testing.assert_allclose(got[0], x_in, rtol=1e-5, atol=1e-5)
    with pytest.raises(BackendError, match="closed"):
        remote.device()


def test_the_remote_backend_takes_its_config_from_its_caller(host, monkeypatch):
    """RemoteBackend and create_backend read no environment: the token and spin time come
    as parameters, resolved once at the edge (the CLI's RunConfig)."""
    from apir.backends import create_backend
    from apir.backends.remote import AuthError, RemoteBackend

    token = Path(host.token_file).read_text().strip()
    monkeypatch.setenv("APIR_SPIN_US", "777")
    monkeypatch.setenv("APIR_TOKEN", token)
    monkeypatch.delenv("APIR_TOKEN_FILE", raising=False)
    with RemoteBackend(host.unix) as remote:
        assert remote.chan.spin_seconds == 0  # a cpu host's default, not $APIR_SPIN_US
    with RemoteBackend(host.unix, spin_us=1234) as remote:
        assert remote.chan.spin_seconds == 1234e-6
    with create_backend("remote", remote=host.tcp, token=token, spin_us=777) as remote:
        assert remote.chan.spin_seconds == 777e-6 and remote.device().kind == "cpu"
    for make in (lambda: RemoteBackend(host.tcp), lambda: create_backend("remote", remote=host.tcp)):
        with pytest.raises(AuthError, match="no token was sent"):
            make()
    with RemoteBackend(host.tcp, token=token) as remote:
        assert remote.device().kind == "cpu"


def test_tcp_without_token_is_refused(host, monkeypatch):
    monkeypatch.delenv("APIR_TOKEN", raising=False)
    monkeypatch.delenv("APIR_TOKEN_FILE", raising=False)
    with pytest.raises(AuthError, match="no token was sent"):
        apir.load("smollm2-135m", backend="remote", remote=host.tcp)
    out = subprocess.run(apir_cmd("run", "-p", "hi", "-n", "2", "--remote", host.tcp),
                         capture_output=True, text=True, env={**os.environ, "APIR_TOKEN": "wrong"})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("error: host: authentication failed")


def test_nobody_listening_is_one_clear_line(tmp_path):
    sock = tmp_path / "nobody.sock"
    with pytest.raises(HostUnreachable, match="no apir host is listening"):
        apir.load("smollm2-135m", backend="remote", remote=f"unix://{sock}")
    out = subprocess.run(apir_cmd("run", "-p", "hi", "--remote", f"unix://{sock}"),
                         capture_output=True, text=True)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines == [f"error: no apir host is listening at unix://{sock} (no socket there): "
                     f"start one with `apir host --listen unix://{sock}`"]


def test_unix_socket_is_owner_only(host):
    mode = os.stat(host.unix.removeprefix("unix://")).st_mode & 0o777
    assert mode == 0o600


def test_run_remote_auto_starts_and_stops_a_private_daemon(tmp_path, long_model):
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    out = subprocess.run(apir_cmd("run", "-m", long_model, "-p", PROMPT, "-n", "8", "--temp", "0",
                                  "--remote", "auto"), capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    with apir.load(long_model, backend="local") as local:
        assert out.stdout == local.generate(PROMPT, temperature=0, max_tokens=8) + "\n"
    assert not (tmp_path / "apir" / "apir.sock").exists()  # stopped and cleaned up


needs_bwrap = pytest.mark.skipif(
    subprocess.run(["sh", "-c", "command -v bwrap"], capture_output=True).returncode != 0,
    reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap",
)


@needs_bwrap
def test_sandboxed_guest_gives_local_output(host, long_model):
    out = subprocess.run(apir_cmd("run", "--sandbox", "-m", long_model, "-p", PROMPT, "-n", "8",
                                  "--temp", "0", "--remote", host.unix),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sandbox: guest in bubblewrap" in out.stderr
    with apir.load(long_model, backend="local") as local:
        assert out.stdout == local.generate(PROMPT, temperature=0, max_tokens=8) + "\n"


@needs_bwrap
def test_sandbox_has_no_network_no_gpu_nodes_and_a_read_only_root(host, tmp_path):
    from apir.sandbox import sandbox_command

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    probe = f"""
import os, socket
s = socket.socket()
try:
    s.connect(("127.0.0.1", {port})); print("net:open")
except OSError:
    print("net:closed")
print("gpu:" + str(any(n.startswith(("nvidia", "dri", "kfd")) for n in os.listdir("/dev"))))
try:
    open("{tmp_path}/written", "w"); print("root:writable")
except OSError:
    print("root:read-only")
c = socket.socket(socket.AF_UNIX); c.connect("{host.unix.removeprefix('unix://')}"); print("host:reachable")
"""
    out = subprocess.run(sandbox_command(host.unix.removeprefix("unix://"), [sys.executable, "-c", probe]),
                         capture_output=True, text=True, timeout=60)
    listener.close()
    assert out.stdout.split() == ["net:closed", "gpu:False", "root:read-only", "host:reachable"], out.stderr


def _vsock_loopback_reason() -> str | None:
    if not hasattr(socket, "AF_VSOCK"):
        return "this Python has no AF_VSOCK"
    try:
        srv = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        srv.bind((socket.VMADDR_CID_ANY, socket.VMADDR_PORT_ANY))
        srv.listen()
        port = srv.getsockname()[1]
        cli = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        cli.settimeout(1.0)
        cli.connect((1, port))  # VMADDR_CID_LOCAL: needs the vsock_loopback kernel module
        cli.close()
        srv.close()
        return None
    except OSError as e:
        return f"the kernel has no vsock loopback here ({e.strerror or e}); modprobe vsock_loopback"


@pytest.mark.skipif(_vsock_loopback_reason() is not None, reason=str(_vsock_loopback_reason()))
def test_vsock_transport(tmp_path, long_model):
    token = tmp_path / "token"
    token.write_text("t" * 32)
    port = 7000 + os.getpid() % 1000
    # it answers on its unix socket once every listener is up
    listen = [f"unix://{tmp_path / 'apir.sock'}", f"vsock://4294967295:{port}"]
    with spawn_host(listen, tmp_path / "host.log", device="cpu", token_file=str(token)), \
            apir.load(long_model, backend="remote", remote=f"vsock://1:{port}", token=token.read_text().strip()) as rm, \
            apir.load(long_model, backend="local") as local:
        ids = local.tokenize(PROMPT)
        np.testing.assert_array_equal(rm.logits(ids), local.logits(ids))
