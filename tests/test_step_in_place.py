"""A Step whose bytes lie in the shared arena: the host reads the float inputs where they
lie and writes the outputs straight into the reply's place (no host copy either way),
while the inputs it checks or branches on (I32 indices, sampling parameters) are private
copies that a guest changing the arena mid-step cannot touch."""

from __future__ import annotations

import numpy as np
import pytest

from apir.backends import BufferPurpose
from apir.backends.base import DEFAULT_EXECUTOR, ExecutorConfig
from apir.backends.local import LocalBackend
from apir.backends.local.pinned import MIN_PINNED
from apir.backends.numpy_ref import NumpyBackend
from apir.graph import DType, GraphBuilder, SampleArgs, T
from apir.graph.sampling import PARAMS_SIZE
from apir.host.session import Session, SessionConfig
from apir.protocol.step import StepLayout
from apir.transport import Arena

VOCAB, DIM, TOKENS = 64, 16, 40  # logits (40, 64) f32: 10 KB, over INLINE_MAX
IN_AT, OUT_AT = 1024, 64 << 10  # where the guest put the inputs and asked for the reply


def _graph(b) -> int:
    """x (T, DIM) f32 plus the embedding rows of ids (T,) i32, times the head: (T, VOCAB)
    logits, and a token sampled from each row under SampleArgs ``params``."""
    rng = np.random.default_rng(3)
    buf = b.alloc_buffer(2 * VOCAB * DIM * 4, BufferPurpose.WEIGHTS)
    b.set_tensor(buf, 0, rng.standard_normal(2 * VOCAB * DIM).astype(np.float32))
    g = GraphBuilder()
    x, ids = g.input("x", (T, DIM), DType.F32), g.input("ids", (T,), DType.I32)
    params = g.input("params", (PARAMS_SIZE,), DType.F32)
    emb = g.weight(buf, 0, (VOCAB, DIM), DType.F32)
    head = g.weight(buf, VOCAB * DIM * 4, (VOCAB, DIM), DType.F32)
    logits = g.matmul(g.add(x, g.get_rows(emb, ids)), head)
    return b.register_graph(g.build(logits, g.sample(logits, params)))


class Recording(LocalBackend):
    """Keeps what each submit was given; ``during`` runs between binding and running, as a
    guest writing the arena while the host computes would."""

    def __init__(self, device: str = "cpu", config: ExecutorConfig = DEFAULT_EXECUTOR) -> None:
        super().__init__(device, config=config)
        self.calls: list[tuple[dict, list | None]] = []
        self.during = lambda: None

    def submit(self, gid, inputs, feed=None, out=None):
        self.calls.append((dict(inputs), out))
        return super().submit(gid, inputs, feed, out)

    def _run(self, reg, inputs, bounds):
        self.during()
        return super()._run(reg, inputs, bounds)


def _inputs(tokens: int = TOKENS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"x": rng.standard_normal((tokens, DIM)).astype(np.float32),
            "ids": rng.integers(0, VOCAB, tokens).astype(np.int32),
            "params": SampleArgs(0.7, 0, 1.0, 0.0, 0.25).pack()}


def _host(backend: Recording, arena_bytes: int = 1 << 20):
    memory = np.zeros(arena_bytes, np.uint8)
    session = Session(None, backend, Arena(memoryview(memory)), SessionConfig("cpu", backend.limits, 0, 1, "test"))
    gid = _graph(backend)
    session.layouts[gid] = StepLayout.of(backend._graphs[gid].graph)
    return session, backend, memory, gid


@pytest.fixture
def host():
    return _host(Recording())


def _step(session, memory, gid, inputs, out_at: int = OUT_AT, capacity: int = 1 << 19):
    layout = session.layouts[gid]
    packed = layout.pack_inputs(inputs)
    packed.into(memoryview(memory)[IN_AT:IN_AT + packed.size])
    inflight = session._start_step(1, gid, packed.n_tokens, out_at, capacity, b"", IN_AT, packed.size, ())
    inline, at, size = inflight.finish()
    assert (inline, at) == (b"", out_at)
    return layout.unpack_outputs(memory[out_at:out_at + size].copy(), packed.n_tokens), packed


def test_floats_are_read_in_the_arena_and_outputs_written_into_their_place(host):
    session, backend, memory, gid = host
    inputs = _inputs()
    outs, _ = _step(session, memory, gid, inputs)
    given, out = backend.calls[-1]
    assert np.shares_memory(given["x"], memory)
    assert not np.shares_memory(given["ids"], memory)
    assert not np.shares_memory(given["params"], memory)
    assert out is not None and np.shares_memory(out[0], memory)
    with NumpyBackend() as ref:  # the reply equals the reference executor's outputs
        want = ref.compute(_graph(ref), inputs)
    np.testing.assert_allclose(outs[0], want[0], rtol=1e-5, atol=1e-5)
    assert outs[1].tolist() == backend.compute(gid, inputs)[1].tolist()


