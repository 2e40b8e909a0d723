"""Pipelined computes against a real daemon: ``submit`` sends without waiting, replies
come back in request order and each lands at its own Pending; a token fed on the host
gives exactly the tokens of the unpipelined loop; errors and a dying daemon surface at
the right ``result()``; several requests in flight never share arena bytes."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
from hosts import start_host

from apir.backends import BufferPurpose
from apir.backends.base import BackendError
from apir.backends.local import LocalBackend
from apir.backends.remote import HostGoneError, RemoteBackend
from apir.graph import DType, GraphBuilder, T

VOCAB, DIM = 64, 16


def _remote(host, transport: str, **kw) -> RemoteBackend:
    return RemoteBackend(host.unix if transport == "unix" else host.tcp, token=Path(host.token_file).read_text().strip(), **kw)


def _decoder(b) -> tuple[int, int]:
    """On ``b``: a decode-shaped graph, tokens (T,) and pos (T,) in, the argmax token (T,)
    and the logits (T, VOCAB) out; and the weights' buffer."""
    rng = np.random.default_rng(7)
    buf = b.alloc_buffer(2 * VOCAB * DIM * 4, BufferPurpose.WEIGHTS)
    b.set_tensor(buf, 0, rng.standard_normal(2 * VOCAB * DIM).astype(np.float32))
    g = GraphBuilder()
    tokens, pos = g.input("tokens", (T,), DType.I32), g.input("pos", (T,), DType.I32)
    emb = g.weight(buf, 0, (VOCAB, DIM), DType.F32)
    out = g.weight(buf, VOCAB * DIM * 4, (VOCAB, DIM), DType.F32)
    logits = g.matmul(g.add(g.get_rows(emb, tokens), g.get_rows(emb, pos)), out)  # (T, VOCAB)
    return b.register_graph(g.build(g.argmax(logits), logits)), buf


def _pos(i: int) -> dict[str, np.ndarray]:
    return {"pos": np.array([i % VOCAB], np.int32)}


def _unpipelined(b, gid: int, token: int, n: int) -> list[int]:
    out = []
    for i in range(n):
        token = int(b.compute(gid, {"tokens": np.array([token], np.int32), **_pos(i)})[0][0])
        out.append(token)
    return out