def test_a_guest_changing_the_arena_mid_step_cannot_move_an_index_out_of_range(host):
    """The ids are checked and then used as the same private bytes: writing 10**6 over
    them in the arena while the step runs changes nothing; the floats, read in place, are
    the guest's own to spoil (its logits change, nothing else does)."""
    session, backend, memory, gid = host
    inputs = _inputs()
    clean, packed = _step(session, memory, gid, inputs)
    (ids_at, _), (x_at, _) = (packed.place.places[session.layouts[gid].sent(()).names.index(n)]
                               for n in ("ids", "x"))

    def guest_writes() -> None:
        memory[IN_AT + ids_at:IN_AT + ids_at + 4 * TOKENS].view(np.int32)[:] = 10**6
        memory[IN_AT + x_at:IN_AT + x_at + 4 * DIM].view(np.float32)[:] = 1e3

    backend.during = guest_writes
    layout = session.layouts[gid]
    packed.into(memoryview(memory)[IN_AT:IN_AT + packed.size])
    inline, at, size = session._start_step(2, gid, TOKENS, OUT_AT, 1 << 19, b"", IN_AT, packed.size, ()).finish()
    spoiled = layout.unpack_outputs(memory[OUT_AT:OUT_AT + size].copy(), TOKENS)
    np.testing.assert_array_equal(spoiled[0][1:], clean[0][1:])  # rows 1.. read the checked ids
    assert not np.allclose(spoiled[0][0], clean[0][0])  # row 0's x was the guest's to change


def test_a_reply_range_over_the_steps_inputs_is_written_after_the_run(host):
    session, backend, memory, gid = host
    inputs = _inputs()
    layout = session.layouts[gid]
    packed = layout.pack_inputs(inputs)
    packed.into(memoryview(memory)[IN_AT:IN_AT + packed.size])
    inline, at, size = session._start_step(3, gid, TOKENS, IN_AT, 1 << 19, b"", IN_AT, packed.size, ()).finish()
    assert backend.calls[-1][1] is None  # no views handed out over its own inputs
    got = layout.unpack_outputs(memory[IN_AT:IN_AT + size].copy(), TOKENS)
    np.testing.assert_array_equal(got[0], backend.compute(gid, inputs)[0])


@pytest.mark.gpu
def test_on_cuda_the_arena_is_registered_as_far_as_steps_reach_and_outputs_match():
    """Inputs at the bottom, 1.5 MiB of logits (past the small outputs' pinned copies) asked
    for above MIN_PINNED: the registered prefix grows to the next power of two over them,
    and the reply, copied by DMA straight into the arena, equals compute's."""
    session, backend, memory, gid = _host(Recording("cuda", ExecutorConfig(cuda_graphs=False)), 4 * MIN_PINNED)
    tokens = 6144  # logits (6144, 64) f32: 1.5 MiB
    inputs = _inputs(tokens)
    outs, _ = _step(session, memory, gid, inputs, out_at=MIN_PINNED + 4096, capacity=2 * MIN_PINNED)
    assert np.shares_memory(backend.calls[-1][1][0], memory)
    assert backend._pinned is not None and not backend._pinned.failed
    assert backend._pinned.pinned == 2 * MIN_PINNED
    np.testing.assert_allclose(outs[0], backend.compute(gid, inputs)[0], rtol=1e-5, atol=1e-5)
    backend.close()
    assert backend._pinned.pinned == 0


def test_arena_bytes_are_split_where_the_registered_prefix_ends():
    """CUDA refuses a copy from a host range registered only in part: ``split`` cuts such
    a range at the prefix's end, and leaves ranges wholly on one side whole."""
    from apir.backends.local.pinned import PinnedPrefix

    memory = np.zeros(4 * MIN_PINNED, np.uint8)
    prefix = PinnedPrefix(memoryview(memory), None)
    assert prefix.split(memory[10:100])[0][1].nbytes == 90  # nothing registered yet
    prefix.pinned = MIN_PINNED  # as cover() leaves it
    runs = prefix.split(memory[MIN_PINNED - 64 : MIN_PINNED + 100])
    assert [(at, part.nbytes) for at, part in runs] == [(0, 64), (64, 100)]
    assert runs[1][1].ctypes.data - memory.ctypes.data == MIN_PINNED
    for inside_or_beyond in (memory[:MIN_PINNED], memory[MIN_PINNED : MIN_PINNED + 8], np.zeros(8, np.uint8)):
        assert [(at, part.nbytes) for at, part in prefix.split(inside_or_beyond)] == [(0, inside_or_beyond.nbytes)]


@pytest.mark.gpu
def test_on_cuda_an_upload_across_the_registered_prefix_lands_whole():
    """After a step registered the arena's first MIN_PINNED bytes, a weight upload whose
    bytes lie across that end (a SetTensor's piece where the ring had reached) is written
    in full; as one copy CUDA would refuse it (an AcceleratorError, the session lost)."""
    session, backend, memory, gid = _host(Recording("cuda", ExecutorConfig(cuda_graphs=False)), 4 * MIN_PINNED)
    _step(session, memory, gid, _inputs(6144), out_at=1 << 20, capacity=2 << 20)  # 1.5 MiB of logits
    assert backend._pinned.pinned == MIN_PINNED
    handle = backend.alloc_buffer(1 << 20)
    data = np.arange(1 << 20, dtype=np.uint32).astype(np.uint8)
    at = MIN_PINNED - 1000
    memory[at : at + data.nbytes] = data
    backend.set_tensor(handle, 0, memory[at : at + data.nbytes])
    assert backend.get_tensor(handle, 0, data.nbytes) == data.tobytes()
    backend.close()