def _pipelined(b, gid: int, token: int, n: int) -> list[int]:
    """Step i+1 is submitted, its token fed from step i on the backend, before token i is read."""
    pending = b.submit(gid, {"tokens": np.array([token], np.int32), **_pos(0)})
    out = []
    for i in range(1, n + 1):
        following = b.submit(gid, _pos(i), feed={"tokens": 0}) if i < n else None
        out.append(int(pending.result()[0][0]))
        pending = following
    return out


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_pipelined_decode_gives_exactly_the_unpipelined_tokens(host, transport):
    with LocalBackend("cpu") as local, _remote(host, transport) as remote:
        want = _unpipelined(local, _decoder(local)[0], 5, 40)
        gid, buf = _decoder(remote)
        assert _unpipelined(remote, gid, 5, 40) == want
        assert _pipelined(remote, gid, 5, 40) == want
        assert _pipelined(local, _decoder(local)[0], 5, 40) == want  # the base class's submit
        # other requests between a submit and its result take the earlier replies first
        first = remote.submit(gid, {"tokens": np.array([5], np.int32), **_pos(0)})
        second = remote.submit(gid, _pos(1), feed={"tokens": 0})
        weights = remote.get_tensor(buf, 0, 16)
        remote.synchronize()
        third = remote.submit(gid, _pos(2), feed={"tokens": 0})
        assert [int(p.result()[0][0]) for p in (third, first, second)] == [want[2], want[0], want[1]]
        assert weights == local.get_tensor(_decoder(local)[1], 0, 16)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_an_error_surfaces_at_its_own_result_and_a_fed_step_after_it_fails(host, transport):
    with _remote(host, transport) as remote:
        gid, _ = _decoder(remote)
        good = remote.submit(gid, {"tokens": np.array([1], np.int32), **_pos(0)})
        bad = remote.submit(gid, {"tokens": np.array([VOCAB + 5], np.int32), **_pos(1)})  # out of range
        fed = remote.submit(gid, _pos(2), feed={"tokens": 0})
        after = remote.submit(gid, {"tokens": np.array([2], np.int32), **_pos(3)})
        assert after.result()[0].shape == (1,)  # a later reply, read first
        assert good.result()[0].shape == (1,)
        with pytest.raises(BackendError, match=r"row index out of range: input .tokens. must lie in \[0, 64\)"):
            bad.result()
        with pytest.raises(BackendError, match="no outputs to feed from"):
            fed.result()
        with pytest.raises(BackendError, match="feed names 'nope', which is not an input"):
            remote.compute(gid, _pos(0), feed={"nope": 0})  # the guest says, as the local backend would
        assert remote.compute(gid, {"tokens": np.array([3], np.int32), **_pos(0)})[0].shape == (1,)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_many_requests_in_flight_through_a_small_arena(host, transport):
    """Big inputs and outputs of nine requests in flight, on an arena that holds about
    four of them: no two share arena bytes, the wrap waits, every result is its own."""
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((64, 1024)).astype(np.float32) for _ in range(8)]  # 256 KiB each
    with _remote(host, transport, arena_size=4 << 20) as remote:
        g = GraphBuilder()
        x = g.input("x", (T, 1024))
        gid = remote.register_graph(g.build(g.scale(x, 2.0), g.scale(x, -1.0)))
        # T only in a fed input: that of the output feeding it, in the previous compute (a
        # pick: argmax of the identity's rows gives tok back)
        eye = remote.alloc_buffer(8 * 8 * 4, BufferPurpose.WEIGHTS)
        remote.set_tensor(eye, 0, np.eye(8, dtype=np.float32))
        g = GraphBuilder()
        rows = g.get_rows(g.weight(eye, 0, (8, 8), DType.F32), g.input("tok", (T,), DType.I32))
        named = remote.register_graph(g.build(g.argmax(rows), g.scale(g.input("x", (64, 1024)), 3.0)))
        remote.compute(named, {"tok": np.array([4, 2], np.int32), "x": xs[0]})
        for _ in range(3):
            pending = [remote.submit(gid, {"x": x}) for x in xs]
            pending.insert(4, remote.submit(named, {"x": xs[1]}, feed={"tok": 0}))
            tok, tripled = pending.pop(4).result()
            for x, p in reversed(list(zip(xs, pending))):
                doubled, negated = p.result()
                assert np.array_equal(doubled, 2 * x) and np.array_equal(negated, -x)
            assert tok.tolist() == [4, 2] and np.array_equal(tripled, 3 * xs[1])


def _slow(b) -> tuple[int, dict]:
    """A graph that takes a good fraction of a second (eight 1024 x 1024 products on
    (4096, 1024)) from a small request, fed like a decode step: output 0 is an I32 token."""
    buf = b.alloc_buffer(1024 * 1024 * 4, BufferPurpose.WEIGHTS)
    b.set_tensor(buf, 0, np.full(1024 * 1024, 1e-3, np.float32))
    g = GraphBuilder()
    w = g.weight(buf, 0, (1024, 1024), DType.F32)
    x = g.get_rows(w, g.input("rows", (T,), DType.I32))  # (T, 1024)
    for _ in range(8):
        x = g.matmul(x, w)
    tok = g.input("tok", (1,), DType.I32)
    return b.register_graph(g.build(tok, x)), {"rows": np.zeros(4096, np.int32)}


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_daemon_death_fails_every_outstanding_step(tmp_path, transport):
    host = start_host(tmp_path)
    try:
        remote = _remote(host, transport)
        gid, inputs = _slow(remote)
        first = remote.submit(gid, {**inputs, "tok": np.array([1], np.int32)})
        fed = [remote.submit(gid, inputs, feed={"tok": 0}) for _ in range(2)]
        host.proc.send_signal(signal.SIGKILL)
        host.proc.wait()
        with pytest.raises(HostGoneError, match="went away during Compute"):
            remote.synchronize()  # waits for the steps' replies, which never come
        for p in (fed[1], first, fed[0]):
            with pytest.raises(HostGoneError, match="went away during Compute"):
                p.result()
        with pytest.raises(BackendError, match="closed"):
            remote.compute(gid, {**inputs, "tok": np.array([1], np.int32)})
        remote.close()
    finally:
        host.stop()


class _AheadSession:
    """A host session in a thread whose executor runs ahead of the host (as on CUDA:
    ``result()`` waits for the device), and the guest's end of its channel. ``events``
    records each submit and each wait for a result, in order."""

    def __init__(self) -> None:
        import socket
        import threading

        from apir.backends.base import Pending
        from apir.host.session import Session, SessionConfig
        from apir.protocol.step import StepLayout
        from apir.transport import SocketChannel

        events: list[str] = []
        self.events = events

        class OnDevice(Pending):  # not ready until someone waits for it, like a queued GPU step
            def __init__(self, done: Pending, i: int) -> None:
                super().__init__()
                self.done, self.i = done, i

            def ready(self) -> bool:
                return False

            def result(self) -> list[np.ndarray]:
                events.append(f"result {self.i}")
                return self.done.result()

        class RunsAhead(LocalBackend):
            def _pending(self, reg, outputs, out=None):
                i = sum(e.startswith("submit") for e in events)
                events.append(f"submit {i}")
                return OnDevice(super()._pending(reg, outputs, out), i)

        backend = RunsAhead("cpu")
        session = Session(None, backend, None, SessionConfig("cpu", backend.limits, 0, 1, "test"))
        self.gid, _ = _decoder(backend)
        session.layouts[self.gid] = self.layout = StepLayout.of(backend._graphs[self.gid].graph)
        host_end, guest_end = socket.socketpair()
        session.chan, self.guest = SocketChannel(host_end), SocketChannel(guest_end)
        session.chan.spin_seconds = 0.2  # how long the host waits for the next step before replying
        self.server = threading.Thread(target=session.serve, daemon=True)
        self.server.start()

    def send(self, i: int, inputs: dict[str, np.ndarray], feed: tuple = ()) -> None:
        from apir.protocol import WANT_REPLY
        from apir.protocol import messages as m

        packed = self.layout.pack_inputs(inputs, tuple(k for k, _ in feed))
        n_tokens, payload = packed.n_tokens, packed.bytes()
        self.guest.send_frame(m.step_frame(i, WANT_REPLY, self.gid, n_tokens, -1, 0, payload, -1,
                                           len(payload), feed))

    def tokens(self, i: int, n_tokens: int = 1) -> list[int]:
        from apir.protocol import messages as m

        header, body, _ = self.guest.recv_frame()
        assert (header.opcode, header.request_id) == (m.DATA_OPCODE, i)
        return self.layout.unpack_outputs(bytearray(m.parse_data(body)[0]), n_tokens)[0].tolist()

    def close(self) -> None:
        from apir.protocol import messages as m

        self.guest.send(m.Goodbye())
        self.server.join(5)


def test_the_host_queues_the_next_step_before_it_replies():
    """A pipelining guest's step n+1 is read, and queued, before the host waits for step n
    and replies; the replies still come in request order with the unpipelined tokens."""
    reference = LocalBackend("cpu")
    want = _unpipelined(reference, _decoder(reference)[0], 3, 6)
    s = _AheadSession()
    tokens_at = s.layout.names.index("tokens")
    s.send(0, {"tokens": np.array([3], np.int32), **_pos(0)})
    got = []
    for i in range(1, 7):
        if i < 6:
            s.send(i, _pos(i), feed=((tokens_at, 0),))
        got.extend(s.tokens(i - 1))
    s.close()
    assert got == want
    # the host queued step i+1 before it waited for step i's outputs
    assert s.events == ["submit 0", "submit 1", "result 0", "submit 2", "result 1", "submit 3", "result 2",
                        "submit 4", "result 3", "submit 5", "result 4", "result 5"]


def test_a_prefill_sized_step_is_answered_before_the_next_is_read():
    """A step of more tokens than PIPELINED_MAX_TOKENS is waited for at once, as natively
    (polling a running GPU step slows it), even though the guest's next step is waiting."""
    from apir.host.session import PIPELINED_MAX_TOKENS

    n = PIPELINED_MAX_TOKENS + 4
    prompt = {"tokens": np.arange(n, dtype=np.int32) % VOCAB, "pos": np.arange(n, dtype=np.int32) % VOCAB}
    reference = LocalBackend("cpu")
    gid = _decoder(reference)[0]
    want = reference.compute(gid, prompt)[0].tolist()
    step = {"tokens": np.array([want[-1]], np.int32), **_pos(n)}
    s = _AheadSession()
    s.send(0, prompt)
    s.send(1, step)
    assert s.tokens(0, n) == want
    assert s.tokens(1) == reference.compute(gid, step)[0].tolist()
    s.close()
    assert s.events == ["submit 0", "result 0", "submit 1", "result 1"]


def test_a_fed_step_of_many_tokens_is_pipelined():
    """A fed step (a batch's decode tokens, one a sequence, each step fed from the last)
    has its guest's next step queued before its reply, however many tokens it has; the
    unfed step that starts the chain is answered first, as a prefill chunk is."""
    from apir.host.session import PIPELINED_MAX_TOKENS

    n, steps = PIPELINED_MAX_TOKENS + 8, 5
    reference = LocalBackend("cpu")
    gid = _decoder(reference)[0]
    tokens, want = np.arange(n, dtype=np.int32) % VOCAB, []
    for i in range(steps):
        tokens = reference.compute(gid, {"tokens": tokens, "pos": np.full(n, i, np.int32)})[0]
        want.append(tokens.tolist())
    s = _AheadSession()
    tokens_at = s.layout.names.index("tokens")
    s.send(0, {"tokens": np.arange(n, dtype=np.int32) % VOCAB, "pos": np.zeros(n, np.int32)})
    got = []
    for i in range(1, steps + 1):
        if i < steps:
            s.send(i, {"pos": np.full(n, i, np.int32)}, feed=((tokens_at, 0),))
        got.append(s.tokens(i - 1, n))
    s.close()
    assert got == want
    assert s.events == ["submit 0", "result 0", "submit 1", "submit 2", "result 1", "submit 3", "result 2",
                        "submit 4", "result 3", "result 4"]


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_synchronize_asks_the_host_only_after_a_request_without_a_reply(host, transport):
    with _remote(host, transport) as remote:
        gid, buf = _decoder(remote)
        sent = []
        send = remote.chan.send_frame
        remote.chan.send_frame = lambda frame, *fds: (sent.append(frame), send(frame, *fds))[1]
        pending = remote.submit(gid, {"tokens": np.array([1], np.int32), **_pos(0)})
        remote.synchronize()  # the step's reply says it is done: nothing more to ask
        assert len(sent) == 1 and pending.done
        remote.free_buffer(buf + 1000)  # posted: its failure can only come back in a reply
        with pytest.raises(BackendError, match=r"an earlier FreeBuffer failed: unknown buffer handle"):
            remote.synchronize()
        assert len(sent) == 3
        remote.synchronize()  # the failure was reported; nothing left in flight
        assert len(sent) == 3
        assert remote.ping() > 0 and len(sent) == 4  # a round trip all the same
        assert remote.compute(gid, {"tokens": np.array([2], np.int32), **_pos(1)})[0].shape == (1,)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_step_too_big_for_the_arena_and_a_message_says_what_to_do(host, transport):
    """Inputs of 80 MiB on a 4 MiB arena (or none, over TCP) cannot travel: a clear error
    before anything is sent, and the session goes on."""
    with _remote(host, transport, arena_size=4 << 20) as remote:
        g = GraphBuilder()
        x = g.input("x", (T, 1024))
        gid = remote.register_graph(g.build(g.scale(x, 2.0)))
        big = np.ones((20 * 1024, 1024), np.float32)  # 80 MiB in and out
        with pytest.raises(BackendError, match=r"this step's inputs are 80 MiB: more than a message carries "
                                               r"\(64 MiB\).*larger arena_size.*smaller batches"):
            remote.compute(gid, {"x": big})
        small = np.ones((2, 1024), np.float32)
        assert np.array_equal(remote.compute(gid, {"x": small})[0], 2 * small)
